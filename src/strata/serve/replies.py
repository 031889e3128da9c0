"""`reply`: run a checked request through the engine thread and answer it, whole or streamed.

The request joins the queue (503 at once when it is full); its answer begins only when the
engine takes it, so that a request refused while it waited (the server stopping) still gets a
status and an error body. A streamed answer is server-sent events, one `data: {json}` chunk per
piece of text, then the chunk that says how it ended, the usage chunk when
`stream_options.include_usage` asks for it, and `data: [DONE]`. An error after the stream began
is sent as an event with the error body, then `[DONE]`.

A client that disconnects, while it waits or mid-answer, cancels its job: a waiting job is
skipped, a computing one stops before its next decode round, and the engine keeps its cells as
the live conversation (parked when the next request does not continue it).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from strata.serve.access_log import FIGURES
from strata.serve.errors import ApiError
from strata.serve.jobs import Finished, Job, watch_disconnect
from strata.serve.prompts import Work
from strata.serve.shapes import Shape, dump
from strata.serve.status import request_figures
from strata.serve.worker import EngineWorker

__all__ = ["reply"]

DONE = "data: [DONE]\n\n"


def _event(document: dict[str, Any]) -> str:
    return f"data: {json.dumps(document, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _figures(request: Request, job: Job, finished: Finished) -> None:
    """Leave the request's figures where the access log finds them."""
    request.scope[FIGURES] = {**request_figures(job, finished), "user": job.work.user}


async def reply(request: Request, worker: EngineWorker, work: Work, shape: Shape) -> Response:
    """The answer to `work` (see the module's docstring); raises ApiError when it cannot
    run (a full queue, the server stopping, the engine failing before the stream began)."""
    job = Job(work, asyncio.get_running_loop())
    worker.submit(job)
    watcher = asyncio.create_task(watch_disconnect(request.receive, job))
    try:
        await job.wait_started()
        if work.stream:
            return StreamingResponse(_stream(request, job, shape, watcher),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        pieces: list[str] = []
        while True:
            kind, value = await job.next()
            if kind == "text":
                pieces.append(value)
            elif kind == "error":
                raise value
            else:
                break
    except BaseException:
        job.cancel()  # a computing job stops before its next round
        worker.withdraw(job)  # a waiting one leaves the queue
        watcher.cancel()
        raise
    watcher.cancel()
    _figures(request, job, value)
    return JSONResponse(dump(shape.whole("".join(pieces), value)))


async def _stream(request: Request, job: Job, shape: Shape,
                  watcher: asyncio.Task[None]) -> AsyncIterator[str]:
    """The server-sent events of a streamed answer."""
    try:
        first = shape.first()
        if first is not None:
            yield _event(dump(first))
        while True:
            kind, value = await job.next()
            if kind == "text":
                yield _event(dump(shape.piece(value)))
            elif kind == "error":
                error: ApiError = value
                yield _event(error.body())
                break
            else:
                yield _event(dump(shape.last(value)))
                if job.work.include_usage:
                    yield _event(dump(shape.usage(value)))
                _figures(request, job, value)
                break
        yield DONE
    finally:
        # Cut short (the client left, the server stopped) or done: either way the job ends.
        job.cancel()
        watcher.cancel()
