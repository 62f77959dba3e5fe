"""Anthropic Messages wire format: the request models.

Strict like the OpenAI models (no "5" for 5) and unknown fields ignored, so
newer clients keep working. Content blocks share one permissive model: the
converter checks each block's fields by its `type` and names the block that is
wrong, which a discriminated union would report less clearly.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedkv.server.protocol import StopText, Text, _Request


class ImageSource(_Request):
    """An image block's `source`: `base64` (`media_type` and `data`), or `url` (only when
    the server runs with --allow-remote-images)."""

    type: str = Field(json_schema_extra={"enum": ["base64", "url"]})
    media_type: str | None = Field(
        None, json_schema_extra={"enum": ["image/png", "image/jpeg", "image/webp"]}
    )
    data: str | None = None
    url: str | None = None


class ContentBlock(_Request):
    type: str = Field(json_schema_extra={"enum": ["text", "image", "tool_use", "tool_result"]})
    text: Text | None = None
    source: ImageSource | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: Text | list[ContentBlock] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = Field(
        None, description="a breakpoint: leases the prompt up to here for its ttl (5m, 1h)"
    )


class MessageParam(_Request):
    role: Literal["user", "assistant"]
    content: Text | list[ContentBlock]


class AnthropicTool(_Request):
    name: Text = Field(min_length=1, max_length=64)
    description: Text | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    cache_control: dict[str, Any] | None = None


class AnthropicToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(_Request):
    """Anthropic's extended-thinking switch. Only "disabled" can be honoured; "enabled"
    is refused with a 400 by the route, never ignored."""

    type: str
    budget_tokens: int | None = None


class CountTokensRequest(_Request):
    """A top-level field not defined here is kept only for the route to refuse it by
    name (`unknown_fields.py`)."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: Text | list[ContentBlock] | None = None
    tools: list[AnthropicTool] | None = Field(None, max_length=512)
    tool_choice: AnthropicToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[StopText] | None = Field(None, max_length=16)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    thinking: ThinkingConfig | None = Field(
        None, description="only {'type': 'disabled'}: extended thinking is not served"
    )
    cache_salt: Text | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="extension; isolates this request's cached prefixes further",
    )


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail
