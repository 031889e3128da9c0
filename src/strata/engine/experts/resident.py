"""The one interface through which the MoE layer runs its experts, and `ResidentExperts`.

Dimension letters: T tokens, D hidden size, E experts per layer, K experts per token, F expert
width.

The MoE layer only ever calls `Experts.forward`; `ResidentExperts` (every expert on one device)
implements it here, and the expert cache (`strata.engine.cache.cached_experts`) implements the
same protocol.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from strata.engine.experts import grouped, sorted_grouped
from strata.engine.experts.activation import silu_and_mul
from strata.engine.experts.blobs import BlobStack
from strata.engine.experts.combine import weighted_sum
from strata.engine.experts.store import ExpertStore

__all__ = ["Experts", "ResidentExperts"]


class Experts(Protocol):
    """How the MoE layer gets its experts computed. Implementations must be deterministic."""

    def forward(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """sum_k topk_weights[t, k] * expert[topk_ids[t, k]](x[t]) for each token t.

        x [T, D] in the model dtype; topk_ids [T, K] int64; topk_weights [T, K] float32.
        Returns [T, D] in the model dtype; the sum over k runs in order k = 0..K-1 in float32.
        """
        ...


class ResidentExperts:
    """Every expert of every layer resident on one device, stacked per layer.

    Per layer, gate_up [E, 2F, D] and down [E, D, F] are strided views into one [E, blob]
    buffer (on the CPU with the store's dtype, the store's own memory: no copy). A store of
    quantized blobs (`ExpertStore.quant`) stays quantized on the device, read through its
    `BlobStack`: decode by the quantized kernels, a prompt chunk a batch of experts at a time,
    each dequantized once for its tokens (the grouped products read the others in place).

    Two paths, chosen by T alone (never by routed data, so capture-safe for decode):
    - T == 1 (decode, what a CUDA graph captures): the K routed experts by
      `strata.engine.experts.grouped.expert_rows`, from the stacked weights by the routed ids;
      no host sync, static shapes. On CUDA with Triton its kernels read the weights in place
      (unquantized, the weighted sum inside the last of them: `grouped.expert_sum_triton`);
      elsewhere it gathers the K blobs (`index_select`) for two batched matmuls, the most
      workspace this path takes (`strata.engine.cache.budget.workspace_bytes`).
    - otherwise (a prompt chunk, however short): where `sorted_grouped.available` (bf16 on a
      Hopper GPU) and `grouped_prefill` is not False, two grouped matrix products over the rows
      sorted by expert (`strata.engine.experts.sorted_grouped`), no host sync; quantized
      experts there are dequantized a batch at a time, two grouped products a batch
      (`BlobStack.grouped_rows`), after one host sync for the per-expert counts; elsewhere a
      loop over the experts actually routed, each over its tokens (sorted by expert), reading
      the weights in place, with that one host sync.
    Each (token, k) output lands in its own row of a [T*K, D] buffer (the grouped products' rows
    stay sorted by expert), then the K rows are weighted and summed in order
    (`strata.engine.experts.combine.weighted_sum`): no atomics, a fixed summation order.
    """

    def __init__(
        self, store: ExpertStore, device: str | torch.device, dtype: torch.dtype | None = None,
        grouped_prefill: bool | None = None,
    ) -> None:
        self.device = torch.device(device)
        # None: the grouped products where they are available; False: always the loop (a
        # benchmark's baseline).
        self.grouped_prefill = grouped_prefill
        self.dtype = dtype or store.dtype
        self.n_layers = store.n_layers
        self.n_experts = store.n_experts
        f, d = store.expert_width, store.hidden_size
        self.expert_width, self.hidden_size = f, d
        self.quant = store.quant
        self._stacks: list[BlobStack] = []  # per layer, over [E, blob]
        for layer in range(store.n_layers):
            blobs = store.layer_blobs(layer)  # [E, blob] uint8
            if self.quant is None:
                # Converted to the compute dtype as whole blobs: [E, 3*F*D] in `dtype`.
                blobs = blobs.view(store.dtype).to(device=self.device, dtype=self.dtype)
                blobs = blobs.view(torch.uint8)
            else:
                blobs = blobs.to(device=self.device)
            self._stacks.append(BlobStack(blobs, self.dtype, self.quant, f, d))
        # A decode call's K rows summed inside the last `down` programs (one kernel less, the
        # same bytes: `grouped.expert_sum_triton`), where the Triton kernels run unquantized
        # experts; this is its counter (one stream, so one for every layer).
        self._sum_arrivals = (grouped.sum_arrivals(d, self.device)
                              if self.quant is None and not grouped.copies_weights(self.device)
                              else None)

    def gate_up(self, layer: int) -> torch.Tensor:
        """[E, 2F, D]: every expert's gate rows then up rows, a view into the layer's blobs
        (unquantized experts only)."""
        return self._stacks[layer].gate_up_all()

    def down(self, layer: int) -> torch.Tensor:
        """[E, D, F]: every expert's down matrix, a view into the layer's blobs (unquantized
        experts only)."""
        return self._stacks[layer].down_all()

    @property
    def prompt_capturable(self) -> bool:
        """Whether a prompt chunk's call syncs nothing with the host, so a CUDA graph can hold
        it: the grouped products' path (the loop over experts reads its counts on the host)."""
        return (self.grouped_prefill is not False and self.quant is None
                and sorted_grouped.available_for(self.device, self.dtype))

    def forward(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        if topk_ids.shape[0] == 1:
            if self._sum_arrivals is not None and not torch.compiler.is_compiling():
                return grouped.expert_sum_triton(
                    self.gate_up(layer), self.down(layer), topk_ids.reshape(-1),
                    x.expand(topk_ids.shape[1], -1), topk_weights.float().contiguous(),
                    self._sum_arrivals)  # [1, D]
            out = self._gathered(layer, x, topk_ids)
        elif self.prompt_capturable:
            return sorted_grouped.sorted_grouped_sum(
                self.gate_up(layer), self.down(layer), x, topk_ids, topk_weights)  # [T, D]
        else:
            out = self._per_expert(layer, x, topk_ids)
        # [T*K, D] -> [T, D]: weight and sum over K in float32, in order.
        return weighted_sum(out, topk_weights, x.dtype)

    def _gathered(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        n_tokens, top_k = topk_ids.shape
        ids = topk_ids.reshape(-1)  # [T*K]
        x_rows = x.unsqueeze(1).expand(n_tokens, top_k, -1).reshape(n_tokens * top_k, -1)
        return self._stacks[layer].expert_rows(ids, x_rows)  # [T*K, D]

    def _per_expert(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        n_tokens, top_k = topk_ids.shape
        ids = topk_ids.reshape(-1)  # [T*K]
        order = torch.argsort(ids, stable=True)  # [T*K] rows grouped by expert, tokens ascending
        counts = torch.bincount(ids, minlength=self.n_experts).tolist()  # the one host sync
        out = x.new_empty(n_tokens * top_k, x.shape[1])  # [T*K, D]
        routed = [expert for expert, count in enumerate(counts) if count]
        if self.grouped_prefill is not False and sorted_grouped.available(x):
            # Quantized blobs (an unquantized stack takes `sorted_grouped_sum` in `forward`):
            # dequantized a batch at a time, two grouped products a batch.
            y = self._stacks[layer].grouped_rows(
                routed, x.index_select(0, order // top_k),
                [counts[expert] for expert in routed])  # [T*K, D] sorted by expert
            return out.index_copy_(0, order, y)
        ends = np.cumsum([counts[expert] for expert in routed]).tolist()
        weights = self._stacks[layer].each_weights(routed)  # dequantized in batches if need be
        for expert, end, (gate_up, down) in zip(routed, ends, weights, strict=True):
            count = counts[expert]
            rows = order[end - count : end]  # [n] flat (token, k) rows routed to `expert`
            h = F.linear(x.index_select(0, rows // top_k), gate_up)  # [n, 2F]
            act = silu_and_mul(h)  # [n, F]
            out.index_copy_(0, rows, F.linear(act, down))  # [n, D]
        return out
