"""Belady's MIN with bypass and the oracle static set, against brute force and every policy."""

from itertools import combinations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.strategies import policy_options, profile_for, tiny_traces
from strata.formats.trace import DECODE, Trace
from strata.policies import load_registry
from strata.sim import _kernels
from strata.sim.belady import (
    access_sequence,
    belady,
    layer_capacities,
    oracle_static,
    oracle_static_set,
)
from strata.sim.replay import ReplayConfig, replay

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
REGISTRY = load_registry()


def blocks_of(trace):
    """The access sequence cut into blocks (one layer of one step): lists of flat ids."""
    seq = access_sequence(trace).tolist()
    per_block = np.repeat(trace.step_tokens * trace.top_k, trace.n_layers)
    starts = np.concatenate([[0], np.cumsum(per_block)])
    return [seq[starts[b]:starts[b + 1]] for b in range(per_block.size)]


def brute_force(trace, capacity, relaxed):
    """The most hits of any cache of `capacity` slots that starts holding anything and, after
    each block's lookups, may let in any of the block's missed experts and evict any resident.

    relaxed=False is the engine: an expert missed in a block misses at every access there.
    relaxed=True lets a missed expert's later accesses in its block hit (MIN's model).
    """
    blocks = blocks_of(trace)
    items = sorted({x for block in blocks for x in block})
    states = {frozenset(c): 0 for n in range(min(capacity, len(items)) + 1)
              for c in combinations(items, n)}
    for block in blocks:
        new = {}
        for state, hits in states.items():
            gained = hits + sum(x in state for x in block)
            if relaxed:
                gained += sum(block.count(x) - 1 for x in set(block) - state)
            pool = sorted(state | set(block))
            for n in range(min(capacity, len(pool)) + 1):
                for keep in combinations(pool, n):
                    key = frozenset(keep)
                    new[key] = max(new.get(key, -1), gained)
        states = new
    return max(states.values())


def one_layer(trace, layer):
    return Trace(trace.n_experts, trace.expert_ids[:, layer:layer + 1], trace.step_offsets,
                 trace.step_phase, trace.request_offsets)


@FAST
@given(trace=tiny_traces(max_steps=4, max_experts=3), capacity=st.integers(0, 3))
def test_min_is_the_optimum_of_its_model(trace, capacity):
    assert belady(trace, capacity).hits == brute_force(trace, capacity, relaxed=True)


@FAST
@given(trace=tiny_traces(max_tokens_per_step=1, max_steps=5), capacity=st.integers(0, 3))
def test_min_is_the_engine_optimum_on_decode_steps(trace, capacity):
    assert belady(trace, capacity).hits == brute_force(trace, capacity, relaxed=False)


@FAST
@given(trace=tiny_traces(max_steps=4, max_experts=3), capacity=st.integers(0, 3))
def test_min_bounds_the_engine_optimum_on_prompt_steps(trace, capacity):
    assert belady(trace, capacity).hits >= brute_force(trace, capacity, relaxed=False)


@FAST
@given(trace=tiny_traces(max_steps=4, max_experts=3), capacity=st.integers(0, 5))
def test_per_layer_min_is_min_of_each_layer(trace, capacity):
    expected = sum(
        brute_force(one_layer(trace, layer), int(cap), relaxed=True)
        for layer, cap in enumerate(layer_capacities(capacity, trace.n_layers))
    )
    result = belady(trace, capacity, scope="per-layer")
    assert result.hits == expected
    assert result.hits <= belady(trace, capacity).hits


@FAST
@given(trace=tiny_traces(), capacity=st.integers(0, 6))
def test_oracle_static_is_the_best_fixed_set(trace, capacity):
    counts = trace.routing_counts().reshape(-1)
    n = min(capacity, counts.size)
    best = max(counts[list(c)].sum() for c in combinations(range(counts.size), n))
    assert oracle_static(trace, capacity).hits == best
    assert oracle_static(trace, capacity).hits <= belady(trace, capacity).hits


@st.composite
def policy_runs(draw):
    trace = draw(tiny_traces(max_layers=3, max_experts=5, max_steps=8))
    slots = draw(st.integers(0, trace.n_layers * trace.n_experts + 1))
    loan = draw(st.integers(0, slots))
    name = draw(st.sampled_from(REGISTRY.names()))
    return trace, name, policy_options(draw, name), slots, loan, profile_for(draw, trace)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(run=policy_runs())
def test_belady_is_at_least_every_policy(run):
    trace, name, options, slots, loan, profile = run
    result = replay(trace, REGISTRY.create(name, options),
                    ReplayConfig(slots=slots, loan_slots=loan), profile)
    bound = belady(trace, slots)
    assert bound.hits >= result.hits, (name, options)
    assert bound.accesses == result.accesses


def test_hand_example():
    # One layer, decode steps routing 0 1 2 0 1 3 0 with two slots. MIN starts with {0, 1}:
    # 0 1 hit; 2 is needed after both: bypassed; 0 1 hit; 3 never again: bypassed; 0 hits.
    ids = np.array([0, 1, 2, 0, 1, 3, 0], np.int32).reshape(-1, 1, 1)
    trace = Trace(4, ids, np.arange(8), np.full(7, DECODE, np.uint8), [0, 7])
    result = belady(trace, 2)
    assert result.steps.hits[:, 0].tolist() == [1, 1, 0, 1, 1, 0, 1]
    assert result.admissions == 0 and result.evictions == 0
    assert belady(trace, 1).hits == 3  # 0 kept throughout: its three accesses hit
    assert oracle_static(trace, 1).hits == 3
    assert oracle_static_set(trace, 2).tolist() == [0, 1]


def test_min_bypass_codes_and_evictions():
    seq = np.array([0, 1, 2, 2, 0, 2], np.int32)
    nxt = _kernels.next_use(seq, 3)
    assert nxt.tolist() == [4, 6, 3, 5, 6, 6]
    # Blocks of one access: start {0}; 1 is never used again: bypassed; 2 is next used (3)
    # before 0 (4): loaded, 0 evicted; then 0 misses and is bypassed.
    codes, evictions = _kernels.min_bypass(seq, nxt, np.arange(7), 1, 3)
    assert codes.tolist() == [1, 0, 2, 1, 0, 1]
    assert evictions.tolist() == [1, 0, 0]
    # One block [0 1 2 2] then [0 2]: 2's second access in its block repeats its miss (3),
    # and it is loaded at the block's end only if needed before 0: 2 at 5, 0 at 4: bypassed.
    codes, evictions = _kernels.min_bypass(seq, nxt, np.array([0, 4, 6]), 1, 3)
    assert codes.tolist() == [1, 0, 0, 3, 1, 0]
    assert evictions.tolist() == [0, 0, 0]


def test_bad_arguments():
    trace = Trace(2, np.zeros((1, 1, 1), np.int32), [0, 1], [DECODE], [0, 1])
    with pytest.raises(ValueError, match="slots must be an int >= 0"):
        belady(trace, -1)
    with pytest.raises(ValueError, match="scope must be one of global, per-layer"):
        belady(trace, 1, scope="layers")
    with pytest.raises(IndexError, match=r"seq\[0\] = 5 is outside \[0, 3\)"):
        _kernels.next_use(np.array([5], np.int32), 3)
    with pytest.raises(ValueError, match="not a later index"):
        _kernels.min_bypass(np.array([0, 0], np.int32), np.array([0, 2]), np.array([0, 2]), 1, 1)
    with pytest.raises(ValueError, match="starts must run from 0 to len"):
        _kernels.min_bypass(np.array([0, 0], np.int32), np.array([1, 2]), np.array([0, 1]), 1, 1)
