"""`Policy`: the decisions a policy answers, each with the `coldest-in-loan` default.

A policy overrides only what it changes. It reads the books through a read-only
`ResidencyView` and returns decisions; the engine (or the simulator) checks each answer with
`strata.books.validate` and only then acts on it. Slots are ints in [0, n_slots); experts are
(layer, expert) pairs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from strata.policies import choose
from strata.policies.kv_params import KvContext, KvParams, default_kv_params, default_kv_target
from strata.policies.options import parse_options
from strata.policies.view import ResidencyView

# The decisions, in the order the docs and `strata policies` list them.
DECISIONS: tuple[str, ...] = (
    "kv_params",
    "kv_target",
    "give_up",
    "relocate",
    "refill",
    "observe",
    "admit",
)


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """The options of a policy that takes none."""


class Policy:
    """The decisions a policy answers; every one defaults to the `coldest-in-loan` behaviour.

    Subclasses set `name` (how `--policy` picks it) and, if they take options, `Options`: a
    frozen dataclass whose fields all have defaults (int, float, bool or str). The docstring's
    first line is the summary `strata policies` prints.
    """

    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions

    def __init__(self, options: Any = None) -> None:
        """`options`: an `Options` instance, or a dict / `key=value` strings to parse into one
        (OptionError naming the policy for a bad key or value); None for the defaults."""
        if not isinstance(options, self.Options):
            if options is not None and not isinstance(options, Mapping | list | tuple):
                raise TypeError(
                    f"{type(self).__name__} takes a {self.Options.__name__}, a dict or "
                    f"key=value strings, got {type(options).__name__}"
                )
            options = parse_options(self.name or type(self).__name__, self.Options, options)
        self.options = options

    def kv_params(self, ctx: KvContext) -> KvParams:
        """Cells mapped at start, the growth step and the floor, once at engine start.

        Default: 16384 cells, steps of 8192, the engine's floor; `STRATA_KV_GROW_INIT`,
        `_STEP` and `_FLOOR` override each; cells round up to whole chunks of the K/V.
        """
        return default_kv_params(ctx)

    def kv_target(self, need_cells: int, mapped_cells: int, params: KvParams) -> int:
        """How many cells to have mapped, given the cells the next step needs.

        More than `mapped_cells` grows, fewer trims, equal leaves the K/V as it is; the answer
        must cover `need_cells`, and the engine caps it at the window. Default: grow by whole
        steps; trim to the step grid once `mapped >= need + 2 * step`.
        """
        return default_kv_target(need_cells, mapped_cells, params)

    def give_up(self, view: ResidencyView, n_chunks: int) -> Sequence[int]:
        """Which slots hand their chunks to the K/V so that at least `n_chunks` are freed.

        Only backed slots in [floor, top) may go; a chunk shared with a slot that stays is not
        freed. Default: the backed slots just below `top`, downward.
        """
        return choose.give_up_below_top(view, n_chunks)

    def relocate(self, view: ResidencyView, slots: np.ndarray) -> Sequence[tuple[int, int]]:
        """(src_slot, dst_slot) moves of experts in the given-up `slots` before they go.

        A destination is a backed slot that is not given up; its resident, if any, is evicted.
        Default: a given-up expert hotter than the coldest resident of the loan region takes
        that resident's slot, hottest first.
        """
        return choose.relocate_into_loan(view, slots)

    def refill(
        self, view: ResidencyView, free_slots: np.ndarray
    ) -> Sequence[tuple[int, int, int]]:
        """(slot, layer, expert) to load into the empty `free_slots` after a trim or a loan.

        Default: the hottest missing experts (heat, then profile rank), into the slots in
        ascending order.
        """
        return choose.refill_hottest(view, free_slots)

    def observe(
        self, view: ResidencyView, layer: int, expert_ids: np.ndarray, hit_mask: np.ndarray
    ) -> None:
        """Routing seen at one layer in one step: ids int [T, K], hit_mask bool [T, K].

        Called once per layer per step on the hot path, after the engine has recorded the
        routing into the books' heat: keep it vectorised and cheap. For a policy's own state
        (recency, counts); the default keeps none.
        """

    def admit(
        self, view: ResidencyView, layer: int, missed_experts: np.ndarray
    ) -> Sequence[tuple[int, int, int]]:
        """(slot, layer, expert): which of this step's missed experts of `layer` enter the cache.

        `missed_experts` is int32 [M], distinct, ascending. A named slot must be backed and
        below `top`; its resident, if any, is evicted. Default: nothing (a fixed cache).
        """
        return []

    @classmethod
    def overrides(cls) -> tuple[str, ...]:
        """The decisions this class answers itself rather than by the defaults."""
        return tuple(m for m in DECISIONS if getattr(cls, m) is not getattr(Policy, m))
