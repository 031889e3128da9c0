"""Engine and simulator agree: a trace recorded from CPU `generate` runs through the expert cache
replays in `strata.sim` (same policy, slots and profile) to the counts the runs reported."""

import json

import numpy as np
import pytest
import torch

from strata import _vmm
from strata.engine.cache.arena import slot_bytes_for
from strata.engine.cache.budget import MIB, CacheBudget
from strata.engine.cache.build import CacheConfig
from strata.engine.model.config import ModelConfig
from strata.engine.model.moe import load_model
from strata.engine.runtime.calibrate import collect_counts
from strata.engine.runtime.generate import GenerateOptions, generate
from strata.engine.runtime.load import load
from strata.engine.runtime.recording import RoutingRecorder, installed, new_trace_writer
from strata.formats.profile import Profile, fill_rank
from strata.formats.trace import DECODE, PROMPT
from strata.policies.registry import load_registry
from strata.sim import ReplayConfig, replay
from support.checkpoints import cached_checkpoint

CHUNK_BYTES = 65536
# Requests of several prompt chunks (prefill_chunk 5) and decode rounds.
PROMPTS = [list(range(10, 27)), [200, 3, 41, 7, 99, 12, 250, 8, 1], list(range(100, 133, 3))]
CALIBRATION = [list(range(30, 60)), [5, 9, 13, 17, 21, 25, 29]]


@pytest.fixture(scope="module")
def ckpt():
    return cached_checkpoint("qwen3_moe", "small", dtype=torch.float32)  # L=4, E=16, K=4


@pytest.fixture(scope="module")
def profile(ckpt):
    counts, _ = collect_counts(load_model(ckpt), CALIBRATION, decode_tokens=4)
    return Profile.for_model(counts, ModelConfig.from_dir(ckpt))


def _cached_model(ckpt, profile, policy, n_slots):
    cfg = ModelConfig.from_dir(ckpt)
    slot_bytes = slot_bytes_for(3 * cfg.expert_width * cfg.hidden_size * 4)
    budget = CacheBudget(
        budget_bytes=1 << 40, reserve_bytes=0, dense_bytes=0, kv_bytes=0, workspace_bytes=0,
        slot_bytes=slot_bytes, chunk_bytes=CHUNK_BYTES,
        total_experts=cfg.n_layers * cfg.n_experts,
        expert_cache_mib=n_slots * slot_bytes / MIB,
    )
    assert budget.n_slots == n_slots
    rank, warning = fill_rank(profile, cfg.n_layers, cfg.n_experts)
    assert warning is None
    config = CacheConfig(budget=budget, backend=_vmm.HostBackend(CHUNK_BYTES),
                         policy=load_registry().create(policy), rank=rank, prefill_loan=False)
    return load(ckpt, dtype=torch.float32, cache=config).model


def _run(model, options):
    """Each prompt as one request, recorded; returns (trace, per-request CacheStats)."""
    writer = new_trace_writer(model, "test_trace_sim")
    recorder = RoutingRecorder(model.experts, writer)
    stats = []
    with installed(model, recorder):
        for prompt in PROMPTS:
            with recorder.request(len(prompt)):
                stats.append(generate(model, None, prompt, options).cache)
    return writer.finish(), stats


@pytest.mark.parametrize("policy,n_slots", [("lru", 20), ("sieve", 24), ("coldest-in-loan", 16),
                                            ("lfu", 9)])
def test_replay_reports_the_runs_hits_misses_and_admissions(ckpt, profile, policy, n_slots):
    model = _cached_model(ckpt, profile, policy, n_slots)
    options = GenerateOptions(max_new=7, temperature=0, prefill_chunk=5, ignore_stop=True)
    trace, stats = _run(model, options)
    result = replay(trace, load_registry().create(policy), ReplayConfig(slots=n_slots),
                    profile.counts)
    engine_hits = sum(s.hits for s in stats)
    engine_lookups = sum(s.lookups for s in stats)
    assert (result.hits, result.accesses) == (engine_hits, engine_lookups)
    assert result.misses == engine_lookups - engine_hits and result.misses > 0
    assert result.hits > 0
    # Request by request and phase by phase, too.
    for r, request in enumerate(stats):
        s0, s1 = trace.request_offsets[r], trace.request_offsets[r + 1]
        for phase, code in (("prompt", PROMPT), ("decode", DECODE)):
            steps = np.arange(s0, s1)[trace.step_phase[s0:s1] == code]
            engine = request.phase(phase)
            assert engine.hits == int(result.steps.hits[steps].sum()), (r, phase)
            assert engine.passes == steps.size
            # Distinct experts sent to the CPU, per layer call: the sim's distinct misses.
            assert engine.cpu_experts == int(result.steps.distinct_misses[steps].sum())
    assert sum(s.total.admitted for s in stats) == result.admissions
    assert sum(s.total.evicted for s in stats) == result.evictions
    if policy in ("lru", "sieve", "lfu"):
        assert result.admissions > 0  # the adaptive policies did change the cache
    model.experts.close()


def test_a_full_cache_hits_everything_in_both(ckpt, profile):
    model = _cached_model(ckpt, profile, "lru", 64)
    trace, stats = _run(model, GenerateOptions(max_new=3, temperature=0, ignore_stop=True))
    result = replay(trace, load_registry().create("lru"), ReplayConfig(slots=64), profile.counts)
    assert result.misses == 0 and sum(s.lookups - s.hits for s in stats) == 0
    model.experts.close()


def test_strata_generate_trace_replays_in_strata_simulate(ckpt, profile, tmp_path, capsys):
    """The command lines: `strata generate --trace` with a profile and a policy, then
    `strata simulate` of its trace with the same ones, report the same hits and misses."""
    from strata.cli.main import main

    profile_path, trace_path = tmp_path / "profile.npz", tmp_path / "trace.npz"
    profile.save(profile_path)
    status = main(["generate", "--model", str(ckpt), "--device", "cpu", "--temperature", "0",
                   "--max-new", "12", "--prefill-chunk", "8", "--expert-cache", "20",
                   "--expert-profile", str(profile_path), "--policy", "lru",
                   "--no-prefill-loan", "--trace", str(trace_path), "--json",
                   "The quick brown fox jumps over the lazy dog"])
    out, err = capsys.readouterr()
    assert status == 0, err
    run = json.loads(out)["cache"]
    assert 0 < run["hits"] < run["lookups"] and run["admitted"] > 0
    status = main(["simulate", str(trace_path), "--policy", "lru", "--slots", str(run["slots"]),
                   "--profile", str(profile_path), "--bounds", "none", "--json", "--quiet"])
    out, err = capsys.readouterr()
    assert status == 0, err
    (row,) = json.loads(out)["results"]
    assert (row["hits"], row["misses"]) == (run["hits"], run["lookups"] - run["hits"])
    assert row["admissions"] == run["admitted"]
