"""The OpenAI-compatible HTTP app: routes, authentication and error mapping.

Status codes: malformed JSON, wrong types and unsupported values are 400 with
the field in `param` (never 422); a missing or wrong key 401; a non-admin key
on an admin endpoint 403; an unknown model or path 404; a body over
`max_body_bytes` 413; a full engine queue 429 and a shutting-down server 503,
both with Retry-After. Bad input is refused before it reaches the engine; the
catch-all 500 handler exists for bugs only.

Keys: when none are configured the server is single-user: every caller is the
one (admin) tenant. When keys are configured, every /v1 endpoint needs one,
checked from the headers before the body is read (`server/authn.py`); only the
keys named as admin keys may clear the cache or see the global statistics.
/health stays open for orchestrators; /metrics, which shows every tenant's
traffic, needs a metrics key or an admin key, and /docs and /openapi.json any key.
Errors whose text pagedkv did not write reach the client as a generic message
with the request id (`x-request-id`); the detail goes to the log. Limits on a
request's messages and text and on each key's running requests are in
`server/limits.py`.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from anyio import to_thread
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedkv.cache.leases import LeaseRequest
from pagedkv.engine.request import StreamEvent
from pagedkv.errors import ImagePromptError, PromptTooLongError
from pagedkv.model.vision import ImagePrompt
from pagedkv.server.adapters import ModelNames, add_adapter_routes
from pagedkv.server.anthropic import MessagesContext, add_messages_routes
from pagedkv.server.auth import KeyRing, Tenant
from pagedkv.server.authn import AuthMiddleware, TenantDep
from pagedkv.server.chat_images import chat_renderer, takes_images, template_ids
from pagedkv.server.dashboard import Dashboard, add_dashboard_routes
from pagedkv.server.drift import RenderMemory
from pagedkv.server.engine_api import EngineAPI
from pagedkv.server.error_handlers import add_error_handlers, error_body
from pagedkv.server.explain import ChatExplainRequest, Explainer, refuse_unknown_chat_fields
from pagedkv.server.generation import Generation, Options, history_message
from pagedkv.server.http_errors import (
    REQUEST_ID,
    APIError,
    bad_request,
    hidden_error,
    shutting_down,
)
from pagedkv.server.images import ImageLimits, ImageMemory, attach_images
from pagedkv.server.leases import add_lease_routes, openai_leases
from pagedkv.server.limits import KeyShare, RequestLimits, RequestLimitsMiddleware, ShareHeld
from pagedkv.server.metrics import ServerMetrics, stats_json
from pagedkv.server.middleware import (
    BodyLimitMiddleware,
    RequestIdMiddleware,
    RequestMetricsMiddleware,
)
from pagedkv.server.prepare import (
    chat_messages,
    check_prompt_fits,
    check_supported,
    check_token_ids,
    completion_prompt,
    max_new_tokens,
    sampling_params,
)
from pagedkv.server.prewarm import AfterTurn, PrewarmContext, add_prewarm_route
from pagedkv.server.protocol import (
    ERRORS,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
)
from pagedkv.server.render_pool import RenderPool
from pagedkv.server.tenants import TenantLedger
from pagedkv.server.tokenize import TokenizerContext, add_tokenizer_routes
from pagedkv.server.tools import ToolSupport, tool_support
from pagedkv.server.tools.output import ToolMode
from pagedkv.server.tools.request import template_tools, tool_mode
from pagedkv.server.unknown_fields import refuse_unknown_fields

_T = TypeVar("_T")
log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
STREAMS: dict[int | str, dict[str, Any]] = {
    **ERRORS,
    200: {
        "description": "JSON, or with `stream: true` server-sent events ending in `data: [DONE]`",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    },
}


@dataclass
class ServerState:
    """What the routes share. `closing` is set by `run_server` on SIGTERM."""

    engine: EngineAPI
    model_name: str
    keys: KeyRing
    metrics: ServerMetrics
    vocab_size: int | None
    tools: ToolSupport
    share: KeyShare
    images: ImageLimits = field(default_factory=ImageLimits)
    render: RenderPool = field(default_factory=RenderPool)
    ledger: TenantLedger = field(default_factory=TenantLedger)
    dashboard: Dashboard = field(default_factory=Dashboard)
    created: int = field(default_factory=lambda: int(time.time()))
    closing: bool = False
    generations: set[Generation] = field(default_factory=set)
    # Decoded image pixels of all requests in flight (`images.max_memory_bytes`).
    image_memory: ImageMemory = field(init=False)

    def __post_init__(self) -> None:
        self.image_memory = ImageMemory(self.images.max_memory_bytes)

    def cancel_all(self) -> int:
        """Cancel every generation in flight; returns how many there were."""
        for gen in list(self.generations):
            gen.cancel()
        return len(self.generations)


def create_app(
    engine: EngineAPI,
    *,
    api_keys: Iterable[str] = (),
    admin_keys: Iterable[str] | None = (),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    limits: RequestLimits | None = None,
    max_requests_per_key: int | None = None,
    model_name: str | None = None,
    tool_call_parser: str | None = None,
    metrics_keys: Iterable[str] = (),
    served_model_names: Sequence[str] = (),
    images: ImageLimits | None = None,
) -> FastAPI:
    """An app serving `engine` (a `pagedkv.Engine`, or anything with its `EngineAPI`).

    `admin_keys` may clear the cache and see the global statistics; other keys
    may not (with no keys at all, the one caller may). `limits` bounds one
    request's messages and text; `max_requests_per_key` the requests one key
    may have running (None: no bound). `served_model_names` are the names
    requests may give as `model` (`--served-model-name`); the first, else
    `model_name`, else the engine's own name, is the id clients see. Requests
    may also name the engine's own name, or leave `model` out. `tool_call_parser`
    names the tool-call format (`pagedkv.server.tools.PARSERS`) when the chat
    template does not make it clear.
    `metrics_keys` may read /metrics, as admin keys may (`server/authn.py`).
    `images` bounds a chat request's images and says whether http(s) URLs are fetched
    (`server/images/`).
    """
    names = served_names(served_model_names, model_name, engine.model_name)
    state = ServerState(
        engine=engine,
        model_name=names[0],
        keys=KeyRing(api_keys, admin_keys),
        metrics=ServerMetrics(engine.cache_stats, engine.num_active_requests),
        vocab_size=engine.vocab_size if engine.vocab_size > 0 else None,
        tools=tool_support(engine.chat_template, tool_call_parser),
        share=KeyShare(max_requests_per_key),
        images=images or ImageLimits(),
    )
    models = ModelNames(engine, [*names, engine.model_name])  # base names, then adapters
    app = FastAPI(title="pagedkv", version="0.1.0", strict_content_type=False)
    app.state.pagedkv = state
    # Outermost last: count every response, then the key, then the body's size and limits.
    app.add_middleware(
        RequestLimitsMiddleware, limits=limits or RequestLimits(), error_body=error_body
    )
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=max_body_bytes, error_body=error_body)
    app.add_middleware(
        AuthMiddleware, keys=state.keys, error_body=error_body, metrics_keys=KeyRing(metrics_keys)
    )
    app.add_middleware(RequestMetricsMiddleware, metrics=state.metrics)
    app.add_middleware(RequestIdMiddleware, error_body=error_body)
    add_error_handlers(app)

    def check_open(model: str | None) -> None:
        """Refuse while closing, and a `model` that is neither the base nor an adapter."""
        if state.closing:
            raise shutting_down()
        models.adapter_of(model)

    def check_admin(tenant: Tenant, what: str) -> None:
        if not tenant.is_admin:
            raise APIError(403, f"{what} needs an admin key", code="admin_key_required")

    async def generate(
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        ids: list[int],
        tenant: Tenant,
        arrived: float,
        held: ShareHeld,
        tools: ToolMode | None = None,
        images: Sequence[Any] = (),
    ) -> Response:
        gen = await start_generation(
            request, body, ids, tenant, arrived, held, tools, images=images
        )
        if not body.stream:
            return JSONResponse(await gen.response_body())
        return StreamingResponse(
            gen.sse(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def start_generation(
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        ids: list[int],
        tenant: Tenant,
        arrived: float,
        held: ShareHeld,
        tools: ToolMode | None = None,
        leases: Sequence[LeaseRequest] = (),
        images: Sequence[Any] = (),
    ) -> Generation:
        """Submit the request; returns once its first event (or its refusal) arrived.
        `held` is the key's share the request took (`admit`); the generation gives it
        back when it closes. `images`: the prompt's image spans (`Engine.render_chat`)."""
        chat = isinstance(body, ChatCompletionRequest)
        param = "messages" if chat else "prompt"
        max_tokens = max_new_tokens(body, len(ids), engine.max_context, param)
        if isinstance(body, ChatCompletionRequest):
            logprobs = body.logprobs
        else:
            logprobs = body.logprobs is not None  # 0: the sampled token's logprob only
        params = sampling_params(
            body, max_tokens, logprobs, engine.sampling_defaults, state.vocab_size, tools
        )
        salt = tenant.cache_salt(body.cache_salt)
        lora = models.adapter_of(body.model)
        stream = body.stream
        include_usage = bool(stream and body.stream_options and body.stream_options.include_usage)
        options = Options(
            kind="chat" if chat else "completion",
            model=body.model if lora is not None and body.model else state.model_name,
            include_usage=include_usage,
            logprobs=logprobs,
            n=params.n,
            tools=tools,
            top_logprobs=params.top_logprobs,
            decode=functools.partial(engine.decode, skip_special_tokens=False),
        )

        leases = [*leases, *openai_leases(body, len(ids), tenant)]

        def open_stream() -> Iterator[StreamEvent]:
            # Only when asked for: an engine double need not know these arguments.
            more: dict[str, Any] = {}
            if lora is not None:
                more["lora"] = lora
            if leases:
                more["leases"] = leases
            if images:
                more["images"] = images
            return engine.stream(ids, params, cache_salt=salt, owner=tenant.salt, **more)

        def on_close(gen: Generation) -> None:
            state.generations.discard(gen)
            held.release()
            results = [gen.results[i] for i in sorted(gen.results)]
            state.ledger.finished(tenant, results, complete=gen.done)
            if gen.done and results:
                state.dashboard.finished(REQUEST_ID.get(), tenant.label, results)
            # The next turn's form is stored with the base model's weights: an adapter's
            # turn is left to its next request (its KV would be keyed to the base).
            # A turn with images is stored too: its messages keep their decoded images,
            # which the next-turn render keys as the next request will.
            turn = gen.done and len(results) == 1 and lora is None
            if isinstance(body, ChatCompletionRequest) and turn:
                message = history_message(results[0], tools)
                after_turn.finished(body, ids, results[0], message, salt, tenant.salt)

        state.ledger.started(tenant)
        gen = Generation(
            open_stream,
            options,
            state.metrics,
            arrived=arrived,
            closing=lambda: state.closing,
            on_close=on_close,
        )
        state.generations.add(gen)
        await gen.start(request.receive)
        return gen

    @app.get("/health", response_model=HealthResponse, responses={503: {"model": ErrorResponse}})
    def health() -> Response:
        if state.closing:
            return shutting_down().response()
        if not engine.healthy:
            return APIError(
                503,
                "the engine's worker has stopped; the server is exiting for a restart",
                type="server_error",
                code="engine_dead",
            ).response()
        return JSONResponse(
            {
                "status": "ok",
                "model": state.model_name,
                "active_requests": engine.num_active_requests(),
            }
        )

    @app.get(
        "/metrics",
        response_class=Response,
        responses={
            200: {"content": {"text/plain": {}}},
            401: {"model": ErrorResponse},
            403: {"model": ErrorResponse},
        },
    )
    def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_card(model_id: str, parent: str | None = None) -> dict[str, Any]:
        card = {
            "id": model_id,
            "object": "model",
            "created": state.created,
            "owned_by": "pagedkv",
            "max_model_len": engine.max_context,
        }
        if parent is not None:  # a LoRA adapter on the base model, as vLLM lists them
            card["parent"] = parent
        return card

    @app.get("/v1/models", response_model=ModelList, responses=ERRORS)
    async def list_models(tenant: TenantDep) -> Response:
        cards = [model_card(state.model_name)]
        cards += [model_card(name, state.model_name) for name in engine.adapter_names()]
        return JSONResponse({"object": "list", "data": cards})

    # `:path`: Hub ids hold a slash (`ORG/NAME`), which clients send encoded or not.
    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=ERRORS)
    async def retrieve_model(model_id: str, tenant: TenantDep) -> Response:
        lora = models.adapter_of(model_id, "model_id")
        return JSONResponse(model_card(model_id, None if lora is None else state.model_name))

    @app.post("/v1/completions", response_model=CompletionResponse, responses=STREAMS)
    async def completions(request: Request, body: CompletionRequest, tenant: TenantDep) -> Response:
        arrived = time.perf_counter()
        check_open(body.model)
        refuse_unknown_fields(body, "/v1/completions", "an OpenAI completion body")
        check_supported(body)
        prompt = completion_prompt(body)
        held = admit(tenant, body.n)
        with held.released_on_error():
            if isinstance(prompt, str):
                ids = list(
                    await _blocking(
                        functools.partial(engine.tokenize, max_tokens=engine.max_context),
                        prompt,
                        what="the tokenizer",
                        pool=state.render,
                        owner=tenant.salt,
                    )
                )
            else:
                check_token_ids(prompt, state.vocab_size, "prompt")
                ids = prompt
            return await generate(request, body, ids, tenant, arrived, held)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=STREAMS)
    async def chat_completions(
        request: Request, body: ChatCompletionRequest, tenant: TenantDep
    ) -> Response:
        arrived = time.perf_counter()
        check_open(body.model)
        refuse_unknown_fields(body, "/v1/chat/completions", "an OpenAI chat completion body")
        check_supported(body)
        held = admit(tenant, body.n)
        with held.released_on_error():
            prompt, mode = await chat_render(body, tenant, remember=True)
            return await generate(
                request, body, prompt.token_ids, tenant, arrived, held, mode, prompt.images
            )

    def admit(tenant: Tenant, n: int) -> ShareHeld:
        """Take `n` sequences of the key's share, before any tokenizing or templating:
        a key over its share gets its 429 without costing the server that work."""
        return state.share.acquire(tenant, n)

    async def prompt_only(
        body: ChatCompletionRequest, tenant: Tenant
    ) -> tuple[ImagePrompt, ToolMode | None]:
        """The prompt of a request that only looks at it (explain, count_tokens), its
        images' spans included: rendered under one sequence of the key's share, and
        refused past the model's context."""
        with admit(tenant, 1):
            prompt, mode = await chat_render(body, tenant)
        check_prompt_fits(len(prompt.token_ids), engine.max_context, "messages")
        return prompt, mode

    async def chat_render(
        body: ChatCompletionRequest, tenant: Tenant, remember: bool = False
    ) -> tuple[ImagePrompt, ToolMode | None]:
        """The prompt's token ids (tools rendered by the template) with its images' spans,
        and how to parse the reply. Callers hold the key's share (`admit`). `remember`: a
        generating request's render, kept for explain's `template_drift`
        (`Explainer.remember`)."""
        mode = tool_mode(body, state.tools)
        await check_images(body, tenant)
        messages = chat_messages(body)
        render = chat_renderer(engine, template_tools(body), engine.max_context)
        if remember:  # on the same thread, right after the render: no second hand-off
            render = functools.partial(_render_and_remember, render, explainer, body, tenant)
        prompt = await _blocking(
            render, messages, what="the chat template", pool=state.render, owner=tenant.salt
        )
        return prompt, mode

    async def check_images(body: ChatCompletionRequest, tenant: Tenant) -> None:
        """Decode the request's images onto their parts; then refuse them if the model
        takes none (after the checks, so a bad image gets its own 400 either way)."""
        takes = takes_images(engine)
        found = await attach_images(
            body, state.images, state.render, tenant.salt, keep=takes, memory=state.image_memory
        )
        if found and not takes:
            raise bad_request(
                f"{found[0]}: the served model {state.model_name} does not take images; "
                "send text only",
                found[0],
                code="images_not_supported",
            )

    @app.get("/v1/cache/stats", responses=ERRORS)
    async def cache_stats(tenant: TenantDep) -> Response:
        """Admins (and a server without keys) get the engine's and cache's global figures;
        any other key gets its own requests' figures only."""
        if not tenant.is_admin:
            figures = state.ledger.figures(tenant)
            return JSONResponse(
                {"model": state.model_name, "scope": "key", "requests": figures.to_json()}
            )
        stats = await to_thread.run_sync(engine.cache_stats)
        return JSONResponse({"scope": "server", **stats_json(stats)})

    explainer = Explainer(
        engine,
        prompt_only,
        state.render,
        metrics=state.metrics,
        other_salts=lambda tenant: [s for s in state.keys.salts() if s != tenant.salt],
        drift=RenderMemory(),
        on_miss=state.dashboard.explained,
        adapter_of=models.adapter_of,
    )
    after_turn = AfterTurn(engine, state.render)

    def check_base(model: str | None) -> None:
        check_open(model)
        if models.adapter_of(model) is not None:
            raise bad_request(
                f"prewarm computes the base model's KV; {model!r} is a LoRA adapter, whose "
                "prefix its first request stores",
                "model",
            )

    add_prewarm_route(app, PrewarmContext(engine, state.model_name, check_base, chat_render, admit))
    add_adapter_routes(app, engine, models, check_admin)

    @app.post("/v1/cache/explain", responses=ERRORS)
    async def cache_explain(body: ChatExplainRequest, tenant: TenantDep) -> Response:
        """What this chat request would reuse from the cache if sent now, and why not more
        (`server/explain.py`). A top-level field a chat request does not have is refused."""
        check_open(body.model)
        refuse_unknown_chat_fields(body)
        return JSONResponse(await explainer.explain(body, tenant))

    @app.post("/v1/cache/clear", responses={**ERRORS, 403: {"model": ErrorResponse}})
    async def cache_clear(tenant: TenantDep) -> Response:
        check_admin(tenant, "clearing the cache")
        if state.closing:
            raise shutting_down()
        await to_thread.run_sync(engine.clear_cache)
        return JSONResponse({"cleared": True})

    add_lease_routes(app, engine, check_open)
    stats = engine.cache_stats()
    if stats.cache is not None:  # caching on: the dashboard lists the leases
        state.dashboard.sources.leases = functools.partial(engine.list_leases, all_owners=True)
    add_messages_routes(
        app,
        MessagesContext(
            model_name=state.model_name,
            check_open=check_open,
            chat_render=chat_render,
            prompt_only=prompt_only,
            admit=admit,
            start_generation=start_generation,
            decode=engine.decode,
            block_size=stats.cache.block_size if stats.cache is not None else None,
            explain=explainer.explain,
            render=template_ids(engine),
        ),
    )
    blocking = functools.partial(_blocking, pool=state.render)
    add_tokenizer_routes(
        app, TokenizerContext(engine, state.tools, check_open, admit, blocking, check_images)
    )
    add_dashboard_routes(app)
    _document_errors(app)
    return app


def served_names(served: Sequence[str], model_name: str | None, own: str) -> list[str]:
    """The names the server answers to, the shown id first, duplicates dropped."""
    names = [n.strip() for n in served]
    if any(not n for n in names):
        raise ValueError("a served model name must not be empty (--served-model-name)")
    if not names:
        names = [model_name or own]
    return list(dict.fromkeys(names))


def _document_errors(app: FastAPI) -> None:
    """Drop FastAPI's default 422 from the schema: validation errors are 400s here."""
    make_schema = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = make_schema()
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _render_and_remember(
    render: Callable[[list[dict[str, Any]]], ImagePrompt],
    explainer: Explainer,
    body: ChatCompletionRequest,
    tenant: Tenant,
    messages: list[dict[str, Any]],
) -> ImagePrompt:
    prompt = render(messages)
    explainer.remember(body, tenant, prompt.token_ids)
    return prompt


async def _blocking(
    fn: Callable[[Any], _T], arg: Any, *, what: str, pool: RenderPool, owner: str | None
) -> _T:
    """Run a tokenizer call on the render pool; its refusals of the input are 400s. Only
    a chat template's own `raise_exception()` message (the model author's words about
    the messages) and our own words about images reach the client; the tokenizer's and
    jinja2's own texts can name internals and go to the log."""
    try:
        return await pool.run(owner, fn, arg)
    except PromptTooLongError as exc:  # our words: how long, and the context
        raise APIError(400, str(exc), param="messages", code="context_length_exceeded") from exc
    except ImagePromptError as exc:  # our words: the images do not fit the model
        raise bad_request(str(exc), "messages", code="invalid_image_prompt") from exc
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise hidden_error(400, f"{what} could not encode the input", exc) from exc
    except Exception as exc:
        if _raised_by_template(exc):
            raise bad_request(f"{what} refused the messages: {exc}", "messages") from exc
        if type(exc).__module__.startswith("jinja2"):
            message = f"{what} could not render the messages"
            raise hidden_error(400, message, exc, param="messages") from exc
        raise


def _raised_by_template(exc: Exception) -> bool:
    """transformers' `raise_exception(message)` raises exactly jinja2's TemplateError."""
    from jinja2.exceptions import TemplateError

    return type(exc) is TemplateError
