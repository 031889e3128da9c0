"""Lifecycle notifications in a real engine run (tiny model, host backend): every entry and
exit of an expert is told to the policy, in the books' order, whatever made it: the fill, the
policy's own admissions, the prompt loan (lending, refill), the elastic K/V (give-up,
relocation, trim) and a rollback.

The policy is `lru` keeping a copy of the books' residency from the notifications alone
(`Shadow`): each notification must fit its copy (an entry into an empty slot, an exit of the
expert it holds), and at every layer step its copy must be the books'.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sim.test_drivers import Shadow
from strata import _vmm
from strata.engine.kv.plan import plan_elastic_cache
from strata.engine.model.config import ModelConfig
from strata.engine.runtime.engine import Engine
from strata.engine.runtime.generate import GenerateOptions
from strata.formats.profile import rank_from_counts
from strata.policies import PolicyError, plugin_manager
from support.checkpoints import cached_checkpoint

CHUNK = 4096
WINDOW = 512
GROW = {"STRATA_KV_GROW_INIT": "32", "STRATA_KV_GROW_STEP": "32", "STRATA_KV_GROW_FLOOR": "2"}


def options(max_new):
    return GenerateOptions(max_new=max_new, max_context=WINDOW, temperature=0.0,
                           prefill_chunk=32, ignore_stop=True)


@pytest.fixture(scope="module")
def ckpt():
    return cached_checkpoint("qwen3_moe", "tiny", dtype=torch.float32)


def engine_with(ckpt, policy):
    cfg = ModelConfig.from_dir(ckpt)
    counts = np.random.default_rng(0).integers(0, 1000, (cfg.n_layers, cfg.n_experts))
    cache, elastic, _ = plan_elastic_cache(
        cfg, torch.float32, torch.device("cpu"), profile=True, environ=GROW,
        max_context=WINDOW, prefill_chunk=32, prefill_loan=True, short_read=16,
        rank=rank_from_counts(counts),
        backend=_vmm.HostBackend(CHUNK), events=plugin_manager(entry_points=False),
        policy=policy)
    return Engine.open(ckpt, cache=cache, kv_grow=elastic, max_context=WINDOW,
                       conversation_cache_mib=4.0, conversation_cache_slots=2)


def test_every_entry_and_exit_is_told_in_the_books_order(ckpt, monkeypatch):
    monkeypatch.setenv("STRATA_LOAN_KEEP_SLOTS", "8")  # a loan region of the top 8 slots
    policy = Shadow()
    engine = engine_with(ckpt, policy)
    table = engine.cache.table
    with engine:
        engine.generate(list(range(100, 110)), options(6))
        long_prompt = [3 + i % 250 for i in range(250)]
        engine.generate(long_prompt, options(60))  # grows into the cache: give-ups
        engine.generate(list(range(200, 210)), options(6))  # trims back: refills
        engine.generate(list(range(230, 240)), options(6))
        assert np.array_equal(policy.owner, table.owner)
    whys = {(kind, why) for kind, why, _ in policy.told}
    assert policy.told[0][:2] == ("entered", "fill")
    expected = {("entered", "fill"), ("entered", "admit"), ("left", "admit"),
                ("left", "give_up"), ("left", "loan"), ("entered", "refill"),
                ("entered", "trim")}
    assert expected <= whys, expected - whys
    # The moves of a relocation, when there are any, come between the evictions they need
    # and the give-up's own.
    for i, (kind, why, _) in enumerate(policy.told):
        if kind == "moved":
            assert why == "relocate" and policy.told[i + 1][:2] == ("left", "give_up")


class Refuses(Shadow):
    """Raises when told of the trim's refill: the trim is rolled back, and told so."""

    name = "refuses"

    def entered(self, view, why, placements):
        super().entered(view, why, placements)
        if why == "trim":
            raise RuntimeError("no refills")


def test_a_policy_that_raises_when_told_fails_the_change_and_hears_the_rollback(ckpt,
                                                                                 monkeypatch):
    monkeypatch.setenv("STRATA_LOAN_KEEP_SLOTS", "8")
    policy = Refuses()
    engine = engine_with(ckpt, policy)
    with engine:
        engine.generate([3 + i % 250 for i in range(250)], options(60))
        with pytest.raises(PolicyError, match="policy 'refuses', entered: raised RuntimeError"):
            for start in (200, 230, 260):
                engine.generate(list(range(start, start + 10)), options(6))
        told = [(kind, why) for kind, why, _ in policy.told]
        assert told[-2:] == [("entered", "trim"), ("left", "rollback")]
        # Its copy, with the rollback told, is the books' again.
        assert np.array_equal(policy.owner, engine.cache.table.owner)
