"""A plugin whose one policy, `misbehaving`, answers the decision its `rule` option names wrongly.

Registered like any plugin (a module with a `strata_register_policies` hookimpl); the validation
tests select each rule and check that the checker rejects the answer and the books stay as they
were.
"""

from dataclasses import dataclass

import numpy as np

from strata.policies import KvParams, Policy, hookimpl


def _first_unbacked(view):
    return int(np.flatnonzero(~view.backed)[0])


# rule -> (decision, answer(view, args)); args are the decision's own arguments.
RULES = {
    "give_up_missing_slot": ("give_up", lambda v, a: [v.n_slots + 3]),
    "give_up_twice": ("give_up", lambda v, a: [v.top - 1, v.top - 2, v.top - 1]),
    "give_up_below_floor": ("give_up", lambda v, a: [v.floor - 1, v.top - 1]),
    "give_up_lent": ("give_up", lambda v, a: [v.top - 1, v.top]),
    "give_up_unbacked": ("give_up", lambda v, a: [_first_unbacked(v)]),
    "give_up_short": ("give_up", lambda v, a: [v.top - 2]),
    "give_up_floats": ("give_up", lambda v, a: [7.0]),
    "give_up_none": ("give_up", lambda v, a: None),
    "give_up_raises": ("give_up", lambda v, a: 1 // 0),
    "relocate_from_kept": ("relocate", lambda v, a: [(0, v.top)]),
    # The tests give up slots whose first is empty: a[0][0] holds no expert, a[0][1:] do.
    "relocate_from_empty": ("relocate", lambda v, a: [(int(a[0][0]), v.top)]),
    "relocate_into_given": ("relocate", lambda v, a: [(int(a[0][1]), int(a[0][2]))]),
    "relocate_into_unbacked": ("relocate", lambda v, a: [(int(a[0][1]), _first_unbacked(v))]),
    "relocate_into_missing": ("relocate", lambda v, a: [(int(a[0][1]), -1)]),
    "relocate_src_twice": (
        "relocate", lambda v, a: [(int(a[0][1]), v.top), (int(a[0][1]), v.top + 1)]),
    "relocate_dst_twice": (
        "relocate", lambda v, a: [(int(a[0][1]), v.top), (int(a[0][2]), v.top)]),
    "relocate_triples": ("relocate", lambda v, a: [(int(a[0][1]), v.top, 0)]),
    "refill_not_offered": ("refill", lambda v, a: [(0, 1, 7)]),
    "refill_resident": ("refill", lambda v, a: [(int(a[0][0]), 0, 0)]),
    "refill_missing_expert": ("refill", lambda v, a: [(int(a[0][0]), v.n_layers, 0)]),
    "refill_expert_twice": (
        "refill", lambda v, a: [(int(a[0][0]), 1, 7), (int(a[0][1]), 1, 7)]),
    "refill_slot_twice": ("refill", lambda v, a: [(int(a[0][0]), 1, 6), (int(a[0][0]), 1, 7)]),
    "admit_lent": ("admit", lambda v, a: [(v.top, a[0], int(a[1][0]))]),
    "admit_unbacked": ("admit", lambda v, a: [(_first_unbacked(v), a[0], int(a[1][0]))]),
    "admit_wrong_layer": ("admit", lambda v, a: [(0, a[0] + 1, int(a[1][0]))]),
    "admit_not_missed": ("admit", lambda v, a: [(0, a[0], 5)]),
    "admit_resident": ("admit", lambda v, a: [(1, a[0], 0)]),
    "admit_slot_twice": ("admit", lambda v, a: [(0, a[0], int(a[1][0])), (0, a[0], int(a[1][1]))]),
    "kv_target_short": ("kv_target", lambda v, a: a[0] - 1),
    "kv_target_float": ("kv_target", lambda v, a: float(a[0])),
    "kv_params_not_whole_chunks": ("kv_params", lambda v, a: KvParams(1000, 8192, 0)),
    "kv_params_type": ("kv_params", lambda v, a: (16384, 8192, 128)),
}


@dataclass(frozen=True)
class MisbehavingOptions:
    rule: str = ""


class Misbehaving(Policy):
    """Answers the decision its `rule` option names wrongly (a test plugin)."""

    name = "misbehaving"
    Options = MisbehavingOptions

    def _answer(self, decision, view, *args):
        wanted, answer = RULES[self.options.rule]
        if wanted != decision:
            before = () if view is None else (view,)
            return getattr(Policy, decision)(self, *before, *args)
        return answer(view, args)

    def kv_params(self, ctx):
        return self._answer("kv_params", None, ctx)

    def kv_target(self, need_cells, mapped_cells, params):
        return self._answer("kv_target", None, need_cells, mapped_cells, params)

    def give_up(self, view, n_chunks):
        return self._answer("give_up", view, n_chunks)

    def relocate(self, view, slots):
        return self._answer("relocate", view, slots)

    def refill(self, view, free_slots):
        return self._answer("refill", view, free_slots)

    def admit(self, view, layer, missed_experts):
        return self._answer("admit", view, layer, missed_experts)


@hookimpl
def strata_register_policies(register):
    register(Misbehaving)
