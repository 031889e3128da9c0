"""Prefetching the next layer's likely misses (`strata.engine.cache.prefetch`), on the host
twin: the staging buffer's halves, the prefetched experts streamed first and not uploaded
again, the books and counts as without it, and the bytes close to a run without it (the
device and the CPU round differently) and repeated run to run."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from strata.engine.experts.routed import Routed
from strata.engine.experts.streamed import StreamedMisses, StreamSplit
from strata.engine.model.ops import router_route
from support.token_calls import books, bytes_of, make_cache, small_store, split_call


def _assert_staged_rows_are_computes(streamer, store, layer, streamed, seed):
    """The graph's half (`staged_rows`) writes each streamed expert's row where the map says,
    the bytes a plain buffer's `compute` of the same experts gives."""
    x = torch.randn(1, store.hidden_size, generator=torch.Generator().manual_seed(seed))
    rows = torch.zeros(5, store.hidden_size)  # [K + 1, D]
    streamer.staged_rows(x, rows)
    expected = StreamedMisses(store, torch.device("cpu"), 2).compute(layer, x, streamed)
    for i, row in enumerate(streamed.rows.tolist()):
        assert torch.equal(rows[row + 1], expected[i])


def test_a_prefetched_expert_is_streamed_first_and_not_uploaded_again():
    store = small_store(torch.float32)
    streamer = StreamedMisses(store, torch.device("cpu"), 2, prefetch=True)
    assert streamer.nbytes == 4 * store.blob_bytes  # two halves of N = 2
    assert streamer.prefetch(3, [12, 9]) == 2  # layer 3: the odd half, blobs 2 and 3
    misses = Routed.of(np.array([[3, 9, 12, 5]]))  # four misses; the fixed count streams 2
    streamed, rest = streamer.split(misses, layer=3)
    assert streamed.experts.tolist() == [9, 12] and rest.experts.tolist() == [3, 5]
    assert streamer.count(4, layer=3) is None  # a split call asks the streamer to pick
    # Another layer's call finds nothing prefetched: the first two by id.
    streamed_other, _ = streamer.split(misses, layer=2)
    assert streamed_other.experts.tolist() == [3, 5]
    assert streamer.count(4, layer=2) == 2
    assert streamer.stage(3, streamed, streamed.rows + 1) == 0  # both were there
    assert streamer.stage_map.tolist()[:2] == [3, 2]  # expert 9 in blob 3, 12 in blob 2
    assert (streamer.prefetched_experts, streamer.prefetch_used) == (2, 2)
    _assert_staged_rows_are_computes(streamer, store, 3, streamed, seed=1)
    # One prefetched and missed, one not: the other miss uploads into the free blob.
    streamer.prefetch(2, [7, 1])
    streamed, _ = streamer.split(Routed.of(np.array([[7, 4]])), layer=2)
    assert streamed.experts.tolist() == [4, 7]
    assert streamer.stage(2, streamed, streamed.rows + 1) == 1
    assert streamer.stage_map.tolist()[:2] == [1, 0]  # 4 over 1's blob, 7 where it was
    with pytest.raises(ValueError, match="at most 2 distinct experts"):
        streamer.prefetch(0, [1, 2, 3])
    with pytest.raises(RuntimeError, match="without prefetch"):
        StreamedMisses(store, torch.device("cpu"), 2).prefetch(0, [1])


def _routed_calls(store, routers, n_tokens, seed):
    """Each token's calls through every layer, one x for all of them and each layer routed by
    its router: so layer l+1's router on layer l's x predicts layer l+1 exactly."""
    gen = torch.Generator().manual_seed(seed)
    calls = []
    for _ in range(n_tokens):
        x = torch.randn(1, store.hidden_size, generator=gen).to(store.dtype)  # [1, D]
        for layer, router in enumerate(routers):
            ids, weights = router_route(x, router, 4, True)  # [1, K]
            calls.append((layer, x, ids, weights))
    return calls


def _run(store, routers, prefetch):
    cached = make_cache(store, 24, "coldest-in-loan", 2, token_path=True, prefetch=prefetch)
    try:
        if prefetch:
            cached.use_routers(routers, 4)
        out = [split_call(cached, *call) for call in _routed_calls(store, routers, 6, 9)]
        streamer = cached.streamer
        return (out, books(cached), cached.stats.decode,
                (streamer.prefetched_experts, streamer.prefetch_used))
    finally:
        cached.close()


def _routers(store):
    """A random router [E, D] a layer, seeded."""
    gen = torch.Generator().manual_seed(4)
    return [torch.randn(store.n_experts, store.hidden_size, generator=gen)
            for _ in range(store.n_layers)]


def test_split_calls_that_prefetch_keep_the_books_and_nearly_thebytes_of():
    store = small_store(torch.float32)
    routers = _routers(store)
    plain, plain_books, plain_stats, _ = _run(store, routers, prefetch=0)
    out, books, stats, (prefetched, used) = _run(store, routers, prefetch=2)
    again = _run(store, routers, prefetch=2)[0]
    assert [bytes_of(t) for t in out] == [bytes_of(t) for t in again]  # run to run
    # Exact predictions here: every prefetched expert was missed and streamed from its blob.
    assert prefetched > 0 and used == prefetched
    assert books == plain_books
    for name in ("lookups", "hits", "layer_calls"):
        assert getattr(stats, name) == getattr(plain_stats, name)
    assert stats.cpu_experts + stats.streamed_experts == \
        plain_stats.cpu_experts + plain_stats.streamed_experts  # every miss, either side
    assert stats.streamed_experts >= plain_stats.streamed_experts  # prefetched: all streamed
    # Bytes uploaded: each prefetched blob once, the other streamed ones at their call.
    assert stats.uploaded_bytes == (stats.streamed_experts - used + prefetched) * store.blob_bytes
    for got, expected in zip(out, plain, strict=True):
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_a_capped_prefetch_uploads_the_likeliest_predicted_misses_only():
    """`prefetch_misses` 1 of a staging buffer of 2: each layer uploads at most its likeliest
    predicted miss ahead; the books and the counts are those of the calls without it, and the
    bytes repeat run to run."""
    store = small_store(torch.float32)
    routers = _routers(store)
    _, plain_books, plain_stats, _ = _run(store, routers, prefetch=0)
    out, books, stats, (prefetched, used) = _run(store, routers, prefetch=1)
    _, _, _, (all_prefetched, _) = _run(store, routers, prefetch=2)
    n_issues = 6 * (store.n_layers - 1)  # six tokens; the last layer predicts nothing
    assert 0 < prefetched <= n_issues and prefetched < all_prefetched and used == prefetched
    assert books == plain_books
    assert stats.cpu_experts + stats.streamed_experts == \
        plain_stats.cpu_experts + plain_stats.streamed_experts
    assert [bytes_of(t) for t in out] == [bytes_of(t) for t in _run(store, routers, 1)[0]]


def test_the_prefetch_cap_is_checked_against_the_staging_buffer():
    from strata.engine.cache.prefetch import MissPrefetch, check_prefetch_misses

    check_prefetch_misses(0, 0)  # off needs nothing
    check_prefetch_misses(2, 2)
    for cap, staging, message in ((True, 2, "must be an int >= 0"),
                                  (-1, 2, "must be an int >= 0"),
                                  (1.5, 2, "must be an int >= 0"),
                                  (1, 0, "needs streamed misses"),
                                  (3, 2, "prefetch_misses 3 is more than the staging buffer's 2 "
                                   "blobs")):
        with pytest.raises(ValueError, match=message):
            check_prefetch_misses(cap, staging)
    store = small_store(torch.float32)
    routers = [torch.zeros(store.n_experts, store.hidden_size)] * store.n_layers
    with pytest.raises(ValueError, match="cap must be an int >= 1"):
        MissPrefetch(routers, 4, store.n_experts, torch.device("cpu"), 0)
    with pytest.raises(ValueError, match="prefetch_misses 3 is more than"):
        make_cache(store, 24, "coldest-in-loan", 2, token_path=True, prefetch=3)


def test_prefetch_needs_streamed_misses_and_the_models_routers():
    store = small_store(torch.float32)
    with pytest.raises(ValueError, match="prefetch_misses needs streamed misses"):
        make_cache(store, 24, "coldest-in-loan", 0, token_path=True, prefetch=1)
    cached = make_cache(store, 24, "coldest-in-loan", 2, token_path=True)
    try:
        with pytest.raises(ValueError, match="made without prefetch_misses"):
            cached.use_routers([], 4)
    finally:
        cached.close()
    cached = make_cache(store, 24, "coldest-in-loan", 2, token_path=True, prefetch=2)
    try:
        with pytest.raises(ValueError, match=r"every layer's router \[E = 16, D\]"):
            cached.use_routers([torch.zeros(8, store.hidden_size)] * 4, 4)
        with pytest.raises(ValueError, match="top_k must be an int in"):
            cached.use_routers([torch.zeros(16, store.hidden_size)] * 4, 0)
    finally:
        cached.close()


def test_a_cache_planned_to_prefetch_holds_two_halves_and_the_models_routers():
    """`CacheConfig.prefetch_misses` through `load`: the workspace counts the second half,
    the staging buffer holds 2N blobs, and the cache predicts with the model's own routers."""
    from support.cache_models import cached_model
    from support.checkpoints import cached_checkpoint

    ckpt = cached_checkpoint("qwen3_moe", "small", dtype=torch.float32)
    plain = cached_model(ckpt, expert_cache_mib=12, stream_misses=2)
    model = cached_model(ckpt, expert_cache_mib=12, stream_misses=2, prefetch_misses=2)
    try:
        cache = model.experts
        blob = cache.store.blob_bytes
        # The workspace (rounded to MiB) grew for the second half.
        assert cache.budget.workspace_bytes > plain.experts.budget.workspace_bytes
        assert cache.streamer.nbytes == 4 * blob and plain.experts.prefetch is None
        assert all(router is layer.moe.router
                   for router, layer in zip(cache.prefetch.routers, model.layers, strict=True))
        assert cache.prefetch.top_k == model.config.top_k
    finally:
        plain.experts.close()
        model.experts.close()
    with pytest.raises(ValueError, match="prefetch_misses needs streamed misses"):
        cached_model(ckpt, expert_cache_mib=12, stream_misses=0, prefetch_misses=1)


def test_an_upload_that_fails_leaves_nothing_claimed(monkeypatch):
    """Fault injection: a prefetch or a stage whose copy fails raises, and claims no blob: the
    next call of that layer streams by id and uploads what it streams, with right rows."""
    store = small_store(torch.float32)
    streamer = StreamedMisses(store, torch.device("cpu"), 2, prefetch=True)
    queue = streamer._copies.queue

    def failing(layer, copies):
        raise RuntimeError("injected: the copy engine failed")

    monkeypatch.setattr(streamer._copies, "queue", failing)
    with pytest.raises(RuntimeError, match="injected"):
        streamer.prefetch(1, [4, 6])
    misses = Routed.of(np.array([[6, 4, 2, 9]]))
    streamed, _ = streamer.split(misses, layer=1)
    assert streamed.experts.tolist() == [2, 4]  # nothing prefetched: the first two by id
    with pytest.raises(RuntimeError, match="injected"):
        streamer.stage(1, streamed, streamed.rows + 1)
    monkeypatch.setattr(streamer._copies, "queue", queue)
    assert streamer.stage(1, streamed, streamed.rows + 1) == 2  # both uploaded now
    assert streamer.prefetched_experts == 0 and streamer.prefetch_used == 0
    _assert_staged_rows_are_computes(streamer, store, 1, streamed, seed=2)


@given(st.sets(st.integers(0, 15), min_size=1, max_size=4),
       st.sets(st.integers(0, 15), max_size=2), st.integers(0, 2))
def test_the_split_streams_every_prefetched_miss_first_then_by_id(missed, ahead, n_fixed):
    """Property, against the rule written out: of the misses, the prefetched ones all stream,
    then the first others by id up to the fixed count; each side ascending, together all."""
    store = small_store(torch.float32)
    streamer = StreamedMisses(store, torch.device("cpu"), 2, StreamSplit.fixed(n_fixed, 4),
                              prefetch=True)
    if ahead:
        streamer.prefetch(1, sorted(ahead))
    ids = np.array([sorted(missed) + [e for e in range(16) if e not in missed][:4 - len(missed)]])
    misses = Routed.of(ids, np.arange(4)[None, :] < len(missed))
    streamed, rest = streamer.split(misses, layer=1)
    ready = sorted(missed & ahead)
    others = sorted(missed - ahead)
    expected = sorted(ready + others[:max(min(n_fixed, len(missed)) - len(ready), 0)])
    got = streamed.experts.tolist() if streamed is not None else []
    left = rest.experts.tolist() if rest is not None else []
    assert got == expected and left == sorted(missed - set(expected))
