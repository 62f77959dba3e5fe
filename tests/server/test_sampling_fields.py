"""A request's sampling fields to SamplingParams: the model's defaults fill the fields a
request leaves out, and a greedy request takes none of them."""

from __future__ import annotations

from typing import Any

import pytest

from pagedkv.model.generation_defaults import SamplingDefaults
from pagedkv.server.http_errors import APIError
from pagedkv.server.prepare import check_supported, sampling_params
from pagedkv.server.protocol import ChatCompletionRequest, CompletionRequest

RECOMMENDED = SamplingDefaults(
    temperature=0.2, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.2, source="test"
)


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **fields}
    )


def values(body: Any, defaults: SamplingDefaults | None = RECOMMENDED) -> tuple[Any, ...]:
    p = sampling_params(body, 8, False, defaults, 500)
    return (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty)


def test_left_out_fields_take_the_models_defaults() -> None:
    assert values(chat()) == (0.2, 0.9, 40, 0.05, 1.2)
    assert values(chat(temperature=0.8, top_k=0)) == (0.8, 0.9, 0, 0.05, 1.2)
    assert values(chat(top_p=1.0, min_p=0.0, repetition_penalty=1.0)) == (0.2, 1.0, 40, 0.0, 1.0)
    # Without recommendations: OpenAI's temperature 1 and everything else off.
    assert values(chat(), SamplingDefaults()) == (1.0, 1.0, 0, 0.0, 1.0)


@pytest.mark.parametrize("greedy", [{"temperature": 0}, {"top_p": 0}])
def test_a_greedy_request_takes_no_default(greedy: dict[str, float]) -> None:
    assert values(chat(**greedy)) == (0.0, 1.0, 0, 0.0, 1.0)
    # What the request itself asks for still applies.
    assert values(chat(**greedy, repetition_penalty=1.5)) == (0.0, 1.0, 0, 0.0, 1.5)


def test_penalties_bias_and_top_logprobs_reach_the_sampler() -> None:
    p = sampling_params(
        chat(presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={"7": -100}, top_logprobs=4),
        8,
        True,
        None,
        500,
    )
    assert (p.presence_penalty, p.frequency_penalty, dict(p.logit_bias)) == (0.5, -0.5, {7: -100})
    assert p.top_logprobs == 4 and p.logprobs
    completion = CompletionRequest.model_validate({"prompt": "x", "logprobs": 3})
    assert sampling_params(completion, 8, True, None, 500).top_logprobs == 3


@pytest.mark.parametrize(
    "body, param",
    [
        (chat(top_logprobs=2), "top_logprobs"),
        (chat(min_tokens=1), "min_tokens"),
        (chat(length_penalty=2.0), "length_penalty"),
        (chat(function_call="auto"), "function_call"),
        (CompletionRequest.model_validate({"prompt": "x", "echo": True}), "echo"),
    ],
)
def test_unsupported_fields_are_refused_by_name(body: Any, param: str) -> None:
    with pytest.raises(APIError) as err:
        check_supported(body)
    assert err.value.param == param
