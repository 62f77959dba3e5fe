"""The Hermes format, used by Qwen 2.5/3 and NousResearch Hermes templates:
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one element per call."""

from __future__ import annotations

import re

from pagedkv.server import nesting
from pagedkv.server.tools.calls import ParsedOutput, ToolCall, ToolCallParser, call_from_json, plain

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# A last call the model did not close (it stopped at its end-of-turn token) counts too.
_CALL = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


class HermesParser(ToolCallParser):
    name = "hermes"
    call_open, call_close, call_separator = OPEN + "\n", "\n" + CLOSE, "\n"
    args_key = "arguments"

    def parse(self, text: str) -> ParsedOutput:
        if OPEN not in text:
            return plain(text)
        calls: list[ToolCall] = []
        for match in _CALL.finditer(text):
            try:
                obj = nesting.loads(match.group(1).strip())
            except ValueError:  # bad JSON, or nested past MAX_JSON_DEPTH
                return plain(text)
            call = call_from_json(obj, ("arguments", "parameters"))
            if call is None:
                return plain(text)
            calls.append(call)
        content = _CALL.sub("", text).strip()
        return ParsedOutput(content or None, calls)

    def hold_from(self, text: str) -> int | None:
        at = text.find(OPEN)
        if at != -1:
            return at
        for n in range(min(len(OPEN) - 1, len(text)), 0, -1):  # "<tool" may become "<tool_call>"
            if text.endswith(OPEN[:n]):
                return len(text) - n
        return None
