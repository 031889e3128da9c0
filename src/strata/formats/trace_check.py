"""What a valid routing trace is: the checks of `strata.formats.trace.Trace` and `load_trace`.

Legend as in `strata.formats.trace`: N tokens, L layers, K experts per token, E experts per
layer, S steps, R requests. Each check raises `TraceError` naming the field, the first offending
entry and what is wrong, and returns the field as the trace keeps it (dtype fixed, read-only).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

PROMPT, DECODE = 0, 1
ID_DTYPES = (np.int16, np.int32)


class TraceError(ValueError):
    """A trace that breaks the format: the message names the file (if any) and the problem."""


def frozen(array: np.ndarray) -> np.ndarray:
    """`array` C-contiguous and read-only (a read-only view when it was writeable)."""
    array = np.ascontiguousarray(array)
    if array.flags.writeable:
        array = array.view()
        array.flags.writeable = False
    return array


def check_n_experts(n_experts: Any) -> int:
    """E as an int in [1, 2**31)."""
    if isinstance(n_experts, bool) or not isinstance(n_experts, int | np.integer):
        raise TraceError(f"n_experts must be an int, got {n_experts!r}")
    n_experts = int(n_experts)
    if not 1 <= n_experts <= np.iinfo(np.int32).max:
        raise TraceError(f"n_experts must be >= 1, got {n_experts}")
    return n_experts


def check_expert_ids(expert_ids: Any, n_experts: int) -> np.ndarray:
    """int32 [N, L, K], read-only: ids in [0, E), distinct within a token's K."""
    ids = np.asarray(expert_ids)
    if ids.dtype.kind not in "iu":
        raise TraceError(f"expert_ids must be integers, got dtype {ids.dtype}")
    if ids.ndim != 3 or 0 in ids.shape:
        raise TraceError(f"expert_ids must be [N, L, K] with N, L, K >= 1, got {ids.shape}")
    top_k = ids.shape[2]
    if top_k > n_experts:
        raise TraceError(f"top_k {top_k} (expert_ids.shape[2]) exceeds n_experts {n_experts}")
    bad = (ids < 0) | (ids >= n_experts)
    if bad.any():
        t, layer, k = (int(v) for v in np.argwhere(bad)[0])
        raise TraceError(
            f"expert_ids[{t}, {layer}, {k}] = {int(ids[t, layer, k])} is outside "
            f"[0, {n_experts}) (n_experts)"
        )
    ids = ids.astype(np.int32, copy=False)
    if top_k > 1:
        ordered = np.sort(ids, axis=2)
        twice = np.argwhere(ordered[:, :, 1:] == ordered[:, :, :-1])
        if twice.size:
            t, layer, _ = (int(v) for v in twice[0])
            raise TraceError(
                f"token {t} is routed to one expert twice at layer {layer}: "
                f"{ids[t, layer].tolist()} (top-k ids are distinct)"
            )
    return frozen(ids)


def int64_offsets(name: str, values: Any) -> np.ndarray:
    """`values` as read-only int64 (checked by `check_offsets` once both offsets are)."""
    offsets = np.asarray(values)
    if offsets.dtype.kind not in "iu":
        raise TraceError(f"{name} must be integers, got dtype {offsets.dtype}")
    return frozen(offsets.astype(np.int64, copy=False))


def check_offsets(name: str, offsets: np.ndarray, end: int, unit: str) -> None:
    """offsets int64 [n + 1]: 0, strictly increasing, ending at `end` (the `unit`)."""
    if offsets.ndim != 1 or offsets.size < 2:
        raise TraceError(f"{name} must be int64 [n + 1] with n >= 1, got shape {offsets.shape}")
    if offsets[0] != 0 or offsets[-1] != end:
        raise TraceError(
            f"{name} must start at 0 and end at {end} (the {unit}), got "
            f"{int(offsets[0])} .. {int(offsets[-1])}"
        )
    empty = np.flatnonzero(np.diff(offsets) <= 0)
    if empty.size:
        i = int(empty[0])
        raise TraceError(
            f"{name} must increase strictly (no empty entry): {name}[{i}] = {int(offsets[i])}, "
            f"{name}[{i + 1}] = {int(offsets[i + 1])}"
        )


def check_step_phase(step_phase: Any, request_offsets: np.ndarray) -> np.ndarray:
    """uint8 [S], read-only: PROMPT or DECODE, a request's prompt steps first."""
    n_steps = int(request_offsets[-1])
    phase = np.asarray(step_phase)
    if phase.dtype.kind not in "iu" or phase.shape != (n_steps,):
        raise TraceError(
            f"step_phase must be integers [S] = [{n_steps}], got {phase.dtype} {phase.shape}"
        )
    bad = np.flatnonzero((phase != PROMPT) & (phase != DECODE))
    if bad.size:
        raise TraceError(
            f"step_phase[{int(bad[0])}] = {int(phase[bad[0]])}; want 0 (prompt) or 1 (decode)"
        )
    phase = phase.astype(np.uint8)
    # A prompt step right after a decode step must begin a new request.
    back = np.flatnonzero((phase[1:] == PROMPT) & (phase[:-1] == DECODE)) + 1
    starts = np.zeros(n_steps, bool)
    starts[request_offsets[:-1]] = True
    back = back[~starts[back]]
    if back.size:
        s = int(back[0])
        r = int(np.searchsorted(request_offsets, s, side="right") - 1)
        raise TraceError(
            f"step {s} is a prompt step after a decode step of the same request {r}; "
            "a request's prompt steps come first"
        )
    return frozen(phase)


def check_router_weights(router_weights: Any, shape: tuple[int, ...]) -> np.ndarray | None:
    """None, or float32 of expert_ids' `shape`, read-only: finite, >= 0."""
    if router_weights is None:
        return None
    weights = np.asarray(router_weights)
    if weights.dtype.kind != "f" or weights.shape != shape:
        raise TraceError(
            f"router_weights must be floats of expert_ids' shape {shape}, got "
            f"{weights.dtype} {weights.shape}"
        )
    weights = weights.astype(np.float32, copy=False)
    bad = ~np.isfinite(weights) | (weights < 0)
    if bad.any():
        t, layer, k = (int(v) for v in np.argwhere(bad)[0])
        raise TraceError(
            f"router_weights[{t}, {layer}, {k}] = {float(weights[t, layer, k])}; "
            "want a finite weight >= 0"
        )
    return frozen(weights)


def check_meta(meta: Any) -> dict[str, Any]:
    """A JSON-ready mapping, as the dict JSON gives back (keys sorted)."""
    if not isinstance(meta, Mapping):
        raise TraceError(f"meta must be a mapping, got {type(meta).__name__}")
    try:
        text = json.dumps(dict(meta), sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise TraceError(f"meta must be JSON-ready: {exc}") from None
    return json.loads(text)


def check_stored_dtypes(path: str, data: Mapping[str, np.ndarray]) -> None:
    """The arrays of a trace file at `path`, each of a dtype the format allows (the values are
    checked when the `Trace` is made)."""
    ids = data["expert_ids"]
    if ids.dtype not in ID_DTYPES:
        raise TraceError(f"{path}: expert_ids must be int16 or int32, got {ids.dtype}")
    for name in ("step_offsets", "request_offsets"):
        if data[name].dtype != np.int64:
            raise TraceError(f"{path}: {name} must be int64, got {data[name].dtype}")
    if data["step_phase"].dtype != np.uint8:
        raise TraceError(f"{path}: step_phase must be uint8, got {data['step_phase'].dtype}")
    weights = data.get("router_weights")
    if weights is not None and weights.dtype not in (np.float16, np.float32):
        raise TraceError(f"{path}: router_weights must be float16 or float32, got "
                         f"{weights.dtype}")
