"""Piecewise CUDA graphs: a decode step replayed as graphs between the experts' host calls.

Legend: L layers, D hidden size, K experts per token, V vocabulary.

An `Experts` that reads the routing on the host (the expert cache when it can miss, a routing
recorder) cannot be captured, so such a decode round ran every kernel of the step eagerly, and
launching them took most of the round outside the experts. Here the step is captured as L + 1
graphs cut at the `experts.forward` calls: graph 0 runs from the embedding to layer 0's routing,
graph i from layer i-1's expert output to layer i's routing, graph L from the last expert output
to the logits. A round replays graph i, calls the real experts eagerly on the inputs graph i
left in its static tensors, copies their output into the static tensor graph i+1 reads, and so
on. The experts (their books, stats, policy and CPU work) run exactly as in an eager round.

Capturing: `Cut` stands in for the model's experts while the step is captured. It ends the
open capture at each experts call, keeps that call's inputs (graph outputs, alive from then on)
and returns a static output tensor allocated outside the graphs, then begins the next capture.
The warm-up runs before a capture (lazy kernel setup outside any graph) call no experts: `Cut`
returns zeros there, so the experts' books and stats see no warm-up. Their K/V writes land in
the cell of the round's own position, which the round rewrites before reading it.

An expert cache whose `splits_calls` is true is cut differently: at each experts call the
graph ends with the rows of the resident experts (`CachedExperts.resident_rows`: the slots are
read from the device mirror, no host work), the host then writes the CPU's misses' rows over
them and stages the streamed ones (`CachedExperts.fill_misses`), and the next graph begins
with the staged experts' rows and the weighted sum (`CachedExperts.sum_rows`). The hits' and
the streamed misses' kernels, the slots' upload and the sum are replayed with the graphs
instead of launched from the host (`strata.engine.cache.graph_call`); the bytes are the same.

All graphs of all windows share one memory pool and are replayed in the order they were
captured (within a round; windows only grow), as a shared pool requires.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Cut", "Pieces", "capture_pieces"]


@dataclass
class Pieces:
    """One window's graphs: `graphs` [L + 1]; `calls` [L] the experts calls' static inputs
    (layer, x [1, D], ids [1, K], weights [1, K]); `outputs` [L] what graph i+1 reads of call
    i: its result [1, D], or with `split` its rows [K + 1, D] (the resident experts' written by
    graph i, the CPU's misses' by the host, the staged ones' by graph i+1); `logits` [V] graph
    L's output. `replay` runs a round on
    `model`'s experts."""

    model: Any
    split: bool = False
    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    calls: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)
    logits: torch.Tensor | None = None

    def replay(self) -> None:
        """Graph 0, the experts, graph 1, ..., graph L; the logits are in `logits` after. A
        split call hands back its end (`CachedExperts.fill_misses`' books_after, or ahead):
        the next graph is launched first, queued on the device behind the call's rows, and the
        end (the call's books, or with ahead the wait for the CPU's rows too) called after it,
        whatever the launch does."""
        experts = self.model.experts
        self.graphs[0].replay()
        for graph, call, out in zip(self.graphs[1:], self.calls, self.outputs, strict=True):
            if not self.split:
                out.copy_(experts.forward(*call))
                graph.replay()
                continue
            rest = experts.fill_misses(*call, out, books_after=True)
            try:
                graph.replay()
            finally:
                if rest is not None:
                    rest()


class Cut:
    """The experts as a capture sees them: cuts the graph at each call (see the module)."""

    def __init__(self, inner: Any, pool: Any) -> None:
        self.inner = inner  # the model's experts, put back after the capture
        self.pool = pool
        self.split = bool(getattr(inner, "splits_calls", False))
        self.pieces: Pieces | None = None  # None: a warm-up, no capture open

    def forward(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        # Split: the resident experts' rows end this graph (a warm-up computes them too: the
        # mirror is read, the books are not told).
        rows = self.inner.resident_rows(layer, x, topk_ids) if self.split else None  # [K+1, D]
        if self.pieces is None:  # a warm-up: the experts are not told
            return self.inner.sum_rows(x, rows, topk_weights) if self.split \
                else torch.zeros_like(x)
        self.pieces.graphs[-1].capture_end()
        self.pieces.calls.append((layer, x, topk_ids, topk_weights))
        # What the next graph reads: the rows, an output of this graph that the host completes
        # at replay; else a tensor made outside any graph that the call's result is copied into.
        out = rows if self.split else torch.zeros_like(x)
        self.pieces.outputs.append(out)
        graph = torch.cuda.CUDAGraph()
        self.pieces.graphs.append(graph)
        graph.capture_begin(pool=self.pool)
        return self.inner.sum_rows(x, out, topk_weights) if self.split else out


def capture_pieces(
    model: Any, step: Callable[[], torch.Tensor], pool: Any, side: torch.cuda.Stream
) -> Pieces:
    """Capture `step()` (a decode step of `model` returning its logits [V], reading static
    inputs) as pieces cut at the experts calls, after two warm-ups that call no experts.
    `side` is the stream captures run on: the same for every capture into `pool`, so that
    they can share its memory."""
    from strata.engine.runtime.recording import installed

    device = model.device
    cut = Cut(model.experts, pool)
    side.wait_stream(torch.cuda.current_stream(device))
    with installed(model, cut), torch.cuda.stream(side):
        for _ in range(2):
            step()
        torch.cuda.synchronize(device)
        pieces = Pieces(model, split=cut.split, graphs=[torch.cuda.CUDAGraph()])
        cut.pieces = pieces
        pieces.graphs[0].capture_begin(pool=pool)
        try:
            pieces.logits = step()
        finally:
            pieces.graphs[-1].capture_end()
    torch.cuda.current_stream(device).wait_stream(side)
    if len(pieces.calls) != model.config.n_layers:
        raise RuntimeError(f"a decode step called the experts {len(pieces.calls)} times, not "
                           f"once per layer ({model.config.n_layers})")
    return pieces
