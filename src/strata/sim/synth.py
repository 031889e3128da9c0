"""Synthetic routing traces: uniform, Zipf, and Zipf with Markov correlation between tokens.

Legend: N tokens, L layers, E experts per layer, K experts per token, R requests.

Each layer has its own popularity: under `zipf` and `markov` the expert of popularity rank r
(0 = most popular) is drawn with weight 1 / (r + 1) ** s, and which expert holds which rank is a
permutation per layer drawn from `popularity_seed`. A token's K experts are drawn without
replacement (the Gumbel top-k trick), so they are distinct, as a router's are. Under `markov`,
each of a token's K experts repeats, with probability `markov_p`, one of the previous token's
experts at that layer (within a request), and is otherwise drawn fresh. Two traces with the same
`popularity_seed` and different `seed`s are two samples of one workload: one can be the other's
calibration profile.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from strata.formats.trace import DECODE, PROMPT, Trace

KINDS = ("uniform", "zipf", "markov")

# The geometry recorded in a synthetic trace's meta, for `strata simulate --kv-grow` and the
# cost model: a Qwen3-30B-A3B-like shape (bf16 experts of 3 x 2048 x 768; 4 K/V heads of 128).
DEFAULT_SLOT_BYTES = 3 * 2048 * 768 * 2
DEFAULT_KV_SEGMENT_CELL_BYTES = 4 * 128 * 2

# Gumbel keys are drawn for at most this many floats at once.
_BLOCK_FLOATS = 1 << 22


def _span(name: str, value: Any) -> tuple[int, int]:
    """An int, or an inclusive (lo, hi) range, as (lo, hi) with 0 <= lo <= hi."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value, value)
    try:
        lo, hi = (int(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an int or a (lo, hi) pair, got {value!r}") from None
    if not 0 <= lo <= hi:
        raise ValueError(f"{name} must satisfy 0 <= lo <= hi, got ({lo}, {hi})")
    return lo, hi


@dataclass(frozen=True)
class SynthSpec:
    """What to generate. Token counts are an int or an inclusive (lo, hi) range per request."""

    kind: str = "zipf"
    n_layers: int = 48
    n_experts: int = 128
    top_k: int = 8
    n_requests: int = 4
    prompt_tokens: Any = 256
    decode_tokens: Any = 256
    prompt_chunk: int = 512  # tokens per prompt step (chunked prefill)
    zipf_s: float = 1.0
    markov_p: float = 0.5
    seed: int = 0
    popularity_seed: int = 0
    slot_bytes: int = DEFAULT_SLOT_BYTES
    kv_segment_cell_bytes: int = DEFAULT_KV_SEGMENT_CELL_BYTES

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        for name in ("n_layers", "n_experts", "top_k", "n_requests", "prompt_chunk",
                     "slot_bytes", "kv_segment_cell_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("seed", "popularity_seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k {self.top_k} exceeds n_experts {self.n_experts}")
        object.__setattr__(self, "prompt_tokens", _span("prompt_tokens", self.prompt_tokens))
        object.__setattr__(self, "decode_tokens", _span("decode_tokens", self.decode_tokens))
        if self.prompt_tokens[0] + self.decode_tokens[0] < 1:
            raise ValueError("a request needs at least one token: raise prompt_tokens or "
                             "decode_tokens")
        if not (np.isfinite(self.zipf_s) and self.zipf_s >= 0):
            raise ValueError(f"zipf_s must be a finite number >= 0, got {self.zipf_s!r}")
        if not 0.0 <= self.markov_p <= 1.0:
            raise ValueError(f"markov_p must be in [0, 1], got {self.markov_p!r}")

    def describe(self) -> dict[str, Any]:
        """JSON-ready; only the parameters the kind uses."""
        spec = dataclasses.asdict(self)
        spec["prompt_tokens"] = list(self.prompt_tokens)
        spec["decode_tokens"] = list(self.decode_tokens)
        if self.kind == "uniform":
            del spec["zipf_s"], spec["popularity_seed"]
        if self.kind != "markov":
            del spec["markov_p"]
        for name in ("slot_bytes", "kv_segment_cell_bytes"):
            del spec[name]
        return spec


def log_popularity(spec: SynthSpec) -> np.ndarray:
    """float64 [L, E]: log draw weight of each expert (0 everywhere for `uniform`)."""
    if spec.kind == "uniform" or spec.zipf_s == 0:
        return np.zeros((spec.n_layers, spec.n_experts))
    rng = np.random.default_rng(spec.popularity_seed)
    ranks = np.stack([rng.permutation(spec.n_experts) for _ in range(spec.n_layers)])
    return -spec.zipf_s * np.log1p(ranks.astype(np.float64))


def _fresh(rng: np.random.Generator, logw: np.ndarray, n_tokens: int, k: int) -> np.ndarray:
    """int32 [n_tokens, L, k]: independent top-k draws without replacement."""
    n_layers, n_experts = logw.shape
    block = max(1, _BLOCK_FLOATS // (n_layers * n_experts))
    out = np.empty((n_tokens, n_layers, k), np.int32)
    for lo in range(0, n_tokens, block):
        hi = min(n_tokens, lo + block)
        keys = logw + rng.gumbel(size=(hi - lo, n_layers, n_experts))
        out[lo:hi] = _top(keys, k)
    return out


def _top(keys: np.ndarray, k: int) -> np.ndarray:
    """The indices of the k largest keys along the last axis, largest first."""
    if k < keys.shape[-1]:
        part = np.argpartition(-keys, k - 1, axis=-1)[..., :k]
    else:
        part = np.broadcast_to(np.arange(k), keys.shape).copy()
    order = np.argsort(-np.take_along_axis(keys, part, axis=-1), axis=-1, kind="stable")
    return np.take_along_axis(part, order, axis=-1)


def _markov_request(
    rng: np.random.Generator, logw: np.ndarray, n_tokens: int, k: int, p: float
) -> np.ndarray:
    """int32 [n_tokens, L, k] for one request: each choice repeats the previous token's with
    probability p."""
    n_layers, n_experts = logw.shape
    out = np.empty((n_tokens, n_layers, k), np.int32)
    out[0] = _fresh(rng, logw, 1, k)[0]
    rows = np.arange(n_layers)[:, None]
    slot = np.arange(k)[None, :]
    for t in range(1, n_tokens):
        kept = (rng.random((n_layers, k)) < p).sum(axis=1)[:, None]  # [L, 1]
        order = np.argsort(rng.random((n_layers, k)), axis=1)
        repeats = np.take_along_axis(out[t - 1], order, axis=1)  # [L, K], a shuffle
        keep = slot < kept
        keys = logw + rng.gumbel(size=(n_layers, n_experts))
        keys[np.broadcast_to(rows, keep.shape)[keep], repeats[keep]] = -np.inf
        fresh = _top(keys, k)
        chosen = np.concatenate([repeats, fresh], axis=1)
        valid = np.concatenate([keep, slot < k - kept], axis=1)
        out[t] = chosen[valid].reshape(n_layers, k)
    return out


def synth_trace(spec: SynthSpec) -> Trace:
    """The trace `spec` describes; the same spec always gives the same trace."""
    rng = np.random.default_rng(spec.seed)
    logw = log_popularity(spec)
    n_req = spec.n_requests
    prompt = rng.integers(spec.prompt_tokens[0], spec.prompt_tokens[1] + 1, n_req)
    decode = rng.integers(spec.decode_tokens[0], spec.decode_tokens[1] + 1, n_req)
    empty = (prompt + decode) == 0
    decode[empty] = 1  # a request has at least one token
    tokens = prompt + decode
    if spec.kind == "markov":
        ids = np.concatenate([
            _markov_request(rng, logw, int(n), spec.top_k, spec.markov_p) for n in tokens
        ])
    else:
        ids = _fresh(rng, logw, int(tokens.sum()), spec.top_k)

    step_tokens: list[int] = []
    phases: list[int] = []
    request_steps: list[int] = []
    for p_tokens, d_tokens in zip(prompt.tolist(), decode.tolist(), strict=True):
        chunks = [spec.prompt_chunk] * (p_tokens // spec.prompt_chunk)
        if p_tokens % spec.prompt_chunk:
            chunks.append(p_tokens % spec.prompt_chunk)
        step_tokens += chunks + [1] * d_tokens
        phases += [PROMPT] * len(chunks) + [DECODE] * d_tokens
        request_steps.append(len(chunks) + d_tokens)
    meta = {
        "source": "synthetic",
        "synth": spec.describe(),
        "model": {
            "slot_bytes": spec.slot_bytes,
            "kv_segment_cell_bytes": spec.kv_segment_cell_bytes,
            "kv_segments": 2 * spec.n_layers,
        },
    }
    return Trace(
        n_experts=spec.n_experts,
        expert_ids=ids,
        step_offsets=np.concatenate([[0], np.cumsum(step_tokens)]).astype(np.int64),
        step_phase=np.array(phases, dtype=np.uint8),
        request_offsets=np.concatenate([[0], np.cumsum(request_steps)]).astype(np.int64),
        meta=meta,
    )
