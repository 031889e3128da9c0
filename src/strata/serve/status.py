"""`Status`: what `GET /v1/status` shows, kept current by the engine thread.

The engine's state (the K/V's mapped cells, the parked conversations, the cache's books) may
change while a request computes, and only the engine thread may read it safely. So that thread
takes a snapshot after loading and after each request (`engine_figures`), and the route answers
from the latest snapshot, with the queue's and the events' live counts beside it.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from strata.engine.runtime.engine import Engine
from strata.serve.jobs import Finished, Job

__all__ = ["Status", "engine_figures", "rss_bytes"]

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
KV_COUNTERS = ("grows", "trims", "slots_given_up", "relocated", "refilled", "fresh_chunks",
               "returned_chunks", "failures")


def rss_bytes() -> int:
    """This process's resident memory, in bytes (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE_BYTES


def engine_figures(engine: Engine) -> dict[str, Any]:
    """The engine's cache, K/V and conversations now; call it on the engine's thread."""
    cache, kv, parked = engine.cache, engine.kv, engine.conversations
    figures: dict[str, Any] = {
        "device": str(engine.model.device),
        "live_conversation_tokens": len(engine.live),
        "kv": {"cells_mapped": kv.mapped_cells, "window_cells": engine.max_context,
               "elastic": engine.elastic is not None},
        "cache": None,
        "conversations": None,
    }
    if engine.elastic is not None:
        stats = engine.elastic.stats
        figures["kv"].update({key: getattr(stats, key) for key in KV_COUNTERS})
        figures["kv"]["last_failure"] = stats.last_failure
    if cache is not None:
        table = cache.table
        figures["cache"] = {
            "policy": cache.checked.name, "slots": cache.arena.n_slots,
            "backed_slots": int(table.backed.sum()), "resident_experts": table.n_resident,
            "experts": table.n_layers * table.n_experts,
        }
    if parked is not None:
        figures["conversations"] = {
            "parked": len(parked), "parked_cells": sum(e.n_cells for e in parked.entries()),
            "parked_bytes": sum(e.nbytes for e in parked.entries()),
            "host_bytes": parked.host_bytes, "spare_bytes": parked.spare_bytes,
            "max_bytes": parked.max_bytes,
            "max_entries": parked.max_entries,
        }
    return figures


def request_figures(job: Job, finished: Finished) -> dict[str, Any]:
    """One request's figures, as the last request of /v1/status and the access log give them."""
    result = finished.result
    return {
        "prompt_tokens": result.prompt_tokens,
        "reused_tokens": result.reused_tokens,
        "completion_tokens": len(result.tokens),
        "finish_reason": finished.finish_reason,
        "stopped": result.stop_reason == "stopped" and not job.stop_text.hit,
        "queued_s": finished.queued_s,
        # The server's time to first token: from arrival to the first text sent, the queue
        # included; the engine's: parking, fitting the K/V and restoring, then the prefill.
        "ttft_s": finished.first_text_s,
        "first_token_s": result.first_token_s,
        "prefill_s": result.prefill_s,
        "decode_tok_s": result.decode_tok_s,
        "hit_rate": result.cache.hit_rate if result.cache is not None else None,
    }


class Status:
    """The latest snapshot (see the module's docstring) and the requests' running totals."""

    def __init__(self) -> None:
        self.started = time.time()
        self._lock = threading.Lock()
        self.engine: dict[str, Any] | None = None
        self.last_request: dict[str, Any] | None = None
        self.completed = 0
        self.hits = self.lookups = 0

    def record_engine(self, figures: dict[str, Any]) -> None:
        with self._lock:
            self.engine = figures

    def record_request(self, job: Job, finished: Finished) -> dict[str, Any]:
        """Keep one request's figures; returns them."""
        figures = request_figures(job, finished)
        cache = finished.result.cache
        with self._lock:
            self.last_request = figures
            self.completed += 1
            if cache is not None:
                self.hits += cache.hits
                self.lookups += cache.lookups
        return figures

    def document(self, *, model: str, state: str, waiting: int, max_queue: int,
                 computing: bool, events: dict[str, int]) -> dict[str, Any]:
        """The body of `GET /v1/status`."""
        with self._lock:
            engine = dict(self.engine or {})
            if engine.get("cache") is not None:
                engine["cache"] = {**engine["cache"], "hits": self.hits,
                                   "lookups": self.lookups,
                                   "hit_rate": self.hits / self.lookups if self.lookups else None}
            return {
                "model": model, "state": state, "uptime_s": time.time() - self.started,
                "queue": {"computing": computing, "waiting": waiting, "max_waiting": max_queue},
                "requests_completed": self.completed,
                **engine,
                "events": events,
                "last_request": self.last_request,
                "memory": {"rss_bytes": rss_bytes()},
            }
