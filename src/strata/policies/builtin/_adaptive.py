"""The shared shape of the adaptive built-ins (`lru`, `lfu`, `sieve`): a score per expert.

A subclass keeps its own state from `observe` and says how much each expert is worth keeping
(`expert_scores`, higher = keep). From that one notion of coldest it answers: give up the
coldest chunks, move given-up experts hotter than the coldest kept ones into their slots, and
admit this step's misses into the coldest slots below `top` when `worth_admitting` says so.
Ties break by the books' heat order. Not a plugin itself.
"""

from __future__ import annotations

import numpy as np

from strata.policies import choose
from strata.policies.base import Policy
from strata.policies.view import ResidencyView


class ScoredCache(Policy):
    """Base of the adaptive caches; subclasses define `expert_scores` and `observe`."""

    def expert_scores(self, view: ResidencyView) -> np.ndarray:
        """float64 [L, E]: how much each expert is worth keeping, higher = keep."""
        raise NotImplementedError

    def worth_admitting(self, expert_score: float, victim_score: float) -> bool:
        """Whether a missed expert scoring `expert_score` should replace a resident scoring
        `victim_score` (-inf for an empty slot). Default: always."""
        return True

    def slot_scores(self, view: ResidencyView) -> np.ndarray:
        """float64 [S]: the score of each slot's resident, -inf for an empty slot."""
        owner = view.owner
        scores = self.expert_scores(view).ravel()
        return np.where(owner >= 0, scores[np.maximum(owner, 0)], -np.inf)

    def give_up(self, view, n_chunks):
        return choose.give_up_by_score(view, n_chunks, self.slot_scores(view))

    def relocate(self, view, slots):
        kept = view.backed.copy()
        kept[np.asarray(slots, dtype=np.int64)] = False
        return choose.relocate_by_score(view, slots, self.slot_scores(view), np.flatnonzero(kept))

    def admit(self, view, layer, missed_experts):
        limit = self.options.max_admits
        if limit == 0 or len(missed_experts) == 0:
            return []
        scores = self.expert_scores(view)
        heat, rank = view.heat[layer], view.rank[layer]
        missed = np.asarray(missed_experts, dtype=np.int64)
        # Most worth keeping first: score, then the books' order (heat, then profile rank).
        missed = missed[np.lexsort((rank[missed], -heat[missed], -scores[layer, missed]))][:limit]
        candidates = np.flatnonzero(view.backed[: view.top])
        owner = view.owner[candidates]
        flat = np.maximum(owner, 0)
        slot_score = np.where(owner >= 0, scores.ravel()[flat], -np.inf)
        if candidates.size > missed.size:
            # Only the lowest scores can be victims: sort just those (and their ties).
            kth = np.partition(slot_score, missed.size - 1)[missed.size - 1]
            pool = np.flatnonzero(slot_score <= kth)
            candidates, owner, flat, slot_score = (
                candidates[pool], owner[pool], flat[pool], slot_score[pool])
        slot_heat = np.where(owner >= 0, view.heat.ravel()[flat], -1.0)
        slot_rank = np.where(owner >= 0, view.rank.ravel()[flat], np.iinfo(np.int32).max)
        # Coldest first: score, then the books' order (heat, then profile rank), empty first.
        coldest_first = np.lexsort((-slot_rank, slot_heat, slot_score))[: missed.size]
        victims, victim_score = candidates[coldest_first], slot_score[coldest_first]
        placements = []
        for expert, slot, score in zip(missed, victims, victim_score, strict=False):
            if not self.worth_admitting(float(scores[layer, expert]), float(score)):
                break
            placements.append((int(slot), layer, int(expert)))
        return placements
