"""The C step loop of the `generic` path against the engine's sequence in plain Python
(`strata.sim.reference`): the same counts, books, policy state and notifications, for any
policy; and a bad answer still a PolicyError naming the policy."""

import dataclasses
import os
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.test_replay import REGISTRY, assert_same, decode_trace, replay_runs
from strata.policies import Policy, PolicyError, StatefulPolicy
from strata.policies.builtin.lru import Lru
from strata.sim.reference import ReferenceReplay
from strata.sim.replay import Replay, ReplayConfig


class Fifo(StatefulPolicy):
    """A plain FIFO over the slots below top, answering lists of plain ints."""

    name = "plain-fifo"

    def start(self, view):
        self.hand = 0

    def admit(self, view, layer, missed_experts):
        self.ready(view)
        usable = np.flatnonzero(view.backed[: view.top])
        if usable.size == 0:
            return []
        picked = usable[(self.hand + np.arange(min(len(missed_experts), usable.size)))
                        % usable.size]
        self.hand += picked.size
        return [(int(s), layer, int(e)) for s, e in zip(picked, missed_experts, strict=False)]


class ArrayFifo(Fifo):
    """The same answers as an int32 array, then as numpy scalars (the Python checker's)."""

    name = "array-fifo"

    def admit(self, view, layer, missed_experts):
        rows = super().admit(view, layer, missed_experts)
        if self.hand % 2:
            return [tuple(np.int64(v) for v in row) for row in rows]
        return np.array(rows, np.int32).reshape(-1, 3)


class Shadow(Lru):
    """lru that keeps the books' residency from the notifications alone, checking each one
    against its copy, and the copy against the books at every layer step."""

    name = "shadow"

    def __init__(self, options=None):
        super().__init__(options)
        self.owner = None
        self.told = []

    def _copy(self, view):
        if self.owner is None:
            self.owner = np.full(view.n_slots, -1)
        return self.owner

    def entered(self, view, why, placements):
        owner = self._copy(view)
        for slot, layer, expert in placements.tolist():
            assert owner[slot] == -1, (why, slot)
            owner[slot] = layer * view.n_experts + expert
        self.told.append(("entered", why, placements.tolist()))

    def left(self, view, why, placements):
        owner = self._copy(view)
        for slot, layer, expert in placements.tolist():
            assert owner[slot] == layer * view.n_experts + expert, (why, slot)
            owner[slot] = -1
        self.told.append(("left", why, placements.tolist()))

    def moved(self, view, why, moves):
        owner = self._copy(view)
        for src, dst, layer, expert in moves.tolist():
            assert owner[src] == layer * view.n_experts + expert and owner[dst] == -1
            owner[src], owner[dst] = -1, owner[src]
        self.told.append(("moved", why, moves.tolist()))

    def observe(self, view, layer, expert_ids, hit_mask):
        assert np.array_equal(self._copy(view), view.owner)  # every change was told, in order
        super().observe(view, layer, expert_ids, hit_mask)


MAKERS = {"fifo": Fifo, "array-fifo": ArrayFifo, "shadow": Shadow}


def make(name, options):
    return MAKERS[name]() if name in MAKERS else REGISTRY.create(name, options)


def run_pair(trace, name, options, config, profile, env):
    config = dataclasses.replace(config, path="generic")
    with mock.patch.dict(os.environ, env):
        fast = Replay(trace, make(name, options), config, profile)
        fast.run()
        slow = ReferenceReplay(trace, make(name, options), config, profile)
        slow.run()
    return fast, slow


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(run=replay_runs(names=["static", "lru", "lfu", "sieve", "fifo", "array-fifo",
                              "shadow"]))
def test_the_c_step_loop_equals_the_engines_sequence(run):
    trace, name, options, config, profile, env = run
    fast, slow = run_pair(trace, name, options if name in REGISTRY.names() else {}, config,
                          profile, env)
    assert fast.result.path == slow.result.path == "generic"
    assert_same(fast, slow)
    a, b = fast.checked.policy, slow.checked.policy
    if name == "shadow":
        assert a.told == b.told
        if a.owner is not None:
            assert np.array_equal(a.owner, fast.table.owner)
    if name == "lfu" and b.counts is not None:
        assert a.counts.tobytes() == b.counts.tobytes()
    assert fast.table.hits == slow.table.hits and fast.table.lookups == slow.table.lookups


def test_the_notifications_tell_every_entry_and_exit_in_the_simulator():
    """A K/V that grows into the cache and trims back: fill, admit, give_up, relocate, trim."""
    from strata.sim import KvConfig, SynthSpec, synth_trace

    spec = SynthSpec(kind="markov", n_layers=4, n_experts=16, top_k=2, n_requests=6,
                     prompt_tokens=(8, 300), decode_tokens=(4, 16), prompt_chunk=64)
    trace = synth_trace(spec)
    kv = KvConfig(max_context=512, slot_bytes=4096, kv_segment_cell_bytes=64, kv_segments=2,
                  chunk_bytes=4096, floor_slots=2)
    env = {"STRATA_KV_GROW_INIT": "64", "STRATA_KV_GROW_STEP": "64"}
    with mock.patch.dict(os.environ, env):
        run = Replay(trace, Shadow(), ReplayConfig(slots=24, loan_slots=4, kv=kv),
                     trace.routing_counts())
        result = run.run()
    policy = run.checked.policy
    whys = {(kind, why) for kind, why, _ in policy.told}
    assert {("entered", "fill"), ("entered", "admit"), ("left", "admit"),
            ("left", "give_up"), ("entered", "trim")} <= whys, whys
    assert result.events["grows"] and result.events["trims"]
    assert policy.told[0][:2] == ("entered", "fill")
    assert np.array_equal(policy.owner, run.table.owner)


class BadAdmit(Policy):
    name = "bad-admit"

    def admit(self, view, layer, missed_experts):
        return [(view.top, layer, int(missed_experts[0]))]  # the loan region


class Raising(Policy):
    name = "raising"

    def observe(self, view, layer, expert_ids, hit_mask):
        raise KeyError("boom")


class BadListener(Policy):
    name = "bad-listener"

    def entered(self, view, why, placements):
        placements[0, 0] = 1  # read-only: raises


@pytest.mark.parametrize(("policy", "match"), [
    (BadAdmit(), r"policy 'bad-admit', admit: admits into slot 2, in the loan region"),
    (Raising(), r"policy 'raising', observe: raised KeyError"),
    (BadListener(), r"policy 'bad-listener', entered: raised ValueError"),
])
def test_a_bad_answer_is_still_a_policy_error(policy, match):
    trace = decode_trace([0, 1, 2, 3], n_experts=8)
    with pytest.raises(PolicyError, match=match):
        Replay(trace, policy, ReplayConfig(slots=3, loan_slots=1),
               np.arange(8)[None, ::-1]).run()


@settings(max_examples=50, deadline=None)
@given(ids=st.lists(st.integers(0, 7), min_size=1, max_size=30))
def test_a_plain_fifo_runs_in_c_as_in_python(ids):
    trace = decode_trace(ids, n_experts=8)
    config = ReplayConfig(slots=3, path="generic")
    fast = Replay(trace, Fifo(), config)
    fast.run()
    slow = ReferenceReplay(trace, Fifo(), config)
    slow.run()
    assert_same(fast, slow)
