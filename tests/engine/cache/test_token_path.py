"""A one-token call's own path (`strata.engine.cache.token_call`) against the general one
(`routed_call.routed_forward`), and the call split around piecewise graphs
(`strata.engine.cache.graph_call`) against the token path, byte for byte: the same outputs,
books, stats and admissions, at every hit rate, with streamed misses, observing and admitting
policies, and repeated experts."""

import functools

import numpy as np
import pytest
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
def _store(dtype):
    """The `small` checkpoint's store (L=4, E=16, K=4), read once per session and dtype."""
    return store_of(cached_checkpoint("qwen3_moe", "small", dtype=dtype))


def _cache(store, n_slots, policy, stream_misses, token_path, device="cpu"):
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
    cached = CachedExperts(store, arena, table, checked, device, stream_misses=stream_misses)
    cached._token_path = token_path
    cached.fill_hottest()
    cached.begin_request()
    cached.set_phase("decode")
    return cached


def _calls(store, n_calls, seed, repeats, device="cpu"):
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


def _bytes(tensor):
    return tensor.cpu().contiguous().view(torch.uint8).numpy().tobytes()


def _books(cached):
    t = cached.table
    return (t.res.tobytes(), t.heat.tobytes(), t.hits, t.lookups, t.n_resident)


def _counts(cached):
    return {name: getattr(cached.stats.decode, name) for name in COUNTS}


# (dtype, cached share, policy, --stream-misses, ids drawn with repeats): mixed, empty and full
# caches, streamed misses, observing (lru) and admitting (sieve) policies. Streamed misses
# are one row an expert, so they meet no repeats (routing never repeats an expert).
CASES = [
    ("fp32", 0.5, "coldest-in-loan", 0, False), ("bf16", 0.5, "coldest-in-loan", 0, False),
    ("fp32", 0.5, "coldest-in-loan", 2, False), ("bf16", 0.5, "coldest-in-loan", 2, False),
    ("bf16", 0.0, "coldest-in-loan", 0, False), ("bf16", 0.0, "coldest-in-loan", 2, False),
    ("bf16", 1.0, "lru", 0, False), ("fp32", 0.5, "lru", 0, False),
    ("bf16", 0.5, "sieve", 1, False), ("fp32", 0.5, "sieve", 0, True),
    ("bf16", 0.5, "coldest-in-loan", 0, True), ("fp32", 0.0, "lru", 0, True),
    ("fp32", 1.0, "coldest-in-loan", 0, False),  # every expert resident: device-only calls
    ("bf16", 1.0, "coldest-in-loan", 2, False),  # the same with a stage map (never used)
]


@pytest.mark.parametrize("dtype,share,policy,stream,repeats", CASES,
                         ids=["-".join(str(v) for v in case) for case in CASES])
def test_the_token_path_gives_the_general_paths_bytes(dtype, share, policy, stream, repeats):
    _same_bytes(_store(DTYPES[dtype]), share, policy, stream, repeats, "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,share,policy,stream,repeats", CASES[:4] + CASES[6:9],
                         ids=["-".join(str(v) for v in case) for case in CASES[:4] + CASES[6:9]])
def test_the_token_path_gives_the_general_paths_bytes_on_cuda(dtype, share, policy, stream,
                                                               repeats):
    """The same on CUDA: pinned index uploads, the hits' kernels, the CPU's rows uploaded."""
    store = store_of(cached_checkpoint("qwen3_moe", "small", dtype=DTYPES[dtype]),
                     pin_memory=True)
    _same_bytes(store, share, policy, stream, repeats, "cuda")


@pytest.mark.parametrize("dtype,share,policy,stream,repeats", CASES,
                         ids=["-".join(str(v) for v in case) for case in CASES])
def test_a_call_split_around_the_graphs_gives_the_token_paths_bytes(dtype, share, policy,
                                                                     stream, repeats):
    _same_bytes(_store(DTYPES[dtype]), share, policy, stream, repeats, "cpu", split=True)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,share,policy,stream,repeats", CASES[:4] + CASES[6:9],
                         ids=["-".join(str(v) for v in case) for case in CASES[:4] + CASES[6:9]])
def test_a_call_split_around_the_graphs_gives_the_token_paths_bytes_on_cuda(
        dtype, share, policy, stream, repeats):
    """On CUDA the resident rows are the Triton kernels' over every K row, a missing expert's
    row left unwritten (its slot -1 reads nothing), then written by the host."""
    store = store_of(cached_checkpoint("qwen3_moe", "small", dtype=DTYPES[dtype]),
                     pin_memory=True)
    _same_bytes(store, share, policy, stream, repeats, "cuda", split=True)


def _split_call(cached, layer, x, topk_ids, topk_weights):
    """A call as the split piecewise graphs make it: the resident rows, the host's misses,
    the sum."""
    rows = cached.resident_rows(layer, x, topk_ids)  # [K + 1, D]
    cached.fill_misses(layer, x, topk_ids, topk_weights, rows)
    return cached.sum_rows(x, rows, topk_weights)


def _same_bytes(store, share, policy, stream, repeats, device, split=False):
    """The general path against the token path, or (`split`) the token path against the split
    call."""
    n_slots = round(share * store.n_layers * store.n_experts)
    general = _cache(store, n_slots, policy, stream, token_path=split, device=device)
    token = _cache(store, n_slots, policy, stream, token_path=True, device=device)
    try:
        for call in _calls(store, 32, seed=int(share * 10) + stream, repeats=repeats,
                           device=device):
            expected = general.forward(*call)
            got = _split_call(token, *call) if split else token.forward(*call)
            assert got.dtype == expected.dtype and _bytes(got) == _bytes(expected)
            assert _books(token) == _books(general)
        assert _counts(token) == _counts(general)
        assert token.stats.decode.lookups == 32 * 4
    finally:
        general.close()
        token.close()


def test_the_token_path_runs_where_it_should(monkeypatch):
    """Decode calls take it, a call of more tokens does not (and still counts the same)."""
    from strata.engine.cache import cached_experts

    store = _store(torch.float32)
    cached = _cache(store, 32, "coldest-in-loan", 0, token_path=True)
    taken = []
    token_forward = cached_experts.token_forward
    monkeypatch.setattr(cached_experts, "token_forward",
                        lambda *args: taken.append(args[1]) or token_forward(*args))
    try:
        for layer, x, ids, weights in _calls(store, 4, seed=5, repeats=False):
            cached.forward(layer, x, ids, weights)
        x = torch.randn(3, store.hidden_size)
        ids, weights = route(torch.randn(3, store.n_experts), 4, False)
        cached.forward(0, x, ids, weights)
        assert taken == [0, 1, 2, 3]
        assert cached.stats.decode.lookups == 4 * 4 + 3 * 4
    finally:
        cached.close()


def test_a_tracing_wrapper_still_sees_observe():
    """The token path skips `observe` only where the policy's is the default: a wrapper with
    an `observe` of its own (the tracer) is told, though what it wraps keeps none."""
    from strata.policies.tracing import TracedPolicy

    store = _store(torch.float32)
    slot_bytes = slot_bytes_for(store.blob_bytes)
    table = ResidencyTable(store.n_layers, store.n_experts, 32, slot_bytes, CHUNK_BYTES)
    arena = Arena(_vmm.HostBackend(CHUNK_BYTES), 32, slot_bytes,
                  hidden_size=store.hidden_size, expert_width=store.expert_width,
                  dtype=store.dtype)
    seen = []

    class Stream:
        def write(self, text):
            seen.append(text)

    traced = TracedPolicy(load_registry().create("coldest-in-loan"), Stream())
    cached = CachedExperts(store, arena, table, CheckedPolicy(traced, table), "cpu")
    try:
        cached.fill_hottest()
        cached.set_phase("decode")
        layer, x, ids, weights = _calls(store, 1, seed=6, repeats=False)[0]
        cached.forward(layer, x, ids, weights)
        assert any(".observe(" in line for line in seen)
    finally:
        cached.close()

