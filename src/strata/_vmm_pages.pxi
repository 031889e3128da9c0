# Host pages for host memory the engine chooses itself: the expert store (as long as the model)
# and each parked conversation's cells (strata.engine.kv.conversations). Included by _vmm.pyx.
#
# Why not torch's own host memory: `pin_memory=True` goes through torch's caching host
# allocator, which rounds every block up to a power of two (a qwen3-30b-a3b layer's 1.2 GB of
# bf16 experts takes 2 GiB). One anonymous mapping of the exact size costs what it holds.
# Advised to use 2 MiB pages (`huge`), a streaming read of it (the CPU's experts, the copy
# engine's uploads) walks 512 times fewer page-table entries and the CPU's hardware
# prefetchers, which stop at each page's end, run 2 MiB at a time; but on a virtual machine a
# huge page's first touch can cost more than 512 small ones' (the development VM filled them
# 2.2-5.9x slower), so the caller chooses.

from posix.mman cimport MADV_HUGEPAGE, madvise
from posix.unistd cimport _SC_PAGESIZE, sysconf


PAGES_FAULT_OPS = ("map", "register")
HUGE_PAGE_BYTES = 2 << 20
# cuda.h's flag (an ABI constant since CUDA 4.0), as the plain unsigned int the driver takes,
# whatever Python type a cuda-python release gives its own name for it.
cdef unsigned int CU_MEMHOSTREGISTER_PORTABLE = 0x01

cdef int[2] _pages_countdown = [0, 0]
# HostPages alive in this process and the bytes they map (for leak tests).
cdef Py_ssize_t _pages_alive = 0
cdef Py_ssize_t _pages_bytes = 0


def inject_pages_fault(op, nth=1):
    """Make the `nth` next `op` of any HostPages ('map': the mapping, 'register': the CUDA
    page-locking) fail with VmmError; `clear_pages_faults()` cancels."""
    if op not in PAGES_FAULT_OPS:
        raise ValueError(f"inject_pages_fault: unknown op {op!r}; expected one of "
                         f"{PAGES_FAULT_OPS}")
    if not isinstance(nth, int) or nth < 1:
        raise ValueError(f"inject_pages_fault: nth must be a positive int, got {nth!r}")
    _pages_countdown[PAGES_FAULT_OPS.index(op)] = nth


def clear_pages_faults():
    _pages_countdown[0] = _pages_countdown[1] = 0


def alive_host_pages():
    """(HostPages not yet freed, the bytes they map), over the process."""
    return _pages_alive, _pages_bytes


cdef int _pages_tick(int op) except -1:
    if _pages_countdown[op] > 0:
        _pages_countdown[op] -= 1
        if _pages_countdown[op] == 0:
            raise VmmError(f"injected fault in the host pages' {PAGES_FAULT_OPS[op]}")
    return 0


@cython.no_gc_clear
cdef class HostPages:
    """`nbytes` of zeroed host memory in one anonymous mapping (advised to use huge pages with
    `huge`), as a writable buffer (`torch.frombuffer(pages, dtype=torch.uint8)` views it, and
    keeps it alive).

    The mapping is rounded up to whole huge pages (HUGE_PAGE_BYTES) and starts on one, so no
    page is shared with other data; one smaller than a huge page and not advised to use them
    takes whole small pages instead (a parked conversation of a few cells). `huge_pages` says
    whether the kernel took the advice (whether it then gives huge pages depends on
    /sys/kernel/mm/transparent_hugepage).
    `register(device)` page-locks the whole mapping for CUDA (`cuMemHostRegister`, portable:
    every context's copies from it are asynchronous); it stays locked until the pages are freed.
    `unregister()` undoes it (owners call it at their close). Freed when the last reference
    goes (a tensor viewing the buffer is one): pages still registered are unregistered first,
    after the device is synchronised (a copy queued from them may still run), then unmapped.
    """

    cdef readonly Py_ssize_t nbytes
    cdef readonly Py_ssize_t mapped_bytes
    cdef readonly bint huge_pages
    cdef readonly object registered_device  # None, or the CUDA device index
    cdef Py_ssize_t _address
    cdef object _driver
    cdef object _cu_device
    cdef Py_ssize_t _shape[1]
    cdef Py_ssize_t _strides[1]

    def __cinit__(self, nbytes, huge=False):
        global _pages_alive, _pages_bytes
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"HostPages: nbytes must be a positive int, got {nbytes!r}")
        _pages_tick(0)
        cdef bint small = not huge and nbytes < HUGE_PAGE_BYTES
        cdef Py_ssize_t granule = sysconf(_SC_PAGESIZE) if small else HUGE_PAGE_BYTES
        cdef Py_ssize_t mapped = -(-nbytes // granule) * granule
        # Huge-page-sized ones: one huge page more than needed, so that the memory can start on
        # a huge-page boundary (mmap aligns to small pages only); the unused head and tail are
        # unmapped again.
        cdef Py_ssize_t extra = 0 if small else HUGE_PAGE_BYTES
        cdef void* p = mmap(NULL, mapped + extra, PROT_READ | PROT_WRITE,
                            MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
        if p == MAP_FAILED:
            raise _os_error(f"mapping {nbytes} bytes of host memory")
        cdef Py_ssize_t base = <Py_ssize_t>p
        cdef Py_ssize_t start = -(-base // granule) * granule
        if start > base:
            munmap(p, start - base)
        if base + extra > start:
            munmap(<void*>(start + mapped), base + extra - start)
        self._address, self.mapped_bytes, self.nbytes = start, mapped, nbytes
        self.huge_pages = bool(huge) and madvise(<void*>self._address, self.mapped_bytes,
                                                 MADV_HUGEPAGE) == 0
        _pages_alive += 1
        _pages_bytes += self.mapped_bytes

    def register(self, device=0):
        """Page-lock the pages for CUDA device `device`'s copies (portable, so any context's),
        once; VmmError naming the driver's error if it refuses, the pages left as they were."""
        if self.registered_device is not None:
            raise VmmError(f"these host pages are registered already (cuda:"
                           f"{self.registered_device})")
        if not isinstance(device, int) or device < 0:
            raise ValueError(f"register: device must be a non-negative int, got {device!r}")
        _pages_tick(1)
        try:
            from cuda.bindings import driver
        except ImportError as err:
            raise VmmError("registering host pages needs cuda-python: pip install "
                           "'strata[cuda]'") from err
        _cuda_check(driver.cuInit(0), "cuInit")
        cu_device = _cuda_check(driver.cuDeviceGet(device), "cuDeviceGet")
        context = _cuda_check(driver.cuDevicePrimaryCtxRetain(cu_device),
                              "cuDevicePrimaryCtxRetain")
        try:
            _cuda_check(driver.cuCtxSetCurrent(context), "cuCtxSetCurrent")
            _cuda_check(driver.cuMemHostRegister(self._address, self.mapped_bytes,
                                                 CU_MEMHOSTREGISTER_PORTABLE),
                        f"page-locking {self.mapped_bytes} bytes of host memory for cuda:"
                        f"{device}'s copies (cuMemHostRegister)")
        except BaseException:
            driver.cuDevicePrimaryCtxRelease(cu_device)
            raise
        # The primary context stays retained while registered: the pages are unregistered in
        # it, whichever thread frees them.
        self._driver, self._cu_device, self.registered_device = driver, cu_device, device

    def unregister(self):
        """Undo `register`, once the device has run what was queued (it is synchronised: a
        copy from the pages may still read them); nothing if they are not registered. The
        pages stay mapped, for their views, until the last reference goes. VmmError naming
        the driver's error.

        Owners call it at their close: freeing registered pages does it too, but a free
        comes when the last reference goes, and a synchronisation while a CUDA graph is being
        captured (by any thread of the process) breaks that capture."""
        if self._driver is not None:
            self._unlock()

    cdef _unlock(self):
        driver, cu_device = self._driver, self._cu_device
        self._driver, self.registered_device = None, None
        context = _cuda_check(driver.cuDevicePrimaryCtxRetain(cu_device),
                              "cuDevicePrimaryCtxRetain")
        try:
            _cuda_check(driver.cuCtxSetCurrent(context), "cuCtxSetCurrent")
            _cuda_check(driver.cuCtxSynchronize(), "synchronising the device before "
                        "unlocking host pages (cuCtxSynchronize)")
            _cuda_check(driver.cuMemHostUnregister(self._address),
                        f"unlocking {self.mapped_bytes} bytes of host memory "
                        "(cuMemHostUnregister)")
        finally:
            driver.cuDevicePrimaryCtxRelease(cu_device)  # this call's retain
            driver.cuDevicePrimaryCtxRelease(cu_device)  # register's

    def __getbuffer__(self, Py_buffer* buffer, int flags):
        self._shape[0] = self.nbytes
        self._strides[0] = 1
        buffer.buf = <void*>self._address
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
    def address(self):
        return self._address

    def __dealloc__(self):
        global _pages_alive, _pages_bytes
        if self._address == 0:
            return
        if self._driver is not None:
            # Not unregistered by its owner: done here, errors ignored (the driver's module may
            # be half torn down at the interpreter's exit, where the process's end frees all).
            try:
                self._unlock()
            except Exception:
                pass
        munmap(<void*>self._address, self.mapped_bytes)
        self._address = 0
        _pages_alive -= 1
        _pages_bytes -= self.mapped_bytes

    def __repr__(self):
        where = "" if self.registered_device is None else \
            f", registered for cuda:{self.registered_device}"
        return (f"<HostPages {self.nbytes} bytes in {self.mapped_bytes}, huge pages "
                f"{'advised' if self.huge_pages else 'not advised'}{where}>")
