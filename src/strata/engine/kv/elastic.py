"""The elastic K/V: growing the K/V into free budget and the expert cache's slots, trimming it
back, each step all or nothing.

Units: cells are K/V positions; chunks are the memory backend's physical chunks, shared by the
K/V's range and the arena's (one backend), so a chunk moves between them with its bytes and
without a copy; slots are expert-cache slots. The K/V maps whole chunks of each of its 2*L
segments, so `cells_per_chunk` cells of every segment take `n_segments` chunks.

A growth (`ensure`, before a step needs cells past the mapped ones):
1. the policy's `kv_target` says how many cells to map (whole steps);
2. chunks come from free budget first; the rest from the cache: the policy's `give_up` names
   slots below `top` (the loan region's first slot, even while no loan is open) and above the
   floor, and `relocate` moves hotter experts in them into the loan region (both checked);
3. the moved blobs are copied (device to device, complete before anything is unmapped), the
   freed arena chunks are unmapped, the books apply the plan, and the K/V maps the arena's
   chunks and then new ones, zeroing the new cells;
4. the device mirror of the books is uploaded, events are told.
If a step of 3 fails, everything is rolled back: the K/V is as before (its mapping is all or
nothing), the arena maps its chunks back (bytes intact), the books are restored and the
relocations' destinations get their own experts' blobs again from the host store. The run goes
on with the K/V it has; the reason is kept (`stats.last_failure`) and told to `on_note`.

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
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from strata import _vmm
from strata._residency import ResidencyTable
from strata.books import GiveUpPlan, apply_give_up, apply_refill
from strata.engine.kv.kv_cache import KVCache
from strata.engine.kv.stats import KvStats
from strata.policies import KvParams, emit
from strata.policies.events import GaveUp, Grown, Refilled, Relocated, Trimmed
from strata.policies.kv_params import ceil_div

__all__ = ["ElasticKV", "KvFullError", "KvGrowError", "loan_top"]


class KvGrowError(RuntimeError):
    """A growth or trim could not be made; it was rolled back (the K/V is as it was)."""


class KvFullError(RuntimeError):
    """A step needs K/V cells that are not mapped and could not be."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def loan_top(cached: Any) -> int:
    """The first slot of the loan region: the open loan's `top`, else the slots the prompt
    loan would lend (`strata.engine.cache.loan.loan_slots`), else `n_slots` (no loan)."""
    from strata.engine.cache.loan import PromptLoan, loan_slots

    table = cached.table
    loan = cached.loan
    if not isinstance(loan, PromptLoan) or loan.active:
        return table.top
    n = loan_slots(table.n_slots, cached.n_experts, loan.keep_slots, loan.max_fraction,
                   table.floor)
    return min(table.top, table.n_slots - n)


@dataclass(frozen=True)
class _Books:
    """A copy of what growths and trims change in the books: residents, mapped chunks, top."""

    owner: np.ndarray  # int32 [S]
    chunk_mapped: np.ndarray  # bool [n_chunks]
    top: int

    @classmethod
    def of(cls, table: ResidencyTable) -> _Books:
        return cls(table.owner.copy(), table.chunk_mapped.copy(), table.top)

    def restore(self, table: ResidencyTable) -> None:
        """Put the books back as they were; each call checks before it changes anything."""
        n_experts = table.n_experts
        now = table.owner
        changed = np.flatnonzero(now != self.owner).astype(np.int32)
        leaving = changed[now[changed] >= 0]
        if leaving.size:
            table.evict_many(leaving)
        unmap = np.flatnonzero(~self.chunk_mapped & table.chunk_mapped).astype(np.int32)
        remap = np.flatnonzero(self.chunk_mapped & ~table.chunk_mapped).astype(np.int32)
        if unmap.size:
            table.mark_chunks(unmap, False)
        if remap.size:
            table.mark_chunks(remap, True)
        back = changed[self.owner[changed] >= 0]
        if back.size:
            flat = self.owner[back]
            table.assign_many(back, (flat // n_experts).astype(np.int32),
                              (flat % n_experts).astype(np.int32))
        table.set_regions(top=self.top)


class ElasticKV:
    """The K/V `kv` of a model whose experts run through `cached` (a `CachedExperts`), grown
    into `free_chunks` chunks of free budget and the cache's slots by `params`' steps.

    `kv` must live on the arena's backend (chunks move between the two ranges). `on_note` is
    told, in one line, why a growth or trim failed. Not thread-safe: the engine's thread only.
    """

    def __init__(
        self,
        kv: KVCache,
        cached: Any,
        params: KvParams,
        *,
        free_chunks: int,
        on_note: Callable[[str], None] | None = None,
    ) -> None:
        if kv.backend is not cached.arena.backend:
            raise ValueError("the K/V and the arena must share one memory backend")
        if kv.chunk_bytes % kv.cell_bytes:
            raise ValueError(f"K/V cells of {kv.cell_bytes} bytes do not tile chunks of "
                             f"{kv.chunk_bytes}")
        if free_chunks < 0:
            raise ValueError(f"free_chunks must be >= 0, got {free_chunks}")
        self.kv = kv
        self.cached = cached
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
        self.cached.flush_heat()  # the policy decides on all the routing seen so far
        return self.cached.checked.kv_target(need_cells, self.mapped_cells, self.params,
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
        """The policy's checked give-up of `n_chunks` chunks, decided with `top` at the loan
        region's first slot (restored after)."""
        table = self.cached.table
        top = table.top
        table.set_regions(top=loan_top(self.cached))
        try:
            givable = self.cached.checked.view.givable_chunks()
            if n_chunks > givable:
                raise KvGrowError(
                    f"the growth needs {n_chunks} chunks from the expert cache, which can give "
                    f"{givable} (slots [{table.floor}, {table.top}) between the floor and the "
                    "loan region)"
                )
            return self.cached.checked.give_up(n_chunks)
        finally:
            table.set_regions(top=top)

    def _grow(self, target_cells: int) -> None:
        kv, cached = self.kv, self.cached
        table, arena = cached.table, cached.arena
        cells = min(target_cells, kv.max_cells)
        before = kv.mapped_cells
        n_new = (kv.chunks_for(cells) - kv.mapped_chunks) * kv.n_segments
        from_budget = min(self.free_chunks, n_new)
        plan = self._plan_give_up(n_new - from_budget) if n_new > from_budget else None
        books = _Books.of(table)
        moves = plan.moves if plan is not None else np.empty((0, 2), np.int32)
        victims = self._residents(moves[:, 1])
        taken: list[_vmm.Chunk] = []
        copied = False
        try:
            if plan is not None:
                _sync(cached.device)  # no kernel still reads a slot whose chunk leaves
                if moves.size:
                    arena.copy_blobs(moves)  # complete before the sources are unmapped
                    copied = True
                taken = arena.unmap_chunks(plan.chunks)
                evicted = apply_give_up(table, plan)
            use, spare = taken[:n_new], taken[n_new:]
            kv.map_cells(cells, chunks=use)  # new chunks past `use`; zeroes the new cells
        except BaseException:
            books.restore(table)
            if taken:
                arena.map_chunks(plan.chunks, taken)
            if copied:
                slots, experts = victims
                arena.upload(slots, experts, cached.store)  # the destinations' own blobs
            cached.sync_mirror()
            raise
        fresh = n_new - len(use)
        for chunk in spare:  # a give-up freed more than the step needs: back to free budget
            chunk.release()
        self.free_chunks += len(spare) - fresh
        cached.sync_mirror()
        self._grown(before, fresh, plan, evicted if plan is not None else None)

    def _residents(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slots, experts int [n, 2]) of the residents of `slots`, to re-upload on a rollback."""
        owner = self.cached.table.owner[np.asarray(slots, dtype=np.int64)]
        held = owner >= 0
        n_experts = self.cached.table.n_experts
        flat = owner[held].astype(np.int64)
        return np.asarray(slots)[held], np.stack([flat // n_experts, flat % n_experts], axis=1)

    def _grown(self, before: int, fresh: int, plan: GiveUpPlan | None, evicted) -> None:
        stats = self.stats
        stats.grows += 1
        stats.fresh_chunks += fresh
        stats.cells_mapped = self.kv.mapped_cells
        from_cache = 0 if plan is None else int(plan.chunks.size)
        if plan is not None:
            stats.slots_given_up += int(plan.slots.size)
            stats.relocated += int(plan.moves.shape[0])
        events = self.cached.events
        if events is None:
            return
        if plan is not None:
            if plan.moves.size:
                emit(events, Relocated(moves=tuple((int(s), int(d)) for s, d in plan.moves)))
            emit(events, GaveUp(slots=tuple(int(s) for s in plan.slots), chunks=from_cache,
                                evicted=tuple((int(a), int(b)) for a, b in evicted)))
        emit(events, Grown(cells_before=before, cells_after=self.kv.mapped_cells,
                           chunks_from_budget=fresh, chunks_from_cache=from_cache))

    # --- trimming ---
    def _trim(self, target_cells: int) -> int:
        kv, cached = self.kv, self.cached
        table, arena = cached.table, cached.arena
        before = kv.mapped_cells
        cells = min(target_cells, kv.max_cells)
        n_back = (kv.mapped_chunks - kv.chunks_for(cells)) * kv.n_segments
        holes = np.flatnonzero(~table.chunk_mapped)[:n_back].astype(np.int32)  # lowest first
        books = _Books.of(table)
        # The decision first, on the books as they will be: nothing has moved yet.
        try:
            if holes.size:
                table.mark_chunks(holes, True)
            free = cached.checked.view.empty_slots(0, table.top)  # never a lent slot
            placements = cached.checked.refill(free) if free.size else np.empty((0, 3), np.int64)
        except BaseException:
            books.restore(table)
            raise
        _sync(cached.device)  # no kernel still reads the cells that leave
        back: list[_vmm.Chunk] = []
        try:
            back = kv.unmap_cells(cells)
            arena.map_chunks(holes, back[: holes.size])
        except BaseException:
            if back:
                kv.remap_cells(before, back)
            books.restore(table)
            raise
        # Past the last fallible memory step: the blobs overwrite what the K/V left there.
        if placements.size:
            arena.upload(placements[:, 0], placements[:, 1:], cached.store)
            apply_refill(table, placements)
        spare = back[holes.size :]
        for chunk in spare:
            chunk.release()
        self.free_chunks += len(spare)
        cached.sync_mirror()
        self._trimmed(before, len(back), len(spare), placements)
        return len(back)

    def _trimmed(self, before: int, n_back: int, n_spare: int, placements: np.ndarray) -> None:
        stats = self.stats
        stats.trims += 1
        stats.returned_chunks += n_back - n_spare
        stats.freed_chunks += n_spare
        stats.refilled += int(placements.shape[0])
        stats.cells_mapped = self.kv.mapped_cells
        events = self.cached.events
        if events is None:
            return
        emit(events, Trimmed(cells_before=before, cells_after=self.kv.mapped_cells,
                             chunks_returned=n_back))
        if placements.size:
            emit(events, Refilled(placements=tuple(
                (int(s), int(layer), int(e)) for s, layer, e in placements)))
