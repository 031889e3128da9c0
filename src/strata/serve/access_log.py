"""`AccessLog`: one log line per HTTP request, and its count in the metrics.

An ASGI middleware around the whole app, so that it sees every request, those refused before
any route (bad JSON, 401, 404) included, and sees a streamed response to its end: the app
returns only once the last byte is sent, or the client went away. A route that ran a
generation leaves its figures in the request's scope (`FIGURES`), and the line gives them:

    POST /v1/chat/completions 200 0.84 s: prompt 312 (reused 280), new 64, queued 0.00 s,
    ttft 0.05 s, 81.2 tok/s, stop
"""

from __future__ import annotations

import logging
import time
from typing import Any

from strata.serve.metrics import Metrics

__all__ = ["FIGURES", "AccessLog", "figures_text"]

log = logging.getLogger("strata.serve")

FIGURES = "strata.figures"  # the scope key a generating route leaves its figures under


def figures_text(figures: dict[str, Any]) -> str:
    """A request's figures (`status.request_figures`) as the log line's tail."""
    ending = "client left" if figures.get("stopped") else figures["finish_reason"]
    return (f"prompt {figures['prompt_tokens']} (reused {figures['reused_tokens']}), new "
            f"{figures['completion_tokens']}, queued {figures['queued_s']:.2f} s, ttft "
            f"{figures['ttft_s']:.2f} s, {figures['decode_tok_s']:.1f} tok/s, {ending}")


class AccessLog:
    """The middleware (see the module's docstring)."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 0  # none sent: the client left before the response began

        async def sending(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self._record(scope, status, time.perf_counter() - started)

    def _record(self, scope: dict[str, Any], status: int, seconds: float) -> None:
        route = getattr(scope.get("route"), "path", None) or "unknown"
        self.metrics.http.labels(route=route, status=str(status)).inc()
        path = repr(scope["path"])[1:-1]  # escaped: a path is the client's text
        line = f"{scope['method']} {path} {status or 'no response'} {seconds:.2f} s"
        figures = scope.get(FIGURES)
        if figures is not None:
            line += ": " + figures_text(figures)
            if figures.get("user"):
                line += f", user {figures['user']!r}"
        log.info("%s", line)
