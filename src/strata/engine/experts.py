"""The experts: a host store of blobs, and the one interface through which the MoE layer runs them.

Dimension letters: T tokens, D hidden size, E experts per layer, K experts per token, F expert
width.

A *blob* is one expert's bytes laid out contiguously: gate [F, D] | up [F, D] | down [D, F], in
the model dtype. It is the unit a VRAM expert cache copies into a slot. Because gate and up are
adjacent, the first 2*F*D elements of a blob are the fused gate_up matrix [2F, D].

The MoE layer only ever calls `Experts.forward`; `ResidentExperts` (every expert on one device)
implements it here, and the expert cache of a later stage implements the same protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from strata.engine import families
from strata.engine.grouped_experts import expert_rows

if TYPE_CHECKING:
    from strata.engine.checkpoint import Checkpoint

__all__ = ["ExpertStore", "Experts", "ResidentExperts"]


class ExpertStore:
    """All experts of all layers in host RAM, as blobs: per layer one uint8 tensor [E, blob_bytes].

    Row `e` of layer `l` is the blob of expert (l, e). `pin_memory` page-locks the buffers so
    that uploads to a CUDA device can be asynchronous.
    """

    def __init__(
        self, layers: list[torch.Tensor], hidden_size: int, expert_width: int, dtype: torch.dtype
    ) -> None:
        self.hidden_size = hidden_size
        self.expert_width = expert_width
        self.dtype = dtype
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.blob_bytes = 3 * expert_width * hidden_size * itemsize
        if not layers:
            raise ValueError("an ExpertStore needs at least one layer")
        for i, buf in enumerate(layers):
            if buf.dtype != torch.uint8 or buf.dim() != 2 or buf.shape[1] != self.blob_bytes:
                raise ValueError(
                    f"layer {i}: expected a uint8 tensor [E, {self.blob_bytes}], got "
                    f"{buf.dtype} {list(buf.shape)}"
                )
            if buf.shape[0] != layers[0].shape[0]:
                raise ValueError(
                    f"layer {i} has {buf.shape[0]} experts, layer 0 has {layers[0].shape[0]}"
                )
        self._layers = layers
        self.n_layers = len(layers)
        self.n_experts = layers[0].shape[0]

    @classmethod
    def from_checkpoint(
        cls,
        ckpt: Checkpoint,
        dtype: torch.dtype | None = None,
        *,
        pin_memory: bool = False,
        on_tensor: Callable[[], None] | None = None,
    ) -> ExpertStore:
        """Gather every expert of `ckpt` into blobs of `dtype` (default: the checkpoint's)."""
        cfg = ckpt.config
        dtype = dtype or cfg.dtype
        fam = families.family(cfg.family)
        f, d = cfg.expert_width, cfg.hidden_size
        itemsize = torch.empty((), dtype=dtype).element_size()
        layers = []
        for layer in range(cfg.n_layers):
            buf = torch.empty(
                (cfg.n_experts, 3 * f * d * itemsize), dtype=torch.uint8, pin_memory=pin_memory
            )
            typed = buf.view(dtype)  # [E, 3*F*D]
            for expert in range(cfg.n_experts):
                gate_name, up_name, down_name = fam.expert_names(layer, expert)
                # copy_ converts the stored dtype to the blob's dtype.
                typed[expert, : f * d].view(f, d).copy_(ckpt.tensor(gate_name))
                typed[expert, f * d : 2 * f * d].view(f, d).copy_(ckpt.tensor(up_name))
                typed[expert, 2 * f * d :].view(d, f).copy_(ckpt.tensor(down_name))
                if on_tensor is not None:
                    for _ in range(3):
                        on_tensor()
            layers.append(buf)
        return cls(layers, d, f, dtype)

    def _check(self, layer: int, expert: int | None = None) -> None:
        if not 0 <= layer < self.n_layers:
            raise IndexError(f"layer {layer} is out of range [0, {self.n_layers})")
        if expert is not None and not 0 <= expert < self.n_experts:
            raise IndexError(f"expert {expert} is out of range [0, {self.n_experts})")

    def layer_blobs(self, layer: int) -> torch.Tensor:
        """uint8 [E, blob_bytes]: the blobs of one layer, row e is expert e."""
        self._check(layer)
        return self._layers[layer]

    def blob(self, layer: int, expert: int) -> torch.Tensor:
        """uint8 [blob_bytes]: a view of the blob of expert (layer, expert)."""
        self._check(layer, expert)
        return self._layers[layer][expert]

    def weights(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views (gate [F, D], up [F, D], down [D, F]) into the blob of expert (layer, expert)."""
        typed = self.blob(layer, expert).view(self.dtype)
        f, d = self.expert_width, self.hidden_size
        return (
            typed[: f * d].view(f, d),
            typed[f * d : 2 * f * d].view(f, d),
            typed[2 * f * d :].view(d, f),
        )


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
    buffer (on the CPU with the store's dtype, the store's own memory: no copy).

    Two paths, chosen by T alone (never by routed data, so capture-safe for decode):
    - T == 1 (decode, what a CUDA graph captures): the K routed experts by
      `strata.engine.grouped_experts.expert_rows`, from the stacked weights by the routed ids;
      no host sync, static shapes. On CUDA with Triton its kernels read the weights in place;
      elsewhere it gathers the K blobs (`index_select`) for two batched matmuls, the most
      workspace this path takes (`strata.engine.cache.budget.workspace_bytes`).
    - otherwise (a prompt chunk, however short): loop over the experts actually routed, each
      over its tokens (sorted by expert), reading the weights in place; one host sync for the
      per-expert counts.
    Each (token, k) output lands in its own row of a [T, K, D] buffer, then the K rows are summed
    in order: no atomics, a fixed summation order.
    """

    def __init__(
        self, store: ExpertStore, device: str | torch.device, dtype: torch.dtype | None = None
    ) -> None:
        self.device = torch.device(device)
        self.dtype = dtype or store.dtype
        self.n_layers = store.n_layers
        self.n_experts = store.n_experts
        f, d = store.expert_width, store.hidden_size
        self.expert_width, self.hidden_size = f, d
        self._gate_up: list[torch.Tensor] = []  # per layer [E, 2F, D]
        self._down: list[torch.Tensor] = []  # per layer [E, D, F]
        for layer in range(store.n_layers):
            typed = store.layer_blobs(layer).view(store.dtype)  # [E, 3*F*D]
            typed = typed.to(device=self.device, dtype=self.dtype)
            e = typed.shape[0]
            self._gate_up.append(typed[:, : 2 * f * d].view(e, 2 * f, d))
            self._down.append(typed[:, 2 * f * d :].view(e, d, f))

    def gate_up(self, layer: int) -> torch.Tensor:
        """[E, 2F, D]: every expert's gate rows then up rows, a view into the layer's blobs."""
        return self._gate_up[layer]

    def down(self, layer: int) -> torch.Tensor:
        """[E, D, F]: every expert's down matrix, a view into the layer's blobs."""
        return self._down[layer]

    def forward(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        if topk_ids.shape[0] == 1:
            out = self._gathered(layer, x, topk_ids)
        else:
            out = self._per_expert(layer, x, topk_ids)
        # [T, K, D] -> [T, D]: weight and sum over K in float32, in order.
        weighted = out.float() * topk_weights.float().unsqueeze(-1)
        return weighted.sum(dim=1).to(x.dtype)

    def _gathered(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        n_tokens, top_k = topk_ids.shape
        ids = topk_ids.reshape(-1)  # [T*K]
        x_rows = x.unsqueeze(1).expand(n_tokens, top_k, -1).reshape(n_tokens * top_k, -1)
        y = expert_rows(self._gate_up[layer], self._down[layer], ids, x_rows)  # [T*K, D]
        return y.view(n_tokens, top_k, -1)

    def _per_expert(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        n_tokens, top_k = topk_ids.shape
        f = self.expert_width
        ids = topk_ids.reshape(-1)  # [T*K]
        order = torch.argsort(ids, stable=True)  # [T*K] rows grouped by expert, tokens ascending
        counts = torch.bincount(ids, minlength=self.n_experts).tolist()  # the one host sync
        out = x.new_empty(n_tokens * top_k, x.shape[1])  # [T*K, D]
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = order[start : start + count]  # [n] flat (token, k) rows routed to `expert`
            start += count
            h = F.linear(x.index_select(0, rows // top_k), self._gate_up[layer][expert])  # [n, 2F]
            act = F.silu(h[:, :f]) * h[:, f:]  # [n, F]
            out.index_copy_(0, rows, F.linear(act, self._down[layer][expert]))  # [n, D]
        return out.view(n_tokens, top_k, -1)
