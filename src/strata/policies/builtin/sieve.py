"""Plugin: `sieve`, the SIEVE eviction algorithm (Zhang et al., NSDI 2024), scan-resistant."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from strata.policies.base import SieveState
from strata.policies.builtin._adaptive import ScoredCache
from strata.policies.hookspecs import hookimpl


@dataclass(frozen=True)
class SieveOptions:
    max_admits: int = field(default=4, metadata={"help": "misses admitted per layer per step"})

    def __post_init__(self) -> None:
        if self.max_admits < 0:
            raise ValueError(f"max_admits must be >= 0, got {self.max_admits}")


class Sieve(ScoredCache):
    """SIEVE: a FIFO queue and a hand; a hit marks an expert visited, the hand spares it once.

    Misses enter at the head. To make room, the hand walks from the tail toward the head,
    clearing visited marks, and evicts the first expert not visited since the hand last
    passed; it stays where it stopped. Experts used once (a scan) leave quickly, those used
    again stay. Experts the policy did not admit (the profile fill, refills) count as older
    than any it did, the profile's coldest oldest. Gives up what the hand would evict next.
    """

    name = "sieve"
    Options = SieveOptions
    replay_kernel = "sieve"

    def __init__(self, options=None) -> None:
        super().__init__(options)
        self.visited: np.ndarray | None = None  # bool [L, E]
        self.inserted: np.ndarray | None = None  # int64 [L, E]: admission number, -1 = never
        self.next_insert = 0
        self.hand = -1  # queue key of the next expert to examine; -1 = the tail (oldest)

    def _state(self, n_layers: int, n_experts: int) -> None:
        shape = (n_layers, n_experts)
        if self.visited is None or self.visited.shape != shape:
            self.visited = np.zeros(shape, bool)
            self.inserted = np.full(shape, -1, np.int64)

    def kernel_state(self, n_layers, n_experts):
        self._state(n_layers, n_experts)
        return SieveState(self.visited, self.inserted, self.next_insert, self.hand,
                          self.options.max_admits)

    def set_kernel_state(self, state):
        self.visited, self.inserted = state.visited, state.inserted
        self.next_insert, self.hand = state.next_insert, state.hand

    def observe(self, view, layer, expert_ids, hit_mask):
        self._state(view.n_layers, view.n_experts)
        self.visited[layer, np.asarray(expert_ids)[np.asarray(hit_mask)]] = True

    def _queue(self, view, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The residents of `slots` in queue order, tail first: (slots, keys), both int64."""
        flat = view.owner[slots].astype(np.int64)
        n_total = view.n_layers * view.n_experts
        # Older admission first; among never admitted, the profile's coldest first.
        keys = (self.inserted.ravel()[flat] + 1) * n_total + (n_total - 1 - view.rank.ravel()[flat])
        order = np.argsort(keys)
        return slots[order], keys[order]

    def _hand_order(self, view, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Residents of `slots` in the order the hand meets them, and their flat expert ids."""
        queue, keys = self._queue(view, slots)
        start = int(np.searchsorted(keys, self.hand))
        turn = np.roll(np.arange(queue.size), -start)
        return queue[turn], keys[turn]

    def _victims(self, view, count: int) -> list[int]:
        """Walk the hand over the residents below top; the (up to) `count` slots it evicts.

        One sort per call; each victim is then a vectorised search onward from the last one.
        """
        slots = np.flatnonzero(view.owner[: view.top] >= 0)
        if slots.size == 0 or count == 0:
            return []
        met, keys = self._hand_order(view, slots)
        flat = view.owner[met]
        visited = self.visited.ravel()
        taken = np.zeros(met.size, bool)
        victims: list[int] = []
        pos = 0
        for _ in range(min(count, met.size)):
            free = ~visited[flat[pos:]] & ~taken[pos:]
            if not free.any():  # a full turn: the hand clears the rest and wraps to the tail
                visited[flat[pos:]] = False
                pos = 0
                free = ~taken
            stop = pos + int(np.argmax(free))
            visited[flat[pos:stop]] = False  # the hand clears what it passes
            taken[stop] = True
            victims.append(int(met[stop]))
            pos = stop + 1
        self.hand = int(keys[pos]) if pos < keys.size else -1
        return victims

    def admit(self, view, layer, missed_experts):
        self._state(view.n_layers, view.n_experts)
        heat, rank = view.heat[layer], view.rank[layer]
        missed = np.asarray(missed_experts, dtype=np.int64)
        missed = missed[np.lexsort((rank[missed], -heat[missed]))][: self.options.max_admits]
        empty = view.empty_slots(0, view.top)[: missed.size].tolist()
        slots = empty + self._victims(view, missed.size - len(empty))
        placements = []
        for expert, slot in zip(missed, slots, strict=False):
            self.inserted[layer, expert] = self.next_insert
            self.next_insert += 1
            self.visited[layer, expert] = False
            placements.append((int(slot), layer, int(expert)))
        return placements

    def expert_scores(self, view):
        """Residents score by how late the hand would evict them; the rest score -inf."""
        self._state(view.n_layers, view.n_experts)
        scores = np.full(view.n_layers * view.n_experts, -np.inf)
        met, _ = self._hand_order(view, np.flatnonzero(view.owner >= 0))
        flat = view.owner[met]
        # The hand takes the unvisited in its order first, then (after a full turn) the rest.
        evict_order = np.concatenate([flat[~self.visited.ravel()[flat]],
                                      flat[self.visited.ravel()[flat]]])
        scores[evict_order] = np.arange(evict_order.size, dtype=np.float64)
        return scores.reshape(view.n_layers, view.n_experts)


@hookimpl
def strata_register_policies(register):
    register(Sieve)
