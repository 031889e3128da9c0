"""The shared layers: RoPE tables, grouped-query attention over the K/V, the MoE block, SwiGLU,
the decoder layer. The small per-token ops they call (RMSNorm, the rotation, top-k routing)
are `strata.engine.model.ops`, one Triton kernel each on CUDA.

Dimension letters: T tokens in the batch, D hidden size, H query heads, G kv heads (R = H / G
query heads per kv head), Dh head dim, N K/V cells attended, E experts, K experts per token,
F expert width, Fs shared-expert width.

Weights are plain tensors held by small classes built from a role -> tensor dict (roles are
listed in `strata.engine.model.families`). Nothing here reads a tensor's values on the host: no
`.item()`, no data-dependent branching, so decode (T = 1), or a short prompt chunk, can be
captured in a CUDA graph.
Numerics follow the Hugging Face implementations: RMSNorm and softmax in float32, RoPE tables in
float32 cast to the model dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from strata.engine.experts import Experts
from strata.engine.model import decode_attention, ops, products
from strata.engine.model.config import ModelConfig
from strata.engine.model.kv_cells import LayerCells
from strata.engine.model.ops import (
    QKHeads,
    add_norm_router_route,
    add_rms_norm,
    rms_norm,
    rope_and_mask_triton,
    rotate_and_write,
    route,
    router_route,
)

__all__ = ["ATTENTION_PIECE_TOKENS", "Attention", "AttentionSpan", "DecoderLayer", "MoE",
           "add_rms_norm", "attention_mask", "rms_norm", "rope_and_mask", "rope_cos_sin",
           "rope_inv_freq", "route", "swiglu"]

Weights = dict[str, torch.Tensor]

# A later chunk of at most this many tokens, or a chunk past a sliding window, attends in pieces
# of at most this many (`MoEModel.forward`): a piece's mask is [piece, N] in the model's dtype,
# copied per query head of a kv head, and would otherwise grow with the chunk. A longer chunk,
# or one from position 0, attends in one causal call, no mask. The experts see the whole chunk
# at once either way, so a long prompt read in larger chunks reads (or uploads) each expert
# fewer times.
ATTENTION_PIECE_TOKENS = 512


def rope_inv_freq(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """[Dh/2] float32 inverse frequencies (computed on the CPU, as Hugging Face does)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return (1.0 / (theta**exponents)).to(device)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, Dh] for positions [T] int64 (halves repeated, the "rotate half" layout),
    sin's first half negated: what multiplies x rolled by half a head (`ops.apply_rope`)."""
    freqs = positions.unsqueeze(1).float() * inv_freq.unsqueeze(0)  # [T, Dh/2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [T, Dh]
    sin = angles.sin().to(dtype)
    half = sin.shape[-1] // 2
    return angles.cos().to(dtype), torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


def attention_mask(
    positions: torch.Tensor, n_ctx: int, sliding_window: int | None, dtype: torch.dtype
) -> torch.Tensor:
    """[T, N] in `dtype`, added to the scores: 0 where token t (at positions[t]) may attend
    cell n, -inf elsewhere. Causal (n <= position) and, with a window, n > position - window
    (as Hugging Face's).

    Made once a forward for every layer: given a boolean mask, the fused attention kernels
    would convert it to this one in each call (two more kernels a layer)."""
    cells = torch.arange(n_ctx, device=positions.device)  # [N]
    pos = positions.unsqueeze(1)  # [T, 1]
    allowed = cells.unsqueeze(0) <= pos  # [T, N]
    if sliding_window is not None:
        allowed &= cells.unsqueeze(0) > pos - sliding_window
    zero = torch.zeros((), dtype=dtype, device=positions.device)
    return torch.where(allowed, zero, float("-inf"))


def rope_and_mask(
    positions: torch.Tensor, inv_freq: torch.Tensor, n_ctx: int, sliding_window: int | None,
    dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cos, sin [T, Dh], mask [T, N = n_ctx]): `rope_cos_sin` and `attention_mask` of a
    forward over a fixed window; as one kernel on CUDA where `ops.ROPE_MASK_KERNEL`, for a
    head dim that is a power of two (the kernel's block), the torch ops for any other."""
    half = inv_freq.shape[0]
    if ops.ROPE_MASK_KERNEL and ops.use_kernels(positions) and not half & (half - 1):
        return rope_and_mask_triton(positions, inv_freq, n_ctx, sliding_window, dtype)
    cos, sin = rope_cos_sin(positions, inv_freq, dtype)
    return cos, sin, attention_mask(positions, n_ctx, sliding_window, dtype)


class AttentionSpan(NamedTuple):
    """The tokens of one attention call: rows [a, b) of a forward's T tokens.

    `cos`, `sin` [b - a, Dh] and `positions` [b - a] are those rows'; the call attends over
    cells [0, n_ctx) through `mask` [b - a, n_ctx] (`attention_mask`), or (None) causally when
    `causal` (the rows are the last b - a cells of [0, n_ctx): row i attends cells
    [0, n_ctx - (b - a) + i]), or (None, not causal) every cell (decode).
    """

    rows: slice
    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor
    n_ctx: int
    mask: torch.Tensor | None
    causal: bool


class Attention:
    """Grouped-query attention; q, k and v fused into one projection."""

    def __init__(self, cfg: ModelConfig, w: Weights) -> None:
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.wqkv = torch.cat((w["q"], w["k"], w["v"]))  # [H*Dh + 2*G*Dh, D]
        self.bqkv = torch.cat((w["q_bias"], w["k_bias"], w["v_bias"])) if cfg.qkv_bias else None
        self.wo = w["o"]  # [D, H*Dh]
        self.bo = w.get("o_bias")  # [D] or None
        # q's and k's norm weights side by side, as q's and k's rows sit in the projection:
        # [(H+G)*Dh] ("full"), [H+G, Dh] ("head": each head's), or None.
        qk_weight = None
        if cfg.qk_norm == "full":
            qk_weight = torch.cat((w["q_norm"], w["k_norm"]))
        elif cfg.qk_norm == "head":
            q_norm, k_norm = w["q_norm"], w["k_norm"]  # [Dh] each
            qk_weight = torch.cat((q_norm.expand(self.n_heads, -1),
                                   k_norm.expand(self.n_kv_heads, -1)))
        self.heads = QKHeads(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.qk_norm, qk_weight,
                             cfg.rms_norm_eps, cfg.clip_qkv)

    def forward(self, x: torch.Tensor, *span) -> torch.Tensor:
        """x [T, D] -> [T, D]: q/k/v's product of x, then `attend` (its `span` arguments)."""
        return self.attend(products.linear(x, self.wqkv, self.bqkv), *span)

    def attend(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        cells: LayerCells,
        n_ctx: int,
        mask: torch.Tensor | None,
        causal: bool,
        project: bool = True,
    ) -> torch.Tensor:
        """The tokens' q/k/v projection qkv [T, H*Dh + 2*G*Dh] -> [T, D] (the decoder layer
        computes qkv with the norm before it: `products.add_norm_linear`). Writes K/V at
        `positions`, attends over cells [0, n_ctx). Without `project`, attention's output
        [T, H*Dh] before the output product (the decoder layer runs that product with the
        MoE's norm and routing: `products.linear_add_norm_route`).

        `cells` is the layer's K/V (bf16, fp32 or int8 cells: int8 rows are quantized as they
        are written, and the attended cells dequantized to qkv's dtype as they are read).
        mask [T, N] (`attention_mask`: added to the scores) or None; None with `causal` means
        causally, the T tokens being the last T of the N cells (a prompt chunk); None without
        `causal` means every cell (one token: decode).
        """
        # One token's output product reads its weights beside attention (`products`).
        if not causal and decode_attention.rotates(qkv, self.heads, cells, n_ctx, positions):
            # One token over a short window: the rotation, the K/V write and attention as one
            # kernel.
            out = decode_attention.rotate_attend(qkv, self.heads, cos, sin, positions, cells,
                                                 n_ctx, mask, self.scale)  # [1, H*Dh]
            return products.linear(out, self.wo, self.bo) if project else out  # [1, D]
        # q's and k's heads normed and rotated side by side, k and v stored: one op.
        q = rotate_and_write(qkv, self.heads, cos, sin, positions, cells)  # [T, H, Dh]
        keys, values = cells.read(n_ctx, q.dtype)  # [N, G, Dh] each
        keys, values = keys.transpose(0, 1), values.transpose(0, 1)  # [G, N, Dh] each
        if causal and mask is None:
            out = self._prompt(q, keys, values)
        elif decode_attention.takes(q, keys, values):  # one token on CUDA: one kernel
            out = decode_attention.attend_one(q, keys, values, mask, self.scale, positions)
        else:
            out = self._folded(q, keys, values, mask)
        return products.linear(out, self.wo, self.bo) if project else out  # [T, D]

    def _prompt(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """A prompt chunk, the last T of the N cells: causal, aligned at the last cell (row t
        attends cells [0, N - T + t]); kv heads repeated to H."""
        n_tokens, h, _ = q.shape
        n_ctx = keys.shape[1]
        r = h // self.n_kv_heads
        if r > 1:
            keys = keys.repeat_interleave(r, dim=0)  # [H, N, Dh]: query head i reads kv head i // R
            values = values.repeat_interleave(r, dim=0)  # [H, N, Dh]
        # From position 0 (N == T) `is_causal`; a later chunk a lower-right causal bias, which
        # the fused kernels take without a mask in memory (`torch.nn.attention.bias`).
        bias = None if n_ctx == n_tokens else causal_lower_right(n_tokens, n_ctx)
        # 4-D [1, heads, length, Dh] operands: the layout the fused kernels take.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
            attn_mask=bias, is_causal=bias is None, scale=self.scale,
        )[0]  # [H, T, Dh]
        return out.transpose(0, 1).reshape(n_tokens, h * self.head_dim)

    def _folded(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """The R query heads of each kv head folded into the query axis: no K/V copies."""
        n_tokens, h, dh = q.shape
        g = self.n_kv_heads
        r = h // g
        q = q.view(n_tokens, g, r, dh).permute(1, 2, 0, 3).reshape(g, r * n_tokens, dh)
        if mask is not None:
            # [T, N] -> [R*T, N], rows ordered (r, t) like q's.
            mask = mask.unsqueeze(0).expand(r, -1, -1).reshape(r * n_tokens, -1)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask,
            scale=self.scale,
        )[0]  # [G, R*T, Dh]
        return out.view(g, r, n_tokens, dh).permute(2, 0, 1, 3).reshape(n_tokens, h * dh)


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """x [T, D] through a SwiGLU FFN: gate_up [2F, D] (gate rows first), down [D, F]."""
    h = F.linear(x, gate_up)  # [T, 2F]
    width = gate_up.shape[0] // 2
    return F.linear(F.silu(h[:, :width]) * h[:, width:], down)  # [T, D]


class MoE:
    """The MoE feed-forward: router, routed experts (through `Experts`), optional shared expert."""

    def __init__(self, cfg: ModelConfig, layer: int, w: Weights) -> None:
        self.layer = layer
        self.top_k = cfg.top_k
        self.normalize = cfg.norm_topk_prob
        self.router = w["router"]  # [E, D]
        self.shared_gate_up = None
        if cfg.shared_expert_width:
            self.shared_gate_up = torch.cat((w["shared_gate"], w["shared_up"]))  # [2Fs, D]
            self.shared_down = w["shared_down"]  # [D, Fs]
            self.shared_router = w["shared_router"]  # [1, D]

    def forward(self, x: torch.Tensor, experts: Experts) -> torch.Tensor:
        """x [T, D] -> [T, D]: the routing, then `forward_routed`."""
        ids, weights = router_route(x, self.router, self.top_k, self.normalize)  # [T, K]
        return self.forward_routed(x, ids, weights, experts)

    def forward_routed(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                       experts: Experts) -> torch.Tensor:
        """x [T, D] -> [T, D], routed already: ids [T, K] int64, weights [T, K] float32
        (`router_route` of x by `router`, or `add_norm_router_route` as `DecoderLayer.forward`
        routes it), the shared expert (if any) added."""
        out = experts.forward(self.layer, x, ids, weights)  # [T, D]
        if self.shared_gate_up is not None:
            shared = swiglu(x, self.shared_gate_up, self.shared_down)  # [T, D]
            out = out + torch.sigmoid(F.linear(x, self.shared_router)) * shared
        return out


class DecoderLayer:
    """Pre-norm residual block: x + attention(norm(x)), then h + moe(norm(h))."""

    def __init__(self, cfg: ModelConfig, layer: int, w: Weights) -> None:
        self.layer = layer
        self.eps = cfg.rms_norm_eps
        self.attn_norm = w["attn_norm"]  # [D]
        self.mlp_norm = w["mlp_norm"]  # [D]
        self.attn = Attention(cfg, w)
        self.moe = MoE(cfg, layer, w)

    def forward(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        spans: list[AttentionSpan],
        cells: LayerCells,
        experts: Experts,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream x [T, D] and what the layer before adds to it, delta [T, D] (None
        for the first layer) -> this layer's (stream, delta): the sum x + delta is left to the
        next norm (`add_rms_norm`: one kernel for both on CUDA; with one attention call
        `products.add_norm_linear`, the norm inside q/k/v's product for a decode step's token
        on CUDA). Attention span by span, in order (a span attends the K/V the spans before it
        wrote), then the MoE over all T tokens at once: its sum, norm and routing one op
        (`add_norm_router_route`, one kernel on CUDA where `ops.NORM_ROUTER_KERNEL`; with one
        attention call, `products.linear_add_norm_route`: attention's output product in that
        op's kernel too, for a decode step's token on CUDA)."""
        attn, moe = self.attn, self.moe
        if len(spans) == 1:  # the norm and q/k/v's product one kernel for one token on CUDA
            span = spans[0]
            x, qkv = products.add_norm_linear(x, delta, self.attn_norm, self.eps, attn.wqkv,
                                              attn.bqkv)  # [T, D], [T, H*Dh + 2*G*Dh]
            out = attn.attend(qkv, span.cos, span.sin, span.positions, cells, span.n_ctx,
                              span.mask, span.causal, project=False)  # [T, H*Dh]
            h, normed, ids, weights = products.linear_add_norm_route(
                out, attn.wo, attn.bo, x, self.mlp_norm, self.eps, moe.router, moe.top_k,
                moe.normalize)  # [T, D] each, then [T, K] each
            return h, moe.forward_routed(normed, ids, weights, experts)
        x, normed = add_rms_norm(x, delta, self.attn_norm, self.eps)  # [T, D] each
        qkvs = [products.linear(normed[span.rows], attn.wqkv, attn.bqkv) for span in spans]
        attended = torch.cat([
            attn.attend(qkv, span.cos, span.sin, span.positions, cells, span.n_ctx, span.mask,
                        span.causal)
            for qkv, span in zip(qkvs, spans, strict=True)
        ])  # [T, D]
        h, normed, ids, weights = add_norm_router_route(
            x, attended, self.mlp_norm, self.eps, moe.router, moe.top_k, moe.normalize
        )  # [T, D] each, then [T, K] each
        return h, moe.forward_routed(normed, ids, weights, experts)
