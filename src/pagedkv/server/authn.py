"""Authentication of every /v1 request: an API key as `Authorization: Bearer <key>`
(OpenAI clients, and Anthropic clients given an auth token) or as `x-api-key: <key>`
(Anthropic clients). Both name the same tenant.

The check is ASGI middleware, not a route dependency, because FastAPI reads and
parses the body before it solves a route's dependencies: a caller without a valid
key would otherwise get the server to parse up to `max_body_bytes` of JSON, and
learn from a 400 that its JSON was wrong before hearing that its key was. The
middleware answers 401 from the headers alone and hands the tenant to the routes
in the ASGI scope's state.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedkv.server.auth import ANONYMOUS, KeyRing, Tenant
from pagedkv.server.http_errors import APIError
from pagedkv.server.middleware import ErrorBody, openai_body, send_error

# For the OpenAPI schema only; the key is checked by `AuthMiddleware`.
_bearer = HTTPBearer(auto_error=False, description="an API key, when the server has keys")


def is_api_path(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


def tenant_of(keys: KeyRing, headers: list[tuple[bytes, bytes]]) -> Tenant:
    """The tenant a request's headers name; raises APIError(401) when none."""
    if not keys.enabled:
        return ANONYMOUS
    key = None
    for name, value in headers:
        if name == b"authorization":
            scheme, _, credentials = value.decode("latin-1").strip().partition(" ")
            if scheme.lower() == "bearer" and credentials.strip():
                key = credentials.strip()
        elif name == b"x-api-key" and key is None:
            key = value.decode("latin-1").strip() or None
    if not key:
        raise APIError(
            401,
            "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    tenant = keys.lookup(key)
    if tenant is None:
        raise APIError(
            401, "invalid API key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
        )
    return tenant


class AuthMiddleware:
    """401 for a /v1 request without a valid key, before one byte of its body is read.
    /health and /metrics stay open (they show only aggregate counts)."""

    def __init__(self, app: ASGIApp, keys: KeyRing, error_body: ErrorBody = openai_body) -> None:
        self.app = app
        self.keys = keys
        self.error_body = error_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_api_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        try:
            tenant = tenant_of(self.keys, scope["headers"])
        except APIError as exc:
            await send_error(send, self.error_body(scope["path"], exc), exc)
            return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)


async def authenticate(
    request: Request,
    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Tenant:
    tenant = request.scope.get("state", {}).get("tenant")
    if isinstance(tenant, Tenant):
        return tenant
    # An app mounted without the middleware still checks keys, after the body.
    return tenant_of(request.app.state.pagedkv.keys, request.scope["headers"])


TenantDep = Annotated[Tenant, Depends(authenticate)]
