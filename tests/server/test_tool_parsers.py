"""The tool-call parsers on fixed model outputs, and choosing one from a chat template."""

from __future__ import annotations

import json

import pytest

from pagedkv.server.tools import PARSERS, tool_support
from pagedkv.server.tools.hermes import HermesParser
from pagedkv.server.tools.llama3 import Llama3JsonParser
from pagedkv.server.tools.output import ToolMode, ToolStream

hermes = HermesParser()
llama = Llama3JsonParser()


def test_hermes_one_call_with_text_before() -> None:
    out = hermes.parse(
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call>"
    )
    assert out.content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert out.tool_calls[0].id.startswith("call_")


def test_hermes_parallel_calls_and_an_unclosed_last_call() -> None:
    out = hermes.parse(
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {"x": [1, 2]}}'
    )
    assert out.content is None
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("a", {}),
        ("b", {"x": [1, 2]}),
    ]
    assert len({c.id for c in out.tool_calls}) == 2


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "a", "arguments": {"x": 1</tool_call>',  # truncated JSON
        "<tool_call>not json at all</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name":</tool_call>',
        "just words, no call",
    ],
)
def test_hermes_anything_malformed_is_plain_text(text: str) -> None:
    out = hermes.parse(text)
    assert out.content == text and out.tool_calls == []


def test_llama3_json_calls() -> None:
    out = llama.parse('{"name": "search", "parameters": {"q": "kv cache"}}')
    assert out.content is None
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("search", {"q": "kv cache"})
    ]
    two = llama.parse(
        '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": "{\\"n\\": 2}"}'
    )
    assert [(c.name, json.loads(c.arguments)) for c in two.tool_calls] == [
        ("a", {}),
        ("b", {"n": 2}),
    ]


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "search", "parameters": {"q": ',
        '{"name": "search", "parameters": {}} and then some prose',
        "The answer is {42}.",
        '{"title": "not a call"}',
    ],
)
def test_llama3_malformed_is_plain_text(text: str) -> None:
    out = llama.parse(text)
    assert out.content == text and out.tool_calls == []


def test_streaming_sends_text_before_a_call_and_holds_the_call() -> None:
    stream = ToolStream(ToolMode(hermes))
    pieces = ["Sure", ", one", " moment <to", "ol_call>", '{"name": "f", ', '"arguments": {}}']
    sent = "".join(stream.feed(p) for p in [*pieces, "</tool_call>"])
    assert sent == "Sure, one moment "
    rest = stream.finish()
    assert rest.content is None and [c.name for c in rest.tool_calls] == ["f"]


def test_streaming_a_false_alarm_is_sent_once_it_cannot_be_a_call() -> None:
    stream = ToolStream(ToolMode(hermes))
    assert stream.feed("a <to") == "a "
    assert stream.feed("ken> b") == "<token> b"
    assert stream.finish().content is None


def test_parallel_off_keeps_the_first_call_and_a_bad_reply_is_content() -> None:
    mode = ToolMode(hermes, None, parallel=False)
    two = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>' * 2
    out = mode.parse(two)
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("f", {"a": 1})]
    broken = mode.parse("<tool_call>oops")
    assert broken.tool_calls == [] and broken.content == "<tool_call>oops"


def test_parser_is_chosen_from_the_template_or_the_flag() -> None:
    qwen_like = (
        "{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}<tool_call>{% endif %}"
    )
    assert type(tool_support(qwen_like, None).parser) is HermesParser
    llama_like = '{% if tools %}Respond as {"name": ..., "parameters": ...}{% endif %}'
    assert type(tool_support(llama_like, None).parser) is Llama3JsonParser
    assert type(tool_support(qwen_like, "llama3_json").parser) is Llama3JsonParser
    unknown = tool_support("{{ tools }}", None)
    assert unknown.parser is None and "--tool-call-parser" in (unknown.reason or "")
    plain = tool_support("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes")
    assert plain.parser is None and "does not render tools" in (plain.reason or "")
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        tool_support(qwen_like, "mistral")
    assert set(PARSERS) == {"hermes", "llama3_json"}


def _deep(levels: int) -> str:
    return '{"a": ' * levels + "1" + "}" * levels


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "a", "arguments": ' + "[" * 50_000 + "</tool_call>",
        '<tool_call>{"name": "a", "arguments": ' + _deep(900) + "}</tool_call>",
        '<tool_call>{"name": "a", "arguments": ' + _deep(100) + "}</tool_call>",  # < 1000
        '<tool_call>{"name": "a", "arguments": ' + json.dumps("[" * 50_000) + "}</tool_call>",
        '<tool_call>{"name": "a", "arguments": ' + json.dumps(_deep(900)) + "}</tool_call>",
    ],
)
def test_hermes_deeply_nested_output_is_plain_text_and_never_raises(text: str) -> None:
    """Python's JSON decoder recurses once per level: a model writing `[` 50,000 times used
    to raise RecursionError out of a parser that promises never to raise."""
    out = hermes.parse(text)
    assert out.content == text and out.tool_calls == []
    stream = ToolStream(ToolMode(hermes))
    stream.feed(text)
    assert stream.finish().tool_calls == []


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "a", "parameters": ' + "[" * 50_000,
        '{"name": "a", "parameters": ' + _deep(900) + "}",
        '{"name": "a", "parameters": ' + _deep(100) + "}",
        '{"name": "a", "parameters": ' + json.dumps("{" * 50_000) + "}",
    ],
)
def test_llama3_deeply_nested_output_is_plain_text_and_never_raises(text: str) -> None:
    out = llama.parse(text)
    assert out.content == text and out.tool_calls == []


def test_nesting_up_to_the_cap_is_still_a_call() -> None:
    from pagedkv.server.nesting import MAX_JSON_DEPTH

    # The call object is level 1, so arguments of MAX_JSON_DEPTH - 1 levels reach the cap.
    args = _deep(MAX_JSON_DEPTH - 1)
    out = hermes.parse('<tool_call>{"name": "a", "arguments": ' + args + "}</tool_call>")
    assert [json.loads(c.arguments) for c in out.tool_calls] == [json.loads(args)]
    too_deep = _deep(MAX_JSON_DEPTH)
    out = hermes.parse('<tool_call>{"name": "a", "arguments": ' + too_deep + "}</tool_call>")
    assert out.tool_calls == []
