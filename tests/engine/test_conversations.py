"""The conversation cache's host memory: each parked conversation in its own pages, of its
cells' bytes rounded to whole pages, bounded by those bytes, given back when it leaves; a park
that fails changes nothing. Against a plain model of least-recently-used entries."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from strata import _vmm
from strata.engine.kv.conversations import CELLS_ALIGN_BYTES, ConversationCache
from strata.engine.kv.kv_cache import KVCache, device_backend

# 3 layers, 2 kv heads x 16 dims of float32: K and V 128 bytes a layer, 768 bytes a cell.
CELL_BYTES = 3 * 2 * 2 * 16 * 4


def _kv(backend, cell_dtype=None):
    kv = KVCache(backend, 3, 8192, 2, 16, torch.float32, mapped_cells=2048, cell_dtype=cell_dtype)
    gen = torch.Generator().manual_seed(0)
    for layer in range(kv.n_layers):
        kv.layer(layer).write(torch.arange(kv.mapped_cells),
                              torch.randn(kv.mapped_cells, 2, 16, generator=gen),
                              torch.randn(kv.mapped_cells, 2, 16, generator=gen))
    return kv


def _cells(kv, n):
    return [t[:n].clone() for t in (*kv._k, *kv._v, *(s for s in kv.scales()))]


def _page_bytes(n_cells, cell_dtype=None):
    # Each layer's K, then V, on a CELLS_ALIGN_BYTES boundary; whole small pages.
    per_tensor = n_cells * CELL_BYTES // 6
    n_bytes = 5 * -(-per_tensor // CELLS_ALIGN_BYTES) * CELLS_ALIGN_BYTES + per_tensor
    return -(-n_bytes // mmap.PAGESIZE) * mmap.PAGESIZE


pytestmark = pytest.mark.usefixtures("no_host_page_leaks")


def test_a_parked_conversation_holds_its_cells_in_its_own_pages(backend):
    kv = _kv(backend)
    cache = ConversationCache(1 << 20, 4)
    count, mapped = _vmm.alive_host_pages()
    entry, dropped = cache.park(list(range(100)), kv)
    assert dropped == [] and entry.nbytes == 100 * CELL_BYTES
    assert entry.host_bytes == entry.pages.mapped_bytes == _page_bytes(100)
    assert _vmm.alive_host_pages() == (count + 1, mapped + entry.host_bytes)
    assert cache.host_bytes == entry.host_bytes
    for copy in (*entry.keys, *entry.values):  # views of the one mapping, aligned
        offset = copy.data_ptr() - entry.pages.address
        assert 0 <= offset < entry.pages.nbytes and offset % CELLS_ALIGN_BYTES == 0
    before = _cells(kv, 100)
    for t in (*kv._k, *kv._v):
        t.zero_()
    cache.restore(entry, kv, 100)
    assert all(torch.equal(a, b) for a, b in zip(_cells(kv, 100), before, strict=True))
    del entry, copy
    cache.take(cache.entries()[0])
    gc.collect()
    assert _vmm.alive_host_pages() == (count, mapped), "a conversation gone gives its pages back"
    kv.close()


def test_the_bound_counts_whole_pages_not_cells(backend):
    kv = _kv(backend)
    n = 10  # 7,680 bytes of cells in 8 KiB of pages
    tight = ConversationCache(n * CELL_BYTES, 4)
    assert tight.park(list(range(n)), kv) == (None, [])
    roomy = ConversationCache(_page_bytes(n), 4)
    entry, _ = roomy.park(list(range(n)), kv)
    assert entry is not None and roomy.host_bytes == _page_bytes(n)
    kv.close()


def test_the_entries_it_replaces_leave_once_it_is_parked(backend):
    kv = _kv(backend)
    cache = ConversationCache(2 * _page_bytes(50), 8)
    first, _ = cache.park(list(range(50)), kv)
    second, _ = cache.park(list(range(1, 51)), kv)
    third, dropped = cache.park(list(range(2, 52)), kv)
    assert dropped == [first] and cache.entries() == [second, third]
    kv.close()


@pytest.mark.parametrize("op", ["map"])
def test_a_park_that_fails_changes_nothing(backend, op):
    kv = _kv(backend)
    cache = ConversationCache(2 * _page_bytes(50), 2)
    first, _ = cache.park(list(range(50)), kv)
    second, _ = cache.park(list(range(1, 51)), kv)
    count = _vmm.alive_host_pages()
    _vmm.inject_pages_fault(op)
    with pytest.raises(_vmm.VmmError, match=f"injected fault in the host pages' {op}"):
        cache.park(list(range(2, 52)), kv)  # would push `first` out
    assert cache.entries() == [first, second] and _vmm.alive_host_pages() == count
    third, dropped = cache.park(list(range(2, 52)), kv)
    assert dropped == [first] and third.name == "c3"
    kv.close()


def test_int8_cells_and_their_scales_share_the_pages(backend):
    kv = _kv(backend, torch.int8)
    cache = ConversationCache(1 << 20, 2)
    entry, _ = cache.park(list(range(64)), kv)
    assert len(entry.scales) == len(kv.scales()) > 0
    for copy in (*entry.keys, *entry.values, *entry.scales):
        assert entry.pages.address <= copy.data_ptr() < entry.pages.address + entry.pages.nbytes
    assert entry.host_bytes >= entry.nbytes == 64 * kv.layout.bytes_per_cell
    kv.close()


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300), st.integers(0, 3)), min_size=1, max_size=12),
       st.integers(1, 4), st.integers(1, 40))
def test_parks_against_a_model_of_least_recently_used_pages(parks, max_entries, max_pages):
    # ops: (n cells, 0: park; 1: take the best match and put it back; 2: take it for good)
    backend = _vmm.HostBackend(1 << 16)
    kv = _kv(backend)
    max_bytes = max_pages * mmap.PAGESIZE
    cache = ConversationCache(max_bytes, max_entries)
    model: list[tuple[tuple[int, ...], int]] = []  # (tokens, host bytes), oldest first
    gc.collect()
    base = _vmm.alive_host_pages()[0]
    for i, (n, op) in enumerate(parks):
        dropped = []
        tokens = tuple(range(i, i + n))
        if op == 0 or not model:
            entry, dropped = cache.park(tokens, kv)
            host = _page_bytes(n)
            if host > max_bytes:
                assert entry is None and dropped == []
                continue
            gone = []
            while model and (len(model) >= max_entries
                             or sum(b for _, b in model) + host > max_bytes):
                gone.append(model.pop(0))
            model.append((tokens, host))
            assert [d.tokens for d in dropped] == [t for t, _ in gone]
        else:
            entry, _ = cache.best(model[0][0])
            taken = cache.take(entry)
            model.pop(next(j for j, (t, _) in enumerate(model) if t == taken.tokens))
            if op == 1:
                cache.put_back(taken)
                model.append((taken.tokens, taken.host_bytes))
            del taken
        del entry, dropped
        gc.collect()
        assert [e.tokens for e in cache.entries()] == [t for t, _ in model]
        assert cache.host_bytes == sum(b for _, b in model) <= max_bytes
        assert _vmm.alive_host_pages()[0] == base + len(model)
    kv.close()
    backend.close()


@pytest.mark.cuda
def test_cuda_parks_are_page_locked_and_a_refused_lock_changes_nothing():
    backend = device_backend("cuda")
    kv = KVCache(backend, 3, 8192, 2, 16, torch.bfloat16, mapped_cells=2048)
    for t in (*kv._k, *kv._v):
        t.normal_()
    cache = ConversationCache(1 << 24, 2, pin=True)
    entry, _ = cache.park(list(range(500)), kv)
    assert entry.pages.registered_device == torch.cuda.current_device()
    before = _cells(kv, 500)
    for t in (*kv._k, *kv._v):
        t.zero_()
    cache.restore(entry, kv, 500)
    assert all(torch.equal(a, b) for a, b in zip(_cells(kv, 500), before, strict=True))
    _vmm.inject_pages_fault("register")
    with pytest.raises(_vmm.VmmError, match="register"):
        cache.park(list(range(1, 501)), kv)
    assert cache.entries() == [entry]
    del entry
    cache.take(cache.entries()[0])
    kv.close()
    backend.close()
