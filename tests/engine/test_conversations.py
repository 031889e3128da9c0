"""The conversation cache's host memory: each parked conversation in its own pages, of its
cells' bytes rounded to whole pages; the pages of one that leaves kept spare for the next park,
within the bound, and given back first when a park needs the room; a park that fails changes
nothing. Against a plain-Python model of the books."""

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
from strata.machine import transparent_huge_pages

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


def _exact_bytes(n_cells):
    # Each layer's K, then V: six tensors, each on a CELLS_ALIGN_BYTES boundary.
    per_tensor = n_cells * CELL_BYTES // 6
    return 5 * -(-per_tensor // CELLS_ALIGN_BYTES) * CELLS_ALIGN_BYTES + per_tensor


def _page_bytes(n_cells):
    return -(-_exact_bytes(n_cells) // mmap.PAGESIZE) * mmap.PAGESIZE


pytestmark = pytest.mark.usefixtures("no_host_page_leaks")


def test_a_parked_conversation_holds_its_cells_in_its_own_pages(backend):
    kv = _kv(backend)
    cache = ConversationCache(1 << 20, 4)
    count, mapped = _vmm.alive_host_pages()
    entry, dropped = cache.park(list(range(100)), kv)
    assert dropped == [] and entry.nbytes == 100 * CELL_BYTES
    assert entry.host_bytes == entry.pages.mapped_bytes == _page_bytes(100)
    assert _vmm.alive_host_pages() == (count + 1, mapped + entry.host_bytes)
    assert cache.host_bytes == entry.host_bytes and cache.spare_bytes == 0
    for copy in (*entry.keys, *entry.values):  # views of the one mapping, aligned
        offset = copy.data_ptr() - entry.pages.address
        assert 0 <= offset < entry.pages.nbytes and offset % CELLS_ALIGN_BYTES == 0
    before, address = _cells(kv, 100), entry.pages.address
    for t in (*kv._k, *kv._v):
        t.zero_()
    cache.restore(cache.take(entry), kv, 100)
    assert all(torch.equal(a, b) for a, b in zip(_cells(kv, 100), before, strict=True))
    # Restored, it is released: its pages are spare, still counted, and the next park of
    # about its size takes them (no new mapping, no new page-lock).
    assert entry.keys == [] and entry.pages is None and entry.tokens == tuple(range(100))
    assert cache.spare_bytes == cache.host_bytes == _page_bytes(100)
    again, _ = cache.park(list(range(1, 91)), kv)
    assert again.pages.address == address and cache.spare_bytes == 0
    assert _vmm.alive_host_pages()[0] == count + 1
    del copy, again
    cache.clear()
    assert len(cache) == 0 and cache.host_bytes == 0
    assert _vmm.alive_host_pages() == (count, mapped), "cleared, the cache gives its pages back"
    kv.close()


def test_restore_takes_a_taken_conversation_once(backend):
    kv = _kv(backend)
    cache = ConversationCache(1 << 20, 4)
    entry, _ = cache.park(list(range(10)), kv)
    with pytest.raises(ValueError, match="c1 is parked"):
        cache.restore(entry, kv, 10)
    cache.restore(cache.take(entry), kv, 10)
    with pytest.raises(ValueError, match="c1 is released"):
        cache.restore(entry, kv, 10)
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


def test_the_entries_it_replaces_leave_once_it_is_parked_and_their_pages_serve_again(backend):
    kv = _kv(backend)
    cache = ConversationCache(2 * _page_bytes(50), 8)
    first, _ = cache.park(list(range(50)), kv)
    second, _ = cache.park(list(range(1, 51)), kv)
    address = first.pages.address
    third, dropped = cache.park(list(range(2, 52)), kv)
    assert dropped == [first] and cache.entries() == [second, third]
    assert first.keys == [] and first.pages is None  # released
    assert third.pages.address != address  # the bound had no room for a spare beside them
    kv.close()


def test_spares_too_large_are_given_back_before_any_conversation_leaves(backend):
    kv = _kv(backend)
    cache = ConversationCache(_page_bytes(400) + _page_bytes(50), 8)
    big, _ = cache.park(list(range(400)), kv)
    cache.restore(cache.take(big), kv, 400)
    small, _ = cache.park(list(range(1, 51)), kv)  # the big spare is over twice its bytes
    assert cache.spare_bytes == _page_bytes(400)
    count = _vmm.alive_host_pages()[0]
    other, dropped = cache.park(list(range(2, 102)), kv)  # needs room: the spare goes
    assert dropped == [] and cache.entries() == [small, other] and cache.spare_bytes == 0
    assert _vmm.alive_host_pages()[0] == count
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
    assert first.keys and second.keys  # their cells kept
    third, dropped = cache.park(list(range(2, 52)), kv)
    assert dropped == [first] and third.name == "c3"
    kv.close()


def test_a_copy_that_fails_parks_nothing_and_keeps_its_pages_spare(backend, monkeypatch):
    kv = _kv(backend)
    cache = ConversationCache(3 * _page_bytes(50), 4)
    first, _ = cache.park(list(range(50)), kv)
    gone, _ = cache.park(list(range(1, 51)), kv)
    cache.restore(cache.take(gone), kv, 50)  # its pages spare
    copy_ = torch.Tensor.copy_
    calls = []

    def failing_copy(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the copy engine failed")
        return copy_(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", failing_copy)
    with pytest.raises(RuntimeError, match="the copy engine failed"):
        cache.park(list(range(2, 47)), kv)  # into the spare
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    assert cache.entries() == [first] and first.keys
    assert cache.spare_bytes == _page_bytes(50) and cache.host_bytes == 2 * _page_bytes(50)
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


def test_huge_pages_where_the_setting_or_the_caller_says(backend, monkeypatch):
    kv = _kv(backend)
    monkeypatch.setenv("STRATA_HOST_HUGE_PAGES", "1")
    advised = ConversationCache(1 << 22, 2)
    monkeypatch.setenv("STRATA_HOST_HUGE_PAGES", "0")
    for cache, huge in ((advised, True), (ConversationCache(1 << 22, 2), False),
                        (ConversationCache(1 << 22, 2, huge=True), True)):
        entry, _ = cache.park(list(range(100)), kv)
        assert cache.huge == huge
        assert entry.pages.mapped_bytes == (_vmm.HUGE_PAGE_BYTES if huge else _page_bytes(100))
        if huge and transparent_huge_pages() in ("always", "madvise"):
            assert entry.pages.huge_pages
        del entry
        cache.clear()
    kv.close()


class ModelCache:
    """The conversation cache's books in plain Python: entries (tokens, exact bytes, page
    bytes) oldest first, spares (exact bytes, page bytes)."""

    def __init__(self, max_bytes: int, max_entries: int) -> None:
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self.parked: list[tuple[tuple[int, ...], int, int]] = []
        self.spare: list[tuple[int, int]] = []

    def held(self) -> int:
        return sum(m for *_, m in self.parked) + sum(m for _, m in self.spare)

    def park(self, tokens: tuple[int, ...]) -> list[tuple[int, ...]] | None:
        need, pages = _exact_bytes(len(tokens)), _page_bytes(len(tokens))
        if self.max_entries == 0 or len(tokens) * CELL_BYTES > self.max_bytes:
            return None
        fits = [s for s in self.spare if need <= s[0] and s[1] <= 2 * need]
        if fits:
            block = min(fits, key=lambda s: s[1])
            self.spare.remove(block)
        else:
            if pages > self.max_bytes:
                return None
            while self.spare and self.held() + pages > self.max_bytes:
                self.spare.remove(max(self.spare, key=lambda s: s[1]))
            block = (need, pages)
        self.parked.append((tokens, *block))
        dropped = []
        while len(self.parked) > self.max_entries or self.held() > self.max_bytes:
            if self.held() > self.max_bytes and self.spare:
                self.spare.remove(max(self.spare, key=lambda s: s[1]))
                continue
            tokens, *block = self.parked.pop(0)
            self.spare.append(tuple(block))
            dropped.append(tokens)
        return dropped

    def take(self, tokens: tuple[int, ...]) -> tuple[int, int]:
        j = next(j for j, entry in enumerate(self.parked) if entry[0] == tokens)
        return self.parked.pop(j)

    def put_back(self, entry) -> None:
        self.parked.append(entry)  # the most recently used

    def restore(self, entry) -> None:
        self.spare.append(tuple(entry[1:]))
        while self.spare and self.held() > self.max_bytes:
            self.spare.remove(max(self.spare, key=lambda s: s[1]))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300), st.integers(0, 3)), min_size=1, max_size=14),
       st.integers(1, 4), st.integers(1, 40))
def test_parks_against_a_plain_model_of_the_books(parks, max_entries, max_pages):
    # ops: (n cells, 0: park; 1: take the oldest and put it back; 2: take and restore it; 3:
    # take the oldest, park n cells, restore the taken one, as the engine does)
    backend = _vmm.HostBackend(1 << 16)
    kv = _kv(backend)
    max_bytes = max_pages * mmap.PAGESIZE
    cache, model = ConversationCache(max_bytes, max_entries), ModelCache(max_bytes, max_entries)
    gc.collect()
    base = _vmm.alive_host_pages()[0]
    for i, (n, op) in enumerate(parks):
        tokens = tuple(range(i, i + n))
        taken = None
        if op and model.parked:
            taken = cache.take(cache.entries()[0])
            taken_model = model.take(taken.tokens)
        if op in (0, 3) or taken is None:
            entry, dropped = cache.park(tokens, kv)
            expected = model.park(tokens)
            assert (entry is None) == (expected is None)
            assert [d.tokens for d in dropped] == (expected or [])
            del entry, dropped
        if op == 1 and taken is not None:
            cache.put_back(taken)
            model.put_back(taken_model)
        elif taken is not None:
            cache.restore(taken, kv, min(taken.n_cells, 5))
            model.restore(taken_model)
        del taken
        gc.collect()
        assert [e.tokens for e in cache.entries()] == [t for t, *_ in model.parked]
        assert cache.host_bytes == model.held() <= max_bytes
        assert cache.spare_bytes == sum(m for _, m in model.spare)
        assert _vmm.alive_host_pages()[0] == base + len(model.parked) + len(model.spare)
    cache.clear()
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
    pages = entry.pages
    assert pages.registered_device == torch.cuda.current_device()
    _vmm.inject_pages_fault("register")  # fresh pages for another conversation
    with pytest.raises(_vmm.VmmError, match="register"):
        cache.park(list(range(1, 301)), kv)
    assert cache.entries() == [entry]
    before = _cells(kv, 500)
    for t in (*kv._k, *kv._v):
        t.zero_()
    cache.restore(cache.take(entry), kv, 500)
    assert all(torch.equal(a, b) for a, b in zip(_cells(kv, 500), before, strict=True))
    again, _ = cache.park(list(range(2, 452)), kv)  # the spare, still page-locked
    assert again.pages is pages and pages.registered_device == torch.cuda.current_device()
    del again, pages
    cache.clear()
    kv.close()
    backend.close()
