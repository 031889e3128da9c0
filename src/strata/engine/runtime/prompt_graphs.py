"""A short prompt chunk replayed from a CUDA graph.

Dimension letters: T the chunk's tokens, B its bucket's (T padded), N cells attended, V vocabulary.

A chunk of a few hundred tokens is bound by the host, not the device: on the H200 a 32-token
chunk of `olmoe-1b-7b`'s shape spent 19% of its time in kernels, a 512-token one 36%
(bench/results/prefill-graphs-h200-2026-12-02.md). With every expert resident and the MoE's
grouped products (nothing read on the host: `ResidentExperts.prompt_capturable`), such a chunk
is replayed from a graph of `MoEModel.forward_at`, captured once per bucket and window (at
the shape's second use: the first runs the padded chunk eagerly, the same bytes, so a one-off
prompt pays no capture):

- the bucket: T padded to the next power of two in [PROMPT_GRAPH_MIN_TOKENS,
  PROMPT_GRAPH_MAX_TOKENS] (longer chunks run eagerly: their kernels dominate);
- the window: cells [0, N), N the next power of two from the chunk's last padded cell,
  at least PROMPT_GRAPH_MIN_CELLS, at most the mapped cells. Powers of two, so a
  conversation's turns at growing positions meet few windows, each captured once.

The padding tokens (id 0) sit in the cells after the chunk's: their K/V is written there, and
each such cell is written again by its own token's forward before anything attends it (causal
attention reads no cell past the token's own). They are routed and computed like the others;
no real row attends them, and the logits are the real last token's.

A chunk with no padded shape (longer, or past the mapped cells) runs as it is, through the
fused causal kernel: it differs from the padded chunk's mask over its window in the last bits.
Each is deterministic, and which one a chunk takes depends on its length, its start and the
mapped cells only.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from strata.engine.runtime.decode_steps import capture_graph

__all__ = ["PROMPT_GRAPH_MAX_TOKENS", "PROMPT_GRAPH_MIN_CELLS", "PROMPT_GRAPH_MIN_TOKENS",
           "PromptGraphs", "padded_chunk"]

PROMPT_GRAPH_MIN_TOKENS = 16
PROMPT_GRAPH_MAX_TOKENS = 512
PROMPT_GRAPH_MIN_CELLS = 256


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def padded_chunk(n_tokens: int, start: int, mapped_cells: int) -> tuple[int, int] | None:
    """(bucket B, window N) of a chunk of `n_tokens` at cell `start`, or None when it has no
    graph: longer than PROMPT_GRAPH_MAX_TOKENS, or its padded cells past `mapped_cells`."""
    if n_tokens > PROMPT_GRAPH_MAX_TOKENS:
        return None
    bucket = max(_power_of_two_at_least(n_tokens), PROMPT_GRAPH_MIN_TOKENS)
    end = start + bucket  # the cells [start, end) the padded chunk writes
    if end > mapped_cells:
        return None
    window = min(max(_power_of_two_at_least(end), PROMPT_GRAPH_MIN_CELLS), mapped_cells)
    return bucket, window


class _Bucket:
    """The static inputs every graph of one bucket reads: ids and positions [B], the real last
    row [1] (int64, on the device)."""

    def __init__(self, bucket: int, device: torch.device) -> None:
        self.ids = torch.zeros(bucket, dtype=torch.int64, device=device)  # [B]
        self.positions = torch.zeros(bucket, dtype=torch.int64, device=device)  # [B]
        self.last = torch.zeros(1, dtype=torch.int64, device=device)  # [1]

    def fill(self, chunk: torch.Tensor, start: int) -> None:
        n_tokens, bucket = chunk.shape[0], self.ids.shape[0]
        self.ids[:n_tokens].copy_(chunk)
        self.ids[n_tokens:].zero_()
        torch.arange(start, start + bucket, out=self.positions)
        self.last.fill_(n_tokens - 1)


class PromptGraphs:
    """The prompt chunks of one model over one K/V, replayed from graphs (see the module's
    docstring). An engine keeps it for its life, like its decode graphs: the K/V's addresses
    never move, so the graphs stay valid across requests, growths and trims.

    A shape (bucket, window) met for the first time runs the padded chunk eagerly, the same
    bytes as a replay; the second time captures its graph, and later ones replay it. So a
    one-off prompt pays no capture, and a request's bytes do not depend on what came before.
    `capture=False` always runs the padded chunk eagerly: the host twin the CPU tests check.
    """

    def __init__(self, model: Any, kv: Any, capture: bool = True) -> None:
        self.model, self.kv, self.capture = model, kv, capture
        self.pool: Any = None  # the graphs' memory, made at the first capture
        self.buckets: dict[int, _Bucket] = {}
        self.seen: set[tuple[int, int]] = set()  # shapes met once, run eagerly
        # (bucket, window) -> (its graph, logits [1, V] refreshed by each replay)
        self.graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self.failed: str | None = None  # why a capture failed: every chunk runs eagerly since

    def __call__(self, chunk: torch.Tensor, start: int) -> torch.Tensor | None:
        """Logits float32 [1, V] of chunk [T]'s last token, its K/V written at cells
        [start, start + T), from the padded chunk (replayed, or run eagerly); None (nothing
        run) when the chunk has no padded shape (`padded_chunk`): the caller runs it as it is.
        A capture that fails is said on stderr, once, and every chunk runs eagerly from then
        on (its warm-up runs wrote the chunk's cells; the eager run writes the same values)."""
        shape = padded_chunk(chunk.shape[0], start, self.kv.mapped_cells)
        if shape is None:
            return None
        bucket, window = shape
        if bucket not in self.buckets:
            self.buckets[bucket] = _Bucket(bucket, self.model.device)
        inputs = self.buckets[bucket]
        inputs.fill(chunk, start)

        def step() -> torch.Tensor:
            return self.model.forward_at(inputs.ids, inputs.positions, self.kv, window,
                                         logit_rows=inputs.last)  # [1, V]

        if not self.capture or self.failed is not None:
            return step()
        if shape not in self.graphs:
            if shape not in self.seen:  # the first time: eagerly, no capture
                self.seen.add(shape)
                return step()
            try:
                self.graphs[shape] = self._capture(step)
            except RuntimeError as err:  # an op the capture refuses (a host sync), memory
                self.failed = f"{type(err).__name__}: {err}"
                print(f"strata: short prompt chunks run eagerly from here on: capturing their "
                      f"CUDA graph failed ({self.failed})", file=sys.stderr)
                return step()
        graph, logits = self.graphs[shape]
        graph.replay()
        return logits

    def _capture(self, step: Any) -> tuple[Any, torch.Tensor]:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        return capture_graph(step, self.model.device, self.pool)
