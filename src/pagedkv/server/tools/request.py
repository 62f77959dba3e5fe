"""From a chat request's `tools`, `tool_choice` and history to what the template and the
reply parser take. Pure; raises `APIError(400)` naming the field."""

from __future__ import annotations

from typing import Any

from pagedkv.engine.grammar import GrammarError, ResponseFormat
from pagedkv.server import nesting
from pagedkv.server.http_errors import bad_request
from pagedkv.server.protocol import ChatCompletionRequest, ToolCallIn
from pagedkv.server.tools.calls import ToolCallParser
from pagedkv.server.tools.grammar import tool_call_format
from pagedkv.server.tools.output import ToolMode
from pagedkv.server.tools.select import ToolSupport


def template_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tool definitions as transformers passes them to a chat template."""
    if not body.tools:
        return None
    return [t.model_dump(exclude_none=True) for t in body.tools]


def tool_mode(body: ChatCompletionRequest, support: ToolSupport) -> ToolMode | None:
    """How the reply is parsed; None: it is plain text.

    `tool_choice` "none" still renders the tools (the prompt, and so its cached
    prefix, stays the same as the turns that may call them) but parses nothing.
    "required" and a named function generate the reply under a grammar of the
    parser's call format with each tool's parameters schema (`tools/grammar.py`).
    """
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice requires a call but no tools were given", "tool_choice")
        return None
    if support.parser is None:
        raise bad_request(f"tools cannot be used with this model: {support.reason}", "tools")
    if choice == "none":
        return None
    parallel = body.parallel_tool_calls
    if choice is None or choice == "auto":
        return ToolMode(support.parser, None, parallel)
    if choice == "required":
        tools = [(t.function.name, t.function.parameters) for t in body.tools]
        return ToolMode(support.parser, _grammar(support.parser, tools, parallel), parallel)
    name = choice.function.name
    names = [t.function.name for t in body.tools]
    if name not in names:
        raise bad_request(
            f"tool_choice names the function {name!r}, which is not among the tools "
            f"({', '.join(names)})",
            "tool_choice.function.name",
        )
    params = next(t.function.parameters for t in body.tools if t.function.name == name)
    return ToolMode(support.parser, _grammar(support.parser, [(name, params)], False), False)


def _grammar(
    parser: ToolCallParser, tools: list[tuple[str, dict[str, Any] | None]], parallel: bool
) -> ResponseFormat:
    try:
        return tool_call_format(parser, tools, parallel)
    except GrammarError as exc:
        raise bad_request(f"{exc}; check the tools' parameters schemas", "tools") from exc


def history_tool_calls(calls: list[ToolCallIn], param: str) -> list[dict[str, Any]]:
    """An assistant turn's calls for the template, arguments decoded (templates write
    them with `tojson`, so a string would be quoted twice). Decoded within
    `nesting.MAX_JSON_DEPTH`, like the body: the body's own walk sees only a string."""
    out = []
    for k, call in enumerate(calls):
        try:
            args = nesting.loads(call.function.arguments)
        except ValueError as exc:  # bad JSON (JSONDecodeError) or too deep (NestingError)
            raise bad_request(
                f"{param}[{k}].function.arguments is not JSON: {exc}",
                f"{param}[{k}].function.arguments",
            ) from exc
        if not isinstance(args, dict):
            raise bad_request(
                f"{param}[{k}].function.arguments must be a JSON object",
                f"{param}[{k}].function.arguments",
            )
        fn = {"name": call.function.name, "arguments": args}
        out.append({"id": call.id, "type": "function", "function": fn})
    return out
