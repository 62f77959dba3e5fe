"""The Llama 3.1/3.2 JSON format for custom tools: the reply is one JSON object
`{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`); Llama 3.2
separates several calls with `;`."""

from __future__ import annotations

import json

from pagedkv.server import nesting
from pagedkv.server.tools.calls import ParsedOutput, ToolCall, ToolCallParser, call_from_json, plain

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"
    call_open, call_close, call_separator = "", "", "; "
    args_key = "parameters"

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG) :].lstrip()
        if not body.startswith("{"):
            return plain(text)
        decoder = json.JSONDecoder()
        calls: list[ToolCall] = []
        at = 0
        while at < len(body):
            try:
                obj, end = nesting.raw_decode(decoder, body, at)
            except ValueError:  # bad JSON, or nested past MAX_JSON_DEPTH
                return plain(text)
            call = call_from_json(obj, ("parameters", "arguments"))
            if call is None:
                return plain(text)
            calls.append(call)
            at = end
            while at < len(body) and body[at] in " \t\r\n;":
                at += 1
        return ParsedOutput(None, calls)

    def hold_from(self, text: str) -> int | None:
        # Only a reply that starts as a call is one: hold it all until it can be parsed.
        head = text.lstrip()
        if not head or head.startswith("{") or head.startswith(PYTHON_TAG):
            return 0
        if PYTHON_TAG.startswith(head):
            return 0
        return None
