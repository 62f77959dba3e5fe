"""Authentication of every /v1 request: an API key as `Authorization: Bearer <key>`
(OpenAI clients, and Anthropic clients given an auth token) or as `x-api-key: <key>`
(Anthropic clients). Both name the same tenant.

The check is ASGI middleware, not a route dependency, because FastAPI reads and
parses the body before it solves a route's dependencies: a caller without a valid
key would otherwise get the server to parse up to `max_body_bytes` of JSON, and
learn from a 400 that its JSON was wrong before hearing that its key was. The
middleware answers 401 from the headers alone and hands the tenant to the routes
in the ASGI scope's state.

The same middleware guards what is outside /v1. `/tokenize` and `/detokenize`
(`server/tokenize.py`) need a key as /v1 does. The API's description (`/docs`,
`/redoc`, `/openapi.json`) needs a key whenever the API does.
`/metrics` needs a metrics key (`--metrics-key`) or an admin key whenever the
server has any key: its counters, read before and after another tenant's
request, give that request's prompt length, cached tokens and generated tokens,
which per-key statistics otherwise hide. `/health` stays open for orchestrators:
it says only whether the server serves, its model and how many requests run.
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


DOCS_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
# Outside /v1 because vLLM serves them there; they render prompts like /v1 does.
TOKENIZER_PATHS = frozenset({"/tokenize", "/detokenize"})
METRICS_PATH = "/metrics"


def is_api_path(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/") or path in DOCS_PATHS or path in TOKENIZER_PATHS


def presented_key(headers: list[tuple[bytes, bytes]]) -> str:
    """The key a request's headers carry; raises APIError(401) when none."""
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
    return key


def tenant_of(keys: KeyRing, headers: list[tuple[bytes, bytes]]) -> Tenant:
    """The tenant a request's headers name; raises APIError(401) when none."""
    if not keys.enabled:
        return ANONYMOUS
    tenant = keys.lookup(presented_key(headers))
    if tenant is None:
        raise _invalid_key()
    return tenant


def check_metrics_access(
    keys: KeyRing, metrics_keys: KeyRing, headers: list[tuple[bytes, bytes]]
) -> None:
    """Raises APIError(401/403) unless the headers may read /metrics: open on a server
    with no key of either kind, else a metrics key or an admin key."""
    if not keys.enabled and not metrics_keys.enabled:
        return
    key = presented_key(headers)
    if metrics_keys.lookup(key) is not None:
        return
    tenant = keys.lookup(key) if keys.enabled else None
    if tenant is None:
        raise _invalid_key()
    if not tenant.is_admin:
        raise APIError(
            403,
            "/metrics shows every tenant's traffic: it needs a metrics key (--metrics-key) "
            "or an admin key",
            code="metrics_key_required",
        )


def _invalid_key() -> APIError:
    return APIError(
        401, "invalid API key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
    )


class AuthMiddleware:
    """401 for a /v1 or API-description request without a valid key, before one byte of
    its body is read; 401/403 on /metrics without a metrics or admin key (when the
    server has keys). /health and unknown paths (404) pass."""

    def __init__(
        self,
        app: ASGIApp,
        keys: KeyRing,
        error_body: ErrorBody = openai_body,
        metrics_keys: KeyRing | None = None,
    ) -> None:
        self.app = app
        self.keys = keys
        self.metrics_keys = metrics_keys or KeyRing(())
        self.error_body = error_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        try:
            if is_api_path(path):
                scope.setdefault("state", {})["tenant"] = tenant_of(self.keys, scope["headers"])
            elif path == METRICS_PATH:
                check_metrics_access(self.keys, self.metrics_keys, scope["headers"])
        except APIError as exc:
            await send_error(send, self.error_body(path, exc), exc)
            return
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
