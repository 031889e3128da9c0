"""Virtual memory ranges backed by physical chunks, on the host (mmap) or on a CUDA device.

Ownership: a `Backend` creates physical `Chunk`s and reserves `Range`s. A mapped chunk belongs to
its range; `Range.unmap` hands chunks back to the caller, bytes intact, and a chunk nobody holds is
released. No object here points back at its owner's owner (a range keeps its backend, a chunk its
backend, the backend only weak references to its ranges), so there are no reference cycles and
`__dealloc__` frees everything even when `close()` was never called.

Atomicity: `map` and `unmap` either finish or leave the range exactly as it was. Faults can be
injected into `create`, `map`, `access` and `unmap` to test that.

`HostPages` (_vmm_pages.pxi) is the other kind of memory here: one mapping of host pages
(for the expert store, and for each parked conversation), optionally in huge pages and
page-locked for CUDA.

Not thread-safe: one owner (the engine's thread) drives a backend and its ranges.
"""

import heapq
import mmap as _pymmap
import operator
import os
import weakref

cimport cython
from libc.errno cimport errno
from libc.string cimport strerror
from posix.mman cimport (
    MAP_ANONYMOUS,
    MAP_FAILED,
    MAP_FIXED,
    MAP_NORESERVE,
    MAP_PRIVATE,
    MAP_SHARED,
    PROT_NONE,
    PROT_READ,
    PROT_WRITE,
    mmap,
    mprotect,
    munmap,
)
from posix.types cimport off_t
from posix.unistd cimport close as c_close


cdef extern from "<fcntl.h>" nogil:
    int fallocate(int fd, int mode, off_t offset, off_t length)

cdef extern from "<linux/falloc.h>" nogil:
    int FALLOC_FL_KEEP_SIZE
    int FALLOC_FL_PUNCH_HOLE


DEFAULT_CHUNK_BYTES = 2 << 20
# Host chunks live as offsets in a few large sparse memfd files (the process may open 20,000 files
# and map 65,530 regions; one file per chunk would run out of both).
HOST_FILE_BYTES = 8 << 30

cdef int OP_CREATE = 0
cdef int OP_MAP = 1
cdef int OP_ACCESS = 2
cdef int OP_UNMAP = 3
FAULT_OPS = ("create", "map", "access", "unmap")

# Physical chunks alive in this process, over every backend (for leak tests).
cdef Py_ssize_t _alive_chunks_total = 0


class VmmError(RuntimeError):
    """A system or driver call failed (or a fault was injected); the range is as it was."""


def alive_chunks():
    """Physical chunks alive in this process, over every backend."""
    return _alive_chunks_total


def _check_index_range(lo, hi, n, what):
    try:
        lo, hi = operator.index(lo), operator.index(hi)
    except TypeError:
        raise TypeError(f"{what}: lo and hi must be ints, got {lo!r}, {hi!r}") from None
    if not 0 <= lo <= hi <= n:
        raise IndexError(f"{what}: chunk range [{lo}, {hi}) is outside [0, {n}]")
    return lo, hi


@cython.no_gc_clear
cdef class Chunk:
    """One physical allocation of `chunk_bytes`, owned by whoever holds this object.

    Mapped into a range, the range holds it; unmapped, it is handed back to the caller, and
    dropping it (or `release()`) frees the memory.
    """

    cdef readonly Backend backend
    # host: the memfd file index and byte offset; cuda: the driver's allocation handle.
    cdef Py_ssize_t file_index
    cdef off_t offset
    cdef unsigned long long handle
    cdef bint _released
    cdef bint _mapped

    @property
    def released(self):
        return self._released

    @property
    def mapped(self):
        return self._mapped

    def release(self):
        """Free the physical memory now. Idempotent; an error while the chunk is mapped."""
        if self._mapped:
            raise ValueError("cannot release a mapped chunk: unmap it from its range first")
        self._release()

    cdef _release(self):
        global _alive_chunks_total
        if self._released:
            return
        self._released = True
        _alive_chunks_total -= 1
        self.backend._alive -= 1
        self.backend._release_chunk(self)

    def __dealloc__(self):
        if not self._released and self.backend is not None:
            # A mapped chunk is only dropped with its range's memory already gone (Range.__dealloc__).
            self._mapped = False
            self._release()

    def __repr__(self):
        state = "released" if self._released else ("mapped" if self._mapped else "held")
        return f"<Chunk {self.backend.kind} {state}>"


@cython.no_gc_clear
cdef class Backend:
    """The physical side of one kind of memory: `host` or `cuda`."""

    cdef readonly str kind
    cdef readonly Py_ssize_t chunk_bytes
    cdef Py_ssize_t _alive
    cdef Py_ssize_t _bytes_mapped
    cdef Py_ssize_t _n_held  # closed ranges whose addresses their live views still hold
    cdef int _countdown[4]
    cdef object _ranges  # weakref.WeakSet of open Range objects

    def __cinit__(self, *args, **kwargs):
        self._ranges = weakref.WeakSet()
        for op in range(4):
            self._countdown[op] = 0

    @property
    def alive_chunks(self):
        """Physical chunks of this backend not yet released (mapped or held)."""
        return self._alive

    @property
    def bytes_mapped(self):
        """Bytes mapped in all open ranges of this backend."""
        return self._bytes_mapped

    @property
    def held_ranges(self):
        """Closed ranges of this backend whose addresses are held by views still alive."""
        return self._n_held

    def inject_fault(self, op, nth=1):
        """Make the `nth` next call of `op` ('create', 'map', 'access', 'unmap') fail with VmmError.

        Counting starts now; one pending fault per op; `clear_faults()` cancels them.
        """
        if op not in FAULT_OPS:
            raise ValueError(f"inject_fault: unknown op {op!r}; expected one of {FAULT_OPS}")
        if not isinstance(nth, int) or nth < 1:
            raise ValueError(f"inject_fault: nth must be a positive int, got {nth!r}")
        self._countdown[FAULT_OPS.index(op)] = nth

    def clear_faults(self):
        for op in range(4):
            self._countdown[op] = 0

    cdef int _tick(self, int op) except -1:
        if self._countdown[op] > 0:
            self._countdown[op] -= 1
            if self._countdown[op] == 0:
                raise VmmError(f"injected fault in {FAULT_OPS[op]}")
        return 0

    def reserve(self, nbytes):
        """Reserve a range of `nbytes` rounded up to whole chunks; nothing is mapped."""
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"reserve: nbytes must be a positive int, got {nbytes!r}")
        n_chunks = -(-nbytes // self.chunk_bytes)
        address = self._reserve(n_chunks * self.chunk_bytes)
        cdef Range rng = Range.__new__(Range)
        rng._init(self, address, n_chunks)
        self._ranges.add(rng)
        return rng

    def create_chunks(self, n):
        """Create `n` unmapped physical chunks (all or none)."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"create_chunks: n must be a non-negative int, got {n!r}")
        return self._create(n)

    cdef list _create(self, Py_ssize_t n):
        global _alive_chunks_total
        cdef list made = []
        cdef Chunk chunk
        try:
            for _ in range(n):
                self._tick(OP_CREATE)
                chunk = Chunk.__new__(Chunk)
                chunk._released = True  # not counted until the allocation exists
                self._create_chunk(chunk)
                chunk.backend = self
                chunk._released = False
                _alive_chunks_total += 1
                self._alive += 1
                made.append(chunk)
        except BaseException:
            for chunk in made:
                chunk._release()
            raise
        return made

    def close(self):
        """Close every range of this backend; chunks held by callers stay valid until dropped."""
        for rng in list(self._ranges):
            rng.close()

    # --- the primitives each backend implements; `address` is an absolute address ---
    cdef object _reserve(self, Py_ssize_t nbytes):
        raise NotImplementedError

    cdef _free_reservation(self, object address, Py_ssize_t nbytes):
        raise NotImplementedError

    cdef _hold(self, object address, Py_ssize_t nbytes):
        """A closed range whose views are still alive keeps its (unmapped) addresses reserved
        until the last view goes (`_free_held`), so that no later mapping lands under a stale
        view. Never raises: close has already released the chunks."""
        self._n_held += 1
        try:
            self._hold_reservation(address, nbytes)
        except Exception:
            pass  # reserved all the same, only not readable

    cdef _free_held(self, object address, Py_ssize_t nbytes):
        """The last view of a held range is gone: its addresses are freed."""
        self._n_held -= 1
        self._release_hold(address, nbytes)

    cdef _hold_reservation(self, object address, Py_ssize_t nbytes):
        # What a backend does to a held range's addresses so that a stale view reads zeros.
        pass

    cdef _release_hold(self, object address, Py_ssize_t nbytes):
        self._free_reservation(address, nbytes)

    cdef _create_chunk(self, Chunk chunk):
        raise NotImplementedError

    cdef _release_chunk(self, Chunk chunk):
        raise NotImplementedError

    cdef _map_chunk(self, object address, Chunk chunk):
        raise NotImplementedError

    cdef _set_access(self, object address, Py_ssize_t nbytes):
        raise NotImplementedError

    cdef _unmap_chunks(self, object address, Py_ssize_t n_chunks):
        raise NotImplementedError

    cdef object _tensor(self, object span, Py_ssize_t address, Py_ssize_t nbytes):
        raise NotImplementedError


def _os_error(what):
    return VmmError(f"{what} failed: {strerror(errno).decode()}")


@cython.no_gc_clear
cdef class HostBackend(Backend):
    """memfd-backed chunks mapped with mmap(MAP_FIXED | MAP_SHARED) into PROT_NONE reservations.

    `set access` is an mprotect to read/write once per contiguous run, so the host follows the
    same map-then-access steps as the driver, and faults can be injected into each.
    """

    cdef list _fds          # memfd descriptors, each HOST_FILE_BYTES of sparse file
    # (file_index, offset) of released chunks, a heap: the lowest is reused first, so chunks
    # created together lie at consecutive offsets and the kernel merges their mappings (a process
    # may hold only 65,530 mappings).
    cdef list _free
    cdef off_t _next_offset  # first never-used offset in the last file

    def __init__(self, chunk_bytes=None):
        """`chunk_bytes`: a multiple of the page size that divides HOST_FILE_BYTES; None: 2 MiB.

        The environment is not read here: `strata.engine.memory.device_backend` passes the
        `STRATA_VMM_CHUNK_BYTES` setting (`strata.settings`).
        """
        if chunk_bytes is None:
            chunk_bytes = DEFAULT_CHUNK_BYTES
        page = _pymmap.PAGESIZE
        if not isinstance(chunk_bytes, int) or chunk_bytes <= 0 or chunk_bytes % page:
            raise ValueError(
                f"chunk_bytes={chunk_bytes!r}: expected a positive multiple of the page size ({page})"
            )
        if HOST_FILE_BYTES % chunk_bytes:
            raise ValueError(f"chunk_bytes={chunk_bytes} must divide {HOST_FILE_BYTES}")
        self.kind = "host"
        self.chunk_bytes = chunk_bytes
        self._fds = []
        self._free = []
        self._next_offset = HOST_FILE_BYTES  # forces a file on first use

    cdef object _reserve(self, Py_ssize_t nbytes):
        cdef void* p = mmap(NULL, nbytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        if p == MAP_FAILED:
            raise _os_error(f"reserving {nbytes} bytes of address space")
        return <Py_ssize_t>p

    cdef _free_reservation(self, object address, Py_ssize_t nbytes):
        if munmap(<void*><Py_ssize_t>address, nbytes) != 0:
            raise _os_error("munmap of a reservation")

    cdef _hold_reservation(self, object address, Py_ssize_t nbytes):
        # The unmapped chunks are PROT_NONE anonymous pages (`_unmap_chunks`): readable, a
        # stale view reads zeros (the shared zero page, no memory) instead of faulting. A write
        # still faults. If mprotect fails the range stays PROT_NONE, reserved all the same.
        self._tick(OP_ACCESS)
        if mprotect(<void*><Py_ssize_t>address, nbytes, PROT_READ) != 0:
            raise _os_error("mprotect of a held range")

    cdef _create_chunk(self, Chunk chunk):
        if self._free:
            chunk.file_index, chunk.offset = heapq.heappop(self._free)
            return
        if self._next_offset >= HOST_FILE_BYTES:
            fd = os.memfd_create("strata-chunks", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, HOST_FILE_BYTES)
            except OSError as err:
                os.close(fd)
                raise VmmError(f"sizing a memfd file: {err}") from err
            self._fds.append(fd)
            self._next_offset = 0
        chunk.file_index = len(self._fds) - 1
        chunk.offset = self._next_offset
        self._next_offset += self.chunk_bytes

    cdef _release_chunk(self, Chunk chunk):
        cdef int fd = self._fds[chunk.file_index]
        # Give the pages back to the system; the offset reads zeros when reused.
        fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, chunk.offset, self.chunk_bytes)
        heapq.heappush(self._free, (chunk.file_index, chunk.offset))

    cdef _map_chunk(self, object address, Chunk chunk):
        cdef void* want = <void*><Py_ssize_t>address
        cdef int fd = self._fds[chunk.file_index]
        cdef void* p = mmap(want, self.chunk_bytes, PROT_NONE, MAP_SHARED | MAP_FIXED, fd, chunk.offset)
        if p == MAP_FAILED:
            raise _os_error("mmap of a chunk")

    cdef _set_access(self, object address, Py_ssize_t nbytes):
        if mprotect(<void*><Py_ssize_t>address, nbytes, PROT_READ | PROT_WRITE) != 0:
            raise _os_error("mprotect of a chunk run")

    cdef _unmap_chunks(self, object address, Py_ssize_t n_chunks):
        cdef Py_ssize_t nbytes = n_chunks * self.chunk_bytes
        # Replacing the chunks with a fresh PROT_NONE reservation is one atomic step: the address
        # range is never free for another mmap to take.
        cdef void* p = mmap(
            <void*><Py_ssize_t>address, nbytes, PROT_NONE,
            MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0,
        )
        if p == MAP_FAILED:
            raise _os_error("unmapping a chunk run")

    cdef object _tensor(self, object span, Py_ssize_t address, Py_ssize_t nbytes):
        import torch

        return torch.frombuffer(span, dtype=torch.uint8, count=nbytes)

    def close(self):
        """Close every range of this backend, then, when no chunk of it is alive any more,
        close its memfd files now rather than when the backend is dropped (a long-lived
        process opens and closes engines). A later chunk opens a new file."""
        Backend.close(self)
        if self._alive == 0 and self._fds:
            for fd in self._fds:
                c_close(fd)
            self._fds = []
            self._free = []
            self._next_offset = HOST_FILE_BYTES

    def __dealloc__(self):
        # Chunks keep their backend alive, so no chunk is left when this runs.
        if self._fds is not None:
            for fd in self._fds:
                c_close(fd)
            self._fds = None


@cython.no_gc_clear
cdef class Range:
    """A reserved address range of `n_chunks` chunks of `chunk_bytes`."""

    cdef readonly Backend backend
    cdef object _address   # absolute address of chunk 0 (int), None once closed
    cdef readonly Py_ssize_t n_chunks
    cdef readonly Py_ssize_t chunk_bytes
    cdef list _chunks      # [n_chunks] Chunk or None
    cdef readonly Py_ssize_t n_mapped
    cdef Py_ssize_t _n_views   # live `_Span`s: the tensors `view` made that are not yet freed
    cdef object _held_address  # closed with views alive: chunk 0's address, freed by the last
    cdef object __weakref__

    cdef _init(self, Backend backend, object address, Py_ssize_t n_chunks):
        self.backend = backend
        self._address = address
        self.n_chunks = n_chunks
        self.chunk_bytes = backend.chunk_bytes
        self._chunks = [None] * n_chunks
        self.n_mapped = 0
        self._n_views = 0
        self._held_address = None

    @property
    def address(self):
        self._check_open("address")
        return self._address

    @property
    def nbytes(self):
        return self.n_chunks * self.chunk_bytes

    @property
    def bytes_mapped(self):
        return self.n_mapped * self.chunk_bytes

    @property
    def closed(self):
        return self._address is None

    cdef _check_open(self, what):
        if self._address is None:
            raise ValueError(f"{what}: the range is closed")

    def is_mapped(self, index):
        index = operator.index(index)
        if not 0 <= index < self.n_chunks:
            raise IndexError(f"is_mapped: chunk {index} is outside [0, {self.n_chunks})")
        return self._chunks[index] is not None

    def mapped_mask(self):
        """A bool array [n_chunks], a copy."""
        import numpy as np

        return np.fromiter((c is not None for c in self._chunks), dtype=bool, count=self.n_chunks)

    def map(self, lo, hi, chunks=None):
        """Map every unmapped chunk index in [lo, hi); return how many were mapped.

        The given chunks are used first, in order, then new ones are created. Indices already
        mapped are skipped. Access is set once per contiguous run. On any failure the range is
        exactly as before, chunks created by this call are released and the given ones stay
        unmapped and the caller's.
        """
        self._check_open("map")
        lo, hi = _check_index_range(lo, hi, self.n_chunks, "map")
        holes = [i for i in range(lo, hi) if self._chunks[i] is None]
        given = self._check_given(chunks, len(holes))
        created = self.backend._create(len(holes) - len(given))
        use = given + created
        done = []  # indices mapped by this call, for the rollback
        cdef Chunk chunk
        try:
            for run_lo, run_hi in _runs(holes):
                for i in range(run_lo, run_hi):
                    chunk = use[len(done)]
                    self.backend._tick(OP_MAP)
                    self.backend._map_chunk(self._address + i * self.chunk_bytes, chunk)
                    done.append(i)
                    self._chunks[i] = chunk
                self.backend._tick(OP_ACCESS)
                self.backend._set_access(
                    self._address + run_lo * self.chunk_bytes, (run_hi - run_lo) * self.chunk_bytes
                )
        except BaseException:
            self._roll_back_map(done)
            for chunk in created:
                chunk._release()
            raise
        for chunk in use:
            chunk._mapped = True
        self.n_mapped += len(holes)
        self.backend._bytes_mapped += len(holes) * self.chunk_bytes
        return len(holes)

    cdef list _check_given(self, chunks, Py_ssize_t n_holes):
        if chunks is None:
            return []
        given = list(chunks)
        if len(given) > n_holes:
            raise ValueError(f"map: {len(given)} chunks given for {n_holes} unmapped indices")
        seen = set()
        for chunk in given:
            if not isinstance(chunk, Chunk):
                raise TypeError(f"map: expected Chunk objects, got {type(chunk).__name__}")
            if (<Chunk>chunk).backend is not self.backend:
                raise ValueError("map: a chunk of another backend was given")
            if (<Chunk>chunk)._released:
                raise ValueError("map: a released chunk was given")
            if (<Chunk>chunk)._mapped:
                raise ValueError("map: a chunk that is mapped elsewhere was given")
            if id(chunk) in seen:
                raise ValueError("map: the same chunk was given twice")
            seen.add(id(chunk))
        return given

    cdef _roll_back_map(self, list done):
        # Unmap, run by run, what this call mapped (faults are injected into the forward steps
        # only; a failure here means the process's memory state is broken, and it propagates).
        try:
            for run_lo, run_hi in _runs(done):
                self.backend._unmap_chunks(
                    self._address + run_lo * self.chunk_bytes, run_hi - run_lo
                )
        finally:
            for i in done:
                self._chunks[i] = None

    def unmap(self, lo, hi):
        """Unmap every mapped chunk index in [lo, hi); return their chunks, in index order, bytes intact.

        Chunks are unmapped run by run; if a run fails, the runs already unmapped by this call are
        mapped back (same chunks, same bytes) before the error is raised.
        """
        self._check_open("unmap")
        lo, hi = _check_index_range(lo, hi, self.n_chunks, "unmap")
        mapped = [i for i in range(lo, hi) if self._chunks[i] is not None]
        undone = []
        try:
            for run_lo, run_hi in _runs(mapped):
                self.backend._tick(OP_UNMAP)
                self.backend._unmap_chunks(self._address + run_lo * self.chunk_bytes, run_hi - run_lo)
                undone.append((run_lo, run_hi))
        except BaseException:
            self._roll_back_unmap(undone)
            raise
        out = []
        cdef Chunk chunk
        for i in mapped:
            chunk = self._chunks[i]
            chunk._mapped = False
            self._chunks[i] = None
            out.append(chunk)
        self.n_mapped -= len(mapped)
        self.backend._bytes_mapped -= len(mapped) * self.chunk_bytes
        return out

    cdef _roll_back_unmap(self, list undone):
        for run_lo, run_hi in undone:
            for i in range(run_lo, run_hi):
                self.backend._map_chunk(self._address + i * self.chunk_bytes, self._chunks[i])
            self.backend._set_access(
                self._address + run_lo * self.chunk_bytes, (run_hi - run_lo) * self.chunk_bytes
            )

    def view(self, offset, shape, dtype):
        """A zero-copy tensor over bytes [offset, offset + nbytes) of the range.

        Every chunk it covers must be mapped (else ValueError). The view must not be used after
        those chunks are unmapped or the range is closed. A view kept past `close` still names
        addresses nothing else is given: the range's addresses stay reserved until its last
        view is freed (on the host it reads zeros meanwhile; on CUDA a read faults).
        """
        import torch

        self._check_open("view")
        offset = operator.index(offset)
        shape = tuple(operator.index(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"view: negative size in shape {shape}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * itemsize
        if offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError(
                f"view: bytes [{offset}, {offset + nbytes}) are outside the range's {self.nbytes}"
            )
        if offset % itemsize:
            raise ValueError(f"view: offset {offset} is not a multiple of {dtype}'s {itemsize} bytes")
        if nbytes:
            first, last = offset // self.chunk_bytes, (offset + nbytes - 1) // self.chunk_bytes
            for i in range(first, last + 1):
                if self._chunks[i] is None:
                    raise ValueError(
                        f"view: bytes [{offset}, {offset + nbytes}) cover chunk {i}, which is not mapped"
                    )
        address = self._address + offset
        span = _Span(self, address, nbytes)
        raw = self.backend._tensor(span, address, nbytes) if nbytes else torch.empty(
            0, dtype=torch.uint8, device=self._device()
        )
        return raw.view(dtype).view(shape)

    def _device(self):
        return "cpu" if self.backend.kind == "host" else f"cuda:{self.backend.device}"

    def close(self):
        """Unmap and release every chunk, then free the address range, or, while a view of it
        is alive, hold the range's addresses until the last view is freed (`view`).
        Idempotent."""
        if self._address is None:
            return
        chunks = self.unmap(0, self.n_chunks)
        for chunk in chunks:
            (<Chunk>chunk)._release()
        if self._n_views:
            self.backend._hold(self._address, self.nbytes)
            self._held_address = self._address
        else:
            self.backend._free_reservation(self._address, self.nbytes)
        self._address = None
        self.backend._ranges.discard(self)

    cdef _view_freed(self):
        """One of `view`'s tensors was freed: the last one of a closed range frees its held
        addresses. Called from `_Span.__dealloc__`, so it never raises."""
        self._n_views -= 1
        if self._n_views == 0 and self._held_address is not None:
            address, self._held_address = self._held_address, None
            try:
                self.backend._free_held(address, self.nbytes)
            except Exception:
                pass  # the addresses stay reserved: lost address space, no lost memory

    def __dealloc__(self):
        if self.backend is None:
            return
        try:
            if self._address is not None:
                self.close()
            elif self._held_address is not None:  # no view can be left: they hold the range
                self.backend._free_held(self._held_address, self.nbytes)
        except Exception:
            pass

    def __repr__(self):
        state = "closed" if self._address is None else f"{self.n_mapped}/{self.n_chunks} mapped"
        return f"<Range {self.backend.kind} {self.n_chunks} x {self.chunk_bytes} B, {state}>"


@cython.no_gc_clear
cdef class _Span:
    """The bytes behind one view; keeps its range alive while a tensor uses them, and counted
    in its range's views until the tensor's memory is freed (`Range.view`, `Range.close`)."""

    cdef readonly Range owner
    cdef readonly Py_ssize_t address
    cdef readonly Py_ssize_t nbytes
    cdef Py_ssize_t _shape[1]
    cdef Py_ssize_t _strides[1]
    cdef bint _counted

    def __init__(self, Range owner, Py_ssize_t address, Py_ssize_t nbytes):
        self.owner = owner
        self.address = address
        self.nbytes = nbytes
        owner._n_views += 1
        self._counted = True

    def __dealloc__(self):
        if self._counted and self.owner is not None:
            self.owner._view_freed()

    def __getbuffer__(self, Py_buffer* buffer, int flags):
        self._shape[0] = self.nbytes
        self._strides[0] = 1
        buffer.buf = <void*>self.address
        buffer.obj = self
        buffer.len = self.nbytes
        buffer.readonly = 0
        buffer.itemsize = 1
        buffer.format = "B"
        buffer.ndim = 1
        buffer.shape = self._shape
        buffer.strides = self._strides
        buffer.suboffsets = NULL
        buffer.internal = NULL

    def __releasebuffer__(self, Py_buffer* buffer):
        pass

    @property
    def __cuda_array_interface__(self):
        return {
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "data": (self.address, False),
            "version": 3,
            "strides": None,
        }


def _runs(indices):
    """Split ascending indices into contiguous [lo, hi) runs."""
    runs = []
    start = prev = None
    for i in indices:
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            runs.append((start, prev + 1))
            start = prev = i
    if start is not None:
        runs.append((start, prev + 1))
    return runs


include "_vmm_cuda.pxi"
include "_vmm_pages.pxi"


def open_backend(kind, **options):
    """`host` or `cuda` (options: `chunk_bytes` for host, `device` for cuda)."""
    if kind == "host":
        return HostBackend(**options)
    if kind == "cuda":
        return CudaBackend(**options)
    raise ValueError(f"unknown memory backend {kind!r}; expected 'host' or 'cuda'")
