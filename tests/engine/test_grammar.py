"""Structured outputs in the engine: a random tiny model writes garbage, but under a
JSON schema's grammar the garbage always parses and validates, it ends (the schemas
bound their strings, numbers and arrays), and cached == fresh still holds."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv import CacheConfig, Engine, SamplingParams
from pagedkv.engine.grammar import GrammarError, ResponseFormat

PROMPT = "Write a JSON record of a cache block, its hash and its tokens."


@pytest.fixture(scope="module")
def engine(tiny_qwen2_dir: Path) -> Iterator[Engine]:
    with Engine.from_pretrained(str(tiny_qwen2_dir), config=CacheConfig(block_size=8)) as eng:
        yield eng


# -- a reference validator for the subset the property test draws ------------------


def validate(value: Any, schema: dict[str, Any]) -> None:
    """Raise AssertionError unless `value` matches `schema` (the subset drawn below)."""
    if "enum" in schema:
        assert value in schema["enum"], (value, schema)
        return
    kind = schema["type"]
    if kind == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", 10**9)
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool)
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value)
    elif kind == "boolean":
        assert isinstance(value, bool)
    elif kind == "array":
        assert isinstance(value, list) and len(value) <= schema.get("maxItems", 10**9)
        for item in value:
            validate(item, schema["items"])
    else:
        assert kind == "object" and isinstance(value, dict)
        props = schema["properties"]
        assert set(schema.get("required", ())) <= set(value), (value, schema)
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props), (value, schema)
        for key, item in value.items():
            if key in props:
                validate(item, props[key])


leaf = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-50, 50),
        st.integers(0, 500),
    ),
    st.just({"type": "boolean"}),
    st.builds(
        lambda vals: {"type": "string", "enum": vals},
        st.lists(
            st.sampled_from(["red", "green", "blue", "a b", 'q"uote']),
            min_size=1,
            max_size=3,
            unique=True,
        ),
    ),
)
prop = st.one_of(
    leaf,
    st.builds(
        lambda item, n: {"type": "array", "items": item, "maxItems": n}, leaf, st.integers(0, 2)
    ),
)


@st.composite
def object_schemas(draw: st.DrawFn) -> dict[str, Any]:
    names = draw(
        st.lists(
            st.sampled_from(["id", "name", "ok", "tags", "size", "kind"]),
            min_size=1,
            max_size=4,
            unique=True,
        )
    )
    props = {n: draw(prop) for n in names}
    required = draw(st.lists(st.sampled_from(names), unique=True))
    return {
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": False,
    }


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(schema=object_schemas(), seed=st.integers(0, 2**16), greedy=st.booleans())
def test_structured_output_parses_and_validates(
    engine: Engine, schema: dict[str, Any], seed: int, greedy: bool
) -> None:
    params = SamplingParams(
        max_tokens=400,
        temperature=0.0 if greedy else 1.0,
        seed=seed,
        response_format=ResponseFormat.json_schema(schema),
    )
    result = engine.generate(PROMPT, params)
    assert result.finish_reason == "stop", (schema, result.text)  # bounded: it must end
    validate(json.loads(result.text), schema)


def test_n_samples_each_follow_their_own_grammar(engine: Engine) -> None:
    schema = {
        "type": "object",
        "properties": {
            "word": {"type": "string", "maxLength": 5},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["word", "n"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        max_tokens=200,
        temperature=1.0,
        seed=7,
        n=4,
        response_format=ResponseFormat.json_schema(schema),
    )
    results = engine.generate_n(PROMPT, params)
    assert len({r.text for r in results}) > 1  # sampled apart, each valid
    for r in results:
        assert r.finish_reason == "stop"
        validate(json.loads(r.text), schema)


def test_json_object_output_is_an_object(engine: Engine) -> None:
    for seed in range(3):
        params = SamplingParams(
            max_tokens=300, temperature=1.0, seed=seed, response_format=ResponseFormat.json_object()
        )
        result = engine.generate(PROMPT, params)
        if result.finish_reason == "stop":
            assert isinstance(json.loads(result.text), dict)
        else:  # the random model nests on: what it wrote is still the start of an object
            assert result.text.startswith("{")


def test_unconstrained_output_is_not_json(engine: Engine) -> None:
    """The grammar is what makes the outputs above JSON: without it the same model
    writes text that does not parse."""
    result = engine.generate(PROMPT, SamplingParams(max_tokens=30, temperature=1.0, seed=1))
    with pytest.raises(json.JSONDecodeError):
        json.loads(result.text)


def test_cached_equals_fresh_with_a_grammar(engine: Engine, tiny_qwen2_dir: Path) -> None:
    schema = {
        "type": "object",
        "properties": {"text": {"type": "string", "maxLength": 12}},
        "required": ["text"],
    }
    params = SamplingParams(
        max_tokens=100, response_format=ResponseFormat.json_schema(schema), logprobs=True
    )
    first = engine.generate(PROMPT, params)
    second = engine.generate(PROMPT, params)
    assert second.cached_tokens > 0
    assert second.token_ids == first.token_ids and second.text == first.text
    with Engine.from_pretrained(
        str(tiny_qwen2_dir), config=CacheConfig(enable_prefix_caching=False)
    ) as off:
        assert off.generate(PROMPT, params).token_ids == first.token_ids


def test_a_schema_that_cannot_compile_is_refused_before_it_runs(engine: Engine) -> None:
    with pytest.raises(GrammarError, match="strin"):
        ResponseFormat.json_schema({"type": "strin"})
    with pytest.raises(GrammarError, match="nope"):
        ResponseFormat.json_schema({"$ref": "#/definitions/nope"})
    with pytest.raises(GrammarError, match="JSON object"):
        ResponseFormat.json_schema([1, 2])
