"""Building blocks for policies: the give-up, relocation and refill choices, reusable alone.

`Policy`'s defaults (the `coldest-in-loan` behaviour) are made of these, and so are the adaptive
built-ins; an outside policy may call them too. Each returns plain numpy arrays or lists and
changes nothing.
"""

from __future__ import annotations

import numpy as np

from strata.policies.view import ResidencyView


def _smallest_prefix(view: ResidencyView, ordered: np.ndarray, n_chunks: int, grow) -> np.ndarray:
    """The fewest leading `ordered` items whose slots (`grow(prefix)`) free `n_chunks`.

    Freed chunks only grow as slots are added, so a binary search over the prefix length finds
    the shortest one. Returns every item's slots when even all of them fall short: the checker
    then names the shortfall.
    """
    lo, hi = 0, len(ordered)
    if view.chunks_freed_by(grow(ordered)).size < n_chunks:
        return grow(ordered)
    while lo < hi:
        mid = (lo + hi) // 2
        if view.chunks_freed_by(grow(ordered[:mid])).size >= n_chunks:
            hi = mid
        else:
            lo = mid + 1
    return grow(ordered[:lo])


def give_up_below_top(view: ResidencyView, n_chunks: int) -> np.ndarray:
    """int32 slots: the backed slots just below `top`, downward, that free `n_chunks`."""
    downward = view.givable_slots()[::-1].copy()
    if n_chunks <= 0:
        return downward[:0]
    return np.sort(_smallest_prefix(view, downward, n_chunks, lambda prefix: prefix))


def _backed_pairs(view: ResidencyView) -> tuple[np.ndarray, np.ndarray]:
    """int64 [P] twice: every (chunk, backed slot touching it) pair, by chunk then slot."""
    c_lo, c_hi = view.chunk_slot_bounds()
    counts = c_hi - c_lo
    pair_chunk = np.repeat(np.arange(view.n_chunks), counts)
    first_pair = np.repeat(np.cumsum(counts) - counts, counts)
    pair_slot = np.repeat(c_lo, counts) + np.arange(pair_chunk.size) - first_pair
    live = view.backed[pair_slot]
    return pair_chunk[live], pair_slot[live]


def give_up_by_score(view: ResidencyView, n_chunks: int, slot_score: np.ndarray) -> np.ndarray:
    """int32 slots freeing `n_chunks`, chosen chunk by chunk, coldest chunk first.

    `slot_score` float [S]: higher is worth keeping more. A chunk costs the highest score among
    the backed slots touching it, and can be taken only when all of those are givable (in
    [floor, top)). Ties go to the chunk nearer `top`, as the default does.
    """
    givable = np.zeros(view.n_slots, bool)
    givable[view.givable_slots()] = True
    pair_chunk, pair_slot = _backed_pairs(view)
    cost = np.full(view.n_chunks, -np.inf)
    np.maximum.at(cost, pair_chunk, slot_score[pair_slot])
    blocked = np.zeros(view.n_chunks, bool)
    blocked[pair_chunk[~givable[pair_slot]]] = True
    touched = np.zeros(view.n_chunks, bool)
    touched[pair_chunk] = True
    candidates = np.flatnonzero(view.chunk_mapped & touched & ~blocked)
    ordered = candidates[np.lexsort((-candidates, cost[candidates]))]  # coldest, then highest

    def slots_of(chunks: np.ndarray) -> np.ndarray:
        mask = np.zeros(view.n_slots, bool)
        mask[pair_slot[np.isin(pair_chunk, chunks)]] = True
        return np.flatnonzero(mask).astype(np.int32)

    if n_chunks <= 0:
        return slots_of(ordered[:0])
    return _smallest_prefix(view, ordered, n_chunks, slots_of)


def relocate_by_score(
    view: ResidencyView, slots: np.ndarray, slot_score: np.ndarray, destinations: np.ndarray
) -> list[tuple[int, int]]:
    """Moves (src, dst): the hottest given-up experts into the coldest `destinations`.

    `slot_score` float [S], higher is hotter (an empty slot should score -inf: filling it costs
    no one); ties break by the books' heat order. The hottest given-up expert is paired with the
    coldest destination, and so on, while the expert is the hotter of the two.
    """
    position = view.heat_position().ravel()
    owner = view.owner
    # One total order over slots, hottest first: score, then the books' heat order.
    slot_heat = np.where(owner >= 0, position[np.maximum(owner, 0)], position.size)
    order = np.lexsort((slot_heat, -slot_score))
    place = np.empty(view.n_slots, np.int64)
    place[order] = np.arange(view.n_slots)
    slots = np.asarray(slots, dtype=np.int64)
    movers = slots[owner[slots] >= 0]
    movers = movers[np.argsort(place[movers], kind="stable")]  # hottest first
    destinations = np.asarray(destinations, dtype=np.int64)
    targets = destinations[np.argsort(-place[destinations], kind="stable")]  # coldest first
    moves = []
    for src, dst in zip(movers, targets, strict=False):
        if place[src] >= place[dst]:
            break
        moves.append((int(src), int(dst)))
    return moves


def relocate_into_loan(view: ResidencyView, slots: np.ndarray) -> list[tuple[int, int]]:
    """The reference rule: a given-up expert hotter than the coldest loan resident takes its
    slot (that resident is evicted)."""
    position = view.heat_position().ravel()
    owner = view.owner
    score = np.where(owner >= 0, -position[np.maximum(owner, 0)].astype(np.float64), -np.inf)
    loan = np.arange(view.top, view.n_slots)
    return relocate_by_score(view, slots, score, loan[owner[loan] >= 0])


def refill_hottest(view: ResidencyView, free_slots: np.ndarray) -> list[tuple[int, int, int]]:
    """(slot, layer, expert): the hottest missing experts into `free_slots`, ascending."""
    slots = np.sort(np.asarray(free_slots, dtype=np.int64))
    missing = view.hottest_missing(int(slots.size))
    return [(int(s), int(layer), int(e)) for s, (layer, e) in zip(slots, missing, strict=False)]
