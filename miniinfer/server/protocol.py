"""The OpenAI API as our server speaks it, on pydantic models as vLLM, SGLang and the ``openai``
package itself define it: request bodies parsed straight from the raw bytes by pydantic-core's
JSON parser into the models below, responses and stream chunks built from models, and every
error as OpenAI's ``{"error": {"message", "type", "param", "code"}}``.

- Types are strict: a bool, a string or a fraction where an integer belongs is a 400, not a
  silent conversion (a float that is a whole number, ``8.0``, is the integer 8: JSON has one
  number type, and JSON Schema's ``integer`` includes it; the schema fuzzer found that we
  refused it); NaN and infinity are refused; invalid UTF-8 or a lone surrogate anywhere
  is invalid JSON, and so is nesting deeper than the parser's recursion limit.
- The sampling fields are vLLM's (``top_k``, ``min_p``, penalties, ``logit_bias``,
  ``stop_token_ids``, ``min_tokens``, ``ignore_eos``, ``n``, ``best_of``, ``logprobs``...), and
  all of them are implemented. A field nobody defines is accepted and logged once, as vLLM
  does (``strict_fields`` turns that into a 400). What we do not implement (tools, structured
  output, ``suffix``, ``echo`` with ``logprobs``) is refused by name, never silently ignored.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
    WithJsonSchema,
)
from pydantic_core import PydanticCustomError

from ..core.sampling import MAX_LOGPROBS, SEED_RANGE

logger = logging.getLogger("miniinfer.server")

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_CHOICES = 64  # n and best_of: each one is a request in the engine
MAX_STOP_STRINGS = 64  # OpenAI allows 4, vLLM any number; each is searched at every token
MAX_STOP_CHARS = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_PROMPTS = 1024  # a list of prompts on /v1/completions
MAX_UNKNOWN_FIELDS_LOGGED = 256  # distinct names; a client inventing names must not grow this


class APIError(Exception):
    """An error the client sees as OpenAI's JSON body with this HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


class OpenAIModel(BaseModel):
    """Strict types, no NaN or infinity, unknown fields kept (``model_extra``) to be logged."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


def _whole(value: float) -> int:
    if not value.is_integer():
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    return int(value)


def Int(ge: int | None = None, le: int | None = None) -> Any:  # noqa: N802 - a type
    """An integer field, ``ge <= value <= le``: a JSON integer, or a float that is a whole
    number (``8.0``: JSON Schema's ``integer`` includes it). The int form comes first, so a
    long list of token ids pays for nothing else."""
    bounds = {k: v for k, v in (("ge", ge), ("le", le)) if v is not None}
    published = {"type": "integer", **({"minimum": ge} if ge is not None else {}),
                 **({"maximum": le} if le is not None else {})}
    whole = Annotated[float, AfterValidator(_whole)]
    return Annotated[int | whole, Field(**bounds), WithJsonSchema(published)]


NonEmptyText = Annotated[str, Field(min_length=1)]
TokenId = Int(ge=0)
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


def _prompt_kind(value: Any) -> str:
    """Which form of prompt a value is, by its first element; only that form is validated
    (trying every form of a union on a long list of ids costs each form a full pass). The
    tags are no identifiers, so they never pass for a field name in an error's ``param``."""
    if isinstance(value, str):
        return "one-text"
    if isinstance(value, list) and value:
        if isinstance(value[0], str):
            return "many-texts"
        if isinstance(value[0], list):
            return "many-token-ids"
    return "one-token-ids"


# A string, token ids, or a list of either (several prompts, as vLLM and OpenAI take them).
Prompt = Annotated[
    Annotated[NonEmptyText, Tag("one-text")]
    | Annotated[TokenIds, Tag("one-token-ids")]
    | Annotated[list[NonEmptyText], Tag("many-texts"), Field(min_length=1, max_length=MAX_PROMPTS)]
    | Annotated[list[TokenIds], Tag("many-token-ids"),
                Field(min_length=1, max_length=MAX_PROMPTS)],
    Discriminator(_prompt_kind)]
StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class StreamOptions(OpenAIModel):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM: every chunk carries the usage so far


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]


class SamplingFields(OpenAIModel):
    """What both endpoints share. ``None`` is what a client sends for "not set"."""

    model: NonEmptyText
    max_tokens: Int(ge=1) | None = None
    max_completion_tokens: Int(ge=1) | None = None
    n: Int(ge=1, le=MAX_CHOICES) | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Int(ge=-1) | None = None  # vLLM: -1 and 0 mean no top-k
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]],
                          Field(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None = None
    seed: Int(ge=SEED_RANGE[0], le=SEED_RANGE[1]) | None = None
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_STRINGS)] | None = None
    ignore_eos: bool | None = None
    min_tokens: Int(ge=0) | None = None
    skip_special_tokens: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    return_token_ids: bool | None = None  # vLLM: each choice also carries its token ids


class CompletionRequest(SamplingFields):
    prompt: Prompt
    best_of: Int(ge=1, le=MAX_CHOICES) | None = None
    echo: bool | None = None
    logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = None
    suffix: str | None = None


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool | None = None
    top_logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool | None = None  # vLLM; default True


class TokenizeCompletionRequest(OpenAIModel):
    """vLLM's ``POST /tokenize`` with a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = None


class TokenizeChatRequest(OpenAIModel):
    """vLLM's ``POST /tokenize`` with chat messages (the chat template applied)."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool | None = None
    return_token_strs: bool | None = None


# /tokenize takes either form; a body with messages is the chat form.
TokenizeRequest = TypeAdapter(Annotated[
    Annotated[TokenizeChatRequest, Tag("chat")]
    | Annotated[TokenizeCompletionRequest, Tag("prompt")],
    Discriminator(lambda v: "chat" if isinstance(v, dict) and "messages" in v else "prompt")])


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[TokenId]


# -- parsing -----------------------------------------------------------------------------------

RequestModel = TypeVar("RequestModel", bound=BaseModel)

_FIELD_NAMES = frozenset(
    name for model in (StreamOptions, ResponseFormat, CompletionRequest, TextPart, ChatMessage,
                       ChatCompletionRequest, TokenizeCompletionRequest, TokenizeChatRequest,
                       DetokenizeRequest)
    for name in model.model_fields)


def _param(loc: tuple[str | int, ...]) -> str | None:
    """``loc`` as OpenAI names a parameter (``messages.0.content``): pydantic also puts the
    member of a union it tried in ``loc`` (``str``, ``list[int]``, a tag), which is dropped."""
    parts = [str(p) for p in loc if isinstance(p, int) or p in _FIELD_NAMES]
    return ".".join(parts) or None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def validation_error(exc: ValidationError) -> APIError:
    """The first problem pydantic found, as OpenAI reports one: a message and the ``param``.
    A union reports one error per form it tried: the one that got deepest into the value
    (``stop.0`` rather than ``stop`` for ``["", "x"]``) says most."""
    errors = exc.errors(include_url=False, include_context=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        why = first["msg"].removeprefix("Invalid JSON: ")
        if "surrogate" in why or "hex escape" in why:
            why += " (\\ud800-\\udfff escapes are UTF-16 halves and must come in pairs)"
        return invalid(f"the request body is not valid JSON: {why}")
    if first["type"] == "model_type" and not first["loc"]:
        return invalid("the request body must be a JSON object")
    same_field = [e for e in errors if e["loc"][:1] == first["loc"][:1]]
    depth = max(len(e["loc"]) for e in same_field)
    deepest = [e for e in same_field if len(e["loc"]) == depth]
    param = _param(deepest[0]["loc"])
    messages = list(dict.fromkeys(e["msg"] for e in deepest if _param(e["loc"]) == param))
    if deepest[0]["type"] == "missing":
        return invalid(f"{param} is required", param)
    return invalid(f"{param}: {' or '.join(messages)} (got {_shown(deepest[0].get('input'))})",
                   param)


def unknown_fields(model: BaseModel, path: str = "") -> Iterator[str]:
    """The names (dotted) of fields the client sent that no model defines, nested ones too."""
    for name in model.model_extra or {}:
        yield f"{path}{name}"
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            yield from unknown_fields(value, f"{path}{name}.")
        # A list holds models all through or none (a prompt of 400k ids is not walked).
        elif isinstance(value, list) and value and isinstance(value[0], BaseModel):
            for i, item in enumerate(value):
                yield from unknown_fields(item, f"{path}{name}.{i}.")


class UnknownFieldPolicy:
    """vLLM's behaviour (accept, log a warning) with each name logged once, or a 400."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.logged: set[str] = set()

    def check(self, request: BaseModel) -> None:
        names = list(unknown_fields(request))
        if not names:
            return
        if self.strict:
            raise invalid(f"unrecognized request argument(s): "
                          f"{', '.join(_shown(n) for n in names[:8])} (--strict-fields)",
                          names[0])
        new = [n for n in names if n not in self.logged]
        room = MAX_UNKNOWN_FIELDS_LOGGED - len(self.logged)
        if new and room > 0:
            self.logged.update(new[:room])
            logger.warning("ignoring field(s) this server does not know: %s (each name is "
                           "logged once)", ", ".join(_shown(n) for n in new[:room]))


def parse_body(model: type[RequestModel] | TypeAdapter, raw: bytes) -> RequestModel:
    """The body parsed by pydantic-core's JSON parser (bytes in, no ``json.loads`` first)."""
    try:
        if isinstance(model, TypeAdapter):
            return model.validate_json(raw)
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_error(exc) from None


# -- responses ---------------------------------------------------------------------------------

def _unless_none(value: Any) -> bool:
    return value is None


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions shape: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    token_ids: list[int] | None = Field(default=None, exclude_if=_unless_none)


class CompletionResponse(BaseModel):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = Field(default=None, exclude_if=_unless_none)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class AssistantMessage(BaseModel):
    role: str | None = Field(default=None, exclude_if=_unless_none)
    content: str | None = Field(default=None, exclude_if=_unless_none)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage | None = Field(default=None, exclude_if=_unless_none)
    delta: AssistantMessage | None = Field(default=None, exclude_if=_unless_none)
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    token_ids: list[int] | None = Field(default=None, exclude_if=_unless_none)


class ChatCompletionResponse(BaseModel):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = Field(default=None, exclude_if=_unless_none)
