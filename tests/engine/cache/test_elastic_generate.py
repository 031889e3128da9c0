"""`--kv-grow` through load_model(cache=...) and generate on the host backend: the byte-identical
gates, growth by giving up slots (the policy's decisions, executed), failures, determinism.

Chunks are 4 KiB so the tiny model grows in many small steps: a K/V cell of the tiny qwen3_moe in
fp32 is 128 bytes (32 cells a chunk, 4 segments), a slot 96 KiB (24 chunks).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strata import _vmm
from strata.engine.cache.build import plan_cache
from strata.engine.kv.elastic import KvFullError
from strata.engine.kv.plan import plan_elastic_cache
from strata.engine.model.config import ModelConfig
from strata.engine.runtime.generate import GenerateOptions, generate
from strata.engine.runtime.load import load
from strata.formats.profile import rank_from_counts
from strata.policies import plugin_manager
from strata.policies.builtin.coldest_in_loan import ColdestInLoan
from support.checkpoints import cached_checkpoint
from support.events import EventLog

CHUNK = 4096
WINDOW = 256
PROMPT = list(range(3, 63))  # 60 tokens
OPTIONS = GenerateOptions(max_new=8, max_context=WINDOW, temperature=0.0, prefill_chunk=32)
GROW = {"STRATA_KV_GROW_INIT": "32", "STRATA_KV_GROW_STEP": "32", "STRATA_KV_GROW_FLOOR": "2"}


@pytest.fixture(scope="module")
def ckpt():
    return cached_checkpoint("qwen3_moe", "tiny", dtype=torch.float32)


@pytest.fixture(scope="module")
def rank(ckpt):
    """A profile's fill order: a fixed skewed count per expert."""
    cfg = ModelConfig.from_dir(ckpt)
    counts = np.random.default_rng(0).integers(0, 1000, (cfg.n_layers, cfg.n_experts))
    return rank_from_counts(counts)


class Recorder(ColdestInLoan):
    """The default policy, remembering its give-up and relocation answers."""

    name = "recorder"

    def __init__(self, options=None):
        super().__init__(options)
        self.given_up: list[int] = []
        self.moves: list[tuple[int, int]] = []

    def give_up(self, view, n_chunks):
        slots = super().give_up(view, n_chunks)
        self.given_up += [int(s) for s in slots]
        return slots

    def relocate(self, view, slots):
        moves = super().relocate(view, slots)
        self.moves += [(int(s), int(d)) for s, d in moves]
        return moves


def _model(ckpt, rank, *, kv_grow, environ=None, **sizing):
    """The tiny model through a cache planned as `strata generate` plans it, with or without
    `--kv-grow`; (the `Loaded`, notes)."""
    cfg = ModelConfig.from_dir(ckpt)
    sizing = {"max_context": WINDOW, "prefill_chunk": 32, "prefill_loan": False,
              "backend": _vmm.HostBackend(CHUNK), "rank": rank, **sizing}
    if kv_grow:
        cache, elastic, notes = plan_elastic_cache(cfg, torch.float32, torch.device("cpu"),
                                                   profile=rank is not None,
                                                   environ=environ or {}, **sizing)
    else:
        cache, elastic, notes = plan_cache(cfg, torch.float32, torch.device("cpu"), **sizing), \
            None, []
    return load(ckpt, cache=cache, kv_grow=elastic), notes


def _run(loaded, options=OPTIONS):
    try:
        return generate(loaded.model, None, PROMPT, options, kv=loaded.kv)
    finally:
        loaded.close()


def _same(a, b):
    assert a.tokens == b.tokens
    assert torch.equal(a.first_logits, b.first_logits)


def test_without_the_flag_nothing_changes(ckpt, rank):
    loaded, _ = _model(ckpt, rank, kv_grow=False, expert_cache_mib=0.75)
    plain = _run(loaded)
    assert plain.kv is None and "kv" not in plain.stats()
    # --kv-grow without a profile is ignored: the same cache, the same K/V, the same bytes.
    loaded, notes = _model(ckpt, None, kv_grow=True, expert_cache_mib=0.75)
    assert notes == ["--kv-grow ignored: it needs --expert-profile (the refill after a trim "
                     "comes from the profile)"]
    assert loaded.kv is None
    ignored = _run(loaded)
    assert ignored.kv is None
    # (rank None = the uniform fill, rank = the profile's: compare like with like.)
    loaded, _ = _model(ckpt, None, kv_grow=False, expert_cache_mib=0.75)
    _same(ignored, _run(loaded))


def test_mapped_whole_is_identical(ckpt, rank):
    loaded, _ = _model(ckpt, rank, kv_grow=False)
    plain_slots = loaded.cache.arena.n_slots
    plain = _run(loaded)
    env = {**GROW, "STRATA_KV_GROW_INIT": "100000"}  # >= the window: mapped whole
    loaded, _ = _model(ckpt, rank, kv_grow=True, environ=env)
    cached = loaded.cache
    assert cached.arena.n_slots == plain_slots and loaded.kv.kv.mapped_cells == WINDOW
    grown = _run(loaded)
    _same(grown, plain)
    assert grown.kv.grows == 0 and grown.stats()["kv"]["cells_mapped"] == WINDOW


def test_grown_into_free_budget_only_is_identical(ckpt, rank):
    # A fixed cache of 8 slots in a 16 MiB budget; the floor above the cache: nothing given up.
    sizing = {"budget_mib": 16.0, "expert_cache_mib": 0.75}
    loaded, _ = _model(ckpt, rank, kv_grow=False, **sizing)
    plain = _run(loaded)
    env = {**GROW, "STRATA_KV_GROW_FLOOR": "100"}
    loaded, notes = _model(ckpt, rank, kv_grow=True, environ=env, **sizing)
    assert "grows into free budget only" in notes[-1]
    assert loaded.kv.kv.mapped_cells == 32
    grown = _run(loaded)
    _same(grown, plain)
    kv = grown.kv
    # 60 + 16 cells at the request: 96 on the step grid, 3 chunks in each of 4 segments, 8 new.
    assert (kv.grows, kv.cells_mapped, kv.slots_given_up, kv.fresh_chunks) == (1, 96, 0, 8)


def test_grown_by_giving_up_slots_follows_the_policys_decisions(ckpt, rank, monkeypatch):
    monkeypatch.setenv("STRATA_LOAN_KEEP_SLOTS", "8")  # a loan region of the top 8 slots
    policy = Recorder()
    pm = plugin_manager(entry_points=False)
    events = EventLog()
    pm.register(events)
    # The host default budget holds every expert and the start cells: no free budget.
    loaded, _ = _model(ckpt, rank, kv_grow=True, environ=GROW, policy=policy, events=pm,
                      prefill_loan=True)
    cached = loaded.cache
    assert cached.arena.n_slots == 16 and loaded.kv.free_chunks == 0
    before = cached.table.owner.copy()
    result = generate(loaded.model, None, PROMPT, OPTIONS, kv=loaded.kv)
    kv = result.kv
    assert kv.grows == 1 and kv.fresh_chunks == 0 and kv.cells_mapped == 96
    # 8 chunks: slot 7 (24 chunks) is the one just below the loan region [8, 16).
    assert policy.given_up == [7] and kv.slots_given_up == 1
    # Its expert is hotter than every loan resident: it took the coldest one's slot.
    coldest = int(np.argmax(np.where(before >= 0, rank.reshape(-1)[np.maximum(before, 0)], -1)))
    assert policy.moves == [(7, coldest)] and kv.relocated == 1
    assert cached.table.owner[coldest] == before[7]
    gave_up = next(e for e in events.seen if type(e).__name__ == "GaveUp")
    assert gave_up.slots == (7,)
    assert gave_up.evicted == (divmod(int(before[coldest]), 8),)
    assert not cached.table.backed[7] and cached.table.n_resident == 15
    assert len(result.tokens) == 8
    cached.table.validate()
    # Deterministic: the same start, the same bytes out.
    loaded.close()
    loaded, _ = _model(ckpt, rank, kv_grow=True, environ=GROW, policy=Recorder(),
                      prefill_loan=True)
    _same(_run(loaded), result)


def test_a_failed_growth_is_told_and_the_run_goes_on(ckpt, rank, capsys):
    loaded, _ = _model(ckpt, rank, kv_grow=True, environ=GROW, budget_mib=16.0,
                      expert_cache_mib=0.75)
    cached = loaded.cache
    cached.arena.backend.inject_fault("map", 5)  # the growth before the prompt fails
    result = _run(loaded)
    assert result.kv.failures == 1 and "injected fault in map" in result.kv.last_failure
    assert "K/V growth for 76 cells failed and was rolled back; going on with 32 cells" in \
        capsys.readouterr().err
    # The prompt's first chunk fit; the next one grew again (no fault pending), and so on.
    assert result.kv.grows >= 1 and len(result.tokens) == 8


def test_a_round_that_cannot_fit_is_a_clear_error(ckpt, rank):
    loaded, _ = _model(ckpt, rank, kv_grow=True, environ=GROW)
    cached = loaded.cache
    cached.table.set_regions(floor=cached.table.n_slots)  # nothing left to give, no budget
    with pytest.raises(KvFullError, match=r"needs 60 K/V cells, 32 are mapped and growing "
                                          r"failed: the growth needs 4 chunks from the expert "
                                          r"cache, which can give 0"):
        _run(loaded)


def test_the_whole_window_stays_reachable(ckpt, rank, monkeypatch):
    # A loan region of the top 8 of 16 slots and a floor of 7: slot 7 (24 chunks) is all the
    # cache can give, and the rest of the window past 32 cells needs 28. Mapping 64 cells at
    # start leaves 24 to grow into: the window (256 cells) always fits, as without the flag.
    monkeypatch.setenv("STRATA_LOAN_KEEP_SLOTS", "8")
    env = {**GROW, "STRATA_KV_GROW_FLOOR": "7"}
    loaded, notes = _model(ckpt, rank, kv_grow=True, environ=env, prefill_loan=True)
    assert notes[1] == ("--kv-grow: 64 cells mapped at start, not 32: with fewer, the free "
                        "budget and the slots between the floor and the loan region could not "
                        f"hold the rest of the {WINDOW}-cell window")
    assert loaded.kv.kv.mapped_cells == 64 and loaded.kv.params.init_cells == 64
    prompt = list(range(3, 3 + WINDOW - 8))
    options = GenerateOptions(max_new=8, max_context=WINDOW, temperature=0.0, prefill_chunk=32,
                              ignore_stop=True)
    try:
        result = generate(loaded.model, None, prompt, options, kv=loaded.kv)
    finally:
        loaded.close()
    assert result.kv.cells_mapped == WINDOW and result.kv.slots_given_up == 1
    assert len(result.tokens) == 8 and result.prompt_tokens == len(prompt)
    # With a step that jumps past the window there is no start short of it: mapped up front.
    env = {**env, "STRATA_KV_GROW_STEP": "8192"}
    loaded, notes = _model(ckpt, rank, kv_grow=True, environ=env, prefill_loan=True)
    assert loaded.kv is None
    assert notes == [
        "--kv-grow: the cache cannot give memory to the K/V (free budget and slots [7, 8) can "
        "give 96.0 KiB of the 112.0 KiB the rest of the window needs): elastic K/V off for "
        f"this run, the whole window ({WINDOW} cells) is mapped up front"]
    loaded.close()
