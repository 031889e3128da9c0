"""Virtual memory ranges backed by physical chunks, on the host (mmap) or on a CUDA device.

A `Backend` owns the physical side (chunks) and reserves `Range`s: address ranges whose
addresses never move, into which chunks are mapped and out of which they are unmapped,
keeping their bytes. Chunk indices are relative to the range; byte offsets are too.
"""

from collections.abc import Sequence

import numpy as np
import torch

class VmmError(RuntimeError):
    """A system or driver call failed (or a fault was injected); the range is as it was."""

class Chunk:
    """One physical allocation of `chunk_bytes`, owned by whoever holds this object.

    Mapped into a range, the range holds it; unmapped, it is handed back to the caller, and
    dropping it (or `release()`) frees the memory.
    """

    @property
    def backend(self) -> Backend: ...
    @property
    def released(self) -> bool: ...
    @property
    def mapped(self) -> bool: ...
    def release(self) -> None:
        """Free the physical memory now. Idempotent; an error while the chunk is mapped."""

class Backend:
    """The physical side of one kind of memory: `host` or `cuda`."""

    @property
    def kind(self) -> str: ...
    @property
    def chunk_bytes(self) -> int: ...
    @property
    def alive_chunks(self) -> int:
        """Physical chunks of this backend not yet released (mapped or held)."""
    @property
    def bytes_mapped(self) -> int:
        """Bytes mapped in all open ranges of this backend."""
    @property
    def held_ranges(self) -> int:
        """Closed ranges of this backend whose addresses are held by views still alive."""
    def reserve(self, nbytes: int) -> Range:
        """Reserve a range of `nbytes` rounded up to whole chunks; nothing is mapped."""
    def create_chunks(self, n: int) -> list[Chunk]:
        """Create `n` unmapped physical chunks (all or none)."""
    def inject_fault(self, op: str, nth: int = 1) -> None:
        """Make the `nth` next call of `op` ('create', 'map' or 'access') fail with VmmError.

        Counting starts now; one pending fault per op; `clear_faults()` cancels them.
        """
    def clear_faults(self) -> None: ...
    def close(self) -> None:
        """Close every range of this backend; chunks held by callers stay valid until dropped."""

class HostBackend(Backend):
    """memfd-backed chunks mapped with mmap(MAP_FIXED | MAP_SHARED) into PROT_NONE reservations."""

    def close(self) -> None:
        """Close every range, then the memfd files once no chunk of this backend is alive (a
        later chunk opens a new file)."""

    def __init__(self, chunk_bytes: int | None = None) -> None:
        """`chunk_bytes`: a page multiple that divides 8 GiB; None: 2 MiB (`DEFAULT_CHUNK_BYTES`).

        The environment is not read here: `strata.engine.memory.device_backend` passes the
        `STRATA_VMM_CHUNK_BYTES` setting (`strata.settings`).
        """

class CudaBackend(Backend):
    """The driver's virtual memory API on one device, in its primary context."""

    def __init__(self, device: int = 0) -> None: ...
    @property
    def device(self) -> int: ...

class Range:
    """A reserved address range of `n_chunks` chunks of `chunk_bytes`."""

    @property
    def backend(self) -> Backend: ...
    @property
    def address(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def n_chunks(self) -> int: ...
    @property
    def chunk_bytes(self) -> int: ...
    @property
    def n_mapped(self) -> int: ...
    @property
    def bytes_mapped(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    def is_mapped(self, index: int) -> bool: ...
    def mapped_mask(self) -> np.ndarray:
        """A bool array [n_chunks], a copy."""
    def map(self, lo: int, hi: int, chunks: Sequence[Chunk] | None = None) -> int:
        """Map every unmapped chunk index in [lo, hi); return how many were mapped.

        The given chunks are used first, in order, then new ones are created. Indices already
        mapped are skipped. Access is set once per contiguous run. On any failure the range is
        exactly as before, chunks created by this call are released and the given ones stay
        unmapped and the caller's.
        """
    def unmap(self, lo: int, hi: int) -> list[Chunk]:
        """Unmap every mapped chunk index in [lo, hi); return their chunks in index order.

        The chunks keep their bytes. If a run fails to unmap, the runs this call already unmapped
        are mapped back before the error is raised.
        """
    def view(self, offset: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A zero-copy tensor over bytes [offset, offset + nbytes) of the range.

        Every chunk it covers must be mapped (else ValueError). The view must not be used after
        those chunks are unmapped or the range is closed. A view kept past `close` still names
        addresses nothing else is given: the range's addresses stay reserved until its last
        view is freed (on the host it reads zeros meanwhile; on CUDA a read faults).
        """
    def close(self) -> None:
        """Unmap and release every chunk, then free the address range, or, while a view of it
        is alive, hold the range's addresses until the last view is freed (`view`).
        Idempotent."""

def open_backend(kind: str, **options) -> Backend:
    """`host` or `cuda` (options: `chunk_bytes` for host, `device` for cuda)."""

def alive_chunks() -> int:
    """Physical chunks alive in this process, over every backend."""

HUGE_PAGE_BYTES: int
PAGES_FAULT_OPS: tuple[str, ...]

class HostPages:
    """`nbytes` of zeroed host memory in one anonymous mapping (advised to use huge pages with
    `huge`), as a writable buffer (`torch.frombuffer(pages, dtype=torch.uint8)` views it and
    keeps it alive).

    The mapping is `mapped_bytes`: `nbytes` rounded up to whole huge pages, starting on one
    (under one huge page and not `huge`: to whole small pages).
    Freed when the last reference goes; registered pages are unregistered first, after the
    device is synchronised. ValueError for nbytes < 1; VmmError if the mapping fails.
    """

    def __init__(self, nbytes: int, huge: bool = False) -> None: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def mapped_bytes(self) -> int: ...
    @property
    def huge_pages(self) -> bool:
        """Whether the kernel took the advice to back the pages with huge pages."""
    @property
    def registered_device(self) -> int | None:
        """The CUDA device the pages were registered with, or None."""
    @property
    def address(self) -> int: ...
    def register(self, device: int = 0) -> None:
        """Page-lock the pages for CUDA (`cuMemHostRegister`, portable), once; VmmError naming
        the driver's error, the pages left as they were."""
    def unregister(self) -> None:
        """Undo `register` after synchronising the device (nothing if not registered); the
        pages stay mapped until their last reference goes. Owners call it at their close: a
        synchronisation while a CUDA graph is captured would break the capture."""

def inject_pages_fault(op: str, nth: int = 1) -> None:
    """Make the nth next `op` ('map' or 'register') of any HostPages fail with VmmError."""

def clear_pages_faults() -> None: ...
def alive_host_pages() -> tuple[int, int]:
    """(HostPages alive in this process, the bytes they map)."""
