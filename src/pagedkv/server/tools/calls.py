"""What a tool-call parser returns, and the contract every model family's parser keeps."""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from pagedkv.server import nesting


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model wrote: `arguments` is the JSON text of an object."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    """The model's reply split into text and calls. `content` is None when the reply
    was calls only; a reply with no well-formed call is all content."""

    content: str | None
    tool_calls: list[ToolCall]


def plain(text: str) -> ParsedOutput:
    return ParsedOutput(text, [])


def call_from_json(obj: Any, args_keys: tuple[str, ...]) -> ToolCall | None:
    """A call from a decoded `{"name": ..., <args key>: {...}}`; None for anything else."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = nesting.loads(args)
        except ValueError:  # bad JSON, or nested past MAX_JSON_DEPTH
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolCallParser(ABC):
    """Finds tool calls in generated text, for one model family's documented format.

    Rules every parser keeps: parsing never raises; if any call in the text is
    malformed (bad JSON, JSON nested deeper than `nesting.MAX_JSON_DEPTH`, no
    name, arguments not an object) the whole reply is returned as content, so a
    client sees what the model wrote instead of a 500 or a half-parsed answer.
    Decode with `nesting.loads` / `nesting.raw_decode`, never `json` directly:
    a model can write `[` ten thousand times, and Python's decoder recurses.
    """

    name: str

    @abstractmethod
    def parse(self, text: str) -> ParsedOutput: ...

    @abstractmethod
    def hold_from(self, text: str) -> int | None:
        """Where in `text` (the reply so far) a call may begin: a stream sends text
        before this index as content and holds the rest back; None holds nothing."""

    # The text around one call and between calls, and the key of its arguments, as the
    # parser reads them: a required call is generated under a grammar made of these
    # (`tools/grammar.py`), so what the model is forced to write is what parses.
    call_open: str
    call_close: str
    call_separator: str
    args_key: str
