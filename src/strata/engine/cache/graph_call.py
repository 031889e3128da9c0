"""The decode call through the expert cache split around the piecewise CUDA graphs: the hits
inside the graphs, only the misses on the host.

Dimension letters: K experts per token, D hidden size, R rows.

`strata.engine.runtime.piecewise` replays a decode round as graphs cut at the experts calls and
runs each call on the host between two graphs. A call through the cache (`token_forward`) spent
most of its host time issuing work that needs nothing from the host: the hits' kernels (their
slots are in the device mirror of the books), the upload of their slots, the gathering of the
rows and the weighted sum. On the H200 the hits' launches alone took 0.15 ms of host time a
layer (bench/results/layer-call-cpu-2026-12-01.md). Split, a call has three parts:

1. `resident_rows`, captured at the end of layer l's graph: each of the K rows computed from
   the slot the mirror names; a row whose expert is not resident is left unwritten (the
   experts' Triton kernels read nothing for a negative slot);
2. `fill_misses`, on the host between the graphs: `token_forward`'s steps without the hits.
   These are the books' split, the policy's `observe`, the misses computed (the streamed
   ones on the device, the rest on the CPU) and written over their rows, the stats and the
   admissions;
3. the weighted sum over the K rows in order, captured at the start of layer l+1's graph.

The rows are the ones `token_forward` computes, from the same kernels, and the sum reads them
in the same order. So a split call gives `token_forward`'s bytes, and its books and stats
(tests/engine/cache/test_token_path.py).

The mirror the graph reads is the books' state when the host reaches `fill_misses`: every
change of the books re-uploads it, and admissions happen after the rows were computed. The
copy stream waits for the compute stream before it overwrites a slot.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from strata.engine.cache.stats import PhaseStats
from strata.engine.cache.token_call import cpu_rows, device_time, split_call, streamed_rows
from strata.engine.experts import grouped

__all__ = ["fill_misses", "resident_rows"]


def resident_rows(cache: Any, layer: int, x: torch.Tensor, topk_ids: torch.Tensor
                  ) -> torch.Tensor:
    """[K, D]: row k the expert topk_ids[0, k] of `layer` over the one token x [1, D] where the
    device mirror says it is resident, unwritten where it is not. Reads nothing on the host,
    so a CUDA graph can hold it. `cache` is a `CachedExperts` (not imported: it imports this)."""
    top_k = topk_ids.shape[1]
    slots = cache.mirror[layer].index_select(0, topk_ids.reshape(-1))  # [K] int32, -1: missing
    if not grouped.copies_weights(cache.device):  # the Triton kernels: a -1 row reads nothing
        return cache.arena.expert_rows(slots, x.expand(top_k, -1))  # [K, D]
    # The torch path (the host twin) gathers weights by slot: only the resident rows, picked
    # on the host (not capturable; `CachedExperts.splits_calls` is false there).
    rows = x.new_zeros((top_k, x.shape[1]))  # [K, D]
    resident = torch.nonzero(slots >= 0).reshape(-1)  # [n]
    if resident.numel():
        rows[resident] = cache.arena.expert_rows(slots[resident],
                                                 x.expand(resident.numel(), -1))
    return rows


def fill_misses(cache: Any, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
                rows: torch.Tensor, stats: PhaseStats) -> None:
    """The host's part of `cache`'s call for one token x [1, D] routed to topk_ids [1, K]
    outside a loaned pass, after `resident_rows` filled rows [K, D]: the misses' rows written
    into `rows`, the books, the policy and `stats` told as `token_forward` tells them."""
    top_k = topk_ids.shape[1]
    call = split_call(cache, layer, x, topk_ids, stats)
    if not call.n_missed:
        return
    missed = [part for part in (call.streamed, call.misses) if part is not None]
    # The rows (k) each part's outputs go to, streamed first: one upload, into the part of the
    # buffer `split_token` used for the hits' slots and the order, which are not needed here.
    targets = np.concatenate([part.rows for part in missed])
    call.split[:targets.size] = targets
    parts = []  # [R_i, D] each: the streamed misses', the CPU's rows
    with device_time(stats):
        positions = cache.host_rows.indices_to_device(call.buffer[:targets.size])  # [R]
        if call.streamed is not None:
            parts.append(streamed_rows(cache, layer, x, call.streamed, stats))
    if call.misses is not None:
        parts.append(cpu_rows(cache, layer, call.x_host, call.misses, stats))
    rows.index_copy_(0, positions, parts[0] if len(parts) == 1 else torch.cat(parts))
    if cache.checked.admits:
        cache.admit_misses(layer, call.missed_experts(top_k))
