"""`CheckedPolicy`: how the engine and the simulator ask a policy, so that no answer goes unchecked.

Each method asks the policy, turns an exception it raises into `PolicyError`, and runs the
answer through `strata.books.validate`. The caller's own arguments are checked first: a bad
one is the caller's bug (ValueError), not the policy's. A policy is handed its array arguments
as `frozen` views (read-only for good), and the checker judges its answer against the arrays it
kept. `observe` is the hot path: one call of the policy's own method inside a try, and the
policy's default (which keeps no state) is called bare.

A `CheckedPolicy` is also how the books tell the policy of their changes (`tell`: the
notifications `entered`, `left`, `moved`), and what the simulator's C step loop asks through
(`fault`, `admit_slow`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from strata._residency import admit_answer, frozen
from strata.books import validate
from strata.books.apply import GiveUpPlan
from strata.policies.base import Policy
from strata.policies.errors import PolicyError
from strata.policies.kv_params import KvContext, KvParams
from strata.policies.view import ResidencyView

if TYPE_CHECKING:
    from strata._residency import ResidencyTable


def _readonly_int32(values: Any) -> np.ndarray:
    array = np.array(values, dtype=np.int32).reshape(-1)
    array.flags.writeable = False
    return array


# What a policy may raise that is its own fault: any error, and an exit it asked for itself
# (a plugin's sys.exit() must not end the run as if it had succeeded). KeyboardInterrupt is the
# user's, and propagates.
POLICY_FAULTS = (Exception, SystemExit)


def _raised(name: str, method: str, exc: BaseException) -> PolicyError:
    return PolicyError(name, method, exc, f"raised {type(exc).__name__}: {exc}")


def _checked_observe(policy: Policy, name: str) -> Callable[..., None]:
    """The policy's `observe` as the engine and the simulator call it, once per layer per step:
    an exception from it becomes a PolicyError naming the policy (a try costs nothing until it
    raises), and it reads the routing through frozen views, since the caller goes on using the
    arrays. The default `observe` does nothing and cannot raise, so it is returned bare."""
    observe = policy.observe
    if type(policy).observe is Policy.observe:
        return observe

    def checked_observe(view: ResidencyView, layer: int, expert_ids: Any, hit_mask: Any) -> None:
        try:
            observe(view, layer, frozen(expert_ids), frozen(hit_mask))
        except PolicyError:
            raise
        except POLICY_FAULTS as exc:
            raise _raised(name, "observe", exc) from exc

    return checked_observe


class CheckedPolicy:
    """A policy bound to the books it decides about, every answer checked."""

    def __init__(self, policy: Policy, table: ResidencyTable, name: str | None = None) -> None:
        self.policy = policy
        self.name = name or policy.name or type(policy).__name__
        self.table = table
        self.view = ResidencyView(table)
        # The engine calls this per layer per step, directly.
        self.observe = _checked_observe(policy, self.name)
        # Whether `admit` can say anything but "nothing": if not, the engine need not ask.
        answering = type(getattr(policy, "inner", policy))
        self.admits = "admit" in answering.overrides()
        self.observes = "observe" in answering.overrides()
        # The notifications the policy implements: the others are not called at all.
        self.listening: tuple[str, ...] = answering.listens()

    def fault(self, method: str, exc: BaseException) -> BaseException:
        """The error to raise for `exc`, raised by the policy in `method`: a PolicyError
        naming the policy (`exc` itself if it is one)."""
        return exc if isinstance(exc, PolicyError) else _raised(self.name, method, exc)

    def tell(self, kind: str, why: str, rows: Any) -> None:
        """Tell the policy of a change of the books, after it was made: `kind` is `entered`
        or `left` with rows (slot, layer, expert), or `moved` with rows (src_slot, dst_slot,
        layer, expert); `why` one of `strata.policies.WHY`. Nothing for no rows, or for a
        policy that does not implement `kind`. PolicyError for what the policy raises."""
        if kind not in self.listening or len(rows) == 0:
            return
        array = frozen(np.array(rows, dtype=np.int32).reshape(len(rows), -1))
        self._ask(kind, lambda: getattr(self.policy, kind)(self.view, why, array))

    def admit_slow(self, layer: int, missed: np.ndarray, answer: Any) -> np.ndarray:
        """The Python checker's verdict on an `admit` answer the fast check could not pass:
        int64 [n, 3] C-contiguous, or PolicyError naming what is wrong."""
        return np.ascontiguousarray(
            validate.check_admit(self.view, self.name, layer, missed, answer))

    def _ask(self, method: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except PolicyError:
            raise
        except POLICY_FAULTS as exc:
            raise _raised(self.name, method, exc) from exc

    def kv_params(self, ctx: KvContext) -> KvParams:
        answer = self._ask("kv_params", lambda: self.policy.kv_params(ctx))
        return validate.check_kv_params(ctx, self.name, answer)

    def kv_target(
        self, need_cells: int, mapped_cells: int, params: KvParams, max_cells: int
    ) -> int:
        """The cells to have mapped, capped at `max_cells` (the window in whole chunks)."""
        if not 0 <= need_cells <= max_cells:
            raise ValueError(f"need_cells {need_cells} is outside [0, {max_cells}] (the window)")
        answer = self._ask(
            "kv_target", lambda: self.policy.kv_target(need_cells, mapped_cells, params)
        )
        return min(validate.check_kv_target(self.name, need_cells, answer), max_cells)

    def view_with_top(self, top: int | None) -> ResidencyView:
        """The view, or (`top` given) one whose loan region starts at `top`."""
        return self.view if top is None else ResidencyView(self.table, top=top)

    def give_up(self, n_chunks: int, *, top: int | None = None) -> GiveUpPlan:
        """Ask `give_up` for `n_chunks`, then `relocate` for the slots chosen; check both.

        `top`: the loan region's first slot as the decision sees it (default: the books');
        both answers are asked and checked on a view with that region."""
        view = self.view_with_top(top)
        givable = view.givable_chunks()
        if not 1 <= n_chunks <= givable:
            raise ValueError(
                f"n_chunks {n_chunks} is outside [1, {givable}]: the cache can give {givable} "
                f"chunks above the floor {view.floor} and below top {view.top}"
            )
        answer = self._ask("give_up", lambda: self.policy.give_up(view, n_chunks))
        slots, chunks = validate.check_give_up(view, self.name, n_chunks, answer)
        slots = _readonly_int32(slots)
        answer = self._ask("relocate", lambda: self.policy.relocate(view, frozen(slots)))
        moves = validate.check_relocate(view, self.name, slots, answer)
        return GiveUpPlan(n_chunks=n_chunks, slots=slots, moves=moves, chunks=chunks)

    def refill(self, free_slots: Any) -> np.ndarray:
        """Checked (slot, layer, expert) rows int64 [n, 3] for the empty backed `free_slots`."""
        free = _readonly_int32(free_slots)
        if free.size:
            bad = (free < 0) | (free >= self.view.n_slots)
            if not bad.any():
                bad = ~self.view.backed[free] | (self.view.owner[free] >= 0)
            if bad.any() or np.unique(free).size != free.size:
                raise ValueError(
                    f"free_slots {free.tolist()} must be distinct, backed, empty slots"
                )
        answer = self._ask("refill", lambda: self.policy.refill(self.view, frozen(free)))
        return validate.check_refill(self.view, self.name, free, answer)

    def admit(self, layer: int, missed_experts: Any) -> np.ndarray:
        """Checked (slot, layer, expert) rows int64 [n, 3] admitting some of `missed_experts`."""
        if not 0 <= layer < self.view.n_layers:
            raise ValueError(f"layer {layer} is outside [0, {self.view.n_layers})")
        missed = _readonly_int32(missed_experts)
        if missed.size:
            if ((missed < 0) | (missed >= self.view.n_experts)).any():
                raise ValueError(f"missed_experts {missed.tolist()} names an expert out of range")
            if (np.diff(missed) <= 0).any() or (self.view.res[layer, missed] >= 0).any():
                raise ValueError(
                    f"missed_experts {missed.tolist()} must be ascending, distinct, non-resident"
                )
        answer = self._ask("admit", lambda: self.policy.admit(self.view, layer, frozen(missed)))
        # The fast check only ever accepts; what it cannot pass, the Python checker judges.
        fast = admit_answer(self.view, layer, missed, answer)
        return fast if fast is not None else validate.check_admit(
            self.view, self.name, layer, missed, answer)
