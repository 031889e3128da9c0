"""The simulated elastic K/V: growth from the budget, then from the cache; trim and refill."""

import os
from unittest import mock

import numpy as np
import pytest

from strata.formats.trace import DECODE, PROMPT, Trace
from strata.policies import load_registry
from strata.sim.kv_sim import KvConfig
from strata.sim.replay import Replay, ReplayConfig

REGISTRY = load_registry()
# Steps of 2 cells; a K/V chunk holds 2 cells; an arena chunk holds one slot.
ENV = {"STRATA_KV_GROW_INIT": "2", "STRATA_KV_GROW_STEP": "2", "STRATA_KV_GROW_FLOOR": ""}
PROFILE = np.array([[8, 7, 6, 5, 4, 3, 2, 1]])  # expert e has rank e


def kv_config(**changes):
    config = dict(max_context=8, slot_bytes=2, kv_segment_cell_bytes=1, kv_segments=1,
                  chunk_bytes=2, floor_slots=1)
    return KvConfig(**{**config, **changes})


def long_then_short():
    """A 6-token prompt routed to expert 6, then a 1-token request routed to 6 again."""
    ids = np.array([6] * 7, np.int32).reshape(-1, 1, 1)
    return Trace(8, ids, [0, 6, 7], np.array([PROMPT, DECODE], np.uint8), [0, 1, 2])


def run(policy, kv, trace=None, slots=6, loan=1):
    with mock.patch.dict(os.environ, ENV):
        replay = Replay(trace or long_then_short(), REGISTRY.create(policy),
                        ReplayConfig(slots=slots, loan_slots=loan, kv=kv), PROFILE)
        replay.run()
    replay.table.validate()
    return replay


def test_growth_takes_slots_below_top_and_relocates_into_the_loan():
    # Start: slots 0..5 hold experts 0..5, slot 5 the loan; 1 chunk of K/V, no free budget.
    # Request 1 needs 6 cells: 2 more chunks, from slots 4 and 3; expert 3 (hotter than the
    # loan's 5) moves into slot 5, evicting 5; expert 4 leaves. The trim at request 2 hands
    # both chunks back, and the refill brings the hottest missing: 6 (routed 6 times), then 4.
    replay = run("coldest-in-loan", kv_config())
    result = replay.result
    assert {k: result.events[k] for k in ("grows", "gave_up_slots", "relocations", "trims",
                                          "refills", "kv_shortfalls")} == {
        "grows": 1, "gave_up_slots": 2, "relocations": 1, "trims": 1, "refills": 2,
        "kv_shortfalls": 0}
    assert result.evictions == 2
    assert replay.table.owner.tolist() == [0, 1, 2, 6, 4, 3]
    assert result.steps.hits[:, 0].tolist() == [0, 1]  # 6 misses, then the refilled 6 hits
    assert result.steps.uploads.tolist() == [0, 2]  # the refill, before request 2
    assert replay.kv.mapped_cells == 2 and replay.kv.free_chunks == 0


def test_static_loses_the_given_up_experts():
    replay = run("static", kv_config())
    assert replay.result.events["relocations"] == 0
    assert replay.table.owner.tolist() == [0, 1, 2, 6, 3, 5]  # refill: 6, then 3


def test_growth_uses_the_free_budget_first():
    # 2 spare chunks beyond the start's 7 (6 arena + 1 K/V): request 1's growth needs 2.
    replay = run("coldest-in-loan", kv_config(budget_bytes=9 * 2))
    result = replay.result
    assert (result.events["grows"], result.events["gave_up_slots"]) == (1, 0)
    assert result.evictions == 0
    # The trim returns the two chunks to the budget: the arena has no holes to fill.
    assert replay.kv.free_chunks == 2
    assert result.events["refills"] == 0


def test_a_growth_the_cache_cannot_cover_is_skipped_and_counted():
    # The floor keeps 4 of the 5 slots below top: one chunk can go, two are needed.
    replay = run("coldest-in-loan", kv_config(floor_slots=4))
    assert replay.result.events["kv_shortfalls"] == 1
    assert replay.result.events["grows"] == 0
    assert replay.kv.mapped_cells == 2


def test_segments_multiply_the_chunks():
    config = kv_config(kv_segments=2)
    assert config.cells_per_chunk == 2 and config.chunks_for(6) == 6
    replay = run("static", config)
    assert replay.result.events["gave_up_slots"] == 4  # 4 more chunks for 4 more cells


def test_bad_kv_settings():
    with pytest.raises(ValueError, match=r"budget 0\.0 MiB is below what the start takes"):
        run("static", kv_config(budget_bytes=4))
    ids = np.zeros((9, 1, 1), np.int32)
    long = Trace(8, ids, [0, 9], [PROMPT], [0, 1])
    with pytest.raises(ValueError, match="a request of 9 cells does not fit max_context 8"):
        run("static", kv_config(), trace=long)
    with pytest.raises(ValueError, match="must divide chunk_bytes"):
        kv_config(kv_segment_cell_bytes=3)
    with pytest.raises(ValueError, match="kv_segments must be an int >= 1"):
        kv_config(kv_segments=0)
