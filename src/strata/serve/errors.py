"""Errors as the OpenAI API shapes them: `{"error": {"message", "type", "param", "code"}}`.

Every failure a client can cause or meet answers in this shape, whatever raised it: an
`ApiError` raised by the server's own checks, FastAPI's validation of a body (malformed JSON,
a field of the wrong type: 400, as OpenAI answers, not FastAPI's 422), a route or method that
does not exist, and any other exception (500, logged with its traceback). The message names
what was wrong and what would be right; `param` names the request field at fault.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

__all__ = ["ApiError", "error_body", "install_error_handlers"]

log = logging.getLogger("strata.serve")

# The `type` OpenAI gives each kind of failure.
INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


def error_body(message: str, type_: str = INVALID_REQUEST, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The body of an error response (and of an error event inside a stream)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class ApiError(Exception):
    """A request the server answers with `status` and an OpenAI-style error body; `headers`
    go with it (`Retry-After` on a 503)."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type_: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or (SERVER_ERROR if status >= 500 else INVALID_REQUEST)
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# Parts of pydantic's error locations that name a type (a branch of a union, as in
# `content.str`), not a field: left out of the `param` a client is told.
_TYPE_PART = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|[A-Z]\w*)$")


def _location(loc: tuple[Any, ...]) -> str:
    """`messages.0.content` for pydantic's ("body", "messages", 0, "content", "str")."""
    return ".".join(str(part) for part in loc[1:]
                    if part is not None and not _TYPE_PART.match(str(part)))


def _union(problems: list[dict[str, Any]]) -> tuple[str, list[str]] | None:
    """(the field, the types it may be) when the first problem is a union's (each branch
    failed: its type is in the location, as in ("body", "prompt", "list[int]", 0)); None
    otherwise."""
    loc = tuple(problems[0].get("loc", ()))
    at = next((i for i, part in enumerate(loc) if _TYPE_PART.match(str(part))), None)
    if at is None:
        return None
    branches = [str(p["loc"][at]) for p in problems
                if len(p.get("loc", ())) > at and tuple(p["loc"][:at]) == loc[:at]
                and _TYPE_PART.match(str(p["loc"][at]))]
    branches = list(dict.fromkeys(branches))
    return (_location(loc[:at]), branches) if len(branches) > 1 else None


def validation_error(err: RequestValidationError) -> ApiError:
    """The first problem of a body FastAPI could not read, as a 400 naming the field (for a
    union, the types it may be)."""
    problems = err.errors() or [{"msg": "the body could not be read", "loc": ()}]
    first = problems[0]
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "")
        where = first["loc"][-1] if len(first.get("loc", ())) > 1 else "?"
        return ApiError(400, f"the body is not valid JSON: {reason} at character {where}; "
                        "send one JSON object (Content-Type: application/json)")
    param = _location(tuple(first.get("loc", ())))
    if not param:  # the body itself: missing, or not an object
        return ApiError(400, "the body must be a JSON object of the request's fields (sent "
                        f"with Content-Type: application/json): {first.get('msg', '')}")
    given = first.get("input")
    union = _union(problems)
    if union is not None:
        field, branches = union
        return ApiError(400, f"{field}: must be {', '.join(branches[:-1])} or {branches[-1]} "
                        f"(got {given!r:.80})", param=field, code="invalid_value")
    shown = f" (got {given!r:.80})" if first.get("type") != "missing" else ""
    others = sum(_location(tuple(p.get("loc", ()))) != param for p in problems)
    more = f"; {others} more problem(s) after it" if others else ""
    return ApiError(400, f"{param}: {first.get('msg', 'invalid')}{shown}{more}", param=param,
                    code="missing" if first.get("type") == "missing" else "invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    """Answer every failure with an OpenAI-style error body (see the module's docstring)."""

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, err: ApiError) -> JSONResponse:
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def bad_body(_request: Request, err: RequestValidationError) -> JSONResponse:
        return validation_error(err).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        if err.status_code == 404:
            message = f"no route {request.url.path}; the routes are /v1/chat/completions, " \
                      "/v1/completions, /v1/models, /v1/status, /health and /metrics"
        elif err.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(err.detail)
        code = {404: "unknown_route", 405: "method_not_allowed"}.get(err.status_code)
        return ApiError(err.status_code, message, code=code,
                        headers=dict(err.headers or {})).response()

    @app.exception_handler(Exception)
    async def bug(request: Request, err: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return ApiError(500, f"the server failed on this request: {type(err).__name__}: "
                        f"{err}").response()
