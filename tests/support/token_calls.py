"""One-token decode calls through a `CachedExperts` built by hand on the `small` checkpoint's
store: the caches, seeded calls and the views of books and stats that the token path's and
the prefetch's tests compare (tests/engine/cache/test_token_path.py, test_prefetch.py)."""

import functools

import numpy as np
import torch

from strata import _vmm
from strata._residency import ResidencyTable
from strata.books import CheckedPolicy
from strata.engine.cache.arena import Arena, slot_bytes_for
from strata.engine.cache.cached_experts import CachedExperts
from strata.engine.memory import device_backend
from strata.engine.model.layers import route
from strata.policies import load_registry
from support.cache_models import CHUNK_BYTES
from support.checkpoints import cached_checkpoint, store_of

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The stats a call fills that do not depend on timing.
COUNTS = ("layer_calls", "lookups", "hits", "cpu_experts", "cpu_tokens", "streamed_experts",
          "uploaded_bytes", "admitted", "evicted", "passes")


@functools.cache
def small_store(dtype):
    """The `small` checkpoint's store (L=4, E=16, K=4), read once per session and dtype."""
    return store_of(cached_checkpoint("qwen3_moe", "small", dtype=dtype))


def make_cache(store, n_slots, policy, stream_misses, token_path, device="cpu", prefetch=0):
    slot_bytes = slot_bytes_for(store.blob_bytes)
    backend = _vmm.HostBackend(CHUNK_BYTES) if device == "cpu" else device_backend(device)
    table = ResidencyTable(store.n_layers, store.n_experts, n_slots, slot_bytes,
                           backend.chunk_bytes)
    # Rank by a fixed shuffle, so that every layer holds some of its experts.
    table.set_rank(np.random.default_rng(3).permutation(table.rank.size).reshape(
        table.rank.shape))
    arena = Arena(backend, n_slots, slot_bytes, hidden_size=store.hidden_size,
                  expert_width=store.expert_width, dtype=store.dtype)
    checked = CheckedPolicy(load_registry().create(policy), table)
    try:
        cached = CachedExperts(store, arena, table, checked, device, stream_misses=stream_misses,
                               prefetch_misses=prefetch)
    except BaseException:
        arena.close()
        raise
    cached._token_path = token_path
    cached.fill_hottest()
    cached.begin_request()
    cached.set_phase("decode")
    return cached


def token_calls(store, n_calls, seed, repeats, device="cpu"):
    """Seeded one-token calls over the layers in order; with `repeats`, ids drawn with
    replacement (an expert twice in a token), else the top-K of random logits."""
    gen = torch.Generator().manual_seed(seed)
    top_k = 4
    calls = []
    for i in range(n_calls):
        x = torch.randn(1, store.hidden_size, generator=gen).to(store.dtype)  # [1, D]
        logits = torch.randn(1, store.n_experts, generator=gen)
        ids, weights = route(logits, top_k, False)  # [1, K] each
        if repeats:
            ids = torch.randint(0, store.n_experts, (1, top_k), generator=gen)
        calls.append((i % store.n_layers, x.to(device), ids.to(device), weights.to(device)))
    return calls


def bytes_of(tensor):
    return tensor.cpu().contiguous().view(torch.uint8).numpy().tobytes()


def books(cached):
    t = cached.table
    return (t.res.tobytes(), t.heat.tobytes(), t.hits, t.lookups, t.n_resident)


def counts(cached):
    return {name: getattr(cached.stats.decode, name) for name in COUNTS}


def split_call(cached, layer, x, topk_ids, topk_weights, ahead=False, books_after=False):
    """A call as the split piecewise graphs make it: the resident rows, the host's misses,
    the sum; with `books_after`, the call's books after the sum (as after the next graph's
    launch in a round); with `ahead`, on CUDA the sum queued before the call's end (as the
    next graph is); on the host, which has no stream to queue it behind the rows, after it."""
    rows = cached.resident_rows(layer, x, topk_ids)  # [K + 1, D]
    rest = cached.fill_misses(layer, x, topk_ids, topk_weights, rows, ahead=ahead,
                              books_after=books_after)
    if rest is not None and ahead and x.device.type != "cuda":
        rest, end = None, rest
        end()
    try:
        return cached.sum_rows(x, rows, topk_weights)
    finally:
        if rest is not None:
            rest()
