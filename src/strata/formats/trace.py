"""Routing traces: which experts each token was routed to, per layer, request by request.

Legend of dimension letters:
    N  tokens of the whole trace, in the order they were processed
    L  MoE layers
    K  experts routed per token (top-k)
    E  routed experts per layer (ids are in [0, E))
    S  steps: one forward pass of one request (a prompt chunk, or one decoded token)
    R  requests: a prompt, then its decoded tokens

A trace is steps of tokens: step s covers tokens [step_offsets[s], step_offsets[s+1]) and has a
phase (prompt or decode); request r covers steps [request_offsets[r], request_offsets[r+1]),
its prompt steps first. Stored as an `.npz` of format `strata-routing-trace`, version 1
(docs/sim/reference.md); `load_trace` checks every shape and range and names what is wrong.
`TraceWriter` builds one step by step, as the engine will while it runs.

Every public name is importable from here; the checks of a valid trace live in
`strata.formats.trace_check` and the `Trace` class in `strata.formats.trace_data`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from strata.formats.npz import Member, npz_scalar, read_npz, write_npz
from strata.formats.trace_check import DECODE, PROMPT, TraceError, check_stored_dtypes
from strata.formats.trace_data import FORMAT, PHASES, VERSION, Trace

__all__ = [
    "DECODE",
    "FORMAT",
    "PHASES",
    "PROMPT",
    "VERSION",
    "Trace",
    "TraceError",
    "TraceWriter",
    "concat_steps",
    "load_trace",
    "save_trace",
]

# Stored fields, in file order; router_weights is optional.
_FIELDS = (
    "format", "version", "n_experts", "expert_ids", "step_offsets", "step_phase",
    "request_offsets", "meta",
)
_MAX_IDS_DTYPE_INT16 = np.iinfo(np.int16).max


def save_trace(trace: Trace, path: str | os.PathLike[str]) -> None:
    """Write `trace` to an `.npz` at `path` (exactly that name, replaced atomically).

    The same trace always gives the same bytes: a stored zip with fixed timestamps. Expert ids
    are stored as int16 when E fits, else int32.
    """
    ids_dtype = np.int16 if trace.n_experts - 1 <= _MAX_IDS_DTYPE_INT16 else np.int32
    arrays = {
        "format": np.array(FORMAT),
        "version": np.array(VERSION, dtype=np.int64),
        "n_experts": np.array(trace.n_experts, dtype=np.int64),
        "expert_ids": trace.expert_ids.astype(ids_dtype),
        "step_offsets": trace.step_offsets,
        "step_phase": trace.step_phase,
        "request_offsets": trace.request_offsets,
        "meta": np.array(json.dumps(trace.meta, sort_keys=True)),
    }
    if trace.router_weights is not None:
        arrays["router_weights"] = trace.router_weights
    write_npz(path, arrays)


def _scalar(path: str, data: Mapping[str, np.ndarray], name: str, kind: str) -> Any:
    return npz_scalar(path, data, name, kind, TraceError)


def load_trace(path: str | os.PathLike[str]) -> Trace:
    """Read and check a trace written by `save_trace` (or `TraceWriter.save`).

    Raises:
        FileNotFoundError: no file at `path`.
        TraceError: not a readable `.npz`, another format or version, a missing field, or an
            array of the wrong dtype, shape or range; the message names the path and the
            problem.
    """
    path = os.fspath(path)
    data = read_npz(path, fmt=FORMAT, short="trace", long="routing trace", error=TraceError,
                    fields=(*_FIELDS, "router_weights"), check=lambda m: _check_shapes(path, m))
    missing = [name for name in _FIELDS if name not in data]
    if missing:
        raise TraceError(f"{path}: the fields {missing} are missing")
    version = _scalar(path, data, "version", "iu")
    if version != VERSION:
        raise TraceError(f"{path} has trace format version {version}; this strata reads "
                         f"version {VERSION}")
    check_stored_dtypes(path, data)
    try:
        meta = json.loads(_scalar(path, data, "meta", "U"))
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path}: meta is not JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise TraceError(f"{path}: meta must be a JSON object, got {type(meta).__name__}")
    try:
        return Trace(
            n_experts=_scalar(path, data, "n_experts", "iu"),
            expert_ids=data["expert_ids"],
            step_offsets=data["step_offsets"],
            step_phase=data["step_phase"],
            request_offsets=data["request_offsets"],
            router_weights=data.get("router_weights"),
            meta=meta,
        )
    except TraceError as exc:
        raise TraceError(f"{path}: {exc}") from None


def _check_shapes(path: str, members: Mapping[str, Member]) -> None:
    """The shapes of a trace's arrays, from their headers, before any is read: every array is
    no larger than expert_ids [N, L, K] makes it (S <= N steps, R <= S requests)."""
    dims = {"expert_ids": "[N, L, K]", "router_weights": "[N, L, K]",
            "step_offsets": "[S + 1]", "step_phase": "[S]", "request_offsets": "[R + 1]"}
    for name, member in members.items():
        if len(member.shape) != dims.get(name, "").count(",") + (name in dims):
            raise TraceError(f"{path}: {name} must be {dims.get(name, 'a scalar')}, got shape "
                             f"{list(member.shape)}")
    if "expert_ids" not in members:
        return
    ids = members["expert_ids"].shape
    weights = members.get("router_weights")
    if weights is not None and weights.shape != ids:
        raise TraceError(f"{path}: router_weights must be of expert_ids' shape {list(ids)}, "
                         f"got {list(weights.shape)}")
    for name in ("step_offsets", "step_phase", "request_offsets"):
        if name in members and members[name].shape[0] > ids[0] + 1:
            raise TraceError(f"{path}: {name} has {members[name].shape[0]:,} entries, more than "
                             f"the {ids[0]:,} tokens of expert_ids allow (each step holds one "
                             "token or more)")


def _phase_code(phase: str | int) -> int:
    if isinstance(phase, str) and phase in PHASES:
        return PHASES[phase]
    if phase in (PROMPT, DECODE) and not isinstance(phase, bool):
        return int(phase)
    raise ValueError(f"phase must be 'prompt' or 'decode', got {phase!r}")


class TraceWriter:
    """Builds a trace as the engine runs: requests of steps, each step's routing per layer.

    Usage, per request::

        writer.begin_request()
        for each forward pass:                      # a prompt chunk, or one decoded token
            writer.begin_step("prompt" | "decode")
            for layer in range(n_layers):
                writer.record(layer, topk_ids)      # int [T, K], T tokens of this step
            writer.end_step()
        writer.end_request()
        trace = writer.finish()   # or writer.save(path)

    Every call checks its arguments before it changes anything; a bad one is a ValueError
    naming it and the writer is as it was.
    """

    def __init__(
        self, n_layers: int, n_experts: int, top_k: int, *, router_weights: bool = False,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        for name, value in (("n_layers", n_layers), ("n_experts", n_experts), ("top_k", top_k)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if top_k > n_experts:
            raise ValueError(f"top_k {top_k} exceeds n_experts {n_experts}")
        self.n_layers, self.n_experts, self.top_k = n_layers, n_experts, top_k
        self.router_weights = router_weights
        self.meta = dict(meta or {})
        self._ids: list[np.ndarray] = []  # per step: int32 [T, L, K]
        self._weights: list[np.ndarray] = []
        self._step_tokens: list[int] = []
        self._phases: list[int] = []
        self._request_steps: list[int] = []  # steps per finished request
        self._in_request = False
        self._request_first_step = 0
        self._step: list[np.ndarray | None] | None = None  # this step's [T, K] per layer
        self._step_weights: list[np.ndarray | None] = []
        self._step_phase = PROMPT

    def begin_request(self) -> None:
        if self._in_request:
            raise ValueError("begin_request: the previous request was not ended (end_request)")
        self._in_request = True
        self._request_first_step = len(self._step_tokens)

    def begin_step(self, phase: str | int) -> None:
        """Open a step of `phase` ('prompt' or 'decode'); prompt steps come first."""
        code = _phase_code(phase)
        if not self._in_request:
            raise ValueError("begin_step: no request is open (begin_request)")
        if self._step is not None:
            raise ValueError("begin_step: the previous step was not ended (end_step)")
        in_request = self._phases[self._request_first_step:]
        if code == PROMPT and in_request and in_request[-1] == DECODE:
            raise ValueError("begin_step: a prompt step cannot follow a decode step in a request")
        self._step = [None] * self.n_layers
        self._step_weights = [None] * self.n_layers
        self._step_phase = code

    def record(self, layer: int, expert_ids: Any, weights: Any = None) -> None:
        """This step's routing at `layer`: ids int [T, K] (distinct per token, in [0, E)),
        and router weights [T, K] when the writer keeps them."""
        if self._step is None:
            raise ValueError("record: no step is open (begin_step)")
        if isinstance(layer, bool) or not isinstance(layer, int | np.integer):
            raise ValueError(f"layer must be an int, got {layer!r}")
        if not 0 <= layer < self.n_layers:
            raise ValueError(f"layer {layer} is outside [0, {self.n_layers})")
        if self._step[layer] is not None:
            raise ValueError(f"layer {layer} was already recorded in this step")
        ids = np.array(expert_ids)
        if ids.dtype.kind not in "iu" or ids.ndim != 2 or ids.shape[1] != self.top_k \
                or ids.shape[0] < 1:
            raise ValueError(f"expert_ids must be int [T, {self.top_k}] with T >= 1, got "
                             f"{ids.dtype} {ids.shape}")
        tokens = next((a.shape[0] for a in self._step if a is not None), ids.shape[0])
        if ids.shape[0] != tokens:
            raise ValueError(f"layer {layer} has {ids.shape[0]} tokens, other layers of this "
                             f"step {tokens}")
        if ((ids < 0) | (ids >= self.n_experts)).any():
            raise ValueError(f"expert ids {ids.tolist()} go outside [0, {self.n_experts})")
        if self.top_k > 1 and (np.diff(np.sort(ids, axis=1), axis=1) == 0).any():
            raise ValueError(f"a token is routed to one expert twice: {ids.tolist()}")
        if self.router_weights:
            if weights is None:
                raise ValueError("this writer keeps router weights: pass weights [T, K]")
            w = np.array(weights, dtype=np.float32)
            if w.shape != ids.shape or not np.isfinite(w).all() or (w < 0).any():
                raise ValueError(f"weights must be finite floats >= 0 of shape {ids.shape}")
            self._step_weights[layer] = w
        elif weights is not None:
            raise ValueError("weights given, but the writer was made with router_weights=False")
        self._step[layer] = ids.astype(np.int32)

    def end_step(self) -> None:
        if self._step is None:
            raise ValueError("end_step: no step is open (begin_step)")
        missing = [i for i, a in enumerate(self._step) if a is None]
        if missing:
            raise ValueError(f"end_step: layers {missing} were not recorded in this step")
        self._ids.append(np.stack(self._step, axis=1))  # [T, L, K]
        if self.router_weights:
            self._weights.append(np.stack(self._step_weights, axis=1))
        self._step_tokens.append(self._step[0].shape[0])
        self._phases.append(self._step_phase)
        self._step = None

    def add_step(self, phase: str | int, expert_ids: Any, weights: Any = None) -> None:
        """A whole step at once: ids int [T, L, K] (and weights [T, L, K])."""
        ids = np.asarray(expert_ids)
        if ids.ndim != 3 or ids.shape[1] != self.n_layers:
            raise ValueError(f"expert_ids must be [T, {self.n_layers}, K], got {ids.shape}")
        self.begin_step(phase)
        try:
            for layer in range(self.n_layers):
                w = None if weights is None else np.asarray(weights)[:, layer]
                self.record(layer, ids[:, layer], w)
        except ValueError:
            self._step = None
            raise
        self.end_step()

    def end_request(self) -> None:
        if not self._in_request:
            raise ValueError("end_request: no request is open")
        if self._step is not None:
            raise ValueError("end_request: a step is still open (end_step)")
        n_steps = len(self._step_tokens) - self._request_first_step
        if n_steps == 0:
            raise ValueError("end_request: the request has no steps")
        self._request_steps.append(n_steps)
        self._in_request = False

    def finish(self) -> Trace:
        """The trace of every ended request."""
        if self._in_request:
            raise ValueError("finish: a request is still open (end_request)")
        if not self._request_steps:
            raise ValueError("finish: no request was recorded")
        return Trace(
            n_experts=self.n_experts,
            expert_ids=np.concatenate(self._ids),
            step_offsets=np.concatenate([[0], np.cumsum(self._step_tokens)]).astype(np.int64),
            step_phase=np.array(self._phases, dtype=np.uint8),
            request_offsets=np.concatenate([[0], np.cumsum(self._request_steps)]).astype(
                np.int64),
            router_weights=np.concatenate(self._weights) if self.router_weights else None,
            meta=self.meta,
        )

    def save(self, path: str | os.PathLike[str]) -> Trace:
        trace = self.finish()
        save_trace(trace, path)
        return trace


def concat_steps(steps: Sequence[tuple[int, np.ndarray]], n_experts: int,
                 request_steps: Sequence[int], meta: Mapping[str, Any] | None = None) -> Trace:
    """A trace from (phase, ids [T, L, K]) steps and the number of steps of each request."""
    return Trace(
        n_experts=n_experts,
        expert_ids=np.concatenate([ids for _, ids in steps]),
        step_offsets=np.concatenate([[0], np.cumsum([ids.shape[0] for _, ids in steps])]).astype(
            np.int64),
        step_phase=np.array([phase for phase, _ in steps], dtype=np.uint8),
        request_offsets=np.concatenate([[0], np.cumsum(request_steps)]).astype(np.int64),
        meta=meta or {},
    )
