# The cuda backend: the driver's virtual memory API through cuda-python (`cuda.bindings.driver`).
# Driver calls are per chunk or per run, so the Python-level bindings cost little beside the ~40 µs
# the driver takes per chunk; the bookkeeping around them is the Cython above. Included by _vmm.pyx.


def _cuda_check(result, what):
    """cuda-python returns (CUresult, *values): raise VmmError on failure, else the values."""
    err = result[0]
    if int(err) != 0:
        from cuda.bindings import driver

        name = driver.cuGetErrorName(err)[1]
        name = name.decode() if isinstance(name, bytes) else str(err)
        raise VmmError(f"{what} failed: {name}")
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


@cython.no_gc_clear
cdef class CudaBackend(Backend):
    """The driver's virtual memory API on one device, in its primary context.

    The primary context is the one PyTorch uses, so ranges work beside torch's own allocations
    and torch tensors view them through `__cuda_array_interface__`. Initialise torch's CUDA state
    first (e.g. `torch.zeros(1, device="cuda")`).
    """

    cdef readonly int device
    cdef object _driver
    cdef object _cu_device
    cdef object _context
    cdef object _prop
    cdef object _access
    cdef bint _retained
    cdef object _zero_handle  # one chunk of zeros mapped under every held range; None: none
    cdef set _zero_mapped     # held ranges' addresses mapped to it

    def __init__(self, device=0, chunk_bytes=None):
        try:
            from cuda.bindings import driver
        except ImportError as err:
            raise VmmError(
                "the cuda backend needs cuda-python: pip install 'strata[cuda]'"
            ) from err
        if not isinstance(device, int) or device < 0:
            raise ValueError(f"device must be a non-negative int, got {device!r}")
        self._driver = driver
        self.kind = "cuda"
        self.device = device
        _cuda_check(driver.cuInit(0), "cuInit")
        count = _cuda_check(driver.cuDeviceGetCount(), "cuDeviceGetCount")
        if device >= count:
            raise ValueError(f"cuda device {device} does not exist; {count} visible")
        self._cu_device = _cuda_check(driver.cuDeviceGet(device), "cuDeviceGet")
        self._context = _cuda_check(
            driver.cuDevicePrimaryCtxRetain(self._cu_device), "cuDevicePrimaryCtxRetain"
        )
        self._retained = True

        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        self._prop = prop
        granularity = int(_cuda_check(
            driver.cuMemGetAllocationGranularity(
                prop, driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
            ),
            "cuMemGetAllocationGranularity",
        ))
        if chunk_bytes is None:
            chunk_bytes = max(granularity, DEFAULT_CHUNK_BYTES)
        if not isinstance(chunk_bytes, int) or chunk_bytes <= 0 or chunk_bytes % granularity:
            raise ValueError(
                f"chunk_bytes={chunk_bytes!r}: expected a positive multiple of the device's "
                f"allocation granularity ({granularity})"
            )
        self.chunk_bytes = chunk_bytes

        access = driver.CUmemAccessDesc()
        access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = device
        access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [access]
        self._zero_mapped = set()

    cdef object _call(self, str what, fn, tuple args):
        """One driver call. If the thread has no current context (a thread torch never used),
        make the primary context current and call again: no context call on the common path."""
        result = fn(*args)
        if result[0] == self._driver.CUresult.CUDA_ERROR_INVALID_CONTEXT:
            _cuda_check(self._driver.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")
            result = fn(*args)
        return _cuda_check(result, what)

    cdef object _reserve(self, Py_ssize_t nbytes):
        d = self._driver
        args = (nbytes, self.chunk_bytes, 0, 0)
        return int(self._call("cuMemAddressReserve", d.cuMemAddressReserve, args))

    cdef _free_reservation(self, object address, Py_ssize_t nbytes):
        d = self._driver
        self._call("cuMemAddressFree", d.cuMemAddressFree, (d.CUdeviceptr(address), nbytes))

    cdef _create_chunk(self, Chunk chunk):
        d = self._driver
        args = (self.chunk_bytes, self._prop, 0)
        chunk.handle = int(self._call("cuMemCreate", d.cuMemCreate, args))

    cdef _release_chunk(self, Chunk chunk):
        self._call("cuMemRelease", self._driver.cuMemRelease, (chunk.handle,))

    cdef _map_chunk(self, object address, Chunk chunk):
        d = self._driver
        args = (d.CUdeviceptr(address), self.chunk_bytes, 0, chunk.handle, 0)
        self._call("cuMemMap", d.cuMemMap, args)

    cdef _set_access(self, object address, Py_ssize_t nbytes):
        d = self._driver
        args = (d.CUdeviceptr(address), nbytes, self._access, 1)
        self._call("cuMemSetAccess", d.cuMemSetAccess, args)

    cdef _unmap_chunks(self, object address, Py_ssize_t n_chunks):
        # cuMemUnmap must name whole mappings, and each chunk was mapped on its own. It behaves
        # synchronously for device memory: work still reading the chunk finishes first.
        d = self._driver
        cdef Py_ssize_t i
        for i in range(n_chunks):
            ptr = d.CUdeviceptr(address + i * self.chunk_bytes)
            self._call("cuMemUnmap", d.cuMemUnmap, (ptr, self.chunk_bytes))

    cdef object _tensor(self, object span, Py_ssize_t address, Py_ssize_t nbytes):
        import torch

        return torch.as_tensor(span, device=f"cuda:{self.device}")

    cdef _hold_reservation(self, object address, Py_ssize_t nbytes):
        # A kernel reading an unmapped address faults, and the fault is sticky: the context is
        # lost. So a held range gets one chunk of zeros mapped under each of its chunks, read
        # only (the host's held range reads zeros the same way): a stale view reads zeros.
        # All or nothing: on a failure the range is left unmapped, reserved all the same.
        d = self._driver
        cdef Py_ssize_t i, n_mapped = 0
        if self._zero_handle is None:
            self._zero_handle = self._zeroed_chunk()
        try:
            for i in range(nbytes // self.chunk_bytes):
                self._tick(OP_MAP)
                args = (d.CUdeviceptr(address + i * self.chunk_bytes), self.chunk_bytes, 0,
                        self._zero_handle, 0)
                self._call("cuMemMap", d.cuMemMap, args)
                n_mapped += 1
            self._tick(OP_ACCESS)
            self._set_read_only(address, nbytes)
        except BaseException:
            try:
                self._unmap_chunks(address, n_mapped)
            finally:
                self._drop_zeros()
            raise
        self._zero_mapped.add(address)

    cdef _release_hold(self, object address, Py_ssize_t nbytes):
        if address in self._zero_mapped:
            self._zero_mapped.discard(address)
            self._unmap_chunks(address, nbytes // self.chunk_bytes)
            self._drop_zeros()
        self._free_reservation(address, nbytes)

    cdef object _zeroed_chunk(self):
        """A new physical chunk holding zeros: mapped at a scratch reservation, set, unmapped."""
        d = self._driver
        handle = int(self._call("cuMemCreate", d.cuMemCreate, (self.chunk_bytes, self._prop, 0)))
        scratch = None
        try:
            scratch = self._reserve(self.chunk_bytes)
            ptr = d.CUdeviceptr(scratch)
            self._call("cuMemMap", d.cuMemMap, (ptr, self.chunk_bytes, 0, handle, 0))
            try:
                self._set_access(scratch, self.chunk_bytes)
                self._call("cuMemsetD8", d.cuMemsetD8, (ptr, 0, self.chunk_bytes))
                self._call("cuCtxSynchronize", d.cuCtxSynchronize, ())  # set before it is read
            finally:
                self._call("cuMemUnmap", d.cuMemUnmap, (ptr, self.chunk_bytes))
        except BaseException:
            self._call("cuMemRelease", d.cuMemRelease, (handle,))
            raise
        finally:
            if scratch is not None:
                self._free_reservation(scratch, self.chunk_bytes)
        return handle

    cdef _set_read_only(self, object address, Py_ssize_t nbytes):
        """Read-only access to a held range; read-write where the driver refuses read-only
        (a write through a stale view then changes only the zeros other stale views read)."""
        d = self._driver
        access = d.CUmemAccessDesc()
        access.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.device
        access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
        try:
            self._call("cuMemSetAccess", d.cuMemSetAccess, (d.CUdeviceptr(address), nbytes,
                                                             [access], 1))
        except VmmError:
            self._set_access(address, nbytes)

    cdef _drop_zeros(self):
        """The zero chunk released once no held range maps it (a mapping keeps its memory
        alive until unmapped anyway)."""
        if not self._zero_mapped and self._zero_handle is not None:
            handle, self._zero_handle = self._zero_handle, None
            self._call("cuMemRelease", self._driver.cuMemRelease, (handle,))

    def __dealloc__(self):
        if self._zero_handle is not None and self._driver is not None:
            self._driver.cuMemRelease(self._zero_handle)
            self._zero_handle = None
        if self._retained and self._driver is not None:
            self._driver.cuDevicePrimaryCtxRelease(self._cu_device)
            self._retained = False
