"""The expert cache on a CUDA device (run with `pytest -m cuda` on the GPU machine): the arena on
the driver's virtual memory, pinned uploads, and the same correctness as on the host."""

import dataclasses

import pytest
import torch

from strata.engine.cache.build import plan_cache
from strata.engine.model.config import ModelConfig
from strata.engine.model.moe import load_model
from strata.engine.runtime.generate import GenerateOptions, generate
from strata.engine.runtime.load import load
from strata.policies.builtin.lru import Lru
from support.checkpoints import cached_checkpoint

pytestmark = pytest.mark.cuda

PROMPT = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(1)).tolist()
OPTIONS = GenerateOptions(max_new=8, max_context=128, temperature=0.0, ignore_stop=True,
                          prefill_chunk=48, cuda_graphs=False)


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def small(request):
    ckpt = cached_checkpoint("qwen3_moe", "small", dtype=request.param)
    model = load_model(ckpt, device="cuda")
    return ckpt, generate(model, None, PROMPT, OPTIONS)


def _cached(ckpt, **options):
    config = ModelConfig.from_dir(ckpt)
    cache = plan_cache(config, config.dtype, torch.device("cuda"), max_context=128,
                       prefill_chunk=48, prefill_loan=False, **options)
    return load(ckpt, device="cuda", cache=cache).model


def _close(model):
    """The cache's arena released and its store's pages unlocked now, as `Loaded.close` does:
    left to the collector, the unlock's device synchronisation could come while a later test
    captures a graph, and break the capture."""
    model.experts.close()
    model.experts.store.close()


def test_default_budget_is_the_free_memory(small):
    model = _cached(small[0])
    try:
        budget = model.experts.budget
        assert budget.budget_source == "free device memory" and budget.holds_every_expert
        assert budget.budget_bytes <= torch.cuda.mem_get_info()[1]
        assert model.experts.store.layer_blobs(0).is_pinned()
    finally:
        _close(model)


def test_full_cache_is_byte_identical_on_cuda(small):
    ckpt, expected = small
    model = _cached(ckpt)
    try:
        assert model.experts.device_only
        result = generate(model, None, PROMPT, OPTIONS)
    finally:
        _close(model)
    assert torch.equal(result.first_logits, expected.first_logits)
    assert result.tokens == expected.tokens


def test_mixed_cache_on_cuda_agrees_and_repeats(small):
    ckpt, expected = small
    runs = []
    for _ in range(2):
        model = _cached(ckpt, expert_cache_mib=8, policy=Lru())
        try:
            runs.append(generate(model, None, PROMPT, OPTIONS))
        finally:
            _close(model)
    a, b = runs
    assert 0 < a.cache.hits < a.cache.lookups and a.cache.total.admitted > 0
    assert a.tokens == b.tokens and torch.equal(a.first_logits, b.first_logits)
    tolerance = 1e-5 if ModelConfig.from_dir(ckpt).dtype == torch.float32 else 2.0**-6
    scale = expected.first_logits.abs().max().item()
    assert (a.first_logits - expected.first_logits).abs().max().item() <= tolerance * scale


def test_full_cache_replays_cuda_graphs_like_the_runtime(small):
    ckpt, _ = small
    graphs = GenerateOptions(max_new=8, max_context=128, temperature=0.0, ignore_stop=True,
                             prefill_chunk=48)
    resident = load_model(ckpt, device="cuda")
    expected = generate(resident, None, PROMPT, graphs)
    del resident
    model = _cached(ckpt)
    try:
        result = generate(model, None, PROMPT, graphs)
        heat = model.experts.table.heat.sum()
    finally:
        _close(model)
    assert expected.decode_path == result.decode_path == "cuda-graph"
    assert result.tokens == expected.tokens
    decode = result.cache.decode
    assert decode.passes == len(result.tokens) - 1
    assert decode.hits == decode.lookups == decode.layer_calls * ModelConfig.from_dir(ckpt).top_k
    assert heat == result.cache.lookups  # prompt and decode routing, all in the books


def test_streamed_misses_on_cuda_agree_and_repeat(small):
    # The uploads are asynchronous copies from the pinned store into one staging buffer,
    # reused layer after layer: stream order alone keeps a copy from overwriting blobs a
    # previous layer's kernels still read. Repeated runs give the same bytes.
    ckpt, expected = small
    runs = []
    for _ in range(2):
        model = _cached(ckpt, expert_cache_mib=8, stream_misses=2)
        try:
            runs.append(generate(model, None, PROMPT, OPTIONS))
        finally:
            _close(model)
    a, b = runs
    assert a.cache.decode.streamed_experts > 0
    assert a.tokens == b.tokens and torch.equal(a.first_logits, b.first_logits)
    if ModelConfig.from_dir(ckpt).dtype == torch.float32:
        assert a.tokens == expected.tokens


def test_piecewise_graphs_call_the_cache_between_the_pieces(small):
    # A cache that misses and admits (lru): the experts run eagerly between the graphs, so
    # their books, stats and admissions are those of the eager path, round for round.
    ckpt, _ = small
    piecewise = dataclasses.replace(OPTIONS, cuda_graphs=True, piecewise_graphs=True)
    runs = []
    for options in (OPTIONS, piecewise, piecewise):
        model = _cached(ckpt, expert_cache_mib=8, policy=Lru())
        try:
            runs.append(generate(model, None, PROMPT, options))
            model.experts.table.validate()
        finally:
            _close(model)
    eager, first, second = runs
    assert eager.decode_path == "eager" and first.decode_path == "piecewise-cuda-graph"
    assert first.tokens == second.tokens  # deterministic
    for name in ("passes", "layer_calls", "lookups"):
        assert getattr(first.cache.decode, name) == getattr(eager.cache.decode, name)
    assert first.cache.decode.cpu_experts > 0
    # The graphs attend through a mask over their window, the eager path over the cells
    # written: the same tokens in fp32.
    if ModelConfig.from_dir(ckpt).dtype == torch.float32:
        assert first.tokens == eager.tokens
        assert first.cache.decode.hits == eager.cache.decode.hits


def _poison_free_memory() -> None:
    """NaN in the blocks the caching allocator hands out next (small and large ones): what a
    buffer nobody writes may hold. A decode graph's warm-up once summed such rows (a miss's,
    before the host writes it) into the hidden state, which routed to expert ids out of
    range on qwen3-30b-a3b."""
    blocks = [torch.full((n,), float("nan"), device="cuda")
              for n in (2 ** k for k in range(6, 22)) for _ in range(8)]
    del blocks


@pytest.mark.parametrize("stream_misses", [0, 2])
def test_piecewise_graphs_with_split_calls_give_the_same_bytes(small, stream_misses):
    """The hits inside the graphs, the misses on the host (`graph_call`): the tokens, logits,
    books and stats of the calls made whole between the graphs, whatever garbage the
    device's free memory holds."""
    ckpt, _ = small
    piecewise = dataclasses.replace(OPTIONS, cuda_graphs=True, piecewise_graphs=True)
    runs, books = [], []
    for split in (False, True):
        model = _cached(ckpt, expert_cache_mib=8, policy=Lru(), stream_misses=stream_misses)
        model.experts.split_calls = split
        try:
            assert model.experts.splits_calls == split
            _poison_free_memory()
            runs.append(generate(model, None, PROMPT, piecewise))
            books.append(model.experts.table.res.copy())
            model.experts.table.validate()
        finally:
            _close(model)
    whole, split = runs
    assert split.decode_path == "piecewise-cuda-graph"
    assert split.tokens == whole.tokens and torch.equal(split.first_logits, whole.first_logits)
    assert (books[0] == books[1]).all()
    for name in ("passes", "layer_calls", "lookups", "hits", "cpu_experts", "admitted",
                 "streamed_experts"):
        assert getattr(split.cache.decode, name) == getattr(whole.cache.decode, name), name
    assert split.cache.decode.cpu_experts + split.cache.decode.streamed_experts > 0


def test_piecewise_graphs_that_prefetch_keep_the_books_and_repeat(small):
    """Split calls that predict and prefetch the next layer's misses on the copy stream
    (`strata.engine.cache.prefetch`): the books and counts of the calls without it, logits
    within rounding of them (prefetched misses run on the device, not the CPU), the same
    tokens run to run, and prefetched experts streamed by the layer they were uploaded for."""
    ckpt, _ = small
    piecewise = dataclasses.replace(OPTIONS, cuda_graphs=True, piecewise_graphs=True)
    runs, books, prefetch = [], [], []
    for ahead in (0, 2, 2):
        model = _cached(ckpt, expert_cache_mib=8, stream_misses=2, prefetch_misses=ahead)
        try:
            assert model.experts.splits_calls
            assert (model.experts.prefetch is not None) == (ahead > 0)
            runs.append(generate(model, None, PROMPT, piecewise))
            books.append(model.experts.table.res.copy())
            model.experts.table.validate()
            streamer = model.experts.streamer
            prefetch.append((streamer.prefetched_experts, streamer.prefetch_used))
            if ahead:  # issuing reads nothing from the device: it waits for no upload
                torch.cuda.set_sync_debug_mode("error")
                try:
                    predicted = list(range(model.experts.n_experts))
                    model.experts.prefetch.issue(0, predicted, model.experts.table, streamer)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
        finally:
            _close(model)
    plain, first, second = runs
    assert first.decode_path == "piecewise-cuda-graph"
    assert first.tokens == second.tokens and torch.equal(first.first_logits, second.first_logits)
    assert (books[0] == books[1]).all()
    for name in ("passes", "layer_calls", "lookups", "hits"):
        assert getattr(first.cache.decode, name) == getattr(plain.cache.decode, name), name
    assert prefetch[1] == prefetch[2] and prefetch[1][0] > 0
    assert 0 <= prefetch[1][1] <= prefetch[1][0]
    assert first.cache.decode.streamed_experts >= plain.cache.decode.streamed_experts


def test_the_loans_pipelined_uploads_give_the_bytes_of_one_batch(small, monkeypatch):
    """The prompt loan on CUDA, its misses uploaded in 4 batches queued on the copy stream
    (each computed once it is there) against 1: the same logits in fp32 (the per-expert loop),
    within bf16's rounding where the grouped products run, and the same bytes run to run."""
    ckpt, _ = small
    config = ModelConfig.from_dir(ckpt)
    monkeypatch.setenv("STRATA_LOAN_KEEP_SLOTS", "4")
    runs = []
    for batches in ("1", "4", "4"):
        monkeypatch.setenv("STRATA_LOAN_UPLOAD_BATCHES", batches)
        cache = plan_cache(config, config.dtype, torch.device("cuda"), max_context=128,
                           prefill_chunk=48, expert_cache_mib=8, short_read=8)
        model = load(ckpt, device="cuda", cache=cache).model
        try:
            assert model.experts.loan.options.upload_batches == int(batches)
            runs.append(generate(model, None, PROMPT, OPTIONS))
            model.experts.table.validate()
        finally:
            _close(model)
    one, four, again = runs
    assert four.cache.prompt.loan_experts > 0
    assert four.cache.prompt.loan_experts == one.cache.prompt.loan_experts
    assert four.tokens == again.tokens and torch.equal(four.first_logits, again.first_logits)
    if config.dtype == torch.float32:
        assert torch.equal(four.first_logits, one.first_logits) and four.tokens == one.tokens
    else:
        torch.testing.assert_close(four.first_logits, one.first_logits, rtol=0.02, atol=0.02)


def test_prompt_experts_from_slots_run_as_grouped_products_on_hopper(small):
    """bf16 on Hopper: a prompt's hits (and the loan's batches) by two grouped products over
    the rows sorted by slot, agreeing with the per-expert loop and repeating its bytes."""
    import numpy as np

    from strata.engine.cache.from_slots import compute_from_slots
    from strata.engine.experts import sorted_grouped
    from strata.engine.experts.routed import Routed

    ckpt, _ = small
    model = _cached(ckpt)
    try:
        cache = model.experts
        x = torch.randn(40, cache.hidden_size, device="cuda", dtype=cache.arena.dtype,
                        generator=torch.Generator("cuda").manual_seed(0))
        if not sorted_grouped.available(x):
            pytest.skip("the grouped products run for bf16 on Hopper and later")
        rng = np.random.default_rng(0)
        ids = np.stack([rng.choice(cache.n_experts, 4, replace=False) for _ in range(40)])
        routed = Routed.of(ids)
        slots = cache.table.lookup(1, routed.experts[None, :])[0][0]  # every expert resident
        grouped = compute_from_slots(cache.arena, x, routed, slots)
        again = compute_from_slots(cache.arena, x, routed, slots)
        loop = compute_from_slots(cache.arena, x, routed, slots, grouped=False)
        assert torch.equal(grouped, again)
        scale = loop.float().abs().max()
        assert (grouped.float() - loop.float()).abs().max() <= scale * 2.0**-7
    finally:
        _close(model)
