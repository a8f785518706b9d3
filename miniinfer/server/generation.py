"""From a parsed request to engine requests, and from their tokens back to OpenAI's shapes.

A request becomes ``len(prompts) * best_of`` engine requests (choices): every prompt of a
list, and ``n`` (or ``best_of``) samples of each. Choice ``j`` of a seeded request uses seed
``seed + j``, so the samples differ and the whole answer still repeats. With ``best_of > n``
the ``n`` choices of each prompt with the highest cumulative logprob are returned.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from ..core.errors import MiniInferError
from ..core.sampling import SEED_RANGE, SamplingParams, TokenLogprobs
from ..core.scheduler import FinishReason
from .protocol import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    SamplingFields,
    TopLogprob,
    UsageInfo,
    invalid,
)
from .tokens import PromptTokenizer, TextStream

Kind = Literal["completion", "chat"]
PromptSource = str | list[int]  # text to tokenise, or token ids as sent


@dataclass(slots=True)
class GenerationRequest:
    """One checked request: what the engine runs and how to answer."""

    kind: Kind
    model: str
    sources: list[PromptSource]  # one per prompt; chat: the template's tokens, set later
    fields: SamplingFields
    max_tokens: int | None  # None: the default (completions 16; chat: the rest of the context)
    n: int
    best_of: int
    logprobs: int | None  # what the answer shows: None, or this many alternatives per token
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    continuous_usage: bool
    echo: bool
    prompts: list[list[int]] = field(default_factory=list)  # set once tokenised
    params: list[SamplingParams] = field(default_factory=list)  # one per prompt

    @property
    def param(self) -> str:
        return "messages" if self.kind == "chat" else "prompt"

    @property
    def skip_special_tokens(self) -> bool:
        return self.fields.skip_special_tokens is not False

    @property
    def return_token_ids(self) -> bool:
        return bool(self.fields.return_token_ids)

    def set_prompts(self, prompts: list[list[int]], max_context: int, vocab_size: int) -> None:
        """The token ids of every prompt, and each prompt's sampling parameters."""
        f = self.fields
        for name, ids in (("logit_bias", [int(t) for t in f.logit_bias or ()]),
                          ("stop_token_ids", f.stop_token_ids or [])):
            if ids and max(ids) >= vocab_size:
                raise invalid(f"{name}: token ids must be in [0, {vocab_size}), got {max(ids)}",
                              name)
        self.prompts = prompts
        self.params = [self._sampling_params(p, max_context) for p in prompts]

    def _sampling_params(self, prompt: list[int], max_context: int) -> SamplingParams:
        f = self.fields
        if self.max_tokens is not None:
            max_tokens = self.max_tokens
        elif self.kind == "chat":  # unset, a chat answer may run to the end of the context
            max_tokens = max(1, max_context - len(prompt))
        else:
            max_tokens = COMPLETION_DEFAULT_MAX_TOKENS
        if f.min_tokens and f.min_tokens > max_tokens:
            raise invalid(f"min_tokens ({f.min_tokens}) must be at most max_tokens "
                          f"({max_tokens})", "min_tokens")
        # best_of ranks choices by their cumulative logprob, so it needs the sampled token's.
        logprobs = self.logprobs if self.logprobs is not None else \
            (0 if self.best_of > self.n else None)
        try:
            return SamplingParams(
                max_new_tokens=max_tokens,
                temperature=1.0 if f.temperature is None else f.temperature,  # OpenAI's default
                top_k=0 if f.top_k in (None, -1) else f.top_k,
                top_p=1.0 if f.top_p is None else f.top_p,
                seed=f.seed, ignore_eos=bool(f.ignore_eos),
                min_p=f.min_p or 0.0,
                repetition_penalty=1.0 if f.repetition_penalty is None else f.repetition_penalty,
                presence_penalty=f.presence_penalty or 0.0,
                frequency_penalty=f.frequency_penalty or 0.0,
                logit_bias=tuple((int(t), b) for t, b in (f.logit_bias or {}).items()),
                stop_token_ids=tuple(f.stop_token_ids or ()), min_tokens=f.min_tokens or 0,
                logprobs=logprobs)
        except MiniInferError as exc:  # the checks between fields (min_tokens <= max_tokens)
            raise invalid(str(exc)) from None

    def choice_params(self, prompt_index: int, choice: int) -> SamplingParams:
        params = self.params[prompt_index]
        if params.seed is None or choice == 0:
            return params
        low, high = SEED_RANGE
        seed = (params.seed - low + choice) % (high - low + 1) + low
        return replace(params, seed=seed)


def _common(body: SamplingFields) -> dict:
    """What both endpoints check alike."""
    if body.response_format is not None and body.response_format.type != "text":
        raise invalid(f"response_format {body.response_format.type!r} is not supported: this "
                      f"server has no structured output (only {{\"type\": \"text\"}})",
                      "response_format")
    stream = bool(body.stream)
    if body.stream_options is not None and not stream:
        raise invalid("stream_options is only allowed with stream=true", "stream_options")
    options = body.stream_options
    stop = body.stop
    stops = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    if body.logit_bias:
        bad = next((t for t in body.logit_bias if not t.isdigit() or len(t) > 12), None)
        if bad is not None:
            raise invalid(f"logit_bias keys must be token ids (decimal integers), got "
                          f"{bad[:40]!r}", "logit_bias")
    n = body.n or 1
    return dict(model=body.model, fields=body,
                max_tokens=body.max_completion_tokens or body.max_tokens, n=n, stop=stops,
                stream=stream, include_usage=bool(options and options.include_usage),
                continuous_usage=bool(options and options.include_usage
                                      and options.continuous_usage_stats))


def completion_request(body: CompletionRequest) -> GenerationRequest:
    common = _common(body)
    n = common["n"]
    best_of = body.best_of or n
    if best_of < n:
        raise invalid(f"best_of ({best_of}) must be at least n ({n})", "best_of")
    if best_of > n and common["stream"]:
        raise invalid("best_of > n cannot be streamed: the best choices are known only at the "
                      "end", "best_of")
    if body.suffix:
        raise invalid("suffix is not supported by this server (no fill-in-the-middle)", "suffix")
    if body.echo and body.logprobs is not None:
        raise invalid("echo with logprobs is not supported: the prompt's logprobs are not "
                      "computed", "echo")
    prompt = body.prompt
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        sources: list[PromptSource] = [prompt]
    else:
        sources = list(prompt)
    return GenerationRequest("completion", sources=sources, best_of=best_of,
                             logprobs=body.logprobs, echo=bool(body.echo), **common)


def chat_turns(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the chat template takes them: text parts joined, ``developer`` (OpenAI's
    new name for the system role) as ``system``."""
    turns = []
    for message in messages:
        content = message.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if message.role == "developer" else message.role
        turns.append({"role": role, "content": content or ""})
    return turns


def chat_request(body: ChatCompletionRequest) -> GenerationRequest:
    common = _common(body)
    if body.tools or body.functions:
        raise invalid("tools are not supported by this server", "tools" if body.tools
                      else "functions")
    if body.tool_choice not in (None, "none"):
        raise invalid("tool_choice is not supported by this server (no tools)", "tool_choice")
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs needs logprobs=true", "top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return GenerationRequest("chat", sources=[], best_of=common["n"], logprobs=logprobs,
                             echo=False, **common)


# -- answers -----------------------------------------------------------------------------------

def finish_reason(reason: FinishReason | None) -> str | None:
    """OpenAI's names: an EOS token, a stop token and a stop string are all "stop"."""
    if reason is None:
        return None
    return "length" if reason is FinishReason.LENGTH else "stop"


@dataclass(slots=True)
class Choice:
    """One engine request's side of the answer: its text so far and its logprobs."""

    prompt_index: int
    text: TextStream
    echo: str = ""  # the prompt's text, sent before the output (completions' echo)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: FinishReason | None = None
    text_offset: int = 0  # completions' logprobs: where the next token's text starts


@dataclass(slots=True)
class Responder:
    """Builds one request's response body, or its stream chunks, in OpenAI's shapes."""

    request: GenerationRequest
    tokenizer: PromptTokenizer
    request_id: str
    created: int

    @classmethod
    def new(cls, request: GenerationRequest, tokenizer: PromptTokenizer) -> Responder:
        prefix = "chatcmpl" if request.kind == "chat" else "cmpl"
        return cls(request, tokenizer, f"{prefix}-{uuid.uuid4().hex}", int(time.time()))

    def usage(self, num_output_tokens: int) -> UsageInfo:
        prompt = sum(len(p) for p in self.request.prompts)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=num_output_tokens,
                         total_tokens=prompt + num_output_tokens)

    def _completion_logprobs(self, choice: Choice,
                             entries: Sequence[TokenLogprobs]) -> CompletionLogprobs | None:
        if self.request.logprobs is None:
            return None
        out = CompletionLogprobs()
        text = self.tokenizer.token_text
        for entry in entries:
            token = text(entry.token_id)
            out.tokens.append(token)
            out.token_logprobs.append(entry.logprob)
            # vLLM's shape: the sampled token is always there, so up to logprobs + 1 entries.
            out.top_logprobs.append({token: entry.logprob,
                                     **{text(i): lp for i, lp in entry.top if text(i) != token}})
            out.text_offset.append(choice.text_offset)
            choice.text_offset += len(token)
        return out

    def _chat_logprobs(self, entries: Sequence[TokenLogprobs]) -> ChatLogprobs | None:
        if self.request.logprobs is None:
            return None
        text = self.tokenizer.token_text

        def top(token_id: int, logprob: float) -> TopLogprob:
            token = text(token_id)
            return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

        return ChatLogprobs(content=[
            ChatTokenLogprob(**top(e.token_id, e.logprob).model_dump(),
                             top_logprobs=[top(i, lp) for i, lp in e.top])
            for e in entries])

    def _choice(self, index: int, choice: Choice, text: str, token_ids: list[int],
                entries: Sequence[TokenLogprobs], reason: FinishReason | None,
                chunk: bool) -> CompletionChoice | ChatChoice:
        ids = token_ids if self.request.return_token_ids else None
        if self.request.kind == "chat":
            if chunk:
                message = AssistantMessage(content=text) if text or reason is None \
                    else AssistantMessage()
                return ChatChoice(index=index, delta=message, logprobs=self._chat_logprobs(
                    entries), finish_reason=finish_reason(reason), token_ids=ids)
            return ChatChoice(index=index, message=AssistantMessage(role="assistant",
                                                                    content=text),
                              logprobs=self._chat_logprobs(entries),
                              finish_reason=finish_reason(reason), token_ids=ids)
        return CompletionChoice(index=index, text=text,
                                logprobs=self._completion_logprobs(choice, entries),
                                finish_reason=finish_reason(reason), token_ids=ids)

    def _envelope(self, chunk: bool) -> dict:
        if self.request.kind == "chat":
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created,
                "model": self.request.model}

    def _body(self, choices: list, chunk: bool, usage: UsageInfo | None) -> str:
        model = ChatCompletionResponse if self.request.kind == "chat" else CompletionResponse
        return model(**self._envelope(chunk), choices=choices, usage=usage).model_dump_json()

    def response(self, choices: list[Choice], num_output_tokens: int) -> str:
        """The whole answer; ``choices`` in the order they are returned, and every token
        generated (best_of's discarded choices included) in the usage."""
        out = []
        for index, choice in enumerate(choices):
            choice.text_offset = len(choice.echo)
            out.append(self._choice(index, choice, choice.echo + choice.text.text,
                                    choice.token_ids, choice.logprobs, choice.finish_reason,
                                    chunk=False))
        return self._body(out, False, self.usage(num_output_tokens))

    def chunk(self, index: int, choice: Choice, text: str, token_ids: list[int],
              entries: Sequence[TokenLogprobs], reason: FinishReason | None,
              num_output_tokens: int) -> str:
        """One streamed piece of choice ``index``: the new text (maybe empty: every engine
        step that gave the request tokens sends one, so a client can time each token); a
        finished choice's last piece carries its finish reason."""
        usage = self.usage(num_output_tokens) if self.request.continuous_usage else None
        return self._body([self._choice(index, choice, text, token_ids, entries, reason, True)],
                          True, usage)

    def role_chunk(self, index: int) -> str:
        """Chat streams open with the assistant's role and no text."""
        return self._body([ChatChoice(index=index, delta=AssistantMessage(role="assistant",
                                                                          content=""),
                                      logprobs=None, finish_reason=None)], True, None)

    def usage_chunk(self, num_output_tokens: int) -> str:
        return self._body([], True, self.usage(num_output_tokens))
