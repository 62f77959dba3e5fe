"""How deep a JSON value may nest, and decoding JSON text within that depth.

Python's JSON decoder and encoder, pydantic's model builder, Jinja's `tojson`
and `copy.deepcopy` all recurse once per level, so a value nested a few
hundred levels deep raises `RecursionError` somewhere in the request's path,
which used to be a 500 with a long traceback. No tool schema, message or
tool-call argument needs more than a handful of levels, so the server caps the
depth at `MAX_JSON_DEPTH` at its two doors: the request body
(`limits.RequestLimits`) and every JSON text it decodes itself (tool-call
arguments sent as strings, tool calls in the model's output). The walks here
use an explicit stack, never recursion, so checking a value cannot fail the
way using it would.
"""

from __future__ import annotations

import json
from typing import Any

MAX_JSON_DEPTH = 64  # levels of arrays and objects; the body itself is level 1


class NestingError(ValueError):
    """A JSON value nests deeper than allowed."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the JSON nests deeper than {limit} levels of arrays and objects")
        self.limit = limit


def within_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when `value` (decoded JSON) has at most `limit` levels of lists and dicts."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return False
        stack.extend((child, depth + 1) for child in children)
    return True


def loads(text: str, limit: int = MAX_JSON_DEPTH) -> Any:
    """`json.loads` that raises `NestingError` (a ValueError) instead of `RecursionError`
    and for anything deeper than `limit`, so what it returns is safe to encode again."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise NestingError(limit) from None
    if not within_depth(value, limit):
        raise NestingError(limit)
    return value


def raw_decode(
    decoder: json.JSONDecoder, text: str, at: int, limit: int = MAX_JSON_DEPTH
) -> tuple[Any, int]:
    """`decoder.raw_decode(text, at)` with the same depth rule as `loads`."""
    try:
        value, end = decoder.raw_decode(text, at)
    except RecursionError:
        raise NestingError(limit) from None
    if not within_depth(value, limit):
        raise NestingError(limit)
    return value, end
