"""An Anthropic request as the OpenAI chat request the rest of the server takes.

The conversion is to the OpenAI model rather than to the template's messages
directly, so that both APIs share one path for checking messages and tools,
rendering the template and choosing the tool parser: a prompt sent through
either API is the same token ids, and so the same cached prefix. An image block
becomes an `image_url` part (base64 data as a data URL) that keeps the name of
the client's field (`source.data`, `source.url`) for its errors
(`server/images/request.py`).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from pagedkv.server.anthropic.protocol import ContentBlock, CountTokensRequest, MessagesRequest
from pagedkv.server.http_errors import bad_request
from pagedkv.server.protocol import ChatCompletionRequest


def _text_of(blocks: str | list[ContentBlock] | None, param: str) -> str:
    if blocks is None:
        return ""
    if isinstance(blocks, str):
        return blocks
    texts = []
    for j, block in enumerate(blocks):
        if block.type != "text":
            raise bad_request(
                f"{param}[{j}]: a block of type {block.type!r} is not supported here; only 'text'",
                f"{param}[{j}].type",
            )
        texts.append(block.text or "")
    return "\n".join(texts)


# Sources of images: (chat message index, part index, the field the client sent).
ImageSources = list[tuple[int, int, str]]
MEDIA_TYPES = ("image/png", "image/jpeg", "image/webp")


def _image_part(block: ContentBlock, where: str) -> tuple[dict[str, Any], str]:
    """An image block as an OpenAI `image_url` part, and the name of its data's field."""
    source = block.source
    if source is None:
        raise bad_request(f"{where}: an image block needs 'source'", f"{where}.source")
    if source.type == "base64":
        if source.media_type not in MEDIA_TYPES:
            raise bad_request(
                f"{where}.source.media_type: {source.media_type!r} is not taken; send "
                f"{', '.join(MEDIA_TYPES)} (the format is then read from the data itself)",
                f"{where}.source.media_type",
            )
        if not source.data:
            raise bad_request(
                f"{where}.source: a base64 source needs 'data'", f"{where}.source.data"
            )
        url, field = f"data:{source.media_type};base64,{source.data}", "data"
    elif source.type == "url":
        if not source.url:
            raise bad_request(f"{where}.source: a url source needs 'url'", f"{where}.source.url")
        url, field = source.url, "url"
    else:
        raise bad_request(
            f"{where}.source.type: image sources of type {source.type!r} are not supported; "
            "send 'base64' or 'url'",
            f"{where}.source.type",
        )
    return {"type": "image_url", "image_url": {"url": url}}, f"{where}.source.{field}"


def _user_turn(blocks: list[ContentBlock], param: str) -> tuple[list[dict[str, Any]], ImageSources]:
    """Tool results become tool messages (in order), the text one user message after them:
    plain text, or, when the turn holds images, its text and image parts in order."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    parts: list[dict[str, Any]] = []
    sources: list[tuple[int, str]] = []
    for j, block in enumerate(blocks):
        where = f"{param}[{j}]"
        if block.type == "text":
            if block.text is None:
                raise bad_request(f"{where}: a text block needs 'text'", f"{where}.text")
            texts.append(block.text)
            parts.append({"type": "text", "text": block.text})
        elif block.type == "image":
            part, field = _image_part(block, where)
            sources.append((len(parts), field))
            parts.append(part)
        elif block.type == "tool_result":
            if not block.tool_use_id:
                raise bad_request(
                    f"{where}: a tool_result needs 'tool_use_id'", f"{where}.tool_use_id"
                )
            content = _text_of(block.content, f"{where}.content")
            if block.is_error:
                content = f"Error: {content}"
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        else:
            raise bad_request(
                f"{where}: content blocks of type {block.type!r} are not supported; "
                "send 'text', 'image' or 'tool_result'",
                f"{where}.type",
            )
    if sources:
        out.append({"role": "user", "content": parts})
    elif texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out, [(len(out) - 1, k, field) for k, field in sources]


def _assistant_turn(blocks: list[ContentBlock], param: str) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        where = f"{param}[{j}]"
        if block.type == "text":
            texts.append(block.text or "")
        elif block.type == "tool_use":
            if not block.id or not block.name:
                raise bad_request(f"{where}: a tool_use needs 'id' and 'name'", where)
            arguments = json.dumps(block.input or {}, ensure_ascii=False)
            fn = {"name": block.name, "arguments": arguments}
            calls.append({"id": block.id, "type": "function", "function": fn})
        else:
            raise bad_request(
                f"{where}: content blocks of type {block.type!r} are not supported in an "
                "assistant turn; send 'text' or 'tool_use'",
                f"{where}.type",
            )
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def chat_origins(body: CountTokensRequest) -> list[int | None]:
    """For each message of `to_chat_request(body)`, the index in `body.messages` it came
    from (a user turn's tool results are one chat message each); None for the system
    prompt. Lets explain name a section by the caller's own message index."""
    origins: list[int | None] = [None] if body.system else []
    for i, msg in enumerate(body.messages):
        if isinstance(msg.content, str) or msg.role == "assistant":
            origins.append(i)
        else:
            turn, _ = _user_turn(msg.content, f"messages[{i}].content")
            origins.extend([i] * len(turn))
    return origins


def to_chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The OpenAI form of `body` (sampling fields too for a `MessagesRequest`)."""
    messages: list[dict[str, Any]] = []
    images: ImageSources = []
    if body.system:
        messages.append({"role": "system", "content": _text_of(body.system, "system")})
    for i, msg in enumerate(body.messages):
        param = f"messages[{i}].content"
        if isinstance(msg.content, str):
            messages.append({"role": msg.role, "content": msg.content})
        elif msg.role == "user":
            turn, sources = _user_turn(msg.content, param)
            images += [(len(messages) + m, k, field) for m, k, field in sources]
            messages.extend(turn)
        else:
            messages.append(_assistant_turn(msg.content, param))
    chat: dict[str, Any] = {"model": body.model, "messages": messages}
    if body.tools:
        chat["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    **({"description": t.description} if t.description else {}),
                    "parameters": t.input_schema,
                },
            }
            for t in body.tools
        ]
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise bad_request("tool_choice of type 'tool' needs 'name'", "tool_choice.name")
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        chat["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if isinstance(body, MessagesRequest):
        chat["max_tokens"] = body.max_tokens
        chat["stream"] = body.stream
        for name in ("temperature", "top_p", "top_k", "cache_salt"):
            if getattr(body, name) is not None:
                chat[name] = getattr(body, name)
        if body.stop_sequences:
            chat["stop"] = list(body.stop_sequences)
    try:
        request = ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:  # a message the chat form cannot hold
        first = exc.errors()[0]
        raise bad_request(f"the request cannot be served: {first.get('msg')}") from exc
    for m, k, field in images:  # errors about an image name the client's own field
        content = request.messages[m].content
        assert isinstance(content, list)
        content[k].source_param = field
    return request
