"""strata._vmm.HostPages, the expert store's host memory, and `host_blobs`, which maps it.

Real mappings throughout: what the kernel reports for them (/proc/self/smaps) is checked, not
only what the object says. The CUDA page-locking runs with `pytest -m cuda` on a GPU; its
failure path (an injected fault) runs everywhere.
"""

import gc
import mmap
import threading
from pathlib import Path

import pytest
import torch

from strata import _vmm
from strata.engine.cache.rate_calls import synthetic_store
from strata.engine.experts import store as store_module
from strata.engine.experts.quant import expert_blob_bytes
from strata.engine.experts.store import host_blobs
from strata.engine.model.presets import get_preset
from strata.machine import MemoryLimit, huge_page_bytes, transparent_huge_pages
from strata.settings import SettingError
from support.checkpoints import cached_checkpoint, store_of


@pytest.fixture
def tiny_checkpoint():
    return cached_checkpoint("mixtral", "tiny", dtype=torch.float32)


pytestmark = pytest.mark.usefixtures("no_host_page_leaks")


def test_pages_are_zeroed_aligned_rounded_and_freed_with_their_last_view():
    n_bytes = 3 * _vmm.HUGE_PAGE_BYTES + 5
    count, mapped = _vmm.alive_host_pages()
    pages = _vmm.HostPages(n_bytes)
    assert pages.nbytes == n_bytes
    assert pages.mapped_bytes == 4 * _vmm.HUGE_PAGE_BYTES
    assert pages.address % _vmm.HUGE_PAGE_BYTES == 0
    assert pages.registered_device is None
    assert _vmm.alive_host_pages() == (count + 1, mapped + pages.mapped_bytes)
    view = torch.frombuffer(pages, dtype=torch.uint8)
    assert view.numel() == n_bytes and view.data_ptr() == pages.address
    assert int(view.count_nonzero()) == 0
    other = torch.frombuffer(pages, dtype=torch.uint8)
    view[-1] = 7  # the last byte asked for is writable, and one memory behind both views
    assert int(other[-1]) == 7
    del pages, other
    gc.collect()
    assert _vmm.alive_host_pages()[0] == count + 1, "a view keeps its pages alive"
    del view
    gc.collect()
    assert _vmm.alive_host_pages() == (count, mapped)


@pytest.mark.parametrize("n_bytes", [1, 4095, 4097, _vmm.HUGE_PAGE_BYTES - 1])
def test_pages_under_a_huge_page_take_whole_small_pages_unless_advised_huge(n_bytes):
    page = mmap.PAGESIZE
    small = _vmm.HostPages(n_bytes)
    assert small.mapped_bytes == -(-n_bytes // page) * page and small.address % page == 0
    view = torch.frombuffer(small, dtype=torch.uint8)
    view[-1] = 3  # the last byte asked for is writable
    assert int(view.count_nonzero()) == 1
    huge = _vmm.HostPages(n_bytes, huge=True)
    assert huge.mapped_bytes == _vmm.HUGE_PAGE_BYTES
    assert huge.address % _vmm.HUGE_PAGE_BYTES == 0


@pytest.mark.skipif(transparent_huge_pages() not in ("always", "madvise"),
                    reason="the kernel gives no transparent huge pages here")
def test_advised_pages_are_backed_by_huge_pages_and_unadvised_ones_are_not():
    n_bytes = 8 * _vmm.HUGE_PAGE_BYTES
    huge, small = _vmm.HostPages(n_bytes, huge=True), _vmm.HostPages(n_bytes)
    assert huge.huge_pages and not small.huge_pages
    for pages in (huge, small):
        torch.frombuffer(pages, dtype=torch.uint8).fill_(1)  # the first touch maps the pages
    # The kernel may fall short of huge pages when its memory is fragmented: most, not all.
    assert huge_page_bytes(huge.address, huge.mapped_bytes) >= n_bytes // 2
    if transparent_huge_pages() == "madvise":
        assert huge_page_bytes(small.address, small.mapped_bytes) == 0


@pytest.mark.parametrize("bad", [0, -1, 1.5, "4096", None])
def test_bad_sizes_are_named(bad):
    with pytest.raises(ValueError, match="nbytes must be a positive int"):
        _vmm.HostPages(bad)


def test_bad_fault_requests_are_named():
    with pytest.raises(ValueError, match="unknown op 'free'"):
        _vmm.inject_pages_fault("free")
    with pytest.raises(ValueError, match="nth must be a positive int"):
        _vmm.inject_pages_fault("map", 0)


def test_a_fault_in_the_mapping_maps_nothing():
    before = _vmm.alive_host_pages()
    _vmm.inject_pages_fault("map", 2)
    first = _vmm.HostPages(4096)  # the first passes
    with pytest.raises(_vmm.VmmError, match="injected fault in the host pages' map"):
        _vmm.HostPages(4096)
    assert _vmm.alive_host_pages() == (before[0] + 1, before[1] + first.mapped_bytes)


def test_a_fault_in_the_registration_leaves_the_pages_as_they_were():
    pages = _vmm.HostPages(4096)
    view = torch.frombuffer(pages, dtype=torch.uint8)
    view.fill_(3)
    _vmm.inject_pages_fault("register")
    with pytest.raises(_vmm.VmmError, match="injected fault in the host pages' register"):
        pages.register(0)
    assert pages.registered_device is None
    assert int(view.sum()) == 3 * 4096


def test_host_blobs_are_one_mapping_of_the_exact_store():
    pages, blobs = host_blobs(3, 5, 1000, "the experts")
    assert blobs.shape == (3, 5, 1000) and blobs.dtype == torch.uint8
    assert pages.nbytes == 3 * 5 * 1000
    assert blobs.data_ptr() == pages.address and blobs.is_contiguous()


def test_host_blobs_advise_huge_pages_only_where_the_setting_says(monkeypatch):
    monkeypatch.delenv("STRATA_HOST_HUGE_PAGES", raising=False)
    pages, _ = host_blobs(1, 1, 4096, "the experts")
    assert not pages.huge_pages
    monkeypatch.setenv("STRATA_HOST_HUGE_PAGES", "1")
    pages, _ = host_blobs(1, 1, 4096, "the experts")
    assert pages.huge_pages == (transparent_huge_pages() is not None)  # taken where it exists
    monkeypatch.setenv("STRATA_HOST_HUGE_PAGES", "yes")
    before = _vmm.alive_host_pages()
    with pytest.raises(SettingError, match=r"STRATA_HOST_HUGE_PAGES='yes': want 1 \(on\) or 0"):
        host_blobs(1, 1, 4096, "the experts")
    assert _vmm.alive_host_pages() == before


def test_a_store_beyond_the_host_is_refused_before_anything_is_mapped(monkeypatch):
    limit = MemoryLimit(1 << 20, "the container's memory limit (cgroup)")
    monkeypatch.setattr(store_module, "host_limit", lambda: limit)
    before = _vmm.alive_host_pages()
    with pytest.raises(ValueError) as info:
        host_blobs(4, 64, 8192, "model/: its experts as bf16")
    message = str(info.value)
    assert "model/: its experts as bf16 need 2.0 MiB of host memory" in message
    assert "more than the container's memory limit (cgroup) (1.0 MiB)" in message
    assert "--experts-dtype int8 or int4" in message
    assert _vmm.alive_host_pages() == before


def test_expert_store_refuses_a_store_beyond_the_host_before_reading_a_tensor(
        tiny_checkpoint, monkeypatch):
    monkeypatch.setattr(store_module, "host_limit", lambda: MemoryLimit(4096, "the host's RAM"))
    read = []
    with pytest.raises(ValueError, match="its experts as float32 need"):
        store_of(tiny_checkpoint, on_tensor=lambda: read.append(1))
    assert not read


def test_expert_store_holds_its_layers_in_one_mapping(tiny_checkpoint):
    store = store_of(tiny_checkpoint)
    first = store.layer_blobs(0)
    layer_bytes = store.n_experts * store.blob_bytes
    assert first.data_ptr() % mmap.PAGESIZE == 0  # its own pages
    for layer in range(store.n_layers):
        assert store.layer_blobs(layer).data_ptr() == first.data_ptr() + layer * layer_bytes


def test_the_rates_synthetic_store_is_in_the_real_stores_kind_of_memory():
    count = _vmm.alive_host_pages()[0]
    store = synthetic_store(64, 32, 4, torch.bfloat16, False, 1 << 16)
    assert _vmm.alive_host_pages()[0] == count + 1
    assert store.layer_blobs(0).data_ptr() % mmap.PAGESIZE == 0


def test_a_failed_registration_in_expert_store_frees_the_loaded_store(tiny_checkpoint,
                                                                      monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # reached before the driver
    before = _vmm.alive_host_pages()
    _vmm.inject_pages_fault("register")
    with pytest.raises(_vmm.VmmError) as info:
        store_of(tiny_checkpoint, pin_memory=True)
    del info  # its traceback holds the loader's frame, and the pages with it
    gc.collect()
    assert _vmm.alive_host_pages() == before


# --- CUDA ---------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_registered_pages_are_pinned_for_torch_and_copy_asynchronously():
    torch.zeros(1, device="cuda")
    pages = _vmm.HostPages(3 << 20)
    host = torch.frombuffer(pages, dtype=torch.uint8)
    host.copy_(torch.arange(host.numel(), dtype=torch.int64).remainder(251).to(torch.uint8))
    assert not host.is_pinned()
    pages.register(torch.cuda.current_device())
    assert pages.registered_device == torch.cuda.current_device()
    assert host.is_pinned()
    on_device = host.to("cuda", non_blocking=True)
    back = torch.empty_like(host)
    back.copy_(on_device)
    torch.cuda.synchronize()
    assert torch.equal(back, host)
    with pytest.raises(_vmm.VmmError, match="registered already"):
        pages.register(0)
    del host, pages  # unregistered and unmapped, after the device is synchronised
    gc.collect()


@pytest.mark.cuda
def test_pages_register_from_a_thread_torch_never_used():
    torch.zeros(1, device="cuda")
    pages = _vmm.HostPages(1 << 20)
    errors = []

    def register():
        try:
            pages.register(0)
        except Exception as err:
            errors.append(err)

    thread = threading.Thread(target=register)
    thread.start()
    thread.join()
    assert not errors
    assert torch.frombuffer(pages, dtype=torch.uint8).is_pinned()


@pytest.mark.cuda
def test_a_cuda_store_is_page_locked_once_loaded(tiny_checkpoint):
    torch.zeros(1, device="cuda")
    store = store_of(tiny_checkpoint, pin_memory=True)
    assert all(store.layer_blobs(layer).is_pinned() for layer in range(store.n_layers))


def test_the_docs_figure_for_torchs_rounding_is_a_qwen3_layers():
    """docs/expert-cache.md and `host_blobs`: a qwen3-30b-a3b layer's 1.2 GB of bf16 experts
    would take 2 GiB as one of torch's pinned blocks (the next power of two)."""
    preset = get_preset("qwen3-30b-a3b")
    layer_bytes = preset.n_experts * expert_blob_bytes(preset.expert_width,
                                                       preset.hidden_size, torch.bfloat16)
    assert round(layer_bytes / 1e9, 1) == 1.2
    assert 1 << (layer_bytes - 1).bit_length() == 2 << 30
    text = " ".join((Path(__file__).parents[1] / "docs" / "expert-cache.md").read_text().split())
    assert "a `qwen3-30b-a3b` layer's 1.2 GB would take 2 GiB" in text


# --- the registration's driver calls, against a recording stand-in ---------------------------
# The real driver runs the same code under `pytest -m cuda`; here the calls' order and
# arguments are checked where there is no GPU (the path every CUDA store now loads through).


def test_registration_locks_the_whole_mapping_and_freeing_unlocks_it_after_a_sync(
        recording_driver):
    driver = recording_driver()
    pages = _vmm.HostPages(3 << 20)
    address, mapped = pages.address, pages.mapped_bytes
    pages.register(1)
    assert pages.registered_device == 1
    assert driver.calls == [("cuInit", 0), ("cuDeviceGet", 1),
                            ("cuDevicePrimaryCtxRetain", "device"),
                            ("cuCtxSetCurrent", "context"),
                            ("cuMemHostRegister", address, mapped, 1)]  # 1: portable
    driver.calls.clear()
    del pages
    gc.collect()
    # The device synchronised before the pages are unlocked; both retains released.
    assert driver.calls == [("cuDevicePrimaryCtxRetain", "device"),
                            ("cuCtxSetCurrent", "context"), ("cuCtxSynchronize",),
                            ("cuMemHostUnregister", address),
                            ("cuDevicePrimaryCtxRelease", "device"),
                            ("cuDevicePrimaryCtxRelease", "device")]


def test_a_refused_registration_names_what_failed_and_releases_its_context(recording_driver):
    driver = recording_driver(fail="cuMemHostRegister")
    pages = _vmm.HostPages(1 << 20)
    with pytest.raises(_vmm.VmmError) as info:
        pages.register(0)
    assert str(info.value) == (f"page-locking {pages.mapped_bytes} bytes of host memory for "
                               f"cuda:0's copies (cuMemHostRegister) failed: "
                               f"CUDA_ERROR_OUT_OF_MEMORY")
    assert driver.calls[-1] == ("cuDevicePrimaryCtxRelease", "device")
    assert pages.registered_device is None
    driver.calls.clear()
    del pages
    gc.collect()
    assert driver.calls == []  # never locked: nothing to unlock


def test_an_owner_unlocks_its_pages_at_its_close_and_the_free_then_calls_nothing(
        recording_driver, tiny_checkpoint):
    driver = recording_driver()
    store = store_of(tiny_checkpoint)
    pages = store.pages
    pages.register(0)
    driver.calls.clear()
    store.close()
    assert pages.registered_device is None
    assert [call[0] for call in driver.calls] == [
        "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent", "cuCtxSynchronize",
        "cuMemHostUnregister", "cuDevicePrimaryCtxRelease", "cuDevicePrimaryCtxRelease"]
    driver.calls.clear()
    store.close()  # idempotent
    assert int(store.layer_blobs(0).count_nonzero()) > 0  # still mapped for its views
    del store, pages
    gc.collect()
    assert driver.calls == []


def test_a_refused_unlock_names_what_failed_and_still_releases_both_retains(recording_driver):
    driver = recording_driver(fail="cuMemHostUnregister")
    pages = _vmm.HostPages(1 << 20)
    pages.register(0)
    driver.calls.clear()
    with pytest.raises(_vmm.VmmError, match=rf"unlocking {pages.mapped_bytes} bytes of host "
                                            r"memory \(cuMemHostUnregister\) failed"):
        pages.unregister()
    assert driver.calls[-2:] == [("cuDevicePrimaryCtxRelease", "device")] * 2
    assert pages.registered_device is None
