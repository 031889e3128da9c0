"""The decode call through the expert cache split around the piecewise CUDA graphs: the hits
inside the graphs, only the misses on the host.

Dimension letters: K experts per token, D hidden size, R rows.

`strata.engine.runtime.piecewise` replays a decode round as graphs cut at the experts calls and
runs each call on the host between two graphs. A call through the cache (`token_forward`) spent
most of its host time issuing work that needs nothing from the host: the hits' kernels (their
slots are in the device mirror of the books), the upload of their slots, the gathering of the
rows and the weighted sum. On the H200 the hits' launches alone took 0.15 ms of host time a
layer (bench/results/layer-call-cpu-2026-12-01.md). Split, a call has three parts:

1. `resident_rows`, captured at the end of layer l's graph: x and the routing queued to the
   host first (`HostRows.queue_routing`), so that the host's read waits for them and not for
   the hits, which run while it works (on the H200 a layer's int8 hits took 22 µs of the
   device, bench/results/decode-read-ahead-h200-2026-12-04.md); then each of the K rows
   computed from the slot the mirror names; a row whose expert is not resident is zeros (the
   experts' Triton kernels read nothing for a negative slot). The rows are [K + 1, D]: row
   k + 1 is the token's k-th expert's, row 0 a scratch row (see 3);
2. `fill_misses`, on the host between the graphs: `token_forward`'s steps without the hits.
   These are the books' split, the policy's `observe`, the misses (the CPU's computed into a
   kept host buffer and sent with their targets in one copy: `HostRows.stage_cpu_rows`; the
   streamed ones' blobs uploaded and the stage map set: `StreamedMisses.stage`; no kernel
   launched for either; the CPU's share started before the streamed rows are even grouped),
   the stats and the admissions (a round calls these books, with the CPU call's parts and the
   call's end, after it has launched the next graph: `books_after`);
3. `sum_rows`, captured at the start of layer l+1's graph: the CPU's rows written where
   their targets say (`HostRows.scatter_cpu_rows`), the staged experts computed over all the
   staging blobs, an unused blob reading nothing and its row going to the scratch row
   (`StreamedMisses.staged_rows`), then the weighted sum over the K rows in order.

The rows are the ones `token_forward` computes, from the same kernels, and the sum reads them
in the same order. So a split call gives `token_forward`'s bytes, and its books and stats
(tests/engine/cache/test_token_path.py).

The mirror the graph reads is the books' state when the host reaches `fill_misses`: every
change of the books re-uploads it, and admissions happen after the rows were computed. The
copy stream waits for the compute stream before it overwrites a slot. With the next graph
launched ahead of the CPU's rows (`LAUNCH_AHEAD`), a call's admissions come after that graph
is queued: it reads the mirror from before them, which names only slots still whole (see
`_admit`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from strata.engine.cache.stats import PhaseStats
from strata.engine.cache.token_call import (
    DeviceTime,
    count_cpu_call,
    cpu_rows,
    finish_cpu_rows,
    split_call,
    start_cpu_rows,
)
from strata.engine.experts import grouped, weighted_sum

__all__ = ["LAUNCH_AHEAD", "fill_misses", "resident_rows", "sum_rows"]

# Off: split calls return before the CPU's misses are done, the next graph launched ahead of
# their rows behind a wait on the stream (`fill_misses`' `ahead`,
# `strata.engine.cache.host_signal`). The same tokens, but 1.21x then 0.92x the base's round on
# an H100 machine, the CPU's runs slower beside the queued graph
# (bench/results/cpu-parts-h100-2026-12-05.md). bench/offload.py --launch-ahead times both.
LAUNCH_AHEAD = False


def resident_rows(cache: Any, layer: int, x: torch.Tensor, topk_ids: torch.Tensor
                  ) -> torch.Tensor:
    """[K + 1, D]: row k + 1 the expert topk_ids[0, k] of `layer` over the one token x [1, D]
    where the device mirror says it is resident, zeros where it is not (a warm-up sums them
    as they are); row 0 a scratch row. Reads nothing on the host, so a CUDA graph can hold
    it. `cache` is a `CachedExperts` (not imported: it imports this)."""
    top_k = topk_ids.shape[1]
    # x and the routing to the host first: the host's read waits for them, not for the hits.
    cache.host_rows.queue_routing(x, topk_ids)
    if cache.prefetch is not None:  # the next layer's likely experts, for `fill_misses`
        cache.prefetch.predict(layer, x)
    slots = cache.mirror[layer].index_select(0, topk_ids.reshape(-1))  # [K] int32, -1: missing
    slots = torch.cat((slots.new_full((1,), -1), slots))  # [K + 1]: the scratch row reads nothing
    if not grouped.copies_weights(cache.device):  # the Triton kernels: a -1 row reads nothing
        return cache.arena.expert_rows(slots, x.expand(top_k + 1, -1))  # [K + 1, D]
    # The torch path (the host twin) gathers weights by slot: only the resident rows, picked
    # on the host (not capturable; `CachedExperts.splits_calls` is false there).
    rows = x.new_zeros((top_k + 1, x.shape[1]))  # [K + 1, D]
    resident = torch.nonzero(slots >= 0).reshape(-1)  # [n]
    if resident.numel():
        rows[resident] = cache.arena.expert_rows(slots[resident],
                                                 x.expand(resident.numel(), -1))
    return rows


def fill_misses(cache: Any, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
                rows: torch.Tensor, stats: PhaseStats, leave: Callable[[], None],
                ahead: bool = False, books_after: bool = False) -> Callable[[], None] | None:
    """The host's part of `cache`'s call for one token x [1, D] routed to topk_ids [1, K]
    outside a loaned pass, after `resident_rows` filled rows [K + 1, D]: the CPU's misses'
    rows and the streamed ones staged for `sum_rows` to write into `rows`, the books, the
    policy and `stats` told as `token_forward` tells them, then `leave()` (the call's end in
    the cache's books). Returns None, done.

    `books_after`: return once the rows are staged, and the rest of the call as a function,
    its books (the CPU call's times counted, the admissions, `leave()`): the caller launches
    the next graph and then calls it, so that the next graph waits for no bookkeeping.

    `ahead` (where the CPU's misses run on its own thread): return while they still run, the
    rows' copy queued behind a wait on the stream (`HostRows.signal`), and the rest of the
    call as a function: the caller launches the next graph (queued behind the copy) and then
    calls it, which waits for the CPU, sets the signal, admits and leaves. Between the two the
    caller must wait for nothing the device does (`strata.engine.cache.host_signal`).

    Either way the bytes are the same: the stream runs the same work in the same order, and
    admissions, made after the next graph is queued, change no row of it (`_admit`)."""
    top_k = topk_ids.shape[1]
    call = split_call(cache, layer, x, topk_ids, stats, queued=True)
    host_rows, hidden_size = cache.host_rows, x.shape[1]
    out = targets = started = None
    if call.misses is not None:  # computed into the kept host buffer, then sent in one copy
        out = host_rows.cpu_out(top_k, call.misses.n_rows, hidden_size, rows.dtype)  # [R, D]
        if cache.async_cpu:  # on the CPU's own thread while this one issues the uploads
            started = start_cpu_rows(cache, layer, call.x_host, call.misses, stats, out)
        targets = call.misses.rows + 1  # row k of the call is row k + 1 of `rows`
        if not ahead:  # written now, so that the rows, once done, wait for their copy alone
            host_rows.write_cpu_targets(top_k, hidden_size, rows.dtype, targets)
    handed_on = False
    try:
        _stage_uploads(cache, layer, call, top_k, stats)
        if ahead and started is not None:
            rest = _rows_ahead(cache, layer, call, stats, started, targets, rows, leave)
            handed_on = True
            return rest
    finally:  # the CPU's thread writes `out`: never left running past this call
        if started is not None and not handed_on:
            finish_cpu_rows(cache, stats, started, count=False)
    if started is None and call.misses is not None:
        cpu_rows(cache, layer, call.x_host, call.misses, stats, out)
    with DeviceTime(stats):
        host_rows.stage_cpu_rows(top_k, hidden_size, rows.dtype, targets,
                                 targets_written=targets is not None and not ahead)

    def books() -> None:
        if started is not None:
            count_cpu_call(cache, stats)
        _admit(cache, layer, call, top_k)
        leave()

    if books_after:
        return books
    books()
    return None


def _rows_ahead(cache: Any, layer: int, call: Any, stats: PhaseStats, started: float,
                targets: np.ndarray, rows: torch.Tensor, leave: Callable[[], None]
                ) -> Callable[[], None]:
    """`fill_misses`' `ahead`: the wait and the CPU rows' copy queued behind it, and the rest
    of the call (the CPU waited for, the signal set whatever happens, the admissions)."""
    top_k, hidden_size = rows.shape[0] - 1, rows.shape[1]
    signal = cache.host_rows.signal
    with DeviceTime(stats):
        signal.queue_wait()
        try:
            cache.host_rows.stage_cpu_rows(top_k, hidden_size, rows.dtype, targets,
                                           behind_signal=True)
        except BaseException:
            signal.set()  # nothing may stay queued behind a wait nobody sets
            raise

    def rest() -> None:
        try:
            finish_cpu_rows(cache, stats, started)
        finally:  # the rows are written (or the call failed): the stream runs on either way
            signal.set()
        _admit(cache, layer, call, top_k)
        leave()

    return rest


def _admit(cache: Any, layer: int, call: Any, top_k: int) -> None:
    """The policy's admissions of the call's misses. After the next graph was queued (`ahead`)
    they change no row of it: the slots they overwrite are uploaded only once the stream has
    run past it (`Arena.upload` waits for the stream), so an expert they evict is still whole
    in its slot when that graph reads it through the mirror it was queued with, and its row is
    written over by the CPU's or the staged one anyway (the books call it a miss)."""
    if cache.checked.admits and call.n_missed:
        cache.admit_misses(layer, call.missed_experts(top_k))


def _stage_uploads(cache: Any, layer: int, call: Any, top_k: int, stats: PhaseStats
                   ) -> None:
    """`fill_misses`' uploads: the call's streamed misses staged (or the stage map cleared),
    then the next layer's predicted misses prefetched where the cache predicts them."""
    # The next layer's predictions, read while the stream is drained by the routing's read:
    # before this layer's uploads, which a later read would wait for.
    predicted = cache.prefetch.read(layer) if cache.prefetch is not None else []
    blob_bytes = cache.store.blob_bytes
    streamed = call.streamed(top_k)  # made now, after the CPU's start
    if streamed is not None:
        with DeviceTime(stats):
            uploaded = cache.streamer.stage(layer, streamed, streamed.rows + 1)
        stats.streamed_experts += streamed.n_experts
        stats.uploaded_bytes += uploaded * blob_bytes  # less those prefetched
    elif cache.streamer is not None:
        cache.streamer.stage(layer, None, None)  # a map left from an earlier call: cleared
    if predicted:  # after this layer's uploads: the next one's likely misses
        with DeviceTime(stats):
            stats.uploaded_bytes += cache.prefetch.issue(layer, predicted, cache.table,
                                                         cache.streamer) * blob_bytes


def sum_rows(cache: Any, x: torch.Tensor, rows: torch.Tensor, topk_weights: torch.Tensor
             ) -> torch.Tensor:
    """[1, D] in x's dtype: the CPU's and the staged experts' rows written into rows [K + 1, D]
    (none when nothing is staged), then the weighted sum of rows 1..K by topk_weights [1, K].
    Reads nothing on the host on CUDA, so a CUDA graph can hold it."""
    cache.host_rows.scatter_cpu_rows(rows)
    if cache.streamer is not None:
        cache.streamer.staged_rows(x, rows)
    return weighted_sum(rows[1:], topk_weights, x.dtype)
