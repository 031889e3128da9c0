"""Every validation rule: the `misbehaving` test plugin breaks it, the checker names the policy,
the decision and the bad value, and the books stay as they were."""

import numpy as np
import pytest

import support.policy_plugins as misbehaving_plugin
from strata.books import CheckedPolicy, apply_give_up, validate_decision
from strata.policies import (
    KvContext,
    KvParams,
    PolicyError,
)
from strata.policies.builtin.static import Static
from strata.policies.registry import StrataPluginManager, collect_policies
from support.policy_tables import assert_unchanged, make_table, snapshot


@pytest.fixture(scope="module")
def registry():
    pm = StrataPluginManager()
    pm.register(misbehaving_plugin, name="misbehaving-plugin")
    return collect_policies(pm)


@pytest.fixture
def table():
    """10 slots of 3 bytes over 15 chunks of 2; loan [8, 10), floor 2. Slot 7 was given up
    (chunk 11 unmapped); slots 3 and 4 are empty and backed."""
    table = make_table(top=8, floor=2)
    apply_give_up(table, CheckedPolicy(Static(), table).give_up(1))
    assert not table.backed[7] and table.backed[6]
    table.evict_many(np.array([3, 4]))
    return table


CASES = [
    ("give_up_missing_slot", "gives up slot 13, which does not exist (slots are 0..9)", 13),
    ("give_up_twice", "names slot 7 twice", 7),
    ("give_up_below_floor", "slot 1 is below the floor 2", 1),
    ("give_up_lent", "slot 8 is in the loan region [8, 10)", 8),
    ("give_up_unbacked", "slot 7 has no memory left to give", 7),
    ("give_up_short", "frees 2 chunks of the 3 needed", [6]),
    ("give_up_floats", "want a list of slots of integers", [7.0]),
    ("give_up_none", "returned None", None),
    ("give_up_raises", "raised ZeroDivisionError: integer division or modulo by zero", None),
    ("relocate_from_kept", "moves from slot 0, which is not given up", (0, 8)),
    ("relocate_from_empty", "moves from slot 4, which holds no expert", (4, 8)),
    ("relocate_into_given", "moves into slot 6, which is given up too", (5, 6)),
    ("relocate_into_unbacked", "moves into slot 7, which is too small", (5, 7)),
    ("relocate_into_missing", "moves into slot -1, which does not exist", -1),
    ("relocate_src_twice", "moves slot 5 twice", (5, 9)),
    ("relocate_dst_twice", "moves two experts into slot 8", (6, 8)),
    ("relocate_triples", "want a list of (src_slot, dst_slot) pairs, got shape (1, 3)", None),
    ("refill_not_offered", "fills slot 0, which was not offered (free slots: [3, 4])", (0, 1, 7)),
    ("refill_resident", "expert (0, 0) is already resident, in slot 0", (0, 0)),
    ("refill_missing_expert", "expert (2, 0) does not exist (2 layers of 8 experts)", (2, 0)),
    ("refill_expert_twice", "names expert (1, 7) twice", (1, 7)),
    ("refill_slot_twice", "fills slot 3 twice", (3, 1, 7)),
    ("admit_lent", "admits into slot 8, in the loan region [8, 10)", (8, 1, 6)),
    ("admit_unbacked", "admits into slot 7, which is not backed by memory", (7, 1, 6)),
    ("admit_wrong_layer", "admits an expert of layer 2 when asked about layer 1", (0, 2, 6)),
    ("admit_not_missed", "admits expert (1, 5), which was not missed (missed: [6, 7])", None),
    ("admit_resident", "expert (1, 0) is already resident, in slot 8", (1, 0)),
    ("admit_slot_twice", "admits into slot 0 twice", (0, 1, 7)),
]


def _decide(checked, rule):
    decision = rule.split("_")[0]
    if decision == "give":
        return checked.give_up(3)
    if decision == "relocate":
        return checked.give_up(4)  # gives up [4, 5, 6]; slot 4 is empty
    if decision == "refill":
        return checked.refill([3, 4])
    return checked.admit(1, [6, 7])


@pytest.mark.parametrize(("rule", "reason", "value"), CASES, ids=[c[0] for c in CASES])
def test_a_bad_answer_is_rejected_and_the_books_stay(registry, table, rule, reason, value):
    policy = registry.create("misbehaving", {"rule": rule})
    checked = CheckedPolicy(policy, table)
    before = snapshot(table)
    with pytest.raises(PolicyError) as caught:
        _decide(checked, rule)
    err = caught.value
    assert err.policy == "misbehaving"
    assert err.method == rule.split("_")[0].replace("give", "give_up")
    assert reason in err.reason, err.reason
    assert str(err).startswith(f"policy 'misbehaving', {err.method}: ")
    if value is not None and not isinstance(err.value, Exception):
        assert err.value == value or str(value) in str(err.value)
    assert_unchanged(table, before)


def test_the_same_table_accepts_the_default_answers(table):
    """The fixture's requests are satisfiable: only the misbehaviour above is rejected."""
    checked = CheckedPolicy(Static(), table)
    plan = checked.give_up(4)
    assert plan.slots.tolist() == [4, 5, 6]
    assert plan.chunks.tolist() == [6, 7, 8, 9, 10]
    assert checked.refill([3, 4]).tolist() == [[3, 0, 3], [4, 0, 4]]
    assert checked.admit(1, [6, 7]).shape == (0, 3)


def test_a_raising_policy_keeps_its_exception_as_the_cause(registry, table):
    checked = CheckedPolicy(registry.create("misbehaving", {"rule": "give_up_raises"}), table)
    with pytest.raises(PolicyError) as caught:
        checked.give_up(3)
    assert isinstance(caught.value.__cause__, ZeroDivisionError)


@pytest.mark.parametrize(
    ("rule", "reason"),
    [
        ("kv_target_short", "99 cells do not cover the 100 needed"),
        ("kv_target_float", "want an int number of cells"),
    ],
)
def test_kv_target_answers_are_checked(registry, table, rule, reason):
    checked = CheckedPolicy(registry.create("misbehaving", {"rule": rule}), table)
    with pytest.raises(PolicyError, match=reason):
        checked.kv_target(100, 0, KvParams(256, 256, 0), max_cells=1024)


@pytest.mark.parametrize(
    ("rule", "reason"),
    [
        ("kv_params_not_whole_chunks", "init_cells 1000 is not whole chunks (256 cells a chunk)"),
        ("kv_params_type", "want a KvParams"),
    ],
)
def test_kv_params_answers_are_checked(registry, table, rule, reason):
    checked = CheckedPolicy(registry.create("misbehaving", {"rule": rule}), table)
    ctx = KvContext(max_cells=65536, cells_per_chunk=256, n_slots=10, top=8)
    with pytest.raises(PolicyError) as caught:
        checked.kv_params(ctx)
    assert reason in caught.value.reason


def test_the_caller_s_bad_arguments_are_its_own_error(table):
    checked = CheckedPolicy(Static(), table)
    before = snapshot(table)
    with pytest.raises(ValueError, match=r"n_chunks 9 is outside \[1, 8\]"):
        checked.give_up(9)
    with pytest.raises(ValueError, match="must be distinct, backed, empty"):
        checked.refill([0])
    with pytest.raises(ValueError, match="ascending, distinct, non-resident"):
        checked.admit(1, [0])
    with pytest.raises(ValueError, match="out of range"):
        checked.admit(1, [8])
    with pytest.raises(ValueError, match=r"need_cells 2000 is outside \[0, 1024\]"):
        checked.kv_target(2000, 0, KvParams(256, 256, 0), max_cells=1024)
    assert_unchanged(table, before)


def test_validate_decision_is_the_same_checker(table):
    before = snapshot(table)
    slots, chunks = validate_decision(table, "mine", "give_up", [5, 6], n_chunks=3)
    assert slots.tolist() == [5, 6] and chunks.tolist() == [8, 9, 10]
    with pytest.raises(PolicyError, match="policy 'mine', relocate: moves into slot 6"):
        validate_decision(table, "mine", "relocate", [(5, 6)], slots=np.array([5, 6]))
    with pytest.raises(ValueError, match="no check for decision 'evict'"):
        validate_decision(table, "mine", "evict", [])
    assert_unchanged(table, before)


def test_a_give_up_may_not_leave_fewer_usable_slots_than_the_floor():
    table = make_table(top=8, floor=2)
    table.evict_many(np.array([2, 3, 4]))
    table.mark_chunks(np.array([3, 4, 5, 6]), False)  # slots 2, 3, 4 have lost their memory
    table.set_regions(floor=5)  # raised since: only 0, 1 and 5.. are usable below top
    before = snapshot(table)
    with pytest.raises(PolicyError, match="would leave 4 usable slots, fewer than the floor 5"):
        validate_decision(table, "mine", "give_up", [5, 6, 7], n_chunks=1)
    assert_unchanged(table, before)
