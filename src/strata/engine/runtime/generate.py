"""The generation loop: prefill the prompt in chunks, then one token per round.

The prompt is read in chunks of `prefill_chunk` tokens (None: `default_prefill_chunk`) into a
K/V of `max_context` cells; the last chunk's last logits give the first generated token. Each
decode round then runs one token through the model and samples the next: replayed from CUDA
graphs where it can be, eagerly elsewhere (`strata.engine.runtime.decode_steps`; the graphs a
run needs are captured before the decode clock starts). Rounds run eagerly off CUDA, with
`cuda_graphs=False`, or with `piecewise_graphs=False` and a cache that misses. With every expert
resident on CUDA, an engine's short prompt chunks replay graphs too
(`strata.engine.runtime.prompt_graphs`), captured the second time a chunk's shape is met.
`compile` applies to `ResidentExperts` only. The graph path
attends through a mask over its window, the eager one over exactly the cells written, so the two
may differ in the last bits; each is deterministic.

Timing: prefill is measured from the first chunk to the first token sampled; decode from the
first round to the last token sampled. Both end on a host read of the token, which waits for the
device; CUDA is also synchronised explicitly at the boundaries. A decode round is one forward of
one token plus its sampling, so a run of `max_new` tokens has `max_new - 1` rounds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from strata.engine.cache.cached_experts import CachedExperts
from strata.engine.experts import ResidentExperts
from strata.engine.kv.elastic import ElasticKV
from strata.engine.kv.kv_cache import KVCache, new_kv
from strata.engine.model.tokenizer import Tokenizer
from strata.engine.runtime.decode_loop import decode_rounds
from strata.engine.runtime.decode_steps import decode_step
from strata.engine.runtime.prompt_graphs import PromptGraphs
from strata.engine.runtime.sampling import Sampler

# A prompt's chunk when none is asked for. With every expert resident, long: a chunk's MoE is a
# few grouped products over its tokens and a chunk from position 0 attends in one fused causal
# call, so on the H200 a 4,096-token prompt read in one chunk ran at 3.0x its 512-token chunks
# (bench/results/prefill-h200-2026-12-01.md). Through the expert cache, the chunk the cache's
# workspace was planned for (`CacheBudget.prefill_chunk`: `--prefill-chunk`, or chosen from the
# budget), else CACHED_PREFILL_CHUNK.
RESIDENT_PREFILL_CHUNK = 4096
CACHED_PREFILL_CHUNK = 512
GROW_MARGIN_CELLS = 16  # the elastic K/V grows at a request for its prompt + this many cells
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
    prefill_chunk: int | None = None  # None: default_prefill_chunk(model)
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
            if name == "prefill_chunk" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        # The sampler validates temperature, top_p, top_k and seed.
        Sampler(self.temperature, self.top_p, self.top_k, self.seed)


def default_prefill_chunk(model: Any) -> int:
    """The prompt chunk of a request that asks for none: `RESIDENT_PREFILL_CHUNK` when every
    expert is resident (`ResidentExperts`); through the expert cache, wrapped (a routing
    recorder) or not, the chunk its budget was planned for; `CACHED_PREFILL_CHUNK` for other
    experts."""
    if isinstance(model.experts, ResidentExperts):
        return RESIDENT_PREFILL_CHUNK
    cached = expert_cache(model.experts)
    return cached.budget.prefill_chunk if cached is not None else CACHED_PREFILL_CHUNK


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
    # Of decode_s, the host's waits for the rounds' tokens (`decode_loop.Rounds`): the device's.
    decode_token_wait_s: float
    stop_reason: str  # "eos" (a stop id was generated), "max_new" or "stopped" (should_stop)
    decode_path: str  # "cuda-graph", "piecewise-cuda-graph" or "eager"
    first_logits: torch.Tensor = field(repr=False)  # float32 [V] on the CPU: the first position
    cache: Any = None  # the expert cache's CacheStats of this request, or None without a cache
    kv: Any = None  # the elastic K/V's KvStats after this request, or None without --kv-grow
    reused_tokens: int = 0  # prompt tokens whose cells the K/V held already (not read again)
    # From the request's start to its first token: `Engine.generate` adds what it does before
    # the prefill (parking, the K/V's trim and growth, a restore); `generate` alone: prefill_s.
    first_token_s: float = 0.0

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
            "reused_tokens": self.reused_tokens,
            "generated_tokens": len(self.tokens),
            "prefill_s": self.prefill_s,
            "prefill_tok_s": self.prefill_tok_s,
            "first_token_s": self.first_token_s,
            "decode_rounds": self.decode_rounds,
            "decode_s": self.decode_s,
            "decode_ms_per_round": self.decode_ms_per_round,
            "decode_tok_s": self.decode_tok_s,
            "decode_setup_s": self.decode_setup_s,
            "decode_token_wait_s": self.decode_token_wait_s,
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
    while not isinstance(experts, CachedExperts) and hasattr(experts, "inner"):
        experts = experts.inner
    return experts if isinstance(experts, CachedExperts) else None


class _TextStream:
    """The generated ids decoded as they come (`tokenizer`'s streaming detokenizer), each new
    piece passed to `on_text`; stop ids are not decoded."""

    def __init__(self, tokenizer: Tokenizer | None, prompt: list[int], stop_ids: frozenset[int],
                 on_text: Callable[[str], None] | None) -> None:
        self.detok = tokenizer.detokenizer(prompt[-DETOKENIZER_CONTEXT_IDS:]) \
            if tokenizer else None
        self.stop_ids, self.on_text = stop_ids, on_text
        self.pieces: list[str] = []

    def _add(self, piece: str) -> None:
        if piece:
            self.pieces.append(piece)
            if self.on_text is not None:
                self.on_text(piece)

    def push(self, token: int) -> None:
        if self.detok is not None and token not in self.stop_ids:
            self._add(self.detok.push(token))

    def finish(self) -> str:
        if self.detok is not None:
            self._add(self.detok.flush())
        return "".join(self.pieces)


def generate(
    model: Any,
    tokenizer: Tokenizer | None,
    prompt_ids: Sequence[int],
    options: GenerateOptions,
    on_text: Callable[[str], None] | None = None,
    *,
    kv: ElasticKV | None = None,
    cells: KVCache | None = None,
    reused: int = 0,
    warm: dict[tuple[Any, ...], Any] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> GenerateResult:
    """Generate up to `options.max_new` tokens after `prompt_ids`.

    `model` is a `strata.engine.model.MoEModel`. With a `tokenizer`, the text is decoded as it
    comes and each new piece is passed to `on_text`; without one, `text` is "". The K/V: `kv`,
    the elastic K/V kept across requests (`Loaded.kv`), grown at the request for the prompt
    (plus `GROW_MARGIN_CELLS`) and in decode rounds as they reach its mapped cells; else
    `cells`, a fixed K/V the caller keeps; else one of `max_context` cells made for this
    request and released after. `reused`: the prompt's first tokens whose cells the K/V holds
    already (a conversation's earlier turns), read again by no forward; at most all but one.
    `warm`: the decode steps (and their CUDA graphs) of earlier requests over the same K/V, to
    use again and to add to (`decode_step`); None makes them for this request.
    `should_stop`: asked before each decode round; True ends the request there with
    `stop_reason` "stopped" (a server's client went away, or its stop text was generated).
    Raises ValueError when the prompt is empty, holds an id outside the model's vocabulary, or
    does not fit `max_context` with `max_new`.
    """
    prompt = [int(i) for i in prompt_ids]
    check_prompt(prompt, options, model.config.vocab_size)
    stop_ids = frozenset(() if options.ignore_stop else options.stop_ids)
    text = _TextStream(tokenizer, prompt, stop_ids, on_text)
    cached = expert_cache(model.experts)
    cache_stats = None
    if not 0 <= reused < len(prompt):
        raise ValueError(f"reused {reused} must be in [0, {len(prompt) - 1}]: the last prompt "
                         "token is always read, its logits give the first new token")
    elastic = kv
    own_cells = elastic is None and cells is None
    cells = _request_cells(model, options, elastic, cells)
    run = _Run(model, cells, elastic, cached, options, stop_ids, warm, should_stop)
    try:
        if cached is not None:
            cached.begin_request()
        run.prefill(prompt, reused)
        text.push(run.tokens[0])
        run.decode(len(prompt), text.push)
    finally:
        if own_cells:
            cells.close()
        if cached is not None:
            cache_stats = cached.end_request()
    tokens = run.tokens
    return GenerateResult(
        tokens=tokens,
        text=text.finish(),
        prompt_tokens=len(prompt),
        prefill_s=run.prefill_s,
        decode_rounds=len(tokens) - 1,
        decode_s=run.decode_s,
        decode_setup_s=run.decode_setup_s,
        decode_token_wait_s=run.decode_token_wait_s,
        stop_reason="eos" if tokens[-1] in stop_ids else "stopped" if run.stopped else "max_new",
        decode_path=run.path,
        first_logits=run.first_logits,
        reused_tokens=reused,
        first_token_s=run.prefill_s,
        cache=cache_stats,
        kv=elastic.stats.copy() if elastic is not None else None,
    )


def _request_cells(model: Any, options: GenerateOptions, elastic: ElasticKV | None,
                   cells: KVCache | None) -> KVCache:
    """The request's K/V cells: the elastic K/V's (--kv-grow, kept across requests), else the
    caller's `cells`, else new ones of `max_context` cells (the caller releases them).
    ValueError when `max_context` is past the window of the ones given."""
    if elastic is not None and options.max_context > elastic.kv.max_cells:
        raise ValueError(f"max_context {options.max_context} is past the elastic K/V's window "
                         f"of {elastic.kv.max_cells} cells")
    if cells is not None and cells.max_cells < options.max_context:
        raise ValueError(f"max_context {options.max_context} is past the K/V's window of "
                         f"{cells.max_cells} cells")
    if elastic is not None:
        return elastic.kv
    return cells if cells is not None else new_kv(model, options.max_context)


class _Run:
    """One request's prefill and decode rounds, timed (see the module's docstring)."""

    def __init__(self, model: Any, kv: Any, elastic: ElasticKV | None,
                 cached: CachedExperts | None, options: GenerateOptions,
                 stop_ids: frozenset[int], warm: dict[tuple[Any, ...], Any] | None,
                 should_stop: Callable[[], bool] | None = None) -> None:
        self.model, self.kv, self.elastic, self.cached = model, kv, elastic, cached
        self.options, self.stop_ids, self.warm = options, stop_ids, warm
        self.should_stop = should_stop
        self.stopped = False
        self.sampler = Sampler(options.temperature, options.top_p, options.top_k, options.seed)
        self.tokens: list[int] = []
        self.prefill_s = self.decode_s = self.decode_setup_s = self.decode_token_wait_s = 0.0
        self.path = "eager"

    def _step(self) -> Any:
        options = self.options
        step = decode_step(self.model, self.kv, self.cached, cuda_graphs=options.cuda_graphs,
                           piecewise_graphs=options.piecewise_graphs, compile=options.compile,
                           warm=self.warm, greedy=self.sampler.greedy)
        self.path, self._current = step.path, step
        return step

    def _prompt_graphs(self) -> PromptGraphs | None:
        """The short chunks' graphs (`strata.engine.runtime.prompt_graphs`) where they can be
        captured (every expert resident, on CUDA, graphs on) and kept: only with `warm`, the
        steps an engine keeps across requests (a graph is captured at a shape's second use,
        which one request alone rarely makes)."""
        model, warm = self.model, self.warm
        experts = model.experts
        if (warm is None or not self.options.cuda_graphs or model.device.type != "cuda"
                or not isinstance(experts, ResidentExperts) or not experts.prompt_capturable):
            return None
        key = ("prompt", id(self.kv))
        if key not in warm:
            warm[key] = PromptGraphs(model, self.kv)
        return warm[key]

    def prefill(self, prompt: list[int], reused: int) -> None:
        """Read the prompt past its `reused` tokens in chunks and sample the first token
        (`first_logits` kept)."""
        model, elastic, options = self.model, self.elastic, self.options
        ids = torch.tensor(prompt, dtype=torch.int64, device=model.device)  # [P]
        _sync(model.device)
        start = time.perf_counter()
        if elastic is not None:
            # For the prompt, not for max_new: most requests stop early; decode rounds grow
            # it further as they reach the mapped cells. If this fails, the run goes on while
            # the cells last.
            elastic.ensure(min(len(prompt) + GROW_MARGIN_CELLS, elastic.kv.max_cells))
        chunk_tokens = options.prefill_chunk or default_prefill_chunk(model)
        graphs = self._prompt_graphs()
        for chunk_start in range(reused, len(prompt), chunk_tokens):
            chunk = ids[chunk_start : chunk_start + chunk_tokens]  # [C]
            if elastic is not None:
                elastic.require(chunk_start + chunk.shape[0])  # KvFullError past the mapped
            logits = graphs(chunk, chunk_start) if graphs is not None else None  # [1, V]
            if logits is None:  # no graph for this chunk (or none at all): eagerly
                logits = model.forward(chunk, chunk_start, self.kv, last_only=True)  # [1, V]
        first_logits = logits[-1]  # [V]
        self.tokens.append(self.sampler.sample(first_logits))
        if self.cached is not None:
            self.cached.set_phase("decode")  # the prompt loan gives its slots back here
        _sync(model.device)
        self.prefill_s = time.perf_counter() - start
        self.first_logits = first_logits.float().cpu()

    def decode(self, position: int, on_token: Callable[[int], None]) -> None:
        """Decode rounds from `position` (the cell of the token being fed) until `max_new`
        tokens or a stop id; each new token to `on_token`."""
        model, options, tokens = self.model, self.options, self.tokens
        step = self._step()
        token = tokens[-1]
        start = time.perf_counter()
        if token not in self.stop_ids:
            # The rounds the mapped cells hold; an elastic K/V grown later captures the next
            # windows as the rounds reach them (addresses never move: the graphs stay valid).
            step.prepare(token, position, min(position + options.max_new - 2,
                                              self.kv.mapped_cells - 1))
        _sync(model.device)
        self.decode_setup_s = time.perf_counter() - start
        def take(token: int) -> None:
            tokens.append(token)
            on_token(token)

        start = time.perf_counter()
        if token not in self.stop_ids:
            rounds = decode_rounds(
                step, self.sampler, token, position, options.max_new - len(tokens),
                stop_ids=self.stop_ids, on_token=take, should_stop=self.should_stop,
                grow=self._grow if self.elastic is not None else None)
            self.stopped, self.decode_token_wait_s = rounds.stopped, rounds.token_wait_s
        _sync(model.device)
        self.decode_s = time.perf_counter() - start

    def _grow(self, position: int) -> Any:
        """Map the cell of a round at `position` (the elastic K/V's policy steps; KvFullError
        when it cannot) and return the step for the rounds after: a new one when the old one
        went stale (slots given up: the experts work on the host now)."""
        self.elastic.require(position + 1)
        return self._step() if not self._current.still_valid() else self._current


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
