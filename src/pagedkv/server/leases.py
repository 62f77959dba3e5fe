"""Leases through the APIs: OpenAI's `prompt_cache_retention`, the admin's list and drop.

`prompt_cache_retention` leases the whole prompt: "in_memory" for `IN_MEMORY_TTL_S`
in RAM only, "24h" for a day in every tier (`pagedkv.cache.leases`);
`prompt_cache_key` names the lease's group in the admin's list. Anthropic's
`cache_control` breakpoints are read by `anthropic/breakpoints.py`.

`GET /v1/cache/leases` lists the live leases: every tenant's for an admin key,
the caller's own otherwise. `DELETE /v1/cache/leases/{lease_id}` lapses one; an
admin key only, like `POST /v1/cache/clear`.
"""

from __future__ import annotations

from collections.abc import Callable

from anyio import to_thread
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from pagedkv.cache.leases import TTL_SECONDS, LeaseRequest
from pagedkv.server.auth import Tenant
from pagedkv.server.authn import TenantDep
from pagedkv.server.engine_api import EngineAPI
from pagedkv.server.http_errors import APIError
from pagedkv.server.protocol import ERRORS, ChatCompletionRequest, CompletionRequest

IN_MEMORY_TTL_S = TTL_SECONDS["5m"]
RETENTION = {"in_memory": (IN_MEMORY_TTL_S, True), "24h": (TTL_SECONDS["24h"], False)}


def openai_leases(
    body: CompletionRequest | ChatCompletionRequest, num_prompt: int, tenant: Tenant
) -> list[LeaseRequest]:
    """The lease `prompt_cache_retention` asks for, over the whole prompt (none without it)."""
    retention = body.prompt_cache_retention
    if retention is None:
        return []
    ttl_s, ram_only = RETENTION[retention]
    return [LeaseRequest(num_prompt, ttl_s, ram_only, tenant.label, body.prompt_cache_key)]


def add_lease_routes(
    app: FastAPI, engine: EngineAPI, check_open: Callable[[str | None], None]
) -> None:
    @app.get("/v1/cache/leases", responses=ERRORS)
    async def list_leases(tenant: TenantDep) -> Response:
        """The live leases: all of them for an admin key, the key's own for any other."""
        leases = await to_thread.run_sync(
            lambda: engine.list_leases(tenant.salt, all_owners=tenant.is_admin)
        )
        scope = "server" if tenant.is_admin else "key"
        return JSONResponse({"object": "list", "scope": scope, "data": leases})

    @app.delete("/v1/cache/leases/{lease_id}", responses=ERRORS)
    async def drop_lease(lease_id: str, tenant: TenantDep) -> Response:
        if not tenant.is_admin:
            raise APIError(403, "dropping a lease needs an admin key", code="admin_key_required")
        check_open(None)
        if not await to_thread.run_sync(engine.drop_lease, lease_id):
            raise APIError(
                404,
                f"no live lease has id {lease_id!r} (it may have lapsed); "
                "GET /v1/cache/leases lists them",
                param="lease_id",
                code="lease_not_found",
            )
        return JSONResponse({"id": lease_id, "dropped": True})
