"""Experts computed on the device straight from their slots in the arena (no weight copy).

Dimension letters: T tokens, D hidden size, F expert width, K experts per token, M experts of
a call, R routed (token, k) rows.

Used for a prompt's hits, and by the prompt loan for the misses it streams through lent slots;
the math is `ResidentExperts`' (SwiGLU), and so is the choice of path: two grouped matrix
products over the rows sorted by slot where `ResidentExperts` runs them (bf16 on Hopper;
`strata.engine.experts.sorted_grouped`, one kernel each for every slot at once; quantized
slots dequantized a batch at a time, two grouped products a batch: `Arena.grouped_rows`), else
a loop over the experts, so the rows differ from the CPU's only by rounding. In the loop a
quantized slot is dequantized once for the chunk's tokens (`Arena.each_weights`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from strata.engine.cache.arena import Arena
from strata.engine.experts import sorted_grouped
from strata.engine.experts.activation import silu_and_mul
from strata.engine.experts.blobs import to_device_async
from strata.engine.experts.routed import Routed

__all__ = ["SlotsIndex", "compute_from_slots"]


@dataclass(frozen=True)
class SlotsIndex:
    """What `compute_from_slots` reads on the device for a `Routed`'s rows from their slots, in
    one upload: each row's token and slot, and the experts' runs.

    One upload from pinned memory, and made before a prompt loan queues its blobs but the
    first batch's: a copy to the device queued behind the blobs (on any stream: the
    host-to-device copies share one copy engine, in order) waits for all of them, and every
    kernel behind it in its stream waits with it, so no batch's compute would overlap the next
    batch's upload (on the H200, an int8 prompt's copies and computes never overlapped until
    the loan uploaded its index ahead of its blobs). `part` gives a group of the experts'
    views, without another upload."""

    tokens: torch.Tensor  # int64 [R]: each row's token (row // K)
    row_slots: torch.Tensor  # int64 [R]: each row's slot
    ends: torch.Tensor  # int64 [M + 1]: expert i's rows are ends[i] - ends[0] up to ends[i + 1]
    host_starts: np.ndarray  # int64 [M + 1]: `Routed.starts` of the rows (the host's copy)

    @classmethod
    def upload(cls, routed: Routed, slots: np.ndarray, device: torch.device) -> SlotsIndex:
        """The index of `routed`'s rows from `slots` [M] (one per expert), on `device`."""
        n_rows = routed.n_rows
        host = np.concatenate([routed.rows // routed.top_k,
                               np.repeat(np.asarray(slots, dtype=np.int64),
                                         np.diff(routed.starts)),
                               routed.starts]).astype(np.int64)  # [2R + M + 1]
        index = to_device_async(torch.from_numpy(host), device)
        return cls(index[:n_rows], index[n_rows : 2 * n_rows], index[2 * n_rows :],
                   np.asarray(routed.starts, dtype=np.int64))

    def part(self, lo: int, hi: int) -> SlotsIndex:
        """The index of experts lo..hi (`Routed.group(lo, hi)`'s rows): views."""
        r0, r1 = int(self.host_starts[lo]), int(self.host_starts[hi])
        return SlotsIndex(self.tokens[r0:r1], self.row_slots[r0:r1], self.ends[lo : hi + 1],
                          self.host_starts[lo : hi + 1] - r0)


def compute_from_slots(
    arena: Arena, x: torch.Tensor, routed: Routed, slots: Sequence[int] | np.ndarray,
    grouped: bool | None = None, index: SlotsIndex | None = None,
) -> torch.Tensor:
    """[R, D] on the device, rows in `routed.rows` order: expert `routed.experts[i]` over its
    tokens of x [T, D], from the blob in `slots[i]`, through the slot's views. `grouped`
    None: the grouped products where `sorted_grouped.available`, else the loop; False: the
    loop (a benchmark's or a test's baseline). `index`: `routed`'s `SlotsIndex` from these
    slots, uploaded earlier (None: uploaded here)."""
    slots = np.asarray(slots).reshape(-1)
    if slots.size != routed.n_experts:
        raise ValueError(f"{slots.size} slots for {routed.n_experts} experts")
    if index is None:
        index = SlotsIndex.upload(routed, slots, x.device)
    elif index.tokens.shape[0] != routed.n_rows or index.ends.shape[0] != slots.size + 1:
        raise ValueError(f"the index covers {index.tokens.shape[0]} rows of "
                         f"{index.ends.shape[0] - 1} experts; these are {routed.n_rows} rows "
                         f"of {slots.size}")
    grouped = grouped is not False and sorted_grouped.available(x)
    if grouped and arena.quant is not None:
        # routed.rows are sorted by expert already: expert i's run is starts[i]:starts[i + 1].
        return arena.grouped_rows(slots.tolist(), x.index_select(0, index.tokens),
                                  np.diff(routed.starts).tolist(),
                                  index.ends - index.ends[:1])  # [R, D]
    if grouped:
        # The rows sorted by slot keep routed.rows' order within a slot, the loop's.
        return sorted_grouped.sorted_grouped_rows(arena.gate_up_all(), arena.down_all(),
                                                  x.index_select(0, index.tokens),
                                                  index.row_slots.unsqueeze(1))  # [R, D]
    y = x.new_empty((routed.n_rows, x.shape[1]))  # [R, D]
    # [2F, D], [D, F] each: views, or dequantized in batches if quantized.
    weights = arena.each_weights(slots.tolist())
    for i, (gate_up, down) in enumerate(weights):
        lo, hi = int(routed.starts[i]), int(routed.starts[i + 1])
        h = F.linear(x.index_select(0, index.tokens[lo:hi]), gate_up)  # [n, 2F]
        act = silu_and_mul(h)  # [n, F]
        y[lo:hi] = F.linear(act, down)  # [n, D]
    return y
