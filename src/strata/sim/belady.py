"""The upper bounds shown beside every policy: Belady's MIN with bypass, and the oracle static set.

Legend: A accesses, L layers, E experts per layer, S steps; a block is one layer of one step.

The accesses are taken in replay order (step, then layer, then token, then k) and, as in the
engine, a block's lookups all come before any expert enters the cache. strata computes a miss
on the CPU, so a missed expert need not enter: MIN with bypass lets it in (at the end of its
block) only if some resident is next needed later than it, and then evicts the resident needed
last. The cache may start holding anything (a profile fill is free), so MIN starts with the
experts used first.

This minimises the (block, expert) misses, each a CPU computation, of any cache of `slots`
slots that loads an expert only after it was routed to. Its hit count is every access but
those misses: on decode steps (one token each) that is exactly the most hits any policy can
have; in a prompt step, a missed expert routed by m tokens counts one miss and m - 1 hits
(code REPEAT), so there the count is an upper bound, not a tight one. With `--kv-grow` a
policy's cache shrinks and refills (a refill loads experts no token routed to yet); the bound
is that of the fixed cache of `slots` slots.

`scope="global"` shares the slots between all layers, as strata's cache does;
`scope="per-layer"` splits them evenly (the first `slots % L` layers get one more).
"oracle static" is the best fixed set of `slots` experts for the whole trace: the most routed.
"""

from __future__ import annotations

import numpy as np

from strata.formats.trace import Trace
from strata.sim import _kernels
from strata.sim.result import ReplayResult

SCOPES = ("global", "per-layer")


def access_sequence(trace: Trace) -> np.ndarray:
    """int32 [A]: flat expert ids (`layer * E + expert`) in replay order."""
    return _kernels.access_sequence(trace.expert_ids, trace.step_offsets, trace.n_experts)


def _block_starts(trace: Trace) -> np.ndarray:
    """int64 [S * L + 1]: where each (step, layer) block starts in the access sequence."""
    per_block = np.repeat(trace.step_tokens * trace.top_k, trace.n_layers)
    return np.concatenate([[0], np.cumsum(per_block)]).astype(np.int64)


def _check_slots(slots: int) -> None:
    if isinstance(slots, bool) or not isinstance(slots, int | np.integer) or slots < 0:
        raise ValueError(f"slots must be an int >= 0, got {slots!r}")


def result_from_codes(trace: Trace, seq: np.ndarray, codes: np.ndarray, *, policy: str,
                      slots: int) -> ReplayResult:
    """A bound's counts from what happened at each access (`_kernels.CODE_*`)."""
    result = ReplayResult.empty(trace, policy=policy, name=policy, options={}, path="bound",
                                slots=int(slots))
    n_blocks = trace.n_steps * trace.n_layers
    hits, dh, dm, loads = (np.zeros(n_blocks, np.int32) for _ in range(4))
    _kernels.block_stats(seq, codes, _block_starts(trace), trace.n_layers * trace.n_experts,
                         hits, dh, dm, loads)
    shape = (trace.n_steps, trace.n_layers)
    result.steps.hits[...] = hits.reshape(shape)
    result.steps.distinct_hits[...] = dh.reshape(shape)
    result.steps.distinct_misses[...] = dm.reshape(shape)
    result.steps.uploads[...] = loads.reshape(shape).sum(axis=1)
    loaded = seq[codes == _kernels.CODE_LOADED] // trace.n_experts
    result.layer_admissions[...] = np.bincount(loaded, minlength=trace.n_layers)
    return result


def layer_capacities(slots: int, n_layers: int) -> np.ndarray:
    """int64 [L]: an even split of `slots`, the first `slots % L` layers one more."""
    capacity = np.full(n_layers, slots // n_layers, np.int64)
    capacity[: slots % n_layers] += 1
    return capacity


def belady(trace: Trace, slots: int, scope: str = "global",
           seq: np.ndarray | None = None) -> ReplayResult:
    """MIN with bypass with `slots` slots (see the module docstring).

    `seq` is `access_sequence(trace)` when the caller already has it.
    """
    _check_slots(slots)
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {', '.join(SCOPES)}, got {scope!r}")
    if seq is None:
        seq = access_sequence(trace)
    n_items = trace.n_layers * trace.n_experts
    if scope == "global":
        codes, evictions = _kernels.min_bypass(seq, _kernels.next_use(seq, n_items),
                                               _block_starts(trace), int(slots), n_items)
        layer_evictions = evictions.reshape(trace.n_layers, -1).sum(axis=1)
        label = "belady"
    else:
        codes = np.empty(seq.size, np.uint8)
        layer_evictions = np.zeros(trace.n_layers, np.int64)
        layer_of = seq // trace.n_experts
        block = trace.step_tokens * trace.top_k  # a layer's accesses per step
        starts = np.concatenate([[0], np.cumsum(block)]).astype(np.int64)
        for layer, capacity in enumerate(layer_capacities(int(slots), trace.n_layers)):
            where = np.flatnonzero(layer_of == layer)
            local = np.ascontiguousarray(seq[where] - layer * trace.n_experts)
            codes[where], evictions = _kernels.min_bypass(
                local, _kernels.next_use(local, trace.n_experts), starts, int(capacity),
                trace.n_experts)
            layer_evictions[layer] = evictions.sum()
        label = "belady-per-layer"
    result = result_from_codes(trace, seq, codes, policy=label, slots=slots)
    result.layer_evictions[...] = layer_evictions
    return result


def oracle_static_set(trace: Trace, slots: int) -> np.ndarray:
    """int64 flat ids of the `slots` most routed experts (ties: lower flat id), hottest first."""
    _check_slots(slots)
    counts = trace.routing_counts().reshape(-1)
    order = np.lexsort((np.arange(counts.size), -counts))
    return order[: int(slots)]


def oracle_static(trace: Trace, slots: int, seq: np.ndarray | None = None) -> ReplayResult:
    """The best fixed set of `slots` experts for the whole trace, replayed."""
    if seq is None:
        seq = access_sequence(trace)
    resident = np.zeros(trace.n_layers * trace.n_experts, np.uint8)
    resident[oracle_static_set(trace, slots)] = _kernels.CODE_HIT
    return result_from_codes(trace, seq, resident[seq], policy="oracle-static", slots=slots)
