"""`--experts-dtype`: experts quantized at load, read in place by every path that computes them.

A model whose experts are quantized at load must compute exactly what the same model computes
from a checkpoint whose expert weights were replaced by the weights the format stands for
(`fake_quantize_experts`): the resident experts, the cache's slots (decode and prompt), the
CPU's misses, the streamed misses and the prompt loan, on the host backend in fp32 (where each
path's arithmetic over the dequantized weights is the same as over plain ones).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from strata.engine.cache.arena import slot_bytes_for
from strata.engine.cache.budget import workspace_bytes
from strata.engine.cache.build import build_cached_experts, plan_cache
from strata.engine.experts import ResidentExperts
from strata.engine.experts.quant import WEIGHT_FORMATS, expert_blob_bytes, experts_quant_for
from strata.engine.model.config import ModelConfig
from strata.engine.model.init_model import write_checkpoint
from strata.engine.model.layers import route
from strata.engine.model.presets import get_preset
from strata.engine.runtime.engine import Engine
from strata.engine.runtime.generate import GenerateOptions
from strata.engine.runtime.options import CacheOptions, EngineOptions
from support.checkpoints import cached_checkpoint, fake_quantize_experts, make_checkpoint, store_of

MIB = 1 << 20
PROMPT = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(2)).tolist()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """fmt -> a fp32 checkpoint whose experts are the weights `fmt` stands for."""
    made = {}

    def of(fmt):
        if fmt not in made:
            path = make_checkpoint(tmp_path_factory.mktemp(fmt) / "ckpt", "qwen3_moe", "tiny",
                                   dtype=torch.float32)
            made[fmt] = fake_quantize_experts(path, fmt)
        return made[fmt]

    return of


def _options(**kw):
    return GenerateOptions(max_new=6, max_context=128, temperature=0.0, ignore_stop=True,
                           prefill_chunk=32, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", WEIGHT_FORMATS)
def test_resident_quantized_experts_compute_as_their_weights(reference, fmt, dtype):
    quantized = ResidentExperts(store_of(cached_checkpoint("qwen3_moe", "tiny",
                                                           dtype=torch.float32),
                                         dtype=dtype, quant=fmt), "cpu")
    plain = ResidentExperts(store_of(reference(fmt), dtype=dtype), "cpu")
    gen = torch.Generator().manual_seed(3)
    for n_tokens in (1, 9):  # decode (gathered) and a prompt chunk (per expert)
        x = torch.randn(n_tokens, 64, generator=gen).to(dtype)
        ids, weights = route(torch.randn(n_tokens, 8, generator=gen), 2, False)
        for layer in range(2):
            assert torch.equal(quantized.forward(layer, x, ids, weights),
                               plain.forward(layer, x, ids, weights))
    with pytest.raises(ValueError, match=r"the blobs are quantized \(" + fmt):
        quantized.gate_up(0)


@pytest.mark.parametrize("fmt", WEIGHT_FORMATS)
def test_a_quantized_prompt_takes_grouped_products_where_they_run(reference, fmt, monkeypatch):
    """Where the grouped products run (bf16 on Hopper; forced here, as torch's `_grouped_mm`
    runs on the CPU too), a prompt chunk's quantized experts are computed a batch of blobs at
    a time (`BlobStack.grouped_rows`), resident and from the cache's slots: the same bytes as
    the fake-quantized weights' through that path, close to the loop over the experts."""
    from strata import _vmm
    from strata.engine.cache.arena import Arena
    from strata.engine.cache.from_slots import SlotsIndex, compute_from_slots
    from strata.engine.experts import sorted_grouped
    from strata.engine.experts.blobs import BlobStack
    from strata.engine.experts.routed import Routed

    store = store_of(cached_checkpoint("qwen3_moe", "tiny", dtype=torch.float32),
                     dtype=torch.bfloat16, quant=fmt)
    quantized = ResidentExperts(store, "cpu")
    plain = ResidentExperts(store_of(reference(fmt), dtype=torch.bfloat16), "cpu")
    loop = ResidentExperts(store, "cpu", grouped_prefill=False)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 64, generator=gen).to(torch.bfloat16)
    ids, weights = route(torch.randn(9, 8, generator=gen), 2, False)
    calls = []
    real = BlobStack.grouped_rows
    monkeypatch.setattr(BlobStack, "grouped_rows",
                        lambda self, *a: calls.append(self.quant) or real(self, *a))
    monkeypatch.setattr(sorted_grouped, "available", lambda x: True)
    got = quantized.forward(1, x, ids, weights)
    assert calls == [fmt]
    # Its weights through the same path (forced, plain bf16 takes it in `_per_expert` too).
    assert torch.equal(got, plain.forward(1, x, ids, weights)) and calls == [fmt, None]
    scale = loop.forward(1, x, ids, weights).float().abs().max()
    assert (got.float() - loop.forward(1, x, ids, weights).float()).abs().max() <= scale / 64

    slot_bytes = slot_bytes_for(store.blob_bytes)
    arena = Arena(_vmm.HostBackend(1 << 16), store.n_experts, slot_bytes,
                  hidden_size=store.hidden_size, expert_width=store.expert_width,
                  dtype=store.dtype, quant=fmt)
    try:
        arena.upload(list(range(store.n_experts)),
                     np.stack([np.ones(store.n_experts, np.int64),
                               np.arange(store.n_experts)], 1), store)
        routed = Routed.of(ids.numpy())
        slots = routed.experts  # expert e in slot e
        from_slots = compute_from_slots(arena, x, routed, slots)
        assert calls == [fmt, None, fmt]
        looped = compute_from_slots(arena, x, routed, slots, grouped=False)
        assert (from_slots.float() - looped.float()).abs().max() <= \
            looped.float().abs().max() / 64
        order = torch.tensor(routed.rows)  # the resident path's rows, (token, k) order
        resident_rows = quantized._per_expert(1, x, ids)
        assert torch.equal(from_slots, resident_rows[order])
        # One index uploaded for every expert, read a group at a time (the prompt loan's
        # batches): the same rows, on both paths.
        index = SlotsIndex.upload(routed, slots, x.device)
        mid = routed.n_experts // 2
        for grouped, whole in ((None, from_slots), (False, looped)):
            parts = [compute_from_slots(arena, x, routed.group(lo, hi), slots[lo:hi],
                                        grouped=grouped, index=index.part(lo, hi))
                     for lo, hi in ((0, mid), (mid, routed.n_experts))]
            assert torch.equal(torch.cat(parts), whole)
        with pytest.raises(ValueError, match=r"the index covers \d+ rows of \d+ experts"):
            compute_from_slots(arena, x, routed.group(0, mid), slots[:mid], index=index)
    finally:
        arena.close()


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["int8", "int4-g32"])
def test_on_hopper_a_quantized_prompt_runs_grouped_products_and_repeats(fmt):
    """bf16 on the GPU: a prompt chunk's quantized resident experts through
    `BlobStack.grouped_rows`, agreeing with the loop over the experts and repeating its bytes."""
    from strata.engine.experts import sorted_grouped

    store = store_of(cached_checkpoint("qwen3_moe", "small"), dtype=torch.bfloat16, quant=fmt)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, store.hidden_size, generator=gen).to("cuda", torch.bfloat16)
    if not sorted_grouped.available(x):
        pytest.skip("the grouped products run for bf16 on Hopper and later")
    ids, weights = route(torch.randn(40, store.n_experts, generator=gen), 4, False)
    ids, weights = ids.cuda(), weights.cuda()
    grouped = ResidentExperts(store, "cuda")
    got = grouped.forward(0, x, ids, weights)
    assert torch.equal(got, grouped.forward(0, x, ids, weights))
    loop = ResidentExperts(store, "cuda", grouped_prefill=False).forward(0, x, ids, weights)
    assert (got.float() - loop.float()).abs().max() <= loop.float().abs().max() * 2.0**-6


@pytest.mark.parametrize("fmt", WEIGHT_FORMATS)
def test_a_quantized_engine_generates_what_its_weights_do(reference, fmt, monkeypatch):
    """Resident, through a small cache (hits, CPU misses, streamed misses, the loan), with the
    elastic K/V: tokens and first logits equal to the fake-quantized checkpoint's."""
    monkeypatch.setenv("STRATA_LOAN_KEEP_SLOTS", "0")  # a loan from a cache this small
    ckpt = cached_checkpoint("qwen3_moe", "tiny", dtype=torch.float32)
    cfg = ModelConfig.from_dir(ckpt)
    slots = {q: slot_bytes_for(expert_blob_bytes(cfg.expert_width, cfg.hidden_size,
                                                 torch.float32, q)) for q in (fmt, None)}
    n_slots = 6  # of 16 experts: misses on the CPU, and a loan for the 70-token prompt
    for cache in ({}, {"expert_cache_mib": None, "stream_misses": 1, "short_read": 16},
                  {"expert_cache_mib": None, "kv_grow": True, "short_read": 16}):
        results = []
        for path, experts_dtype, quant in ((ckpt, fmt, fmt), (reference(fmt), "auto", None)):
            if "expert_cache_mib" in cache:
                cache = {**cache, "expert_cache_mib": n_slots * slots[quant] / MIB}
            options = EngineOptions(dtype=torch.float32, experts_dtype=experts_dtype,
                                    max_context=128, prefill_chunk=32,
                                    cache=CacheOptions(**cache))
            with Engine.from_options(path, options) as engine:
                assert engine.model.experts_dtype == (quant or "float32")
                if "expert_cache_mib" in cache:
                    assert engine.cache.arena.n_slots == n_slots
                    assert engine.cache.arena.slot_bytes == slots[quant]
                result = engine.generate(PROMPT, _options())
                if "expert_cache_mib" in cache:
                    stats = result.cache
                    assert stats.hits < stats.lookups
                    assert stats.phase("prompt").loan_experts > 0
                    if cache.get("stream_misses"):
                        assert stats.phase("decode").streamed_experts > 0
                results.append(result)
        assert results[0].tokens == results[1].tokens
        assert torch.equal(results[0].first_logits, results[1].first_logits)


def test_a_quantized_cache_holds_more_experts_in_the_same_budget():
    cfg = ModelConfig.from_dir(cached_checkpoint("qwen3_moe", "small"))
    device = torch.device("cpu")
    budgets = {}
    for quant in (None, "int8", "int4-g32"):
        config = plan_cache(cfg, torch.bfloat16, device, max_context=64, prefill_chunk=16,
                            expert_cache_mib=4.0, experts_quant=quant)
        config.backend.close()
        budgets[quant] = config.budget
        assert config.budget.slot_bytes == slot_bytes_for(
            expert_blob_bytes(cfg.expert_width, cfg.hidden_size, torch.bfloat16, quant))
    assert budgets["int8"].n_slots > 1.8 * budgets[None].n_slots
    assert budgets["int4-g32"].n_slots > 3 * budgets[None].n_slots
    # The staging buffer of streamed misses holds quantized blobs too.
    for quant in (None, "int8"):
        staging = [workspace_bytes(cfg, 16, 64, torch.bfloat16, blobs, experts_quant=quant)
                   for blobs in (0, 64)]
        blob = expert_blob_bytes(cfg.expert_width, cfg.hidden_size, torch.bfloat16, quant)
        assert abs(staging[1] - staging[0] - 64 * blob) < MIB  # the workspace is whole MiB


def test_bad_experts_dtypes_are_refused_before_loading(tmp_path):
    ckpt = cached_checkpoint("qwen3_moe", "tiny")
    with pytest.raises(ValueError, match=r"--experts-dtype must be one of auto, bf16, int8, "
                                         r"int4, int4-g32, int4-g64, got 'int3'"):
        EngineOptions(experts_dtype="int3")
    with pytest.raises(ValueError, match=r"--experts-dtype bf16 keeps the experts in the "
                                         r"model's dtype, and this model computes in float32"):
        Engine.from_options(ckpt, EngineOptions(dtype=torch.float32, experts_dtype="bf16"))
    assert experts_quant_for("bf16", torch.bfloat16) is None
    assert experts_quant_for("int4", torch.float32) == "int4-g32"
    # int4 needs D and F multiples of its group.
    odd = write_checkpoint(tmp_path / "odd", "qwen3_moe",  # F = 96: of 32, not of 64
                           dataclasses.replace(get_preset("tiny"), expert_width=96))
    with pytest.raises(ValueError, match=r"int4-g64 needs F and D multiples of 64, got F = 96"):
        Engine.from_options(odd, EngineOptions(experts_dtype="int4-g64"))


def test_a_store_in_another_format_than_the_plan_is_refused():
    ckpt = cached_checkpoint("qwen3_moe", "tiny")
    cfg = ModelConfig.from_dir(ckpt)
    config = plan_cache(cfg, torch.bfloat16, torch.device("cpu"), max_context=64,
                        prefill_chunk=16, expert_cache_mib=1.0, experts_quant="int8")
    try:
        with pytest.raises(ValueError, match=r"the cache was planned for experts in int8, the "
                                             r"store holds torch.bfloat16"):
            build_cached_experts(config, store_of(ckpt), "cpu")
        assert config.backend.alive_chunks == 0  # refused before the arena was made
        cached = build_cached_experts(config, store_of(ckpt, quant="int8"), "cpu")
        try:
            assert cached.arena.quant == "int8"
            ids = np.arange(cfg.n_layers * cfg.n_experts)
            assert cached.table.n_resident == min(cached.arena.n_slots, ids.size)
        finally:
            cached.close()
    finally:
        config.backend.close()


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["int8", "int4-g32"])
def test_on_cuda_quantized_experts_agree_with_their_weights_and_repeat(tmp_path, fmt):
    """bf16 on the GPU: the Triton kernels read the slots in place (CUDA graphs with every
    expert resident; hits, streamed and CPU misses and the loan through a small cache). They
    sum in another order than the bf16 kernels over the fake-quantized weights, so the logits
    agree to a few bf16 ulps, and each run repeats its own bytes."""
    ckpt = cached_checkpoint("qwen3_moe", "small")
    plain = fake_quantize_experts(make_checkpoint(tmp_path / "ref", "qwen3_moe", "small"), fmt)
    cfg = ModelConfig.from_dir(ckpt)
    slot = slot_bytes_for(expert_blob_bytes(cfg.expert_width, cfg.hidden_size, torch.bfloat16,
                                            fmt))
    n_slots = cfg.n_layers * cfg.n_experts // 3
    for cache in ({}, {"expert_cache_mib": n_slots * slot / MIB, "short_read": 16,
                       "stream_misses": 2}):
        runs = []
        for path, experts_dtype in ((ckpt, fmt), (ckpt, fmt), (plain, "auto")):
            options = EngineOptions(device="cuda", experts_dtype=experts_dtype,
                                    max_context=128, prefill_chunk=32,
                                    cache=CacheOptions(**cache) if experts_dtype != "auto"
                                    else CacheOptions())
            with Engine.from_options(path, options) as engine:
                runs.append(engine.generate(PROMPT, _options()))
        assert runs[0].tokens == runs[1].tokens
        assert torch.equal(runs[0].first_logits, runs[1].first_logits)
        scale = runs[2].first_logits.abs().max()
        assert (runs[0].first_logits - runs[2].first_logits).abs().max() <= scale * 2.0**-5


@pytest.mark.parametrize("quant", [None, *WEIGHT_FORMATS])
def test_the_builtin_model_s_cache_is_whole_slots_in_every_format(quant):
    from strata.engine.model.builtin import BUILTIN_PRESET, builtin_expert_cache_mib

    preset = get_preset(BUILTIN_PRESET)
    for dtype in (torch.bfloat16, torch.float32):
        slot = slot_bytes_for(expert_blob_bytes(preset.expert_width, preset.hidden_size, dtype,
                                                quant))
        assert builtin_expert_cache_mib(dtype, quant) * MIB == 8 * slot


def test_a_trace_carries_the_quantized_slot_bytes_to_the_simulator():
    from strata.engine.model.moe import load_model
    from strata.engine.runtime.recording import trace_meta

    ckpt = cached_checkpoint("qwen3_moe", "tiny")
    cfg = ModelConfig.from_dir(ckpt)
    for quant in (None, "int8", "int4-g64"):
        model = load_model(ckpt, experts_quant=quant)
        meta = trace_meta(model, "test")["model"]
        assert meta["experts_dtype"] == (quant or "bfloat16")
        assert meta["slot_bytes"] == slot_bytes_for(expert_blob_bytes(
            cfg.expert_width, cfg.hidden_size, torch.bfloat16, quant))
