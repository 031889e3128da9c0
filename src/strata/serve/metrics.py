"""`Metrics`: what `GET /metrics` shows, in Prometheus' text format (`prometheus-client`).

Each app has its own registry (not the library's global one), so that several servers can live
in one process (the tests make many). Three sources feed it:
- the access log: every HTTP request by route and status (`strata_http_requests_total`);
- the engine thread, after each request: tokens (prompt, reused, completion), time to first
  token, decode tok/s, the expert cache's hits and lookups, the K/V cells mapped, the parked
  conversations and the conversation cache's host memory;
- the engine's plugin manager: `EngineEvents` is an observer (a pluggy plugin) that counts
  every event the engine emits by kind: `grown`, `trimmed`, `gave_up`, `refilled`, `parked`,
  `restored`, ... (`strata_engine_events_total{kind=...}`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from strata.policies import hookimpl
from strata.policies.events import EVENTS, Event

__all__ = ["CONTENT_TYPE_LATEST", "EngineEvents", "Metrics"]

SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOK_S_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)


class EngineEvents:
    """A `strata_event` observer: counts each kind of event, and tells the metrics."""

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        # Every kind present from the start, at 0: /v1/status reads a copy from another
        # thread, and a dashboard finds every series before the first event.
        self.counts: dict[str, int] = {event.kind: 0 for event in EVENTS}
        for kind in self.counts:
            counter.labels(kind=kind)
        self._lock = threading.Lock()

    @hookimpl
    def strata_event(self, event: Event) -> None:
        with self._lock:
            self.counts[event.kind] = self.counts.get(event.kind, 0) + 1
        self.counter.labels(kind=event.kind).inc()

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


class Metrics:
    """The app's registry and its series (see the module's docstring). `waiting` is read at
    each scrape (the requests in the queue)."""

    def __init__(self, waiting: Callable[[], int]) -> None:
        self.registry = registry = CollectorRegistry()
        ProcessCollector(registry=registry)  # process_resident_memory_bytes, cpu seconds, fds
        self.http = Counter("strata_http_requests", "HTTP requests answered, by route and "
                            "status", ["route", "status"], registry=registry)
        self.prompt_tokens = Counter("strata_prompt_tokens", "prompt tokens of the requests "
                                     "that ran", registry=registry)
        self.reused_tokens = Counter("strata_reused_tokens", "prompt tokens the K/V held "
                                     "already (usage's cached_tokens)", registry=registry)
        self.completion_tokens = Counter("strata_completion_tokens", "tokens generated",
                                         registry=registry)
        self.first_token = Histogram("strata_time_to_first_token_seconds", "from a request's "
                                     "arrival to its first text, queueing included",
                                     buckets=SECONDS_BUCKETS, registry=registry)
        self.decode = Histogram("strata_decode_tokens_per_second", "decode rounds a second, "
                                "per request", buckets=TOK_S_BUCKETS, registry=registry)
        self.hits = Counter("strata_expert_cache_hits", "routed experts found in the expert "
                            "cache", registry=registry)
        self.lookups = Counter("strata_expert_cache_lookups", "routed experts looked up in the "
                               "expert cache", registry=registry)
        self.hit_rate = Gauge("strata_expert_cache_hit_rate", "the last request's expert "
                              "cache hit rate", registry=registry)
        self.cells = Gauge("strata_kv_cells_mapped", "K/V cells with memory behind them",
                           registry=registry)
        self.window = Gauge("strata_kv_window_cells", "the window: K/V cells a conversation "
                            "may reach (--max-context)", registry=registry)
        self.parked = Gauge("strata_parked_conversations", "conversations parked in host RAM",
                            registry=registry)
        self.parked_bytes = Gauge("strata_conversation_cache_bytes", "host memory the "
                                  "conversation cache holds (parked and spare pages)",
                                  registry=registry)
        queue = Gauge("strata_queue_waiting", "requests waiting behind the one computing",
                      registry=registry)
        queue.set_function(waiting)
        self.events = EngineEvents(Counter(
            "strata_engine_events", "the engine's events by kind (grown, trimmed, refilled, "
            "parked, restored, ...)", ["kind"], registry=registry))

    def record_request(self, result: Any, first_text_s: float) -> None:
        """The figures of one request that ran (`GenerateResult`)."""
        self.prompt_tokens.inc(result.prompt_tokens)
        self.reused_tokens.inc(result.reused_tokens)
        self.completion_tokens.inc(len(result.tokens))
        self.first_token.observe(first_text_s)
        if result.decode_rounds:
            self.decode.observe(result.decode_tok_s)
        if result.cache is not None and result.cache.lookups:
            self.hits.inc(result.cache.hits)
            self.lookups.inc(result.cache.lookups)
            self.hit_rate.set(result.cache.hit_rate)

    def record_engine(self, figures: dict[str, Any]) -> None:
        """The engine's gauges, from `status.engine_figures`."""
        self.cells.set(figures["kv"]["cells_mapped"])
        self.window.set(figures["kv"]["window_cells"])
        conversations = figures["conversations"]
        self.parked.set(conversations["parked"] if conversations else 0)
        self.parked_bytes.set(conversations["host_bytes"] if conversations else 0)

    def text(self) -> bytes:
        """The exposition, as `GET /metrics` answers it."""
        return generate_latest(self.registry)
