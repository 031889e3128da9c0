"""`Policy`: the decisions a policy answers, each with the `coldest-in-loan` default, and the
notifications it may listen to.

A policy overrides only what it changes. It reads the books through a read-only
`ResidencyView` and returns decisions; the engine (or the simulator) checks each answer with
`strata.books.validate` and only then acts on it. Slots are ints in [0, n_slots); experts are
(layer, expert) pairs.

The rules of a layer step (engine and simulator alike): the routed experts are looked up
(hits and misses) and recorded into the books' heat; `observe` is told the routing; `admit` is
asked about the step's distinct missed experts, and its answer is checked and applied before
the next layer step. An admission may name any backed slot below `top` (empty or not): its
resident is evicted, even one hit in this very step, whose compute has been issued from its
slot already (on the device, the upload of the new blob is ordered after it). It may not name a
slot twice, a slot in the loan region [top, n_slots) or one whose memory went to the K/V.
Between steps, and only there, the K/V's give-ups (slots in [floor, top)), relocations, trims
and the loan's lending and refill change the cache; each change is told to the policy by the
notifications `entered`, `left` and `moved`, in the order the books make them.
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


@dataclasses.dataclass(frozen=True)
class LruState:
    """The `lru` kernel's state: recency by `observe` calls. The rule is the built-in `lru`'s.

    `observe` stamps the experts routed at its layer with `clock`, then advances it by one.
    `admit` takes up to `max_admits` of the missed experts, latest stamp first (then the books'
    heat order), into the backed slots below `top`: empty ones first, then those of the
    residents stamped longest ago (then the coldest by heat, then by profile rank).

    Attributes:
        last_use: int64 [L, E], the clock at each expert's last routing, -1 never.
        clock: the `observe` calls so far.
        max_admits: the most misses admitted per layer per step.
    """

    last_use: np.ndarray
    clock: int
    max_admits: int


@dataclasses.dataclass(frozen=True)
class LfuState:
    """The `lfu` kernel's state: decayed routing counts. The rule is the built-in `lfu`'s.

    `observe` multiplies its layer's counts by `decay`, then adds one per routed token. `admit`
    pairs the missed experts, highest count first, with the victims `lru` would take ranked
    by count, and admits each pair while the miss's count is above its victim's (an empty
    slot's is -inf), up to `max_admits`.

    Attributes:
        counts: float64 [L, E], the decayed routing counts.
        decay: in (0, 1], each layer's counts are multiplied by it at its step.
        max_admits: the most misses admitted per layer per step.
    """

    counts: np.ndarray
    decay: float
    max_admits: int


@dataclasses.dataclass(frozen=True)
class SieveState:
    """The `sieve` kernel's state: SIEVE's queue, visited marks and hand. The rule is the
    built-in `sieve`'s.

    `observe` marks the hit experts visited. `admit` takes up to `max_admits` missed experts
    (hottest by the books' heat first) into the empty slots below `top`, then into the slots
    of the residents the hand evicts. The queue is the residents below `top` ordered by key
    `(inserted + 1) * L*E + (L*E - 1 - rank)`, oldest first; the hand walks it from the first
    key >= `hand` (-1: the oldest), clearing the visited marks it passes, and evicts the first
    unvisited. Each admitted expert gets the number `next_insert`, which advances, unvisited.

    Attributes:
        visited: bool [L, E], hit since the hand last passed.
        inserted: int64 [L, E], each expert's admission number, -1 never admitted.
        next_insert: the number the next admitted expert gets.
        hand: the queue key the hand resumes at, -1 the oldest.
        max_admits: the most misses admitted per layer per step.
    """

    visited: np.ndarray
    inserted: np.ndarray
    next_insert: int
    hand: int
    max_admits: int


KernelState = LruState | LfuState | SieveState

# The lifecycle notifications, in the order the docs list them.
NOTIFICATIONS: tuple[str, ...] = ("entered", "left", "moved")

# Why an expert entered or left the cache: the `why` of the notifications.
WHY: tuple[str, ...] = ("fill", "admit", "refill", "trim", "relocate", "give_up", "loan",
                        "rollback")

# The simulator's kernels a policy may declare as its `replay_kernel`, with their states.
REPLAY_KERNELS: dict[str, type] = {"lru": LruState, "lfu": LfuState, "sieve": SieveState}


class Policy:
    """The decisions a policy answers; every one defaults to the `coldest-in-loan` behaviour.

    Subclasses set `name` (how `--policy` picks it) and, if they take options, `Options`: a
    frozen dataclass whose fields all have defaults (int, float, bool or str). The docstring's
    first line is the summary `strata policies` prints. A policy that keeps its own state about
    the books makes it when it first meets them (`strata.policies.StatefulPolicy`) and keeps
    it in step through `observe`, its `admit` answers and the notifications `entered`, `left`
    and `moved` (every other entry and exit of an expert). The view (`ResidencyView`) is the
    books, read-only and live: `n_layers` L, `n_experts` E per layer, `n_slots` S, `top` (the
    loan region's first slot), `floor`, `res` [L, E], `owner` [S] (flat ids), `heat`, `rank`,
    `backed` [S]; see its docstrings for units. A policy whose `observe` and `admit` are a
    compiled rule (`strata.policies.RulePolicy`) replays at the built-ins' speed.

    A class whose `observe` and `admit` follow exactly the rule of one of the simulator's
    kernels (`REPLAY_KERNELS`: `lru`, `lfu`, `sieve`, the rules of the built-ins of those
    names) may declare it: `replay_kernel` names the kernel, `kernel_state` hands the rule's
    state out and `set_kernel_state` takes it back. The simulator then replays spans of steps
    in that kernel (its `kernel` path) and still asks the policy object for every other
    decision, between spans. The declaration holds for the class whose body makes it, not for
    its subclasses, which may change the rule: a subclass declares it again to keep it.
    """

    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    # The simulator kernel that runs this class's `observe` and `admit` exactly; None: none.
    replay_kernel: ClassVar[str | None] = None

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

        `missed_experts` is int32 [M], distinct, ascending. A named slot must be backed, below
        `top` and named once; its resident, if any, is evicted, even one hit in this very step
        (its compute was issued already). The admitted are resident from the next layer step
        on, and `left` and `entered` (`admit`) are told first. Default: nothing (a fixed
        cache).
        """
        return []

    def entered(self, view: ResidencyView, why: str, placements: np.ndarray) -> None:
        """Experts entered the cache: `placements` int32 [n, 3] (slot, layer, expert), read-only.

        `why` is `fill` (the start, from the profile), `admit` (this policy's admissions),
        `refill` (the loan's slots after a prompt), `trim` (slots a K/V trim completed) or
        `rollback` (a failed change undone). Told right after the books changed, before
        anything else is asked, in the books' order; the view shows the books after the change.
        Default: nothing. An exception is a PolicyError naming the policy.
        """

    def left(self, view: ResidencyView, why: str, placements: np.ndarray) -> None:
        """Experts left the cache: `placements` int32 [n, 3] (slot, layer, expert), each the
        slot it was in, read-only.

        `why` is `admit` (evicted to make room for this policy's admissions), `relocate`
        (evicted to make room for a relocated expert), `give_up` (its slot's memory went to
        the K/V), `loan` (its slot was lent to the prompt path) or `rollback`. Told as
        `entered` is. Default: nothing.
        """

    def moved(self, view: ResidencyView, why: str, moves: np.ndarray) -> None:
        """Experts changed slots and stayed resident: `moves` int32 [n, 4] (src_slot,
        dst_slot, layer, expert), read-only; `why` is `relocate` (before a give-up: the
        destinations' residents have `left` just before). Told as `entered` is. Default:
        nothing.
        """

    def kernel_state(self, n_layers: int, n_experts: int) -> KernelState:
        """The state of this policy's `replay_kernel` rule for books of [L, E] experts, as
        that kernel's state class (`REPLAY_KERNELS[replay_kernel]`); made fresh, as `observe`
        would make it, if the policy has none of that shape yet.

        The simulator asks before each span of steps it replays in the kernel and does not
        write into what it is given: it replays on copies and hands the state back with
        `set_kernel_state`. Only a class that declares `replay_kernel` implements it.
        """
        raise NotImplementedError(f"{type(self).__name__} declares no replay_kernel")

    def set_kernel_state(self, state: KernelState) -> None:
        """Take back the state a kernel advanced over a span of steps, as `observe` and
        `admit` would have left it: the policy keeps it (its arrays are the policy's now) and
        answers its next decisions from it."""
        raise NotImplementedError(f"{type(self).__name__} declares no replay_kernel")

    @classmethod
    def overrides(cls) -> tuple[str, ...]:
        """The decisions this class answers itself rather than by the defaults."""
        return tuple(m for m in DECISIONS if getattr(cls, m) is not getattr(Policy, m))

    @classmethod
    def listens(cls) -> tuple[str, ...]:
        """The notifications this class implements (`entered`, `left`, `moved`)."""
        return tuple(m for m in NOTIFICATIONS if getattr(cls, m) is not getattr(Policy, m))
