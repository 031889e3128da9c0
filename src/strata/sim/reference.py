"""The engine's sequence in plain Python: the reference every replay path is held to.

`ReferenceReplay` is a `Replay` whose every span is played step by step, layer by layer, with
the same calls the engine makes (`lookup`, `record`, the checked `observe` and `admit`,
`apply_admit` telling the policy), whatever the policy: no C step loop, no kernel, no batching.
It is slow (tens of thousands of accesses a second) and exists for the tests, which prove the
`generic` (C step loop), `kernel` (built-in kernels and compiled rules) and `batched` paths
equal to it, count for count and decision for decision.
"""

from __future__ import annotations

import numpy as np

from strata.books import apply_admit
from strata.formats.trace import Trace
from strata.policies import Policy
from strata.sim.replay import Replay, ReplayConfig
from strata.sim.result import ReplayResult

__all__ = ["ReferenceReplay", "reference_replay"]


class ReferenceReplay(Replay):
    """A replay on the reference sequence (its result's path reads `generic`)."""

    def __init__(self, trace: Trace, policy: Policy, config: ReplayConfig,
                 profile: np.ndarray | None = None) -> None:
        super().__init__(trace, policy, config, profile)
        self.path = self.result.path = "generic"

    def run_span(self, s0: int, s1: int) -> None:
        for s in range(s0, s1):
            self.step(s)

    def step(self, s: int) -> None:
        """Step `s`, layer by layer, as the engine runs it."""
        t0, t1 = self.trace.step_offsets[s], self.trace.step_offsets[s + 1]
        table, checked, steps = self.table, self.checked, self.result.steps
        n_layers = self.trace.n_layers
        for layer in range(n_layers):
            ids = self.ids_by_layer[layer, t0:t1]  # [T, K]
            _, hit = table.lookup(layer, ids)
            table.record(layer, ids)
            checked.observe(checked.view, layer, ids, hit)
            steps.hits[s, layer] = np.count_nonzero(hit)
            steps.distinct_hits[s, layer] = np.unique(ids[hit]).size
            missed = np.unique(ids[~hit])
            steps.distinct_misses[s, layer] = missed.size
            if missed.size:
                placements = checked.admit(layer, missed)
                if placements.size:
                    evicted = apply_admit(table, placements, checked)
                    self.result.layer_admissions[layer] += placements.shape[0]
                    self.result.layer_evictions += np.bincount(evicted[:, 0],
                                                               minlength=n_layers)
                    steps.uploads[s] += placements.shape[0]


def reference_replay(trace: Trace, policy: Policy, config: ReplayConfig,
                     profile: np.ndarray | None = None) -> ReplayResult:
    """`replay` on the reference sequence."""
    return ReferenceReplay(trace, policy, config, profile).run()
