"""The K/V figures: KvContext and its environment overrides, the default kv_params and
kv_target (grow by whole steps, trim with two steps of hysteresis), and the cap at the window."""

import pytest

from strata.books import CheckedPolicy
from strata.policies import KvContext, KvParams, Policy
from strata.policies.kv_params import default_kv_params, default_kv_target
from support.policy_tables import make_table


def context(**overrides):
    fields = {"max_cells": 262144, "cells_per_chunk": 256, "n_slots": 500, "top": 400}
    return KvContext(**(fields | overrides))


# Cells are positive; a floor is slots, and 0 of them is a floor.
BAD_OVERRIDES = [(name, raw, "a positive integer")
                 for name in ("STRATA_KV_GROW_INIT", "STRATA_KV_GROW_STEP")
                 for raw in ("abc", "0", "-8", "1.5", "8k")] + [
    ("STRATA_KV_GROW_FLOOR", raw, "an integer >= 0 (slots") for raw in ("abc", "-8", "1.5", "8k")]


@pytest.mark.parametrize(("name", "raw", "want"), BAD_OVERRIDES)
def test_a_bad_override_names_its_variable(name, raw, want):
    with pytest.raises(ValueError) as caught:
        KvContext.from_env(max_cells=1024, cells_per_chunk=16, n_slots=10, top=10,
                           environ={name: raw})
    assert str(caught.value).startswith(f"{name}={raw!r}: want {want}")


def test_a_floor_of_no_slots_is_a_floor():
    ctx = KvContext.from_env(max_cells=1024, cells_per_chunk=16, n_slots=10, top=10,
                             environ={"STRATA_KV_GROW_FLOOR": "0"})
    assert ctx.env_floor_slots == 0
    assert default_kv_params(ctx).floor_slots == 0


def test_overrides_are_read_and_default_params_round_to_chunks():
    env = {"STRATA_KV_GROW_INIT": " 1000 ", "STRATA_KV_GROW_STEP": "300",
           "STRATA_KV_GROW_FLOOR": "450", "UNRELATED": "x"}
    ctx = KvContext.from_env(max_cells=262144, cells_per_chunk=256, n_slots=500, top=400,
                             environ=env)
    assert (ctx.env_init_cells, ctx.env_step_cells, ctx.env_floor_slots) == (1000, 300, 450)
    # Whole chunks of 256 cells; the floor is capped at top.
    assert default_kv_params(ctx) == KvParams(1024, 512, 400)
    unset = KvContext.from_env(max_cells=262144, cells_per_chunk=256, n_slots=500, top=400,
                               environ={"STRATA_KV_GROW_INIT": ""})
    assert default_kv_params(unset) == KvParams(16384, 8192, 128)


def test_init_is_capped_at_the_window():
    assert default_kv_params(context(max_cells=5000)).init_cells == 5120  # 20 chunks


@pytest.mark.parametrize(
    ("need", "mapped", "target"),
    [
        (16384, 16384, 16384),  # covered: nothing to do
        (17000, 16384, 24576),  # one step
        (40000, 16384, 40960),  # three steps
        (20000, 32768, 32768),  # 32768 < 20000 + 2 steps: keep
        (16385, 32768, 32768),  # one cell short of two spare steps: keep
        (16383, 32768, 16384),  # exactly two spare steps: trim
        (1000, 32768, 16384),  # two steps spare: trim to init
        (20000, 40960, 24576),  # trim to the smallest init + k * step that covers
    ],
)
def test_default_kv_target(need, mapped, target):
    params = KvParams(16384, 8192, 128)
    assert default_kv_target(need, mapped, params) == target


def test_the_engine_caps_the_target_at_the_window():
    checked = CheckedPolicy(Policy(), make_table())
    assert checked.kv_target(20000, 16384, KvParams(16384, 8192, 0), max_cells=20480) == 20480


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"init_cells": 0, "step_cells": 1, "floor_slots": 0}, "init_cells must be an integer"),
        ({"init_cells": 1, "step_cells": 1.5, "floor_slots": 0}, "step_cells must be an integer"),
        ({"init_cells": 1, "step_cells": 1, "floor_slots": True}, "floor_slots must be an integer"),
    ],
)
def test_kv_params_validate(fields, message):
    with pytest.raises(ValueError, match=message):
        KvParams(**fields)


def test_kv_context_validates():
    with pytest.raises(ValueError, match="top 11 is past the last slot"):
        context(n_slots=10, top=11)
    with pytest.raises(ValueError, match="cells_per_chunk must be an integer >= 1"):
        context(cells_per_chunk=0)
