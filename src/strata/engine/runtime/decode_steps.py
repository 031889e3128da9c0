"""One decode round: eager, replayed from a CUDA graph, or from graphs cut at the experts.

On CUDA, with every expert resident (`ResidentExperts`, or an expert cache holding every
expert that needs nothing on the host: `device_only`), a round replays a CUDA graph captured
for the round's attention window (`GRAPH_WINDOW_CELLS`-cell buckets, so a round reads only
the cells it needs). With a cache that misses (it reads the routing on the host every layer)
or a wrapper around the experts, a round replays graphs cut at the experts calls, which run
eagerly between them (`strata.engine.runtime.piecewise`). `decode_step` picks one.

On by default: `GREEDY_PICK_IN_GRAPH`. Left outside the graph, a greedy round's pick
(`sampling.argmax_pick`, written into the next round's token) and the next position's fill
would be two launches the device waits on between two replays. A step made for greedy rounds
(`decode_step(greedy=True)`) captures them into its graphs instead: each replay ends with its
pick written into `token` and `position` moved on by one, so the loop launches the replay
alone (`picks`). The tokens are the same (the same `sampling.argmax_pick`). bench/decode.py
`--pick-in-graph` is the A/B: on H100 machines the whole olmoe-1b-7b's greedy decode ran
1.002x, 1.004x, 1.003x and 1.002x as fast with it in four runs, the same tokens each time
(bench/results/h100-figures-2026-12-07b.md and -07c.md); the whole `pytest -m cuda` passed
with it on.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from strata.engine.cache.cached_experts import CachedExperts
from strata.engine.experts import ResidentExperts
from strata.engine.runtime.sampling import argmax_pick

__all__ = ["GRAPH_WINDOW_CELLS", "capture_graph", "decode_step"]

GRAPH_WINDOW_CELLS = 256  # decode graphs attend over windows of a multiple of this many cells
GREEDY_PICK_IN_GRAPH = True


def capture_graph(step: Callable[[], torch.Tensor], device: torch.device,
                  pool: Any) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """(a CUDA graph of `step`, the tensor it returns, refreshed by each replay), captured into
    memory `pool`. `step` first runs twice on a side stream (warm-up: lazy initialisations and
    kernel compilations must not happen during capture), so it must be safe to run again: the
    graphs here write the same K/V cells with the same values each time."""
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = step()
    return graph, out


class _EagerDecode:
    """One decode round through `model.forward`."""

    path = "eager"
    picks = False  # the caller picks each round's token

    def __init__(self, model: Any, kv: Any) -> None:
        self.model, self.kv = model, kv
        self.token = torch.zeros(1, dtype=torch.int64, device=model.device)  # [1]: fed next

    def prepare(self, token: int, first: int, last: int) -> None:
        """Nothing to set up for eager rounds."""

    def still_valid(self) -> bool:
        """Eager rounds read whatever the experts are now: always."""
        return True

    def __call__(self, token: int, position: int) -> torch.Tensor:
        self.token.fill_(token)
        return self.round(position)

    def round(self, position: int) -> torch.Tensor:
        """The round of the token in `self.token` (written there on the device by whoever
        picked it) at `position`: logits [V]."""
        return self.model.forward(self.token, position, self.kv)[-1]  # [V]


class _GraphDecode:
    """One decode round replayed from a CUDA graph of `model.forward_at`.

    One graph per attention window (a multiple of GRAPH_WINDOW_CELLS, capped at the mapped
    cells), all captured by `prepare` before the decode clock starts. The round's token and
    position are written into static device tensors the graphs read. Capturing first runs the
    step eagerly on a side stream (warm-up), which writes the K/V cell of the position it is
    given: the first window's warm-up uses the first round's own token and position (the replay
    writes the same values again), a later window's the first position of that window, a cell
    that its own round overwrites before any round reads it (causal attention never reads cells
    after the current position).
    """

    path = "cuda-graph"

    def __init__(self, model: Any, kv: Any, compile: bool = False, cache: Any = None,
                 picks: bool = False) -> None:
        self.model, self.kv = model, kv
        # Whether each graph ends with the round's greedy pick written to `token` and
        # `position` moved on by one (GREEDY_PICK_IN_GRAPH): the caller then picks nothing.
        self.picks = picks
        self._position_held: int | None = None  # what `position` holds on the device, if known
        self.cache = cache  # a device-only CachedExperts: told of captures and replays
        self.forward_at = model.forward_at
        if compile:
            from strata.engine.runtime.compile import compile_decode_step

            self.forward_at = compile_decode_step(model.forward_at)
        self.path = "compiled-cuda-graph" if compile else "cuda-graph"
        self.token = torch.zeros(1, dtype=torch.int64, device=model.device)  # [1]
        self.position = torch.zeros(1, dtype=torch.int64, device=model.device)  # [1]
        self.pool = torch.cuda.graph_pool_handle()
        # n_ctx -> (a CUDAGraph, or the pieces of one: anything with replay(), logits [V])
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}

    def _window(self, position: int) -> int:
        cells = -(-(position + 1) // GRAPH_WINDOW_CELLS) * GRAPH_WINDOW_CELLS
        return min(cells, self.kv.mapped_cells)

    def _capture(self, n_ctx: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        def step() -> torch.Tensor:
            logits = self.forward_at(self.token, self.position, self.kv, n_ctx)[-1]  # [V]
            if self.picks:  # after every read of the token and the position
                argmax_pick(logits, out=self.token)
                self.position.add_(1)
            return logits

        # The warm-up runs write the token and the position when the graph picks: the round's
        # own are put back for its replay, or for the next round when the capture fails.
        held = (self.token.clone(), self.position.clone()) if self.picks else None
        try:
            with self.cache.graph_capture() if self.cache is not None else nullcontext():
                return capture_graph(step, self.model.device, self.pool)
        finally:
            if held is not None:
                self.token.copy_(held[0])
                self.position.copy_(held[1])

    def prepare(self, token: int, first: int, last: int) -> None:
        """Capture the graphs of the rounds at positions [first, last]; `token` is round 1's."""
        position = first
        while position <= last:
            n_ctx = self._window(position)
            if n_ctx not in self.graphs:
                self.token.fill_(token)
                self.position.fill_(position)
                self._position_held = position
                self.graphs[n_ctx] = self._capture(n_ctx)
            position = n_ctx  # the first position of the next window

    def still_valid(self) -> bool:
        """Whether the graphs can still be replayed: a graph of a device-only cache reads no
        routing on the host, so it is stale once the cache misses (slots given up)."""
        return self.cache is None or self.cache.device_only

    def __call__(self, token: int, position: int) -> torch.Tensor:
        self.token.fill_(token)
        return self.round(position)

    def round(self, position: int) -> torch.Tensor:
        """The round of the token in `self.token` (written there on the device by whoever
        picked it, or by `__call__`) at `position`: its graph replayed, logits [V]. Where the
        step `picks`, the replay also leaves the round's greedy pick in `token`, and the
        position is written only where the round before did not leave it there."""
        if position != self._position_held:
            self.position.fill_(position)
            self._position_held = position
        n_ctx = self._window(position)
        if n_ctx not in self.graphs:  # not prepared for: capture now (inside the clock)
            self.graphs[n_ctx] = self._capture(n_ctx)
        graph, logits = self.graphs[n_ctx]
        graph.replay()
        self._position_held = position + 1 if self.picks else position
        if self.cache is not None:
            self.cache.count_replay()
        return logits


class _PiecewiseDecode(_GraphDecode):
    """`_GraphDecode` for experts that work on the host: each window's step is captured as
    graphs cut at the experts calls, which run eagerly between them
    (`strata.engine.runtime.piecewise`).
    """

    def __init__(self, model: Any, kv: Any) -> None:
        super().__init__(model, kv)
        self.path = "piecewise-cuda-graph"
        self.side = torch.cuda.Stream(device=model.device)  # every capture into self.pool

    def _capture(self, n_ctx: int) -> tuple[Any, torch.Tensor]:
        from strata.engine.runtime.piecewise import capture_pieces

        pieces = capture_pieces(
            self.model,
            lambda: self.forward_at(self.token, self.position, self.kv, n_ctx)[-1],  # [V]
            self.pool, self.side,
        )
        assert pieces.logits is not None
        return pieces, pieces.logits


def decode_step(model: Any, kv: Any, cached: CachedExperts | None, *, cuda_graphs: bool,
                piecewise_graphs: bool, compile: bool,
                warm: dict[tuple[Any, ...], Any] | None = None, greedy: bool = False) -> Any:
    """The decode round for `model` over `kv` (`cached`: its expert cache, or None): a graph
    replay where the experts need nothing on the host, graphs cut at the experts calls where
    they do, eager rounds off CUDA or when graphs are off.

    `greedy`: the rounds' picks will be greedy; with GREEDY_PICK_IN_GRAPH a graph replay then
    makes the pick itself (the step `picks`: for greedy rounds only).

    `warm`: steps made before for this model and K/V (an engine keeps them for its life), by
    kind; a step found there is used again, with the graphs it captured: the K/V's and the
    slots' addresses never move, so they stay valid across requests, growths and trims."""
    on_cuda = model.device.type == "cuda"
    # Graphs replay resident experts, and a cache that needs nothing on the host; a cache
    # that misses or a wrapper works on the host.
    resident = isinstance(model.experts, ResidentExperts)
    graph_cache = cached if cached is model.experts and cached.device_only else None
    if cuda_graphs and on_cuda and (resident or graph_cache):
        picks = greedy and GREEDY_PICK_IN_GRAPH
        key: tuple[Any, ...] = ("graph", id(kv), compile and resident, graph_cache is not None,
                                picks)
        make: Any = lambda: _GraphDecode(model, kv, compile and resident,  # noqa: E731
                                         graph_cache, picks)
    elif cuda_graphs and piecewise_graphs and on_cuda:
        key, make = ("piecewise", id(kv)), lambda: _PiecewiseDecode(model, kv)
    else:
        key, make = ("eager", id(kv)), lambda: _EagerDecode(model, kv)
    if warm is None:
        return make()
    if key not in warm:
        warm[key] = make()
    return warm[key]
