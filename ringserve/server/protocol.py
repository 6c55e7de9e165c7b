"""Request and response bodies of the OpenAI API (the fields ringserve serves), as pydantic models."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_serializer,
    model_validator,
)

logger = logging.getLogger(__name__)

_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1
MAX_STOP_STRINGS = 64
MAX_STOP_TOKEN_IDS = 256


def _integral_floats_to_ints(value: Any) -> Any:
    # JSON has one number type: 3.0 is the integer 3, as JSON Schema reads it (a float field
    # takes the int as well; 3.5 stays a float and fails an integer field)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _integral_floats_to_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_integral_floats_to_ints(v) for v in value]
    return value


def lone_surrogate(value: Any, where: str = "") -> str | None:
    """Where the first string holding a lone UTF-16 surrogate is (JSON's "\\ud800" escapes
    decode to one; no tokenizer can encode it), as "messages.0.content"; None if nowhere."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where or "body"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = lone_surrogate(item, f"{where}.{key}" if where else str(key))
        if found:
            return found
    return None


def _json_shape(value: Any) -> str:
    if not isinstance(value, list):
        return "text"
    first = value[0] if value else None
    if isinstance(first, list):
        return "lists"
    if isinstance(first, (dict, str)):
        return "items"
    return "ids"


def _by_shape(**alternatives: Any) -> Any:
    """A union whose alternative is picked by the value's JSON shape (text, list of items,
    of token ids, of lists), so that a bad value is told what is wrong with it there, not
    that it fails every other alternative. The schema lists the alternatives as oneOf."""

    def shape(value: Any) -> str:
        tag = _json_shape(value)
        return tag if tag in alternatives else "items"

    tagged = tuple(Annotated[t, Tag(name)] for name, t in alternatives.items())
    return Annotated[Union[tagged], Discriminator(shape)]  # noqa: UP007 - a tuple of types


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
# text, texts, token ids or lists of token ids; a list is never empty (the text may be:
# with a model that adds a BOS token, it is a prompt)
Prompt = _by_shape(
    text=str,
    items=Annotated[list[str], Field(min_length=1)],
    ids=TokenIds,
    lists=Annotated[list[TokenIds], Field(min_length=1)],
)


# OpenAI takes 4 stop strings and vLLM any number; each is looked for after every token on
# the engine's thread, so a bound keeps one request from slowing every other
StopStrings = _by_shape(text=str, items=Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)])


def _null_extras_schema(schema: dict[str, Any]) -> None:
    # what _Body takes besides its fields: null, and nothing else (see _Body)
    schema["additionalProperties"] = {"type": "null"}


class _Body(BaseModel):
    """A request body (or a part of one). strict: the JSON types the schema declares, as
    OpenAI checks them (no "5" or true for an integer, no 1 for a boolean), so a mistyped
    field is a 400 naming it; no NaN / inf.

    A field the model does not declare is a 400 naming it (extra="forbid"), unlike vLLM,
    which ignores it with a warning: a client that asks for something ringserve does not do
    (tools, response_format, audio, ...) must hear so, not get an answer made without it.
    Declaring a field is therefore all it takes to accept it. The one exception is null: in
    OpenAI's API a null field is an unset one, it asks for nothing, and clients send such
    nulls (an assistant message read back from a response carries "tool_calls": null), so
    an undeclared field whose value is null is dropped."""

    model_config = ConfigDict(
        strict=True, allow_inf_nan=False, extra="forbid", json_schema_extra=_null_extras_schema
    )

    @model_validator(mode="before")
    @classmethod
    def _json_numbers(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = set(cls.model_fields)
            known.update(f.alias for f in cls.model_fields.values() if f.alias)
            data = {k: v for k, v in data.items() if v is not None or k in known}
        return _integral_floats_to_ints(data)

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        # JSON's "\\ud800" escape decodes to a lone surrogate, which no tokenizer can encode:
        # refused here, naming the field, not a 500 from inside the tokenizer
        if (where := lone_surrogate(value)) is not None:
            inside = "" if where == "body" else f" (at {where})"
            raise ValueError(f"the text is not valid Unicode{inside}: it holds a lone surrogate")
        return value


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced, strict or not


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's structured_outputs field: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False


class SamplingFields(_Body):
    model: str | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=_INT64_MIN, le=_UINT64_MAX)
    stop: StopStrings | None = None
    # each is looked for after every token, so bounded as the stop strings are
    stop_token_ids: (
        Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None
    ) = None
    n: int = Field(1, ge=1, le=128)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    # OpenAI's JSON keys are strings: token ids, checked against the vocabulary by the engine
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling fields
    repetition_penalty: float | None = Field(None, gt=0)
    min_p: float | None = Field(None, ge=0, le=1)
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # bounded as the stop strings: each is matched against the output at every step
    bad_words: Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    best_of: int | None = Field(None, ge=1)
    user: str | None = None
    # Structured output: OpenAI's response_format, vLLM's structured_outputs, or vLLM's
    # older guided_* fields; one of them at a time
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM's extra field


class TextPart(_Body):
    type: Literal["text"]
    text: str


MessageContent = _by_shape(text=str, items=list[TextPart])  # a string, or text parts as OpenAI allows


class FunctionCallParam(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallParam(_Body):
    """A call the assistant made, in a conversation sent back."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: MessageContent | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionDefinition(_Body):
    # OpenAI's rule for a function's name
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of its arguments object
    strict: bool | None = None  # forced choices always follow the schema, strict or not


class ChatTool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None: true, as OpenAI
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Metadata: OpenAI's fields that label a request or hint at its routing and change
    # nothing in the answer; accepted and not acted on (README lists them). Bounds as OpenAI's.
    metadata: (
        Annotated[
            dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
            Field(max_length=16),
        ]
        | None
    ) = None
    safety_identifier: str | None = Field(None, max_length=64)
    prompt_cache_key: str | None = None  # ringserve's prefix cache needs no key
    # one tier here: what "auto" and "default" ask for; "flex" or "priority" would ask for
    # processing ringserve does not offer
    service_tier: Literal["auto", "default"] | None = None
    # store: true asks OpenAI to keep the completion for its evals and distillation
    # products; ringserve keeps nothing, so only false is taken
    store: bool | None = None  # (a Literal[False] would take 0, which equals False)

    @field_validator("store")
    @classmethod
    def _stores_nothing(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("ringserve does not store completions: leave store out, or false")
        return value


# Responses --------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's Logprob: one token's entry at a prompt position."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's extra field: per prompt token, None first, then {token id: entry} for the
    # prompt token and the likeliest ones (in the first streamed chunk of a choice).
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def _without_none(data: dict, keys: tuple[str, ...]) -> dict:
    return {k: v for k, v in data.items() if not (k in keys and v is None)}


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # null when the message is tool calls only, as OpenAI
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None  # gpt-oss's analysis channel, as vLLM names it

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):  # no "tool_calls": null in a plain answer
        return _without_none(handler(self), ("tool_calls", "reasoning_content"))


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaFunction(BaseModel):
    name: str | None = None  # in a call's first delta only
    arguments: str | None = None  # the next fragment of the arguments' JSON text

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return _without_none(handler(self), ("name", "arguments"))


class DeltaToolCall(BaseModel):
    """A streamed call: its first delta carries id, type and name, later ones arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return _without_none(handler(self), ("id", "type"))


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):  # {"content": "..."} as OpenAI sends it, no "role": null
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "ringserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ParallelLayout(BaseModel):
    tp: int
    cp: int
    ep: int
    dp: int = 1  # data-parallel replicas


class VersionInfo(BaseModel):
    version: str
    parallel: ParallelLayout  # the engine's layout, so a benchmark result says what it measured


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None  # the request field at fault, when one is
    code: int  # the HTTP status, as vLLM


class ErrorResponse(BaseModel):
    error: ErrorInfo


_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestEntityTooLargeError",
    415: "UnsupportedMediaTypeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    info = ErrorInfo(message=message, type=_ERROR_TYPES.get(status, "Error"), param=param, code=status)
    return ErrorResponse(error=info).model_dump()


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
