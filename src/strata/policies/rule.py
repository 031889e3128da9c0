"""`RulePolicy`: a policy whose `observe`, `admit` and notifications are a compiled rule.

The rule is a `strata._residency.CacheRule` subclass written in Cython (a `.pyx` in the plugin's
own package that does `from strata._residency cimport CacheRule`): per layer step it is told each
distinct routed expert (`routed`), asked a slot for each distinct missed one (`admit`), and
told every entry and exit of an expert (`entered`, `left`, `moved`). In the engine, and on the
simulator's generic path, `RulePolicy`'s methods call the rule once per layer step; on the
simulator's `kernel` path the step loop calls its cdef methods directly, in C, for a whole span
of steps, so a plugin's rule replays at the built-ins' speed. Every slot it answers is checked
as any admission is (`PolicyError` naming the policy). Its other decisions (give-up, relocate,
refill, the K/V's) are `Policy`'s, and may be overridden in Python as usual.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from strata._residency import CacheRule
from strata.policies.base import Policy
from strata.policies.view import ResidencyView

__all__ = ["CacheRule", "RulePolicy", "compiled_rule"]


class RulePolicy(Policy):
    """A policy whose `observe` and `admit` are `self.rule`, a compiled `CacheRule`.

    Subclasses set `Rule`, the rule's class (made by `make_rule`, once per policy instance:
    a policy is fresh for each replay and each engine, and so is its rule). The rule makes its
    state in its `start`, when it first meets the books.
    """

    Rule: ClassVar[type[CacheRule]] = CacheRule

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self.rule = self.make_rule()

    def make_rule(self) -> CacheRule:
        """The rule for this instance: `Rule()`, its `max_admits` (the most admissions per
        layer step) set from an option of that name if `Options` has one. Override to hand it
        other options (through `cdef public` fields)."""
        rule = self.Rule()
        limit = getattr(self.options, "max_admits", None)
        if limit is not None:
            rule.max_admits = limit
        return rule

    def observe(self, view: ResidencyView, layer: int, expert_ids: np.ndarray,
                hit_mask: np.ndarray) -> None:
        self.rule.observe_step(view, layer, expert_ids)

    def admit(self, view: ResidencyView, layer: int, missed_experts: np.ndarray) -> np.ndarray:
        return self.rule.admit_step(view, layer, missed_experts)

    def entered(self, view: ResidencyView, why: str, placements: np.ndarray) -> None:
        self.rule.notify(view, "entered", why, placements)

    def left(self, view: ResidencyView, why: str, placements: np.ndarray) -> None:
        self.rule.notify(view, "left", why, placements)

    def moved(self, view: ResidencyView, why: str, moves: np.ndarray) -> None:
        self.rule.notify(view, "moved", why, moves)


def compiled_rule(policy: Policy) -> CacheRule | None:
    """The compiled rule that answers `policy`'s `observe` and `admit` exactly, or None: a
    `RulePolicy` whose class keeps `RulePolicy`'s `observe` and `admit` (a subclass that
    overrides either in Python has changed the rule, and runs as any Python policy)."""
    cls = type(policy)
    if not isinstance(policy, RulePolicy) or cls.observe is not RulePolicy.observe \
            or cls.admit is not RulePolicy.admit:
        return None
    rule = getattr(policy, "rule", None)
    return rule if isinstance(rule, CacheRule) else None
