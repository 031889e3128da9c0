"""Plugin: `lru`, an adaptive cache that evicts the least recently used expert."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from strata.policies.base import LruState
from strata.policies.builtin._adaptive import ScoredCache
from strata.policies.hookspecs import hookimpl


@dataclass(frozen=True)
class LruOptions:
    max_admits: int = field(default=4, metadata={"help": "misses admitted per layer per step"})

    def __post_init__(self) -> None:
        if self.max_admits < 0:
            raise ValueError(f"max_admits must be >= 0, got {self.max_admits}")


class Lru(ScoredCache):
    """Least recently used: admit every miss, evict the expert unused the longest.

    Recency counts `observe` calls (one per layer per step); experts never routed since start
    are the oldest, the profile's coldest first. Gives up the least recently used chunks.
    """

    name = "lru"
    Options = LruOptions
    replay_kernel = "lru"

    def __init__(self, options=None) -> None:
        super().__init__(options)
        self.last_use: np.ndarray | None = None  # int64 [L, E], -1 = never since start
        self.clock = 0

    def _state(self, n_layers: int, n_experts: int) -> np.ndarray:
        if self.last_use is None or self.last_use.shape != (n_layers, n_experts):
            self.last_use = np.full((n_layers, n_experts), -1, np.int64)
        return self.last_use

    def observe(self, view, layer, expert_ids, hit_mask):
        self._state(view.n_layers, view.n_experts)[layer, np.ravel(expert_ids)] = self.clock
        self.clock += 1

    def expert_scores(self, view):
        return self._state(view.n_layers, view.n_experts).astype(np.float64)

    def kernel_state(self, n_layers, n_experts):
        return LruState(self._state(n_layers, n_experts), self.clock, self.options.max_admits)

    def set_kernel_state(self, state):
        self.last_use, self.clock = state.last_use, state.clock


@hookimpl
def strata_register_policies(register):
    register(Lru)
