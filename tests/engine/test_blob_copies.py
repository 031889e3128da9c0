"""BlobCopies and ByteCopies on the host: whole blobs copied by address into the buffer's rows,
as torch's copies would put them; a bad row or expert refused before any copy; a driver error
named, with the copy it failed (the driver's path itself runs in the CUDA tests of the streamed
misses and of the split calls)."""

import numpy as np
import pytest
import torch

from strata.engine.cache.host_rows import HostRows
from strata.engine.experts import ExpertStore
from strata.engine.experts.blob_copies import BlobCopies, ByteCopies


def _store(n_layers: int = 2, n_experts: int = 5) -> ExpertStore:
    d, f = 8, 4  # blob: 3 * F * D bf16 values
    generator = torch.Generator().manual_seed(0)
    layers = [torch.randint(0, 256, (n_experts, 3 * f * d * 2), dtype=torch.uint8,
                            generator=generator) for _ in range(n_layers)]
    return ExpertStore(layers, d, f, torch.bfloat16)


def test_blobs_are_copied_into_the_rows_asked_for():
    store = _store()
    dest = torch.zeros((3, store.blob_bytes), dtype=torch.uint8)
    copies = BlobCopies(store, dest)
    copies.queue(1, [(2, 4), (0, 1)])
    assert torch.equal(dest[2], store.blob(1, 4)) and torch.equal(dest[0], store.blob(1, 1))
    assert not dest[1].any()  # untouched
    copies.queue(0, [(2, 0)])  # a row written again
    assert torch.equal(dest[2], store.blob(0, 0))


def _counted(copies: BlobCopies) -> list[int]:
    """The byte counts of the copies `copies` makes from now on, in order."""
    made, to_device = [], copies.copies.to_device

    def counting(dst, src, n_bytes, what):
        made.append(n_bytes)
        to_device(dst, src, n_bytes, what)

    copies.copies.to_device = counting
    return made


def test_a_run_of_consecutive_experts_into_consecutive_rows_is_one_copy():
    store = _store(n_experts=8)
    dest = torch.zeros((6, store.blob_bytes), dtype=torch.uint8)
    copies = BlobCopies(store, dest)
    made = _counted(copies)
    # rows 1-3 from experts 4-6 (one run), row 0 from 7 (the run breaks: row 4 would follow),
    # row 5 from 2
    copies.queue(1, [(1, 4), (2, 5), (3, 6), (0, 7), (5, 2)])
    assert made == [3 * store.blob_bytes, store.blob_bytes, store.blob_bytes]
    for row, expert in ((1, 4), (2, 5), (3, 6), (0, 7), (5, 2)):
        assert torch.equal(dest[row], store.blob(1, expert))
    assert not dest[4].any()


def test_rows_spaced_unlike_the_store_are_copied_one_by_one():
    """Slots padded past the blob: a run is not one span of bytes, so each blob is its own
    copy and the padding between them is left as it was."""
    store = _store(n_experts=4)
    padded = torch.full((3, store.blob_bytes + 32), 7, dtype=torch.uint8)
    copies = BlobCopies(store, padded[:, : store.blob_bytes])
    made = _counted(copies)
    copies.queue(0, [(0, 1), (1, 2), (2, 3)])
    assert made == [store.blob_bytes] * 3
    for row in range(3):
        assert torch.equal(padded[row, : store.blob_bytes], store.blob(0, row + 1))
    assert (padded[:, store.blob_bytes :] == 7).all()


@pytest.mark.parametrize("bad", [(3, 0), (-1, 0), (0, 5), (0, -1)])
def test_a_row_or_expert_out_of_range_is_refused_before_any_copy(bad):
    store = _store()
    dest = torch.zeros((3, store.blob_bytes), dtype=torch.uint8)
    with pytest.raises(IndexError, match=r"out of range: rows \[0, 3\), experts \[0, 5\)"):
        BlobCopies(store, dest).queue(0, [(1, 2), bad])
    assert not dest.any()  # the good copy before it was not made either


def test_a_buffer_of_other_rows_is_refused():
    store = _store()
    with pytest.raises(ValueError, match=f"uint8 \\[., {store.blob_bytes}\\]"):
        BlobCopies(store, torch.zeros((3, store.blob_bytes + 1), dtype=torch.uint8))


class Result(int):
    pass


class FakeDriver:  # the driver's failure, injected
    class CUresult:
        CUDA_SUCCESS = 0

    @staticmethod
    def CUstream(handle):
        return handle

    @staticmethod
    def cuMemcpyHtoDAsync(dst, src, n_bytes, stream):
        return (Result(700),)

    @staticmethod
    def cuGetErrorName(result):
        return (0, b"CUDA_ERROR_ILLEGAL_ADDRESS")


def test_a_driver_error_is_named(monkeypatch):
    store = _store()
    dest = torch.zeros((3, store.blob_bytes), dtype=torch.uint8)
    copies = BlobCopies(store, dest)
    copies.copies._driver = FakeDriver
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    with pytest.raises(RuntimeError, match=r"cuMemcpyHtoDAsync of expert \(1, 2\) failed: "
                                           r".*CUDA_ERROR_ILLEGAL_ADDRESS"):
        copies.queue(1, [(0, 2)])
    with pytest.raises(RuntimeError, match=r"cuMemcpyHtoDAsync of experts \(1, 2\.\.3\) "
                                           r"failed"):
        copies.queue(1, [(0, 2), (1, 3)])  # a run, named whole


def test_a_driver_error_staging_the_cpu_rows_is_named(monkeypatch):
    host = HostRows(torch.device("cpu"))
    host.cpu_out(4, 1, 6, torch.bfloat16)
    host._copies._driver = FakeDriver
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    with pytest.raises(RuntimeError, match=r"cuMemcpyHtoDAsync of the CPU's rows failed: "
                                           r".*CUDA_ERROR_ILLEGAL_ADDRESS"):
        host.stage_cpu_rows(4, 6, torch.bfloat16, np.array([2]))


def test_bytes_are_copied_between_the_addresses_given():
    src, dst = torch.arange(16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)
    ByteCopies(torch.device("cpu")).to_device(dst.data_ptr() + 4, src.data_ptr() + 2, 8, "bytes")
    assert dst[4:12].tolist() == list(range(2, 10)) and not dst[:4].any() and not dst[12:].any()


@pytest.mark.cuda
def test_bytes_go_from_pinned_memory_to_the_device_on_the_current_stream():
    """The driver's path: queued on torch's current stream (a side stream here), ordered
    before what that stream runs next; a device named without its index takes the current."""
    src = torch.arange(64, dtype=torch.uint8).pin_memory()
    dst = torch.zeros(64, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        ByteCopies(torch.device("cuda")).to_device(dst.data_ptr() + 8, src.data_ptr(), 16,
                                                   "bytes")
        copied = dst.clone()  # on the side stream, after the copy
    side.synchronize()
    assert copied[8:24].tolist() == list(range(16)) and not copied[:8].any()
    assert not copied[24:].any()
