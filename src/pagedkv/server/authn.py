"""The authentication dependency of every /v1 route: an API key as `Authorization:
Bearer <key>` (OpenAI clients, and Anthropic clients given an auth token) or as
`x-api-key: <key>` (Anthropic clients). Both name the same tenant."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from pagedkv.server.auth import ANONYMOUS, KeyRing, Tenant
from pagedkv.server.http_errors import APIError

_bearer = HTTPBearer(auto_error=False, description="an API key, when the server has keys")


async def authenticate(
    request: Request,
    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Tenant:
    keys: KeyRing = request.app.state.pagedkv.keys
    if not keys.enabled:
        return ANONYMOUS
    key = creds.credentials if creds is not None else request.headers.get("x-api-key")
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


TenantDep = Annotated[Tenant, Depends(authenticate)]
