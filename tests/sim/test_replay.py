"""Replay: the engine's sequence step by step, and the fast paths proven equal to it."""

import dataclasses
import os
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.strategies import policy_options, profile_for, tiny_traces
from strata.formats.trace import DECODE, PROMPT, Trace
from strata.policies import Policy, PolicyError, load_registry
from strata.policies.builtin.lru import Lru
from strata.sim.kv_sim import KvConfig
from strata.sim.replay import Replay, ReplayConfig, choose_path, replay, start_books
from strata.sim.synth import SynthSpec, synth_trace
from support.policy_plugins import Misbehaving

REGISTRY = load_registry()


def decode_trace(per_step, n_experts=4):
    """One layer, top-1, one decode step per id, one request."""
    ids = np.array(per_step, np.int32).reshape(-1, 1, 1)
    n = ids.shape[0]
    return Trace(n_experts, ids, np.arange(n + 1), np.full(n, DECODE, np.uint8), [0, n])


class RefillColdestFirst(Policy):
    """Overrides neither observe nor admit: the batched path runs it."""

    name = "refill-coldest-first"

    def refill(self, view, free_slots):
        missing = view.hottest_missing(view.n_layers * view.n_experts)[::-1]
        return [(int(s), int(layer), int(e))
                for s, (layer, e) in zip(sorted(free_slots), missing, strict=False)]


class CountingStatic(Policy):
    """Keeps its own counts in observe: the generic path runs it."""

    name = "counting-static"

    def __init__(self, options=None):
        super().__init__(options)
        self.seen = 0

    def observe(self, view, layer, expert_ids, hit_mask):
        self.seen += np.asarray(expert_ids).size


class LruSubclass(Lru):
    name = "lru-subclass"


class LruSubclassDeclared(Lru):
    """Declares the kernel again: its rule is still lru's."""

    name = "lru-subclass-declared"
    replay_kernel = "lru"


class OutsideLru(Policy):
    """An outside plugin with `lru`'s rule, declaring the kernel through the public interface
    only: it is no subclass of the built-in and holds the rule in an instance of its own."""

    name = "outside-lru"
    replay_kernel = "lru"

    def __init__(self, options=None):
        super().__init__(options)
        self.rule = REGISTRY.create("lru")
        self.given_back = 0

    def give_up(self, view, n_chunks):
        return self.rule.give_up(view, n_chunks)

    def relocate(self, view, slots):
        return self.rule.relocate(view, slots)

    def observe(self, view, layer, expert_ids, hit_mask):
        self.rule.observe(view, layer, expert_ids, hit_mask)

    def admit(self, view, layer, missed_experts):
        return self.rule.admit(view, layer, missed_experts)

    def kernel_state(self, n_layers, n_experts):
        return self.rule.kernel_state(n_layers, n_experts)

    def set_kernel_state(self, state):
        self.given_back += 1
        self.rule.set_kernel_state(state)


class BadKernelState(OutsideLru):
    """Hands out its recency as float64: the simulator refuses it."""

    name = "bad-kernel-state"
    replay_kernel = "lru"

    def kernel_state(self, n_layers, n_experts):
        state = super().kernel_state(n_layers, n_experts)
        return dataclasses.replace(state, last_use=state.last_use.astype(np.float64))


class UnknownKernel(Policy):
    name = "unknown-kernel"
    replay_kernel = "arc"


def test_paths_chosen():
    assert choose_path(REGISTRY.create("static")) == "batched"
    assert choose_path(REGISTRY.create("coldest-in-loan")) == "batched"
    assert choose_path(REGISTRY.create("lru")) == "kernel"
    assert choose_path(REGISTRY.create("lfu")) == "kernel"
    assert choose_path(REGISTRY.create("sieve")) == "kernel"
    assert choose_path(RefillColdestFirst()) == "batched"
    assert choose_path(CountingStatic()) == "generic"
    assert choose_path(LruSubclass()) == "generic"  # a subclass may change the rule
    assert choose_path(LruSubclassDeclared()) == "kernel"
    assert choose_path(OutsideLru()) == "kernel"
    assert choose_path(REGISTRY.create("lru"), "generic") == "generic"


def test_generic_static_by_hand():
    # Profile: expert 2 hottest, then 0; two slots hold {2, 0}.
    trace = decode_trace([0, 1, 2, 0, 3, 2])
    result = replay(trace, REGISTRY.create("static"), ReplayConfig(slots=2, path="generic"),
                    profile=np.array([[5, 1, 9, 0]]))
    assert result.steps.hits[:, 0].tolist() == [1, 0, 1, 1, 0, 1]
    assert (result.hits, result.misses, result.admissions) == (4, 2, 0)
    assert result.to_dict()["decode"] == {"accesses": 6, "hits": 4, "hit_rate": 4 / 6}


def test_generic_lru_by_hand():
    # Two slots start empty; lru admits each miss, evicting the least recently used.
    trace = decode_trace([0, 1, 0, 2, 1, 0])
    run = Replay(trace, REGISTRY.create("lru"), ReplayConfig(slots=2, path="generic"))
    result = run.run()
    # 0 miss (in), 1 miss (in), 0 hit, 2 miss (evicts 1), 1 miss (evicts 0), 0 miss (evicts 2)
    assert result.steps.hits[:, 0].tolist() == [0, 0, 1, 0, 0, 0]
    assert (result.admissions, result.evictions) == (5, 3)
    assert result.steps.uploads.tolist() == [1, 1, 0, 1, 1, 1]
    assert sorted(run.table.owner.tolist()) == [0, 1]
    # The books saw the routing: heat counts every access.
    assert run.table.heat[0].tolist() == [3.0, 2.0, 1.0, 0.0]


def test_the_table_and_the_policy_are_the_engines():
    trace = decode_trace([0, 1, 2, 0])
    run = Replay(trace, REGISTRY.create("lru"), ReplayConfig(slots=2))
    run.run()
    run.table.validate()
    assert run.checked.policy.clock == 4  # one observe per layer step
    with pytest.raises(ValueError, match="this replay has run"):
        run.run()


def test_start_books_fill_hottest_first():
    trace = Trace(3, np.zeros((1, 2, 1), np.int32), [0, 1], [DECODE], [0, 1])
    table = start_books(trace, ReplayConfig(slots=4, loan_slots=1),
                        np.array([[1, 7, 0], [3, 9, 2]]))
    # Hottest first: (1,1)=9, (0,1)=7, (1,0)=3, (1,2)=2; the top slot is the loan region.
    assert table.owner.tolist() == [4, 1, 3, 5]
    assert (table.top, table.n_resident) == (3, 4)
    empty = start_books(trace, ReplayConfig(slots=2), None)
    assert empty.n_resident == 0


@st.composite
def replay_runs(draw, names=None):
    trace = draw(tiny_traces(max_layers=3, max_experts=5, max_steps=12, max_tokens_per_step=4))
    n_items = trace.n_layers * trace.n_experts
    slots = draw(st.integers(0, n_items + 2))
    loan = draw(st.integers(0, min(slots, 2)))
    name = draw(st.sampled_from(names or REGISTRY.names()))
    kv = None
    env = {}
    if draw(st.integers(0, 2)):  # two runs in three grow and trim a K/V
        slot_bytes, chunk = draw(st.integers(1, 3)), draw(st.integers(1, 4))
        arena_chunks = -(-slots * slot_bytes // chunk)
        kv = KvConfig(
            max_context=int(trace.request_tokens.max()) + draw(st.integers(0, 3)),
            slot_bytes=slot_bytes,
            kv_segment_cell_bytes=1,
            kv_segments=draw(st.integers(1, 2)),
            chunk_bytes=chunk,
            # None: every growth takes slots; else a few spare chunks beyond the arena's.
            budget_bytes=draw(st.sampled_from([None, (arena_chunks + 8) * chunk])),
            floor_slots=draw(st.integers(0, 2)),
        )
        env = {"STRATA_KV_GROW_INIT": str(draw(st.integers(1, 4))),
               "STRATA_KV_GROW_STEP": str(draw(st.integers(1, 3))), "STRATA_KV_GROW_FLOOR": ""}
    config = ReplayConfig(slots=slots, loan_slots=loan, kv=kv)
    return trace, name, policy_options(draw, name), config, profile_for(draw, trace), env


def run_both(trace, make_policy, config, profile, env):
    with mock.patch.dict(os.environ, env):
        fast = Replay(trace, make_policy(), config, profile)
        fast.run()
        slow = Replay(trace, make_policy(), dataclasses.replace(config, path="generic"), profile)
        slow.run()
    return fast, slow


def assert_same(fast, slow):
    a, b = fast.result, slow.result
    assert b.path == "generic"
    assert {**a.to_dict(), "path": "generic"} == b.to_dict()
    for name in ("hits", "distinct_hits", "distinct_misses", "uploads"):
        assert np.array_equal(getattr(a.steps, name), getattr(b.steps, name)), name
    for name in ("owner", "res", "heat", "chunk_mapped", "backed"):
        assert np.array_equal(getattr(fast.table, name), getattr(slow.table, name)), name
    fast.table.validate()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(run=replay_runs())
def test_fast_paths_equal_the_generic_path(run):
    trace, name, options, config, profile, env = run
    fast, slow = run_both(trace, lambda: REGISTRY.create(name, options), config, profile, env)
    assert fast.result.path == ("kernel" if name in ("lru", "lfu", "sieve") else "batched")
    assert_same(fast, slow)
    policy_a, policy_b = fast.checked.policy, slow.checked.policy
    if name == "lru":
        assert policy_a.clock == policy_b.clock
        assert np.array_equal(policy_a.last_use, policy_b.last_use)
    if name == "lfu":  # bit for bit: the kernel rounds as numpy does
        assert policy_a.counts.tobytes() == policy_b.counts.tobytes()
    if name == "sieve" and policy_b.visited is not None:
        assert (policy_a.next_insert, policy_a.hand) == (policy_b.next_insert, policy_b.hand)
        assert np.array_equal(policy_a.visited, policy_b.visited)
        assert np.array_equal(policy_a.inserted, policy_b.inserted)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(run=replay_runs(names=["static"]))
def test_batched_runs_an_outside_policy_exactly(run):
    trace, _, _, config, profile, env = run
    fast, slow = run_both(trace, RefillColdestFirst, config, profile, env)
    assert fast.result.path == "batched"
    assert_same(fast, slow)


def test_generic_path_calls_observe_per_layer_step():
    trace = decode_trace([0, 1, 2])
    run = Replay(trace, CountingStatic(), ReplayConfig(slots=1))
    assert run.run().path == "generic"
    assert run.checked.policy.seen == 3


def test_a_bad_decision_is_a_policy_error():
    trace = decode_trace([0, 1, 2], n_experts=8)
    with pytest.raises(PolicyError, match=r"'misbehaving', admit: admits expert \(0, 5\)"):
        replay(trace, Misbehaving({"rule": "admit_not_missed"}), ReplayConfig(slots=2),
               profile=np.arange(8)[None, ::-1])


def test_bad_configs():
    trace = decode_trace([0, 1])
    with pytest.raises(ValueError, match="loan_slots 3 exceeds slots 2"):
        ReplayConfig(slots=2, loan_slots=3)
    with pytest.raises(ValueError, match="path must be one of auto, generic"):
        ReplayConfig(slots=2, path="fast")
    with pytest.raises(ValueError, match=r"the profile is \(2, 4\); the trace needs"):
        replay(trace, REGISTRY.create("static"), ReplayConfig(slots=2), np.zeros((2, 4)))


def test_phases_are_counted_apart():
    ids = np.array([0, 1, 0, 1], np.int32).reshape(-1, 1, 1)
    trace = Trace(4, ids, [0, 2, 3, 4], np.array([PROMPT, DECODE, DECODE], np.uint8), [0, 3])
    result = replay(trace, REGISTRY.create("static"), ReplayConfig(slots=1),
                    profile=np.array([[1, 0, 0, 0]]))
    out = result.to_dict()
    assert out["prompt"] == {"accesses": 2, "hits": 1, "hit_rate": 0.5}
    assert out["decode"] == {"accesses": 2, "hits": 1, "hit_rate": 0.5}
    assert out["per_layer"]["hits"] == [2]


def workload(seed):
    """A Markov trace of requests of 2 to 52 tokens, a calibration profile of the same
    workload, and a K/V that grows into the cache (3 spare chunks) and trims back."""
    spec = SynthSpec(kind="markov", n_layers=3, n_experts=8, top_k=2, n_requests=10,
                     prompt_tokens=(1, 40), decode_tokens=(1, 12), prompt_chunk=8, seed=seed)
    trace = synth_trace(spec)
    profile = synth_trace(dataclasses.replace(spec, n_requests=4, seed=100 + seed))
    kv = KvConfig(max_context=int(trace.request_tokens.max()), slot_bytes=3,
                  kv_segment_cell_bytes=1, kv_segments=1, chunk_bytes=4, floor_slots=2,
                  budget_bytes=(15 + 1 + 3) * 4)
    return trace, profile.routing_counts(), kv


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("name", "options"), [
    ("lru", {}), ("lru", {"max_admits": 1}), ("lfu", {}), ("lfu", {"decay": 0.7}),
    ("sieve", {}), ("sieve", {"max_admits": 1}), ("static", {}), ("coldest-in-loan", {}),
])
def test_fast_paths_equal_the_generic_path_on_workloads(seed, name, options):
    trace, profile, kv = workload(seed)
    config = ReplayConfig(slots=20, loan_slots=3, kv=kv)
    env = {"STRATA_KV_GROW_INIT": "4", "STRATA_KV_GROW_STEP": "4", "STRATA_KV_GROW_FLOOR": ""}
    fast, slow = run_both(trace, lambda: REGISTRY.create(name, options), config, profile, env)
    assert_same(fast, slow)
    events = fast.result.events
    assert min(events["grows"], events["gave_up_slots"], events["trims"], events["refills"]) > 0
    assert (events["relocations"] > 0) == (name != "static")
    assert (fast.result.admissions > 0) == (name in ("lru", "lfu", "sieve"))


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("make", [OutsideLru, LruSubclassDeclared])
def test_a_declared_kernel_runs_an_outside_policy_exactly(seed, make):
    trace, profile, kv = workload(seed)
    config = ReplayConfig(slots=20, loan_slots=3, kv=kv)
    env = {"STRATA_KV_GROW_INIT": "4", "STRATA_KV_GROW_STEP": "4", "STRATA_KV_GROW_FLOOR": ""}
    fast, slow = run_both(trace, make, config, profile, env)
    assert fast.result.path == "kernel"
    assert_same(fast, slow)
    state_a = fast.checked.policy.kernel_state(trace.n_layers, trace.n_experts)
    state_b = slow.checked.policy.kernel_state(trace.n_layers, trace.n_experts)
    assert state_a.clock == state_b.clock
    assert np.array_equal(state_a.last_use, state_b.last_use)
    if make is OutsideLru:  # the state came back through the interface, once per request
        assert fast.checked.policy.given_back == trace.n_requests


def test_a_bad_kernel_state_is_a_policy_error():
    trace = decode_trace([0, 1, 2])
    with pytest.raises(PolicyError, match=r"'bad-kernel-state', kernel_state: last_use must be "
                                          r"a numpy int64 \[L, E\] = \[1, 4\]"):
        replay(trace, BadKernelState(), ReplayConfig(slots=2))


def test_an_unknown_kernel_is_a_policy_error():
    with pytest.raises(PolicyError, match=r"'unknown-kernel', replay_kernel: no such kernel; "
                                          "the simulator has lru, lfu, sieve"):
        choose_path(UnknownKernel())
    assert choose_path(UnknownKernel(), "generic") == "generic"
