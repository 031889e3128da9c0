"""The prompt chunk a cache is planned for when none is asked: the longest whose workspace
costs at most PREFILL_SLOT_SHARE of the smallest chunk's slots, against the budgets themselves;
the asked chunk kept; the host's default budget left at the smallest; and a request through
the cache reading its prompt in the planned chunks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from strata import _vmm
from strata.engine.cache.build import plan_cache
from strata.engine.cache.prompt_chunk import PREFILL_CHUNKS, PREFILL_SLOT_SHARE
from strata.engine.kv.plan import plan_elastic_cache
from strata.engine.model.config import ModelConfig
from strata.engine.model.init_model import hf_config
from strata.engine.model.presets import PRESETS
from strata.engine.runtime.engine import Engine
from strata.engine.runtime.generate import (
    CACHED_PREFILL_CHUNK,
    GenerateOptions,
    default_prefill_chunk,
)
from strata.engine.runtime.options import CacheOptions, EngineOptions
from strata.engine.runtime.recording import RoutingCounter
from support.checkpoints import cached_checkpoint

CPU = torch.device("cpu")


def _config(layers: int) -> ModelConfig:
    preset = dataclasses.replace(PRESETS["qwen3-30b-a3b"], n_layers=layers)
    return ModelConfig.from_hf(hf_config("qwen3_moe", preset))


def _plan(config, budget_mib, chunk=None, max_context=32_768, **kw):
    cache = plan_cache(config, torch.bfloat16, CPU, max_context=max_context,
                       prefill_chunk=chunk, budget_mib=budget_mib, **kw)
    cache.backend.close()
    return cache.budget


@pytest.mark.parametrize("budget_mib", [4_096.0, 6_144.0, 12_288.0, 20_000.0])
def test_the_longest_chunk_that_costs_little_of_the_cache(budget_mib):
    config = _config(16)
    budget = _plan(config, budget_mib)
    slots = {}
    for chunk in PREFILL_CHUNKS:
        try:
            slots[chunk] = _plan(config, budget_mib, chunk).n_slots
        except ValueError:  # too small at this chunk: it cannot be chosen
            slots[chunk] = 0
    floor = (1 - PREFILL_SLOT_SHARE) * slots[PREFILL_CHUNKS[0]]
    kept = [chunk for chunk in PREFILL_CHUNKS if slots[chunk] >= floor]
    assert budget.prefill_chunk == max(kept)
    assert budget.n_slots == slots[budget.prefill_chunk]
    assert budget.as_dict()["prefill_chunk"] == budget.prefill_chunk
    bigger = [chunk for chunk in PREFILL_CHUNKS if chunk > budget.prefill_chunk]
    assert all(slots[chunk] < floor for chunk in bigger[:1])


def test_a_larger_budget_affords_a_longer_chunk():
    config = _config(16)
    chunks = [_plan(config, mib).prefill_chunk for mib in (4_096.0, 12_288.0, 20_000.0)]
    assert chunks == sorted(chunks) and chunks[0] < chunks[-1]


def test_the_measured_case_gets_the_chunk_that_was_measured_fastest():
    # docs/prompt-loan.md: qwen3-30b-a3b, 16 layers, 12 GiB, a 36,864-cell window, 4 streamed
    # misses (bench/results/prefill-chunk-h200-2026-11-29.md: 2,048 read a 32K prompt in 0.26x
    # 512's time).
    budget = _plan(_config(16), 12_288.0, max_context=36_864, stream_misses=4)
    assert budget.prefill_chunk == 2048


def test_an_asked_chunk_and_the_host_default_are_kept():
    config = _config(2)
    assert _plan(config, 4_096.0, chunk=777).prefill_chunk == 777
    # No budget on the host: every expert fits whatever the chunk; nothing to choose from.
    assert _plan(config, None).prefill_chunk == PREFILL_CHUNKS[0]


def test_engine_options_take_no_chunk_and_refuse_a_bad_one():
    assert EngineOptions().prefill_chunk is None
    for bad in (0, -4, 1.5, True):
        with pytest.raises(ValueError, match="prefill_chunk must be an int >= 1"):
            EngineOptions(prefill_chunk=bad)


def test_a_request_through_the_cache_reads_its_prompt_in_the_planned_chunks(monkeypatch):
    # 64 MiB leave every chunk the tiny model's 16 slots: the longest is chosen.
    ckpt = cached_checkpoint("qwen3_moe", "tiny")
    options = EngineOptions(max_context=2048, cache=CacheOptions(vram_budget_mib=64.0))
    seen = []
    with Engine.from_options(ckpt, options) as engine:
        assert engine.cache.budget.prefill_chunk == PREFILL_CHUNKS[-1]
        # A routing recorder around the cache (--trace) reads the prompt as the cache alone.
        inner = engine.model.experts
        config = engine.model.config
        engine.model.experts = RoutingCounter(inner, config.n_layers, config.n_experts, "cpu")
        assert default_prefill_chunk(engine.model) == PREFILL_CHUNKS[-1]
        engine.model.experts = inner
        forward = engine.model.forward

        def counting(ids, start, kv, **kw):
            seen.append(ids.shape[0])
            return forward(ids, start, kv, **kw)

        monkeypatch.setattr(engine.model, "forward", counting)
        engine.generate([3 + i % 250 for i in range(1100)], GenerateOptions(
            max_new=2, max_context=2048, temperature=0.0, ignore_stop=True, cuda_graphs=False))
    assert seen[0] == 1100 > CACHED_PREFILL_CHUNK  # one chunk, where 512 made three


def test_an_elastic_plan_compares_its_budgets_at_one_chunk():
    # The chunk is chosen once, with the whole window mapped, then every budget the elastic
    # plan weighs (as its start cells vary) is sized for it: the plain plan's. At 7,000 MiB
    # the half window the K/V starts with would afford 1,024 where the whole one affords 512.
    config = _config(16)
    assert _plan(config, 7_000.0, kv_cells=16_384).prefill_chunk == 1024
    backend = _vmm.HostBackend(2 << 20)
    try:
        cache, kv_grow, _ = plan_elastic_cache(
            config, torch.bfloat16, CPU, profile=True, max_context=32_768, prefill_chunk=None,
            budget_mib=7_000.0, backend=backend, environ={})
        assert kv_grow is not None and kv_grow.params.init_cells == 16_384
        assert cache.budget.prefill_chunk == _plan(config, 7_000.0).prefill_chunk == 512
    finally:
        backend.close()
