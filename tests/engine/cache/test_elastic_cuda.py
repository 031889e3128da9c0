"""The elastic K/V on a CUDA device (run with `pytest -m cuda` on the GPU machine): a graph
captured before a growth replays after it, and the byte-identical gate and the give-up path
through generate on the driver's virtual memory (2 MiB chunks)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from strata.engine.cache.budget import MIB
from strata.engine.cache.build import plan_cache
from strata.engine.kv.kv_cache import KVCache, device_backend
from strata.engine.kv.plan import plan_elastic_cache
from strata.engine.model.config import ModelConfig
from strata.engine.runtime.generate import GenerateOptions, generate
from strata.engine.runtime.load import load
from strata.formats.profile import uniform_rank
from strata.policies.builtin.coldest_in_loan import ColdestInLoan
from support.checkpoints import cached_checkpoint

pytestmark = pytest.mark.cuda

CUDA = torch.device("cuda")
# The small qwen3_moe in bf16: 256-byte K/V cells, 8192 cells a 2 MiB chunk, 8 segments.
PROMPT = torch.randint(0, 256, (8300,), generator=torch.Generator().manual_seed(2)).tolist()
OPTIONS = GenerateOptions(max_new=8, max_context=32768, temperature=0.0, ignore_stop=True,
                          prefill_chunk=1024, cuda_graphs=False)
GROW = {"STRATA_KV_GROW_INIT": "8192", "STRATA_KV_GROW_STEP": "8192",
        "STRATA_KV_GROW_FLOOR": "2"}


def test_a_graph_captured_before_a_growth_replays_after_it():
    backend = device_backend("cuda")
    chunk = backend.chunk_bytes
    # fp32, 2 heads of 128: 1 KiB cells, 2048 a chunk; one layer: a K and a V segment.
    kv = KVCache(backend, 1, 8192, 2, 128, torch.float32, mapped_cells=2048)
    keys = kv.k(0)  # [2048, 2, 128], made before the growth
    keys.fill_(1.0)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        total = keys.sum()  # warm up on a side stream, as capture wants
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        total = keys.sum()
    graph.replay()
    assert total.item() == 2048 * 256
    # Chunks of another range (as the arena's would be) move into the K/V with fresh ones.
    donor = backend.reserve(4 * chunk)
    donor.map(0, 4)
    donor.view(0, (4 * chunk,), torch.uint8).fill_(7)
    given = donor.unmap(0, 4)
    assert kv.map_cells(8192, chunks=given) == 6  # 3 more chunks in each of 2 segments
    assert kv.k(0).data_ptr() == keys.data_ptr() and not kv.k(0)[2048:].any().item()
    keys.fill_(2.0)
    graph.replay()  # the same addresses: the graph reads the cells it read before
    assert total.item() == 2 * 2048 * 256
    kv.close()
    donor.close()
    backend.close()


@pytest.fixture(scope="module")
def ckpt():
    return cached_checkpoint("qwen3_moe", "small", dtype=torch.bfloat16)


def _model(ckpt, *, kv_grow, environ=None, **sizing):
    config = ModelConfig.from_dir(ckpt)
    sizing = {"max_context": OPTIONS.max_context, "prefill_chunk": OPTIONS.prefill_chunk,
              "prefill_loan": False, "rank": uniform_rank(config.n_layers, config.n_experts),
              **sizing}
    if kv_grow:
        cache, elastic, _ = plan_elastic_cache(config, config.dtype, CUDA, profile=True,
                                               environ=environ, **sizing)
    else:
        cache, elastic = plan_cache(config, config.dtype, CUDA, **sizing), None
    return load(ckpt, device=CUDA, cache=cache, kv_grow=elastic)


def _run(loaded, options=OPTIONS):
    try:
        return generate(loaded.model, None, PROMPT, options, kv=loaded.kv)
    finally:
        loaded.close()


def test_grown_into_free_budget_is_byte_identical_on_cuda(ckpt):
    sizing = {"budget_mib": 4096.0, "expert_cache_mib": 12.0}  # 32 of 64 slots, fixed
    plain = _run(_model(ckpt, kv_grow=False, **sizing))
    grown = _run(_model(ckpt, kv_grow=True, environ={**GROW, "STRATA_KV_GROW_FLOOR": "100"},
                        **sizing))
    assert grown.kv.grows == 1 and grown.kv.slots_given_up == 0 and grown.kv.fresh_chunks == 8
    assert grown.kv.cells_mapped == 16384
    assert torch.equal(grown.first_logits, plain.first_logits)
    assert grown.tokens == plain.tokens


class Recorder(ColdestInLoan):
    name = "recorder"

    def __init__(self, options=None):
        super().__init__(options)
        self.given_up: list[int] = []

    def give_up(self, view, n_chunks):
        slots = super().give_up(view, n_chunks)
        self.given_up += [int(s) for s in slots]
        return slots


def test_grown_by_giving_up_slots_on_cuda(ckpt):
    # A budget with no room left beside every expert and the start cells: slots must go. The
    # window is 16,384 cells so that the slots above the floor can hold all of it past the
    # start (the plan maps a window they cannot reach up front).
    options = dataclasses.replace(OPTIONS, max_context=16384)
    probe = _model(ckpt, kv_grow=True, environ=GROW, budget_mib=4096.0, max_context=16384)
    budget = probe.cache.budget
    probe.close()
    every = -(-budget.total_experts * budget.slot_bytes // budget.chunk_bytes)
    exact = budget.fixed_bytes + every * budget.chunk_bytes
    runs = []
    for _ in range(2):
        policy = Recorder()
        loaded = _model(ckpt, kv_grow=True, environ=GROW, budget_mib=exact / MIB,
                        policy=policy, max_context=16384)
        assert loaded.cache.arena.n_slots == 64 and loaded.kv.free_chunks == 0
        result = _run(loaded, options)
        kv = result.kv
        assert kv.grows == 1 and kv.fresh_chunks == 0 and kv.cells_mapped == 16384
        assert kv.slots_given_up == len(policy.given_up) > 0 and kv.relocated == 0
        assert len(result.tokens) == 8
        runs.append(result)
    assert runs[0].tokens == runs[1].tokens
    assert torch.equal(runs[0].first_logits, runs[1].first_logits)


class TrimAtOneStep(ColdestInLoan):
    """The default policy, trimming as soon as a whole step is spare (the default waits for
    two, which this test's window of two steps never has)."""

    name = "trim-at-one-step"

    def kv_target(self, need_cells, mapped_cells, params):
        step, init = params.step_cells, params.init_cells
        if need_cells <= mapped_cells - step:
            return init + -(-max(need_cells - init, 0) // step) * step
        return super().kv_target(need_cells, mapped_cells, params)


def _graph_counts(engine):
    """{step kind: windows captured} of the engine's warm decode steps."""
    return {key[0]: len(step.graphs) for key, step in engine.warm.items()}


def test_an_engine_keeps_its_graphs_across_requests_and_growth(ckpt):
    """Three requests on one engine whose cache holds every expert: a short one captures the
    graph of its window; a long one grows the K/V mid-decode by giving up slots, so its graph
    step (which reads no routing) is replaced by the piecewise one at that round; a short one
    after it trims the K/V, refills the slots and replays the first request's graph without
    capturing it again."""
    from strata.engine.runtime.engine import Engine

    window = 16384
    config = ModelConfig.from_dir(ckpt)
    sizing = {"max_context": window, "prefill_chunk": 1024, "prefill_loan": False,
              "rank": uniform_rank(config.n_layers, config.n_experts)}
    probe, _, _ = plan_elastic_cache(config, config.dtype, CUDA, profile=True, environ=GROW,
                                     budget_mib=4096.0, **sizing)
    budget = probe.budget
    probe.backend.close()
    every = -(-budget.total_experts * budget.slot_bytes // budget.chunk_bytes)
    exact = budget.fixed_bytes + every * budget.chunk_bytes
    cache, elastic, _ = plan_elastic_cache(config, config.dtype, CUDA, profile=True,
                                           environ=GROW, budget_mib=exact / MIB,
                                           policy=TrimAtOneStep(), **sizing)
    options = GenerateOptions(max_new=8, max_context=window, temperature=0.0,
                              ignore_stop=True, prefill_chunk=1024)
    with Engine.open(ckpt, device=CUDA, cache=cache, kv_grow=elastic,
                     max_context=window) as engine:
        short = list(range(10, 110))
        first = engine.generate(short, options)
        assert first.decode_path == "cuda-graph" and first.kv.grows == 0
        assert _graph_counts(engine) == {"graph": 1}
        graph_step = next(step for key, step in engine.warm.items() if key[0] == "graph")
        (window, captured), = graph_step.graphs.items()
        # Decode passes the 8,192 start cells: grown by a step, slots given up mid-decode.
        long = PROMPT[:8100]
        second = engine.generate(long, dataclasses.replace(options, max_new=200))
        assert second.kv.grows == 1 and second.kv.slots_given_up > 0
        assert second.decode_path == "piecewise-cuda-graph" and len(second.tokens) == 200
        # (Its rounds before the growth replayed the graph step, which captured their window.)
        counts = _graph_counts(engine)
        assert set(counts) == {"graph", "piecewise"}
        engine.cache.table.validate()
        # Trimmed back, the slots refilled: the first request's graph replays as captured.
        third = engine.generate(list(range(20, 120)), options)
        # (The K/V's figures count since the engine started.)
        assert third.kv.trims == 1 and third.kv.refilled == second.kv.slots_given_up
        assert third.decode_path == "cuda-graph"
        assert _graph_counts(engine) == counts  # nothing captured again
        assert graph_step.graphs[window] is captured
        engine.cache.table.validate()
