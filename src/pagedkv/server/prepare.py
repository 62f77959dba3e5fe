"""From a validated OpenAI request to what the engine takes: prompt and SamplingParams.

Everything here is pure and raises `APIError(400)` naming the offending field;
the app does the blocking parts (tokenizing, the chat template) on a thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedkv.engine.defaults import resolve_sampling
from pagedkv.engine.grammar import GrammarError, ResponseFormat
from pagedkv.engine.sampling import SamplingParams
from pagedkv.model.generation_defaults import SamplingDefaults
from pagedkv.server.http_errors import APIError, bad_request
from pagedkv.server.images.request import IMAGE_PART, image_content
from pagedkv.server.protocol import ChatCompletionRequest, CompletionRequest, _SamplingRequest
from pagedkv.server.tools.output import ToolMode
from pagedkv.server.tools.request import history_tool_calls

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default, when the model recommends none; greedy is 0

# Fields the schema accepts but this server does not implement, refused unless they
# hold their "off" value: (name, off value, why).
_UNSUPPORTED: tuple[tuple[str, object, str], ...] = (
    ("min_tokens", 0, "min_tokens is not supported; send 0 or leave it out"),
    ("use_beam_search", False, "beam search is not supported"),
    ("length_penalty", 1.0, "length_penalty (beam search) is not supported"),
    ("prompt_logprobs", None, "prompt_logprobs is not supported; leave it out"),
    ("allowed_token_ids", None, "allowed_token_ids is not supported; use logit_bias"),
    ("bad_words", None, "bad_words is not supported; use logit_bias"),
)


def check_supported(body: _SamplingRequest) -> None:
    """Refuse fields the schema accepts but this server cannot honour."""
    for name, off, why in _UNSUPPORTED:
        if getattr(body, name) != off:
            raise bad_request(why, name)
    if isinstance(body, CompletionRequest):
        if body.echo:
            raise bad_request("echo is not supported", "echo")
        if body.suffix:
            raise bad_request("suffix (insertion) is not supported", "suffix")
        if body.best_of not in (None, 1):
            raise bad_request("best_of > 1 is not supported", "best_of")
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        for name in ("functions", "function_call"):
            if getattr(body, name) is not None:
                raise bad_request(
                    f"{name} (the deprecated function-calling form) is not supported; "
                    "send tools and tool_choice",
                    name,
                )


def completion_prompt(body: CompletionRequest) -> str | list[int]:
    """The single prompt of a completion request. Batches of several are refused."""
    prompt = body.prompt
    if isinstance(prompt, str):
        return prompt
    if prompt and all(isinstance(p, int) for p in prompt):
        return list(prompt)  # type: ignore[arg-type]
    if len(prompt) > 1:
        raise bad_request(
            f"batched prompts are not supported (got {len(prompt)}): send one "
            "prompt per request; concurrent requests are batched by the engine",
            "prompt",
        )
    if not prompt:
        raise bad_request("the prompt is empty", "prompt")
    only = prompt[0]
    if isinstance(only, str):
        return only
    if isinstance(only, list):
        return list(only)
    raise bad_request("the prompt must be a string or a list of token ids", "prompt")


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: role and plain-text content, plus an
    assistant turn's `tool_calls` and a tool result's `tool_call_id`. A message holding
    images (attached by `images.attach_images`) has a list of text and image parts
    instead (`images.image_content`)."""
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(body.messages):
        if msg.role == "function":
            raise bad_request(
                f"messages[{i}]: role 'function' is the deprecated form; send the result "
                "as role 'tool' with its tool_call_id",
                f"messages[{i}].role",
            )
        content: Any = msg.content
        if isinstance(content, list) and any(p.type == IMAGE_PART for p in content):
            content = image_content(content, i)
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                param = f"messages[{i}].content[{j}]"
                if part.type != "text":
                    raise bad_request(
                        f"{param}: content parts of type {part.type!r} are not "
                        "supported; send 'text' or 'image_url'",
                        f"{param}.type",
                    )
                if part.text is None:
                    raise bad_request(f"{param}: a text part needs 'text'", f"{param}.text")
                texts.append(part.text)
            content = "\n".join(texts)
        if content is None:
            if msg.role != "assistant":
                raise bad_request(
                    f"messages[{i}]: content is required for role {msg.role!r}",
                    f"messages[{i}].content",
                )
            content = ""
        role = "system" if msg.role == "developer" else msg.role
        entry: dict[str, Any] = {"role": role, "content": content}
        if msg.tool_calls:
            if msg.role != "assistant":
                raise bad_request(
                    f"messages[{i}]: only assistant messages carry tool_calls",
                    f"messages[{i}].tool_calls",
                )
            entry["tool_calls"] = history_tool_calls(msg.tool_calls, f"messages[{i}].tool_calls")
        if msg.role == "tool" and msg.tool_call_id is not None:
            entry["tool_call_id"] = msg.tool_call_id
        out.append(entry)
    return out


def check_token_ids(ids: Sequence[int], vocab_size: int | None, param: str) -> None:
    if vocab_size is None:
        return
    for i, t in enumerate(ids):
        if t >= vocab_size:
            raise bad_request(
                f"token id {t} at position {i} is outside the model's vocabulary "
                f"(0..{vocab_size - 1})",
                param,
            )


def check_prompt_fits(num_prompt: int, max_context: int, param: str) -> None:
    """Refuse an empty prompt, and one that leaves no room in the context to generate
    (explain and count_tokens too: no request could be served with it)."""
    if num_prompt == 0:
        raise bad_request("the prompt is empty", param)
    if num_prompt >= max_context:
        raise APIError(
            400,
            f"the prompt has {num_prompt} tokens but the model's context is "
            f"{max_context} tokens, which leaves no room to generate; shorten the "
            "prompt",
            param=param,
            code="context_length_exceeded",
        )


def max_new_tokens(body: _SamplingRequest, num_prompt: int, max_context: int, param: str) -> int:
    """max_tokens checked against the context; when not given, all the context left."""
    asked = body.max_tokens
    asked_param = "max_tokens"
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        asked, asked_param = body.max_completion_tokens, "max_completion_tokens"
    check_prompt_fits(num_prompt, max_context, param)
    room = max_context - num_prompt
    if asked is None:
        return room
    if asked > room:
        raise APIError(
            400,
            f"the prompt has {num_prompt} tokens and {asked_param}={asked}: "
            f"{num_prompt + asked} tokens exceed the model's context of {max_context} "
            f"tokens; lower {asked_param} to at most {room} or shorten the prompt",
            param=asked_param,
            code="context_length_exceeded",
        )
    return asked


def response_format(body: _SamplingRequest, tools: ToolMode | None) -> ResponseFormat | None:
    """The grammar the output is generated under: `response_format`'s, or a required
    tool call's; None for free text."""
    fmt = body.response_format
    kind = "text" if fmt is None else fmt.type
    if tools is not None and tools.grammar is not None:
        if kind != "text":
            raise bad_request(
                f"response_format {kind!r} cannot be combined with a required tool call "
                "(tool_choice): the reply is the call; send one or the other",
                "response_format",
            )
        return tools.grammar
    if fmt is None or kind == "text":
        return None
    try:
        if kind == "json_object":
            return ResponseFormat.json_object()
        if kind == "json_schema":
            spec = fmt.json_schema
            if spec is None or spec.schema_ is None:
                raise bad_request(
                    "response_format of type 'json_schema' needs json_schema.schema",
                    "response_format.json_schema.schema",
                )
            return ResponseFormat.json_schema(spec.schema_, f"the JSON schema {spec.name!r}")
    except GrammarError as exc:
        raise bad_request(str(exc), "response_format.json_schema.schema") from exc
    raise bad_request(
        f"response_format type {kind!r} is not supported; send 'text', 'json_object' or "
        "'json_schema'",
        "response_format.type",
    )


def sampling_params(
    body: _SamplingRequest,
    max_tokens: int,
    logprobs: bool,
    defaults: SamplingDefaults | None = None,
    vocab_size: int | None = None,
    tools: ToolMode | None = None,
) -> SamplingParams:
    """The engine's SamplingParams; fields the request leaves out take the model's
    recommended `defaults` (none for a greedy request: `engine.defaults`), and the
    output follows `response_format` or a required tool call's grammar (`tools`)."""
    top_logprobs = 0
    if isinstance(body, ChatCompletionRequest):
        top_logprobs = body.top_logprobs or 0
    elif isinstance(body, CompletionRequest):
        top_logprobs = body.logprobs or 0
    chosen = resolve_sampling(
        defaults,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k if body.top_k is None or body.top_k > 0 else 0,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        fallback_temperature=DEFAULT_TEMPERATURE,
    )
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    stop_ids = list(body.stop_token_ids or ())
    check_token_ids(stop_ids, vocab_size, "stop_token_ids")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=chosen.temperature,
            top_p=chosen.top_p,
            top_k=chosen.top_k,
            min_p=chosen.min_p,
            repetition_penalty=chosen.repetition_penalty,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            logit_bias=logit_bias(body.logit_bias, vocab_size),
            seed=body.seed,
            stop=stop,
            stop_token_ids=stop_ids,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            ignore_eos=body.ignore_eos,
            n=body.n,
            response_format=response_format(body, tools),
        )
    except ValueError as exc:
        raise bad_request(str(exc)) from exc


def logit_bias(bias: dict[str, float] | None, vocab_size: int | None) -> dict[int, float]:
    """OpenAI's `logit_bias` (token ids as JSON object keys) with int keys."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        if not key.isascii() or not key.isdigit() or len(key) > 10:
            raise bad_request(
                f'logit_bias keys are token ids ("1234"), got {key[:40]!r}', "logit_bias"
            )
        out[int(key)] = value
    check_token_ids(list(out), vocab_size, "logit_bias")
    return out
