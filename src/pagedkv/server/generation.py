"""One generation request: engine events pumped to the event loop, as JSON or SSE."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from starlette.types import Receive

from pagedkv.engine.request import GenerationResult, StreamEvent
from pagedkv.server.event_pump import EventPump
from pagedkv.server.http_errors import REQUEST_ID, APIError, from_engine_error
from pagedkv.server.metrics import ServerMetrics
from pagedkv.server.request_log import Tokens, current_record, note_error
from pagedkv.server.tools.output import ToolMode, ToolStream, tool_call_deltas, tool_calls_json

log = logging.getLogger(__name__)

Kind = Literal["completion", "chat"]


@dataclass(slots=True)
class Options:
    kind: Kind
    model: str
    include_usage: bool
    logprobs: bool
    n: int = 1
    tools: ToolMode | None = None  # chat only: parse tool calls out of the reply
    top_logprobs: int = 0  # the most likely tokens' logprobs, per token (with logprobs)
    decode: Callable[[Sequence[int]], str] | None = None  # a top token's text


class Generation:
    """Runs one request through the engine and renders it as the OpenAI API does.

    Order: `start()` waits for the first event, so that a full queue or a
    refused request still becomes a proper 429/400 before any header is sent;
    then exactly one of `response_body()` or `sse()` is consumed. With `n`
    samples, events of every choice arrive interleaved, each with its index;
    the request is done when all `n` have finished. `close()`
    (called by both and by the disconnect watcher; only the first call counts)
    cancels the engine request if it is still running, records metrics and
    calls `on_close`.
    """

    def __init__(
        self,
        open_stream: Callable[[], Iterator[StreamEvent]],
        options: Options,
        metrics: ServerMetrics,
        *,
        arrived: float,
        closing: Callable[[], bool],
        on_close: Callable[[Generation], None],
    ) -> None:
        self.options = options
        self.metrics = metrics
        self.arrived = arrived
        self.closing = closing
        self.on_close = on_close
        self.id = ("chatcmpl-" if options.kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._open_stream = open_stream
        self._pump: EventPump | None = None
        self._first: StreamEvent | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._last_token_at: float | None = None
        self._first_token_at: float | None = None
        self._record = current_record()  # the request's log line, filled in by close()
        self._closed = False
        self.results: dict[int, GenerationResult] = {}
        n = options.n
        self.token_texts: list[list[str]] = [[] for _ in range(n)]
        self.token_logprobs: list[list[float]] = [[] for _ in range(n)]
        # Per token, its top alternatives as (text, logprob), most likely first.
        self.token_tops: list[list[list[tuple[str, float]]]] = [[] for _ in range(n)]
        self._token_text: dict[int, str] = {}

    @property
    def done(self) -> bool:
        """Every sample finished, and none by being cancelled (a shutdown's cancel can end
        the samples before the stream notices it is closing: that is no answer)."""
        if len(self.results) != self.options.n:
            return False
        return all(r.finish_reason != "cancelled" for r in self.results.values())

    async def start(self, receive: Receive | None) -> None:
        self.metrics.in_flight.inc()
        self._pump = EventPump(self._open_stream)
        if receive is not None:
            self._watcher = asyncio.create_task(self._watch_disconnect(receive))
        try:
            self._first = await self._next()
        except APIError:
            self.close("rejected")
            raise
        except BaseException:
            self.close("error")
            raise

    async def _watch_disconnect(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not self.done:
                    log.info("%s: the client went away; cancelling the request", self.id)
                # Also when the response never starts streaming, and so never closes it.
                self.close("disconnected")
                return

    def cancel(self) -> None:
        if self._pump is not None:
            self._pump.cancel()

    async def _next(self) -> StreamEvent | None:
        assert self._pump is not None
        try:
            event = await self._pump.next()
        except Exception as exc:
            api_error = from_engine_error(exc, closing=self.closing())
            if api_error is None:
                raise
            raise api_error from exc
        if event is None:
            return None
        now = time.perf_counter()
        if event.token_ids and event.index == 0:
            if self._last_token_at is None:
                self._first_token_at = now
                self.metrics.ttft.observe(now - self.arrived)
            else:
                self.metrics.itl.observe(now - self._last_token_at)
            self._last_token_at = now
        if self.options.logprobs and event.token_ids:
            # A token's text is its event's delta: the engine has no per-token text, and
            # holds text back while a stop string may still match, so near a stop string
            # a token can show "" and a later one the text of both.
            lps = event.logprobs or [0.0] * len(event.token_ids)
            texts = self.token_texts[event.index]
            texts.extend([event.text] + [""] * (len(event.token_ids) - 1))
            self.token_logprobs[event.index].extend(lps)
            if self.options.top_logprobs:
                tops = event.top_logprobs or [[] for _ in event.token_ids]
                self.token_tops[event.index].extend(
                    [(self._text_of(t), lp) for t, lp in top] for top in tops
                )
        if event.finished:
            assert event.result is not None
            self.results[event.index] = event.result
        return event

    def _text_of(self, token: int) -> str:
        """One token's own text (special tokens shown), as OpenAI lists alternatives."""
        text = self._token_text.get(token)
        if text is None:
            decode = self.options.decode
            text = decode([token]) if decode is not None else str(token)
            self._token_text[token] = text
        return text

    def _events(self) -> AsyncIterator[StreamEvent]:
        async def gen() -> AsyncIterator[StreamEvent]:
            event = self._first
            while event is not None:
                yield event
                if self.done:
                    return
                event = await self._next()

        return gen()

    def close(self, outcome: str = "cancelled") -> None:
        """Stop the engine request if it still runs; `outcome` labels a request without result."""
        if self._closed:
            return
        self._closed = True
        self._note_tokens(outcome)
        self.on_close(self)
        self.metrics.in_flight.dec()
        if self._watcher is not None and self._watcher is not asyncio.current_task():
            self._watcher.cancel()
        if not self.done:
            self.cancel()
            self.metrics.finished.labels(outcome).inc()
        else:
            results = list(self.results.values())
            self.metrics.observe_result(
                prompt_tokens=results[0].prompt_tokens,
                cached_tokens=results[0].cached_tokens,
                completion_tokens=sum(len(r.token_ids) for r in results),
                finish_reasons=[r.finish_reason for r in results],
            )

    def _note_tokens(self, outcome: str) -> None:
        """Put what the engine did into the request's log line (`server/request_log.py`):
        the first sample's prompt and cache hits (every sample shares them), every
        sample's tokens, and each finish reason, or `outcome` when it did not finish."""
        results = [self.results[i] for i in sorted(self.results)]
        if self._record is None or (outcome == "rejected" and not results):
            return  # a refusal: the log line gives its reason instead
        first = results[0] if results else None
        self._record.tokens = Tokens(
            prompt_tokens=first.prompt_tokens if first is not None else None,
            cached=dict(first.tier_hits) if first is not None else {},
            generated_tokens=sum(len(r.token_ids) for r in results),
            ttft_s=None if self._first_token_at is None else self._first_token_at - self.arrived,
            finish=",".join(r.finish_reason for r in results) if self.done else outcome,
        )

    # -- non-streaming ------------------------------------------------------

    async def finish(self) -> list[GenerationResult]:
        """Run the request to its end; every sample's result, by index."""
        try:
            async for _ in self._events():
                pass
        except APIError as exc:
            self.close("rejected" if exc.status < 500 else "cancelled")
            raise
        except Exception:
            self.close("error")
            raise
        finally:
            self.close()
        if not self.done:
            raise APIError(
                503,
                "the request was cancelled before it finished (the server is shutting down)",
                code="request_cancelled",
                headers={"Retry-After": "1"},
            )
        return [self.results[i] for i in range(self.options.n)]

    def events(self) -> AsyncIterator[StreamEvent]:
        """The request's events, the first included, until every sample finished; the
        caller handles errors and calls `close()`."""
        return self._events()

    async def response_body(self) -> dict[str, Any]:
        results = await self.finish()
        o = self.options
        body: dict[str, Any] = {
            "id": self.id,
            "created": self.created,
            "model": o.model,
            "usage": usage(results),
            "system_fingerprint": None,
        }
        choices: list[dict[str, Any]] = []
        for i, r in enumerate(results):
            if o.kind == "chat":
                message, finish = chat_message(r, o.tools)
                choices.append(
                    {
                        "index": i,
                        "finish_reason": finish,
                        "message": message,
                        "logprobs": self._chat_logprobs(i, 0),
                    }
                )
            else:
                choices.append(
                    {
                        "index": i,
                        "text": r.text,
                        "finish_reason": _finish_reason(r),
                        "logprobs": self._completion_logprobs(i, 0, 0),
                    }
                )
        body["object"] = "chat.completion" if o.kind == "chat" else "text_completion"
        body["choices"] = choices
        return body

    # -- streaming ----------------------------------------------------------

    async def sse(self) -> AsyncIterator[bytes]:
        o = self.options
        try:
            if o.kind == "chat":
                for i in range(o.n):
                    yield self._chunk(i, {"role": "assistant", "content": ""}, None, None)
            sent_tokens = [0] * o.n
            text_offset = [0] * o.n
            held = [ToolStream(o.tools) for _ in range(o.n)] if o.tools else None
            async for event in self._events():
                i = event.index
                text = held[i].feed(event.text) if held else event.text
                if text or (o.logprobs and event.token_ids):
                    if o.kind == "chat":
                        lp = self._chat_logprobs(i, sent_tokens[i])
                        yield self._chunk(i, {"content": text}, None, lp)
                    else:
                        lp = self._completion_logprobs(i, sent_tokens[i], text_offset[i])
                        yield self._chunk(i, text, None, lp)
                    sent_tokens[i] = len(self.token_texts[i])
                    text_offset[i] += len(text)
                if event.finished and event.result is not None:
                    finish = _finish_reason(event.result)
                    if held:
                        parsed = held[i].finish()
                        if parsed.content:
                            yield self._chunk(i, {"content": parsed.content}, None, None)
                        for delta in tool_call_deltas(parsed.tool_calls):
                            yield self._chunk(i, {"tool_calls": delta}, None, None)
                        finish = "tool_calls" if parsed.tool_calls else finish
                    yield self._chunk(i, {} if o.kind == "chat" else "", finish, None)
            if not self.done:
                raise APIError(
                    503,
                    "the request was cancelled before it finished (the server is shutting down)",
                    code="request_cancelled",
                )
            if o.include_usage:
                results = list(self.results.values())
                yield _sse({**self._chunk_head(), "choices": [], "usage": usage(results)})
        except APIError as exc:
            note_error(exc.message)  # sent in the stream: the status stays 200
            self.close("rejected" if exc.status < 500 else "cancelled")
            yield _sse(exc.body())
        except Exception as exc:  # headers are sent: the error travels in the stream
            request_id = REQUEST_ID.get()
            log.exception("request %s (%s): stream failed", request_id, self.id)
            self.close("error")
            message = f"internal error: {type(exc).__name__} (request id {request_id})"
            note_error(message)
            yield _sse(APIError(500, message, type="server_error").body())
        finally:
            self.close()
        yield b"data: [DONE]\n\n"

    def _chunk_head(self) -> dict[str, Any]:
        o = self.options
        obj = "chat.completion.chunk" if o.kind == "chat" else "text_completion"
        head: dict[str, Any] = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": o.model,
        }
        if o.include_usage:
            head["usage"] = None
        return head

    def _chunk(self, index: int, delta: dict[str, Any] | str, finish: str | None, lp: Any) -> bytes:
        if isinstance(delta, dict):
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": index, "text": delta, "logprobs": lp, "finish_reason": finish}
        return _sse({**self._chunk_head(), "choices": [choice]})

    def _chat_logprobs(self, index: int, start: int) -> dict[str, Any] | None:
        if not self.options.logprobs:
            return None
        texts, lps = self.token_texts[index][start:], self.token_logprobs[index][start:]
        tops = self._tops(index, start, len(texts))
        return {
            "content": [
                {
                    "token": t,
                    "logprob": lp,
                    "bytes": list(t.encode()),
                    "top_logprobs": [
                        {"token": tt, "logprob": tlp, "bytes": list(tt.encode())} for tt, tlp in top
                    ],
                }
                for t, lp, top in zip(texts, lps, tops, strict=True)
            ]
        }

    def _tops(self, index: int, start: int, count: int) -> list[list[tuple[str, float]]]:
        if not self.options.top_logprobs:
            return [[] for _ in range(count)]
        return self.token_tops[index][start : start + count]

    def _completion_logprobs(self, index: int, start: int, offset: int) -> dict[str, Any] | None:
        if not self.options.logprobs:
            return None
        texts = self.token_texts[index][start:]
        offsets = []
        for t in texts:
            offsets.append(offset)
            offset += len(t)
        top_logprobs = None
        if self.options.top_logprobs:
            # A dict per token, as OpenAI's legacy API: alternatives whose texts are the
            # same (rare: two ids for one string) keep the most likely one's logprob.
            top_logprobs = []
            for top in self._tops(index, start, len(texts)):
                alternatives: dict[str, float] = {}
                for t, lp in top:
                    alternatives.setdefault(t, lp)
                top_logprobs.append(alternatives)
        return {
            "tokens": texts,
            "token_logprobs": self.token_logprobs[index][start:],
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }


def usage(results: list[GenerationResult]) -> dict[str, Any]:
    """One prompt, the completion tokens of every choice."""
    prompt = results[0].prompt_tokens
    completion = sum(len(r.token_ids) for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": results[0].cached_tokens},
    }


def chat_message(result: GenerationResult, tools: ToolMode | None) -> tuple[dict[str, Any], str]:
    """A choice's message and finish reason; with tools, the calls parsed out of it."""
    if tools is None:
        return {"role": "assistant", "content": result.text}, _finish_reason(result)
    parsed = tools.parse(result.text)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if not parsed.tool_calls:
        return message, _finish_reason(result)
    message["tool_calls"] = tool_calls_json(parsed.tool_calls)
    return message, "tool_calls"


def history_message(result: GenerationResult, tools: ToolMode | None) -> dict[str, Any]:
    """The answer as the client sends it back in its next request's history, in the
    chat template's form (a call's arguments decoded, as `history_tool_calls` does)."""
    message, _ = chat_message(result, tools)
    calls = message.get("tool_calls")
    if calls:
        message["tool_calls"] = [
            {
                **c,
                "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])},
            }
            for c in calls
        ]
    return message


def _finish_reason(result: GenerationResult) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
