"""Plugin: `lfu`, an adaptive cache that evicts the least frequently used expert."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from strata.policies.base import LfuState
from strata.policies.builtin._adaptive import ScoredCache
from strata.policies.hookspecs import hookimpl


@dataclass(frozen=True)
class LfuOptions:
    decay: float = field(
        default=0.95, metadata={"help": "each layer's counts are multiplied by it per step"}
    )
    max_admits: int = field(default=4, metadata={"help": "misses admitted per layer per step"})

    def __post_init__(self) -> None:
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")
        if self.max_admits < 0:
            raise ValueError(f"max_admits must be >= 0, got {self.max_admits}")


class Lfu(ScoredCache):
    """Least frequently used, by decayed counts: a miss enters only if it is used more often.

    Each step, a layer's counts decay by `decay` and its routed experts count one per token.
    A missed expert replaces the resident with the lowest count only if its own count is
    higher, so a burst does not flush the cache. Gives up the least used chunks.
    """

    name = "lfu"
    Options = LfuOptions
    replay_kernel = "lfu"

    def __init__(self, options=None) -> None:
        super().__init__(options)
        self.counts: np.ndarray | None = None  # float64 [L, E], decayed routing counts

    def _state(self, n_layers: int, n_experts: int) -> np.ndarray:
        if self.counts is None or self.counts.shape != (n_layers, n_experts):
            self.counts = np.zeros((n_layers, n_experts), np.float64)
        return self.counts

    def observe(self, view, layer, expert_ids, hit_mask):
        row = self._state(view.n_layers, view.n_experts)[layer]
        row *= self.options.decay
        row += np.bincount(np.ravel(expert_ids), minlength=row.size)

    def expert_scores(self, view):
        return self._state(view.n_layers, view.n_experts)

    def kernel_state(self, n_layers, n_experts):
        return LfuState(self._state(n_layers, n_experts), self.options.decay,
                        self.options.max_admits)

    def set_kernel_state(self, state):
        self.counts = state.counts

    def worth_admitting(self, expert_score, victim_score):
        return expert_score > victim_score


@hookimpl
def strata_register_policies(register):
    register(Lfu)
