"""`CacheExecutor`: the one place a checked decision is carried out on the expert cache.

Carrying out a decision is four steps, always in this order: the bytes (blobs uploaded from
the host store or copied between slots, arena chunks unmapped or mapped), the books
(`strata.books.apply`), the device mirror of the books, the events. Admission, the prompt
loan (lending and refilling), the initial fill and the elastic K/V (give-up and trim) all
make their changes inside one `change()`:

    with executor.change() as change:
        evicted = change.admit(layer, placements)

and each change is all or nothing. If anything inside the block raises, the change is rolled
back before the error propagates: the memory steps it took are undone newest first (chunks
mapped back, with their bytes), the books are put back as they were when the block began, and
every slot whose bytes were written gets its own expert's blob again from the host store (or,
if even that fails, is left empty in the books), so the books never name a slot whose blob is
not there. The mirror is re-uploaded either way, and complete before the block returns or
raises, so no kernel reads it stale; the events are told only for a change that completed.

The policy (`listener`, the cache's `CheckedPolicy`) is told every entry and exit of an expert
right after the books make it, in their order (`entered`, `left`, `moved`, with the reason):
`fill`, `admit`, `refill` (the loan's slots after a prompt), `trim` (a refill in a change
that mapped arena chunks back: a K/V trim), `relocate`, `give_up`, `loan` (slots lent), and
`rollback` for the books put back after a change failed.

Units: slots are expert-cache slots; chunks are the memory backend's physical chunks, indexed
within the arena; bytes are counted as they are uploaded (`on_upload`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import pluggy
import torch

from strata import _vmm
from strata._residency import ResidencyTable
from strata.books import GiveUpPlan, apply_admit, apply_give_up, apply_refill
from strata.books.apply import Listener
from strata.engine.cache.arena import Arena
from strata.engine.experts import ExpertStore
from strata.policies import emit
from strata.policies.events import Admitted, Event, Evicted, GaveUp, Refilled, Relocated

__all__ = ["CacheChange", "CacheExecutor", "sync_device"]


def sync_device(device: torch.device) -> None:
    """Wait for every kernel queued on `device` (nothing to wait for off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pairs(rows: np.ndarray) -> tuple[tuple[int, int], ...]:
    return tuple((int(a), int(b)) for a, b in rows)


def _triples(rows: np.ndarray) -> tuple[tuple[int, int, int], ...]:
    return tuple((int(s), int(lay), int(e)) for s, lay, e in rows)


@dataclass(frozen=True)
class _Books:
    """A copy of what changes may touch in the books: residents, mapped chunks, top."""

    owner: np.ndarray  # int32 [S]
    chunk_mapped: np.ndarray  # bool [n_chunks]
    top: int

    @classmethod
    def of(cls, table: ResidencyTable) -> _Books:
        return cls(table.owner.copy(), table.chunk_mapped.copy(), table.top)

    def restore(self, table: ResidencyTable) -> None:
        """Put the books back as they were; each table call checks before it changes anything."""
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


class CacheExecutor:
    """Carries out decisions on the cache of `arena` (the bytes) whose books are `table`
    (ValueError unless the three describe one cache on `device`).

    `store` holds every expert's blob (the source of uploads and of rollbacks); `events` is the
    plugin manager told each completed change's events (None: nobody); `on_upload(n_bytes,
    seconds)` is told every upload and how long it took, for the caller's figures. `mirror` is
    the books' `res` on `device`. `listener` is told every entry and exit of an expert (None:
    nobody).
    """

    def __init__(
        self,
        store: ExpertStore,
        arena: Arena,
        table: ResidencyTable,
        device: torch.device,
        *,
        events: pluggy.PluginManager | None = None,
        on_upload: Callable[[int, float], None] | None = None,
        listener: Listener | None = None,
    ) -> None:
        _check_parts(store, arena, table, device)
        self.store, self.arena, self.table = store, arena, table
        self.listener = listener
        self.device = device
        self.events = events
        self.on_upload = on_upload
        self.mirror = torch.full((table.n_layers, table.n_experts), -1, dtype=torch.int32,
                                 device=device)  # [L, E]: the books' res, on the device
        self.sync_mirror()

    def sync_mirror(self) -> None:
        """Upload the books' `res` to the device mirror; complete when it returns."""
        self.mirror.copy_(torch.from_numpy(np.array(self.table.res, dtype=np.int32)))
        sync_device(self.device)

    def upload(self, slots: Sequence[int] | np.ndarray, experts: np.ndarray) -> int:
        """Copy (layer, expert) blobs int [n, 2] from the store into `slots`, complete when it
        returns. Bytes only: the books are the caller's (inside a change, `CacheChange.upload`
        also marks the slots written, for a rollback)."""
        started = time.perf_counter()
        n_bytes = self.arena.upload(slots, experts, self.store)
        if self.on_upload is not None:
            self.on_upload(n_bytes, time.perf_counter() - started)
        return n_bytes

    def upload_queued(self, slots: np.ndarray, experts: np.ndarray,
                      after: torch.cuda.Event | None) -> torch.cuda.Event | None:
        """`upload` queued after `after`, not complete when it returns (`Arena.upload_queued`):
        the returned event (None on the host, where it is complete) is what a reader of the
        slots waits for. `on_upload` is told the bytes and the host's time to queue them."""
        started = time.perf_counter()
        done = self.arena.upload_queued(slots, experts, self.store, after)
        if self.on_upload is not None:
            self.on_upload(int(np.asarray(slots).size) * self.arena.blob_bytes,
                           time.perf_counter() - started)
        return done

    @contextmanager
    def change(self) -> Iterator[CacheChange]:
        """A change of the cache, all or nothing (see the module's docstring)."""
        change = CacheChange(self)
        try:
            yield change
        except BaseException as exc:
            try:
                change.roll_back()
            finally:
                self.sync_mirror()
            if change.rollback_error is not None:
                exc.add_note(f"telling the policy of the rollback raised too: "
                             f"{change.rollback_error!r}")
            raise
        self.sync_mirror()
        if self.events is not None:
            for event in change.events:
                emit(self.events, event)


class CacheChange:
    """One change in progress: its steps, what undoes their memory side, its events."""

    def __init__(self, executor: CacheExecutor) -> None:
        self.executor = executor
        self.table = executor.table
        self.events: list[Event] = []
        self._books = _Books.of(executor.table)
        self._undo: list[Callable[[], None]] = []  # memory steps' undos, oldest first
        self._written = np.zeros(executor.table.n_slots, bool)  # slots whose bytes changed
        self.listener = executor.listener
        self._mapped_back = False  # arena chunks were marked mapped again: this is a trim
        self.rollback_error: Exception | None = None  # what telling the rollback raised

    def _tell(self, kind: str, why: str, rows: np.ndarray) -> None:
        if self.listener is not None:
            self.listener.tell(kind, why, rows)

    # --- steps ---
    def upload(self, slots: np.ndarray, experts: np.ndarray) -> None:
        """The blobs of (layer, expert) int [n, 2] into `slots`."""
        slots = np.asarray(slots)
        self._written[slots] = True
        self.executor.upload(slots, experts)

    def fill(self, placements: np.ndarray) -> None:
        """Placements (slot, layer, expert) int [n, 3] into empty slots: books, then bytes
        (a start, when no kernel reads the slots yet)."""
        slots = placements[:, 0].astype(np.int32)
        self.table.assign_many(slots, placements[:, 1].astype(np.int32),
                               placements[:, 2].astype(np.int32))
        self._tell("entered", "fill", placements)
        self.upload(slots, placements[:, 1:])

    def admit(self, layer: int, placements: np.ndarray) -> np.ndarray:
        """A checked admission of `layer`'s misses: the books, then the blobs. Returns int32
        [n, 2] (layer, expert) of the residents it evicted."""
        evicted = apply_admit(self.table, placements, self.listener)
        self.upload(placements[:, 0], placements[:, 1:])
        self.events.append(Admitted(layer=layer, placements=_triples(placements)))
        if evicted.size:
            self.events.append(Evicted(experts=_pairs(evicted)))
        return evicted

    def refill(self, placements: np.ndarray) -> None:
        """A checked refill of empty slots: the blobs first, then the books, so that the books
        never name a slot whose blob is not there. Told as `trim` in a change that mapped arena
        chunks back (`mark_mapped`), else as `refill`."""
        if not placements.size:
            return
        self.upload(placements[:, 0], placements[:, 1:])
        apply_refill(self.table, placements, self.listener,
                     why="trim" if self._mapped_back else "refill")
        self.events.append(Refilled(placements=_triples(placements)))

    def evict(self, slots: np.ndarray) -> np.ndarray:
        """Empty `slots` in the books (their bytes stay). Returns the evicted (layer, expert)."""
        slots = np.asarray(slots, np.int32)
        occupied = slots[self.table.owner[slots] >= 0]
        if not occupied.size:
            return np.empty((0, 2), np.int32)
        evicted = self.table.evict_many(occupied)
        self._tell("left", "loan", np.column_stack([occupied, evicted]))
        self.events.append(Evicted(experts=_pairs(evicted)))
        return evicted

    def set_top(self, top: int) -> None:
        """Move `top`, the first slot of the loan region."""
        self.table.set_regions(top=top)

    def mark_mapped(self, chunks: np.ndarray) -> None:
        """Mark arena chunks mapped in the books before they are (a decision on the books as
        they will be); the memory step is `map_chunks`."""
        if chunks.size:
            self.table.mark_chunks(chunks, True)
            self._mapped_back = True

    def give_up(self, plan: GiveUpPlan) -> list[_vmm.Chunk]:
        """A checked give-up: relocations copied (device to device, complete before their
        sources go), the plan's chunks unmapped from the arena (bytes intact), the books
        applied. Returns the chunks, for the K/V to map; undone by mapping them back."""
        arena = self.executor.arena
        sync_device(self.executor.device)  # no kernel still reads a slot whose chunk leaves
        if plan.moves.size:
            self._written[plan.moves[:, 1]] = True
            arena.copy_blobs(plan.moves)
        taken = arena.unmap_chunks(plan.chunks)
        self._undo.append(lambda: arena.map_chunks(plan.chunks, taken))
        evicted = apply_give_up(self.table, plan, self.listener)
        if plan.moves.size:
            self.events.append(Relocated(moves=_pairs(plan.moves)))
        self.events.append(GaveUp(slots=tuple(int(s) for s in plan.slots),
                                  chunks=int(plan.chunks.size), evicted=_pairs(evicted)))
        return taken

    def map_chunks(self, chunks: np.ndarray, given: Sequence[_vmm.Chunk]) -> None:
        """Map `given` physical chunks at arena chunks `chunks` (all or nothing; the books are
        `mark_mapped`'s); undone by unmapping them again (the same chunk objects, bytes
        intact, for whoever gave them to take back)."""
        if chunks.size:
            arena = self.executor.arena
            arena.map_chunks(chunks, list(given))
            self._undo.append(lambda: arena.unmap_chunks(chunks))

    def on_undo(self, undo: Callable[[], None]) -> None:
        """Register the undo of a memory step taken outside the cache (the K/V's)."""
        self._undo.append(undo)

    def emit(self, event: Event) -> None:
        """An event to tell when the change completes."""
        self.events.append(event)

    # --- rollback ---
    def _tell_restored(self, before: np.ndarray) -> None:
        """Tell the policy what putting the books back changed (`rollback`): who left, then
        who entered again. A policy that raises here does not hide the failure being rolled
        back: its error is noted on that one."""
        now, n_experts = self.table.owner, self.table.n_experts
        changed = np.flatnonzero(now != before)
        gone, back = changed[before[changed] >= 0], changed[now[changed] >= 0]
        try:
            self._tell("left", "rollback", np.column_stack(
                [gone, before[gone] // n_experts, before[gone] % n_experts]))
            self._tell("entered", "rollback", np.column_stack(
                [back, now[back] // n_experts, now[back] % n_experts]))
        except Exception as exc:  # the change's own error is the one to see
            self.rollback_error = exc

    def roll_back(self) -> None:
        """Undo the memory steps newest first, restore the books, re-upload the blobs of the
        restored residents whose slots were written."""
        for undo in reversed(self._undo):
            undo()
        before = self.table.owner.copy()
        self._books.restore(self.table)
        self._tell_restored(before)
        written = np.flatnonzero(self._written & (self.table.owner >= 0)).astype(np.int32)
        if not written.size:
            return
        flat = self.table.owner[written].astype(np.int64)
        n_experts = self.table.n_experts
        experts = np.stack([flat // n_experts, flat % n_experts], axis=1)
        try:
            self.executor.upload(written, experts)
        except BaseException:
            self.table.evict_many(written)  # their bytes are unknown: leave them empty
            raise


def _check_parts(store: ExpertStore, arena: Arena, table: ResidencyTable,
                 device: torch.device) -> None:
    """ValueError unless the store, the arena and the books describe one cache on `device`."""
    if arena.device != device:
        raise ValueError(f"the arena is on {arena.device}, the experts run on {device}")
    geometry = (table.n_layers, table.n_experts, table.n_slots, table.slot_bytes,
                table.chunk_bytes)
    expected = (store.n_layers, store.n_experts, arena.n_slots, arena.slot_bytes,
                arena.chunk_bytes)
    if geometry != expected:
        raise ValueError(
            f"the books' (layers, experts, slots, slot_bytes, chunk_bytes) {geometry} do "
            f"not match the store's and the arena's {expected}"
        )
    if arena.blob_bytes != store.blob_bytes:
        raise ValueError(f"the arena holds blobs of {arena.blob_bytes} bytes, the store "
                         f"{store.blob_bytes}")
