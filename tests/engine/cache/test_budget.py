"""Sizing: each part from the config against the real thing, and the slots the budget leaves."""

import dataclasses
import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from strata import _vmm
from strata._residency import ResidencyTable
from strata.engine.cache.arena import Arena, slot_bytes_for
from strata.engine.cache.budget import (
    MIB,
    CacheBudget,
    dense_bytes,
    gathered_bytes,
    kv_bytes,
    plan_budget,
    workspace_bytes,
)
from strata.engine.cache.cached_experts import CachedExperts
from strata.engine.experts import ResidentExperts
from strata.engine.kv.kv_cache import KVCache
from strata.engine.model import families
from strata.engine.model.checkpoint import Checkpoint, expert_store
from strata.engine.model.config import ModelConfig
from strata.engine.model.layers import ATTENTION_PIECE_TOKENS, route
from support.checkpoints import cached_checkpoint


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe", "mixtral"])
def test_dense_bytes_are_the_non_expert_tensors(family):
    ckpt = Checkpoint.open(cached_checkpoint(family, "tiny"))
    try:
        cfg = ckpt.config
        fam = families.family(cfg.family)
        expert_names = {name for layer in range(cfg.n_layers) for e in range(cfg.n_experts)
                        for name in fam.expert_names(layer, e)}
        numel = sum(ckpt.tensor(name).numel() for name in families.expected_tensors(cfg)
                    if name not in expert_names)
    finally:
        ckpt.close()
    assert dense_bytes(cfg, torch.float32) == 4 * numel
    assert dense_bytes(cfg, torch.bfloat16) == 2 * numel


@pytest.mark.parametrize("max_cells", [1, 100, 4096])
def test_kv_bytes_are_what_the_kv_maps(max_cells):
    cfg = ModelConfig.from_dir(cached_checkpoint("olmoe", "tiny"))
    backend = _vmm.HostBackend(65536)
    with KVCache(backend, cfg.n_layers, max_cells, cfg.n_kv_heads, cfg.head_dim,
                 torch.bfloat16) as kv:
        assert kv_bytes(cfg, max_cells, torch.bfloat16, 65536) == kv.bytes_mapped


def test_workspace_grows_with_the_window_and_the_chunk():
    cfg = ModelConfig.from_dir(cached_checkpoint("olmoe", "tiny"))
    small = workspace_bytes(cfg, 16, 128, torch.float32)
    assert small % MIB == 0 and small >= MIB
    blob = 3 * cfg.expert_width * cfg.hidden_size * 4
    staged = workspace_bytes(cfg, 16, 128, torch.float32, stream_blobs=MIB // blob + 1)
    assert staged == small + MIB  # --stream-misses' staging buffer, rounded to whole MiB
    assert workspace_bytes(cfg, 512, 4096, torch.float32) > workspace_bytes(
        cfg, 512, 1024, torch.float32) > workspace_bytes(cfg, 16, 1024, torch.float32)


@pytest.mark.parametrize("grouped", [True, False])
def test_a_cell_costs_a_pieces_masks_or_a_longer_chunks_repeated_cells(grouped):
    cfg = ModelConfig.from_dir(cached_checkpoint("qwen3_moe", "tiny"))
    if not grouped:  # a kv head for each query head: nothing to repeat
        cfg = dataclasses.replace(cfg, n_kv_heads=cfg.n_heads)
    r = cfg.n_heads // cfg.n_kv_heads
    assert (r > 1) == grouped
    extra_cells = MIB  # a multiple of MiB a cell apart: the whole-MiB rounding cancels

    def per_cell(chunk: int) -> int:
        return (workspace_bytes(cfg, chunk, chunk + extra_cells, torch.float32)
                - workspace_bytes(cfg, chunk, chunk, torch.float32)) // extra_cells

    # Up to a piece: each token's mask entry in fp32, and its copy per query head of a kv
    # head when R > 1.
    copies = r if r > 1 else 0
    assert per_cell(ATTENTION_PIECE_TOKENS) == ATTENTION_PIECE_TOKENS * 4 * (1 + copies)
    # Longer: one causal call, no mask; K and V repeated to the query heads when R > 1.
    repeated = 2 * cfg.n_heads * cfg.head_dim * 4 if r > 1 else 0
    assert per_cell(4 * ATTENTION_PIECE_TOKENS) == repeated


def _index_select_bytes(experts, layer, x, ids, weights):
    """Bytes the layer call's index_select ops allocate (the weight gathers among them)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        experts.forward(layer, x, ids, weights)
    return sum(max(event.cpu_memory_usage, 0) for event in prof.events()
               if event.name == "aten::index_select")


def test_gathered_bytes_are_what_the_decode_path_gathers():
    ckpt = Checkpoint.open(cached_checkpoint("olmoe", "tiny"))
    try:
        cfg, store = ckpt.config, expert_store(ckpt)
    finally:
        ckpt.close()
    n_slots = store.n_layers * store.n_experts
    table = ResidencyTable(store.n_layers, store.n_experts, n_slots,
                           slot_bytes_for(store.blob_bytes), 65536)
    arena = Arena(_vmm.HostBackend(65536), n_slots, slot_bytes_for(store.blob_bytes),
                  hidden_size=store.hidden_size, expert_width=store.expert_width,
                  dtype=store.dtype)
    cached = CachedExperts(store, arena, table, None, "cpu")
    try:
        cached.fill_hottest()
        gen = torch.Generator().manual_seed(0)
        for experts in (ResidentExperts(store, "cpu"), cached):
            # T == 1 gathers the K routed blobs; a short prompt chunk (T*K <= E still) none.
            for n_tokens in (1, max(2, cfg.n_experts // cfg.top_k)):
                x = torch.randn(n_tokens, cfg.hidden_size, generator=gen).to(store.dtype)
                ids, weights = route(torch.randn(n_tokens, cfg.n_experts, generator=gen),
                                     cfg.top_k, False)
                allocated = _index_select_bytes(experts, 0, x, ids, weights)
                gathered = gathered_bytes(cfg, store.dtype)
                if n_tokens == 1:
                    assert gathered <= allocated < gathered + store.blob_bytes
                else:
                    assert allocated < store.blob_bytes
    finally:
        cached.close()


def _budget(**overrides):
    parts = dict(budget_bytes=100_000, reserve_bytes=1_000, dense_bytes=20_000, kv_bytes=8_192,
                 workspace_bytes=4_096, slot_bytes=1_024, chunk_bytes=4_096, total_experts=64)
    parts.update(overrides)
    return CacheBudget(**parts)


def test_auto_takes_whole_chunks_of_what_is_left():
    budget = _budget()
    assert budget.fixed_bytes == 33_288 and budget.available_bytes == 66_712
    # 16 whole chunks of 4096 = 65536 bytes: 64 slots of 1024
    assert budget.n_slots == 64 and budget.arena_bytes == 65_536
    assert _budget(total_experts=10).n_slots == 10  # never more than one slot per expert
    odd = _budget(slot_bytes=1_536)  # slots straddle chunks: 65536 // 1536 = 42
    assert odd.n_slots == 42 and odd.arena_bytes == 16 * 4_096
    assert odd.fixed_bytes + odd.arena_bytes <= odd.budget_bytes


def test_asked_for_mib_capped_by_the_budget():
    budget = _budget(budget_bytes=4 * MIB, slot_bytes=64 * 1024, total_experts=1000)
    assert budget.auto_slots == (4 * MIB - budget.fixed_bytes) // 4096 * 4096 // (64 * 1024)
    asked = _budget(budget_bytes=4 * MIB, slot_bytes=64 * 1024, total_experts=1000,
                    expert_cache_mib=1.0)
    assert asked.n_slots == 16 and not asked.capped
    greedy = _budget(budget_bytes=4 * MIB, slot_bytes=64 * 1024, total_experts=1000,
                     expert_cache_mib=100)
    assert greedy.n_slots == greedy.auto_slots and greedy.capped
    assert "capped by the budget" in greedy.startup_line()
    none = _budget(budget_bytes=33_288, expert_cache_mib=0)  # no room, none asked for: fine
    assert none.n_slots == 0


def test_too_small_says_how_much_is_missing():
    # fixed 33288 + the minimum cache: one slot in one 4096-byte chunk = 37384
    with pytest.raises(ValueError, match=r"is 0\.0 KiB short") as info:
        _budget(budget_bytes=37_383)
    assert "dense weights 19.5 KiB" in str(info.value)
    assert _budget(budget_bytes=37_384).n_slots == 4
    with pytest.raises(ValueError, match=r"budget of 32\.0 MiB \(--vram-budget-mib\) is "
                       r"968\.0 MiB short: dense weights 1000\.0 MiB"):
        _budget(budget_bytes=32 * MIB, dense_bytes=1000 * MIB)


@pytest.mark.parametrize(("field", "value", "match"), [
    ("budget_bytes", -1, "budget_bytes must be an int >= 0"),
    ("dense_bytes", 1.5, "dense_bytes must be an int >= 0"),
    ("slot_bytes", 0, "slot_bytes must be an int >= 1"),
    ("total_experts", True, "total_experts must be an int >= 1"),
    ("expert_cache_mib", -2, "expert_cache_mib must be None"),
    ("expert_cache_mib", math.inf, "expert_cache_mib must be None"),
])
def test_bad_parts(field, value, match):
    with pytest.raises(ValueError, match=match):
        _budget(**{field: value})


def test_startup_line_names_every_part():
    line = _budget(budget_bytes=3 * MIB, dense_bytes=MIB, slot_bytes=256 * 1024,
                   total_experts=8).startup_line()
    assert line.startswith("expert cache: budget 3.0 MiB (--vram-budget-mib) = dense 1.0 MiB")
    for part in ("K/V 8.0 KiB", "workspace 4.0 KiB (prompt chunks of 512)", "reserve 1.0 KiB",
                 "(auto): 7 slots of 256.0 KiB, 87.5% of 8 experts"):
        assert part in line


def test_startup_line_says_what_the_slots_need_when_chunks_map_more():
    """`--expert-cache 0.2` on a model of 48 KiB experts over 2 MiB chunks: 4 slots, whose
    arena still maps a whole chunk. The line once read "cache 2.0 MiB (0.2 MiB)"."""
    small = _budget(budget_bytes=64 * MIB, slot_bytes=48 * 1024, chunk_bytes=2 * MIB,
                    total_experts=16, expert_cache_mib=0.2)
    assert small.n_slots == 4 and small.arena_bytes == 2 * MIB
    assert small.startup_line().endswith(
        "cache 2.0 MiB (--expert-cache 0.2 MiB): 4 slots of 48.0 KiB, 25.0% of 16 experts; "
        "the slots need 192.0 KiB, the arena maps whole chunks of 2.0 MiB")
    # Slots that fill their chunks (less than a slot to spare) need no such note.
    exact = _budget(budget_bytes=64 * MIB, slot_bytes=MIB, chunk_bytes=2 * MIB,
                    total_experts=16, expert_cache_mib=4)
    assert exact.startup_line().endswith(
        "cache 4.0 MiB (--expert-cache 4 MiB): 4 slots of 1.0 MiB, 25.0% of 16 experts")


def test_plan_on_the_host():
    cfg = ModelConfig.from_dir(cached_checkpoint("olmoe", "tiny"))
    common = dict(slot_bytes=49_152, chunk_bytes=65_536, max_context=256, prefill_chunk=64)
    every = plan_budget(cfg, torch.bfloat16, torch.device("cpu"), **common)
    assert every.holds_every_expert and every.budget_source == "host default: every expert"
    assert every.reserve_bytes == 0
    assert every.dense_bytes == dense_bytes(cfg, torch.bfloat16)
    assert every.kv_bytes == kv_bytes(cfg, 256, torch.bfloat16, 65_536)
    tight = plan_budget(cfg, torch.bfloat16, torch.device("cpu"), **common,
                        budget_mib=(every.fixed_bytes + 4 * 65_536) / MIB)
    assert tight.n_slots == 4 * 65_536 // 49_152 and not tight.holds_every_expert
    reserved = plan_budget(cfg, torch.bfloat16, torch.device("cpu"), **common,
                           budget_mib=every.budget_bytes / MIB, reserve_mib=0.25)
    assert reserved.reserve_bytes == MIB // 4 and reserved.n_slots < every.n_slots
    for flag, key in (("--vram-budget-mib", "budget_mib"), ("--vram-reserve-mib", "reserve_mib"),
                      ("--expert-cache", "expert_cache_mib")):
        with pytest.raises(ValueError, match=f"{flag} must be a number of MiB >= 0"):
            plan_budget(cfg, torch.bfloat16, torch.device("cpu"), **common, **{key: -1.0})
