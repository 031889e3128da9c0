"""The generation loop: prefill the prompt in chunks, then one token per round.

The prompt is read in chunks of `prefill_chunk` tokens into a K/V of `max_context` cells; the
last chunk's last logits give the first generated token. Each decode round then runs one token
through the model and samples the next. On CUDA, with every expert resident (`ResidentExperts`,
or an expert cache holding every expert that needs nothing on the host: `device_only`), a decode
round replays a CUDA graph captured for the round's attention window (`GRAPH_WINDOW_CELLS`-cell
buckets, so a round reads only the cells it needs; the graphs a run needs are captured before the
decode clock starts). With a cache that misses (it reads the routing on the host every layer) or
a wrapper around the experts, a CUDA round replays graphs cut at the experts calls, which run
eagerly between them (`piecewise_graphs`, on by default; `strata.engine.runtime.piecewise`). Rounds
run eagerly off CUDA, with `cuda_graphs=False`, or with `piecewise_graphs=False` and a cache that
misses.
`--compile` applies to `ResidentExperts` only. The graph path attends through a mask over its
window, the eager one over exactly the cells written, so the two may differ in the last bits; each
is deterministic.

Timing: prefill is measured from the first chunk to the first token sampled; decode from the
first round to the last token sampled. Both end on a host read of the token, which waits for the
device; CUDA is also synchronised explicitly at the boundaries. A decode round is one forward of
one token plus its sampling, so a run of `max_new` tokens has `max_new - 1` rounds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from strata.engine.experts import ResidentExperts
from strata.engine.kv.elastic import ElasticKV
from strata.engine.kv.kv_cache import new_kv
from strata.engine.model.tokenizer import Tokenizer
from strata.engine.runtime.sampling import Sampler

GRAPH_WINDOW_CELLS = 256  # decode graphs attend over windows of a multiple of this many cells
GROW_MARGIN_CELLS = 16  # the elastic K/V grows for the prompt + max_new + this, at once
DETOKENIZER_CONTEXT_IDS = 4  # prompt ids the streaming detokenizer sees before the first token


@dataclass(frozen=True)
class GenerateOptions:
    """How to generate. `temperature` 0 is greedy; `stop_ids` end generation (the stop token is
    kept in `tokens` but not in `text`); `ignore_stop` generates exactly `max_new` tokens."""

    max_new: int = 64
    max_context: int = 4096
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 0
    seed: int = 0
    prefill_chunk: int = 512
    stop_ids: tuple[int, ...] = ()
    ignore_stop: bool = False
    cuda_graphs: bool = True
    compile: bool = False  # torch.compile the CUDA-graph decode step (runtime.compile)
    # Experts that work on the host (a cache that misses, a recorder): replay the rest of the
    # step as graphs cut at their calls (strata.engine.runtime.piecewise): 1.1-1.5x as fast as
    # eager rounds on the H200 (bench/results/cache-h200-2026-11-29.md).
    piecewise_graphs: bool = True

    def __post_init__(self) -> None:
        for name in ("max_new", "max_context", "prefill_chunk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        # The sampler validates temperature, top_p, top_k and seed.
        Sampler(self.temperature, self.top_p, self.top_k, self.seed)


@dataclass
class GenerateResult:
    """What one generation produced, and how fast."""

    tokens: list[int]
    text: str
    prompt_tokens: int
    prefill_s: float
    decode_rounds: int
    decode_s: float
    decode_setup_s: float  # capturing CUDA graphs before the decode clock (0 when eager)
    stop_reason: str  # "eos" (a stop id was generated) or "max_new"
    decode_path: str  # "cuda-graph", "piecewise-cuda-graph" or "eager"
    first_logits: torch.Tensor = field(repr=False)  # float32 [V] on the CPU: the first position
    cache: Any = None  # the expert cache's CacheStats of this request, or None without a cache
    kv: Any = None  # the elastic K/V's KvStats after this request, or None without --kv-grow

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_ms_per_round(self) -> float:
        return 1000.0 * self.decode_s / self.decode_rounds if self.decode_rounds else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_rounds / self.decode_s if self.decode_s > 0 else 0.0

    def stats(self) -> dict[str, Any]:
        """The figures as JSON values (what `strata generate --json` prints besides the text)."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": len(self.tokens),
            "prefill_s": self.prefill_s,
            "prefill_tok_s": self.prefill_tok_s,
            "decode_rounds": self.decode_rounds,
            "decode_s": self.decode_s,
            "decode_ms_per_round": self.decode_ms_per_round,
            "decode_tok_s": self.decode_tok_s,
            "decode_setup_s": self.decode_setup_s,
            "stop_reason": self.stop_reason,
            "decode_path": self.decode_path,
            **({"cache": self.cache.as_dict()} if self.cache is not None else {}),
            **({"kv": self.kv.as_dict()} if self.kv is not None else {}),
        }


def check_prompt(prompt_ids: Sequence[int], options: GenerateOptions, vocab_size: int) -> None:
    """ValueError unless the prompt is not empty, its ids are in [0, vocab_size), and it and
    `max_new` fit in `max_context`."""
    if len(prompt_ids) < 1:
        raise ValueError("the prompt is empty (0 tokens); give at least one token of prompt")
    need = len(prompt_ids) + options.max_new
    if need > options.max_context:
        raise ValueError(
            f"the prompt's {len(prompt_ids)} tokens + --max-new {options.max_new} = {need} "
            f"exceed --max-context {options.max_context}; raise --max-context or shorten them"
        )
    bad = [i for i in prompt_ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(
            f"prompt token id {bad[0]} is outside the model's vocabulary [0, {vocab_size})"
        )


def expert_cache(experts: Any) -> Any:
    """The expert cache (`CachedExperts`) under `experts` and any wrappers around it (each
    wrapper's `inner`), or None when the experts are not cached."""
    from strata.engine.cache.cached_experts import CachedExperts

    while not isinstance(experts, CachedExperts) and hasattr(experts, "inner"):
        experts = experts.inner
    return experts if isinstance(experts, CachedExperts) else None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _EagerDecode:
    """One decode round through `model.forward`."""

    path = "eager"

    def __init__(self, model: Any, kv: Any) -> None:
        self.model, self.kv = model, kv

    def prepare(self, token: int, first: int, last: int) -> None:
        """Nothing to set up for eager rounds."""

    def __call__(self, token: int, position: int) -> torch.Tensor:
        ids = torch.tensor([token], dtype=torch.int64, device=self.model.device)  # [1]
        return self.model.forward(ids, position, self.kv)[-1]  # [V]


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

    def __init__(self, model: Any, kv: Any, compile: bool = False, cache: Any = None) -> None:
        self.model, self.kv = model, kv
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
            return self.forward_at(self.token, self.position, self.kv, n_ctx)[-1]  # [V]

        side = torch.cuda.Stream(device=self.model.device)
        with self.cache.graph_capture() if self.cache is not None else nullcontext():
            side.wait_stream(torch.cuda.current_stream(self.model.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    step()
            torch.cuda.current_stream(self.model.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = step()
        return graph, logits

    def prepare(self, token: int, first: int, last: int) -> None:
        """Capture the graphs of the rounds at positions [first, last]; `token` is round 1's."""
        position = first
        while position <= last:
            n_ctx = self._window(position)
            if n_ctx not in self.graphs:
                self.token.fill_(token)
                self.position.fill_(position)
                self.graphs[n_ctx] = self._capture(n_ctx)
            position = n_ctx  # the first position of the next window

    def __call__(self, token: int, position: int) -> torch.Tensor:
        self.token.fill_(token)
        self.position.fill_(position)
        n_ctx = self._window(position)
        if n_ctx not in self.graphs:  # not prepared for: capture now (inside the clock)
            self.graphs[n_ctx] = self._capture(n_ctx)
        graph, logits = self.graphs[n_ctx]
        graph.replay()
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


def generate(
    model: Any,
    tokenizer: Tokenizer | None,
    prompt_ids: Sequence[int],
    options: GenerateOptions,
    on_text: Callable[[str], None] | None = None,
    *,
    kv: ElasticKV | None = None,
) -> GenerateResult:
    """Generate up to `options.max_new` tokens after `prompt_ids`.

    `model` is a `strata.engine.model.moe.MoEModel`. With a `tokenizer`, the text is decoded as it
    comes and each new piece is passed to `on_text`; without one, `text` is "". `kv`: the
    elastic K/V kept across requests (`Loaded.kv`); None makes a K/V of `max_context` cells
    for this request and releases it after.
    Raises ValueError when the prompt is empty, holds an id outside the model's vocabulary, or
    does not fit `max_context` with `max_new`.
    """
    prompt = [int(i) for i in prompt_ids]
    check_prompt(prompt, options, model.config.vocab_size)
    device = model.device
    sampler = Sampler(options.temperature, options.top_p, options.top_k, options.seed)
    stop_ids = frozenset(() if options.ignore_stop else options.stop_ids)
    detok = tokenizer.detokenizer(prompt[-DETOKENIZER_CONTEXT_IDS:]) if tokenizer else None
    pieces: list[str] = []

    def emit(token: int) -> None:
        if detok is None or token in stop_ids:
            return
        piece = detok.push(token)
        if piece:
            pieces.append(piece)
            if on_text is not None:
                on_text(piece)

    cached = expert_cache(model.experts)
    cache_stats = None
    # The elastic K/V (--kv-grow) is kept across requests (`kv`); else one per request.
    elastic = kv
    if elastic is not None and options.max_context > elastic.kv.max_cells:
        raise ValueError(f"max_context {options.max_context} is past the elastic K/V's window "
                         f"of {elastic.kv.max_cells} cells")
    kv = new_kv(model, options.max_context) if elastic is None else elastic.kv
    try:
        if cached is not None:
            cached.begin_request()
        ids = torch.tensor(prompt, dtype=torch.int64, device=device)  # [P]
        _sync(device)
        start = time.perf_counter()
        if elastic is not None:
            # Once, for the whole request; if it fails, the run goes on while the cells last.
            elastic.ensure(min(len(prompt) + options.max_new + GROW_MARGIN_CELLS,
                               elastic.kv.max_cells))
        for chunk_start in range(0, len(prompt), options.prefill_chunk):
            chunk = ids[chunk_start : chunk_start + options.prefill_chunk]  # [C]
            if elastic is not None:
                elastic.require(chunk_start + chunk.shape[0])  # KvFullError past the mapped
            logits = model.forward(chunk, chunk_start, kv, last_only=True)  # [1, V]
        first_logits = logits[-1]  # [V]
        token = sampler.sample(first_logits)
        if cached is not None:
            cached.set_phase("decode")  # the prompt loan gives its slots back here
        _sync(device)
        prefill_s = time.perf_counter() - start
        first_logits = first_logits.float().cpu()

        tokens = [token]
        emit(token)
        # Graphs replay resident experts, and a cache that needs nothing on the host; a cache
        # that misses or a wrapper works on the host.
        resident = isinstance(model.experts, ResidentExperts)
        graph_cache = cached if cached is model.experts and cached.device_only else None
        if options.cuda_graphs and device.type == "cuda" and (resident or graph_cache):
            step = _GraphDecode(model, kv, options.compile and resident, graph_cache)
        elif options.cuda_graphs and options.piecewise_graphs and device.type == "cuda":
            step = _PiecewiseDecode(model, kv)
        else:
            step = _EagerDecode(model, kv)
        position = len(prompt)  # the cell of the token being fed
        start = time.perf_counter()
        if token not in stop_ids:
            step.prepare(token, position, len(prompt) + options.max_new - 2)
        _sync(device)
        decode_setup_s = time.perf_counter() - start
        start = time.perf_counter()
        while len(tokens) < options.max_new and token not in stop_ids:
            if elastic is not None:
                elastic.require(position + 1)
            token = sampler.sample(step(token, position))
            position += 1
            tokens.append(token)
            emit(token)
        _sync(device)
        decode_s = time.perf_counter() - start
    finally:
        if elastic is None:
            kv.close()
        if cached is not None:
            cache_stats = cached.end_request()
    if detok is not None:
        tail = detok.flush()
        if tail:
            pieces.append(tail)
            if on_text is not None:
                on_text(tail)
    return GenerateResult(
        tokens=tokens,
        text="".join(pieces),
        prompt_tokens=len(prompt),
        prefill_s=prefill_s,
        decode_rounds=len(tokens) - 1,
        decode_s=decode_s,
        decode_setup_s=decode_setup_s,
        stop_reason="eos" if tokens[-1] in stop_ids else "max_new",
        decode_path=step.path,
        first_logits=first_logits,
        cache=cache_stats,
        kv=elastic.stats.copy() if elastic is not None else None,
    )
