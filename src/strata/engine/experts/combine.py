"""The last step of every experts call: each token's K expert rows, weighted and summed.

Dimension letters: T tokens, K experts per token, R = T*K routed rows, D hidden size.

`weighted_sum` turns the R rows an experts call computed (row t*K + k: token t's k-th expert)
into the layer's [T, D] output: sum over k = 0..K-1, in that order, of weights[t, k] * row, in
float32, rounded once to the model's dtype. Every holder of experts calls it (the resident
experts, the expert cache's paths), so that on one device they all round alike.

Two implementations, chosen by where the rows are, never by routed data:
- CUDA with Triton: one kernel reads each row once and writes [T, D] (`_combine_triton`); given
  `positions` it reads row t*K + k from rows[positions[t*K + k]], so rows left in another order
  (sorted by expert, as the prompt's grouped products leave them) need no copy back first. At a
  4,096-token chunk of `olmoe-1b-7b` the torch path moves about 1 GB a layer in five kernels
  (the copy back, the widening, the product, the sum, the narrowing) where this reads 134 MB.
- elsewhere, and under `torch.compile` (inductor fuses it itself): the same sum in torch ops.
"""

from __future__ import annotations

import functools

import torch

from strata.engine import dependent_launch

__all__ = ["weighted_sum"]

BLOCK_D = 1024  # columns of one token a kernel program sums


@functools.cache
def _kernels():
    """The Triton kernel module, or None without Triton."""
    try:
        from strata.engine.experts import _combine_triton
    except ImportError:
        return None
    return _combine_triton


def weighted_sum(rows: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype,
                 positions: torch.Tensor | None = None) -> torch.Tensor:
    """[T, D] in `dtype`: out[t] = sum over k in order of weights[t, k] * row(t, k), in float32.

    rows [R', D] (any float dtype); weights [T, K] (float32, or widened to it); row(t, k) is
    rows[t*K + k], or with `positions` [T*K] int64 rows[positions[t*K + k]]."""
    n_tokens, top_k = weights.shape
    if not torch.compiler.is_compiling() and rows.is_cuda and _kernels() is not None:
        return weighted_sum_triton(rows, weights, dtype, positions)
    if positions is not None:
        rows = rows.index_select(0, positions)  # [T*K, D] in (token, k) order
    # Type promotion widens each row exactly inside the product, as `.float()` would.
    weighted = torch.mul(rows.view(n_tokens, top_k, rows.shape[1]), weights.float().unsqueeze(-1))
    return weighted.sum(dim=1).to(dtype)


def weighted_sum_triton(rows: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype,
                        positions: torch.Tensor | None = None) -> torch.Tensor:
    """`weighted_sum` by the Triton kernel (its interpreter on the CPU, with TRITON_INTERPRET=1
    set before import, is how the tests check it without a GPU)."""
    kernels = _kernels()
    if kernels is None:
        raise RuntimeError("weighted_sum_triton needs Triton (pip install triton)")
    n_tokens, top_k = weights.shape
    d = rows.shape[1]
    if rows.stride(1) != 1:
        raise ValueError("weighted_sum_triton needs each row contiguous")
    weights = weights.float().contiguous()
    out = rows.new_empty((n_tokens, d), dtype=dtype)  # [T, D]
    if n_tokens == 0:
        return out
    has_positions = positions is not None
    if positions is None:
        positions = weights  # not read: a placeholder pointer
    kernels.combine[(n_tokens, -(-d // BLOCK_D))](
        rows, weights, positions, out, rows.stride(0), out.stride(0), d, top_k,
        HAS_POSITIONS=has_positions, BLOCK_D=BLOCK_D,
        **dependent_launch.kernel_options(rows.device))
    return out
