"""The grammar a required tool call is generated under: the parser's own call format,
with each tool's name and its `parameters` schema as the arguments.

`tool_choice` "required" allows one call of any of the tools (several, separated as
the format separates them, when parallel calls are allowed); a named function
allows exactly one call of that function. The reply is then calls only, which
the request's parser reads back (`ToolMode`), and the arguments validate
against the tool's schema because the grammar enforces it.
"""

from __future__ import annotations

import json
from typing import Any

from pagedkv.engine.grammar import ResponseFormat, check_schema_size
from pagedkv.server.tools.calls import ToolCallParser

# A tool declared without parameters takes any JSON object.
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def call_schema(name: str, parameters: dict[str, Any] | None, args_key: str) -> dict[str, Any]:
    """One call's JSON: `{"name": <name>, <args_key>: <arguments>}`, in that order."""
    return {
        "type": "object",
        "properties": {"name": {"const": name}, args_key: parameters or ANY_OBJECT},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def tool_call_format(
    parser: ToolCallParser,
    tools: list[tuple[str, dict[str, Any] | None]],
    parallel: bool,
) -> ResponseFormat:
    """The grammar of a reply made of calls of `tools` ((name, parameters) pairs; one
    pair for a named function), in `parser`'s format."""
    calls = [call_schema(name, params, parser.args_key) for name, params in tools]
    body = calls[0] if len(calls) == 1 else {"anyOf": calls}
    names = ", ".join(name for name, _ in tools)
    body_json = json.dumps(body)
    check_schema_size(body_json, f"the parameters of {names}")
    call = [_literal(parser.call_open), "body", _literal(parser.call_close)]
    lark = "\n".join(
        [
            "start: call" + (f" ({_literal(parser.call_separator)} call)*" if parallel else ""),
            "call: " + " ".join(part for part in call if part),
            f"body: %json {body_json}",
        ]
    )
    return ResponseFormat.lark(lark, f"the tool call grammar of {names}")


def _literal(text: str) -> str:
    """`text` as a Lark string literal (JSON's escapes are Lark's); "" for no text."""
    return json.dumps(text) if text else ""
