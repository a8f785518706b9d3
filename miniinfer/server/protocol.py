"""The OpenAI API as our server speaks it: request bodies checked field by field into what the
engine takes, responses and stream chunks in OpenAI's shapes, errors as
``{"error": {"message", "type", "param", "code"}}``, and the output text as it grows.

Checking by hand rather than with a schema library keeps every message ours: an option we do
not implement (``n`` > 1, ``logprobs``, tools, penalties) gets a 400 that names it, instead of
being silently ignored, and a field nobody knows gets the 400 OpenAI gives it.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..core.errors import MiniInferError
from ..core.models import LoadedModel
from ..core.sampling import SamplingParams
from ..core.scheduler import FinishReason

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP_STRINGS = 4  # as OpenAI allows


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


@dataclass(slots=True)
class GenerationRequest:
    """One request, checked: what the engine needs, and how to answer."""

    kind: str  # "completion" or "chat"
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk carries the usage
    return_token_ids: bool  # vLLM's extension: each choice also carries its token ids


# Options OpenAI defines that we do not implement, with the values that mean "not used": a
# request may send those (clients often send defaults explicitly), anything else is a 400.
_NOT_IMPLEMENTED: dict[str, Callable[[Any], bool]] = {
    "n": lambda v: v in (None, 1),
    "best_of": lambda v: v in (None, 1),
    "logprobs": lambda v: v in (None, False, 0),
    "top_logprobs": lambda v: v in (None, 0),
    "echo": lambda v: v in (None, False),
    "suffix": lambda v: v in (None, ""),
    "presence_penalty": lambda v: v in (None, 0),
    "frequency_penalty": lambda v: v in (None, 0),
    "logit_bias": lambda v: v in (None, {}),
    "tools": lambda v: v in (None, []),
    "tool_choice": lambda v: v in (None, "none"),
    "functions": lambda v: v in (None, []),
    "response_format": lambda v: v in (None, {"type": "text"}),
}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream",
           "stream_options", "user", "ignore_eos", "return_token_ids"}
_FIELDS = {"completion": _COMMON | {"prompt"},
           "chat": _COMMON | {"messages", "max_completion_tokens", "parallel_tool_calls"}}


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return body


def _number(body: dict, name: str, default: float, low: float, high: float,
            low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or not (low < value if low_open else low <= value) or value > high:
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise invalid(f"{name} must be a number in {bound}, got {value!r}", name)
    return float(value)


def _int(body: dict, name: str, default: int | None, low: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise invalid(f"{name} must be an integer >= {low}, got {value!r}", name)
    return value


def _bool(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(f"{name} must be true or false, got {value!r}", name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS \
            or not all(isinstance(s, str) and s for s in stops):
        raise invalid(f"stop must be a non-empty string or a list of at most "
                      f"{MAX_STOP_STRINGS} of them, got {stop!r}", "stop")
    return tuple(stops)


def _prompt_ids(prompt: Any, lm: LoadedModel) -> list[int]:
    """A string, or token ids; a list holding one of those is that one prompt."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt is empty", "prompt")
        return lm.tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list)
                                                            for p in prompt):
        raise invalid("several prompts in one request are not supported: send one prompt "
                      "(a string or a list of token ids) per request", "prompt")
    raise invalid("prompt must be a non-empty string or a non-empty list of token ids",
                  "prompt")


def _chat_prompt_ids(messages: Any, lm: LoadedModel) -> list[int]:
    """The model's chat template over the messages, as ``generate --chat`` applies it."""
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list", "messages")
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in (
                "system", "user", "assistant"):
            raise invalid(f"messages[{i}] must be an object with a role of system, user or "
                          f"assistant", "messages")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise invalid(f"messages[{i}].content: only text parts are supported",
                              "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise invalid(f"messages[{i}].content must be a string or a list of text parts",
                          "messages")
        turns.append({"role": message["role"], "content": content})
    return lm.chat_prompt(turns)


def parse_request(kind: str, body: dict[str, Any], lm: LoadedModel) -> GenerationRequest:
    """Check a completions (``kind="completion"``) or chat completions (``"chat"``) body."""
    unknown = sorted(set(body) - _FIELDS[kind] - set(_NOT_IMPLEMENTED))
    if unknown:
        raise invalid(f"unrecognized request argument(s): {', '.join(unknown)}", unknown[0])
    for name, unused in _NOT_IMPLEMENTED.items():
        if name in body and not unused(body[name]):
            raise invalid(f"{name}={body[name]!r} is not supported by this server", name)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model is required (see GET /v1/models)", "model")
    if kind == "chat":
        prompt_ids = _chat_prompt_ids(body.get("messages"), lm)
        tokens_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
            else "max_tokens"
        # Unset, a chat answer may run to the end of the context (as vLLM does).
        default = max(1, lm.max_context - len(prompt_ids))
    else:
        if "prompt" not in body:
            raise invalid("prompt is required", "prompt")
        prompt_ids = _prompt_ids(body["prompt"], lm)
        tokens_field, default = "max_tokens", COMPLETION_DEFAULT_MAX_TOKENS
    max_tokens = _int(body, tokens_field, default, 1)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)  # OpenAI's default is 1
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    seed = _int(body, "seed", None, 0)
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)
                                or set(options) - {"include_usage"}):
        raise invalid("stream_options must be an object with include_usage, and only with "
                      "stream=true", "stream_options")
    try:
        params = SamplingParams(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                seed=seed, ignore_eos=_bool(body, "ignore_eos"))
    except MiniInferError as exc:
        raise invalid(str(exc)) from None
    return GenerationRequest(kind, model, prompt_ids, params, _stop(body), stream,
                             _bool(options or {}, "include_usage"),
                             _bool(body, "return_token_ids"))


def finish_reason(reason: FinishReason) -> str:
    """OpenAI's names: an EOS token and a stop string are both "stop"."""
    return "length" if reason is FinishReason.LENGTH else "stop"


class TextStream:
    """The output text as tokens arrive: each call returns the new text that is safe to send.

    Two things are held back until more tokens come: a character whose UTF-8 bytes are split
    across tokens (it decodes as U+FFFD for now), and the last ``len(longest stop) - 1``
    characters, which could be the start of a stop string (OpenAI never sends a stop string).
    The whole output is decoded each time, so the pieces always join to the final text."""

    def __init__(self, lm: LoadedModel, stop: Sequence[str]) -> None:
        self.tokenizer = lm.tokenizer
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # what has been sent
        self._decoded = ""

    def add(self, token_ids: Sequence[int], reason: FinishReason | None) -> str:
        self.token_ids += token_ids
        decoded = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if reason is None:
            end = len(decoded.rstrip("\ufffd")) - self.holdback
        elif reason is FinishReason.STOP:
            # The output ends at the first stop string, which is left out.
            end = min((i for i in (decoded.find(s) for s in self.stop) if i >= 0),
                      default=len(decoded))
        else:
            end = len(decoded)
        if end <= len(self.text):
            return ""
        delta = decoded[len(self.text):end]
        self.text += delta
        return delta


@dataclass(slots=True)
class Responder:
    """Builds one request's response body, or its stream chunks, in OpenAI's shapes."""

    request: GenerationRequest
    request_id: str
    created: int

    @classmethod
    def new(cls, request: GenerationRequest) -> Responder:
        prefix = "chatcmpl" if request.kind == "chat" else "cmpl"
        return cls(request, f"{prefix}-{uuid.uuid4().hex}", int(time.time()))

    def usage(self, num_output_tokens: int) -> dict[str, int]:
        prompt = len(self.request.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": num_output_tokens,
                "total_tokens": prompt + num_output_tokens}

    def _choice(self, text: str, token_ids: list[int], reason: str | None,
                chunk: bool) -> dict[str, Any]:
        if self.request.kind == "chat":
            key = "delta" if chunk else "message"
            if chunk:
                message = {"content": text} if text or reason is None else {}
            else:
                message = {"role": "assistant", "content": text}
            choice = {"index": 0, key: message, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        if self.request.return_token_ids:
            choice["token_ids"] = token_ids
        return choice

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        if self.request.kind == "chat":
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created,
                "model": self.request.model}

    def response(self, text: str, token_ids: list[int], reason: FinishReason) -> dict[str, Any]:
        return {**self._envelope(False),
                "choices": [self._choice(text, token_ids, finish_reason(reason), False)],
                "usage": self.usage(len(token_ids))}

    def chunk(self, text: str, token_ids: list[int],
              reason: FinishReason | None = None) -> dict[str, Any]:
        """One streamed piece: the new text (maybe empty: every engine step that gave the
        request tokens sends one, so a client can time each token); a finished request's last
        piece carries its finish reason."""
        out = {**self._envelope(True),
               "choices": [self._choice(text, token_ids, reason and finish_reason(reason), True)]}
        if self.request.include_usage:
            out["usage"] = None
        return out

    def role_chunk(self) -> dict[str, Any]:
        """Chat streams open with the assistant's role and no text."""
        return {**self._envelope(True), "choices": [{
            "index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
            "finish_reason": None}]}

    def usage_chunk(self, num_output_tokens: int) -> dict[str, Any]:
        return {**self._envelope(True), "choices": [], "usage": self.usage(num_output_tokens)}
