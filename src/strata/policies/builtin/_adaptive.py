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
        position = view.heat_position()
        missed = np.asarray(missed_experts, dtype=np.int64)
        missed = missed[np.lexsort((position[layer, missed], -scores[layer, missed]))][:limit]
        candidates = np.flatnonzero(view.backed[: view.top])
        slot_score = self.slot_scores(view)[candidates]
        owner = view.owner[candidates]
        slot_heat = np.where(owner >= 0, position.ravel()[np.maximum(owner, 0)], position.size)
        coldest_first = np.lexsort((-slot_heat, slot_score))
        victims, victim_score = candidates[coldest_first], slot_score[coldest_first]
        placements = []
        for expert, slot, score in zip(missed, victims, victim_score, strict=False):
            if not self.worth_admitting(float(scores[layer, expert]), float(score)):
                break
            placements.append((int(slot), layer, int(expert)))
        return placements
