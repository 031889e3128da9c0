"""`create_app`: the FastAPI app of `strata serve`, its routes, the API key, the engine thread.

Routes (each says what it returns):

    POST /v1/chat/completions   a chat completion, whole or streamed (server-sent events)
    POST /v1/completions        a text completion, whole or streamed
    GET  /v1/models             the one model served
    GET  /v1/status             the engine now: cache, K/V, parked conversations, last request
    GET  /metrics               Prometheus text: requests, tokens, latency, the engine's events
    GET  /health                200 once the model is loaded, 503 while it loads

With an API key, every route but /health requires `Authorization: Bearer KEY` (401 without).
The model loads on the engine thread after the server starts listening.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from strata.policies import plugin_manager
from strata.serve.access_log import AccessLog
from strata.serve.errors import ApiError, install_error_handlers
from strata.serve.jobs import Finished, Job
from strata.serve.metrics import CONTENT_TYPE_LATEST, Metrics
from strata.serve.options import ServedModel, ServeOptions
from strata.serve.prompts import chat_work, completion_work
from strata.serve.replies import reply
from strata.serve.schemas import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from strata.serve.shapes import ChatShape, CompletionShape, dump
from strata.serve.status import Status, engine_figures
from strata.serve.worker import READY, EngineWorker

__all__ = ["create_app"]

log = logging.getLogger("strata.serve")


class _Telemetry:
    """What the engine thread records after loading and after each request: the status
    snapshot and the metrics (both read by routes on the event loop)."""

    def __init__(self, options: ServeOptions, metrics: Metrics, status: Status,
                 load_s: Callable[[], float]) -> None:
        self.options, self.metrics, self.status = options, metrics, status
        self.load_s = load_s  # the seconds the model took to load

    def engine_now(self, served: ServedModel) -> None:
        figures = engine_figures(served.engine)
        self.status.record_engine(figures)
        self.metrics.record_engine(figures)

    def loaded(self, served: ServedModel) -> None:
        engine = served.engine
        if engine.events is None:
            # Without an expert cache the engine has no plugin manager; give it one, so that
            # its conversations' and requests' events are counted too.
            engine.events = plugin_manager(entry_points=False)
        engine.events.register(self.metrics.events)
        self.engine_now(served)
        log.info("%s is ready: %s, window %d tokens, loaded in %.1f s",
                 self.options.model_name, engine.model.device, engine.max_context,
                 self.load_s())

    def finished(self, served: ServedModel, job: Job, finished: Finished) -> None:
        self.status.record_request(job, finished)
        self.metrics.record_request(finished.result, finished.first_text_s)
        self.engine_now(served)


def create_app(load: Callable[[], ServedModel], options: ServeOptions, *,
               on_load_failed: Callable[[BaseException], None] | None = None) -> FastAPI:
    """The app serving the model `load` returns (called on the engine thread once the app
    starts). `app.state` holds its `worker`, `metrics` and `status`. `on_load_failed` is told
    when loading raised (the server should stop)."""
    status = Status()
    # Read at each scrape, by which time `worker` below exists.
    metrics = Metrics(waiting=lambda: worker.waiting)
    telemetry = _Telemetry(options, metrics, status, lambda: worker.load_s)
    worker = EngineWorker(load, max_queue=options.max_queue,
                          retry_after_s=options.retry_after_s, on_loaded=telemetry.loaded,
                          on_finished=telemetry.finished, on_failed=on_load_failed)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        yield
        # After the server stopped taking connections and the open ones ended.
        await asyncio.to_thread(worker.stop)

    app = FastAPI(title="strata serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.worker, app.state.metrics, app.state.status = worker, metrics, status
    app.state.options = options
    install_error_handlers(app)
    app.add_middleware(AccessLog, metrics=metrics)
    _add_routes(app, worker, options, _key_check(options.api_key))
    return app


def _key_check(key: str | None) -> Callable[[Request], None]:
    """The dependency that requires `Authorization: Bearer KEY` (nothing without a key)."""

    def check(request: Request) -> None:
        if key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if not given:
            raise ApiError(401, "this server requires an API key: send it as "
                           "'Authorization: Bearer KEY' (the openai client's api_key)",
                           code="missing_api_key")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
                token.strip().encode(), key.encode()):
            raise ApiError(401, "the API key given is not this server's; send the key it was "
                           "started with (--api-key or STRATA_API_KEY)", code="invalid_api_key")

    return check


def _add_routes(app: FastAPI, worker: EngineWorker, options: ServeOptions,
                key: Callable[[Request], None]) -> None:
    guarded = [Depends(key)]

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 `{"status": "ok"}` once the model is loaded; 503 with the state (`loading`,
        `failed`, `stopped`) otherwise. Needs no key."""
        code = 200 if worker.state == READY else 503
        state = "ok" if code == 200 else worker.state
        return JSONResponse({"status": state, "model": options.model_name}, status_code=code)

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> dict[str, Any]:
        """The one model served, with its window (`max_model_len`, in tokens)."""
        served = worker.ready_model()
        card = ModelCard(id=options.model_name, created=int(app.state.status.started),
                         max_model_len=served.engine.max_context)
        return dump(ModelList(data=[card]))

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        """A `chat.completion` (or its `chat.completion.chunk` events, with `stream`)."""
        served = worker.ready_model()
        work = await asyncio.to_thread(chat_work, body, served, options)
        return await reply(request, worker, work, ChatShape(options.model_name, work))

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """A `text_completion` (or its chunks, with `stream`)."""
        served = worker.ready_model()
        work = await asyncio.to_thread(completion_work, body, served, options)
        return await reply(request, worker, work, CompletionShape(options.model_name, work))

    @app.get("/v1/status", dependencies=guarded)
    async def status() -> dict[str, Any]:
        """The engine now (see `strata.serve.status`): the queue, the expert cache's slots and
        hit rate, the K/V's cells, the parked conversations, the events, the last request."""
        return app.state.status.document(
            model=options.model_name, state=worker.state, waiting=worker.waiting,
            max_queue=options.max_queue, computing=worker.computing is not None,
            events=app.state.metrics.events.snapshot())

    @app.get("/metrics", dependencies=guarded)
    async def metrics() -> Response:
        """The metrics in Prometheus' text format (see `strata.serve.metrics`)."""
        return Response(app.state.metrics.text(), media_type=CONTENT_TYPE_LATEST)
