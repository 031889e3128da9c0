"""Planning `--kv-grow`: when it applies, the policy's figures and their environment overrides,
the cache sized around the start cells, and the cases where the cache cannot give memory."""

from __future__ import annotations

import pytest
import torch

from strata import _vmm
from strata.engine.cache.build import plan_cache
from strata.engine.kv.plan import (
    ENV_KV_GROW,
    cells_per_chunk,
    kv_grow_requested,
    plan_elastic_cache,
)
from strata.engine.model.config import ModelConfig
from strata.policies import KvParams, Policy, PolicyError
from support.checkpoints import cached_checkpoint

CHUNK = 4096
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.from_dir(cached_checkpoint("qwen3_moe", "tiny", dtype=torch.float32))


def _plan(cfg, environ, *, profile=True, max_context=1024, **sizing):
    sizing = {"prefill_chunk": 32, "prefill_loan": False, **sizing}
    return plan_elastic_cache(cfg, torch.float32, CPU, profile=profile, max_context=max_context,
                              backend=_vmm.HostBackend(CHUNK), environ=environ, **sizing)


def _plain(cfg, max_context=1024, **sizing):
    return plan_cache(cfg, torch.float32, CPU, max_context=max_context, prefill_chunk=32,
                      backend=_vmm.HostBackend(CHUNK), **sizing)


def test_requested_by_the_flag_or_the_environment():
    assert not kv_grow_requested(False, {})
    assert kv_grow_requested(True, {}) and kv_grow_requested(False, {ENV_KV_GROW: "1"})
    assert not kv_grow_requested(False, {ENV_KV_GROW: "0"})
    with pytest.raises(ValueError, match=r"STRATA_KV_GROW='yes': want 1 \(on\) or 0 \(off\)"):
        kv_grow_requested(False, {ENV_KV_GROW: "yes"})


@pytest.mark.parametrize(("name", "value", "want"), [
    *[(name, value, "a positive integer") for name in ("STRATA_KV_GROW_INIT",
                                                       "STRATA_KV_GROW_STEP")
      for value in ("0", "-5", "1.5", "lots")],
    # A floor is slots: 0 of them is a floor, a negative count is not.
    *[("STRATA_KV_GROW_FLOOR", value, "an integer >= 0") for value in ("-5", "1.5", "lots")],
])
def test_a_bad_environment_value_is_named(cfg, name, value, want):
    with pytest.raises(ValueError, match=f"{name}='{value}': want {want}"):
        _plan(cfg, {name: value})


def test_the_cache_is_sized_around_the_start_cells(cfg):
    # A 2 MiB budget: dense 226 KiB, workspace 1 MiB, and the K/V of the whole window (1024
    # cells: 512 KiB) leave 2 slots of 96 KiB; 256 cells (128 KiB) leave 6.
    whole = _plain(cfg, budget_mib=2.0).budget
    cache, kv_grow, notes = _plan(cfg, {"STRATA_KV_GROW_INIT": "256",
                                        "STRATA_KV_GROW_FLOOR": "2"}, budget_mib=2.0)
    grown = cache.budget
    assert grown.kv_bytes == 4 * 8 * CHUNK  # 256 cells: 8 chunks in each of 4 segments
    assert whole.kv_bytes == 4 * 32 * CHUNK
    assert (whole.n_slots, grown.n_slots) == (2, 6)
    params = kv_grow.params
    assert params == KvParams(init_cells=256, step_cells=8192, floor_slots=2)
    assert notes == ["elastic K/V: 256 of 1024 cells mapped at start, steps of 8192, the "
                     "cache keeps at least 2 slots"]


def test_ignored_without_a_profile_or_when_cells_do_not_tile_chunks(cfg):
    cache, kv_grow, notes = _plan(cfg, {}, profile=False, budget_mib=3.0)
    assert kv_grow is None and notes[0].startswith("--kv-grow ignored: it needs "
                                                         "--expert-profile")
    assert cache.budget == _plain(cfg, budget_mib=3.0).budget  # sized as without the flag
    assert cells_per_chunk(cfg, torch.float32, 4096) == 32
    assert cells_per_chunk(cfg, torch.float32, 4096 + 64) == 0


def test_when_the_cache_cannot_give_the_window_is_mapped_up_front(cfg):
    # The default floor (128 slots) is above this cache's 16 slots: top is at the floor.
    env = {"STRATA_KV_GROW_INIT": "256"}
    cache, kv_grow, notes = _plan(cfg, env, budget_mib=3.0)
    assert kv_grow is None
    assert "(its 16 slots below the loan are at the floor of 16): elastic K/V off for this " \
           "run, the whole window (1024 cells) is mapped up front" in notes[0]
    assert cache.budget == _plain(cfg, budget_mib=3.0).budget
    # With a fixed cache leaving free budget for the whole window, the K/V grows into it.
    cache, kv_grow, notes = _plan(cfg, env, budget_mib=3.0, expert_cache_mib=0.5)
    assert kv_grow is not None and "grows into free budget only" in notes[-1]
    # And a budget too small for the whole window stops with how much is missing.
    with pytest.raises(ValueError, match=r"1.5 MiB \(--vram-budget-mib\) is [\d.]+ KiB short"):
        _plan(cfg, env, budget_mib=1.5)


class SizeDependentInit(Policy):
    name = "size-dependent"

    def kv_params(self, ctx):
        return KvParams(init_cells=32 if ctx.n_slots == 16 else 64, step_cells=32,
                        floor_slots=0)


class NotParams(Policy):
    name = "not-params"

    def kv_params(self, ctx):
        return (256, 32, 2)


def test_a_policy_decides_the_figures_and_is_checked(cfg):
    with pytest.raises(PolicyError, match=r"not-params.*want a KvParams"):
        _plan(cfg, {}, budget_mib=2.0, policy=NotParams())
    with pytest.raises(PolicyError, match="must not depend on the cache's size"):
        _plan(cfg, {}, budget_mib=2.0, policy=SizeDependentInit())
