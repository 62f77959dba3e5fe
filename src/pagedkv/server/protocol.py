"""OpenAI wire format: request and response models for the server.

Requests are validated strictly (no "5" for 5, no 1.5 for an int) and unknown
fields are ignored, as most OpenAI-compatible servers do, so clients that send
newer fields keep working. Every sampling field OpenAI or vLLM defines is declared
here: honoured, or parsed and refused by the app with a 400 that names the field
and says why (`detail` of an image part, `echo`, `suffix`, `best_of`, beam search...), never
silently dropped; the OpenAPI schema documents only the values that are served.
The list, field by field, is docs/usage.md's "Sampling fields".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr

if TYPE_CHECKING:
    from pagedkv.model.images import ImageInput

INT32_MAX = 2**31 - 1
INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1


def _encodable(text: str) -> str:
    # Lone surrogates ("\ud800") survive JSON decoding but not the tokenizer.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"text is not valid Unicode: {exc.reason} at {exc.start}") from None
    return text


Text = Annotated[str, AfterValidator(_encodable)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
StopText = Annotated[Text, Field(min_length=1, max_length=1000)]


def _ONLY(value: int) -> dict[str, Any]:
    """Schema bounds for a field whose other values are refused with a clear 400 by the app."""
    return {"minimum": value, "maximum": value}


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    """`response_format.json_schema`: the output must validate against `schema`.
    `strict` is accepted either way: the schema is always enforced as written."""

    name: Text = Field(min_length=1, max_length=64)
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormatIn(_Request):
    """OpenAI's `response_format`; the app refuses types other than the three below."""

    type: str = Field(json_schema_extra={"enum": ["text", "json_object", "json_schema"]})
    json_schema: JsonSchemaFormat | None = None


class _SamplingRequest(_Request):
    """Fields shared by completions and chat completions. A top-level field not
    defined here is kept (`extra="allow"`) only for the route to refuse it by name
    (`unknown_fields.py`): a field the server cannot honour is refused, not ignored."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="extension; 0 or -1 turns it off")
    seed: int | None = Field(None, ge=INT64_MIN, le=UINT64_MAX)
    stop: StopText | list[StopText] | None = Field(None, max_length=16)
    n: int = Field(1, ge=1, le=64, description="choices: samples that share the prompt's KV")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(
        None, gt=0.0, le=100.0, description="extension (vLLM); 1 turns it off"
    )
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="extension (vLLM); 0 is off")
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, max_length=1024, description="token id (as a string) -> bias added to its logit"
    )
    stop_token_ids: list[TokenId] | None = Field(
        None, max_length=64, description="extension (vLLM); stop after any of these tokens"
    )
    user: str | None = Field(None, description="accepted as metadata; it changes nothing")
    ignore_eos: bool = Field(False, description="extension; generate max_tokens tokens")
    response_format: ResponseFormatIn | None = None
    # vLLM's sampling extensions this server does not implement: refused unless off.
    min_tokens: int = Field(0, ge=0, json_schema_extra=_ONLY(0))
    use_beam_search: bool = Field(False, json_schema_extra={"enum": [False]})
    length_penalty: float = Field(1.0, json_schema_extra=_ONLY(1))
    prompt_logprobs: int | None = Field(None, json_schema_extra={"maxProperties": 0})
    allowed_token_ids: list[int] | None = Field(None, json_schema_extra={"maxItems": 0})
    bad_words: list[str] | None = Field(None, json_schema_extra={"maxItems": 0})
    cache_salt: Text | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="extension; isolates this request's cached prefixes further",
    )
    prompt_cache_key: Text | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="groups a client's requests; names the lease in GET /v1/cache/leases",
    )
    prompt_cache_retention: Literal["in_memory", "24h"] | None = Field(
        None,
        description="lease the whole prompt: in_memory (5 min, RAM only) or 24h (every tier)",
    )


class CompletionRequest(_SamplingRequest):
    prompt: Text | list[TokenId] | list[Text] | list[list[TokenId]]
    logprobs: int | None = Field(
        None, ge=0, le=20, description="the sampled token's logprob and the k most likely"
    )
    echo: bool = Field(False, json_schema_extra={"enum": [False]})
    suffix: str | None = Field(None, json_schema_extra={"maxLength": 0})
    best_of: int | None = Field(None, ge=1, json_schema_extra=_ONLY(1))


class ImageURL(_Request):
    # Optional here so that a missing url is the app's 400 naming it, not a union error.
    model_config = ConfigDict(json_schema_extra={"required": ["url"]})

    url: str | None = Field(
        None,
        description="data:image/png;base64,... (PNG, JPEG or WebP); http(s) URLs only when "
        "the server runs with --allow-remote-images",
    )
    detail: str | None = Field(
        None, json_schema_extra={"enum": ["auto"]}, description="only 'auto' is served"
    )


class ContentPart(_Request):
    """A part of a message's content: text, or an image (`server/images/`). The route
    attaches the decoded image (`image`), and `source_param` names the field an
    Anthropic image block's data came from, for its errors; neither is on the wire."""

    # The schema documents what is served; other part types get a 400 that names them.
    model_config = ConfigDict(json_schema_extra={"required": ["type"]})

    type: str = Field(json_schema_extra={"enum": ["text", "image_url"]})
    text: Text | None = None
    image_url: ImageURL | None = None
    _image: ImageInput | None = PrivateAttr(None)
    _source_param: str | None = PrivateAttr(None)

    @property
    def image(self) -> ImageInput | None:
        return self._image

    @image.setter
    def image(self, image: ImageInput) -> None:
        self._image = image

    @property
    def source_param(self) -> str | None:
        return self._source_param

    @source_param.setter
    def source_param(self, param: str) -> None:
        self._source_param = param


class FunctionCall(_Request):
    name: Text = Field(min_length=1)
    arguments: Text = Field(description="the JSON text of an object")


class ToolCallIn(_Request):
    """A call an earlier assistant turn made, sent back as history."""

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    model_config = ConfigDict(json_schema_extra={"required": ["role"]})

    role: Literal["system", "developer", "user", "assistant", "tool", "function"] = Field(
        json_schema_extra={"enum": ["system", "developer", "user", "assistant", "tool"]}
    )
    content: Text | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: Text | None = None


class FunctionDef(_Request):
    name: Text = Field(min_length=1, max_length=64)
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: Text = Field(min_length=1)


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20, description="needs logprobs: true")
    tools: list[ToolDef] | None = Field(None, max_length=512)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # Metadata: accepted so that clients sending them work; none changes the output.
    store: bool | None = Field(None, description="accepted; nothing is stored")
    metadata: dict[str, str] | None = Field(None, description="accepted; it changes nothing")
    service_tier: str | None = Field(None, description="accepted; every request is served alike")
    # The deprecated function-calling fields: refused, with a pointer to tools.
    functions: list[dict[str, Any]] | None = Field(None, json_schema_extra={"maxItems": 0})
    function_call: str | dict[str, Any] | None = Field(None, json_schema_extra={"enum": [None]})


# -- responses ---------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# The error answers an OpenAPI operation documents (`responses=ERRORS`).
ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 403, 404, 413, 429, 503)
}


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedkv"
    max_model_len: int | None = None
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class HealthResponse(BaseModel):
    status: str
    model: str
    active_requests: int
