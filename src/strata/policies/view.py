"""A read-only view of the books (`strata._residency.ResidencyTable`) for policies.

A policy reads the books through this view and never changes them: every array it hands out has
its write flag off, and it offers no method that assigns, evicts, moves or maps. Beside the
table's own read-only queries it derives, in numpy, what decisions need: a total heat order and
the chunks a set of slots would free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from strata._residency import ResidencyTable


def _readonly(array: np.ndarray) -> np.ndarray:
    if not array.flags.writeable:
        return array
    frozen = array.view()
    frozen.flags.writeable = False
    return frozen


class ResidencyView:
    """The books as a policy sees them: arrays with the write flag off, regions, geometry.

    Slots [top, n_slots) are the loan region; slots below `floor` are never given up. `top`, when
    given, is the loan region's first slot as the caller sees it (the elastic K/V asks its
    give-up with the region the prompt loan would lend, open or not); by default the books'.
    """

    __slots__ = ("_chunk_bounds", "_slot_bounds", "_table", "_top")

    def __init__(self, table: ResidencyTable, *, top: int | None = None) -> None:
        self._table = table
        if top is not None and not table.floor <= top <= table.n_slots:
            raise ValueError(f"top {top} is outside [floor {table.floor}, {table.n_slots}]")
        self._top = top
        self._slot_bounds: tuple[np.ndarray, np.ndarray] | None = None
        self._chunk_bounds: tuple[np.ndarray, np.ndarray] | None = None

    # --- shape and regions ---
    @property
    def n_layers(self) -> int:
        return self._table.n_layers

    @property
    def n_experts(self) -> int:
        return self._table.n_experts

    @property
    def n_slots(self) -> int:
        return self._table.n_slots

    @property
    def slot_bytes(self) -> int:
        return self._table.slot_bytes

    @property
    def chunk_bytes(self) -> int:
        return self._table.chunk_bytes

    @property
    def n_chunks(self) -> int:
        return self._table.n_chunks

    @property
    def top(self) -> int:
        """The first slot of the loan region."""
        return self._table.top if self._top is None else self._top

    @property
    def floor(self) -> int:
        """The fewest slots the cache keeps: slots below it are never given up."""
        return self._table.floor

    # --- arrays, write flag off ---
    @property
    def res(self) -> np.ndarray:
        """int32 [L, E]: slot of each expert, or -1."""
        return _readonly(self._table.res)

    @property
    def owner(self) -> np.ndarray:
        """int32 [S]: flat expert id (`layer * n_experts + expert`) in each slot, or -1."""
        return _readonly(self._table.owner)

    @property
    def heat(self) -> np.ndarray:
        """float64 [L, E]: decayed routing counts."""
        return _readonly(self._table.heat)

    @property
    def rank(self) -> np.ndarray:
        """int32 [L, E]: profile rank, 0 = hottest."""
        return _readonly(self._table.rank)

    @property
    def chunk_mapped(self) -> np.ndarray:
        """bool [n_chunks]: arena chunks that are mapped."""
        return _readonly(self._table.chunk_mapped)

    @property
    def backed(self) -> np.ndarray:
        """bool [S]: slots whose every chunk is mapped; only these can hold an expert."""
        return _readonly(self._table.backed)

    @property
    def n_resident(self) -> int:
        return self._table.n_resident

    # --- the table's read-only queries ---
    def slot_of(self, layer: int, expert: int) -> int:
        return self._table.slot_of(layer, expert)

    def expert_in(self, slot: int) -> tuple[int, int] | None:
        return self._table.expert_in(slot)

    def coldest(self, lo: int, hi: int) -> int:
        """The slot in [lo, hi) holding the coldest resident, or -1."""
        return self._table.coldest(lo, hi)

    def residents_by_heat(self, lo: int, hi: int) -> np.ndarray:
        """int32 slots in [lo, hi) that hold an expert, coldest first."""
        return self._table.residents_by_heat(lo, hi)

    def hottest_missing(self, k: int) -> np.ndarray:
        """int32 [n, 2] (layer, expert) of up to k non-resident experts, hottest first."""
        return self._table.hottest_missing(k)

    def slot_chunks(self, slot: int) -> tuple[int, int]:
        """Chunks [lo, hi) that slot touches."""
        return self._table.slot_chunks(slot)

    def chunk_slots(self, chunk: int) -> tuple[int, int]:
        """Slots [lo, hi) that touch chunk."""
        return self._table.chunk_slots(chunk)

    # --- derived in numpy ---
    def heat_position(self) -> np.ndarray:
        """int64 [L, E]: each expert's place in the heat order, 0 = hottest.

        The books' order: higher heat first, then lower profile rank; ranks are a permutation,
        so no two experts share a place.
        """
        heat = self._table.heat.ravel()
        order = np.lexsort((self._table.rank.ravel(), -heat))  # hottest first
        position = np.empty(order.size, np.int64)
        position[order] = np.arange(order.size)
        return position.reshape(self.n_layers, self.n_experts)

    def slot_chunk_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """int64 [S] twice: the chunks [lo, hi) each slot touches (the table's geometry)."""
        if self._slot_bounds is None:
            start = np.arange(self.n_slots, dtype=np.int64) * self.slot_bytes
            lo = start // self.chunk_bytes
            hi = -(-(start + self.slot_bytes) // self.chunk_bytes)
            self._slot_bounds = (_readonly(lo), _readonly(hi))
        return self._slot_bounds

    def chunk_slot_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """int64 [n_chunks] twice: the slots [lo, hi) that touch each chunk."""
        if self._chunk_bounds is None:
            start = np.arange(self.n_chunks, dtype=np.int64) * self.chunk_bytes
            lo = start // self.slot_bytes
            hi = np.minimum(-(-(start + self.chunk_bytes) // self.slot_bytes), self.n_slots)
            self._chunk_bounds = (_readonly(lo), _readonly(hi))
        return self._chunk_bounds

    def _touched(self, slot_mask: np.ndarray) -> np.ndarray:
        """bool [n_chunks]: chunks that some slot in `slot_mask` touches."""
        lo, hi = self.slot_chunk_bounds()
        n = self.n_chunks
        edges = np.bincount(lo[slot_mask], minlength=n + 1) - np.bincount(
            hi[slot_mask], minlength=n + 1
        )
        return np.cumsum(edges[:n]) > 0

    def chunks_freed_by(self, slots: np.ndarray) -> np.ndarray:
        """int32 chunks, ascending, that giving up `slots` (valid, distinct) frees.

        A mapped chunk is freed when the given-up slots touch it and no other backed slot
        does: a slot straddling a chunk boundary keeps the chunk it shares with a neighbour
        unless that neighbour goes too (or has no memory left already).
        """
        given = np.zeros(self.n_slots, bool)
        given[np.asarray(slots, dtype=np.int64)] = True
        kept = self._touched(self._table.backed & ~given)
        freed = self._table.chunk_mapped & self._touched(given) & ~kept
        return np.flatnonzero(freed).astype(np.int32)

    def givable_slots(self) -> np.ndarray:
        """int32 backed slots in [floor, top), ascending: those a give-up may name."""
        backed = np.flatnonzero(self._table.backed).astype(np.int32)
        return backed[(backed >= self.floor) & (backed < self.top)]

    def givable_chunks(self) -> int:
        """How many chunks giving up every givable slot would free: the most a growth can ask."""
        return int(self.chunks_freed_by(self.givable_slots()).size)

    def empty_slots(self, lo: int, hi: int) -> np.ndarray:
        """int32 backed slots in [lo, hi) that hold no expert, ascending."""
        owner = self._table.owner[lo:hi]
        backed = self._table.backed[lo:hi]
        return (np.flatnonzero(backed & (owner < 0)) + lo).astype(np.int32)
