"""A prompt chunk's experts as two grouped matrix products over the rows sorted by expert.

Dimension letters: T tokens, D hidden size, E experts per layer, K experts per token, F expert
width, R = T*K routed rows.

The rows (token, k) are sorted by their expert; `torch._grouped_mm` then multiplies each
expert's run of rows by that expert's weights, every expert in one kernel, reading the weights
in place (the [E, 2F, D] and [E, D, F] views are column-major per expert once transposed, the
layout it takes). No host sync: the runs' ends are a device tensor, so a CUDA graph can hold a
chunk's call (`strata.engine.runtime.prompt_graphs`). It exists on CUDA for bf16
on Hopper (sm90) and later; `available` says when this path applies, and `ResidentExperts`
loops over the experts elsewhere. Deterministic: no atomics, each row written once.
`sorted_grouped_rows` puts the rows back in (token, k) order (the expert cache's calls take
them so); `sorted_grouped_sum` leaves them sorted and weights and sums each token's K rows
straight from there (`strata.engine.experts.combine`).
"""

from __future__ import annotations

import torch

from strata.engine.experts.activation import silu_and_mul
from strata.engine.experts.combine import weighted_sum

__all__ = ["available", "available_for", "expert_runs", "grouped_products",
           "sorted_grouped_rows", "sorted_grouped_sum"]


def available(x: torch.Tensor) -> bool:
    """Whether the grouped products run for `x` here: `available_for` its device and dtype."""
    return available_for(x.device, x.dtype)


def available_for(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the grouped products run for rows in `dtype` on `device`: bf16 on a CUDA device
    of compute capability 9.0 or later, with a torch that has `_grouped_mm`."""
    return (device.type == "cuda" and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(device) >= (9, 0))


def sorted_grouped_rows(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor,
                        topk_ids: torch.Tensor) -> torch.Tensor:
    """[R, D]: row t*K + k is expert topk_ids[t, k] of layer weights gate_up [E, 2F, D] and
    down [E, D, F] applied to x[t] (x [T, D], topk_ids [T, K] int64)."""
    y, order = _sorted_products(gate_up, down, x, topk_ids)
    out = torch.empty_like(y)  # [R, D] back in (token, k) order
    out.index_copy_(0, order, y)
    return out


def sorted_grouped_sum(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor,
                       topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """[T, D] in x's dtype: `sorted_grouped_rows`' rows weighted by topk_weights [T, K] and
    summed over k (`combine.weighted_sum`), read where the products left them."""
    y, order = _sorted_products(gate_up, down, x, topk_ids)
    positions = torch.empty_like(order)  # [R]: row t*K + k is y[positions[t*K + k]]
    positions[order] = torch.arange(order.shape[0], device=order.device)
    return weighted_sum(y, topk_weights, x.dtype, positions)


def expert_runs(ids: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [R] int64, ends [E] int32) of routed ids [R] in [0, n_experts): `order` lists the
    rows grouped by expert, ascending within an expert (stable); expert e's rows are
    order[ends[e-1]:ends[e]]. The ends are searched, not counted: CUDA's bincount reads its
    largest id on the host, which a CUDA graph cannot hold.

    The ids are sorted as the narrowest integers that hold them (uint8 up to 256 experts):
    CUDA's radix sort makes one pass over the keys per byte, so an int64 id costs eight
    passes where one byte costs one, for the same stable order (on the H200 the int64 sort
    was 11-13% of a 4,096-token chunk's experts call, bench/results/
    prompt-experts-h200-2026-12-03.md)."""
    key_dtype = torch.uint8 if n_experts <= 256 else torch.int16 if n_experts <= 32768 \
        else torch.int32
    sorted_ids, order = torch.sort(ids.to(key_dtype), stable=True)  # [R] each
    experts = torch.arange(n_experts, device=ids.device, dtype=key_dtype)  # [E]
    return order, torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)


def _sorted_products(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor,
                     topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [R, D] sorted by expert, order [R]): y[j] is row order[j] = t*K + k."""
    n_experts = gate_up.shape[0]
    top_k = topk_ids.shape[1]
    order, ends = expert_runs(topk_ids.reshape(-1), n_experts)  # [R], [E]
    x_sorted = x.index_select(0, order // top_k)  # [R, D]
    return grouped_products(gate_up, down, x_sorted, ends), order  # [R, D], [R]


def grouped_products(gate_up: torch.Tensor, down: torch.Tensor, x_sorted: torch.Tensor,
                     ends: torch.Tensor) -> torch.Tensor:
    """[R, D]: rows x_sorted [R, D] sorted by expert, expert e's run ending at ends[e] (int32
    [E], on x's device), each through expert e of gate_up [E, 2F, D] and down [E, D, F]
    (SwiGLU), in two grouped products, every expert in one kernel each."""
    h = torch._grouped_mm(x_sorted, gate_up.transpose(-2, -1), offs=ends)  # [R, 2F]
    act = silu_and_mul(h)  # [R, F]
    return torch._grouped_mm(act, down.transpose(-2, -1), offs=ends)  # [R, D]
