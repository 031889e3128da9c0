"""Plugin: `lru`, an adaptive cache that evicts the least recently used expert."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

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

    def __init__(self, options=None) -> None:
        super().__init__(options)
        self.last_use: np.ndarray | None = None  # int64 [L, E], -1 = never since start
        self.clock = 0

    def _state(self, view) -> np.ndarray:
        if self.last_use is None or self.last_use.shape != (view.n_layers, view.n_experts):
            self.last_use = np.full((view.n_layers, view.n_experts), -1, np.int64)
        return self.last_use

    def observe(self, view, layer, expert_ids, hit_mask):
        self._state(view)[layer, np.ravel(expert_ids)] = self.clock
        self.clock += 1

    def expert_scores(self, view):
        return self._state(view).astype(np.float64)


@hookimpl
def strata_register_policies(register):
    register(Lru)
