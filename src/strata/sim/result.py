"""What a replay counts: hits, misses and what the cache did, per layer, per phase and per step.

Legend: L layers, S steps of the trace.

An access is one routed (token, layer, expert): hits + misses = accesses = N * L * K. The
per-step counts feed the cost model: per layer step, the distinct experts hit (computed on the
device) and missed (computed once each on the CPU), and per step the experts uploaded to the
device (admissions and refills).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from strata.formats.trace import DECODE, PROMPT, Trace

PATHS = ("generic", "batched", "kernel", "bound")


@dataclass
class StepCounts:
    """int32 [S, L] hits, distinct experts hit, distinct experts missed; int32 [S] uploads."""

    hits: np.ndarray
    distinct_hits: np.ndarray
    distinct_misses: np.ndarray
    uploads: np.ndarray

    @classmethod
    def zeros(cls, n_steps: int, n_layers: int) -> StepCounts:
        shape = (n_steps, n_layers)
        return cls(
            hits=np.zeros(shape, np.int32),
            distinct_hits=np.zeros(shape, np.int32),
            distinct_misses=np.zeros(shape, np.int32),
            uploads=np.zeros(n_steps, np.int32),
        )


@dataclass
class ReplayResult:
    """The counts of one policy (or bound) at one cache size over one trace."""

    policy: str  # the label: the name, with options if any were set
    name: str
    options: dict[str, Any]
    path: str
    slots: int
    layer_accesses: np.ndarray  # int64 [L]
    steps: StepCounts
    layer_admissions: np.ndarray  # int64 [L], by the admitted expert's layer
    layer_evictions: np.ndarray  # int64 [L], by the evicted expert's layer
    step_phase: np.ndarray  # uint8 [S]
    step_accesses: np.ndarray  # int64 [S]: accesses per step (tokens * L * K)
    events: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {self.path!r}")

    @classmethod
    def empty(cls, trace: Trace, *, policy: str, name: str, options: dict[str, Any], path: str,
              slots: int) -> ReplayResult:
        n_layers = trace.n_layers
        return cls(
            policy=policy, name=name, options=options, path=path, slots=slots,
            layer_accesses=np.full(n_layers, trace.n_tokens * trace.top_k, np.int64),
            steps=StepCounts.zeros(trace.n_steps, n_layers),
            layer_admissions=np.zeros(n_layers, np.int64),
            layer_evictions=np.zeros(n_layers, np.int64),
            step_phase=np.asarray(trace.step_phase),
            step_accesses=trace.step_tokens * trace.n_layers * trace.top_k,
            events={name: 0 for name in EVENT_NAMES},
        )

    # --- totals ---
    @property
    def layer_hits(self) -> np.ndarray:
        return self.steps.hits.sum(axis=0, dtype=np.int64)

    @property
    def accesses(self) -> int:
        return int(self.layer_accesses.sum())

    @property
    def hits(self) -> int:
        return int(self.steps.hits.sum(dtype=np.int64))

    @property
    def misses(self) -> int:
        return self.accesses - self.hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def admissions(self) -> int:
        return int(self.layer_admissions.sum())

    @property
    def evictions(self) -> int:
        return int(self.layer_evictions.sum())

    def phase_counts(self, phase: int) -> tuple[int, int]:
        """(accesses, hits) of the steps of `phase`."""
        mask = self.step_phase == phase
        return (int(self.step_accesses[mask].sum()),
                int(self.steps.hits[mask].sum(dtype=np.int64)))

    def to_dict(self, per_layer: bool = True) -> dict[str, Any]:
        """JSON-ready; the same counts always give the same dict (and the same JSON)."""
        out: dict[str, Any] = {
            "policy": self.policy,
            "name": self.name,
            "options": dict(self.options),
            "path": self.path,
            "slots": self.slots,
            "accesses": self.accesses,
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hit_rate,
            "admissions": self.admissions,
            "evictions": self.evictions,
        }
        out.update(self.events)
        for phase_name, phase in (("prompt", PROMPT), ("decode", DECODE)):
            accesses, hits = self.phase_counts(phase)
            out[phase_name] = {
                "accesses": accesses,
                "hits": hits,
                "hit_rate": hits / accesses if accesses else 0.0,
            }
        if per_layer:
            out["per_layer"] = {
                "accesses": self.layer_accesses.tolist(),
                "hits": self.layer_hits.tolist(),
                "admissions": self.layer_admissions.tolist(),
                "evictions": self.layer_evictions.tolist(),
            }
        return out


# Events a replay counts beside admissions and evictions. `relocations`: experts moved into
# kept slots before their slots were given up; `refills`: experts loaded after a trim;
# `gave_up_slots`: slots handed to the K/V; `kv_shortfalls`: growths the cache could not cover.
EVENT_NAMES = ("relocations", "refills", "grows", "trims", "gave_up_slots", "kv_shortfalls")
