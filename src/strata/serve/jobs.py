"""`Job`: one request between the event loop that received it and the engine thread.

The engine runs on its own thread (it is not thread-safe, and a request computes for seconds),
while HTTP is served by an asyncio event loop. A job carries the checked work to the engine
thread and carries back what it produces, in order, through an asyncio queue that the engine
thread fills with `loop.call_soon_threadsafe` (the one thread-safe way into a loop):

    ("started", None)      the engine took the job: the response may begin
    ("text", piece)        text for the client, stop strings already cut
    ("done", Finished)     the request ended: its result and the text's figures
    ("error", ApiError)    the job could not run (shutdown, the engine failed on it)

The other way, `cancel()` (the client went away) sets a flag the engine reads before each
decode round (`should_stop`), as it reads whether a stop string was generated.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any

from strata.serve.errors import ApiError
from strata.serve.prompts import Work
from strata.serve.stops import StopText

__all__ = ["Finished", "Job", "watch_disconnect"]


@dataclass(frozen=True)
class Finished:
    """A request's end: the engine's `GenerateResult`, how the reply ended for the client
    ("stop": an end token or a stop string; "length": max_tokens), and the server's clocks:
    seconds waiting in the queue, and from arrival to the first text (time to first token)."""

    result: Any
    finish_reason: str
    queued_s: float
    first_text_s: float


class Job:
    """One request on its way through the engine thread (see the module's docstring)."""

    def __init__(self, work: Work, loop: asyncio.AbstractEventLoop) -> None:
        self.work, self.loop = work, loop
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.stop_text = StopText(work.stops)
        self._cancelled = threading.Event()
        self.arrived = time.perf_counter()
        self.started: float | None = None  # when the engine took it
        self.first_text: float | None = None

    # --- the engine thread's side ---
    def post(self, kind: str, value: Any = None) -> None:
        """Hand `(kind, value)` to the request's event loop (from any thread)."""
        # A closed loop (RuntimeError): the server stopped, and nobody is waiting.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))

    def on_text(self, piece: str) -> None:
        """The engine's text callback: stop strings cut, the rest posted."""
        out = self.stop_text.feed(piece)
        if out:
            if self.first_text is None:
                self.first_text = time.perf_counter()
            self.post("text", out)

    def should_stop(self) -> bool:
        """Asked by the engine before each decode round."""
        return self._cancelled.is_set() or self.stop_text.hit

    def finish(self, result: Any) -> Finished:
        """Post what is left of the text and the end of the request; the `Finished` posted."""
        tail = self.stop_text.finish()
        if tail:
            self.on_text(tail)
        now = time.perf_counter()
        started = self.started if self.started is not None else now
        reason = "length" if result.stop_reason == "max_new" and not self.stop_text.hit \
            else "stop"
        finished = Finished(result, reason, queued_s=started - self.arrived,
                            first_text_s=(self.first_text or now) - self.arrived)
        self.post("done", finished)
        return finished

    # --- the event loop's side ---
    def cancel(self) -> None:
        """The client went away: a waiting job is skipped, a running one stops."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    async def next(self) -> tuple[str, Any]:
        return await self.events.get()

    async def wait_started(self) -> None:
        """Until the engine takes the job; raises the ApiError that came instead."""
        kind, value = await self.next()
        if kind == "error":
            raise value
        if kind != "started":
            raise RuntimeError(f"a job's first event must be 'started', got {kind!r}")


async def watch_disconnect(receive: Any, job: Job) -> None:
    """Cancel `job` when the client disconnects (ASGI `receive` says `http.disconnect`), and
    wake its handler, which may be waiting for a job the engine thread will now skip."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            # 499: nginx's "client closed request"; nobody reads it, the log line shows it.
            job.events.put_nowait(("error", ApiError(499, "the client went away",
                                                     code="client_closed")))
            return
