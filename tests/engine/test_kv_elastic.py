"""KVCache as the elastic K/V uses it: given chunks mapped in, chunks above a need handed back,
both all or nothing under a fault at every chunk, views made before a growth still valid."""

from __future__ import annotations

import pytest
import torch

from strata import _vmm
from strata.engine.kv.kv_cache import KVCache
from support.cache_state import raising_faults_until_done
from support.host_backend import HOST_CHUNK

CHUNK = HOST_CHUNK  # tests/engine/conftest.py's backend
CELLS_PER_CHUNK = 1024  # 1 kv head * 32 dims * 2 bytes (bf16) = 64-byte cells


def _kv(backend, mapped_cells=1024):
    # 2 layers, 4 segments of 4 chunks each.
    return KVCache(backend, 2, 4096, 1, 32, torch.bfloat16, mapped_cells=mapped_cells)


def _stamped_chunks(backend, n):
    """`n` unmapped chunks, chunk i filled with byte 0x10 + i (moved through a scratch range)."""
    scratch = backend.reserve(n * CHUNK)
    scratch.map(0, n)
    for i in range(n):
        scratch.view(i * CHUNK, (CHUNK,), torch.uint8).fill_(0x10 + i)
    chunks = scratch.unmap(0, n)
    scratch.close()
    return chunks


def _chunk_bytes(backend, chunks):
    """The bytes of each of `chunks` (unmapped), read by mapping them into a scratch range."""
    scratch = backend.reserve(len(chunks) * CHUNK)
    scratch.map(0, len(chunks), chunks=chunks)
    out = [scratch.view(i * CHUNK, (CHUNK,), torch.uint8).clone() for i in range(len(chunks))]
    back = scratch.unmap(0, len(chunks))
    assert [id(c) for c in back] == [id(c) for c in chunks]
    scratch.close()
    return out


def _contents(kv):
    return [(kv.k(i).clone(), kv.v(i).clone()) for i in range(kv.n_layers)]


def _state(kv, backend):
    return {"contents": [t for pair in _contents(kv) for t in pair], "chunks": kv.mapped_chunks,
            "mapped": backend.bytes_mapped, "alive": backend.alive_chunks}


def test_given_chunks_are_mapped_first_in_segment_order_and_zeroed(backend):
    kv = _kv(backend)
    given = _stamped_chunks(backend, 6)
    alive = backend.alive_chunks
    # 2048 cells need one more chunk in each of the 4 segments; 3072 two more: 8 chunks, 6 given.
    assert kv.map_cells(3072, chunks=given) == 8
    assert backend.alive_chunks == alive + 2  # two created
    assert kv.mapped_chunks == 3 and kv.mapped_cells == 3072
    assert all(c.mapped for c in given)
    for layer in range(2):
        assert not kv.k(layer).any() and not kv.v(layer).any()  # stamps overwritten by zeros
    # Segment order: K0 gets given[0:2], V0 given[2:4], K1 given[4:6], V1 new chunks. Unmapping
    # hands them back in the same order.
    back = kv.unmap_cells(1024)
    assert [id(c) for c in back[:6]] == [id(c) for c in given]
    assert kv.mapped_cells == 1024 and kv.mapped_chunks == 1 and kv.k(0).shape == (1024, 1, 32)
    kv.close()


def test_unmap_cells_returns_the_chunks_above_the_need_with_their_bytes(backend):
    kv = _kv(backend, mapped_cells=4096)
    for layer in range(2):
        kv.k(layer)[:] = 1.0 + layer
        kv.v(layer)[:] = 3.0 + layer
    mapped = backend.bytes_mapped
    chunks = kv.unmap_cells(1500)  # keeps 2 chunks a segment, returns 2 of each of 4
    assert len(chunks) == 8 and not any(c.mapped for c in chunks)
    assert kv.mapped_cells == 2048 and backend.bytes_mapped == mapped - 8 * CHUNK
    expected = [1.0, 3.0, 2.0, 4.0]  # K0, V0, K1, V1
    for i, data in enumerate(_chunk_bytes(backend, chunks)):
        assert data.view(torch.bfloat16).eq(expected[i // 2]).all()
    assert kv.k(1).eq(2.0).all() and kv.v(0).eq(3.0).all()  # the cells kept are untouched
    assert kv.unmap_cells(2048) == [] and kv.unmap_cells(4000) == []  # nothing above the need
    # Mapping the same chunks back restores the bytes except that new cells are zeroed.
    kv.map_cells(4096, chunks=chunks)
    assert kv.k(0)[2048:].eq(0).all() and kv.k(0)[:2048].eq(1.0).all()
    assert kv.unmap_cells(0) and kv.mapped_cells == 0
    with pytest.raises(ValueError, match="no K/V cells are mapped"):
        kv.k(0)
    kv.close()


def test_bad_arguments_change_nothing(backend):
    kv = _kv(backend)
    with pytest.raises(ValueError, match=r"n_cells 4097 is out of range \[0, 4096\]"):
        kv.unmap_cells(4097)
    with pytest.raises(ValueError, match=r"n_cells -1 is out of range"):
        kv.map_cells(-1)
    given = _stamped_chunks(backend, 5)
    with pytest.raises(ValueError, match="5 chunks given, but cells \\[0, 2048\\) need only 4"):
        kv.map_cells(2048, chunks=given)
    other = _vmm.HostBackend(CHUNK)
    foreign = other.create_chunks(1)
    with pytest.raises(ValueError, match="another backend"):
        kv.map_cells(2048, chunks=foreign)
    assert kv.mapped_chunks == 1 and not any(c.mapped for c in given + foreign)
    assert _chunk_bytes(backend, given)[4].eq(0x14).all()
    kv.close()
    other.close()


def test_a_view_made_before_a_growth_works_after_it(backend):
    kv = _kv(backend)
    old_k = kv.k(1)
    address = old_k.data_ptr()
    kv.map_cells(4096, chunks=_stamped_chunks(backend, 4))
    assert kv.k(1).data_ptr() == address
    old_k[17] = 7.0  # the old view writes where the new one reads
    assert kv.k(1)[17].eq(7.0).all() and old_k.shape == (1024, 1, 32)
    kv.close()


@pytest.mark.parametrize("op", ["create", "map", "access"])
def test_a_fault_at_every_chunk_of_a_growth_leaves_everything_as_it_was(backend, op):
    kv = _kv(backend)
    for layer in range(2):
        kv.k(layer).fill_(layer + 1.0)
        kv.v(layer).fill_(layer + 5.0)
    given = []

    def give():
        given[:] = _stamped_chunks(backend, 5)  # 3 of the 8 chunks are created

    def given_intact():  # the given chunks: the caller's, bytes intact
        stamps = _chunk_bytes(backend, given)
        assert all(s.eq(0x10 + i).all() for i, s in enumerate(stamps))

    failed, _ = raising_faults_until_done(
        backend, op, lambda: kv.map_cells(2500, chunks=given), lambda: _state(kv, backend),
        check=given_intact, prepare=give)
    # One fault a chunk (create: 3 new chunks; map: 8; access: one per segment run, 4).
    assert failed == {"create": 3, "map": 8, "access": 4}[op]
    assert kv.mapped_chunks == 3
    kv.close()


def test_a_fault_at_every_segment_of_an_unmap_leaves_everything_as_it_was(backend):
    kv = _kv(backend, mapped_cells=4096)
    for layer in range(2):
        kv.k(layer).copy_(torch.arange(4096 * 32).view(4096, 1, 32).to(torch.bfloat16))
        kv.v(layer).fill_(-layer)
    failed, chunks = raising_faults_until_done(backend, "unmap", lambda: kv.unmap_cells(1024),
                                               lambda: _state(kv, backend))
    assert failed == 4  # one unmap call (one run) per segment
    assert len(chunks) == 12 and kv.mapped_cells == 1024
    kv.close()


def test_remap_cells_undoes_an_unmap_with_the_bytes(backend):
    kv = _kv(backend, mapped_cells=4096)
    for layer in range(2):
        kv.k(layer).copy_(torch.randn(4096, 1, 32, generator=torch.Generator().manual_seed(layer))
                          .to(torch.bfloat16))
        kv.v(layer).fill_(9.0)
    before = _contents(kv)
    chunks = kv.unmap_cells(1000)
    with pytest.raises(ValueError, match="remap_cells: 11 chunks given; cells \\[0, 4096\\) "
                                         "need 12 more"):
        kv.remap_cells(4096, chunks[:11])
    kv.remap_cells(4096, chunks)
    assert all(torch.equal(a, b) for pair, old in zip(_contents(kv), before, strict=True)
               for a, b in zip(pair, old, strict=True))
    kv.close()
