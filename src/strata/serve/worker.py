"""`EngineWorker`: the one thread that owns the engine, and the queue in front of it.

The engine runs one request at a time and is not thread-safe, so one thread owns it for its
whole life: it loads the model (`/health` says 503 meanwhile), then takes jobs in arrival order
from a bounded queue and runs each to its end, then closes the engine when the server stops.
A request that finds the queue full is refused at once (503, `Retry-After`); one whose client
left while it waited leaves the queue; at shutdown the waiting ones are refused (503) and the
one computing finishes.

A failed request does not stop the worker: the engine drops the live conversation (its cells
may be half-written), keeps the parked ones, and serves the next request.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable

from strata.engine.kv.elastic import KvFullError
from strata.serve.errors import ApiError
from strata.serve.jobs import Finished, Job
from strata.serve.options import ServedModel

__all__ = ["EngineWorker"]

log = logging.getLogger("strata.serve")

LOADING, READY, FAILED, STOPPED = "loading", "ready", "failed", "stopped"


class EngineWorker:
    """The engine's thread (see the module's docstring).

    `load` returns the `ServedModel` (called on this thread); `max_queue` requests may wait
    behind the one computing. The callbacks run on this thread: `on_loaded(served)` once
    ready, `on_finished(served, job, finished)` after each request that ran to its end,
    `on_failed(error)` if loading failed (the server should then stop).
    """

    def __init__(self, load: Callable[[], ServedModel], *, max_queue: int,
                 retry_after_s: int = 1,
                 on_loaded: Callable[[ServedModel], None] | None = None,
                 on_finished: Callable[[ServedModel, Job, Finished], None] | None = None,
                 on_failed: Callable[[BaseException], None] | None = None) -> None:
        self._load, self.max_queue, self.retry_after_s = load, max_queue, retry_after_s
        self.on_loaded, self.on_finished, self.on_failed = on_loaded, on_finished, on_failed
        self.state = LOADING
        self.error: BaseException | None = None  # why loading failed
        self.served: ServedModel | None = None
        self.load_s = 0.0
        self.computing: Job | None = None
        self._waiting: collections.deque[Job] = collections.deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="strata-engine", daemon=True)

    # --- the event loop's side ---
    def start(self) -> None:
        self._thread.start()

    @property
    def waiting(self) -> int:
        """Requests waiting behind the one computing."""
        return len(self._waiting)

    def ready_model(self) -> ServedModel:
        """The served model; ApiError 503 while loading, after a failed load, or stopping."""
        if self.state == READY and not self._stopping:
            return self.served
        message = {LOADING: "the model is still loading; retry shortly",
                   FAILED: f"the model failed to load: {self.error}"}.get(
            self.state, "the server is shutting down")
        raise ApiError(503, message, code=self.state if self.state != READY else "stopping",
                       headers={"Retry-After": str(self.retry_after_s)})

    def submit(self, job: Job) -> None:
        """Queue `job` behind the others; ApiError 503 when the queue is full or the server
        is not serving."""
        with self._wake:
            self.ready_model()
            if len(self._waiting) >= self.max_queue:
                raise ApiError(503, f"the server is busy: {len(self._waiting)} requests wait "
                               f"behind the one computing (--max-queue {self.max_queue}); "
                               f"retry after {self.retry_after_s} s", code="queue_full",
                               headers={"Retry-After": str(self.retry_after_s)})
            self._waiting.append(job)
            self._wake.notify()

    def withdraw(self, job: Job) -> None:
        """Take `job` out of the queue if it still waits (its client left): it frees its place
        at once. A job the engine has taken is stopped by its `cancel` instead."""
        with self._wake, contextlib.suppress(ValueError):
            self._waiting.remove(job)

    def refuse_waiting(self) -> None:
        """Stop taking jobs: the waiting ones are refused (503); the one computing goes on."""
        with self._wake:
            self._stopping = True
            refused, self._waiting = list(self._waiting), collections.deque()
            self._wake.notify()
        for job in refused:
            job.post("error", ApiError(503, "the server is shutting down; retry elsewhere or "
                                       "later", code="stopping"))

    def stop(self, timeout_s: float | None = None) -> None:
        """Refuse the waiting jobs, let the one computing finish, close the engine, join."""
        self.refuse_waiting()
        self._thread.join(timeout_s)

    # --- the engine thread ---
    def _run(self) -> None:
        started = time.perf_counter()
        try:
            self.served = self._load()
        except BaseException as err:  # reported to the server, which stops
            self.state, self.error = FAILED, err
            log.error("the model failed to load: %s: %s", type(err).__name__, err)
            self.refuse_waiting()
            if self.on_failed is not None:
                self.on_failed(err)
            return
        self.load_s = time.perf_counter() - started
        try:
            if self.on_loaded is not None:
                self.on_loaded(self.served)
            self.state = READY
            while (job := self._next()) is not None:
                self._compute(job)
        finally:
            self.state = STOPPED
            self.served.engine.close()

    def _next(self) -> Job | None:
        """The next job still wanted, in arrival order; None once stopping."""
        with self._wake:
            while True:
                while not self._waiting and not self._stopping:
                    self._wake.wait()
                if self._stopping:
                    return None
                job = self._waiting.popleft()
                if not job.cancelled:
                    self.computing = job
                    return job

    def _compute(self, job: Job) -> None:
        served = self.served
        job.started = time.perf_counter()
        job.post("started")
        try:
            result = served.engine.generate(job.work.prompt, job.work.options,
                                            on_text=job.on_text, should_stop=job.should_stop)
        except Exception as err:  # the engine failed on this request; it serves the next
            job.post("error", _engine_error(err, len(job.work.prompt)))
            return
        finally:
            self.computing = None
        finished = job.finish(result)
        if self.on_finished is not None:
            try:
                self.on_finished(served, job, finished)
            except Exception:  # a figure not recorded must not stop the engine's thread
                log.exception("recording a request's figures failed")


def _engine_error(err: Exception, prompt_tokens: int) -> ApiError:
    """What the client is told when the engine raised: 400 for input the engine refused
    (nothing changed), 503 when the K/V could not grow for the request, else 500 (logged
    with its traceback)."""
    if isinstance(err, ValueError):
        return ApiError(400, f"the engine refused this request: {err}")
    if isinstance(err, KvFullError):
        return ApiError(503, f"the K/V could not hold this request: {err}", code="kv_full")
    log.exception("the engine failed on a request of %d prompt tokens", prompt_tokens)
    return ApiError(500, f"the engine failed on this request: {type(err).__name__}: {err}")
