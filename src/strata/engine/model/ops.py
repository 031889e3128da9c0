"""A layer's small per-token ops: the norms, the rotation of q and k, the routing.

Dimension letters: T tokens, D hidden size, H query heads, G kv heads, Dh head dim, E experts,
K experts per token.

A decode step (T = 1) is many small kernels, each a few microseconds on a GPU whatever its
size: on the H200 a 4-layer `olmoe-1b-7b` round ran about 31 a layer, most of them these ops
(bench/results/decode-ops-h200-2026-12-02.md). Each op here is written once in plain torch (the
reference: Hugging Face's numerics, and what the CPU and `torch.compile` run) and, on CUDA with
Triton, as one kernel (`_ops_triton`) that rounds where the reference's ops round:
- `add_rms_norm`: the residual's sum and the next norm, 3 kernels in one;
- `rotate_and_write`: q's and k's norms, their weights, the rotation, and k's and v's writes
  to the K/V cells, up to 10 in one;
- `route`: the softmax, the top k and the renormalization, 2-3 in one; `router_route` the
  router's product before them too, for the few tokens of a decode step (`ROUTER_MAX_TOKENS`);
- `add_norm_router_route`: `add_rms_norm` and `router_route` in one, for those tokens
  (`DecoderLayer.forward`'s sum after attention, the MoE's norm and routing), where
  `NORM_ROUTER_KERNEL`;
- `rope_and_mask_triton`: a `forward_at`'s rotary tables and attention mask, about 13 in one
  (`layers.rope_and_mask` takes it where `ROPE_MASK_KERNEL`).
The routing kernels' launches (`route_triton`, `router_route_triton`,
`add_norm_router_route_triton`) are `routing_ops`', importable from here too.
A decode step's dense products are `products`': a kernel that reads its weights before the
kernel before it has finished.

Which runs is chosen by the tensors' device alone, never by their values, so a CUDA graph
captures the kernels as an eager call runs them (the same bytes), and under `torch.compile`
the reference runs (inductor fuses it itself).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from strata.engine import dependent_launch
from strata.engine.model.kv_cells import LayerCells
from strata.engine.model.op_kernels import NORM_WARPS
from strata.engine.model.op_kernels import block as _block
from strata.engine.model.op_kernels import kernels as _kernels
from strata.engine.model.routing_ops import (
    ROUTER_MAX_TOKENS,
    add_norm_router_route_triton,
    route_triton,
    router_route_triton,
)

__all__ = ["QKHeads", "add_norm_router_route", "add_rms_norm", "apply_rope", "qk_norm_rope",
           "rms_norm", "rope_and_mask_triton", "rotate_and_write", "route", "router_route",
           "use_kernels", "writes_in_kernel"]

NORMS = {"none": 0, "full": 1, "head": 2}  # `ModelConfig.qk_norm` -> the kernel's NORM
# `add_rms_norm`'s kernel holds a row in one program: wider rows run the torch ops.
MAX_KERNEL_WIDTH = 16384
# Whether `layers.rope_and_mask` runs its kernel on CUDA (about 13 torch kernels a round
# fewer). On the H200 a decode round of the whole olmoe-1b-7b took 1.158 ms with it against
# 1.239 with the torch ops timed one after the other, but 1.217 against 1.209 timed side by
# side, and qwen3's and mixtral's rounds were the same either way
# (bench/results/decode-fusions-h200-2026-12-02.md): on, for its fewer launches; the bytes
# are the torch ops'. bench/decode_profile.py's row "the rotary tables and mask in torch" is
# the A/B.
ROPE_MASK_KERNEL = True
MASK_BLOCK_CELLS = 1024  # the mask cells one program of `rope_and_mask_triton` writes
# Whether `add_norm_router_route` runs its one kernel on CUDA (one launch a layer fewer in a
# decode step). On the H200, timed side by side against `add_rms_norm` then `router_route`:
# rounds 1.164 against 1.217 ms (the whole olmoe-1b-7b), 0.485 against 0.515 (qwen3-30b-a3b,
# 4 layers), 0.615 against 0.633 (mixtral-8x7b, 2 layers); bench/decode.py's greedy decode
# 925 against 921 tok/s, alternating runs (bench/results/decode-fusions-h200-2026-12-02.md).
# A decode step's token takes `products.linear_add_norm_route` before it (attention's output
# product in this kernel too); bench/decode_profile.py's row "the output product, the norm and
# the router as three kernels" is the A/B, with that one off as well.
NORM_ROUTER_KERNEL = True


def use_kernels(x: torch.Tensor) -> bool:
    """Whether the ops on `x` run as Triton kernels: on CUDA, with Triton, outside a
    compilation (its interpreter on the CPU is reached through the `*_triton` functions)."""
    return x.is_cuda and not torch.compiler.is_compiling() and _kernels() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., C] normalized over C in float32, cast back, then scaled by weight [C].

    The Hugging Face order (scale after the cast back). `F.rms_norm` widens a bf16 x to
    float32 itself and rounds its result once, as widening first and narrowing after would,
    in one op instead of three.
    """
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, weight * norm(h)) for h = x + delta, x and delta [T, D] (delta None: h = x).

    A pre-norm block's residual sum and the next norm: one kernel on CUDA instead of three
    (for D up to MAX_KERNEL_WIDTH).
    """
    if use_kernels(x) and x.shape[-1] <= MAX_KERNEL_WIDTH:
        return add_rms_norm_triton(x, delta, weight, eps)
    h = x if delta is None else x + delta
    return h, rms_norm(h, weight, eps)


def add_rms_norm_triton(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm` by its Triton kernel (under Triton's interpreter on the CPU in tests)."""
    n_tokens, d = x.shape
    out = torch.empty_like(x)  # [T, D]
    h = x if delta is None else torch.empty_like(x)  # [T, D]
    if n_tokens:
        has_delta = delta is not None
        delta = delta if has_delta else x  # not read: a placeholder pointer
        _kernels().add_rms_norm[(n_tokens,)](
            x, delta, weight, h, out, d, eps, x.stride(0), delta.stride(0), h.stride(0),
            out.stride(0), HAS_DELTA=has_delta, BLOCK_D=_block(d), num_warps=NORM_WARPS,
            **dependent_launch.kernel_options(x.device))
    return h, out


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, Dh] rotated by cos and `layers.rope_cos_sin`'s sin [T, Dh].

    Hugging Face's x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]: here
    [x2, x1] * [-s1, s2], the same products exactly (a sign moves from one factor to the
    other), with the sign folded into sin once a forward, not negated per call."""
    half = x.shape[-1] // 2
    rolled = x.roll(half, dims=-1)  # [T, heads, Dh]: [x2, x1]
    return x * cos.unsqueeze(1) + rolled * sin.unsqueeze(1)


class QKHeads(NamedTuple):
    """How a layer's q and k heads are normed and rotated (from its `ModelConfig`).

    `norm` (`ModelConfig.qk_norm`): "none"; "full", q over its H*Dh values and k over its
    G*Dh, `weight` [(H+G)*Dh]; "head", each head over its Dh, `weight` [H+G, Dh]. `clip`
    (`ModelConfig.clip_qkv`) clamps q, k and v to [-clip, clip]: after a "full" norm, before a
    "head" one (Hugging Face's orders)."""

    n_heads: int  # H
    n_kv_heads: int  # G
    head_dim: int  # Dh
    norm: str
    weight: torch.Tensor | None
    eps: float
    clip: float | None


def qk_norm_rope(qk: torch.Tensor, heads: QKHeads, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
    """q's and k's heads [T, H+G, Dh] from their projection qk [T, (H+G)*Dh] (the first H
    heads q's), normed as `heads` says, weighted (after the cast back, as `rms_norm`), then
    rotated by cos, sin [T, Dh] (`apply_rope`)."""
    if _kernel_takes(qk, heads):
        return qk_norm_rope_triton(qk, heads, cos, sin)
    n_tokens = qk.shape[0]
    if heads.norm == "full":
        q_width = heads.n_heads * heads.head_dim
        q, k = qk.split((q_width, qk.shape[1] - q_width), dim=-1)
        normed = torch.cat((F.rms_norm(q, (q.shape[1],), eps=heads.eps),
                            F.rms_norm(k, (k.shape[1],), eps=heads.eps)), dim=-1)
        qk = heads.weight * normed
    if heads.clip is not None:
        qk = qk.clamp(-heads.clip, heads.clip)
    qk = qk.reshape(n_tokens, -1, heads.head_dim)  # [T, H+G, Dh]
    if heads.norm == "head":
        qk = rms_norm(qk, heads.weight, heads.eps)
    return apply_rope(qk, cos, sin)


def rotate_and_write(qkv: torch.Tensor, heads: QKHeads, cos: torch.Tensor, sin: torch.Tensor,
                     positions: torch.Tensor, cells: LayerCells) -> torch.Tensor:
    """q [T, H, Dh] from a layer's projection qkv [T, (H+2G)*Dh]: q's and k's heads normed and
    rotated (`qk_norm_rope`), k and v stored in `cells` at `positions` [T] (distinct).

    One kernel on CUDA where the cells are in qkv's dtype (not int8); else `qk_norm_rope` and
    `LayerCells.write`."""
    h, g, dh = heads.n_heads, heads.n_kv_heads, heads.head_dim
    n_tokens = qkv.shape[0]
    if writes_in_kernel(qkv, heads, cells):
        q = qkv.new_empty((n_tokens, h, dh))  # [T, H, Dh]
        _launch_qk_norm_rope(qkv, heads, cos, sin, q, (positions, cells.k, cells.v))
        return q
    qk, v = qkv.split(((h + g) * dh, g * dh), dim=-1)
    qk = qk_norm_rope(qk, heads, cos, sin)  # [T, H+G, Dh]
    if heads.clip is not None:
        v = v.clamp(-heads.clip, heads.clip)
    cells.write(positions, qk[:, h:], v.reshape(n_tokens, g, dh))
    return qk[:, :h]


def writes_in_kernel(qkv: torch.Tensor, heads: QKHeads, cells: LayerCells) -> bool:
    """Whether `rotate_and_write` is one kernel for qkv and these cells: `qk_norm_rope`'s
    kernel runs, and the cells are in qkv's dtype (not int8), each cell's heads contiguous
    rows of Dh, k's and v's laid out alike."""
    dh = heads.head_dim
    return (_kernel_takes(qkv, heads) and cells.k_scale is None and cells.k.dtype == qkv.dtype
            and cells.k.stride()[1:] == (dh, 1) and cells.v.stride() == cells.k.stride())


def _kernel_takes(x: torch.Tensor, heads: QKHeads) -> bool:
    """Whether `qk_norm_rope`'s kernel runs: on CUDA, for a head dim that is a power of two,
    without clipping (the models that clip run the torch ops)."""
    dh = heads.head_dim
    return heads.clip is None and dh & (dh - 1) == 0 and use_kernels(x)


def qk_norm_rope_triton(qk: torch.Tensor, heads: QKHeads, cos: torch.Tensor,
                        sin: torch.Tensor) -> torch.Tensor:
    """`qk_norm_rope` by its Triton kernel (under Triton's interpreter on the CPU in tests)."""
    out = qk.new_empty((qk.shape[0], heads.n_heads + heads.n_kv_heads, heads.head_dim))
    _launch_qk_norm_rope(qk, heads, cos, sin, out, None)
    return out  # [T, H+G, Dh]


def rotate_and_write_triton(qkv: torch.Tensor, heads: QKHeads, cos: torch.Tensor,
                            sin: torch.Tensor, positions: torch.Tensor,
                            cells: LayerCells) -> torch.Tensor:
    """`rotate_and_write`'s kernel, however the cells are (the tests' interpreter)."""
    q = qkv.new_empty((qkv.shape[0], heads.n_heads, heads.head_dim))  # [T, H, Dh]
    _launch_qk_norm_rope(qkv, heads, cos, sin, q, (positions, cells.k, cells.v))
    return q


def _launch_qk_norm_rope(qkv: torch.Tensor, heads: QKHeads, cos: torch.Tensor,
                         sin: torch.Tensor, out: torch.Tensor,
                         write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> None:
    """The kernel over qkv's (or qk's) rows into out; `write` (positions, k cells, v cells)
    stores k and v there, out taking q only."""
    if qkv.stride(1) != 1 or cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError("the qk_norm_rope kernel needs contiguous rows")
    if qkv.shape[0] == 0:
        return
    h, g, dh = heads.n_heads, heads.n_kv_heads, heads.head_dim
    weight = heads.weight.contiguous() if heads.weight is not None else qkv  # qkv: not read
    positions, k_cells, v_cells = write if write is not None else (qkv, qkv, qkv)  # not read
    _kernels().qk_norm_rope[(qkv.shape[0], 2)](
        qkv, weight, cos, sin, out, positions, k_cells, v_cells, h, g, heads.eps,
        qkv.stride(0), cos.stride(0), sin.stride(0), out.stride(0), k_cells.stride(0),
        NORM=NORMS[heads.norm], WRITE=write is not None, HEAD_DIM=dh,
        BLOCK_P=_block(max(h, g)), num_warps=4, **dependent_launch.kernel_options(qkv.device))


def route(
    logits: torch.Tensor, top_k: int, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing from router logits [T, E]: ids [T, K] int64, weights [T, K] float32.

    Softmax over all experts in float32, then the top k (renormalized to sum to 1 if asked).
    """
    if use_kernels(logits):
        return route_triton(logits, top_k, normalize)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E], widened inside
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, K]
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def router_route(
    x: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` of the router's logits x [T, D] @ router [E, D]^T (rounded to x's dtype):
    ids [T, K] int64, weights [T, K] float32.

    On CUDA, for up to ROUTER_MAX_TOKENS tokens, one kernel (the product split over D, the
    last of its programs summing the parts in a fixed order and routing); else `F.linear` and
    `route`.
    """
    if use_kernels(x) and x.shape[0] <= ROUTER_MAX_TOKENS:
        return router_route_triton(x, router, top_k, normalize)
    return route(F.linear(x, router), top_k, normalize)


def add_norm_router_route(
    x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    router: torch.Tensor, top_k: int, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, normed, ids, weights): `add_rms_norm` of x and delta [T, D] (delta None: h = x) by
    norm_weight [D], then `router_route` of normed by router [E, D] (ids [T, K] int64,
    weights [T, K] float32).

    A decode layer's residual sum after attention, the MoE's norm and its routing. On CUDA
    where `NORM_ROUTER_KERNEL`, for up to ROUTER_MAX_TOKENS tokens and D up to
    MAX_KERNEL_WIDTH, one kernel (`add_norm_router_route_triton`: `add_rms_norm`'s bytes for h
    and normed); else the two ops as they run apart.
    """
    if (NORM_ROUTER_KERNEL and use_kernels(x) and x.shape[0] <= ROUTER_MAX_TOKENS
            and x.shape[-1] <= MAX_KERNEL_WIDTH):
        return add_norm_router_route_triton(x, delta, norm_weight, eps, router, top_k,
                                            normalize)
    h, normed = add_rms_norm(x, delta, norm_weight, eps)
    return (h, normed, *router_route(normed, router, top_k, normalize))


def rope_and_mask_triton(
    positions: torch.Tensor, inv_freq: torch.Tensor, n_ctx: int, window: int | None,
    dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cos, sin [T, Dh], mask [T, N = n_ctx]) in `dtype`: `layers.rope_cos_sin` and
    `layers.attention_mask` of positions [T] int64 as one kernel (under Triton's interpreter
    on the CPU in tests, whose sin and cos may differ from torch's in the last bit; on CUDA
    the kernel calls the sinf and cosf torch's own kernels call). inv_freq [Dh/2] float32."""
    n_tokens, half = positions.shape[0], inv_freq.shape[0]
    if positions.dtype != torch.int64 or inv_freq.dtype != torch.float32 or half & (half - 1):
        raise ValueError(f"rope_and_mask_triton needs int64 positions and float32 inv_freq of "
                         f"a power-of-two length, got {positions.dtype} and {inv_freq.dtype} "
                         f"[{half}]")
    cos = torch.empty((n_tokens, 2 * half), dtype=dtype, device=positions.device)  # [T, Dh]
    sin = torch.empty_like(cos)  # [T, Dh]
    mask = torch.empty((n_tokens, n_ctx), dtype=dtype, device=positions.device)  # [T, N]
    if n_tokens:
        _kernels().rope_and_mask[(n_tokens, -(-n_ctx // MASK_BLOCK_CELLS))](
            positions, inv_freq.contiguous(), cos, sin, mask, n_ctx,
            window if window is not None else 0, cos.stride(0), sin.stride(0), mask.stride(0),
            HAS_WINDOW=window is not None, LIBDEVICE=positions.is_cuda, HALF=half,
            BLOCK_N=MASK_BLOCK_CELLS, num_warps=4,
            **dependent_launch.kernel_options(positions.device))
    return cos, sin, mask
