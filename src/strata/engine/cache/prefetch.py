"""Prefetching a decode layer's likely misses: the next layer's routing predicted from this
layer's input, the experts it would miss uploaded before it is reached.

Dimension letters: L layers, E experts, K experts per token, D hidden size.

In a decode round split around piecewise graphs (`strata.engine.cache.graph_call`), layer l's
graph ends with its resident experts' rows; the host then serves the misses, and the next
graph runs layer l+1. A layer's uploads can start only once its routing is read, so the copy
engine idles while the host books each call and while the device runs each graph: on the H200
a 16-layer `qwen3-30b-a3b` round at 22% of its experts cached spent 10.9 of its 17.5 ms
uploading (bench/results/offload-split-h200-2026-12-02.md).

The residual stream changes little from one layer to the next, so layer l+1's router applied
to layer l's MoE input predicts much of layer l+1's routing (the predictor of pre-gated MoE
systems). `MissPrefetch.predict` computes those K ids at the end of layer l's graph
(`ops.router_route`) into a device buffer. `MissPrefetch.read`, on the host right after
layer l's routing is read, reads them: that read drained the stream up to there, so this one
waits for nothing. Read after layer l's own uploads were queued, it would wait for them (on
the H200 that read cost a 16-layer olmoe round 6 ms; bench/results/
offload-staged-h200-2026-12-02.md). `MissPrefetch.issue`, after those uploads are queued,
uploads the predicted experts layer l+1 does not hold into the staging half of l+1
(`StreamedMisses.prefetch`), on the copy stream while the device computes layer l. Layer l+1
streams those of its misses first (`StreamedMisses.split`).

At most `cap` of a layer's predicted misses are uploaded, the likeliest first
(`--prefetch-misses N`). Each upload the next layer does not use delays the uploads it does
need, which queue behind it on the copy stream; the gaps the prefetch is there to fill, while
the host books a call and the device runs a graph, hold about half an olmoe expert's upload a
layer on the H200 (bench/results/offload-host-h200-2026-12-02.md). With every predicted miss
uploaded, 18% of them unused, a round ran 0.83-0.97x as fast; capped at 1 or 2, 90-97% used,
olmoe-1b-7b's round ran 1.00-1.03x and qwen3-30b-a3b's 0.85x, its host's time up by 200 us a
layer (bench/results/offload-prefetch-cap-h200-2026-12-03.md). So it stays off by default.

What is prefetched depends only on the model's values and the books, never on timings, so a
run repeats its bytes. It changes which misses the device computes rather than the CPU, and
so the output's last bits against a run without it.
"""

from __future__ import annotations

from typing import Any

import torch

from strata.engine.model.ops import router_route

__all__ = ["MissPrefetch", "check_prefetch_misses"]


def check_prefetch_misses(cap: int, n_staging: int) -> None:
    """ValueError unless `cap` (the most predicted misses a layer uploads ahead; 0: off) is an
    int from 0 to `n_staging`, the staging buffer's blobs (the streamed misses' N), which must
    be > 0 for a cap > 0: prefetched experts go there."""
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
        raise ValueError(f"prefetch_misses must be an int >= 0 (the predicted misses a layer "
                         f"uploads ahead; 0: off), got {cap!r}")
    if cap and not n_staging:
        raise ValueError("prefetch_misses needs streamed misses (stream_misses > 0): prefetched "
                         "experts go to the staging buffer, and none are streamed here")
    if cap > n_staging:
        raise ValueError(f"prefetch_misses {cap} is more than the staging buffer's {n_staging} "
                         f"blobs (the streamed misses' N): give at most {n_staging}")


class MissPrefetch:
    """The routers [E, D] of every layer (the model's, on the cache's device), the model's K,
    the most predicted misses a layer uploads (`cap`, >= 1), and the predictions: [L, K] each
    layer's predicted experts, most likely first, on the device (a CUDA graph holds the
    buffer's address)."""

    def __init__(self, routers: list[torch.Tensor], top_k: int, n_experts: int,
                 device: torch.device, cap: int) -> None:
        shapes = {tuple(router.shape) for router in routers}
        if not routers or len(shapes) != 1 or next(iter(shapes))[0] != n_experts \
                or any(router.device != device for router in routers):
            raise ValueError(f"prefetching needs every layer's router [E = {n_experts}, D] on "
                             f"{device}, got {[tuple(r.shape) for r in routers]}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must be an int in [1, {n_experts}], got {top_k!r}")
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise ValueError(f"cap must be an int >= 1, got {cap!r}")
        self.routers, self.top_k, self.cap = routers, top_k, cap
        self.predicted = torch.zeros((len(routers), top_k), dtype=torch.int64,
                                     device=device)  # [L, K]

    def predict(self, layer: int, x: torch.Tensor) -> None:
        """Layer+1's predicted experts from layer's MoE input x [1, D], into `predicted` (no
        host read: a CUDA graph holds it). Nothing after the last layer."""
        if layer + 1 < len(self.routers):
            ids, _ = router_route(x, self.routers[layer + 1], self.top_k, False)  # [1, K]
            self.predicted[layer + 1].copy_(ids[0])

    def read(self, layer: int) -> list[int]:
        """Layer+1's predicted experts, most likely first, on the host ([] after the last
        layer). Call right after layer's routing was read, before anything else is queued: the
        stream has then run the prediction, and the read waits for nothing more."""
        if layer + 1 >= len(self.routers):
            return []
        return self.predicted[layer + 1].tolist()

    def issue(self, layer: int, predicted: list[int], table: Any, streamer: Any) -> int:
        """Upload layer+1's `predicted` experts (`read`) that the books (`table`, a
        `ResidencyTable`) do not hold, most likely first, up to `cap` and the staging half's
        N blobs (`streamer`, a `StreamedMisses` made with prefetch). Returns the blobs
        uploaded."""
        if not predicted:
            return 0
        slots = table.res[layer + 1]  # [E] int32, -1: not resident
        missing = [e for e in predicted if slots[e] < 0][:min(self.cap, streamer.n_blobs)]
        return streamer.prefetch(layer + 1, missing) if missing else 0
