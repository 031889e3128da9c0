"""strata._vmm on both backends: the host one here, the cuda one with `pytest -m cuda` on a GPU.

Every test runs against real virtual memory. Chunk contents are checked through tensor views, so a
chunk that loses its bytes, or a view onto the wrong memory, fails a test rather than passing
silently.
"""

import gc
import mmap
import os

import numpy as np
import pytest
import torch

from strata import _vmm

HOST_CHUNK = 64 << 10


@pytest.fixture(params=["host", pytest.param("cuda", marks=pytest.mark.cuda)])
def backend(request):
    if request.param == "cuda":
        torch.zeros(1, device="cuda")  # torch creates and uses the primary context first
        b = _vmm.CudaBackend(0)
    else:
        b = _vmm.HostBackend(chunk_bytes=HOST_CHUNK)
    yield b
    b.close()
    gc.collect()
    assert b.alive_chunks == 0, "a test leaked physical chunks"


def device_of(backend):
    return "cpu" if backend.kind == "host" else f"cuda:{backend.device}"


def stamp(rng, index, value):
    """Write `value` over the whole of chunk `index` (int32 words)."""
    n = rng.chunk_bytes // 4
    rng.view(index * rng.chunk_bytes, (n,), torch.int32).fill_(value)


def read_stamp(rng, index):
    """The value over chunk `index`, checking that all its words agree."""
    words = rng.view(index * rng.chunk_bytes, (rng.chunk_bytes // 4,), torch.int32)
    first = int(words[0])
    assert bool((words == first).all()), f"chunk {index} holds mixed bytes"
    return first


def snapshot(rng):
    mask = rng.mapped_mask()
    stamps = {i: read_stamp(rng, i) for i in np.flatnonzero(mask)}
    return mask.tolist(), stamps, rng.n_mapped, rng.bytes_mapped, rng.backend.alive_chunks


# --- reserve --------------------------------------------------------------------------------


def test_reserve_rounds_up_to_whole_chunks(backend):
    c = backend.chunk_bytes
    for nbytes, want in [(1, 1), (c, 1), (c + 1, 2), (5 * c - 1, 5)]:
        rng = backend.reserve(nbytes)
        assert (rng.n_chunks, rng.nbytes, rng.n_mapped) == (want, want * c, 0)
        assert rng.address % 4096 == 0
        rng.close()


@pytest.mark.parametrize("bad", [0, -1, 1.5, "8"])
def test_reserve_rejects_bad_sizes(backend, bad):
    with pytest.raises(ValueError, match="nbytes"):
        backend.reserve(bad)


# --- map, unmap, re-map -----------------------------------------------------------------------


def test_map_fills_holes_and_skips_mapped_chunks(backend):
    rng = backend.reserve(10 * backend.chunk_bytes)
    assert rng.map(2, 5) == 3
    for i in range(2, 5):
        stamp(rng, i, 100 + i)
    assert rng.map(0, 10) == 7
    assert rng.n_mapped == 10 and backend.alive_chunks == 10
    assert [read_stamp(rng, i) for i in range(2, 5)] == [102, 103, 104], "re-map touched them"
    assert rng.map(0, 10) == 0

    taken = rng.unmap(3, 6)
    assert len(taken) == 3 and all(not c.mapped for c in taken)
    assert rng.mapped_mask().tolist() == [True] * 3 + [False] * 3 + [True] * 4
    assert rng.bytes_mapped == 7 * backend.chunk_bytes
    assert backend.alive_chunks == 10, "unmapped chunks are the caller's until dropped"
    del taken
    gc.collect()
    assert backend.alive_chunks == 7

    assert rng.map(0, 10) == 3
    assert read_stamp(rng, 2) == 102
    assert rng.unmap(0, 0) == [] and rng.map(4, 4) == 0
    rng.close()


def test_given_chunks_are_used_first_in_order(backend):
    src = backend.reserve(3 * backend.chunk_bytes)
    src.map(0, 3)
    for i in range(3):
        stamp(src, i, 7 + i)
    chunks = src.unmap(0, 3)
    dst = backend.reserve(5 * backend.chunk_bytes)
    assert dst.map(1, 5, chunks=chunks[::-1]) == 4
    assert [read_stamp(dst, i) for i in (1, 2, 3)] == [9, 8, 7]
    assert backend.alive_chunks == 4
    src.close()
    dst.close()


def test_a_chunk_moved_between_ranges_keeps_its_bytes(backend):
    a = backend.reserve(4 * backend.chunk_bytes)
    b = backend.reserve(4 * backend.chunk_bytes)
    a.map(0, 4)
    pattern = torch.arange(backend.chunk_bytes // 2, dtype=torch.int16, device=device_of(backend))
    a.view(2 * backend.chunk_bytes, pattern.shape, torch.int16).copy_(pattern)
    (chunk,) = a.unmap(2, 3)
    b.map(3, 4, chunks=[chunk])
    moved = b.view(3 * backend.chunk_bytes, pattern.shape, torch.int16)
    assert torch.equal(moved, pattern)
    assert backend.alive_chunks == 4 and a.n_mapped == 3 and b.n_mapped == 1
    a.close()
    b.close()


def test_views_see_each_others_writes_in_any_dtype_and_shape(backend):
    rng = backend.reserve(3 * backend.chunk_bytes)
    rng.map(0, 3)
    n = backend.chunk_bytes // 4
    floats = rng.view(0, (2, n), torch.float32)
    floats.copy_(torch.randn(2, n, device=device_of(backend)))
    as_int = rng.view(0, (2 * n,), torch.int32)
    assert torch.equal(as_int.view(torch.float32).view(2, n), floats)
    # A view across a chunk boundary, at an offset, in bf16.
    halves = rng.view(backend.chunk_bytes - 8, (8,), torch.bfloat16)
    halves.fill_(3.0)
    two_halves = torch.tensor([3.0, 3.0], dtype=torch.bfloat16).view(torch.float32)
    assert float(floats[0, -1]) == float(two_halves)
    assert float(floats[1, 0]) == float(floats[0, -1])
    assert rng.view(8, (0,), torch.float32).numel() == 0
    del floats, as_int, halves
    rng.close()


def test_a_view_over_an_unmapped_chunk_is_an_error_not_a_crash(backend):
    c = backend.chunk_bytes
    rng = backend.reserve(4 * c)
    rng.map(0, 2)
    rng.map(3, 4)
    with pytest.raises(ValueError, match="chunk 2, which is not mapped"):
        rng.view(c, (c // 4 + 1,), torch.float32)
    with pytest.raises(ValueError, match="outside the range"):
        rng.view(3 * c, (c // 4 + 1,), torch.float32)
    with pytest.raises(ValueError, match="not a multiple"):
        rng.view(2, (4,), torch.float32)
    with pytest.raises(ValueError, match="negative"):
        rng.view(0, (-1,), torch.float32)
    assert rng.view(3 * c, (c // 4,), torch.float32).numel() == c // 4
    rng.close()


# --- close and leaks ----------------------------------------------------------------------------


def test_close_releases_everything_and_is_idempotent(backend):
    before = _vmm.alive_chunks()
    rngs = [backend.reserve(3 * backend.chunk_bytes) for _ in range(3)]
    for rng in rngs:
        rng.map(0, 3)
    held = rngs[0].unmap(0, 1)
    assert _vmm.alive_chunks() == before + 9
    for rng in rngs:
        rng.close()
        rng.close()
    assert rngs[0].closed and backend.bytes_mapped == 0
    assert backend.alive_chunks == 1, "a chunk the caller holds outlives its old range"
    held[0].release()
    held[0].release()
    assert backend.alive_chunks == 0 and _vmm.alive_chunks() == before
    for call in (lambda: rngs[1].map(0, 1), lambda: rngs[1].unmap(0, 1),
                 lambda: rngs[1].view(0, (1,), torch.uint8)):
        with pytest.raises(ValueError, match="closed"):
            call()


def _permissions(address):
    """The permissions ("r--p", "---p", ...) of the mapping of this process that holds
    `address` (/proc/self/maps); None outside every mapping."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, permissions = line.split()[:2]
            lo, hi = (int(a, 16) for a in span.split("-"))
            if lo <= address < hi:
                return permissions
    return None


def _reserved(address):
    """Whether `address` lies in a mapping of this process."""
    return _permissions(address) is not None


def test_a_view_kept_past_close_keeps_its_addresses_until_it_is_freed(backend):
    """Close releases the chunks at once, but a view still alive keeps the range's addresses
    reserved: no later range is placed under it, and it reads zeros instead of faulting (on
    CUDA a chunk of zeros is mapped read-only under it). The last view freed frees the
    addresses."""
    c = backend.chunk_bytes
    rng = backend.reserve(4 * c)
    rng.map(0, 4)
    view = rng.view(c, (c // 4,), torch.int32)[1:]  # a slice: the span lives in its storage
    view.fill_(7)
    address, nbytes = rng.address, rng.nbytes
    rng.close()
    assert rng.closed and backend.alive_chunks == 0 and backend.bytes_mapped == 0
    others = [backend.reserve(4 * c) for _ in range(8)]
    for other in others:
        assert other.address + other.nbytes <= address or other.address >= address + nbytes
    assert backend.held_ranges == 1
    assert int(view.abs().sum()) == 0  # the held range reads zeros
    if backend.kind == "host":
        assert _permissions(address + c) == "r--p"  # readable, a write faults
    else:
        torch.cuda.synchronize()  # the read did not fault
    del view
    gc.collect()
    assert backend.held_ranges == 0
    if backend.kind == "host":
        assert not _reserved(address + c)
    for other in others:
        other.close()


def test_two_held_ranges_read_zeros_and_free_their_addresses_apart(backend):
    """Each held range reads zeros (on CUDA the same chunk of zeros under both) until its own
    last view is freed; a range reserved after both can map and write its own bytes."""
    c = backend.chunk_bytes
    views = []
    for _ in range(2):
        rng = backend.reserve(2 * c)
        rng.map(0, 2)
        views.append(rng.view(0, (2 * c // 4,), torch.int32))
        views[-1].fill_(3)
        rng.close()
    assert backend.held_ranges == 2 and backend.alive_chunks == 0
    assert all(int(view.abs().sum()) == 0 for view in views)
    del views[0]
    gc.collect()
    assert backend.held_ranges == 1 and int(views[0].abs().sum()) == 0
    fresh = backend.reserve(c)
    fresh.map(0, 1)
    written = fresh.view(0, (c // 4,), torch.int32)
    written.fill_(5)
    assert int(written.sum()) == 5 * (c // 4) and int(views[0].abs().sum()) == 0
    del views
    gc.collect()
    assert backend.held_ranges == 0
    fresh.close()


def test_a_hold_whose_access_fails_leaves_the_addresses_reserved_until_the_view_goes(backend):
    """A fault while a held range is made readable: close still succeeds, the addresses stay
    reserved (not readable: the view must not be read) and are freed with the view; a later
    hold is readable again."""
    c = backend.chunk_bytes
    rng = backend.reserve(2 * c)
    rng.map(0, 2)
    address = rng.address
    stale = rng.view(0, (4,), torch.int32)
    backend.inject_fault("access")  # the hold's; close itself sets no access
    rng.close()
    backend.clear_faults()
    assert rng.closed and backend.alive_chunks == 0 and backend.held_ranges == 1
    if backend.kind == "host":
        assert _permissions(address) == "---p"  # the fault was the hold's: left unreadable
    del stale
    gc.collect()
    assert backend.held_ranges == 0
    if backend.kind == "host":
        assert not _reserved(address)
    again = backend.reserve(c)
    again.map(0, 1)
    kept = again.view(0, (4,), torch.int32)
    again.close()
    assert int(kept.abs().sum()) == 0


@pytest.mark.cuda
def test_a_cuda_hold_that_fails_to_map_leaves_the_range_reserved_and_nothing_mapped():
    """A fault while the chunk of zeros is mapped under a held range: the mappings made are
    undone, the zeros released, and the addresses stay reserved until the view is freed; a
    later hold maps its zeros again."""
    torch.zeros(1, device="cuda")
    backend = _vmm.CudaBackend()
    c = backend.chunk_bytes
    rng = backend.reserve(3 * c)
    rng.map(0, 3)
    stale = rng.view(0, (4,), torch.int32)
    backend.inject_fault("map", nth=2)  # the second of the hold's three maps
    rng.close()  # never raises: close has released the chunks already
    backend.clear_faults()
    assert rng.closed and backend.alive_chunks == 0 and backend.held_ranges == 1
    del stale  # never read: nothing is mapped under it
    gc.collect()
    assert backend.held_ranges == 0
    again = backend.reserve(c)
    again.map(0, 1)
    kept = again.view(0, (4,), torch.int32)
    again.close()
    assert int(kept.abs().sum()) == 0
    torch.cuda.synchronize()
    del kept
    gc.collect()
    assert backend.held_ranges == 0


def test_a_range_closed_without_views_frees_its_addresses_at_once(backend):
    rng = backend.reserve(2 * backend.chunk_bytes)
    rng.map(0, 2)
    address = rng.address
    rng.view(0, (4,), torch.int32).fill_(1)  # freed at once: no view is left
    rng.close()
    if backend.kind == "host":
        assert not _reserved(address)


def test_dropping_a_range_without_close_frees_it(backend):
    rng = backend.reserve(4 * backend.chunk_bytes)
    rng.map(0, 4)
    assert backend.alive_chunks == 4
    del rng
    gc.collect()
    assert backend.alive_chunks == 0 and backend.bytes_mapped == 0


def test_backend_close_closes_its_ranges(backend):
    a, b = backend.reserve(backend.chunk_bytes), backend.reserve(2 * backend.chunk_bytes)
    a.map(0, 1)
    b.map(0, 2)
    backend.close()
    assert a.closed and b.closed and backend.alive_chunks == 0


# --- bad input -----------------------------------------------------------------------------------


def test_bad_map_and_unmap_arguments_leave_the_range_unchanged(backend):
    other = _vmm.HostBackend(chunk_bytes=HOST_CHUNK)
    rng = backend.reserve(4 * backend.chunk_bytes)
    rng.map(1, 2)
    stamp(rng, 1, 11)
    spare = backend.create_chunks(2)
    foreign = other.create_chunks(1)
    before = snapshot(rng)
    cases = [
        (IndexError, "outside", lambda: rng.map(0, 5)),
        (IndexError, "outside", lambda: rng.map(3, 2)),
        (IndexError, "outside", lambda: rng.unmap(-1, 2)),
        (TypeError, "ints", lambda: rng.map(0.0, 2)),
        (ValueError, "chunks given", lambda: rng.map(0, 1, chunks=spare)),
        (ValueError, "another backend", lambda: rng.map(0, 1, chunks=foreign)),
        (ValueError, "twice", lambda: rng.map(0, 4, chunks=[spare[0], spare[0]])),
        (TypeError, "Chunk", lambda: rng.map(0, 1, chunks=["x"])),
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()
        assert snapshot(rng) == before
    spare[1].release()
    with pytest.raises(ValueError, match="released"):
        rng.map(0, 1, chunks=[spare[1]])
    rng.map(0, 1, chunks=[spare[0]])
    with pytest.raises(ValueError, match="mapped elsewhere"):
        rng.map(2, 3, chunks=[spare[0]])
    with pytest.raises(ValueError, match="unmap it"):
        spare[0].release()
    foreign.clear()
    rng.close()
    other.close()


def test_bad_fault_requests_and_chunk_sizes_are_named():
    b = _vmm.HostBackend(chunk_bytes=HOST_CHUNK)
    with pytest.raises(ValueError, match="unknown op 'mmap'"):
        b.inject_fault("mmap")
    with pytest.raises(ValueError, match="positive"):
        b.inject_fault("map", 0)
    with pytest.raises(ValueError, match="page size"):
        _vmm.HostBackend(chunk_bytes=1000)
    with pytest.raises(ValueError, match="unknown memory backend 'gpu'"):
        _vmm.open_backend("gpu")


def test_the_memory_layer_does_not_read_the_environment(monkeypatch):
    # strata.settings reads STRATA_VMM_CHUNK_BYTES and the engine passes it on
    # (tests/test_settings.py); a backend built without a size takes the default.
    monkeypatch.setenv("STRATA_VMM_CHUNK_BYTES", "lots")
    assert _vmm.HostBackend().chunk_bytes == _vmm.DEFAULT_CHUNK_BYTES == 2 << 20
    assert _vmm.open_backend("host", chunk_bytes=None).chunk_bytes == 2 << 20
    with pytest.raises(ValueError, match="must divide"):
        _vmm.HostBackend(chunk_bytes=3 * mmap.PAGESIZE)


# --- fault injection -----------------------------------------------------------------------------


def holey_range(backend):
    """8 chunks, 0, 3 and 6 mapped and stamped: mapping [0, 8) fills three runs of holes."""
    rng = backend.reserve(8 * backend.chunk_bytes)
    for i in (0, 3, 6):
        rng.map(i, i + 1)
        stamp(rng, i, 1000 + i)
    return rng


@pytest.mark.parametrize(
    ("op", "calls"),
    # 5 holes in 3 runs, [1,3) [4,6) [7,8), filled by 2 given chunks and 3 new ones.
    [("create", 3), ("map", 5), ("access", 3)],
)
def test_every_injected_fault_in_map_leaves_the_range_as_it_was(backend, op, calls):
    for nth in range(1, calls + 1):
        rng = holey_range(backend)
        given = backend.create_chunks(2)
        before = snapshot(rng)
        backend.inject_fault(op, nth)
        with pytest.raises(_vmm.VmmError, match=f"injected fault in {op}"):
            rng.map(0, 8, chunks=given)
        assert snapshot(rng) == before, f"{op} fault #{nth} changed the range"
        assert all(not c.mapped and not c.released for c in given), "given chunks stay the caller's"
        # The range and the given chunks still work afterwards.
        assert rng.map(0, 8, chunks=given) == 5
        assert [read_stamp(rng, i) for i in (0, 3, 6)] == [1000, 1003, 1006]
        rng.close()
    # One more than the calls a map makes: no fault fires, which pins the count of calls
    # (access is set once per contiguous run, not once per chunk).
    rng = holey_range(backend)
    given = backend.create_chunks(2)
    backend.inject_fault(op, calls + 1)
    assert rng.map(0, 8, chunks=given) == 5
    backend.clear_faults()
    rng.close()


@pytest.mark.parametrize("nth", [1, 2, 3])
def test_an_injected_fault_in_unmap_restores_the_runs_already_unmapped(backend, nth):
    rng = backend.reserve(8 * backend.chunk_bytes)
    rng.map(0, 8)
    for i in range(8):
        stamp(rng, i, 50 + i)
    rng.unmap(2, 3)
    rng.unmap(5, 6)
    before = snapshot(rng)
    backend.inject_fault("unmap", nth)
    with pytest.raises(_vmm.VmmError, match="injected fault in unmap"):
        rng.unmap(0, 8)  # three runs: [0,2) [3,5) [6,8)
    assert snapshot(rng) == before
    assert len(rng.unmap(0, 8)) == 6
    rng.close()


def test_a_fault_in_create_chunks_creates_none(backend):
    backend.inject_fault("create", 3)
    with pytest.raises(_vmm.VmmError):
        backend.create_chunks(5)
    assert backend.alive_chunks == 0


@pytest.mark.cuda
def test_cuda_ranges_work_from_a_thread_torch_never_used():
    import threading

    torch.zeros(1, device="cuda")
    backend = _vmm.CudaBackend(0)
    results = {}

    def work():
        try:
            rng = backend.reserve(2 * backend.chunk_bytes)
            rng.map(0, 2)
            rng.view(0, (4,), torch.float32).fill_(2.0)
            results["sum"] = float(rng.view(0, (4,), torch.float32).sum())
            rng.close()
        except Exception as err:  # reported to the main thread's assertion
            results["error"] = err

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert results == {"sum": 8.0}
    assert backend.alive_chunks == 0


def test_closing_a_host_backend_closes_its_files_once_no_chunk_is_alive():
    def memfds():
        return sum("memfd:strata-chunks" in os.readlink(f"/proc/self/fd/{fd}")
                   for fd in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{fd}"))

    before = memfds()
    backend = _vmm.HostBackend(65536)
    rng = backend.reserve(4 * 65536)
    rng.map(0, 2)
    held = rng.unmap(1, 2)  # a chunk held by the caller keeps the files open
    backend.close()
    assert rng.closed and memfds() == before + 1
    del held
    backend.close()
    assert memfds() == before
    again = backend.reserve(2 * 65536)  # a new file for the next chunk
    again.map(0, 1)
    assert memfds() == before + 1
    backend.close()
    assert memfds() == before
