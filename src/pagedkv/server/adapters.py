"""LoRA adapters over HTTP: which adapter a request's `model` names, and the admin
routes that load and unload them.

A request selects an adapter by `model: NAME` (as vLLM does) or `model:
"BASE:NAME"`, where BASE is a name the base model answers to; any other unknown
name is a 404 listing what is served. `POST /v1/adapters` (`{"name", "path"}`,
a PEFT LoRA directory on the server's filesystem) loads or reloads one and
`DELETE /v1/adapters/{name}` unloads it; both need an admin key, since they
read the server's files and change what every tenant is served. A bad adapter
is a 400 naming what is wrong (`model.lora`); the server keeps serving.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from anyio import to_thread
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from pagedkv.errors import AdapterError, UnknownAdapterError
from pagedkv.server.authn import TenantDep
from pagedkv.server.engine_api import EngineAPI
from pagedkv.server.http_errors import APIError
from pagedkv.server.protocol import ERRORS


class AdapterLoadRequest(BaseModel):
    """Body of `POST /v1/adapters`."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=128)
    path: str = Field(min_length=1, max_length=4096)


class ModelNames:
    """The names the base model answers to, and the engine's adapters."""

    def __init__(self, engine: EngineAPI, base_names: list[str]) -> None:
        self.engine = engine
        self.base_names = dict.fromkeys(base_names)  # ordered, for the 404's list

    def adapter_of(self, model: str | None, param: str = "model") -> str | None:
        """The adapter `model` selects (None: the base model); a 404 when it names
        neither the base model nor a loaded adapter."""
        if model is None or model in self.base_names:
            return None
        adapters = self.engine.adapter_names()
        if model in adapters:
            return model
        base, sep, name = model.rpartition(":")
        if sep and base in self.base_names and name in adapters:
            return name
        raise self.unknown(model, param, adapters)

    def unknown(self, model: str, param: str, adapters: list[str] | None = None) -> APIError:
        adapters = self.engine.adapter_names() if adapters is None else adapters
        served = ", ".join(map(repr, [*self.base_names, *adapters]))
        return APIError(
            404,
            f"model {model!r} does not exist; this server serves {served} (see GET /v1/models;"
            " an adapter is named NAME or BASE:NAME)",
            param=param,
            code="model_not_found",
        )


def add_adapter_routes(
    app: FastAPI,
    engine: EngineAPI,
    names: ModelNames,
    check_admin: Callable[[Any, str], None],
) -> None:
    """`GET`, `POST /v1/adapters` and `DELETE /v1/adapters/{name}` (admin keys only)."""

    @app.get("/v1/adapters", responses=ERRORS)
    async def list_adapters(tenant: TenantDep) -> Response:
        check_admin(tenant, "listing adapters")
        return JSONResponse({"object": "list", "data": engine.describe_adapters()})

    @app.post("/v1/adapters", responses=ERRORS)
    async def load_adapter(body: AdapterLoadRequest, tenant: TenantDep) -> Response:
        check_admin(tenant, "loading an adapter")
        if body.name in names.base_names:
            raise APIError(
                400,
                f"adapter name {body.name!r} is a name of the base model; pick another",
                param="name",
                code="invalid_adapter",
            )
        load = functools.partial(engine.load_adapter, body.name, body.path)
        try:
            info = await to_thread.run_sync(load)
        except AdapterError as exc:
            raise APIError(400, str(exc), param="path", code="invalid_adapter") from exc
        return JSONResponse(info)

    @app.delete("/v1/adapters/{name:path}", responses=ERRORS)
    async def unload_adapter(name: str, tenant: TenantDep) -> Response:
        check_admin(tenant, "unloading an adapter")
        try:
            await to_thread.run_sync(engine.unload_adapter, name)
        except UnknownAdapterError as exc:
            raise APIError(404, str(exc), param="name", code="adapter_not_found") from exc
        return JSONResponse({"name": name, "unloaded": True})
