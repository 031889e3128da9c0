"""The compiled-rule API's own parts in `strata._residency`: `ExpertLists` against a plain
Python model, the fast check of `admit` answers against the Python checker, the reasons."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata._residency import (
    WHY_NAMES,
    CacheRule,
    ExpertLists,
    ResidencyTable,
    ResidencyView,
    admit_answer,
    why_code,
)
from strata.books import validate
from strata.policies import WHY, PolicyError, RulePolicy, compiled_rule

# --- ExpertLists: O(1) linked lists, against Python lists ---

OPS = st.lists(st.tuples(st.sampled_from(["front", "back", "remove"]), st.integers(0, 2),
                         st.integers(0, 7)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops=OPS)
def test_expert_lists_behave_as_python_lists(ops):
    lists = ExpertLists(3, 8)
    model: list[list[int]] = [[], [], []]
    for op, k, item in ops:
        for members in model:
            if item in members:
                members.remove(item)
        if op == "remove":
            lists.py_remove(item)
        else:
            model[k].insert(0, item) if op == "front" else model[k].append(item)
            lists.py_push(k, item, op == "front")
        for j in range(3):
            assert lists.items(j) == model[j]
        for x in range(8):
            assert lists.list_of(x) == next((j for j in range(3) if x in model[j]), -1)


def test_expert_lists_refuse_bad_arguments():
    with pytest.raises(ValueError, match="n_lists >= 1"):
        ExpertLists(0, 4)
    lists = ExpertLists(2, 4)
    with pytest.raises(IndexError, match="k 2 is out of range"):
        lists.py_push(2, 0)
    with pytest.raises(IndexError, match="item 4 is out of range"):
        lists.py_remove(4)


# --- the fast check of admit answers: it only ever accepts what the Python checker accepts ---

def books():
    """2 layers of 6 experts, 8 slots: slots 0-4 hold experts 0-4 of layer 0, slot 5 empty,
    slots 6-7 the loan region; slot 4's memory is gone (given up)."""
    table = ResidencyTable(2, 6, 8, 2, 2)
    table.set_regions(top=6)
    table.assign_many(np.arange(4), np.zeros(4, int), np.arange(4))
    table.mark_chunks([4], False)
    return table


VALUES = st.one_of(st.integers(-2, 9), st.sampled_from([True, np.int64(1), np.int32(5), 2.0,
                                                         2**70]))
ANSWERS = st.one_of(
    st.lists(st.tuples(st.integers(-1, 8), st.integers(0, 1), st.integers(-1, 6)), max_size=4),
    st.lists(st.lists(VALUES, min_size=2, max_size=4), max_size=3),
    st.lists(st.tuples(st.integers(0, 7), st.just(1), st.sampled_from([4, 5])), max_size=3)
    .map(lambda rows: np.array(rows, np.int64).reshape(-1, 3)),
    st.sampled_from([None, [], (), np.empty((0, 3)), "no", [[]], np.zeros((2, 2), int)]),
)


def python_verdict(view, layer, missed, answer):
    try:
        return validate.check_admit(view, "p", layer, missed, answer)
    except PolicyError:
        return None


@settings(max_examples=600, deadline=None)
@given(answer=ANSWERS, layer=st.integers(0, 1))
def test_the_fast_check_never_accepts_what_the_checker_refuses(answer, layer):
    view = ResidencyView(books())
    missed = np.array([4, 5], np.int32) if layer == 0 else np.array([0, 4, 5], np.int32)
    fast = admit_answer(view, layer, missed, answer)
    slow = python_verdict(view, layer, missed, answer)
    if fast is not None:
        assert slow is not None, f"fast accepted {answer!r}, the checker refuses it"
        assert fast.dtype == np.int64 and np.array_equal(fast, slow)


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.tuples(st.sampled_from([0, 1, 2, 3, 5]), st.sampled_from([4, 5])),
                     max_size=2, unique_by=(lambda r: r[0], lambda r: r[1])))
def test_the_fast_check_passes_plain_good_answers(rows):
    view = ResidencyView(books())
    answer = [(slot, 0, expert) for slot, expert in rows]
    fast = admit_answer(view, 0, np.array([4, 5], np.int32), answer)
    assert fast is not None and fast.tolist() == [list(r) for r in answer]


# --- the reasons and the base rule ---

def test_the_reasons_are_one_list():
    assert WHY_NAMES == WHY
    assert [why_code(w) for w in WHY] == list(range(len(WHY)))
    with pytest.raises(ValueError, match="unknown reason 'evicted'"):
        why_code("evicted")


def test_the_base_rule_admits_nothing_and_a_python_override_is_not_compiled():
    class Nothing(RulePolicy):
        name = "nothing"

    class PythonAdmit(Nothing):
        def admit(self, view, layer, missed_experts):
            return []

    view = ResidencyView(books())
    policy = Nothing()
    assert isinstance(compiled_rule(policy), CacheRule)
    assert policy.admit(view, 0, np.array([4, 5])).shape == (0, 3)
    assert compiled_rule(PythonAdmit()) is None
    with pytest.raises(ValueError, match="kind must be entered, left or moved"):
        policy.rule.notify(view, "arrived", "fill", [(5, 0, 5)])
