"""Experts computed on the device straight from their slots in the arena (no weight copy).

Dimension letters: T tokens, D hidden size, F expert width, K experts per token, R routed
(token, k) rows.

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

import numpy as np
import torch
import torch.nn.functional as F

from strata.engine.cache.arena import Arena
from strata.engine.experts import sorted_grouped
from strata.engine.experts.activation import silu_and_mul
from strata.engine.experts.blobs import to_device_async
from strata.engine.experts.routed import Routed

__all__ = ["compute_from_slots"]


def compute_from_slots(
    arena: Arena, x: torch.Tensor, routed: Routed, slots: Sequence[int] | np.ndarray,
    grouped: bool | None = None,
) -> torch.Tensor:
    """[R, D] on the device, rows in `routed.rows` order: expert `routed.experts[i]` over its
    tokens of x [T, D], from the blob in `slots[i]`, through the slot's views. `grouped`
    None: the grouped products where `sorted_grouped.available`, else the loop; False: the
    loop (a benchmark's or a test's baseline)."""
    slots = np.asarray(slots).reshape(-1)
    if slots.size != routed.n_experts:
        raise ValueError(f"{slots.size} slots for {routed.n_experts} experts")
    top_k = routed.top_k
    grouped = grouped is not False and sorted_grouped.available(x)
    if grouped and arena.quant is not None:
        # routed.rows are sorted by expert already: expert i's run is starts[i]:starts[i + 1].
        tokens = to_device_async(torch.from_numpy(routed.rows // top_k), x.device)  # [R]
        return arena.grouped_rows(slots.tolist(), x.index_select(0, tokens),
                                  np.diff(routed.starts).tolist())  # [R, D]
    if grouped:
        # Each row's token and slot, [2, R] in one upload; the rows sorted by slot keep
        # routed.rows' order within a slot, the loop's.
        row_slots = np.repeat(slots.astype(np.int64), np.diff(routed.starts))
        index = to_device_async(torch.from_numpy(np.stack([routed.rows // top_k, row_slots])),
                                x.device)  # [2, R]
        return sorted_grouped.sorted_grouped_rows(arena.gate_up_all(), arena.down_all(),
                                                  x.index_select(0, index[0]),
                                                  index[1].unsqueeze(1))  # [R, D]
    rows = torch.tensor(routed.rows, device=x.device)  # [R]
    y = x.new_empty((routed.n_rows, x.shape[1]))  # [R, D]
    # [2F, D], [D, F] each: views, or dequantized in batches if quantized.
    weights = arena.each_weights(slots.tolist())
    for i, (gate_up, down) in enumerate(weights):
        lo, hi = int(routed.starts[i]), int(routed.starts[i + 1])
        h = F.linear(x.index_select(0, rows[lo:hi] // top_k), gate_up)  # [n, 2F]
        act = silu_and_mul(h)  # [n, F]
        y[lo:hi] = F.linear(act, down)  # [n, D]
    return y
