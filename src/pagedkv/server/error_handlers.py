"""The app's exception handlers: every error is JSON in the shape of the API its path
belongs to (OpenAI's, or Anthropic's under /v1/messages), and pydantic's validation
errors become 400s that name the field as a JSON path. Unhandled exceptions are not
handled here but in `server/middleware.py` (`RequestIdMiddleware`)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedkv.server.anthropic.errors import error_body as anthropic_error_body
from pagedkv.server.anthropic.errors import error_response, is_messages_path
from pagedkv.server.http_errors import APIError, bad_request
from pagedkv.server.request_log import note_error

log = logging.getLogger(__name__)


def error_body(path: str, exc: APIError) -> dict[str, Any]:
    """The JSON of `exc` for a request to `path` (what the middlewares send)."""
    return anthropic_error_body(exc) if is_messages_path(path) else exc.body()


def add_error_handlers(app: FastAPI) -> None:
    def render(request: Request, exc: APIError) -> Response:
        note_error(exc.message)  # the request's log line says why it was refused
        if is_messages_path(request.url.path):
            return error_response(exc)
        return exc.response()

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return render(request, exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return render(request, _validation_error(request, exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"no route for {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        return render(request, APIError(exc.status_code, message, headers=exc.headers))

    @app.exception_handler(RecursionError)
    async def too_deep(request: Request, exc: RecursionError) -> Response:
        # The request limits cap nesting before any route recurses (server/nesting.py);
        # this catches what slips past them, as a 400 with no traceback in the log.
        log.warning(
            "%s %s: RecursionError (input nested too deeply)", request.method, request.url.path
        )
        return render(
            request,
            bad_request(
                "the request nests too deeply to be served; flatten it", code="nesting_too_deep"
            ),
        )

    # An exception no handler here takes (a bug) is answered and logged, once, by
    # `middleware.RequestIdMiddleware`, which knows the request id.


def _validation_error(request: Request, exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [p for p in first.get("loc", ()) if p != "body"]
    kind = first.get("type", "")
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        pos = loc[0] if loc else "?"
        return bad_request(f"the body is not valid JSON: {detail} (at character {pos})")
    if not loc and kind in ("model_attributes_type", "dict_type", "missing"):
        ctype = request.headers.get("content-type", "")
        if "json" not in ctype and ctype:
            return bad_request(
                f"the body must be a JSON object sent as application/json, not {ctype} "
                "(with curl: -H 'Content-Type: application/json')"
            )
        return bad_request("the body must be a JSON object")
    param = _param_name(loc)
    message = str(first.get("msg", "invalid request"))
    params = [_param_name([p for p in e.get("loc", ()) if p != "body"]) for e in errors]
    if len(errors) > 1 and all(p == param for p in params):  # a union: say what each form lacks
        message = "matches none of the accepted forms: " + "; ".join(
            dict.fromkeys(str(e.get("msg")) for e in errors)
        )
    elif len(errors) > 1:
        message += f" (and {len(errors) - 1} more problems)"
    return bad_request(f"{param}: {message}" if param else message, param or None)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _param_name(loc: list[Any]) -> str:
    """pydantic's loc as a JSON path: ["messages", 0, "content"] -> messages[0].content."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif str(part) in _TYPE_TAGS or "[" in str(part) or "-" in str(part):
            continue  # union member tags such as "str", "list[int]", "function-after[...]"
        else:
            out += f".{part}" if out else str(part)
    return out
