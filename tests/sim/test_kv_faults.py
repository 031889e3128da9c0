"""The simulated K/V's grow and trim are all or nothing: a policy that raises or answers wrongly
at random, in any decision a growth or a trim asks, leaves the books, the K/V's figures and the
counts exactly as they were before the failed request."""

import dataclasses
import os
from unittest import mock

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata.formats.trace import DECODE, Trace
from strata.policies import PolicyError
from strata.policies.builtin.coldest_in_loan import ColdestInLoan
from strata.sim.kv_sim import KvConfig
from strata.sim.replay import Replay, ReplayConfig

N_EXPERTS = 8
MAX_CONTEXT = 12
# A K/V chunk holds 2 cells (or 1, with 2-byte cells): growth and trim move a few chunks at once.
ENV = {"STRATA_KV_GROW_INIT": "2", "STRATA_KV_GROW_STEP": "2", "STRATA_KV_GROW_FLOOR": ""}
FAULTS = (None, None, None, None, None, "raise", "wrong")


class Flaky(ColdestInLoan):
    """The default policy, but each decision may raise or answer wrongly, as `fault` draws."""

    name = "flaky"

    def __init__(self, fault):
        super().__init__()
        self.fault = fault

    def _decide(self, method, right, wrong):
        fault = self.fault(method)
        if fault == "raise":
            raise RuntimeError(f"{method} failed on purpose")
        return wrong() if fault == "wrong" else right()

    def kv_target(self, need_cells, mapped_cells, params):
        return self._decide("kv_target",
                            lambda: super(Flaky, self).kv_target(need_cells, mapped_cells, params),
                            lambda: need_cells - 1)

    def give_up(self, view, n_chunks):
        return self._decide("give_up", lambda: super(Flaky, self).give_up(view, n_chunks),
                            lambda: [view.n_slots])

    def relocate(self, view, slots):
        return self._decide("relocate", lambda: super(Flaky, self).relocate(view, slots),
                            lambda: [(-1, 0)])

    def refill(self, view, free_slots):
        return self._decide("refill", lambda: super(Flaky, self).refill(view, free_slots),
                            lambda: [(int(free_slots[0]), view.n_layers, 0)])


def snapshot(replay):
    table, kv, result = replay.table, replay.kv, replay.result
    return {
        "owner": table.owner.copy(), "res": table.res.copy(), "heat": table.heat.copy(),
        "chunk_mapped": table.chunk_mapped.copy(), "backed": table.backed.copy(),
        "regions": (table.top, table.floor, table.n_resident),
        "kv": (kv.mapped_cells, kv.free_chunks),
        "events": dict(result.events), "uploads": result.steps.uploads.copy(),
        "evictions": result.layer_evictions.copy(),
    }


def assert_same(before, after):
    for key, value in before.items():
        if isinstance(value, np.ndarray):
            assert np.array_equal(value, after[key]), key
        else:
            assert value == after[key], key


@st.composite
def setups(draw):
    slots = draw(st.integers(2, 10))
    loan = draw(st.integers(0, min(2, slots)))
    kv = KvConfig(max_context=MAX_CONTEXT, slot_bytes=draw(st.integers(1, 3)),
                  kv_segment_cell_bytes=draw(st.sampled_from([1, 2])),
                  kv_segments=draw(st.integers(1, 2)), chunk_bytes=2,
                  floor_slots=draw(st.integers(0, 2)))
    # The start's chunks (the arena's and the K/V's first 2 cells), and a few spare or none:
    # without spare chunks every growth gives up slots, with some it takes the budget first.
    start = -(-slots * kv.slot_bytes // 2) + kv.chunks_for(2)
    kv = dataclasses.replace(kv, budget_bytes=2 * (start + draw(st.integers(0, 8))))
    counts = np.array(draw(st.lists(st.integers(0, 9), min_size=N_EXPERTS,
                                    max_size=N_EXPERTS))).reshape(1, N_EXPERTS)
    return ReplayConfig(slots=slots, loan_slots=loan, kv=kv), counts


# What happens between requests: a request of so many cells, routing that heats experts, or an
# expert leaving (so that a trim's refill has empty slots to fill).
OPERATIONS = st.lists(st.one_of(
    # Long then short requests make the K/V grow, then trim.
    st.tuples(st.just("request"), st.one_of(st.integers(1, 3),
                                            st.integers(MAX_CONTEXT - 4, MAX_CONTEXT))),
    st.tuples(st.just("route"), st.lists(st.integers(0, N_EXPERTS - 1), min_size=1,
                                         max_size=4)),
    st.tuples(st.just("evict"), st.integers(0, 9)),
), min_size=1, max_size=25)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=setups(), operations=OPERATIONS, data=st.data())
def test_a_failed_grow_or_trim_changes_nothing(setup, operations, data):
    config, counts = setup
    trace = Trace(N_EXPERTS, np.zeros((1, 1, 1), np.int32), [0, 1], [DECODE], [0, 1])
    policy = Flaky(lambda method: data.draw(st.sampled_from(FAULTS), label=method))
    with mock.patch.dict(os.environ, ENV):
        try:
            replay = Replay(trace, policy, config, counts)
        except ValueError:
            return  # the start does not fit (slots too small for the initial K/V)
        failures = 0
        for operation, argument in operations:
            table = replay.table
            if operation == "route":
                table.record(0, np.array(argument))
                continue
            if operation == "evict":
                if argument < table.n_slots and table.owner[argument] >= 0:
                    table.evict(argument)
                continue
            before = snapshot(replay)
            try:
                replay.kv.request(argument, 0, replay.result)
            except PolicyError as err:
                failures += 1
                assert err.policy == "flaky"
                assert_same(before, snapshot(replay))
            table.validate()
            assert 0 <= replay.kv.mapped_cells <= replay.kv.max_cells
            assert table.floor <= table.top
