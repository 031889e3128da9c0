"""The books of the expert cache: which expert sits in which slot, heat, and slot/chunk geometry.

Experts are named by (layer, expert); `owner` stores them flat, as `layer * n_experts + expert`.
The arena is `n_slots` slots of `slot_bytes`, back to back, over `n_chunks` chunks of `chunk_bytes`
(the memory layer's granularity). This module knows nothing of memory: it records which arena
chunks are mapped (`chunk_mapped`) and derives which slots are usable (`backed`).

Regions: slots [top, n_slots) are lent to the prompt path (the loan); `floor` is the fewest slots
the cache keeps. 0 <= floor <= top <= n_slots.

Heat orders experts: higher decayed routing count first, then lower profile rank (0 = hottest).
Profile ranks are a permutation of 0 .. L*E-1, so the order is total and deterministic.
"""

from os import PathLike

import numpy as np

class ResidencyTable:
    def __init__(
        self, n_layers: int, n_experts: int, n_slots: int, slot_bytes: int, chunk_bytes: int
    ) -> None: ...
    # --- shape ---
    @property
    def n_layers(self) -> int: ...
    @property
    def n_experts(self) -> int: ...
    @property
    def n_slots(self) -> int: ...
    @property
    def slot_bytes(self) -> int: ...
    @property
    def chunk_bytes(self) -> int: ...
    @property
    def n_chunks(self) -> int:
        """ceil(n_slots * slot_bytes / chunk_bytes)."""
    # --- read-only numpy views (write flag off) ---
    @property
    def res(self) -> np.ndarray:
        """int32 [L, E]: slot of each expert, or -1."""
    @property
    def owner(self) -> np.ndarray:
        """int32 [S]: flat expert id in each slot, or -1."""
    @property
    def heat(self) -> np.ndarray:
        """float64 [L, E]: decayed routing counts."""
    @property
    def rank(self) -> np.ndarray:
        """int32 [L, E]: profile rank, 0 = hottest."""
    @property
    def chunk_mapped(self) -> np.ndarray:
        """bool [n_chunks]: arena chunks the books count as mapped (all, at start)."""
    @property
    def backed(self) -> np.ndarray:
        """bool [S]: slots whose every chunk is mapped; only these can hold an expert."""
    # --- regions ---
    @property
    def top(self) -> int: ...
    @property
    def floor(self) -> int: ...
    def set_regions(self, *, top: int | None = None, floor: int | None = None) -> None: ...
    # --- residency; every call checks all its arguments before changing anything ---
    def assign(self, slot: int, layer: int, expert: int) -> None: ...
    def evict(self, slot: int) -> tuple[int, int]: ...
    def move(self, src_slot: int, dst_slot: int) -> None: ...
    def assign_many(self, slots: np.ndarray, layers: np.ndarray, experts: np.ndarray) -> None: ...
    def evict_many(self, slots: np.ndarray) -> np.ndarray:
        """Returns int32 [n, 2] (layer, expert) of the evicted, in the order given."""
    def move_many(self, src_slots: np.ndarray, dst_slots: np.ndarray) -> None: ...
    def slot_of(self, layer: int, expert: int) -> int: ...
    def expert_in(self, slot: int) -> tuple[int, int] | None: ...
    @property
    def n_resident(self) -> int: ...
    # --- heat ---
    def set_rank(self, rank: np.ndarray) -> None:
        """int [L, E], a permutation of 0 .. L*E-1."""
    def set_rank_from_counts(self, counts: np.ndarray) -> None:
        """Rank by counts [L, E], highest first, ties by flat id."""
    def record(self, layer: int, expert_ids: np.ndarray) -> None:
        """heat[layer, e] += 1 for each id in an int array of any shape."""
    def decay(self, factor: float) -> None:
        """heat *= factor, 0 < factor <= 1."""
    def coldest(self, lo: int, hi: int) -> int:
        """The slot in [lo, hi) holding the coldest resident, or -1 if none holds one."""
    def residents_by_heat(self, lo: int, hi: int) -> np.ndarray:
        """int32 slots in [lo, hi) that hold an expert, coldest first."""
    def hottest_missing(self, k: int) -> np.ndarray:
        """int32 [n, 2] (layer, expert) of up to k non-resident experts, hottest first."""
    # --- the hot path ---
    def lookup(
        self,
        layer: int,
        expert_ids: np.ndarray,
        out_slots: np.ndarray | None = None,
        out_hit: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Slots int32 [T, K] (-1 for a miss) and hit mask bool [T, K] for ids int [T, K].

        Counts every routed id in `lookups` and every resident one in `hits`.
        """
    @property
    def hits(self) -> int: ...
    @property
    def lookups(self) -> int: ...
    def reset_counters(self) -> None: ...
    # --- geometry ---
    def slot_chunks(self, slot: int) -> tuple[int, int]:
        """Chunks [lo, hi) that slot touches."""
    def chunk_slots(self, chunk: int) -> tuple[int, int]:
        """Slots [lo, hi) that touch chunk."""
    def chunks_within(self, lo: int, hi: int) -> tuple[int, int]:
        """Chunks [c_lo, c_hi) lying wholly inside slots [lo, hi) (empty: c_lo == c_hi)."""
    def slots_completed_by(self, chunks: np.ndarray) -> np.ndarray:
        """int32 slots, ascending, not backed now that would be if `chunks` were mapped too."""
    def mark_chunks(self, chunks: np.ndarray, mapped: bool) -> None:
        """Record arena chunks as mapped or unmapped; unmapping one under a resident is an error."""
    # --- checks and persistence ---
    def validate(self) -> None:
        """Check every invariant; AssertionError naming the first broken one."""
    def save(self, path: str | PathLike[str]) -> None: ...
    @classmethod
    def load(cls, path: str | PathLike[str]) -> ResidencyTable: ...
