"""Golden decisions of `coldest-in-loan` (the defaults) and `static` on hand-built tables.

The table: 2 layers of 8 experts, 10 slots of 3 bytes over 15 chunks of 2 bytes, loan [8, 10),
floor 2; slot s holds flat expert s, profile rank = flat id (0 hottest). Slot s spans bytes
[3s, 3s + 3): slot 5 touches chunks 7 and 8, slot 6 chunks 9 and 10, slot 7 chunks 10 and 11,
so neighbouring slots share a chunk (design.md: chunks come from the slots just below `top`).
"""

import numpy as np
import pytest

from strata.books import CheckedPolicy, apply_give_up, apply_refill
from strata.policies import DEFAULT_POLICY, Policy, load_registry
from support.policy_tables import heat_up, make_table


@pytest.fixture(scope="module")
def registry():
    return load_registry()


@pytest.fixture
def table():
    return make_table(top=8, floor=2)


def checked(registry, name, table, **options):
    return CheckedPolicy(registry.create(name, options), table)


@pytest.mark.parametrize(
    ("n_chunks", "slots", "chunks"),
    [
        (1, [7], [11]),  # chunk 10 is shared with slot 6, which stays
        (2, [6, 7], [9, 10, 11]),
        (3, [6, 7], [9, 10, 11]),
        (4, [5, 6, 7], [8, 9, 10, 11]),
        # Slots 3..7 free 7 chunks (chunk 4 is shared with slot 2): slot 2 goes too.
        (8, [2, 3, 4, 5, 6, 7], list(range(3, 12))),
    ],
)
def test_gives_up_downward_from_top(registry, table, n_chunks, slots, chunks):
    for name in ("coldest-in-loan", "static"):
        plan = checked(registry, name, table).give_up(n_chunks)
        assert plan.slots.tolist() == slots and plan.chunks.tolist() == chunks


def test_gives_up_down_to_the_floor_and_no_further(registry, table):
    policy = checked(registry, "coldest-in-loan", table)
    # Chunk 2 is shared with slot 1, below the floor: 9 chunks (3..11) is all there is.
    assert policy.give_up(9).slots.tolist() == [2, 3, 4, 5, 6, 7]
    with pytest.raises(ValueError, match=r"n_chunks 10 is outside \[1, 9\]"):
        policy.give_up(10)


def test_relocates_hot_experts_into_the_coldest_loan_slots(registry, table):
    # No heat: the profile orders; experts 6 and 7 beat the loan's 9 and 8.
    plan = checked(registry, "coldest-in-loan", table).give_up(2)
    assert plan.moves.tolist() == [[6, 9], [7, 8]]
    # Expert (1, 1) in slot 9 gets hot: only expert 6 beats the loan's coldest, (1, 0) in slot 8.
    heat_up(table, {(1, 1): 5})
    plan = checked(registry, "coldest-in-loan", table).give_up(2)
    assert plan.moves.tolist() == [[6, 8]]
    # Online heat outranks the profile: a given-up expert with heat moves first.
    heat_up(table, {(0, 7): 1})
    plan = checked(registry, "coldest-in-loan", table).give_up(2)
    assert plan.moves.tolist() == [[7, 8]]


def test_static_moves_nothing(registry, table):
    plan = checked(registry, "static", table).give_up(2)
    assert plan.moves.shape == (0, 2)


def test_nothing_to_relocate_into_without_a_loan(registry):
    table = make_table(floor=2)  # top = n_slots: nothing lent
    plan = checked(registry, "coldest-in-loan", table).give_up(2)
    assert plan.slots.tolist() == [8, 9] and plan.moves.shape == (0, 2)


def test_grow_apply_then_trim_and_refill(registry, table):
    heat_up(table, {(1, 1): 5})
    policy = checked(registry, "coldest-in-loan", table)
    evicted = apply_give_up(table, policy.give_up(2))
    table.validate()
    # Slot 6's expert moved into slot 8, whose (1, 0) left; slot 7's (0, 7) left.
    assert evicted.tolist() == [[1, 0], [0, 7]]
    assert table.owner.tolist() == [0, 1, 2, 3, 4, 5, -1, -1, 6, 9]
    assert table.chunk_mapped.tolist() == [True] * 9 + [False] * 3 + [True] * 3
    # The next growth skips the slots given up already.
    assert policy.give_up(1).slots.tolist() == [5]
    # Trim: the chunks come back, completing slots 6 and 7; refill hottest missing first.
    returned = np.array([9, 10, 11])
    free = table.slots_completed_by(returned)
    assert free.tolist() == [6, 7]
    table.mark_chunks(returned, True)
    placements = policy.refill(free)
    assert placements.tolist() == [[6, 0, 7], [7, 1, 0]]
    apply_refill(table, placements)
    table.validate()
    assert table.owner.tolist() == [0, 1, 2, 3, 4, 5, 7, 8, 6, 9]


def test_refill_fills_only_as_many_as_are_missing(registry):
    table = make_table(n_layers=1, n_experts=4, n_slots=6, slot_bytes=1, chunk_bytes=1)
    table.evict(1)
    placements = checked(registry, "coldest-in-loan", table).refill([1, 4, 5])
    assert placements.tolist() == [[1, 0, 1]]


def test_admits_nothing(registry, table):
    table.evict(3)
    for name in ("coldest-in-loan", "static"):
        assert checked(registry, name, table).admit(1, [2, 3]).shape == (0, 3)


def test_the_default_is_the_base_class_by_name(registry):
    # `coldest-in-loan` answers every decision by `Policy`'s defaults: a plain `Policy()` decides
    # the same, only its name differs.
    entry = registry.get(DEFAULT_POLICY)
    assert entry.cls.overrides() == ()
    assert entry.cls.replay_kernel is None
    assert (entry.cls.Options, entry.name) == (Policy.Options, "coldest-in-loan")
