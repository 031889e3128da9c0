"""Watching the routing without touching the model: `Experts` wrappers that count or record.

Legend: T tokens in a step, D hidden size, K experts per token, L layers, E experts per layer.

The MoE layer calls `experts.forward(layer, x, topk_ids, topk_weights)` once per layer per
forward pass, layers in order. A wrapper sees the routed ids there, notes them, and hands the
call to the `Experts` it wraps unchanged, so output is the wrapped one's, bit for bit:
- `RoutingCounter` adds up how often each expert is routed to (what a profile stores), on the
  model's device, with no host sync;
- `RoutingRecorder` writes each forward pass as one step of a routing trace (`TraceWriter`),
  per layer the ids [T, K], with the phase and the request boundaries.

Both need the forward to run in Python: a CUDA graph replay would skip them (and its warm-up
runs would be seen twice), so decode runs eagerly while they are installed; the recorder
refuses to be captured.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from strata.engine.cache.arena import slot_bytes_for
from strata.engine.experts.quant import expert_blob_bytes
from strata.engine.model.kv_cells import KvLayout
from strata.formats.trace import DECODE, PROMPT, TraceWriter

if TYPE_CHECKING:
    from strata.engine.experts import Experts

__all__ = ["RoutingCounter", "RoutingRecorder", "installed", "new_trace_writer", "trace_meta"]

class RoutingCounter:
    """Counts routed (token, expert) pairs per expert, then runs `inner`.

    `counts()` is int64 [L, E]; `tokens` the tokens seen at layer 0 (each token once).
    """

    def __init__(
        self, inner: Experts, n_layers: int, n_experts: int, device: str | torch.device
    ) -> None:
        self.inner = inner
        self.n_layers, self.n_experts = n_layers, n_experts
        # Flat [L*E] on the device: index_add_ of int64 ones is exact in any order.
        self._counts = torch.zeros(n_layers * n_experts, dtype=torch.int64, device=device)
        self._tokens = torch.zeros((), dtype=torch.int64, device=device)

    def forward(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        flat = topk_ids.reshape(-1) + layer * self.n_experts  # [T*K]
        self._counts.index_add_(0, flat, torch.ones_like(flat))
        if layer == 0:
            self._tokens += topk_ids.shape[0]
        return self.inner.forward(layer, x, topk_ids, topk_weights)

    def counts(self) -> np.ndarray:
        """int64 [L, E]: routed (token, expert) pairs per expert so far (one host read)."""
        return self._counts.cpu().numpy().reshape(self.n_layers, self.n_experts).copy()

    @property
    def tokens(self) -> int:
        return int(self._tokens)


class RoutingRecorder:
    """Records every forward pass as a step of a routing trace, then runs `inner`.

    A step opens at layer 0 and closes after layer L-1 (the model calls the layers in order).
    Its phase follows from the request's prompt length, given to `begin_request`: a forward
    pass over tokens still in the prompt is a prompt step (a prefill chunk), one past it a
    decode step. `generate` reads the whole prompt before it decodes, so this is exact there.
    """

    def __init__(self, inner: Experts, writer: TraceWriter) -> None:
        self.inner = inner
        self.writer = writer
        self._prompt_tokens: int | None = None  # None: no request open
        self._tokens_seen = 0
        self._next_layer = 0  # the layer the open step expects next; 0: no step open

    def begin_request(self, prompt_tokens: int) -> None:
        """Open a request whose first `prompt_tokens` tokens are its prompt."""
        if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) \
                or prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be an int >= 1, got {prompt_tokens!r}")
        self.writer.begin_request()
        self._prompt_tokens, self._tokens_seen, self._next_layer = prompt_tokens, 0, 0

    def end_request(self) -> None:
        """Close the open request; ValueError if a step is half recorded or none was."""
        if self._next_layer != 0:
            raise ValueError(
                f"end_request: the last step stopped at layer {self._next_layer - 1} of "
                f"{self.writer.n_layers}"
            )
        self.writer.end_request()
        self._prompt_tokens = None

    def _phase(self, n_tokens: int) -> int:
        assert self._prompt_tokens is not None
        if self._tokens_seen >= self._prompt_tokens:
            return DECODE
        if self._tokens_seen + n_tokens > self._prompt_tokens:
            raise ValueError(
                f"a forward pass over tokens [{self._tokens_seen}, {self._tokens_seen + n_tokens})"
                f" straddles the end of the {self._prompt_tokens}-token prompt"
            )
        return PROMPT

    def forward(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        if self._prompt_tokens is None:
            raise ValueError("RoutingRecorder: the model ran outside a request (begin_request)")
        if topk_ids.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "RoutingRecorder cannot be captured in a CUDA graph: run decode eagerly"
            )
        if layer != self._next_layer:
            raise ValueError(f"layer {layer} ran where layer {self._next_layer} was expected")
        n_tokens = topk_ids.shape[0]
        if layer == 0:
            self.writer.begin_step(self._phase(n_tokens))
        self.writer.record(layer, topk_ids.cpu().numpy())  # [T, K]
        if layer == self.writer.n_layers - 1:
            self.writer.end_step()
            self._tokens_seen += n_tokens
            self._next_layer = 0
        else:
            self._next_layer = layer + 1
        return self.inner.forward(layer, x, topk_ids, topk_weights)

    @contextmanager
    def request(self, prompt_tokens: int) -> Iterator[RoutingRecorder]:
        """`begin_request` ... `end_request` around a block; on an exception the writer's open
        request is left unended (the trace of a failed run is not saved)."""
        self.begin_request(prompt_tokens)
        yield self
        self.end_request()


@contextmanager
def installed(model: Any, wrapper: Any) -> Iterator[Any]:
    """`wrapper` as `model.experts` for the block; the wrapped `Experts` is put back after."""
    if wrapper.inner is not model.experts:
        raise ValueError("the wrapper must wrap the model's own experts (wrapper.inner)")
    model.experts = wrapper
    try:
        yield wrapper
    finally:
        model.experts = wrapper.inner


def trace_meta(model: Any, source: str, *, kv_dtype: torch.dtype | None = None,
               **extra: Any) -> dict[str, Any]:
    """A trace's `meta` for `model`: the source, and under `model` the geometry the simulator
    reads (`slot_bytes`, at the experts' stored format, `experts_dtype`;
    `kv_segment_cell_bytes`, `kv_segments`: the K/V's `KvLayout`, its cells in `kv_dtype`,
    None: the model's dtype) and the config hash."""
    cfg = model.config
    kv = KvLayout.of(cfg, model.dtype if kv_dtype is None else kv_dtype)
    slot_bytes = slot_bytes_for(expert_blob_bytes(
        cfg.expert_width, cfg.hidden_size, model.dtype, model.experts_quant))
    return {
        "source": source,
        "model": {
            "family": cfg.family,
            "config_hash": cfg.config_hash(),
            "dtype": str(model.dtype).removeprefix("torch."),
            "slot_bytes": slot_bytes,
            "experts_dtype": model.experts_dtype,
            "kv_dtype": kv.name,
            "kv_segment_cell_bytes": kv.cell_bytes,
            "kv_segments": kv.n_segments,
        },
        **extra,
    }


def new_trace_writer(model: Any, source: str, *, kv_dtype: torch.dtype | None = None,
                     **extra: Any) -> TraceWriter:
    """A `TraceWriter` shaped for `model`, with `trace_meta` as its meta (`kv_dtype`: the
    K/V cells', None: the model's dtype)."""
    cfg = model.config
    return TraceWriter(cfg.n_layers, cfg.n_experts, cfg.top_k,
                       meta=trace_meta(model, source, kv_dtype=kv_dtype, **extra))
