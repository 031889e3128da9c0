"""A plugin whose policy `faulty` breaks the decision its `rule` option names, the way a buggy or
hostile plugin would: by raising, by answering something that is not an answer, by answering
what the rules forbid, or by reaching for what it was not given. Every other decision is the
default's, so a run reaches the broken one.

The tests install this module as an outside package (tests/support/policy_packages.py) and run
the real command line with `--policy faulty --policy-opt rule=RULE`. Each wrong answer is
written from the arguments the decision is given, so it is wrong in any run: the engine's
(`strata generate`, `strata profile`) and the simulator's.
"""

from dataclasses import dataclass

import numpy as np

from strata.policies import Policy, hookimpl


class _Unreadable:
    """A sequence whose items cannot be read: what a policy's own container type may do."""

    def __len__(self):
        return 1

    def __getitem__(self, index):
        raise RuntimeError("this sequence breaks when read")


def _raise(error):
    raise error


def _forced(ctx, **fields):
    """The default KvParams, with fields set past the dataclass's own checks."""
    params = Policy.kv_params(Policy(), ctx)
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


def _not_offered(view, free_slots):
    offered = set(np.asarray(free_slots).tolist())
    return next(s for s in range(view.n_slots) if s not in offered)


def _resident(view):
    return view.expert_in(int(np.flatnonzero(view.owner >= 0)[0]))


def _not_missed(view, layer, missed):
    return next(e for e in range(view.n_experts) if e not in set(np.asarray(missed).tolist()))


def _write(array):
    array[...] = 0


# rule -> (decision, answer(view, args)): view is the ResidencyView (the KvContext for
# kv_params, None for kv_target), args the decision's other arguments.
RULES = {
    "kv_params_raises": ("kv_params", lambda c, a: _raise(RuntimeError("no figures today"))),
    "kv_params_none": ("kv_params", lambda c, a: None),
    "kv_params_tuple": ("kv_params", lambda c, a: (16384, 8192, 128)),
    "kv_params_floor_negative": ("kv_params", lambda c, a: _forced(c, floor_slots=-1)),
    "kv_params_floor_bool": ("kv_params", lambda c, a: _forced(c, floor_slots=True)),
    "kv_params_floor_above_top": ("kv_params", lambda c, a: _forced(c, floor_slots=c.top + 1)),
    "kv_params_step_zero": ("kv_params", lambda c, a: _forced(c, step_cells=0)),
    "kv_params_step_negative": ("kv_params", lambda c, a: _forced(
        c, step_cells=-c.cells_per_chunk)),
    "kv_params_init_float": ("kv_params", lambda c, a: _forced(
        c, init_cells=float(c.cells_per_chunk))),
    "kv_params_init_text": ("kv_params", lambda c, a: _forced(c, init_cells="32")),
    "kv_params_init_part_chunk": ("kv_params", lambda c, a: _forced(
        c, init_cells=c.cells_per_chunk + 1)),
    "kv_params_init_past_window": ("kv_params", lambda c, a: _forced(
        c, init_cells=c.max_mapped_cells + c.cells_per_chunk)),
    "kv_target_raises": ("kv_target", lambda v, a: _raise(ZeroDivisionError("step of 0"))),
    "kv_target_none": ("kv_target", lambda v, a: None),
    "kv_target_float": ("kv_target", lambda v, a: float(a[0])),
    "kv_target_text": ("kv_target", lambda v, a: str(a[0])),
    "kv_target_bool": ("kv_target", lambda v, a: True),
    "kv_target_short": ("kv_target", lambda v, a: a[0] - 1),
    "kv_target_negative": ("kv_target", lambda v, a: -1),
    "give_up_raises": ("give_up", lambda v, a: _raise(IndexError("no slot 99"))),
    "give_up_none": ("give_up", lambda v, a: None),
    "give_up_missing_slot": ("give_up", lambda v, a: [v.n_slots + 3]),
    "give_up_negative": ("give_up", lambda v, a: [-1]),
    "give_up_lent": ("give_up", lambda v, a: [v.top]),
    "give_up_below_floor": ("give_up", lambda v, a: [v.floor - 1]),
    "give_up_twice": ("give_up", lambda v, a: [v.top - 1, v.top - 1]),
    "give_up_floats": ("give_up", lambda v, a: [float(v.top - 1)]),
    "give_up_text": ("give_up", lambda v, a: ["7"]),
    "give_up_nothing": ("give_up", lambda v, a: []),
    "give_up_shape": ("give_up", lambda v, a: [[v.top - 1]]),
    "give_up_unreadable": ("give_up", lambda v, a: _Unreadable()),
    "give_up_reaches_books": ("give_up", lambda v, a: v._table.evict(0)),
    "give_up_exits": ("give_up", lambda v, a: _raise(SystemExit(0))),
    "relocate_raises": ("relocate", lambda v, a: _raise(KeyError("slot"))),
    "relocate_none": ("relocate", lambda v, a: None),
    "relocate_from_kept": ("relocate", lambda v, a: [(0, v.top)]),
    "relocate_into_given": ("relocate", lambda v, a: [(int(a[0][0]), int(a[0][0]))]),
    "relocate_into_missing": ("relocate", lambda v, a: [(int(a[0][0]), -1)]),
    "relocate_triples": ("relocate", lambda v, a: [(int(a[0][0]), v.top, 0)]),
    "relocate_writes_slots": ("relocate", lambda v, a: _write(a[0])),
    "refill_raises": ("refill", lambda v, a: _raise(MemoryError("refill"))),
    "refill_none": ("refill", lambda v, a: None),
    "refill_not_offered": ("refill", lambda v, a: [(_not_offered(v, a[0]), 0, 0)]),
    "refill_missing_expert": ("refill", lambda v, a: [(int(a[0][0]), v.n_layers, 0)]),
    "refill_resident": ("refill", lambda v, a: [(int(a[0][0]), *_resident(v))]),
    "refill_writes_view": ("refill", lambda v, a: _write(v.owner)),
    "admit_raises": ("admit", lambda v, a: _raise(ValueError("admit"))),
    "admit_none": ("admit", lambda v, a: None),
    "admit_lent": ("admit", lambda v, a: [(v.top, a[0], int(a[1][0]))]),
    "admit_wrong_layer": ("admit", lambda v, a: [(0, a[0] + 1, int(a[1][0]))]),
    "admit_not_missed": ("admit", lambda v, a: [(0, a[0], _not_missed(v, *a))]),
    "admit_floats": ("admit", lambda v, a: [(0.0, float(a[0]), float(a[1][0]))]),
    "observe_raises": ("observe", lambda v, a: _raise(RuntimeError("observe broke"))),
    "observe_raises_key": ("observe", lambda v, a: _raise(KeyError(a[0]))),
    "observe_reaches_books": ("observe", lambda v, a: v._table.evict(0)),
    "observe_writes_routing": ("observe", lambda v, a: _write(a[2])),
    "observe_writes_view": ("observe", lambda v, a: _write(v.backed)),
}


@dataclass(frozen=True)
class FaultyOptions:
    rule: str = ""

    def __post_init__(self) -> None:
        if self.rule and self.rule not in RULES:
            raise ValueError(f"rule must be one of {', '.join(RULES)}")


class Faulty(Policy):
    """Breaks the decision its `rule` option names (a test plugin)."""

    name = "faulty"
    Options = FaultyOptions

    def _answer(self, decision, view, *args):
        wanted, answer = RULES.get(self.options.rule, (None, None))
        if wanted != decision:
            before = () if view is None else (view,)
            return getattr(Policy, decision)(self, *before, *args)
        return answer(view, args)

    def kv_params(self, ctx):
        wanted, answer = RULES.get(self.options.rule, (None, None))
        return answer(ctx, ()) if wanted == "kv_params" else Policy.kv_params(self, ctx)

    def kv_target(self, need_cells, mapped_cells, params):
        return self._answer("kv_target", None, need_cells, mapped_cells, params)

    def give_up(self, view, n_chunks):
        return self._answer("give_up", view, n_chunks)

    def relocate(self, view, slots):
        return self._answer("relocate", view, slots)

    def refill(self, view, free_slots):
        return self._answer("refill", view, free_slots)

    def observe(self, view, layer, expert_ids, hit_mask):
        self._answer("observe", view, layer, expert_ids, hit_mask)

    def admit(self, view, layer, missed_experts):
        return self._answer("admit", view, layer, missed_experts)


@hookimpl
def strata_register_policies(register):
    register(Faulty)
