"""A finished or streaming generation as an Anthropic message.

Usage follows Anthropic's split, which sums to the prompt:
`cache_read_input_tokens` are the prompt tokens restored from the cache (any
tier), `cache_creation_input_tokens` the tokens up to the request's last
`cache_control` breakpoint that it computed and leased (whole blocks; 0 without a
breakpoint, as on Anthropic, although every prefix is cached anyway),
`input_tokens` the rest.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.engine.request import GenerationResult
from pagedkv.server.anthropic.errors import error_body
from pagedkv.server.generation import Generation
from pagedkv.server.http_errors import APIError
from pagedkv.server.tools.calls import ParsedOutput, ToolCall
from pagedkv.server.tools.output import ToolMode, ToolStream

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReplyOptions:
    model: str
    tools: ToolMode | None
    stop_sequences: Sequence[str]
    decode: Callable[[Sequence[int]], str]
    block_size: int | None  # None: prefix caching is off
    prompt_tokens: int  # before the split is known (message_start)
    breakpoints: bool = False  # the request has cache_control breakpoints


def usage(result: GenerationResult, breakpoints: bool) -> dict[str, int]:
    prompt, read = result.prompt_tokens, result.cached_tokens
    created = max(0, result.leased_tokens - read) if breakpoints else 0
    return {
        "input_tokens": prompt - read - created,
        "cache_read_input_tokens": read,
        "cache_creation_input_tokens": created,
        "output_tokens": len(result.token_ids),
    }


def _tool_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def _stop(result: GenerationResult, o: ReplyOptions, calls: bool) -> tuple[str, str | None]:
    """stop_reason and the stop sequence that ended the reply, if one did."""
    if calls:
        return "tool_use", None
    if result.finish_reason == "length":
        return "max_tokens", None
    if o.stop_sequences and result.token_ids:
        # The engine cuts the text before the stop string; the tokens still hold it.
        after = o.decode(result.token_ids)[len(result.text) :]
        for s in o.stop_sequences:
            if after.startswith(s):
                return "stop_sequence", s
    return "end_turn", None


class AnthropicReply:
    """Renders one generation; exactly one of `body()` or `sse()` is consumed."""

    def __init__(self, gen: Generation, options: ReplyOptions) -> None:
        self.gen = gen
        self.o = options
        self.id = "msg_" + uuid.uuid4().hex

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.o.model}

    async def body(self) -> dict[str, Any]:
        (result,) = await self.gen.finish()
        o = self.o
        parsed = o.tools.parse(result.text) if o.tools else ParsedOutput(result.text, [])
        content: list[dict[str, Any]] = []
        if parsed.content or not parsed.tool_calls:
            content.append({"type": "text", "text": parsed.content or ""})
        for call in parsed.tool_calls:
            content.append(
                {
                    "type": "tool_use",
                    "id": _tool_id(call),
                    "name": call.name,
                    "input": json.loads(call.arguments),
                }
            )
        reason, sequence = _stop(result, o, bool(parsed.tool_calls))
        return {
            **self._head(),
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage(result, o.breakpoints),
        }

    async def sse(self) -> AsyncIterator[bytes]:
        o = self.o
        held = ToolStream(o.tools) if o.tools else None
        index = 0
        text_open = False
        try:
            start_usage = {
                "input_tokens": o.prompt_tokens,
                "output_tokens": 0,
                "cache_read_input_tokens": 0,
                "cache_creation_input_tokens": 0,
            }
            message = {
                **self._head(),
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": start_usage,
            }
            yield _event("message_start", {"message": message})
            result: GenerationResult | None = None
            parsed = ParsedOutput(None, [])
            async for event in self.gen.events():
                text = held.feed(event.text) if held else event.text
                if event.finished and event.result is not None:
                    result = event.result
                    if held:
                        parsed = held.finish()
                        text += parsed.content or ""
                if text:
                    if not text_open:
                        yield _text_block_start(index)
                        text_open = True
                    delta = {"type": "text_delta", "text": text}
                    yield _event("content_block_delta", {"index": index, "delta": delta})
            if result is None:
                raise APIError(
                    503,
                    "the request was cancelled before it finished (the server is shutting down)",
                )
            if text_open or not parsed.tool_calls:
                if not text_open:  # an empty reply still has its (empty) text block
                    yield _text_block_start(index)
                yield _event("content_block_stop", {"index": index})
                index += 1
            for call in parsed.tool_calls:
                block: dict[str, Any] = {
                    "type": "tool_use",
                    "id": _tool_id(call),
                    "name": call.name,
                    "input": {},
                }
                yield _event("content_block_start", {"index": index, "content_block": block})
                delta = {"type": "input_json_delta", "partial_json": call.arguments}
                yield _event("content_block_delta", {"index": index, "delta": delta})
                yield _event("content_block_stop", {"index": index})
                index += 1
            reason, sequence = _stop(result, o, bool(parsed.tool_calls))
            yield _event(
                "message_delta",
                {
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": usage(result, o.breakpoints),
                },
            )
            yield _event("message_stop", {})
        except APIError as exc:
            self.gen.close("rejected" if exc.status < 500 else "cancelled")
            yield _event("error", error_body(exc))
        except Exception as exc:  # headers are sent: the error travels in the stream
            log.exception("%s: stream failed", self.id)
            self.gen.close("error")
            yield _event(
                "error", error_body(APIError(500, f"internal error: {type(exc).__name__}"))
            )
        finally:
            self.gen.close()


def _text_block_start(index: int) -> bytes:
    block = {"type": "text", "text": ""}
    return _event("content_block_start", {"index": index, "content_block": block})


def _event(name: str, payload: dict[str, Any]) -> bytes:
    data = {"type": name, **payload} if name != "error" else payload
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()
