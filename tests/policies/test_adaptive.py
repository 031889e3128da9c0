"""Golden decisions of the adaptive built-ins: `lru`, `lfu` and `sieve`.

Each sees routing through `observe` as the engine will (once per layer per step, [T, K] ids and
the hit mask), and answers admissions, give-ups and relocations by its own notion of coldest.
Tables: slot s holds flat expert s; with no heat recorded, ties fall to the profile rank.
"""

import numpy as np
import pytest

from strata.books import CheckedPolicy, apply_admit
from strata.policies import load_registry
from support.policy_tables import make_table


@pytest.fixture(scope="module")
def registry():
    return load_registry()


def small(**kwargs):
    """1 layer of 8 experts, 4 one-byte slots over one-byte chunks, slots 0..3 hold 0..3."""
    return make_table(n_layers=1, n_experts=8, n_slots=4, slot_bytes=1, chunk_bytes=1, **kwargs)


def step(checked, layer, ids):
    """One layer of one step, as the engine will run it: look up, observe, admit the misses."""
    ids = np.asarray(ids, dtype=np.int64).reshape(1, -1)
    _, hit = checked.table.lookup(layer, ids)
    checked.observe(checked.view, layer, ids, hit)
    placements = checked.admit(layer, np.unique(ids[~hit]))
    apply_admit(checked.table, placements)
    return placements.tolist()


def test_lru_evicts_the_least_recently_used(registry):
    table = small()
    lru = CheckedPolicy(registry.create("lru"), table)
    assert step(lru, 0, [0, 2]) == []
    assert step(lru, 0, [3]) == []
    # Expert 1 was never used; then 2 and 0 (used at the same time) by profile: 2 is colder.
    assert step(lru, 0, [5, 6]) == [[1, 0, 5], [2, 0, 6]]
    assert table.owner.tolist() == [0, 5, 6, 3]
    # Now 0 is the oldest.
    assert step(lru, 0, [7]) == [[0, 0, 7]]
    table.validate()


def test_lru_admits_at_most_max_admits(registry):
    lru = CheckedPolicy(registry.create("lru", ["max_admits=1"]), small())
    assert step(lru, 0, [5, 6, 7]) == [[3, 0, 5]]  # the hottest by profile, into the coldest


def test_lfu_admits_only_what_is_used_more(registry):
    table = small()
    lfu = CheckedPolicy(registry.create("lfu", {"decay": 0.5}), table)
    assert step(lfu, 0, [0, 0, 1]) == []
    assert step(lfu, 0, [2]) == []
    # counts now: 0 -> 1.0, 1 -> 0.5, 2 -> 1.0, 3 -> 0; after this step's decay 5 has 1.0.
    assert step(lfu, 0, [5]) == [[3, 0, 5]]
    # Expert 6 is seen once (1.0): the coldest resident, expert 1 (0.125), is colder: it goes.
    assert step(lfu, 0, [6]) == [[1, 0, 6]]
    # Residents used twice each; then a miss seen once (1.0) is used less than the coldest
    # resident (2.125 * 0.5): it stays out.
    assert step(lfu, 0, [0, 0, 2, 2, 5, 5, 6, 6]) == []
    assert step(lfu, 0, [7]) == []
    assert table.owner.tolist() == [0, 6, 2, 5]


def test_sieve_spares_the_visited_once(registry):
    table = small()
    sieve = CheckedPolicy(registry.create("sieve"), table)
    # The profile fill is the oldest, its coldest (3) at the tail. Hits on 3 and 1 mark them.
    assert step(sieve, 0, [3, 1]) == []
    # The hand passes 3 (clearing it) and evicts 2.
    assert step(sieve, 0, [5]) == [[2, 0, 5]]
    # It goes on from 1: visited, cleared; then 0, not visited: evicted.
    assert step(sieve, 0, [6]) == [[0, 0, 6]]
    # It stands at 5, admitted since and never hit: a newcomer used once goes first.
    assert step(sieve, 0, [7]) == [[2, 0, 7]]
    assert table.owner.tolist() == [6, 1, 7, 3]


def test_sieve_is_scan_resistant(registry):
    """A one-off scan through the misses does not flush experts used again and again."""
    table = make_table(n_layers=1, n_experts=32, n_slots=8, slot_bytes=1, chunk_bytes=1)
    sieve = CheckedPolicy(registry.create("sieve"), table)
    lru = CheckedPolicy(registry.create("lru"), make_table(
        n_layers=1, n_experts=32, n_slots=8, slot_bytes=1, chunk_bytes=1))
    hot = [0, 1, 2, 3]
    for scan in range(8, 32, 2):
        for policy in (sieve, lru):
            step(policy, 0, hot)
            step(policy, 0, [scan, scan + 1])
    assert set(hot) <= set(sieve.table.owner.tolist())
    assert set(hot) <= set(lru.table.owner.tolist())  # LRU keeps them too: they are recent
    # But a scan longer than the cache between uses flushes LRU and not SIEVE.
    for policy in (sieve, lru):
        step(policy, 0, hot)
        for scan in range(8, 24):
            step(policy, 0, [scan])
    assert set(hot) <= set(sieve.table.owner.tolist())
    assert not set(hot) & set(lru.table.owner.tolist())


def geometry_table():
    """1 layer of 8, 6 slots of 3 bytes over 9 chunks of 2: slot 2 is chunks 3, 4, slot 3
    chunks 4, 5 (shared chunk 4), slot 4 chunks 6, 7, slot 5 chunks 7, 8."""
    return make_table(n_layers=1, n_experts=8, n_slots=6, slot_bytes=3, chunk_bytes=2)


@pytest.mark.parametrize("name", ["lru", "lfu", "sieve"])
def test_gives_up_the_coldest_chunks_not_those_below_top(registry, name):
    table = geometry_table()
    policy = CheckedPolicy(registry.create(name), table)
    for _ in range(3):
        policy.observe(policy.view, 0, np.array([[0, 1, 4, 5]]), np.ones((1, 4), bool))
    # Slots 2 and 3 (experts 2, 3) were never used: their chunks 3, 4, 5 go, not 6, 7, 8.
    plan = policy.give_up(2)
    assert plan.slots.tolist() == [2, 3]
    assert plan.chunks.tolist() == [3, 4, 5]
    assert plan.moves.shape == (0, 2)  # nothing given up is hotter than what stays
    assert CheckedPolicy(registry.create("coldest-in-loan"), table).give_up(2).slots.tolist() \
        == [4, 5]


@pytest.mark.parametrize(
    ("name", "moves"),
    [
        # Expert 3 was used twice, 2 once, 4 never: 3 takes 4's slot; 2 is no hotter than the
        # rest.
        ("lru", [(3, 4)]),
        ("lfu", [(3, 4)]),
        # SIEVE knows visited or not: 4 (unvisited) goes first, then the hand's order from the
        # tail (the profile's coldest, 5): both given-up experts outrank both.
        ("sieve", [(2, 4), (3, 5)]),
    ],
)
def test_relocates_hot_experts_into_the_coldest_kept_slots(registry, name, moves):
    table = geometry_table()
    policy = CheckedPolicy(registry.create(name), table)
    policy.observe(policy.view, 0, np.array([[0, 1, 2, 3, 5]]), np.ones((1, 5), bool))
    policy.observe(policy.view, 0, np.array([[0, 1, 3, 5]]), np.ones((1, 4), bool))
    assert policy.policy.relocate(policy.view, np.array([2, 3])) == moves


def test_the_engine_asks_admit_only_of_policies_that_answer_it(registry, monkeypatch):
    answers = {name: CheckedPolicy(registry.create(name), small()).admits
               for name in registry.names()}
    assert answers == {"coldest-in-loan": False, "lfu": True, "lru": True, "sieve": True,
                       "static": False}
    monkeypatch.setenv("STRATA_TRACE_PLUGINS", "1")  # a traced policy answers as its own
    assert CheckedPolicy(registry.create("lru"), small()).admits
    assert not CheckedPolicy(registry.create("static"), small()).admits
