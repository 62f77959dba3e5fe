"""`GET /dashboard` (the page and its assets) and `GET /v1/dashboard/state` (its data).

Who may look: with API keys, an admin key only: the page is a login form that keeps
the key in the tab's `sessionStorage` and sends it as `Authorization: Bearer` with
every data request, so the page itself holds nothing secret and is served to anyone.
Without keys (single-user mode) the page and its data answer loopback clients only:
the dashboard shows every request's counts, and a server without keys reachable from
elsewhere should not show them to everyone who can reach it. Behind a reverse proxy
every client looks local: configure an admin key there.

The page loads only its own files (a Content-Security-Policy of 'self' for every
kind of resource), so it works offline and cannot call anything but this server.
"""

from __future__ import annotations

import ipaddress
from importlib import resources
from typing import Any

from anyio import to_thread
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagedkv.server.authn import TenantDep
from pagedkv.server.http_errors import APIError

PAGE_PATH = "/dashboard"
SESSION_PATH = "/dashboard/session.json"
STATE_PATH = "/v1/dashboard/state"
REQUEST_PATH = "/v1/dashboard/requests/{request_id}"
ASSETS = {
    "dashboard.css": "text/css; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "plot.js": "text/javascript; charset=utf-8",
    "chat.js": "text/javascript; charset=utf-8",
}
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'"
)
_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
    "Referrer-Policy": "no-referrer",
}


def _asset(name: str) -> bytes:
    return (resources.files("pagedkv.server.dashboard") / "static" / name).read_bytes()


def is_loopback(request: Request) -> bool:
    host = request.client.host if request.client is not None else ""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _local_only() -> APIError:
    return APIError(
        403,
        "the dashboard of a server without API keys answers only on this host (loopback); "
        "start the server with an admin key (--admin-key) to open it from elsewhere",
        code="dashboard_local_only",
    )


def state_response(state: Any) -> Response:
    """The dashboard's data (`STATE_PATH`): the server's whole share of a refresh but
    the HTTP framework's, which every request pays. `state`: the app's `pagedkv`."""
    stats = state.engine.cache_stats()
    active = state.engine.num_active_requests()
    body = state.dashboard.state(state.model_name, stats, active, state.keys.enabled)
    return JSONResponse(body, headers={"Cache-Control": "no-store"})


def add_dashboard_routes(app: FastAPI) -> None:
    state = app.state.pagedkv

    def check_page(request: Request) -> None:
        if not state.keys.enabled and not is_loopback(request):
            raise _local_only()

    def check_data(request: Request, tenant: Any) -> None:
        check_page(request)
        if not tenant.is_admin:
            raise APIError(
                403, "the dashboard shows every tenant's traffic: it needs an admin key",
                code="admin_key_required",
            )  # fmt: skip

    @app.get(PAGE_PATH, include_in_schema=False)
    def page(request: Request) -> Response:
        check_page(request)
        return Response(_asset("index.html"), media_type="text/html; charset=utf-8",
                        headers=_HEADERS)  # fmt: skip

    @app.get(SESSION_PATH, include_in_schema=False)
    def session(request: Request) -> Response:
        """Whether the page must ask for a key first (so it never starts with a 401)."""
        check_page(request)
        return JSONResponse({"keys": state.keys.enabled}, headers=_HEADERS)

    @app.get(PAGE_PATH + "/{name}", include_in_schema=False)
    def asset(name: str, request: Request) -> Response:
        check_page(request)
        if name not in ASSETS:
            raise APIError(404, f"the dashboard has no file {name!r}", code="not_found")
        return Response(_asset(name), media_type=ASSETS[name], headers=_HEADERS)

    @app.get(STATE_PATH, include_in_schema=False)
    async def dashboard_state(request: Request, tenant: TenantDep) -> Response:
        check_data(request, tenant)
        return await to_thread.run_sync(state_response, state)

    @app.get(REQUEST_PATH, include_in_schema=False)
    async def dashboard_request(request_id: str, request: Request, tenant: TenantDep) -> Response:
        """One recent request's counts (the chat tab's per-tier split), by `x-request-id`."""
        check_data(request, tenant)
        found = state.dashboard.feed.request(request_id)
        if found is None:
            raise APIError(
                404,
                f"no recent request {request_id!r}: the dashboard keeps the last "
                "requests' counts only, and only those that finished",
                code="not_found",
            )
        return JSONResponse(found, headers={"Cache-Control": "no-store"})
