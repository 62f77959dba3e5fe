"""A chat reply with tools: parsed whole (JSON responses) or held back while streaming."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedkv.engine.grammar import ResponseFormat
from pagedkv.server.tools.calls import ParsedOutput, ToolCall, ToolCallParser


@dataclass(frozen=True, slots=True)
class ToolMode:
    """How a request uses tools: the parser of the model's format, the grammar the
    reply is generated under when a call is required (`tool_choice` "required" or a
    named function; `tools/grammar.py`), and whether more than one call may be
    returned."""

    parser: ToolCallParser
    grammar: ResponseFormat | None = None
    parallel: bool = True

    def parse(self, text: str) -> ParsedOutput:
        """The whole reply; `text` is what the model generated after the prompt."""
        parsed = self.parser.parse(text)
        if not parsed.tool_calls:
            return ParsedOutput(text, [])
        return self._limit(parsed)

    def _limit(self, parsed: ParsedOutput) -> ParsedOutput:
        if self.parallel or len(parsed.tool_calls) <= 1:
            return parsed
        return ParsedOutput(parsed.content, parsed.tool_calls[:1])


class ToolStream:
    """One choice of a streamed reply. Text that cannot be part of a call goes out as
    content at once; from where a call may begin (the parser says where) the text is
    held, and parsed when the choice finishes. Rejected: streaming the arguments as
    they are generated, which would send a half call the parser may later refuse
    (malformed JSON must come back as content)."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.text = ""
        self.sent = 0
        self.forced = mode.grammar is not None  # the reply is calls only: hold it all

    def feed(self, delta: str) -> str:
        """The content to send now, after `delta` arrived."""
        self.text += delta
        if self.forced:
            return ""
        hold = self.mode.parser.hold_from(self.text[self.sent :])
        end = len(self.text) if hold is None else self.sent + hold
        out = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return out

    def finish(self) -> ParsedOutput:
        """What was held back: the content left to send and the calls."""
        rest = self.text[self.sent :]
        self.sent = len(self.text)
        parsed = self.mode.parser.parse(rest)
        if not parsed.tool_calls:
            return ParsedOutput(rest or None, [])
        return self.mode._limit(parsed)


def tool_calls_json(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [
        {
            "id": c.id,
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for c in calls
    ]


def tool_call_deltas(calls: list[ToolCall]) -> list[list[dict[str, Any]]]:
    """OpenAI's streamed form: per call, a delta with its id and name, then one with
    its arguments (clients concatenate `arguments` by `index`)."""
    out: list[list[dict[str, Any]]] = []
    for i, c in enumerate(calls):
        head = {"index": i, "id": c.id, "type": "function"}
        out.append([{**head, "function": {"name": c.name, "arguments": ""}}])
        out.append([{"index": i, "function": {"arguments": c.arguments}}])
    return out
