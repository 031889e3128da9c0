"""The expert cache's general layer call: any number of tokens, the routing read on the host.

Dimension letters: T tokens, K experts per token, D hidden size, R rows.

`CachedExperts.forward` sends here every call that is not a decode call on the device only
(`_device_only_forward`) or through `token_call` (decode outside a loaned pass): prompt passes,
the loan's, and decode calls with the token path turned off (the bench's baseline). Its steps
are the ones `strata.engine.cache.cached_experts` lists.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from strata.engine.cache.from_slots import SlotsIndex, compute_from_slots
from strata.engine.cache.loan import LoanLayer
from strata.engine.cache.stats import PhaseStats
from strata.engine.experts import weighted_sum
from strata.engine.experts.routed import Routed, rows_to_device

__all__ = ["routed_forward"]


def routed_forward(cache: Any, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor, stats: PhaseStats) -> torch.Tensor:
    """[T, D]: `cache`'s layer call (a `CachedExperts`, not imported here: it imports this) for
    x [T, D] routed to topk_ids [T, K] with topk_weights [T, K]: steps 1-6 of its module's
    docstring, the routing read on the host; counts into `stats` (the phase's)."""
    n_tokens, top_k = topk_ids.shape
    x_host = cache.host_rows.x_to_host(x) if n_tokens == 1 else None  # read with the ids
    started = time.perf_counter()
    ids = np.ascontiguousarray(topk_ids.cpu().numpy(), dtype=np.int64)  # [T, K], the sync
    stats.wait_s += time.perf_counter() - started
    slots, hit = cache.table.lookup(layer, ids)  # [T, K] each
    loan_layer = _queue_loan_start(cache, layer, x, ids, hit) if cache.loaned else None
    cache.table.record(layer, ids)
    cache.checked.observe(cache.checked.view, layer, ids, hit)
    n_hits = int(np.count_nonzero(hit))
    misses = Routed.of(ids, ~hit) if n_hits < ids.size else None
    stats.layer_calls += 1
    stats.lookups += ids.size
    stats.hits += n_hits

    streamed = None
    if misses is not None and not cache.loaned and n_tokens == 1 and cache.streamer is not None:
        streamed, misses = cache.streamer.split(misses)
    on_cpu = misses is not None and not cache.loaned
    if on_cpu:
        started = time.perf_counter()
        if x_host is None:
            x_host = x.cpu()
        # [R, D]: the misses' inputs, picked on the host (one read of x, no index upload).
        x_rows = x_host.index_select(0, torch.from_numpy(misses.tokens()))
        stats.wait_s += time.perf_counter() - started

    # The device's share is issued first and runs while this thread computes the misses
    # on the CPU; the next host read (the next layer's routing) waits for it.
    started = time.perf_counter()
    out = x.new_empty((n_tokens * top_k, x.shape[1]))  # [T*K, D]: row t*K + k
    try:
        miss_index = _issue_device_share(cache, layer, x, ids, slots, hit, n_hits, streamed,
                                         misses, out, stats, loan_layer)
    finally:
        stats.device_s += time.perf_counter() - started
    if on_cpu:
        started = time.perf_counter()
        miss_rows = cache.cpu.compute(layer, x_rows, misses)  # [R, D]
        stats.cpu_s += time.perf_counter() - started
        stats.cpu_experts += misses.n_experts
        stats.cpu_tokens += misses.n_rows
        out.index_copy_(0, miss_index, cache.host_rows.to_device(miss_rows))

    if cache.checked.admits and (misses is not None or streamed is not None):
        missed = [r.experts for r in (streamed, misses) if r is not None]
        cache.admit_misses(layer, np.sort(np.concatenate(missed)))
    return weighted_sum(out, topk_weights, x.dtype)


def _queue_loan_start(cache: Any, layer: int, x: torch.Tensor, ids: np.ndarray,
                      hit: np.ndarray) -> LoanLayer | None:
    """A loaned layer's first upload batch queued (`PromptLoan.queue_first`) for the experts
    of ids [T, K] that `hit` [T, K] misses; None when it misses none. Needs no sort of the
    rows: the distinct missed experts by a count, ascending as `Routed.of` orders them."""
    assert cache.loan is not None  # `loaned` means a loan is open
    missed = np.flatnonzero(np.bincount(ids[~hit], minlength=cache.table.n_experts))  # [M]
    return cache.loan.queue_first(layer, x, missed) if missed.size else None


def _issue_device_share(cache: Any, layer: int, x: torch.Tensor, ids: np.ndarray,
                        slots: np.ndarray, hit: np.ndarray, n_hits: int,
                        streamed: Routed | None, misses: Routed | None, out: torch.Tensor,
                        stats: PhaseStats, loan_layer: LoanLayer | None = None
                        ) -> torch.Tensor | None:
    """Issue the hits, the streamed misses and the loan's misses into `out` [T*K, D], the
    loan's taking on `loan_layer` (its first batch queued already); returns the device rows
    of the misses left to the CPU (None: none)."""
    n_tokens = ids.shape[0]
    hits = Routed.of(ids, hit) if n_hits and n_tokens > 1 else None
    if hits is not None:
        hit_rows = hits.rows
    else:  # decode: the hit rows, each reading its slot by the books' answer
        hit_rows = np.flatnonzero(hit.reshape(-1)) if n_hits else None
    hit_slots = slots.reshape(-1)[hit_rows] if hit_rows is not None and hits is None \
        else None
    # [R] each: the slots, and the rows each share's outputs land in; one upload. Pinned
    # behind a loan's first batch: from pageable memory the host would wait for its blobs.
    slot_index, hit_index, streamed_index, miss_index = rows_to_device(cache.device,
        hit_slots, hit_rows,
        streamed.rows if streamed is not None else None,
        misses.rows if misses is not None else None, pinned=loan_layer is not None)
    hits_index = None
    if hits is not None:
        # Each hit expert's slot: that of its first row (one slot per expert).
        hit_slots = slots.reshape(-1)[hits.rows[hits.starts[:-1]]]
    if misses is not None and cache.loaned:
        # The loan's first batch is on its way; the indexes go up behind it, then the loan's
        # other batches (a copy behind all of them would wait for them, and the hits'
        # kernels with it), and only then are the hits launched.
        assert cache.loan is not None
        if hits is not None:
            hits_index = SlotsIndex.upload(hits, hit_slots, x.device)
        loan_layer = cache.loan.queue_misses(layer, x, misses, loan_layer)
    if hit_slots is not None and hits is None:
        # T == 1: every hit row reads the one token; all of them in one call.
        y = cache.arena.expert_rows(slot_index, x.expand(hit_slots.size, -1))  # [R, D]
        out.index_copy_(0, hit_index, y)
    elif hits is not None:
        out.index_copy_(0, hit_index, compute_from_slots(cache.arena, x, hits, hit_slots,
                                                         index=hits_index))
    if streamed is not None:
        assert cache.streamer is not None  # only it splits streamed rows off
        out.index_copy_(0, streamed_index, cache.streamer.compute(layer, x, streamed))
        stats.streamed_experts += streamed.n_experts
        stats.uploaded_bytes += streamed.n_experts * cache.store.blob_bytes
    if loan_layer is not None:
        out.index_copy_(0, miss_index, cache.loan.compute_queued(loan_layer))
        stats.loan_experts += misses.n_experts
        return None
    return miss_index
