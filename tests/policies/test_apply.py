"""Applying checked decisions: every step or none; a plan gone stale since it was checked is
undone and the books are as they were."""

import numpy as np
import pytest

from strata.books import CheckedPolicy, apply_admit, apply_give_up, apply_refill
from strata.policies import Policy
from support.policy_tables import assert_unchanged, make_table, snapshot


def test_a_stale_give_up_is_rolled_back():
    table = make_table(top=8, floor=2)
    plan = CheckedPolicy(Policy(), table).give_up(2)
    assert plan.moves.tolist() == [[6, 9], [7, 8]]
    table.evict(7)  # the books change after the check: the move out of slot 7 cannot be done
    before = snapshot(table)
    with pytest.raises(ValueError):
        apply_give_up(table, plan)
    assert_unchanged(table, before)  # the loan's residents, evicted first, are back


def test_a_stale_admission_is_rolled_back():
    table = make_table(n_layers=1, n_experts=8, n_slots=4, slot_bytes=1, chunk_bytes=1)
    placements = np.array([[1, 0, 5], [2, 0, 6]])
    table.evict(0)
    table.assign(0, 0, 6)  # expert 6 got in elsewhere since
    before = snapshot(table)
    with pytest.raises(ValueError):
        apply_admit(table, placements)
    assert_unchanged(table, before)


def test_applied_admissions_and_refills_change_exactly_what_they_name():
    table = make_table(n_layers=1, n_experts=8, n_slots=4, slot_bytes=1, chunk_bytes=1)
    table.evict(3)
    evicted = apply_admit(table, np.array([[1, 0, 5], [3, 0, 6]]))
    assert evicted.tolist() == [[0, 1]]
    assert table.owner.tolist() == [0, 5, 2, 6]
    table.evict(2)
    apply_refill(table, np.array([[2, 0, 7]]))
    assert table.owner.tolist() == [0, 5, 7, 6]
    apply_refill(table, np.empty((0, 3), np.int64))
    assert apply_admit(table, np.empty((0, 3), np.int64)).shape == (0, 2)
    table.validate()


def test_a_plan_is_read_only():
    table = make_table(top=8, floor=2)
    plan = CheckedPolicy(Policy(), table).give_up(2)
    for array in (plan.slots, plan.moves, plan.chunks):
        assert not array.flags.writeable
