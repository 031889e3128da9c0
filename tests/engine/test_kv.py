"""KVCache on real host virtual memory: segment layout, mapping, growth, views, close."""

from __future__ import annotations

import pytest
import torch

from strata import _vmm
from strata.engine.kv.kv_cache import KVCache, device_backend
from support.host_backend import HOST_CHUNK

CHUNK = HOST_CHUNK  # tests/engine/conftest.py's backend


def test_segments_are_whole_chunks_and_contiguous(backend):
    # A cell is 2 heads * 16 dims * 4 bytes = 128 bytes; 1000 cells round up to 2 chunks.
    kv = KVCache(backend, n_layers=3, max_cells=1000, n_kv_heads=2, head_dim=16,
                 dtype=torch.float32)
    assert (kv.cell_bytes, kv.segment_chunks, kv.segment_bytes) == (128, 2, 2 * CHUNK)
    assert kv.mapped_cells == 1000 and kv.bytes_mapped == 6 * 2 * CHUNK
    base = kv.k(0).data_ptr()
    for layer in range(3):
        k, v = kv.k(layer), kv.v(layer)
        assert k.shape == v.shape == (1000, 2, 16) and k.is_contiguous() and v.is_contiguous()
        # K of layer l, then V of layer l, each at the start of its own segment.
        assert k.data_ptr() - base == 2 * layer * kv.segment_bytes
        assert v.data_ptr() - base == (2 * layer + 1) * kv.segment_bytes
        assert not k.any() and not v.any()  # fresh cells are zero
    kv.k(2)[999] = 1.0
    kv.v(0)[0] = 2.0
    assert kv.k(2)[999].eq(1.0).all() and kv.v(0)[0].eq(2.0).all()
    assert not kv.v(2).any() and not kv.k(1).any()  # segments do not overlap
    kv.close()


def test_growth_maps_every_segment_and_keeps_addresses(backend):
    kv = KVCache(backend, 2, max_cells=4096, n_kv_heads=1, head_dim=32, dtype=torch.bfloat16,
                 mapped_cells=100)
    # 64-byte cells: one chunk holds 1024 cells.
    assert kv.segment_chunks == 4 and kv.mapped_cells == 1024
    assert kv.bytes_mapped == 4 * CHUNK  # one chunk in each of the 4 segments
    addresses = [(kv.k(i).data_ptr(), kv.v(i).data_ptr()) for i in range(2)]
    kv.k(1)[1023] = 3.0
    kv.map_cells(2000)
    assert kv.mapped_cells == 2048 and kv.bytes_mapped == 8 * CHUNK
    assert [(kv.k(i).data_ptr(), kv.v(i).data_ptr()) for i in range(2)] == addresses
    assert kv.k(1).shape == (2048, 1, 32)
    assert kv.k(1)[1023].eq(3.0).all()  # bytes kept
    assert not kv.k(1)[1024:].any() and not kv.v(0)[1024:].any()  # new cells zeroed
    kv.map_cells(10)  # already mapped: nothing changes
    assert kv.mapped_cells == 2048
    with pytest.raises(ValueError, match=r"n_cells 4097 is out of range \[0, 4096\]"):
        kv.map_cells(4097)
    assert kv.mapped_cells == 2048
    kv.map_cells(4096)
    assert kv.mapped_cells == 4096 and kv.bytes_mapped == 16 * CHUNK
    kv.close()


def test_failed_growth_leaves_the_cache_as_it_was(backend):
    kv = KVCache(backend, 2, 4096, 1, 32, torch.bfloat16, mapped_cells=1)
    kv.k(0)[0] = 5.0
    before = (kv.mapped_cells, kv.bytes_mapped, backend.alive_chunks)
    backend.inject_fault("map", nth=3)  # the third segment's mapping fails
    with pytest.raises(_vmm.VmmError):
        kv.map_cells(3000)
    assert (kv.mapped_cells, kv.bytes_mapped, backend.alive_chunks) == before
    assert kv.k(0)[0].eq(5.0).all()
    kv.map_cells(3000)
    assert kv.mapped_cells == 3072
    kv.close()


def test_layer_errors_and_close(backend):
    kv = KVCache(backend, 2, 64, 2, 8, torch.float32)
    with pytest.raises(IndexError, match=r"layer 2 is out of range \[0, 2\)"):
        kv.k(2)
    with pytest.raises(ValueError, match="n_kv_heads must be >= 1"):
        KVCache(backend, 2, 64, 0, 8, torch.float32)
    assert backend.alive_chunks > 0
    kv.close()
    kv.close()  # idempotent
    assert kv.closed and backend.alive_chunks == 0
    with pytest.raises(ValueError, match="no K/V cells are mapped"):
        kv.v(0)


def test_a_cell_view_kept_past_close_reads_zeros_and_its_memory_is_released(backend):
    """A K view held past close (a test's traceback locals, a caller's variable) is read
    without a fault: the chunks are released at close, and the addresses stay reserved, reading
    zeros, until the view is dropped (`Range.view`)."""
    kv = KVCache(backend, 2, 64, 2, 8, torch.float32)
    keys = kv.k(1)[:10]
    keys.fill_(3.0)
    kv.close()
    assert backend.alive_chunks == 0 and backend.bytes_mapped == 0
    assert not keys.any() and keys.shape == (10, 2, 8)
    assert "tensor" in repr(keys)  # what pytest prints for a failing test's locals


def test_kv_backend():
    backend = device_backend("cpu")
    assert isinstance(backend, _vmm.HostBackend)
    backend.close()
    with pytest.raises(ValueError, match="no K/V backend for device 'meta'"):
        device_backend("meta")


@pytest.mark.cuda
def test_cuda_kv_segments():
    backend = device_backend("cuda")
    assert isinstance(backend, _vmm.CudaBackend)
    kv = KVCache(backend, 2, 5000, 4, 128, torch.bfloat16)
    k, v = kv.k(1), kv.v(1)
    assert k.device.type == "cuda" and k.shape == (5000, 4, 128) and k.is_contiguous()
    assert v.data_ptr() - k.data_ptr() == kv.segment_bytes
    assert kv.segment_bytes % backend.chunk_bytes == 0
    assert not k.any().item() and not v.any().item()  # zeroed on mapping
    k[4999] = 1.0
    assert k[4999].float().sum().item() == 4 * 128 and not kv.k(0).any().item()
    kv.close()
    backend.close()
