"""A cache on CUDA uploads from page-locked host memory only, and only the store's owner
unlocks it: `ExpertStore.check_uploads_to`, `Loaded.owns_store`, and the benchmarks' engines,
which share one store among their variants' caches in turn. Where no GPU runs, the pages are
locked through the recording stand-in of the driver (`pytest -m cuda` runs the real one)."""

import pytest
import torch

from strata import _vmm
from strata._residency import ResidencyTable
from strata.engine.cache.arena import Arena, slot_bytes_for
from strata.engine.cache.build import plan_cache
from strata.engine.cache.cached_experts import CachedExperts
from strata.engine.model.config import ModelConfig
from strata.engine.runtime.load import Loaded, load
from support.bench_scripts import load_bench
from support.checkpoints import cached_checkpoint, store_of
from support.token_calls import make_cache

CUDA = torch.device("cuda", 0)


def _small_store():
    """A fresh store of the `small` checkpoint, not page-locked (not token_calls' shared one:
    these tests lock and unlock it)."""
    return store_of(cached_checkpoint("qwen3_moe", "small", dtype=torch.bfloat16))


def test_a_cuda_cache_over_a_store_not_page_locked_is_refused_by_name():
    """Copies from pageable memory run synchronously at a fraction of the pinned rate: the
    cache refuses the store before it makes anything, where a CPU cache takes it."""
    store = _small_store()
    make_cache(store, 8, "lru", 0, True).close()  # the CPU reads it in place: no lock needed
    table = ResidencyTable(store.n_layers, store.n_experts, 8, slot_bytes_for(store.blob_bytes),
                           1 << 20)
    backend = _vmm.HostBackend(1 << 20)  # the arena's kind does not matter here
    arena = Arena(backend, 8, slot_bytes_for(store.blob_bytes), hidden_size=store.hidden_size,
                  expert_width=store.expert_width, dtype=store.dtype)
    for device in ("cuda", CUDA):  # refused before the device is asked anything
        with pytest.raises(ValueError, match=r"the expert store's host memory is not "
                                             r"page-locked for CUDA \(a store loaded without "
                                             r"pin_memory, or closed.*pin_memory=True"):
            CachedExperts(store, arena, table, None, device)
    arena.close()
    backend.close()
    layers = [store.layer_blobs(i).clone() for i in range(store.n_layers)]  # torch's, unpinned
    torch_store = type(store)(layers, store.hidden_size, store.expert_width, store.dtype)
    with pytest.raises(ValueError, match="not page-locked for CUDA"):
        torch_store.check_uploads_to(CUDA)


def test_closing_a_loaded_unlocks_the_store_only_where_it_owns_it(recording_driver):
    recording_driver()
    store = _small_store()
    store.pages.register(0)
    store.check_uploads_to(CUDA)  # locked: taken
    # Loaded.close does not touch the model: None stands for it here.
    Loaded(None, make_cache(store, 8, "lru", 0, True), owns_store=False).close()
    assert store.pages.registered_device == 0
    store.check_uploads_to(CUDA)  # still taken by the next cache
    Loaded(None, make_cache(store, 8, "lru", 0, True)).close()
    assert store.pages.registered_device is None
    with pytest.raises(ValueError, match=r"not page-locked for CUDA .*closed"):
        store.check_uploads_to(CUDA)


def test_a_benchs_engine_leaves_the_shared_store_locked_for_the_next_variant(
        recording_driver):
    """bench/offload.py, prefill_chunk.py and kv_grow.py close an engine per variant
    (`engine_around`) over one store: closing one must not unlock the store under the next
    (before, every variant after the first uploaded from pageable memory)."""
    recording_driver()
    ckpt = cached_checkpoint("qwen3_moe", "small", dtype=torch.float32)
    cfg = ModelConfig.from_dir(ckpt)
    cache = plan_cache(cfg, torch.float32, torch.device("cpu"), max_context=64,
                       prefill_chunk=32, prefill_loan=False, backend=_vmm.HostBackend(1 << 20))
    loaded = load(ckpt, cache=cache)
    pages = loaded.cache.store.pages
    pages.register(0)
    engine_around = load_bench("_common.py").engine_around
    engine_around(loaded.model, None, 64).close()
    assert pages.registered_device == 0
    loaded.close()  # the loader's Loaded owns the store
    assert pages.registered_device is None
