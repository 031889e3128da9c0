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
(docs/sim/trace-format.md); `load_trace` checks every shape and range and names what is wrong.
`TraceWriter` builds one step by step, as the engine will while it runs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from strata.formats.npz import npz_scalar, read_npz, write_npz

FORMAT = "strata-routing-trace"
VERSION = 1
PROMPT, DECODE = 0, 1
PHASES = {"prompt": PROMPT, "decode": DECODE}

# Stored fields, in file order; router_weights is optional.
_FIELDS = (
    "format", "version", "n_experts", "expert_ids", "step_offsets", "step_phase",
    "request_offsets", "meta",
)
_ID_DTYPES = (np.int16, np.int32)
_MAX_IDS_DTYPE_INT16 = np.iinfo(np.int16).max


class TraceError(ValueError):
    """A trace that breaks the format: the message names the file (if any) and the problem."""


def _frozen(array: np.ndarray) -> np.ndarray:
    array = np.ascontiguousarray(array)
    if array.flags.writeable:
        array = array.view()
        array.flags.writeable = False
    return array


def _check_offsets(name: str, offsets: np.ndarray, end: int, unit: str) -> None:
    """offsets int64 [n+1]: 0, strictly increasing, ending at `end`."""
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


@dataclass(frozen=True, eq=False)
class Trace:
    """A checked routing trace; its arrays are read-only.

    Attributes:
        n_experts: E, routed experts per layer.
        expert_ids: int32 [N, L, K], the experts each token was routed to at each layer,
            distinct within a token's K.
        step_offsets: int64 [S + 1], token ranges of the steps.
        step_phase: uint8 [S], PROMPT (0) or DECODE (1).
        request_offsets: int64 [R + 1], step ranges of the requests; in each request the
            prompt steps come before the decode steps.
        router_weights: float32 [N, L, K] (finite, >= 0) or None.
        meta: JSON-ready dict: where the trace came from (a synthetic spec, a model), and the
            model's geometry if known (`slot_bytes`, `kv_segment_cell_bytes`, `kv_segments`).

    Raises:
        TraceError: any array of the wrong dtype, shape or range, with what is wrong.
    """

    n_experts: int
    expert_ids: np.ndarray
    step_offsets: np.ndarray
    step_phase: np.ndarray
    request_offsets: np.ndarray
    router_weights: np.ndarray | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.n_experts, bool) or not isinstance(self.n_experts, int | np.integer):
            raise TraceError(f"n_experts must be an int, got {self.n_experts!r}")
        n_experts = int(self.n_experts)
        if not 1 <= n_experts <= np.iinfo(np.int32).max:
            raise TraceError(f"n_experts must be >= 1, got {n_experts}")
        object.__setattr__(self, "n_experts", n_experts)
        ids = np.asarray(self.expert_ids)
        if ids.dtype.kind not in "iu":
            raise TraceError(f"expert_ids must be integers, got dtype {ids.dtype}")
        if ids.ndim != 3 or 0 in ids.shape:
            raise TraceError(f"expert_ids must be [N, L, K] with N, L, K >= 1, got {ids.shape}")
        n_tokens, _, top_k = ids.shape
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
        object.__setattr__(self, "expert_ids", _frozen(ids))

        for name in ("step_offsets", "request_offsets"):
            offsets = np.asarray(getattr(self, name))
            if offsets.dtype.kind not in "iu":
                raise TraceError(f"{name} must be integers, got dtype {offsets.dtype}")
            object.__setattr__(self, name, _frozen(offsets.astype(np.int64, copy=False)))
        _check_offsets("step_offsets", self.step_offsets, n_tokens, "tokens")
        n_steps = self.step_offsets.size - 1
        _check_offsets("request_offsets", self.request_offsets, n_steps, "steps")

        phase = np.asarray(self.step_phase)
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
        starts[self.request_offsets[:-1]] = True
        back = back[~starts[back]]
        if back.size:
            s = int(back[0])
            r = int(np.searchsorted(self.request_offsets, s, side="right") - 1)
            raise TraceError(
                f"step {s} is a prompt step after a decode step of the same request {r}; "
                "a request's prompt steps come first"
            )
        object.__setattr__(self, "step_phase", _frozen(phase))

        if self.router_weights is not None:
            weights = np.asarray(self.router_weights)
            if weights.dtype.kind != "f" or weights.shape != ids.shape:
                raise TraceError(
                    f"router_weights must be floats of expert_ids' shape {ids.shape}, got "
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
            object.__setattr__(self, "router_weights", _frozen(weights))

        if not isinstance(self.meta, Mapping):
            raise TraceError(f"meta must be a mapping, got {type(self.meta).__name__}")
        try:
            text = json.dumps(dict(self.meta), sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise TraceError(f"meta must be JSON-ready: {exc}") from None
        object.__setattr__(self, "meta", json.loads(text))

    # --- shape ---
    @property
    def n_layers(self) -> int:
        return int(self.expert_ids.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.expert_ids.shape[2])

    @property
    def n_tokens(self) -> int:
        return int(self.expert_ids.shape[0])

    @property
    def n_steps(self) -> int:
        return int(self.step_offsets.size - 1)

    @property
    def n_requests(self) -> int:
        return int(self.request_offsets.size - 1)

    @property
    def n_accesses(self) -> int:
        """Routed (token, layer, expert) lookups: N * L * K."""
        return int(self.expert_ids.size)

    @property
    def step_tokens(self) -> np.ndarray:
        """int64 [S]: tokens per step."""
        return np.diff(self.step_offsets)

    @property
    def request_tokens(self) -> np.ndarray:
        """int64 [R]: tokens per request (prompt + decoded): the K/V cells it reaches."""
        return self.step_offsets[self.request_offsets[1:]] - self.step_offsets[
            self.request_offsets[:-1]
        ]

    def routing_counts(self) -> np.ndarray:
        """int64 [L, E]: how often each expert was routed to, over the whole trace."""
        flat = self.expert_ids + (np.arange(self.n_layers, dtype=np.int32) * self.n_experts)[
            None, :, None
        ]
        counts = np.bincount(flat.reshape(-1), minlength=self.n_layers * self.n_experts)
        return counts.reshape(self.n_layers, self.n_experts)

    def summary(self) -> dict[str, Any]:
        """The trace's figures, JSON-ready."""
        phase = self.step_phase
        tokens = self.step_tokens
        return {
            "format": FORMAT,
            "version": VERSION,
            "n_layers": self.n_layers,
            "n_experts": self.n_experts,
            "top_k": self.top_k,
            "requests": self.n_requests,
            "steps": self.n_steps,
            "prompt_tokens": int(tokens[phase == PROMPT].sum()),
            "decode_tokens": int(tokens[phase == DECODE].sum()),
            "accesses": self.n_accesses,
            "router_weights": self.router_weights is not None,
            "meta": dict(self.meta),
        }


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
    data = read_npz(path, fmt=FORMAT, short="trace", long="routing trace", error=TraceError)
    missing = [name for name in _FIELDS if name not in data]
    if missing:
        raise TraceError(f"{path}: the fields {missing} are missing")
    version = _scalar(path, data, "version", "iu")
    if version != VERSION:
        raise TraceError(f"{path} has trace format version {version}; this strata reads "
                         f"version {VERSION}")
    ids = data["expert_ids"]
    if ids.dtype not in _ID_DTYPES:
        raise TraceError(f"{path}: expert_ids must be int16 or int32, got {ids.dtype}")
    for name in ("step_offsets", "request_offsets"):
        if data[name].dtype != np.int64:
            raise TraceError(f"{path}: {name} must be int64, got {data[name].dtype}")
    if data["step_phase"].dtype != np.uint8:
        raise TraceError(f"{path}: step_phase must be uint8, got {data['step_phase'].dtype}")
    try:
        meta = json.loads(_scalar(path, data, "meta", "U"))
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path}: meta is not JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise TraceError(f"{path}: meta must be a JSON object, got {type(meta).__name__}")
    weights = data.get("router_weights")
    if weights is not None and weights.dtype not in (np.float16, np.float32):
        raise TraceError(f"{path}: router_weights must be float16 or float32, got "
                         f"{weights.dtype}")
    try:
        return Trace(
            n_experts=_scalar(path, data, "n_experts", "iu"),
            expert_ids=ids,
            step_offsets=data["step_offsets"],
            step_phase=data["step_phase"],
            request_offsets=data["request_offsets"],
            router_weights=weights,
            meta=meta,
        )
    except TraceError as exc:
        raise TraceError(f"{path}: {exc}") from None


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
