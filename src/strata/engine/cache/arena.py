"""The arena: the slots of the expert cache, back to back in one `_vmm` range.

Dimension letters: S slots, D hidden size, F expert width.

Slot `s` occupies bytes [s * slot_bytes, (s + 1) * slot_bytes) of the range; its first
`blob_bytes` hold one expert's blob (gate [F, D] | up [F, D] | down [D, F] in the model dtype,
see `strata.engine.experts.store`, or one of the quantized formats of
`strata.engine.experts.quant`), the rest is padding up to a multiple of `SLOT_ALIGN_BYTES`.
Tensors over the slots are zero-copy views of the range, so a kernel reads an expert straight from
its slot (`stack`, a `BlobStack`, is the math over them). The arena knows nothing of which expert
is where: that is the books' (`strata._residency.ResidencyTable`).

Uploads on CUDA run on a copy stream that first waits for the compute stream (a slot being
overwritten may still be read by a kernel already queued), asynchronously from a pinned store,
and are complete when `upload` returns (one sync per batch).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from strata import _vmm
from strata.engine.experts import ExpertStore
from strata.engine.experts.blob_copies import BlobCopies
from strata.engine.experts.blobs import BlobStack
from strata.engine.experts.quant import expert_blob_bytes

__all__ = ["SLOT_ALIGN_BYTES", "Arena", "record_event", "slot_bytes_for", "wait_for"]

SLOT_ALIGN_BYTES = 256  # slots start on this boundary: aligned loads for every dtype


def slot_bytes_for(blob_bytes: int) -> int:
    """The slot size for blobs of `blob_bytes`: rounded up to `SLOT_ALIGN_BYTES`."""
    if blob_bytes < 1:
        raise ValueError(f"blob_bytes must be >= 1, got {blob_bytes}")
    return -(-blob_bytes // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES


class Arena:
    """`n_slots` slots of `slot_bytes` in one range of `backend`, mapped whole at construction.

    The blobs it holds are experts of `hidden_size` D and `expert_width` F computing in
    `dtype`, stored in `dtype` or, with `quant`, in that quantized format. With `n_slots` 0 the
    arena holds nothing and reserves nothing. `close()` releases the memory.
    """

    def __init__(
        self,
        backend: _vmm.Backend,
        n_slots: int,
        slot_bytes: int,
        *,
        hidden_size: int,
        expert_width: int,
        dtype: torch.dtype,
        quant: str | None = None,
    ) -> None:
        blob_bytes = expert_blob_bytes(expert_width, hidden_size, dtype, quant)  # ValueError
        if isinstance(n_slots, bool) or not isinstance(n_slots, int) or n_slots < 0:
            raise ValueError(f"n_slots must be an int >= 0, got {n_slots!r}")
        if slot_bytes < blob_bytes or slot_bytes % SLOT_ALIGN_BYTES:
            raise ValueError(
                f"slot_bytes {slot_bytes} must hold a blob of {blob_bytes} bytes and be a "
                f"multiple of {SLOT_ALIGN_BYTES}; use slot_bytes_for(blob_bytes) = "
                f"{slot_bytes_for(blob_bytes)}"
            )
        self.backend = backend
        self.n_slots = n_slots
        self.slot_bytes = slot_bytes
        self.blob_bytes = blob_bytes
        self.hidden_size, self.expert_width, self.dtype = hidden_size, expert_width, dtype
        self.quant = quant
        self.device = torch.device(
            "cpu" if backend.kind == "host" else f"cuda:{backend.device}"  # type: ignore[attr-defined]
        )
        self._range: _vmm.Range | None = None
        if n_slots:
            self._range = backend.reserve(n_slots * slot_bytes)
            try:
                self._range.map(0, self._range.n_chunks)
            except BaseException:
                self._range.close()
                raise
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.refresh_views()

    # --- geometry ---
    @property
    def chunk_bytes(self) -> int:
        return self.backend.chunk_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of device memory mapped for the slots (whole chunks)."""
        return 0 if self._range is None else self._range.bytes_mapped

    @property
    def closed(self) -> bool:
        return self._range is not None and self._range.closed

    # --- views ---
    def refresh_views(self) -> None:
        """Re-make the views over the slots; call after the range's mapping changes."""
        if self._range is None:
            self._slots = torch.empty((0, self.slot_bytes), dtype=torch.uint8, device=self.device)
        else:
            self._slots = self._range.view(0, (self.n_slots, self.slot_bytes), torch.uint8)
        # (store, its copies into the slots): made by the first upload from a store, by the
        # slots' addresses, so made again with the views
        self._blob_copies: tuple[ExpertStore, BlobCopies] | None = None
        self.stack = BlobStack(self._slots, self.dtype, self.quant, self.expert_width,
                               self.hidden_size)  # [S, slot_bytes]

    def slots_view(self) -> torch.Tensor:
        """uint8 [S, slot_bytes]: every slot's bytes."""
        return self._slots

    def gate_up_all(self) -> torch.Tensor:
        """[S, 2F, D]: every slot's gate rows then up rows (strided by slot_bytes; unquantized
        slots only)."""
        return self.stack.gate_up_all()

    def down_all(self) -> torch.Tensor:
        """[S, D, F]: every slot's down matrix (strided by slot_bytes; unquantized slots only)."""
        return self.stack.down_all()

    def _check_slot(self, slot: int) -> int:
        slot = int(slot)
        if not 0 <= slot < self.n_slots:
            raise IndexError(f"slot {slot} is out of range [0, {self.n_slots})")
        return slot

    def gate_up(self, slot: int) -> torch.Tensor:
        """[2F, D]: the gate and up rows of the blob in `slot`, a contiguous view (unquantized
        slots only)."""
        return self.gate_up_all()[self._check_slot(slot)]

    def down(self, slot: int) -> torch.Tensor:
        """[D, F]: the down matrix of the blob in `slot`, a contiguous view (unquantized slots
        only)."""
        return self.down_all()[self._check_slot(slot)]

    def weights(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2F, D], down [D, F]) of the blob in `slot` in the compute dtype: views, or
        the dequantized weights of a quantized blob (`BlobStack.weights`)."""
        return self.stack.weights(self._check_slot(slot))

    def each_weights(self, slots: Sequence[int]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """`weights(slot)` for each of `slots` in order (`BlobStack.each_weights`: quantized
        blobs dequantized a batch at a time)."""
        return self.stack.each_weights([self._check_slot(slot) for slot in slots])

    def grouped_rows(self, slots: Sequence[int], x_sorted: torch.Tensor,
                     counts: Sequence[int], ends: torch.Tensor | None = None) -> torch.Tensor:
        """[R, D]: x_sorted's rows by runs of counts[i] through the blob in slots[i], in
        grouped products a batch of blobs (`BlobStack.grouped_rows`, whose `ends` this is)."""
        return self.stack.grouped_rows([self._check_slot(slot) for slot in slots], x_sorted,
                                       counts, ends)

    def expert_rows(self, slot_index: torch.Tensor, x_rows: torch.Tensor) -> torch.Tensor:
        """[R, D]: row r is the expert in slot slot_index[r] over x_rows[r] (the decode path,
        `BlobStack.expert_rows`); slot_index int64 [R] on the arena's device."""
        return self.stack.expert_rows(slot_index, x_rows)

    # --- copies ---
    def upload(self, slots: Sequence[int] | np.ndarray, experts: np.ndarray, store: ExpertStore
               ) -> int:
        """Copy the blobs of `experts` int [n, 2] (layer, expert) from `store` into `slots` [n].

        Complete when it returns. Returns the bytes copied. Every argument is checked before
        anything is copied (IndexError for a slot, layer or expert out of range; ValueError for
        mismatched lengths, a slot named twice, or a store of another blob size).
        """
        slots, experts = self._checked_copies(slots, experts, store)
        if not slots.size:
            return 0
        if self._copy_stream is None:
            self._copy(slots, experts, store)
        else:
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._copy_stream):
                self._copy(slots, experts, store)
            self._copy_stream.synchronize()  # the batch's one sync: complete before any read
        return int(slots.size) * self.blob_bytes

    def upload_queued(self, slots: Sequence[int] | np.ndarray, experts: np.ndarray,
                      store: ExpertStore, after: torch.cuda.Event | None
                      ) -> torch.cuda.Event | None:
        """`upload`, queued rather than complete: on CUDA the copies go on the copy stream once
        `after` has happened (an event the caller recorded on the compute stream after the
        last kernel that reads these slots' old bytes; None: at once), and the returned event
        happens when they are done: a kernel that reads the slots must wait for it
        (`wait_for`). The host does not wait. On the host the copies are complete when it
        returns, and there is no event (None). Checked as `upload` checks."""
        slots, experts = self._checked_copies(slots, experts, store)
        if self._copy_stream is None:
            self._copy(slots, experts, store)
            return None
        if after is not None:
            self._copy_stream.wait_event(after)
        with torch.cuda.stream(self._copy_stream):
            self._copy(slots, experts, store)
            return record_event(self.device)

    def _checked_copies(self, slots: Sequence[int] | np.ndarray, experts: np.ndarray,
                        store: ExpertStore) -> tuple[np.ndarray, np.ndarray]:
        """slots int64 [n] and experts int64 [n, 2], every one checked (see `upload`)."""
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        experts = np.asarray(experts, dtype=np.int64).reshape(-1, 2)
        if slots.size != experts.shape[0]:
            raise ValueError(
                f"{slots.size} slots for {experts.shape[0]} experts; give one slot per expert"
            )
        if store.blob_bytes != self.blob_bytes:
            raise ValueError(
                f"the store's blobs are {store.blob_bytes} bytes, the arena's {self.blob_bytes}"
            )
        bad = (slots < 0) | (slots >= self.n_slots)
        if bad.any():
            self._check_slot(slots[bad][0])  # IndexError naming it
        if np.unique(slots).size != slots.size:
            raise ValueError(f"slots {slots.tolist()} name a slot twice")
        bad = (experts < 0).any(axis=1) | (experts[:, 0] >= store.n_layers) | \
            (experts[:, 1] >= store.n_experts)
        if bad.any():
            store.blob(*(int(i) for i in experts[bad][0]))  # IndexError naming it
        return slots, experts

    def _copy(self, slots: np.ndarray, experts: np.ndarray, store: ExpertStore) -> None:
        """The checked copies, on the current stream (on the host, done now): by address, a
        run of consecutive experts into consecutive slots one copy (`BlobCopies`)."""
        if self._blob_copies is None or self._blob_copies[0] is not store:
            self._blob_copies = (store, BlobCopies(store, self._slots[:, : self.blob_bytes]))
        copies = self._blob_copies[1]
        # One call a run of copies from one layer (a refill may span layers).
        cuts = np.flatnonzero(np.diff(experts[:, 0])) + 1
        for run in np.split(np.arange(slots.size), cuts):
            if run.size:
                copies.queue(int(experts[run[0], 0]),
                             list(zip(slots[run].tolist(), experts[run, 1].tolist(),
                                       strict=True)))

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy slot `src`'s bytes to slot `dst` on the device, complete when it returns."""
        src, dst = self._check_slot(src), self._check_slot(dst)
        if src == dst:
            raise ValueError(f"copy_slot: src and dst are both slot {src}")
        self._slots[dst].copy_(self._slots[src])
        if self.device.type == "cuda":
            # Complete before the caller may unmap the source's chunks or reuse it.
            torch.cuda.synchronize(self.device)

    def copy_blobs(self, moves: np.ndarray) -> None:
        """Copy the blob of slot `src` into slot `dst` for each row of `moves` int [M, 2], on
        the device, complete when it returns (one sync). The slots' padding is not copied, so
        a destination's bytes past the blob stay as they were. Sources and destinations must
        be disjoint (every copy reads bytes no other copy writes)."""
        moves = np.asarray(moves, dtype=np.int64).reshape(-1, 2)
        for slot in moves.reshape(-1):
            self._check_slot(slot)
        if np.intersect1d(moves[:, 0], moves[:, 1]).size or \
                np.unique(moves[:, 1]).size != moves.shape[0]:
            raise ValueError(f"copy_blobs: moves {moves.tolist()} must have distinct "
                             "destinations that are not sources")
        for src, dst in moves.tolist():
            self._slots[dst, : self.blob_bytes].copy_(self._slots[src, : self.blob_bytes])
        if self.device.type == "cuda":
            # Complete before the caller unmaps the sources' chunks.
            torch.cuda.synchronize(self.device)

    # --- chunks lent to the elastic K/V (strata.engine.kv.elastic) ---
    # The views are not re-made when chunks leave: they keep their addresses and stay valid
    # over the slots still mapped; nothing may read a slot that touches an unmapped chunk
    # (the books' `backed` says which may be read).
    def mapped_chunks(self) -> np.ndarray:
        """bool [n_chunks]: the arena's chunks that are mapped now."""
        if self._range is None:
            return np.zeros(0, bool)
        return self._range.mapped_mask()

    def _runs(self, chunks: np.ndarray, mapped: bool, what: str) -> list[tuple[int, int]]:
        """[lo, hi) runs of `chunks` (ascending, distinct, in range, each `mapped` now)."""
        n = 0 if self._range is None else self._range.n_chunks
        if chunks.size and (chunks[0] < 0 or chunks[-1] >= n or (np.diff(chunks) <= 0).any()):
            raise ValueError(f"{what}: chunks {chunks.tolist()} must be ascending, distinct "
                             f"and in [0, {n})")
        if chunks.size and (self.mapped_chunks()[chunks] != mapped).any():
            state = "mapped" if mapped else "unmapped"
            raise ValueError(f"{what}: chunks {chunks.tolist()} must all be {state}")
        cuts = np.flatnonzero(np.diff(chunks) != 1) + 1
        return [(int(run[0]), int(run[-1]) + 1) for run in np.split(chunks, cuts) if run.size]

    def unmap_chunks(self, chunks: Sequence[int] | np.ndarray) -> list[_vmm.Chunk]:
        """Unmap the arena's chunks at indices `chunks` (ascending) and hand over their physical
        chunks, in that order, bytes intact. All or nothing: if a run fails to unmap, the runs
        already unmapped are mapped back with their chunks before the error propagates."""
        chunks = np.asarray(chunks, dtype=np.int64).reshape(-1)
        runs = self._runs(chunks, True, "unmap_chunks")
        taken: list[tuple[int, int, list[_vmm.Chunk]]] = []
        assert self._range is not None or not runs
        try:
            for lo, hi in runs:
                taken.append((lo, hi, self._range.unmap(lo, hi)))
        except BaseException:
            for lo, hi, physical in taken:
                self._range.map(lo, hi, chunks=physical)
            raise
        return [chunk for _, _, physical in taken for chunk in physical]

    def map_chunks(self, chunks: Sequence[int] | np.ndarray, physical: Sequence[_vmm.Chunk]
                   ) -> None:
        """Map `physical` (unmapped chunks of the arena's backend, one per index) at the arena's
        unmapped chunk indices `chunks` (ascending), keeping their bytes. All or nothing: on a
        failure the runs already mapped are unmapped again and every chunk is the caller's."""
        chunks = np.asarray(chunks, dtype=np.int64).reshape(-1)
        physical = list(physical)
        if len(physical) != chunks.size:
            raise ValueError(f"map_chunks: {len(physical)} chunks for {chunks.size} indices")
        runs = self._runs(chunks, False, "map_chunks")
        done: list[tuple[int, int]] = []
        assert self._range is not None or not runs
        try:
            used = 0
            for lo, hi in runs:
                self._range.map(lo, hi, chunks=physical[used : used + hi - lo])
                used += hi - lo
                done.append((lo, hi))
        except BaseException:
            for lo, hi in done:
                self._range.unmap(lo, hi)
            raise

    def close(self) -> None:
        """Unmap and release the slots; the views must not be used afterwards. Idempotent."""
        if self._range is not None:
            self._slots = torch.empty((0, self.slot_bytes), dtype=torch.uint8, device=self.device)
            self._blob_copies = None  # a copy after close finds no slot (IndexError)
            self.stack = BlobStack(self._slots, self.dtype, self.quant, self.expert_width,
                                   self.hidden_size)
            self._range.close()


def record_event(device: torch.device) -> torch.cuda.Event | None:
    """An event recorded now on `device`'s current stream: it happens once everything queued
    there so far has run. None off CUDA, where work is complete when it returns."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def wait_for(event: torch.cuda.Event | None, device: torch.device) -> None:
    """`device`'s current stream waits for `event` (from `upload_queued` or `record_event`)
    before what is queued next; nothing for None."""
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)
