"""The elastic K/V: growing the K/V into free budget and the expert cache's slots, trimming it
back, each step all or nothing.

Units: cells are K/V positions; chunks are the memory backend's physical chunks, shared by the
K/V's range and the arena's (one backend), so a chunk moves between them with its bytes and
without a copy; slots are expert-cache slots. The K/V maps whole chunks of each of its
`n_segments` segments (2*L, and int8's scale segments: `KvLayout`), all of one cell size, so
`cells_per_chunk` cells of every segment take `n_segments` chunks.

A growth (`ensure`, before a step needs cells past the mapped ones):
1. the policy's `kv_target` says how many cells to map (whole steps);
2. chunks come from free budget first; the rest from the cache: the policy's `give_up` names
   slots below the loan region (`PromptLoan.top`, the region a loan would lend even while none
   is open, handed to the policy in its view) and above the floor, and `relocate` moves
   hotter experts in them into the loan region (both checked);
3. the cache's executor carries the plan out (`CacheChange.give_up`: the moved blobs copied
   device to device, complete before anything is unmapped; the freed arena chunks unmapped;
   the books applied), and the K/V maps the arena's chunks and then new ones, zeroing the new
   cells;
4. the device mirror of the books is uploaded, events are told (the executor's change ends).
If a step of 3 fails, everything is rolled back: the K/V is as before (its mapping is all or
nothing), and the change rolls the cache back (the arena maps its chunks back, bytes intact;
the books are restored; the relocations' destinations get their own experts' blobs again from
the host store). The run goes on with the K/V it has; the reason is kept
(`stats.last_failure`) and told to `on_note`.

A trim (`trim`, when requests need fewer cells): the K/V hands back its chunks above the
target; they fill the arena's unmapped chunks, lowest first; the policy's `refill` fills the
empty backed slots (from the heat and the profile) and the spare chunks are released. The
decision comes first, then the fallible memory steps, then the blob uploads, so a failure
rolls back exactly as a growth does.

No kernel may be running while chunks move: the device is synchronised first. Addresses never
move, so views (and CUDA graphs) made over mapped cells or slots stay valid.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from strata import _vmm
from strata.books import GiveUpPlan
from strata.engine.cache.cached_experts import CachedExperts
from strata.engine.cache.executor import CacheChange, sync_device
from strata.engine.kv.kv_cache import KVCache
from strata.engine.kv.stats import KvStats
from strata.policies.events import Grown, Trimmed
from strata.policies.kv_params import KvParams, ceil_div

if TYPE_CHECKING:
    import numpy.typing as npt

__all__ = ["ElasticKV", "KvFullError", "KvGrowError", "loan_top"]


class KvGrowError(RuntimeError):
    """A growth or trim could not be made; it was rolled back (the K/V is as it was)."""


class KvFullError(RuntimeError):
    """A step needs K/V cells that are not mapped and could not be."""


def loan_top(cache: CachedExperts) -> int:
    """The first slot of the loan region: the prompt loan's (`PromptLoan.top`: the open loan's
    `top`, else the first slot a loan would lend), else the books' `top` (no loan)."""
    return cache.loan.top() if cache.loan is not None else cache.table.top


class ElasticKV:
    """The K/V `kv` of a model whose experts run through `cache`, grown into `free_chunks`
    chunks of free budget and the cache's slots by `params`' steps.

    `kv` must live on the arena's backend (chunks move between the two ranges). `on_note` is
    told, in one line, why a growth or trim failed. Not thread-safe: the engine's thread only.
    """

    def __init__(
        self,
        kv: KVCache,
        cache: CachedExperts,
        params: KvParams,
        *,
        free_chunks: int,
        on_note: Callable[[str], None] | None = None,
    ) -> None:
        if kv.backend is not cache.arena.backend:
            raise ValueError("the K/V and the arena must share one memory backend")
        if kv.chunk_bytes % kv.cell_bytes:
            raise ValueError(f"K/V cells of {kv.cell_bytes} bytes do not tile chunks of "
                             f"{kv.chunk_bytes}")
        if free_chunks < 0:
            raise ValueError(f"free_chunks must be >= 0, got {free_chunks}")
        self.kv = kv
        self.cache = cache
        self.executor = cache.executor
        self.table = cache.table
        self.params = params
        self.free_chunks = free_chunks
        self.on_note = on_note
        self.cells_per_chunk = kv.chunk_bytes // kv.cell_bytes
        # The window in whole chunks: the most cells a target may name.
        self.max_mapped_cells = ceil_div(kv.max_cells, self.cells_per_chunk) * self.cells_per_chunk
        self.stats = KvStats(
            cells_mapped=kv.mapped_cells, max_cells=kv.max_cells, init_cells=params.init_cells,
            step_cells=params.step_cells, floor_slots=params.floor_slots,
        )

    # --- what the policy sees ---
    @property
    def mapped_cells(self) -> int:
        """Cells mapped, on the chunk grid (may pass the window by less than a chunk)."""
        return self.kv.mapped_chunks * self.cells_per_chunk

    def _target(self, need_cells: int) -> int:
        if not 0 <= need_cells <= self.kv.max_cells:
            raise ValueError(f"need_cells {need_cells} is outside [0, {self.kv.max_cells}] "
                             "(the window, --max-context)")
        self.cache.flush_heat()  # the policy decides on all the routing seen so far
        return self.cache.checked.kv_target(need_cells, self.mapped_cells, self.params,
                                            self.max_mapped_cells)

    # --- the calls generate and serve make ---
    def ensure(self, need_cells: int) -> bool:
        """Grow, if cells [0, need_cells) are not all mapped, by the policy's whole steps.

        The call before a step that may pass the mapped cells (a request's prompt, a parked
        conversation's restore, a decode round). True when the cells are mapped; False when
        the growth failed and was rolled back (the reason is in `stats.last_failure`).
        PolicyError (a wrong answer) propagates, with nothing changed.
        """
        if need_cells <= self.kv.mapped_cells:
            return True
        target = self._target(need_cells)
        try:
            self._grow(target)
        except (_vmm.VmmError, KvGrowError) as err:
            self._failed("growth", need_cells, err)
            return False
        return True

    def require(self, need_cells: int) -> None:
        """`ensure`, then KvFullError if cells [0, need_cells) still are not mapped."""
        if need_cells <= self.kv.mapped_cells or self.ensure(need_cells):
            return
        raise KvFullError(
            f"the next step needs {need_cells} K/V cells, {self.kv.mapped_cells} are mapped "
            f"and growing failed: {self.stats.last_failure}"
        )

    def trim(self, need_cells: int) -> int:
        """Give back the chunks above what the policy's target for `need_cells` keeps, refill
        the slots they complete; returns the chunks given back (0: none, or a failed trim,
        rolled back, with its reason in `stats.last_failure`)."""
        target = self._target(need_cells)
        if target >= self.mapped_cells:
            return 0
        try:
            return self._trim(target)
        except (_vmm.VmmError, KvGrowError) as err:
            self._failed("trim", need_cells, err)
            return 0

    def close(self) -> None:
        """Release the K/V's memory. Idempotent."""
        self.kv.close()

    def _failed(self, what: str, need_cells: int, err: BaseException) -> None:
        reason = f"{type(err).__name__}: {err}" if isinstance(err, _vmm.VmmError) else str(err)
        self.stats.failures += 1
        self.stats.last_failure = reason
        if self.on_note is not None:
            self.on_note(f"K/V {what} for {need_cells} cells failed and was rolled back; "
                         f"going on with {self.kv.mapped_cells} cells mapped ({reason})")

    # --- growing ---
    def _plan_give_up(self, n_chunks: int) -> GiveUpPlan:
        """The policy's checked give-up of `n_chunks` chunks, decided on a view whose `top` is
        the loan region's first slot."""
        top = loan_top(self.cache)
        checked = self.cache.checked
        givable = checked.view_with_top(top).givable_chunks()
        if n_chunks > givable:
            raise KvGrowError(
                f"the growth needs {n_chunks} chunks from the expert cache, which can give "
                f"{givable} (slots [{self.table.floor}, {top}) between the floor and the "
                "loan region)"
            )
        return checked.give_up(n_chunks, top=top)

    def _grow(self, target_cells: int) -> None:
        kv = self.kv
        cells = min(target_cells, kv.max_cells)
        before = kv.mapped_cells
        n_new = (kv.chunks_for(cells) - kv.mapped_chunks) * kv.n_segments
        from_budget = min(self.free_chunks, n_new)
        plan = self._plan_give_up(n_new - from_budget) if n_new > from_budget else None
        with self.executor.change() as change:
            taken = change.give_up(plan) if plan is not None else []
            use, spare = taken[:n_new], taken[n_new:]
            kv.map_cells(cells, chunks=use)  # new chunks past `use`; zeroes the new cells
            fresh = n_new - len(use)
            change.emit(Grown(cells_before=before, cells_after=kv.mapped_cells,
                              chunks_from_budget=fresh,
                              chunks_from_cache=0 if plan is None else int(plan.chunks.size)))
        for chunk in spare:  # a give-up freed more than the step needs: back to free budget
            chunk.release()
        self.free_chunks += len(spare) - fresh
        stats = self.stats
        stats.grows += 1
        stats.fresh_chunks += fresh
        stats.cells_mapped = kv.mapped_cells
        if plan is not None:
            stats.slots_given_up += int(plan.slots.size)
            stats.relocated += int(plan.moves.shape[0])

    # --- trimming ---
    def _trim(self, target_cells: int) -> int:
        kv, table = self.kv, self.table
        before = kv.mapped_cells
        cells = min(target_cells, kv.max_cells)
        n_back = (kv.mapped_chunks - kv.chunks_for(cells)) * kv.n_segments
        all_holes = np.flatnonzero(~table.chunk_mapped)  # lowest first
        # A give-up that freed more than its step needed released the rest to the free budget
        # (`_grow`): the holes it left are filled from that budget too, so that the cache
        # gets its slots back whole once the K/V is back where it was.
        from_budget = min(max(all_holes.size - n_back, 0), self.free_chunks)
        holes = all_holes[:n_back + from_budget].astype(np.int32)
        with self.executor.change() as change:
            # The decision first, on the books as they will be: nothing has moved yet.
            change.mark_mapped(holes)
            free = self.cache.checked.view.empty_slots(0, table.top)  # never a lent slot
            placements = self.cache.checked.refill(free) if free.size \
                else np.empty((0, 3), np.int64)
            back = self._hand_back(change, before, cells, holes)
            if from_budget:
                fresh = kv.backend.create_chunks(from_budget)
                change.map_chunks(holes[len(back):], fresh)
            change.emit(Trimmed(cells_before=before, cells_after=kv.mapped_cells,
                                chunks_returned=len(back)))
            # Past the memory steps: the blobs overwrite what the K/V left in those chunks.
            change.refill(placements)
        spare = back[holes.size :]
        for chunk in spare:
            chunk.release()
        self.free_chunks += len(spare) - from_budget
        stats = self.stats
        stats.trims += 1
        stats.fresh_chunks += from_budget
        stats.returned_chunks += len(back) - len(spare)
        stats.freed_chunks += len(spare)
        stats.refilled += int(placements.shape[0])
        stats.cells_mapped = kv.mapped_cells
        return len(back)

    def _hand_back(self, change: CacheChange, before: int, cells: int,
                   holes: npt.NDArray[np.int32]) -> list[_vmm.Chunk]:
        """The K/V's chunks above `cells`, the first into the arena's `holes` (as many as
        there are of either); undone (the K/V maps them back) if the change fails after."""
        sync_device(self.cache.device)  # no kernel still reads the cells that leave
        back = self.kv.unmap_cells(cells)
        change.on_undo(lambda: self.kv.remap_cells(before, back))
        change.map_chunks(holes[: len(back)], back[: holes.size])
        return back
