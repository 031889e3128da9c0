"""What the checker guards beyond each answer's rules: `kv_params` fields forced past the
dataclass, an `observe` that raises, and the arrays a policy is handed (read-only for good, and
not the ones the checker judges the answer by)."""

import numpy as np
import pytest

from strata.books import CheckedPolicy
from strata.policies import KvContext, KvParams, Policy, PolicyError
from strata.policies.builtin.static import Static
from support.policy_tables import assert_unchanged, make_table, snapshot

CTX = KvContext(max_cells=65536, cells_per_chunk=256, n_slots=10, top=8)


class Answers(Policy):
    """Answers `kv_params` with `params`; in the other decisions, runs `hook(arguments)` after
    answering as the default would."""

    name = "answers"

    def __init__(self, params=None, hook=None):
        super().__init__()
        self.params, self.hook = params, hook or (lambda *a: None)

    def kv_params(self, ctx):
        return self.params

    def observe(self, view, layer, expert_ids, hit_mask):
        self.hook("observe", view, expert_ids, hit_mask)

    def relocate(self, view, slots):
        answer = super().relocate(view, slots)
        self.hook("relocate", view, slots)
        return answer

    def refill(self, view, free_slots):
        answer = super().refill(view, free_slots)
        self.hook("refill", view, free_slots)
        return answer

    def admit(self, view, layer, missed_experts):
        self.hook("admit", view, missed_experts)
        return []


def forced(**fields):
    params = KvParams(512, 256, 2)
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


@pytest.mark.parametrize(("fields", "reason"), [
    ({"floor_slots": -1}, "floor_slots must be an integer >= 0, got -1"),
    ({"floor_slots": True}, "floor_slots must be an integer >= 0, got True"),
    ({"floor_slots": 2.0}, "floor_slots must be an integer >= 0, got 2.0"),
    ({"step_cells": 0}, "step_cells must be an integer >= 1, got 0"),
    ({"step_cells": -256}, "step_cells must be an integer >= 1, got -256"),
    ({"init_cells": 512.0}, "init_cells must be an integer >= 1, got 512.0"),
    ({"init_cells": "512"}, "init_cells must be an integer >= 1, got '512'"),
    ({"init_cells": None}, "init_cells must be an integer >= 1, got None"),
    ({"init_cells": np.int64(512)}, "init_cells must be an integer >= 1, got"),
])
def test_forced_kv_params_fields_are_read_again(fields, reason):
    checked = CheckedPolicy(Answers(forced(**fields)), make_table(top=8, floor=2))
    with pytest.raises(PolicyError) as caught:
        checked.kv_params(CTX)
    assert (caught.value.policy, caught.value.method) == ("answers", "kv_params")
    assert reason in caught.value.reason


def test_kv_params_are_kept_as_a_copy_of_plain_ints():
    class Count(int):
        pass

    answer = KvParams(Count(512), 256, 2)
    params = CheckedPolicy(Answers(answer), make_table(top=8, floor=2)).kv_params(CTX)
    assert params == KvParams(512, 256, 2) and params is not answer
    assert type(params.init_cells) is int


def test_an_observe_that_raises_is_the_policys_error():
    def hook(method, *arguments):
        raise RuntimeError("observe broke")

    table = make_table(top=8, floor=2)
    checked = CheckedPolicy(Answers(hook=hook), table)
    with pytest.raises(PolicyError) as caught:
        checked.observe(checked.view, 0, np.array([[1, 2]]), np.ones((1, 2), bool))
    err = caught.value
    assert (err.policy, err.method) == ("answers", "observe")
    assert str(err).startswith("policy 'answers', observe: raised RuntimeError: observe broke")
    assert isinstance(err.__cause__, RuntimeError)


def test_the_default_observe_is_called_bare():
    policy = Static()
    assert CheckedPolicy(policy, make_table()).observe == policy.observe


def _cannot_write(array):
    with pytest.raises(ValueError):
        array[...] = 0
    with pytest.raises(ValueError):
        array.flags.writeable = True


def test_the_arrays_a_policy_is_handed_stay_read_only():
    seen = {}

    def hook(method, view, *arrays):
        seen[method] = arrays
        for array in arrays:
            _cannot_write(array)
            array.shape = (-1, 1)  # its own object: the checker's array keeps its shape

    table = make_table(top=8, floor=2)
    checked = CheckedPolicy(Answers(hook=hook), table)
    ids, hit = np.array([[1, 2]]), np.ones((1, 2), bool)
    checked.observe(checked.view, 0, ids, hit)
    assert ids.flags.writeable and ids.shape == (1, 2)  # the caller's arrays are as they were
    plan = checked.give_up(2)
    assert plan.slots.shape == (plan.slots.size,)
    table.evict_many(np.array([3, 4]))
    before = snapshot(table)
    assert checked.refill([3, 4]).shape == (2, 3)
    assert checked.admit(1, [6, 7]).shape == (0, 3)
    assert set(seen) == {"observe", "relocate", "refill", "admit"}
    assert_unchanged(table, before)


def test_a_policy_that_exits_does_not_end_the_run_as_a_success():
    class Exits(Policy):
        name = "exits"

        def give_up(self, view, n_chunks):
            raise SystemExit(0)

    table = make_table(top=8, floor=2)
    with pytest.raises(PolicyError, match=r"'exits', give_up: raised SystemExit: 0"):
        CheckedPolicy(Exits(), table).give_up(2)
