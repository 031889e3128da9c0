"""Sweeps: several policies at several cache sizes over one trace, with the bounds beside.

What `strata simulate` computes, without its command line: for each cache size, each policy
replayed through `replay` (a fresh instance each time, built by the registry), then the bounds
asked for (Belady's MIN with bypass over all layers or per layer, the oracle static set), in
that order. Benchmarks and tests call `sweep` directly; the command line only reads its options
into these arguments and prints the results.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from strata.formats.trace import Trace
from strata.policies.registry import PolicyRegistry, load_registry
from strata.sim.belady import access_sequence, belady, oracle_static
from strata.sim.kv_sim import KvConfig
from strata.sim.replay import ReplayConfig, policy_label, replay
from strata.sim.result import ReplayResult

__all__ = ["BOUNDS", "DEFAULT_BOUNDS", "PolicySpec", "sweep", "sweep_steps"]

BOUNDS = ("belady", "belady-per-layer", "oracle-static")
DEFAULT_BOUNDS = ("belady", "oracle-static")

# A policy to replay: its registered name and its options (`key=value` strings or a dict).
PolicySpec = tuple[str, Sequence[str] | Mapping[str, Any]]


def sweep_steps(trace: Trace, n_policies: int, n_sizes: int) -> int:
    """The steps a sweep replays (its progress total): every policy at every size."""
    return trace.n_steps * n_policies * n_sizes


def _check(slots: Sequence[int], loan_slots: int, bounds: Sequence[str]) -> None:
    if loan_slots < 0:
        raise ValueError(f"loan_slots must be >= 0, got {loan_slots}")
    for size in slots:
        if loan_slots > size:
            raise ValueError(f"loan_slots {loan_slots} exceeds a cache of {size} slots")
    unknown = [name for name in bounds if name not in BOUNDS]
    if unknown:
        raise ValueError(f"unknown bound {unknown[0]!r}; known: {', '.join(BOUNDS)}")


def sweep(
    trace: Trace,
    policies: Sequence[PolicySpec],
    slots: Sequence[int],
    *,
    registry: PolicyRegistry | None = None,
    loan_slots: int = 0,
    kv: KvConfig | None = None,
    profile: np.ndarray | None = None,
    path: str = "auto",
    bounds: Sequence[str] = DEFAULT_BOUNDS,
    on_step: Callable[[int], None] | None = None,
    on_replay: Callable[[str, int], None] | None = None,
) -> list[ReplayResult]:
    """Replay each of `policies` at each of `slots` cache sizes, then the `bounds` at that size.

    `profile` fills the cache at start (counts [L, E]; None: empty); `loan_slots` is the loan
    region at the top of each cache; `kv` simulates the elastic K/V; `path` is `ReplayConfig`'s.
    `on_step(n)` is called as steps are replayed, `on_replay(label, slots)` before each policy's
    replay (for a progress bar). The results come in order: per size, the policies, then the
    bounds.

    Raises:
        ValueError: a bad figure (`loan_slots` below 0 or above a size, an unknown bound), or
            one the replay refuses (a budget too small for the K/V).
        UnknownPolicyError, OptionError: a policy or option the registry does not know.
        PolicyError: a policy answered a decision wrongly (named in the message).
    """
    _check(slots, loan_slots, bounds)
    registry = registry or load_registry()
    seq = access_sequence(trace) if bounds else None
    results: list[ReplayResult] = []
    for size in slots:
        config = ReplayConfig(slots=size, loan_slots=loan_slots, kv=kv, path=path)
        for name, options in policies:
            policy = registry.create(name, options)
            if on_replay is not None:
                on_replay(policy_label(policy)[0], size)
            results.append(replay(trace, policy, config, profile, on_step))
        for bound in bounds:
            if bound == "oracle-static":
                results.append(oracle_static(trace, size, seq=seq))
            else:
                scope = "global" if bound == "belady" else "per-layer"
                results.append(belady(trace, size, scope=scope, seq=seq))
    return results
