"""`Engine`: one model with its expert cache, K/V and plugins, serving requests one at a time.

The engine owns, for its whole life, what `load` composed (the model, the expert cache with
its loan, the elastic K/V) or, without `--kv-grow`, one fixed K/V of the window; the
conversation cache; the plugin manager its observers hang on. Requests run one at a time
(`generate`), each through the same K/V, so that a conversation's next turn reads only what
is new.

At each request, in this order:
1. the live conversation (its token ids; cells [0, len) of the K/V hold their keys and values)
   and the parked ones are matched against the prompt: the request reuses the longest common
   prefix with the live conversation; if a parked one shares more (or the live one shares
   nothing), the live one is parked (its cells copied to host RAM) and the best parked one
   is restored after step 2; a request that keeps less than half of the live one (another
   chat sharing only a system prompt) parks it too, and reuses the common prefix in place.
   At least the prompt's last token is always read again: its logits give the first new
   token;
2. the elastic K/V is fitted to the request: trimmed to the prompt's need when the policy's
   target for it is below the mapped cells (no conversation holds cells above what this
   request reuses: the outgoing one was parked or its tail dropped), its chunks refilled into
   the expert cache; then grown for the prompt (plus a margin), and later in decode rounds;
3. the restore, if any: the parked cells copied back;
4. the prefill of the prompt past the reused tokens, and the decode rounds (`generate`).
Observers hear `RequestStarted`, the cache's and the K/V's events, `Parked` / `Restored`, and
`RequestFinished`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pluggy
import torch

from strata.engine.cache.build import CacheConfig
from strata.engine.kv.conversations import ConversationCache, common_prefix
from strata.engine.kv.kv_cache import KVCache, new_kv
from strata.engine.kv.plan import KvGrowConfig
from strata.engine.model.config import ModelConfig
from strata.engine.model.tokenizer import Tokenizer
from strata.engine.runtime.generate import (
    GROW_MARGIN_CELLS,
    GenerateOptions,
    GenerateResult,
    check_prompt,
    generate,
)
from strata.engine.runtime.load import Loaded, load
from strata.engine.runtime.options import EngineOptions, kv_cell_dtype, plan_engine_cache
from strata.policies import EngineInfo, announce_start, emit
from strata.policies.events import Event, Parked, RequestFinished, RequestStarted, Restored

__all__ = ["Engine"]

MIB = 1 << 20
# A request that keeps less than this share of the live conversation parks it before reusing
# their common prefix (a chat's next turn keeps nearly all of it: nothing is parked then).
PARK_WHEN_KEPT_UNDER = 0.5


class Engine:
    """Requests one at a time through `loaded` (see the module's docstring).

    `tokenizer` decodes the text as it comes (None: token ids only); `max_context` is the
    window every request fits in; `conversations` parks finished conversations (None: a request
    that shares nothing with the live one drops it); `events` is the plugin manager observers
    are registered on (None: nobody). `close` releases everything; the engine is a context
    manager.
    """

    def __init__(
        self,
        loaded: Loaded,
        tokenizer: Tokenizer | None,
        *,
        max_context: int,
        name: str = "model",
        conversations: ConversationCache | None = None,
        events: pluggy.PluginManager | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        self.loaded, self.model, self.tokenizer = loaded, loaded.model, tokenizer
        self.elastic, self.cache = loaded.kv, loaded.cache
        if self.elastic is not None and self.elastic.kv.max_cells < max_context:
            raise ValueError(f"max_context {max_context} is past the elastic K/V's window of "
                             f"{self.elastic.kv.max_cells} cells")
        self.max_context = max_context
        if self.elastic is not None and kv_dtype not in (None, self.elastic.kv.cell_dtype):
            raise ValueError(f"kv_dtype {kv_dtype} differs from the elastic K/V's cells, "
                             f"{self.elastic.kv.cell_dtype}: plan it with kv_dtype")
        # Without the elastic K/V, one K/V of the whole window for the engine's life, its
        # cells in `kv_dtype` (None: the model's dtype).
        self.fixed: KVCache | None = None if self.elastic is not None else \
            new_kv(self.model, max_context, kv_dtype)
        self.conversations = conversations
        self.events = events
        self.notes: list[str] = []  # what planning had to say (from_options)
        self.live: list[int] = []  # the live conversation: cells [0, len(live)) hold it
        # Decode steps and their CUDA graphs, captured once and replayed by every request.
        self.warm: dict[tuple[object, ...], object] = {}
        self._requests = (f"r{i}" for i in itertools.count(1))
        if events is not None:
            announce_start(events, self.info(name))

    @classmethod
    def open(
        cls,
        path: str | Path,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        max_context: int = 4096,
        cache: CacheConfig | None = None,
        kv_grow: KvGrowConfig | None = None,
        conversation_cache_mib: float = 0.0,
        conversation_cache_slots: int = 0,
        tokenizer: Tokenizer | None = None,
        events: pluggy.PluginManager | None = None,
        progress: bool = False,
        experts_quant: str | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> Engine:
        """Load the checkpoint at `path` (see `load`; `experts_quant`: the experts quantized
        at load) and start an engine on it, with a conversation cache of
        `conversation_cache_mib` MiB and `conversation_cache_slots` entries (either 0: none).
        `kv_dtype` is the K/V cells' dtype (None: the model's; with `kv_grow`, the one it was
        planned with). `events` defaults to the cache's plugin manager."""
        if conversation_cache_mib < 0 or conversation_cache_slots < 0:
            raise ValueError("conversation_cache_mib and conversation_cache_slots must be >= 0, "
                             f"got {conversation_cache_mib} and {conversation_cache_slots}")
        loaded = load(path, device=device, dtype=dtype, progress=progress, cache=cache,
                      kv_grow=kv_grow, experts_quant=experts_quant)
        try:
            conversations = None
            if conversation_cache_mib > 0 and conversation_cache_slots > 0:
                conversations = ConversationCache(
                    int(conversation_cache_mib * MIB), conversation_cache_slots,
                    pin=loaded.model.device.type == "cuda")
            if events is None and cache is not None:
                events = cache.events
            return cls(loaded, tokenizer, max_context=max_context, name=str(path),
                       conversations=conversations, events=events, kv_dtype=kv_dtype)
        except BaseException:
            loaded.close()
            raise

    @classmethod
    def from_options(cls, path: str | Path, options: EngineOptions, *,
                     tokenizer: Tokenizer | None = None, progress: bool = False,
                     on_note: Callable[[str], None] | None = None) -> Engine:
        """Plan the cache `options.cache` asks for (`plan_cache_options`: every value checked,
        the cache sized, before the long load), then `open`. The plan's notes (the profile
        warning, the elastic K/V's figures) go to `on_note` as soon as they are known, before
        the load, and are kept in `notes`. Raises as `plan_cache_options` and `load`."""
        config = ModelConfig.from_dir(path)
        plan, quant = plan_engine_cache(options, config)
        for note in plan.notes if on_note is not None else ():
            on_note(note)
        try:
            engine = cls.open(
                path, device=options.device, dtype=options.dtype,
                max_context=options.max_context, cache=plan.config, kv_grow=plan.kv_grow,
                conversation_cache_mib=options.conversation_cache_mib,
                conversation_cache_slots=options.conversation_cache_slots,
                tokenizer=tokenizer, progress=progress, experts_quant=quant,
                kv_dtype=kv_cell_dtype(options, config))
        except BaseException:
            if plan.config is not None:
                plan.config.backend.close()
            raise
        engine.notes = plan.notes
        return engine

    @property
    def kv(self) -> KVCache:
        """The K/V every request runs in."""
        return self.elastic.kv if self.elastic is not None else self.fixed

    def info(self, name: str) -> EngineInfo:
        """The engine's shape, as `strata_engine_started` tells it."""
        cfg, cache = self.model.config, self.cache
        return EngineInfo(
            model=name, device=str(self.model.device),
            policy=cache.checked.name if cache is not None else "none",
            n_layers=cfg.n_layers, n_experts=cfg.n_experts,
            n_slots=cache.arena.n_slots if cache is not None else 0,
            slot_bytes=cache.arena.slot_bytes if cache is not None else 0,
            chunk_bytes=self.kv.chunk_bytes, max_cells=self.kv.max_cells,
            mapped_cells=self.kv.mapped_cells, kv_grow=self.elastic is not None,
        )

    # --- requests ---
    def generate(self, prompt_ids: Sequence[int], options: GenerateOptions,
                 on_text: Callable[[str], None] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> GenerateResult:
        """Run one request (see the module's docstring); the result's `reused_tokens` says how
        many prompt tokens it did not read again. `should_stop` is asked before each decode
        round (True: the request ends there, its cells kept as the live conversation's).
        Raises ValueError for a bad prompt or options (nothing changed), and whatever the run
        raises (the live conversation is then dropped: its cells may be half-written)."""
        prompt = [int(i) for i in prompt_ids]
        if options.max_context > self.max_context:
            raise ValueError(f"max_context {options.max_context} is past the engine's window "
                             f"of {self.max_context} cells")
        check_prompt(prompt, options, self.model.config.vocab_size)
        name = next(self._requests)
        started = time.perf_counter()
        restore, reused = self._match(prompt)
        self._emit(RequestStarted(request=name, prompt_tokens=len(prompt), reused_tokens=reused))
        try:
            self._fit_kv(prompt, reused)
            if restore is not None:
                self._restore(restore, reused)
                restore = None
            self.live = []  # from here until it ends, the request writes the cells
            setup_s = time.perf_counter() - started
            result = generate(self.model, self.tokenizer, prompt, options, on_text,
                              kv=self.elastic, cells=self.fixed, reused=reused,
                              warm=self.warm, should_stop=should_stop)
        except BaseException:
            self.live = []
            if restore is not None:  # not restored: it stays parked, nothing is lost
                self.conversations.put_back(restore)
            raise
        result.first_token_s = setup_s + result.prefill_s
        # Cells hold the prompt and every generated token but the last, which was not fed.
        self.live = prompt + result.tokens[:-1]
        self._emit(RequestFinished(
            request=name, prompt_tokens=len(prompt), new_tokens=len(result.tokens),
            seconds=time.perf_counter() - started,
            hits=result.cache.hits if result.cache is not None else 0,
            lookups=result.cache.lookups if result.cache is not None else 0,
            reused_tokens=reused, first_token_s=result.first_token_s))
        return result

    def _match(self, prompt: list[int]):
        """(the parked conversation to restore or None, the prompt tokens reused); parks or
        drops the live conversation when the request does not continue it."""
        last = len(prompt) - 1  # the last prompt token is always read: its logits are needed
        live_n = min(common_prefix(self.live, prompt), last)
        parked, parked_n = (None, 0) if self.conversations is None else \
            self.conversations.best(prompt)
        parked_n = min(parked_n, last)
        if parked is not None and parked_n > live_n:
            restore = self.conversations.take(parked)  # first: parking may make room by LRU
            try:
                self._park()
            except BaseException:  # nothing was parked or dropped: it goes back, as it was
                self.conversations.put_back(restore)
                raise
            return restore, parked_n
        if live_n == 0:
            self._park()
            return None, 0
        if live_n < PARK_WHEN_KEPT_UNDER * len(self.live):
            # The request leaves the live conversation early: another chat that shares only
            # the template's start or a system prompt. Park it whole, to be restored when it
            # comes back; the cells of the common prefix stay in place for this request.
            kept = self.live[:live_n]
            self._park()
            self.live = kept
            return None, live_n
        self.live = self.live[:live_n]  # the cells past the common prefix are dropped
        return None, live_n

    def _park(self) -> None:
        """Park the live conversation (if any, and if the cache takes it), then drop it. A park
        that raises leaves it live (its cells untouched) and the cache as it was."""
        entry = None
        if self.live and self.conversations is not None:
            entry, _ = self.conversations.park(self.live, self.kv)
        self.live = []
        if entry is not None:
            self._emit(Parked(conversation=entry.name, cells=entry.n_cells,
                              nbytes=entry.nbytes))

    def _fit_kv(self, prompt: list[int], reused: int) -> None:
        """Trim the elastic K/V to what this request needs when the policy says so, then
        grow it for the prompt (the decode rounds grow it further)."""
        if self.elastic is None:
            return
        need = min(len(prompt) + GROW_MARGIN_CELLS, self.elastic.kv.max_cells)
        # Nothing above `reused` cells is held: the outgoing conversation was parked or its
        # tail dropped, so the cells above the need may go back to the expert cache.
        self.elastic.trim(need)
        self.elastic.ensure(need)

    def _restore(self, entry, n_cells: int) -> None:
        """Copy a parked conversation's first `n_cells` back (the K/V grown for them)."""
        if self.elastic is not None:
            self.elastic.require(n_cells)
        self.conversations.restore(entry, self.kv, n_cells)
        self._emit(Restored(conversation=entry.name, cells=n_cells,
                            nbytes=n_cells * self.conversations.cell_bytes(self.kv)))

    def _emit(self, event: Event) -> None:
        if self.events is not None:
            emit(self.events, event)

    def reset(self) -> None:
        """Forget the live conversation: the next request reads its whole prompt, writing over
        the cells. Parked conversations stay. For measurements that must not reuse a prompt
        (benchmarks repeating one request) and for a user's "new conversation"."""
        self.live = []

    # --- life ---
    def close(self) -> None:
        """Release the K/V, the cache and the parked conversations. Idempotent."""
        if self.fixed is not None:
            self.fixed.close()
            self.fixed.backend.close()
        self.loaded.close()
        if self.conversations is not None:
            self.conversations.clear()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
