"""Applying checked decisions to the books, all or nothing.

The engine and the simulator share these: the simulator calls them alone, the engine after it
has done the device side (copies for the moves, unmapping the chunks). Each step is one bulk
table call that checks its arguments before changing anything; if a later step still fails
(the books changed since the plan was checked), the earlier steps are undone, so the books are
as they were and the error propagates.

Given a `listener` (the `CheckedPolicy` whose answer it is), each function tells it of every
entry and exit of an expert once the books have changed, in the books' order (`tell`:
`entered`, `left`, `moved`, each with the reason, `strata.policies.WHY`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from strata._residency import ResidencyTable


class Listener(Protocol):
    """What is told of the books' changes: `strata.books.CheckedPolicy.tell`."""

    def tell(self, kind: str, why: str, rows: Any) -> None: ...


def _with_experts(slots: np.ndarray, experts: np.ndarray) -> np.ndarray:
    """int32 [n, 3] (slot, layer, expert) from slots [n] and (layer, expert) rows [n, 2]."""
    return np.column_stack([slots, experts]).astype(np.int32).reshape(-1, 3)


def _frozen(array: np.ndarray, dtype, shape_tail: tuple[int, ...] = ()) -> np.ndarray:
    out = np.array(array, dtype=dtype).reshape((-1, *shape_tail))
    out.flags.writeable = False
    return out


@dataclass(frozen=True)
class GiveUpPlan:
    """A checked give-up: `slots` int32 [G] ascending hand their `chunks` int32 [C] to the K/V,
    after `moves` int32 [M, 2] (src, dst) carried their hottest experts into kept slots."""

    n_chunks: int
    slots: np.ndarray
    moves: np.ndarray
    chunks: np.ndarray

    def __post_init__(self) -> None:
        object.__setattr__(self, "slots", _frozen(self.slots, np.int32))
        object.__setattr__(self, "moves", _frozen(self.moves, np.int32, (2,)))
        object.__setattr__(self, "chunks", _frozen(self.chunks, np.int32))


def _run(steps: list[tuple[Callable[[], object], Callable[[object], None]]]) -> list[object]:
    """Do each step; if one raises, undo those done, newest first, and re-raise."""
    done: list[tuple[Callable[[object], None], object]] = []
    try:
        for do, undo in steps:
            done.append((undo, do()))
    except BaseException:
        for undo, result in reversed(done):
            undo(result)
        raise
    return [result for _, result in done]


def _evicted_experts(table: ResidencyTable, slots: np.ndarray) -> np.ndarray:
    return np.empty((0, 2), np.int32) if slots.size == 0 else table.evict_many(slots)


def _reassign(table: ResidencyTable, slots: np.ndarray, experts: np.ndarray) -> None:
    if slots.size:
        table.assign_many(slots, experts[:, 0].copy(), experts[:, 1].copy())


def apply_give_up(table: ResidencyTable, plan: GiveUpPlan,
                  listener: Listener | None = None) -> np.ndarray:
    """Evict the destinations' residents, move, evict the rest of the given-up slots, and mark
    the freed chunks unmapped. Returns int32 [n, 2] (layer, expert) of every expert evicted.
    Tells `listener`: `left` (`relocate`) for the destinations' residents, `moved`
    (`relocate`), `left` (`give_up`) for the rest."""
    src = np.ascontiguousarray(plan.moves[:, 0])
    dst = np.ascontiguousarray(plan.moves[:, 1])
    victims = dst[table.owner[dst] >= 0]
    moved = np.zeros(table.n_slots, bool)
    moved[src] = True
    leaving = plan.slots[(table.owner[plan.slots] >= 0) & ~moved[plan.slots]]
    chunks = plan.chunks

    def move() -> None:
        if src.size:
            table.move_many(src, dst)

    def unmove(_: object) -> None:
        if src.size:
            table.move_many(dst, src)

    def unmap() -> None:
        if chunks.size:
            table.mark_chunks(chunks, False)

    def remap(_: object) -> None:
        if chunks.size:
            table.mark_chunks(chunks, True)

    movers = table.owner[src].copy()
    evicted_victims, _, evicted_leaving, _ = _run([
        (lambda: _evicted_experts(table, victims), lambda e: _reassign(table, victims, e)),
        (move, unmove),
        (lambda: _evicted_experts(table, leaving), lambda e: _reassign(table, leaving, e)),
        (unmap, remap),
    ])
    if listener is not None:
        listener.tell("left", "relocate", _with_experts(victims, evicted_victims))
        n_experts = table.n_experts
        listener.tell("moved", "relocate", np.column_stack(
            [src, dst, movers // n_experts, movers % n_experts]).astype(np.int32))
        listener.tell("left", "give_up", _with_experts(leaving, evicted_leaving))
    return np.concatenate([evicted_victims, evicted_leaving]).astype(np.int32)


def apply_refill(table: ResidencyTable, placements: np.ndarray,
                 listener: Listener | None = None, why: str = "refill") -> None:
    """Assign checked (slot, layer, expert) rows [n, 3] into empty slots: one table call.
    Tells `listener` `entered` with `why` (`refill`, `trim`, `fill`)."""
    placements = np.asarray(placements, dtype=np.int32).reshape(-1, 3)
    if placements.size:
        table.assign_many(placements[:, 0].copy(), placements[:, 1].copy(),
                          placements[:, 2].copy())
        if listener is not None:
            listener.tell("entered", why, placements)


def apply_admit(table: ResidencyTable, placements: np.ndarray,
                listener: Listener | None = None) -> np.ndarray:
    """Evict the residents of the checked admissions' slots, then assign the admitted experts.
    Returns int32 [n, 2] (layer, expert) of the evicted. Tells `listener` `left` then
    `entered`, both `admit`."""
    placements = np.asarray(placements, dtype=np.int32).reshape(-1, 3)
    slots = placements[:, 0].copy()
    occupied = slots[table.owner[slots] >= 0]
    evicted, _ = _run([
        (lambda: _evicted_experts(table, occupied), lambda e: _reassign(table, occupied, e)),
        (lambda: apply_refill(table, placements), lambda _: None),
    ])
    if listener is not None:
        listener.tell("left", "admit", _with_experts(occupied, evicted))
        listener.tell("entered", "admit", placements)
    return evicted
