"""Sampling fields and top_logprobs through a real server and the `openai` client."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from server_proc import ServerProc, running, server_model_dir, start_server

pytestmark = pytest.mark.slow
__all__ = ["server_model_dir"]  # a fixture, used by name

MODEL = "tiny"
GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}
HI = [{"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def server(server_model_dir: Path) -> Iterator[ServerProc]:
    yield from running(start_server(server_model_dir))


@pytest.fixture(scope="module")
def client(server: ServerProc) -> openai.OpenAI:
    return server.client()


def _check_chat_tops(content: list[Any], k: int) -> None:
    for item in content:
        assert len(item.top_logprobs) == k
        values = [t.logprob for t in item.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert all(t.bytes == list(t.token.encode()) for t in item.top_logprobs)
        # Greedy: the sampled token is the most likely one, with the same logprob.
        assert math.isclose(values[0], item.logprob, abs_tol=1e-5)
    assert sum(math.exp(t.logprob) for t in content[0].top_logprobs) <= 1.0 + 1e-5


def test_chat_top_logprobs_streamed_and_not(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"max_tokens": 6, "logprobs": True, "top_logprobs": 5, **GREEDY}
    whole = client.chat.completions.create(model=MODEL, messages=HI, **kw)
    lp = whole.choices[0].logprobs
    assert lp is not None and lp.content is not None and len(lp.content) == 6
    _check_chat_tops(lp.content, 5)
    chunks = list(client.chat.completions.create(model=MODEL, messages=HI, stream=True, **kw))
    streamed = [
        item
        for c in chunks
        if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.content
        for item in c.choices[0].logprobs.content
    ]
    assert len(streamed) == 6
    _check_chat_tops(streamed, 5)
    for a, b in zip(streamed, lp.content, strict=True):
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]
        assert [t.logprob for t in a.top_logprobs] == pytest.approx(
            [t.logprob for t in b.top_logprobs]
        )
    # logprobs without top_logprobs: the sampled token's only, as before.
    plain = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=3, logprobs=True, **GREEDY
    )
    assert plain.choices[0].logprobs is not None and plain.choices[0].logprobs.content
    assert all(t.top_logprobs == [] for t in plain.choices[0].logprobs.content)


def test_completion_logprobs_k_streamed_and_not(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"max_tokens": 5, "logprobs": 3, **GREEDY}
    whole = client.completions.create(model=MODEL, prompt="The cache", **kw)
    lp = whole.choices[0].logprobs
    assert lp is not None and lp.top_logprobs is not None and lp.token_logprobs is not None
    assert len(lp.top_logprobs) == len(lp.token_logprobs) == 5
    for top, sampled in zip(lp.top_logprobs, lp.token_logprobs, strict=True):
        assert 1 <= len(top) <= 3
        assert math.isclose(max(top.values()), sampled, abs_tol=1e-5)  # greedy
    chunks = list(client.completions.create(model=MODEL, prompt="The cache", stream=True, **kw))
    tops = [
        top
        for c in chunks
        if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.top_logprobs
        for top in c.choices[0].logprobs.top_logprobs
    ]
    assert [list(t) for t in tops] == [list(t) for t in lp.top_logprobs]
    zero = client.completions.create(model=MODEL, prompt="The cache", max_tokens=2, logprobs=0)
    assert zero.choices[0].logprobs is not None and zero.choices[0].logprobs.top_logprobs is None


def test_penalties_change_output_and_are_cached_exactly(client: openai.OpenAI) -> None:
    # A fixed prompt (not a random one) on which the tiny model's greedy answer repeats
    # a token within 24, so each penalty has something to act on; no other test sends it.
    prompt = [{"role": "user", "content": "[penalties-1] " + "cache the fox " * 12}]

    def ask(**extra: Any) -> Any:
        return client.chat.completions.create(
            model=MODEL,
            messages=prompt,
            max_tokens=24,
            temperature=0,
            extra_body={"ignore_eos": True, **extra},
        )

    plain = ask()
    first = ask(repetition_penalty=2.0)
    second = ask(repetition_penalty=2.0)
    assert first.choices[0].message.content != plain.choices[0].message.content
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert (second.usage.prompt_tokens_details.cached_tokens or 0) > 0
    assert second.choices[0].message.content == first.choices[0].message.content
    for field, value in (("presence_penalty", 2.0), ("frequency_penalty", 2.0)):
        r = client.chat.completions.create(
            model=MODEL, messages=prompt, max_tokens=24, **{field: value}, **GREEDY
        )
        assert r.choices[0].message.content != plain.choices[0].message.content, field


def test_logit_bias_and_stop_token_ids(client: openai.OpenAI, server_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(server_model_dir)
    token = tokenizer.encode("x", add_special_tokens=False)[-1]
    r = client.completions.create(
        model=MODEL, prompt="The cache", max_tokens=4, logit_bias={str(token): 100}, **GREEDY
    )
    assert r.choices[0].text == tokenizer.decode([token]) * 4
    stopped = client.completions.create(
        model=MODEL,
        prompt="The cache",
        max_tokens=8,
        logit_bias={str(token): 100},
        temperature=0,
        extra_body={"stop_token_ids": [token]},
    )
    assert stopped.usage is not None and stopped.usage.completion_tokens == 1
    assert stopped.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
        ({"min_tokens": 4}, "min_tokens"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"logit_bias": {"1": 200}}, "logit_bias.1"),
        ({"logit_bias": {"100000": 1}}, "logit_bias"),
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ],
)
def test_refused_fields_name_the_field(
    client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, extra_body=extra)
    assert err.value.param == param
