"""A strata policy plugin: a given-up expert may take the slot of the coldest resident anywhere."""

from dataclasses import dataclass

import numpy as np

from strata.policies import Policy, hookimpl


@dataclass(frozen=True)
class Options:
    max_moves: int = 64  # device-to-device copies allowed per growth


class ColdestAnywhere(Policy):
    """Like coldest-in-loan, but relocations may go into any kept slot, not only the loan."""

    name = "coldest-anywhere"
    Options = Options

    def relocate(self, view, slots):
        place = view.heat_position().ravel()  # each expert's place in the heat order, 0 = hottest
        kept = view.backed & (view.owner >= 0)  # slots holding an expert ...
        kept[slots] = False  # ... that are not being given up
        targets = np.flatnonzero(kept)
        targets = targets[np.argsort(-place[view.owner[targets]])]  # coldest first
        movers = [s for s in slots if view.owner[s] >= 0]
        movers.sort(key=lambda s: place[view.owner[s]])  # hottest first
        moves = []
        for src, dst in zip(movers, targets, strict=False):
            if len(moves) == self.options.max_moves:
                break
            if place[view.owner[src]] > place[view.owner[dst]]:
                break  # the rest of the movers are colder still
            moves.append((int(src), int(dst)))
        return moves


@hookimpl
def strata_register_policies(register):
    register(ColdestAnywhere)
