"""Experts computed on the device straight from their slots in the arena (no weight copy).

Dimension letters: T tokens, D hidden size, F expert width, K experts per token, R routed
(token, k) rows.

Used for a prompt's hits, and by the prompt loan for the misses it streams through lent slots;
the math is `ResidentExperts`' per expert (SwiGLU), so the rows differ from the CPU's only by
rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from strata.engine.cache.arena import Arena
from strata.engine.experts.routed import Routed

__all__ = ["compute_from_slots"]


def compute_from_slots(
    arena: Arena, x: torch.Tensor, routed: Routed, slots: Sequence[int] | np.ndarray
) -> torch.Tensor:
    """[R, D] on the device, rows in `routed.rows` order: expert `routed.experts[i]` over its
    tokens of x [T, D], from the blob in `slots[i]`, through the slot's views."""
    slots = np.asarray(slots).reshape(-1)
    if slots.size != routed.n_experts:
        raise ValueError(f"{slots.size} slots for {routed.n_experts} experts")
    f, top_k = arena.expert_width, routed.top_k
    rows = torch.tensor(routed.rows, device=x.device)  # [R]
    y = x.new_empty((routed.n_rows, x.shape[1]))  # [R, D]
    for i, slot in enumerate(slots.tolist()):
        lo, hi = int(routed.starts[i]), int(routed.starts[i + 1])
        h = F.linear(x.index_select(0, rows[lo:hi] // top_k), arena.gate_up(slot))  # [n, 2F]
        act = F.silu(h[:, :f]) * h[:, f:]  # [n, F]
        y[lo:hi] = F.linear(act, arena.down(slot))  # [n, D]
    return y
