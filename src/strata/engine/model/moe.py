"""The MoE language model: embedding, decoder layers, final norm, logits; and `load_model`.

Dimension letters: T tokens in the batch, D hidden size, V vocabulary, N K/V cells.

One model class serves every family: the families differ in which tensors they have (roles,
see `strata.engine.model.families`) and the shared layers in `strata.engine.model.layers` act on the
roles present. Experts are computed through the `Experts` interface only.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F

from strata.engine.experts import Experts, ExpertStore, ResidentExperts
from strata.engine.model import families, products
from strata.engine.model.checkpoint import Checkpoint, expert_store
from strata.engine.model.config import ModelConfig
from strata.engine.model.kv_cells import LayerCells
from strata.engine.model.layers import (
    ATTENTION_PIECE_TOKENS,
    AttentionSpan,
    DecoderLayer,
    add_rms_norm,
    attention_mask,
    rope_and_mask,
    rope_cos_sin,
    rope_inv_freq,
)

__all__ = ["RUNTIME_DTYPES", "KVCells", "MoEModel", "load_model", "runtime_dtype"]

# The dtypes the model computes in: bf16 (the GPU's), or fp32 (the CPU's reference numerics).
RUNTIME_DTYPES = (torch.bfloat16, torch.float32)


class KVCells(Protocol):
    """The K/V as the model reads and writes it (`strata.engine.kv.KVCache` is one): per layer
    its cells (`LayerCells`: K and V [N, G, Dh] over the mapped cells [0, mapped_cells), and
    int8's scales); `dtype` is the model's, what the cells are read into."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def mapped_cells(self) -> int: ...
    def layer(self, layer: int) -> LayerCells: ...


class MoEModel:
    """A loaded model: plain weight tensors on `device`, experts behind `experts`.

    `experts_dtype` names how the experts are kept: `experts_quant` or else `dtype`."""

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        global_weights: dict[str, torch.Tensor],
        layers: list[DecoderLayer],
        experts: Experts,
        experts_quant: str | None = None,
    ) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        self.experts = experts
        # The experts' stored format (`strata.engine.experts.quant.WEIGHT_FORMATS`), None: in
        # `dtype`; they compute in `dtype` either way.
        self.experts_quant = experts_quant
        self.layers = layers
        self.embed = global_weights["embed"]  # [V, D]
        self.final_norm = global_weights["final_norm"]  # [D]
        self.lm_head = global_weights.get("lm_head", self.embed)  # [V, D] (tied: the embedding)
        self.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, device)  # [Dh/2]

    @property
    def experts_dtype(self) -> str:
        """How the experts are kept: their quantized format, or the model's dtype ("bfloat16")."""
        return self.experts_quant or str(self.dtype).removeprefix("torch.")

    def forward(
        self, token_ids: torch.Tensor, start_pos: int, kv: KVCells, *, last_only: bool = False
    ) -> torch.Tensor:
        """Logits float32 [T, V] for token_ids [T] at positions [start_pos, start_pos + T).

        Writes K/V for those positions and attends causally over cells [0, start_pos + T): a
        chunk from position 0, or one longer than `ATTENTION_PIECE_TOKENS`, in one causal
        call (row t attends cells [0, start_pos + t]); otherwise, and past a sliding window,
        in pieces of at most `ATTENTION_PIECE_TOKENS` through masks; one token over every
        cell before it. Each layer's MoE sees all T tokens at once. `last_only` returns
        [1, V] for the last token only (a long prompt's [T, V] is large).
        """
        n_tokens = self._check_call(token_ids, kv)
        if start_pos < 0 or start_pos + n_tokens > kv.mapped_cells:
            raise ValueError(
                f"positions [{start_pos}, {start_pos + n_tokens}) do not fit the K/V's "
                f"{kv.mapped_cells} mapped cells"
            )
        positions = torch.arange(start_pos, start_pos + n_tokens, device=self.device)  # [T]
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.dtype)  # [T, Dh]
        window = self.config.sliding_window
        end = start_pos + n_tokens
        # The fused causal kernel over [0, end), aligned at the last cell: no mask, so no
        # pieces. A later chunk of at most a piece attends through its mask instead: on the
        # H200 the aligned call was the slower there (0.65x for chunks of 512), the faster for
        # chunks of 4,096 (1.8x the pieces' prefill at 16,384 tokens; bench/results/
        # prefill-h200-2026-12-01.md, prefill-graphs-h200-2026-12-02.md).
        causal = start_pos == 0 or n_tokens > ATTENTION_PIECE_TOKENS
        if n_tokens > 1 and causal and (window is None or end <= window):
            spans = [AttentionSpan(slice(0, n_tokens), cos, sin, positions, end, None, True)]
        else:
            spans = []
            for a in range(0, n_tokens, ATTENTION_PIECE_TOKENS):
                rows = slice(a, min(a + ATTENTION_PIECE_TOKENS, n_tokens))
                n_ctx = start_pos + rows.stop
                mask = None  # one token attends every cell before it
                if (window is not None and n_ctx > window) or rows.stop - a > 1:
                    mask = attention_mask(positions[rows], n_ctx, window, self.dtype)
                    # [b - a, N]
                spans.append(AttentionSpan(rows, cos[rows], sin[rows], positions[rows], n_ctx,
                                           mask, False))
        return self._run(token_ids, spans, kv, last_only)

    def forward_at(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: KVCells,
        n_ctx: int,
        *,
        last_only: bool = False,
        logit_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Like `forward`, with positions [T] int64 given as a tensor and a fixed window.

        Attends over cells [0, n_ctx) through a mask built from `positions` on the device, so
        the shapes depend only on T and n_ctx: a decode step (T = 1), or a prompt chunk, can be
        captured in a CUDA graph and replayed with new values written into `token_ids` and
        `positions`. The caller guarantees positions < n_ctx <= kv.mapped_cells (not checked:
        that would sync). `logit_rows` [R] int64 on the device returns [R, V] for those rows
        only (a padded chunk's real last token); else `last_only` as in `forward`.
        """
        n_tokens = self._check_call(token_ids, kv)
        if positions.shape != (n_tokens,) or not 0 < n_ctx <= kv.mapped_cells:
            raise ValueError(
                f"positions must be [{n_tokens}] and n_ctx in [1, {kv.mapped_cells}], got "
                f"{list(positions.shape)} and {n_ctx}"
            )
        cos, sin, mask = rope_and_mask(positions, self.inv_freq, n_ctx,
                                       self.config.sliding_window, self.dtype)
        # [T, Dh], [T, Dh], [T, N]
        span = AttentionSpan(slice(0, n_tokens), cos, sin, positions, n_ctx, mask, False)
        return self._run(token_ids, [span], kv, last_only, logit_rows)

    def _check_call(self, token_ids: torch.Tensor, kv: KVCells) -> int:
        cfg = self.config
        if token_ids.dim() != 1 or token_ids.shape[0] < 1 or token_ids.dtype != torch.int64:
            raise ValueError(
                f"token_ids must be a non-empty 1-D int64 tensor, got {token_ids.dtype} "
                f"{list(token_ids.shape)}"
            )
        if token_ids.device != self.device:
            raise ValueError(
                f"token_ids are on {token_ids.device}, the model on {self.device}: move them first"
            )
        geometry = (kv.n_layers, kv.n_kv_heads, kv.head_dim, kv.dtype)
        if geometry != (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, self.dtype):
            raise ValueError(
                f"K/V geometry (layers, kv heads, head dim, dtype) {geometry} does not match the "
                f"model's {(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, self.dtype)}"
            )
        return token_ids.shape[0]

    def _run(
        self, token_ids: torch.Tensor, spans: list[AttentionSpan], kv: KVCells, last_only: bool,
        logit_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = F.embedding(token_ids, self.embed)  # [T, D]
        delta = None  # what the last layer adds to x, left to the next norm
        for layer in self.layers:
            x, delta = layer.forward(x, delta, spans, kv.layer(layer.layer), self.experts)
            # [T, D] each
        if logit_rows is not None:
            x, delta = x.index_select(0, logit_rows), delta.index_select(0, logit_rows)
            # [R, D] each
        elif last_only:
            x, delta = x[-1:], delta[-1:]  # [1, D] each
        _, x = add_rms_norm(x, delta, self.final_norm, self.config.rms_norm_eps)
        return products.logits(x, self.lm_head)  # [T, V] float32


def runtime_dtype(cfg: ModelConfig, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a model computes in: `dtype`, or (None) the checkpoint's own if it is one of
    RUNTIME_DTYPES, else bfloat16. ValueError for a dtype outside RUNTIME_DTYPES."""
    if dtype is None:
        dtype = cfg.dtype if cfg.dtype in RUNTIME_DTYPES else torch.bfloat16
    if dtype not in RUNTIME_DTYPES:
        raise ValueError(f"dtype {dtype} is not supported; supported: bfloat16, float32")
    return dtype


def load_model(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    progress: bool = False,
    make_experts: Callable[[ExpertStore], Experts] | None = None,
    experts_quant: str | None = None,
) -> MoEModel:
    """Load a checkpoint directory onto `device` in `dtype` (None: the checkpoint's own), its
    experts quantized at load into `experts_quant` (one of
    `strata.engine.experts.quant.WEIGHT_FORMATS`; None: kept in `dtype`).

    Without `make_experts`, every expert is resident on `device` (`ResidentExperts`); with it,
    the experts are what it makes of the host store (pinned on CUDA), e.g. the expert cache
    (`strata.engine.runtime.load` composes one). `progress` shows a tqdm bar over the tensors read.
    Raises `CheckpointError` for a bad checkpoint, ValueError for a bad dtype.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        # Tensors report "cuda:0", not "cuda": name the device fully so that they compare equal.
        device = torch.device("cuda", torch.cuda.current_device())
    ckpt = Checkpoint.open(path)
    cfg = ckpt.config
    dtype = runtime_dtype(cfg, dtype)
    fam = families.family(cfg.family)
    total = len(families.expected_tensors(cfg))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, desc=f"loading {Path(path).name}", unit="tensor")

    def read(name: str) -> torch.Tensor:
        tensor = ckpt.tensor(name).to(device=device, dtype=dtype)
        if bar is not None:
            bar.update()
        return tensor

    try:
        names = fam.global_names(cfg)
        global_weights = {role: read(names[role]) for role in families.global_shapes(cfg)}
        layers = []
        for layer in range(cfg.n_layers):
            names = fam.layer_names(cfg, layer)
            weights = {role: read(names[role]) for role in families.layer_shapes(cfg)}
            layers.append(DecoderLayer(cfg, layer, weights))
        store = expert_store(
            ckpt, dtype, pin_memory=make_experts is not None and device.type == "cuda",
            on_tensor=bar.update if bar is not None else None, quant=experts_quant,
        )
        if make_experts is None:
            experts: Experts = ResidentExperts(store, device, dtype)
        else:
            experts = make_experts(store)
    finally:
        if bar is not None:
            bar.close()
        ckpt.close()
    return MoEModel(cfg, device, dtype, global_weights, layers, experts, experts_quant)
