"""CachedExperts on the host backend: identical to ResidentExperts when full, close when not,
deterministic, and its books, slots, mirror, stats and events in step."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from strata import _vmm
from strata._residency import ResidencyTable
from strata.books import CheckedPolicy
from strata.engine.cache.arena import Arena, slot_bytes_for
from strata.engine.cache.cached_experts import CachedExperts
from strata.engine.cache.stats import PhaseStats
from strata.engine.experts import ResidentExperts
from strata.engine.kv.kv_cache import new_kv
from strata.engine.model.config import ModelConfig
from strata.engine.model.layers import route
from strata.engine.model.moe import load_model
from strata.engine.runtime.generate import GenerateOptions, generate
from strata.policies import Policy, PolicyError, plugin_manager
from strata.policies.builtin.lru import Lru
from strata.policies.events import Admitted, Evicted
from support.cache_models import CHUNK_BYTES, cached_model
from support.checkpoints import cached_checkpoint, store_of
from support.events import EventLog

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# max |logit difference| / max |logit| allowed when experts run on the CPU instead of the slots:
# fp32 rounding, or a few bf16 ulps of the largest logit.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2.0**-6}
PROMPT = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(1)).tolist()
# Two prompt passes of 48 and one of 4 tokens (T > 1: per expert), then 7 decode rounds
# (T == 1: gathered).
OPTIONS = GenerateOptions(max_new=8, max_context=128, temperature=0.0, ignore_stop=True,
                          prefill_chunk=48)


def _store(ckpt_dir):
    return store_of(ckpt_dir)


def _cache(store, n_slots, policy=None, events=None, stream_misses=0):
    slot_bytes = slot_bytes_for(store.blob_bytes)
    table = ResidencyTable(store.n_layers, store.n_experts, n_slots, slot_bytes, CHUNK_BYTES)
    arena = Arena(_vmm.HostBackend(CHUNK_BYTES), n_slots, slot_bytes,
                  hidden_size=store.hidden_size, expert_width=store.expert_width,
                  dtype=store.dtype)
    checked = CheckedPolicy(policy, table) if policy is not None else None
    cached = CachedExperts(store, arena, table, checked, "cpu", events=events,
                           stream_misses=stream_misses)
    cached.fill_hottest()
    return cached


@pytest.fixture(scope="module", params=list(DTYPES), ids=list(DTYPES))
def small(request):
    """(checkpoint dir, model with every expert resident, its generate result): L=4, E=16, K=4."""
    ckpt = cached_checkpoint("qwen3_moe", "small", dtype=DTYPES[request.param])
    model = load_model(ckpt)
    return ckpt, model, generate(model, None, PROMPT, OPTIONS)


def _close(model):
    model.experts.close()


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("n_tokens", [1, 4, 37])  # T == 1: gathered; larger: per expert
def test_full_cache_forward_is_byte_identical(dtype, n_tokens):
    store = _store(cached_checkpoint("qwen3_moe", "tiny", dtype=dtype))  # E=8, K=2
    resident = ResidentExperts(store, "cpu")
    cached = _cache(store, store.n_layers * store.n_experts)
    try:
        gen = torch.Generator().manual_seed(n_tokens)
        for layer in range(store.n_layers):
            x = torch.randn(n_tokens, store.hidden_size, generator=gen).to(dtype)
            logits = torch.randn(n_tokens, store.n_experts, generator=gen)
            ids, weights = route(logits, 2, False)
            expected = resident.forward(layer, x, ids, weights)
            assert torch.equal(cached.forward(layer, x, ids, weights), expected)
        assert cached.stats.hits == cached.stats.lookups == n_tokens * 2 * store.n_layers
    finally:
        cached.close()


def test_full_cache_generates_byte_identical_output(small):
    ckpt, _, expected = small
    model = cached_model(ckpt)
    try:
        assert model.experts.arena.n_slots == 64  # the host default holds every expert
        result = generate(model, None, PROMPT, OPTIONS)
        assert torch.equal(result.first_logits, expected.first_logits)
        assert result.tokens == expected.tokens
        assert result.decode_path == "eager" and result.cache.hit_rate == 1.0
        sampled = GenerateOptions(max_new=12, max_context=128, temperature=0.9, seed=7)
        assert generate(model, None, PROMPT[:20], sampled).tokens == generate(
            small[1], None, PROMPT[:20], sampled).tokens
    finally:
        _close(model)


@pytest.mark.parametrize("expert_cache_mib", [0, 8], ids=["0-slots", "mixed"])
def test_cpu_misses_agree_within_tolerance(small, expert_cache_mib):
    ckpt, resident, expected = small
    model = cached_model(ckpt, expert_cache_mib=expert_cache_mib)
    try:
        result = generate(model, None, PROMPT, OPTIONS)
    finally:
        _close(model)
    stats = result.cache
    if expert_cache_mib == 0:
        assert stats.slots == 0 and stats.hits == 0
    else:
        assert 0 < stats.slots < 64 and 0 < stats.hits < stats.lookups
    assert stats.cpu_experts_per_layer > 0  # both paths ran: slots and the CPU
    scale = expected.first_logits.abs().max().item()
    diff = (result.first_logits - expected.first_logits).abs().max().item()
    assert diff <= TOLERANCE[resident.dtype] * scale
    if resident.dtype == torch.float32:
        assert result.tokens == expected.tokens


def test_runs_are_deterministic(small):
    ckpt = small[0]
    runs = []
    for _ in range(2):
        model = cached_model(ckpt, expert_cache_mib=8, policy=Lru())
        try:
            runs.append(generate(model, None, PROMPT, OPTIONS))
        finally:
            _close(model)
    a, b = runs
    assert a.cache.decode.admitted > 0  # the cache's contents changed during the run
    assert a.tokens == b.tokens and torch.equal(a.first_logits, b.first_logits)
    for name in ("hits", "lookups", "cpu_experts", "cpu_tokens", "admitted", "evicted",
                 "uploaded_bytes"):
        assert getattr(a.cache.total, name) == getattr(b.cache.total, name), name


class _Spy:
    """Records the routing the cache is given (as the MoE layer calls it), then runs it."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def forward(self, layer, x, ids, weights):
        self.calls.append((layer, ids.numpy().copy()))
        return self.inner.forward(layer, x, ids, weights)


def test_stats_count_what_happened(small):
    ckpt = small[0]
    model = cached_model(ckpt, expert_cache_mib=8)  # coldest-in-loan: residency never changes
    cached = model.experts
    try:
        resident = cached.table.res.copy()  # [L, E]
        model.experts = _Spy(cached)
        result = generate(model, None, PROMPT, OPTIONS)
        calls = model.experts.calls
    finally:
        cached.close()
    stats, n_layers = result.cache, cached.n_layers
    prompt_calls = 3 * n_layers  # passes of 48, 48 and 4 tokens
    assert stats.prompt.passes == 3 and stats.decode.passes == OPTIONS.max_new - 1
    assert len(calls) == prompt_calls + (OPTIONS.max_new - 1) * n_layers
    for phase, chosen in (("prompt", calls[:prompt_calls]), ("decode", calls[prompt_calls:])):
        hit = [resident[layer][ids] >= 0 for layer, ids in chosen]
        p = stats.phase(phase)
        assert p.layer_calls == len(chosen)
        assert p.lookups == sum(ids.size for _, ids in chosen)
        assert p.hits == sum(int(h.sum()) for h in hit)
        assert p.cpu_tokens == p.lookups - p.hits
        assert p.cpu_experts == sum(np.unique(ids[~h]).size
                                    for (_, ids), h in zip(chosen, hit, strict=True))
        assert p.admitted == p.evicted == p.uploaded_bytes == 0 and p.upload_s == 0.0
    assert stats.hit_rate == stats.hits / stats.lookups
    assert stats.cpu_experts_per_layer == stats.total.cpu_experts / len(calls)
    d = result.stats()["cache"]
    assert d["slots"] == stats.slots and d["lent_slots"] == 0
    for key in ("hits", "lookups", "hit_rate", "cpu_experts_per_layer", "cpu_tokens_per_layer",
                "uploaded_bytes", "device_s", "upload_s", "cpu_s", "wait_s"):
        assert key in d and key in d["prompt"] and key in d["decode"], key


def test_every_key_of_a_phase_s_stats_is_documented():
    """docs/expert-cache.md's table names every key `--json` puts in a phase's `cache` object
    (`PhaseStats.as_dict`)."""
    doc = (Path(__file__).resolve().parents[3] / "docs" / "expert-cache.md").read_text()
    table = doc[doc.index("| key | meaning |"):]
    rows = table[:table.index("\n\n")].splitlines()[2:]
    documented = {key for row in rows
                  for key in re.findall(r"`([a-z_0-9]+)`", row.split("|")[1])}
    missing = set(PhaseStats().as_dict()) - documented
    assert not missing, f"undocumented in docs/expert-cache.md's table: {sorted(missing)}"


def _blobs_match_books(cached):
    view = cached.arena.slots_view()
    for slot in np.flatnonzero(cached.table.owner >= 0):
        layer, expert = divmod(int(cached.table.owner[slot]), cached.n_experts)
        assert torch.equal(view[slot, : cached.store.blob_bytes], cached.store.blob(layer, expert))


def test_admissions_keep_books_slots_mirror_and_events_in_step(small):
    ckpt = small[0]
    pm = plugin_manager(entry_points=False)
    observer = EventLog()
    pm.register(observer)
    model = cached_model(ckpt, expert_cache_mib=8, policy=Lru(), events=pm)
    try:
        cached = model.experts
        result = generate(model, None, PROMPT, OPTIONS)
        stats = result.cache.total
        assert stats.admitted > 0 and stats.evicted > 0
        assert stats.uploaded_bytes == stats.admitted * cached.store.blob_bytes
        assert stats.upload_s > 0  # each admission's upload, timed
        cached.table.validate()
        _blobs_match_books(cached)
        assert np.array_equal(cached.mirror.numpy(), cached.table.res)
        admitted = [e for e in observer.seen if isinstance(e, Admitted)]
        evicted = [e for e in observer.seen if isinstance(e, Evicted)]
        assert sum(len(e.placements) for e in admitted) == stats.admitted
        assert sum(len(e.experts) for e in evicted) == stats.evicted
        for event in admitted:
            assert all(layer == event.layer for _, layer, _ in event.placements)
    finally:
        _close(model)


class _AdmitsIntoAMissingSlot(Policy):
    name = "bad-admit"

    def admit(self, view, layer, missed_experts):
        return [(view.n_slots, layer, int(missed_experts[0]))]


def test_a_bad_admission_is_refused_and_changes_nothing():
    store = _store(cached_checkpoint("qwen3_moe", "tiny", dtype=torch.float32))
    cached = _cache(store, 3, _AdmitsIntoAMissingSlot())
    try:
        res, owner = cached.table.res.copy(), cached.table.owner.copy()
        slots = cached.arena.slots_view().clone()
        x = torch.randn(1, store.hidden_size)
        ids = torch.tensor([[6, 7]])  # the fill took the 3 first experts of layer 0: misses
        with pytest.raises(PolicyError, match="bad-admit"):
            cached.forward(0, x, ids, torch.full((1, 2), 0.5))
        assert np.array_equal(cached.table.res, res) and np.array_equal(cached.table.owner, owner)
        assert torch.equal(cached.arena.slots_view(), slots)
        assert np.array_equal(cached.mirror.numpy(), res)
    finally:
        cached.close()


def test_fill_follows_the_rank():
    store = _store(cached_checkpoint("qwen3_moe", "tiny", dtype=torch.float32))
    slot_bytes = slot_bytes_for(store.blob_bytes)
    table = ResidencyTable(store.n_layers, store.n_experts, 5, slot_bytes, CHUNK_BYTES)
    rank = np.arange(16)[::-1].reshape(2, 8).copy()  # the last flat ids are the hottest
    table.set_rank(rank)
    arena = Arena(_vmm.HostBackend(CHUNK_BYTES), 5, slot_bytes, hidden_size=store.hidden_size,
                  expert_width=store.expert_width, dtype=store.dtype)
    cached = CachedExperts(store, arena, table, None, "cpu")
    try:
        assert cached.fill_hottest() == 5
        assert table.owner.tolist() == [15, 14, 13, 12, 11]
        _blobs_match_books(cached)
        assert np.array_equal(cached.mirror.numpy(), table.res)
        with pytest.raises(ValueError, match="filled already"):
            cached.fill_hottest()
    finally:
        cached.close()


def test_mismatched_parts_are_refused():
    store = _store(cached_checkpoint("qwen3_moe", "tiny", dtype=torch.float32))
    slot_bytes = slot_bytes_for(store.blob_bytes)
    arena = Arena(_vmm.HostBackend(CHUNK_BYTES), 4, slot_bytes, hidden_size=store.hidden_size,
                  expert_width=store.expert_width, dtype=store.dtype)
    try:
        wrong = ResidencyTable(store.n_layers, store.n_experts, 5, slot_bytes, CHUNK_BYTES)
        with pytest.raises(ValueError, match="do not match"):
            CachedExperts(store, arena, wrong, None, "cpu")
        table = ResidencyTable(store.n_layers, store.n_experts, 4, slot_bytes, CHUNK_BYTES)
        with pytest.raises(ValueError, match="bound to other books"):
            CachedExperts(store, arena, table, CheckedPolicy(Lru(), wrong), "cpu")
        cached = CachedExperts(store, arena, table, None, "cpu")
        with pytest.raises(IndexError, match=r"layer 2 is out of range \[0, 2\)"):
            cached.forward(2, torch.zeros(1, 64), torch.tensor([[0, 1]]), torch.ones(1, 2))
        with pytest.raises(ValueError, match="phase must be one of prompt, decode"):
            cached.set_phase("verify")
        cached.close()
    finally:
        arena.close()


class _Watching(Policy):
    """The default decisions, with an `observe` of its own: the routing must reach the host."""

    name = "watching"

    def observe(self, view, layer, expert_ids, hit_mask):
        pass


def test_a_full_cache_decodes_on_the_device_with_the_same_books(small):
    ckpt, _, expected = small
    results, tables = [], []
    for policy in (None, _Watching()):
        model = cached_model(ckpt, policy=policy)
        try:
            assert model.experts.device_only == (policy is None)
            results.append(generate(model, None, PROMPT, OPTIONS))
            tables.append((model.experts.table.heat.copy(), model.experts.table.owner.copy()))
        finally:
            _close(model)
    on_device, on_host = results
    assert torch.equal(on_device.first_logits, expected.first_logits)
    assert on_device.tokens == on_host.tokens == expected.tokens
    assert np.array_equal(tables[0][0], tables[1][0])  # the heat counted on the device
    assert tables[0][0].sum() == on_device.cache.lookups
    for name in ("hits", "lookups", "layer_calls", "passes"):
        assert getattr(on_device.cache.decode, name) == getattr(on_host.cache.decode, name)


def test_a_captured_step_counts_only_its_replays(small):
    ckpt, _, _ = small
    model = cached_model(ckpt)
    try:
        cached = model.experts
        cfg = model.config
        cached.begin_request()
        cached.set_phase("decode")
        kv = new_kv(model, 16)
        token = torch.tensor([3], dtype=torch.int64)
        position = torch.tensor([0], dtype=torch.int64)
        with pytest.raises(RuntimeError, match="no step was captured"):
            cached.count_replay()
        heat = cached.table.heat.copy()
        with cached.graph_capture():  # what generate's capture runs: warm-ups, then the capture
            for _ in range(3):
                model.forward_at(token, position, kv, 1)
        cached.flush_heat()
        assert np.array_equal(cached.table.heat, heat) and cached.stats.decode.layer_calls == 0
        cached.count_replay()
        cached.count_replay()
        decode = cached.stats.decode
        assert (decode.passes, decode.layer_calls) == (2, 2 * cfg.n_layers)
        assert decode.lookups == decode.hits == 2 * cfg.n_layers * cfg.top_k
        kv.close()
    finally:
        _close(model)
    model = cached_model(ckpt, policy=_Watching())
    try:
        with pytest.raises(RuntimeError, match="every expert is resident"), \
                model.experts.graph_capture():
            pass
    finally:
        _close(model)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_streamed_misses_agree_with_the_cpu_and_take_the_first_misses(dtype):
    ckpt = cached_checkpoint("qwen3_moe", "small", dtype=dtype)
    store = _store(ckpt)
    top_k = ModelConfig.from_dir(ckpt).top_k
    on_cpu, streaming = _cache(store, 8), _cache(store, 8, stream_misses=2)
    gen = torch.Generator().manual_seed(3)
    expected_streamed = 0
    try:
        for cached in (on_cpu, streaming):
            cached.begin_request()
            cached.set_phase("decode")
        for layer in range(store.n_layers):
            x = torch.randn(1, store.hidden_size, generator=gen).to(dtype)  # [1, D]
            ids = torch.randperm(store.n_experts, generator=gen)[:top_k].unsqueeze(0)  # [1, K]
            weights = torch.softmax(torch.randn(1, top_k, generator=gen), dim=-1)
            a = on_cpu.forward(layer, x, ids, weights)
            b = streaming.forward(layer, x, ids, weights)
            scale = a.abs().max().item()
            assert (a - b).abs().max().item() <= TOLERANCE[dtype] * scale
            _, hit = on_cpu.table.lookup(layer, ids.numpy())
            expected_streamed += min(2, int((~hit).sum()))
        cpu, streamed = on_cpu.stats.decode, streaming.stats.decode
        assert streamed.streamed_experts == expected_streamed > 0
        assert streamed.cpu_experts == cpu.cpu_experts - expected_streamed
        assert streamed.uploaded_bytes == expected_streamed * store.blob_bytes
        assert streamed.hits == cpu.hits and streamed.lookups == cpu.lookups
        # A prompt pass (T > 1) streams nothing: the CPU computes its misses.
        ids = torch.stack([torch.randperm(store.n_experts, generator=gen)[:top_k]
                           for _ in range(4)])  # [4, K]
        x = torch.randn(4, store.hidden_size, generator=gen).to(dtype)
        for cached in (on_cpu, streaming):
            cached.set_phase("prompt")
            cached.forward(0, x, ids, torch.full((4, top_k), 1.0 / top_k))
        assert streaming.stats.prompt.streamed_experts == 0
        assert streaming.stats.prompt.cpu_experts == on_cpu.stats.prompt.cpu_experts > 0
    finally:
        on_cpu.close()
        streaming.close()


def test_streamed_misses_are_admitted_and_deterministic(small):
    ckpt = small[0]
    runs = []
    for _ in range(2):
        model = cached_model(ckpt, expert_cache_mib=8, policy=Lru(), stream_misses=3)
        try:
            runs.append(generate(model, None, PROMPT, OPTIONS))
            model.experts.table.validate()
        finally:
            _close(model)
    a, b = runs
    assert a.tokens == b.tokens and torch.equal(a.first_logits, b.first_logits)
    assert a.cache.decode.streamed_experts > 0 and a.cache.decode.admitted > 0
    with pytest.raises(ValueError,
                       match="stream_misses must be an int >= 0 or a StreamSplit, got -1"):
        cached_model(ckpt, stream_misses=-1)
