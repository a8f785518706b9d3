"""The HTTP side: a FastAPI app whose handlers parse, enqueue and stream, and the uvicorn server
that runs it (``python -m miniinfer serve``).

Endpoints: ``POST /v1/completions`` and ``/v1/chat/completions`` (streamed or not), and what
clients probe before they send anything, in vLLM's shapes: ``GET /health``, ``/version``,
``/v1/models`` (with ``max_model_len``), ``/metrics`` (Prometheus), ``POST /tokenize`` and
``/detokenize``.

No request can stall the others: a body is refused with a 413 as soon as it passes
``max_request_bytes`` (from its Content-Length, or counted as it streams in), parsing is
pydantic-core's, and tokenising runs in worker threads in bounded pieces (:mod:`.tokens`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..core.config import MAX_DRAFT_TOKENS
from ..core.errors import InvalidRequestError, MiniInferError
from ..core.kv_cache import DEFAULT_BLOCK_SIZE, KVCacheConfig, blocks_for, kv_bytes_per_block
from ..core.models import (
    MODELS,
    LoadedModel,
    load_model,
    model_config,
    resolve_device,
    resolve_dtype,
)
from ..engines import engine_config, make_engine, resolve_engine
from ..engines.continuous import ContinuousEngine
from .engine_loop import EngineLoop, RequestHandle, Update, dead_engine_error
from .generation import (
    Choice,
    GenerationRequest,
    Responder,
    chat_request,
    chat_turns,
    completion_request,
)
from .linger import LingeringH11Protocol
from .metrics import ServerMetrics
from .openapi import install as install_openapi
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeRequest,
    UnknownFieldPolicy,
    invalid,
    parse_body,
)
from .tokens import PromptTokenizer, TextStream

logger = logging.getLogger("miniinfer.server")

DEFAULT_MAX_REQUEST_BYTES = 2 << 20  # 2 MiB: far more than any prompt the context can hold
# The status ``serve`` exits with when the engine can no longer serve (a supervisor restarts it).
EXIT_ENGINE_DEAD = 3




@dataclass(slots=True)
class ServerConfig:
    """``max_num_seqs``: requests running at once (the engine's); ``max_waiting``: requests
    queued beyond those before new ones get a 429."""

    model: str = "smollm2-135m"
    engine: str = "continuous"
    host: str = "127.0.0.1"  # this machine only, unless told otherwise
    port: int = 8000  # 0: any free port (the URL line says which)
    max_num_seqs: int = 256
    max_waiting: int = 1024
    max_num_batched_tokens: int = 512
    kv_cache_bytes: int | None = None  # the KV pool; None: the engines' default pool
    # An idle engine waits this long for more arrivals after the first (EngineLoop).
    arrival_window_ms: float = 5.0
    device: str = "auto"
    dtype: str | None = None
    strict_fields: bool = False  # a field nobody defines: 400 instead of a logged warning
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # larger bodies get a 413
    tensor_parallel: int | None = None  # the engine's runner over N processes (chapter 12)
    # "ngram": the engine drafts by prompt lookup and verifies k + 1 positions a step
    # (chapter 14), on whichever engine it serves.
    speculative: str | None = None
    num_speculative_tokens: int = 4  # the most draft tokens a request gets in one step
    # Any other engine settings (EngineConfig's fields: weights, forward, prefix_caching...).
    engine_settings: dict[str, object] = field(default_factory=dict)
    # Once the engine can no longer serve, /health answers 503 for this long (a load balancer
    # takes the server out), then the server exits with EXIT_ENGINE_DEAD.
    exit_after_failure_s: float = 5.0

    def __post_init__(self) -> None:
        if not 0 <= self.exit_after_failure_s <= 3600:
            raise InvalidRequestError(f"exit_after_failure_s must be in 0-3600, got "
                                      f"{self.exit_after_failure_s}")
        for name in ("max_num_seqs", "max_waiting", "max_num_batched_tokens",
                     "max_request_bytes"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.arrival_window_ms <= 1000:
            raise InvalidRequestError(f"arrival_window_ms must be in 0-1000, got "
                                      f"{self.arrival_window_ms}")
        if not 0 <= self.port <= 65535:
            raise InvalidRequestError(f"port must be in 0-65535, got {self.port}")
        if self.speculative is not None and \
                not 0 <= self.num_speculative_tokens <= MAX_DRAFT_TOKENS:
            raise InvalidRequestError(f"num_speculative_tokens must be in 0-{MAX_DRAFT_TOKENS}, "
                                      f"got {self.num_speculative_tokens}")
        cls, _ = resolve_engine(self.engine)
        # The server adds requests one by one and steps: the interface chapter 08 built.
        if not issubclass(cls, ContinuousEngine):
            raise InvalidRequestError(
                f"serve needs an engine that takes requests while it runs (add_request, step, "
                f"abort): continuous or a stage built on it; {self.engine!r} runs static batches")
        # Every setting checked together before the model loads: a combination that cannot
        # run (compiled with tensor parallelism, say) is refused here, naming both.
        engine_config(self.engine, **self.engine_options())

    def engine_options(self) -> dict[str, object]:
        """The settings the server passes its engine, on top of the engine's preset."""
        options: dict[str, object] = {
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "kv_cache_bytes": self.kv_cache_bytes}
        options.update(self.engine_settings)
        if self.tensor_parallel is not None:
            options["tensor_parallel"] = self.tensor_parallel
        if self.speculative is not None:
            options["speculative"] = self.speculative
            options["num_draft_tokens"] = self.num_speculative_tokens
        return options

    def check_kv_cache(self) -> None:
        """Before the model loads: a ``kv_cache_bytes`` more than the device's memory, or a
        pool (given, or the engines' default) that cannot hold one request of the model's
        full context, is refused (vLLM refuses the same at start-up)."""
        if self.kv_cache_bytes is not None:
            device = resolve_device(self.device)
            memory = device_kv_cache_bytes(device)
            if self.kv_cache_bytes > memory:
                raise InvalidRequestError(
                    f"kv_cache_bytes={self.kv_cache_bytes} is more than the {memory} bytes of "
                    f"memory this machine's {device.type} has")
        if self.model not in MODELS:
            return  # load_model names the problem
        config = model_config(self.model)
        max_context = int(config.max_position_embeddings)
        dtype = resolve_dtype(self.dtype, MODELS[self.model].default_dtype)
        per_block = kv_bytes_per_block(config, dtype, DEFAULT_BLOCK_SIZE)
        if self.kv_cache_bytes is None:
            pool = "the default KV pool"
            num_blocks = KVCacheConfig().resolve_num_blocks(per_block, max_context)
        else:
            pool = f"kv_cache_bytes={self.kv_cache_bytes}"
            num_blocks = self.kv_cache_bytes // per_block
        need = blocks_for(max_context, DEFAULT_BLOCK_SIZE)
        if num_blocks < need:
            raise InvalidRequestError(
                f"{pool} holds {num_blocks} KV blocks; one request of {self.model}'s full "
                f"context ({max_context} tokens) needs {need} blocks: give --kv-cache-bytes of "
                f"at least {need * per_block}")

    def make_engine(self, lm: LoadedModel) -> ContinuousEngine:
        return make_engine(self.engine, lm, **self.engine_options())


def device_kv_cache_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device.index or 0).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _package_version() -> str:
    try:
        return version("miniinfer")
    except PackageNotFoundError:
        return "unknown"


def _sse(payload: str) -> str:
    return f"data: {payload}\n\n"


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with a 413 once it passes ``limit`` bytes: by its Content-Length
    before anything is read, and counted as it streams in (a chunked body has none)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise invalid(f"Content-Length must be a number of bytes, got {declared[:40]!r}")
        if int(declared) > limit:
            raise _too_large(f"Content-Length says {declared} bytes", limit)
    chunks = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(f"{size} bytes received so far", limit)
            chunks.append(chunk)
    except ClientDisconnect:  # nobody reads the answer; no traceback in the log either
        raise invalid("the client went away before the body ended") from None
    return b"".join(chunks)


def _too_large(what: str, limit: int) -> APIError:
    return APIError(413, f"the request body is larger than the server's --max-request-bytes "
                    f"({limit}): {what}", code="request_too_large")


def create_app(lm: LoadedModel, engine: ContinuousEngine, model_name: str,
               max_waiting: int = 1024, arrival_window_s: float = 0.0,
               strict_fields: bool = False,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """The app; its lifespan starts the engine loop and stops it (aborting what is left)."""
    metrics = ServerMetrics(engine, model_name)
    engine_loop = EngineLoop(engine, metrics, max_waiting, arrival_window_s)
    tokenizer = PromptTokenizer(lm)
    unknown_fields = UnknownFieldPolicy(strict_fields)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine_loop.start()
        yield
        engine_loop.stop()

    app = FastAPI(title="miniinfer", lifespan=lifespan)
    app.state.engine_loop = engine_loop
    app.state.tokenizer = tokenizer

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        # A body refused unread leaves bytes on the connection: close it after the answer.
        headers = {"connection": "close"} if exc.status == 413 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("request to %s failed", request.url.path)
        return JSONResponse(APIError(500, f"{type(exc).__name__}: {exc}", "server_error").body(),
                            status_code=500)

    async def body_of(http_request: Request, model: Any) -> Any:
        body = parse_body(model, await read_body(http_request, max_request_bytes))
        unknown_fields.check(body)
        name = getattr(body, "model", None)
        if name is not None and name != model_name:  # "" names no model either
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                           f"{model_name!r}", param="model", code="model_not_found")
        return body

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine can serve; a 503 saying why once it cannot (the server then
        exits: EXIT_ENGINE_DEAD)."""
        reason = engine_loop.health()
        if reason is None:
            return Response(status_code=200)
        return JSONResponse(dead_engine_error(reason).body(), status_code=503)

    @app.get("/version")
    async def server_version() -> dict[str, str]:
        return {"version": _package_version()}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": 0, "owned_by": "miniinfer",
            "root": model_name, "parent": None, "max_model_len": lm.max_context}]}

    @app.post("/tokenize")
    async def tokenize(http_request: Request) -> dict[str, Any]:
        """vLLM's: a prompt, or chat messages through the template."""
        body = await body_of(http_request, TokenizeRequest)
        if isinstance(body, TokenizeChatRequest):
            ids = await asyncio.to_thread(tokenizer.encode_chat, chat_turns(body.messages),
                                          body.add_generation_prompt is not False)
        else:
            ids = await asyncio.to_thread(tokenizer.encode, body.prompt, "prompt",
                                          body.add_special_tokens is not False)
        strs = [tokenizer.tokenizer.convert_ids_to_tokens(i) for i in ids] \
            if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": lm.max_context, "tokens": ids,
                "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(http_request: Request) -> dict[str, str]:
        body = await body_of(http_request, DetokenizeRequest)
        vocab = lm.config.vocab_size
        if body.tokens and max(body.tokens) >= vocab:
            raise invalid(f"tokens must be ids in [0, {vocab}), got {max(body.tokens)}",
                          "tokens")
        if len(body.tokens) > lm.max_context:
            raise invalid(f"tokens: at most the model's context of {lm.max_context} ids, got "
                          f"{len(body.tokens)}", "tokens")
        text = await asyncio.to_thread(tokenizer.decode, body.tokens, False)
        return {"prompt": text}

    @app.post("/v1/completions")
    async def completions(http_request: Request) -> Response:
        body = await body_of(http_request, CompletionRequest)
        return await _generate(completion_request(body), http_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(http_request: Request) -> Response:
        body = await body_of(http_request, ChatCompletionRequest)
        request = chat_request(body)
        prompt = await asyncio.to_thread(tokenizer.encode_chat, chat_turns(body.messages),
                                         body.add_generation_prompt is not False)
        request.sources = [prompt]
        return await _generate(request, http_request)

    async def _prompts(request: GenerationRequest) -> list[list[int]]:
        prompts = []
        for source in request.sources:
            if isinstance(source, str):  # in a worker thread, piece by piece
                prompts.append(await asyncio.to_thread(tokenizer.encode, source, request.param))
            else:
                prompts.append(source)
        return prompts

    def _check_size(request: GenerationRequest) -> None:
        """Every choice of a request is queued at once: more than the queue holds could
        never be admitted."""
        num_choices = len(request.sources) * request.best_of
        if num_choices > max_waiting:
            raise invalid(f"{len(request.sources)} prompt(s) x {request.best_of} choice(s) = "
                          f"{num_choices} sequences, more than the server queues at once "
                          f"(--max-waiting {max_waiting})", request.param)

    async def _generate(request: GenerationRequest, http_request: Request) -> Response:
        _check_size(request)
        request.set_prompts(await _prompts(request), lm.max_context, lm.config.vocab_size)
        for prompt, params in zip(request.prompts, request.params, strict=True):
            try:  # prompt too long for the context or the KV pool, token ids outside the vocab
                engine.validate([prompt], params)
            except MiniInferError as exc:
                raise invalid(str(exc), request.param) from None
        responder = Responder.new(request, tokenizer)
        echoes = [await _echo(request, i) for i in range(len(request.prompts))]
        updates: asyncio.Queue[Update] = asyncio.Queue()
        event_loop = asyncio.get_running_loop()
        handles, choices = [], []
        for i, prompt in enumerate(request.prompts):
            first = None
            for j in range(request.best_of):
                handle = RequestHandle(f"{responder.request_id}-{i}-{j}", prompt,
                                       request.choice_params(i, j), request.stop, event_loop,
                                       updates, index=len(handles), after=first)
                first = first or handle.request_id
                handles.append(handle)
                choices.append(Choice(i, TextStream(tokenizer, request.stop,
                                                    request.skip_special_tokens), echoes[i]))
        engine_loop.submit(handles)  # a 429 when the queue is full
        abort = _aborter([h.request_id for h in handles])
        if request.stream:
            return StreamingResponse(_stream(request, responder, updates, choices, abort),
                                     media_type="text/event-stream")
        return Response(await _collect(request, responder, updates, choices, abort,
                                       http_request), media_type="application/json")

    async def _echo(request: GenerationRequest, i: int) -> str:
        if not request.echo:
            return ""
        source = request.sources[i]
        if isinstance(source, str):
            return source
        return await asyncio.to_thread(tokenizer.decode, source, request.skip_special_tokens)

    def _aborter(request_ids: list[str]) -> Callable[[], None]:
        def abort() -> None:
            for request_id in request_ids:
                engine_loop.abort(request_id)
        return abort

    async def _collect(request: GenerationRequest, responder: Responder,
                       updates: asyncio.Queue[Update], choices: list[Choice],
                       abort: Callable[[], None], http_request: Request) -> str:
        """The whole answer at once. Nothing is written until the end, so nobody notices a
        client that hangs up meanwhile; a watcher does: with the body read, the connection's
        next ASGI message is ``http.disconnect``, and it only comes if the client goes."""
        unfinished = len(choices)
        gone = asyncio.ensure_future(_disconnected(http_request))
        try:
            while unfinished:
                next_update = asyncio.ensure_future(updates.get())
                await asyncio.wait((next_update, gone), return_when=asyncio.FIRST_COMPLETED)
                if not next_update.done():
                    next_update.cancel()
                    logger.info("client of %s went away; aborting it", responder.request_id)
                    return ""  # nobody reads it; the finally aborts the request
                update = next_update.result()
                if update.error is not None:
                    raise update.error
                choice = choices[update.index]
                choice.token_ids += update.token_ids
                choice.logprobs += update.logprobs
                choice.cumulative_logprob = update.cumulative_logprob
                if update.finish_reason is not None:
                    choice.finish_reason = update.finish_reason
                    await _finish_text(choice)
                    unfinished -= 1
            return responder.response(_best(request, choices),
                                      sum(len(c.token_ids) for c in choices))
        finally:
            gone.cancel()
            if unfinished:  # failed, cancelled or abandoned: free the requests' blocks
                abort()

    async def _finish_text(choice: Choice) -> None:
        if len(choice.token_ids) > 256:  # a long text: decode it off the event loop
            await asyncio.to_thread(choice.text.add, choice.token_ids, choice.finish_reason)
        else:
            choice.text.add(choice.token_ids, choice.finish_reason)

    async def _disconnected(http_request: Request) -> None:
        while (await http_request.receive())["type"] != "http.disconnect":
            pass

    async def _stream(request: GenerationRequest, responder: Responder,
                      updates: asyncio.Queue[Update], choices: list[Choice],
                      abort: Callable[[], None]) -> AsyncIterator[str]:
        """Server-sent events. A client that disconnects cancels this generator (Starlette
        watches the connection), and the ``finally`` aborts the request."""
        unfinished = len(choices)
        generated = 0
        # A chat choice opens with the assistant's role when its first tokens are out, as
        # vLLM's server does: clients (vllm bench serve among them) time the first token at
        # the first chunk, so a role sent on arrival would read as a TTFT of no time at all.
        opened: set[int] = set()
        try:
            for index, choice in enumerate(choices):
                if request.kind != "chat" and choice.echo:
                    choice.text_offset = len(choice.echo)
                    yield _sse(responder.chunk(index, choice, choice.echo, [], [], None,
                                               generated))
            while unfinished:
                update = await updates.get()
                if update.error is not None:  # the status line went out: say it in the stream
                    yield _sse(_error_json(update.error))
                    return  # the finally aborts the other choices
                if request.kind == "chat" and update.index not in opened:
                    opened.add(update.index)
                    yield _sse(responder.role_chunk(update.index))
                choice = choices[update.index]
                generated += len(update.token_ids)
                delta = choice.text.add(update.token_ids, update.finish_reason)
                yield _sse(responder.chunk(update.index, choice, delta, update.token_ids,
                                           update.logprobs, update.finish_reason, generated))
                if update.finish_reason is not None:
                    unfinished -= 1
            if request.include_usage:
                yield _sse(responder.usage_chunk(generated))
            yield _sse("[DONE]")
        except Exception as exc:
            logger.exception("stream of %s failed", responder.request_id)
            yield _sse(_error_json(APIError(500, f"{type(exc).__name__}: {exc}",
                                            "server_error")))
        finally:
            if unfinished:
                abort()

    install_openapi(app, model_name)
    return app


def _best(request: GenerationRequest, choices: list[Choice]) -> list[Choice]:
    """With ``best_of > n``: each prompt's ``n`` choices of highest cumulative logprob."""
    if request.best_of == request.n:
        return choices
    best = []
    for i in range(len(request.prompts)):
        group = choices[i * request.best_of: (i + 1) * request.best_of]
        best += sorted(group, key=lambda c: c.cumulative_logprob, reverse=True)[: request.n]
    return best


def _error_json(error: APIError) -> str:
    return json.dumps(error.body(), separators=(",", ":"))


class Server(uvicorn.Server):
    """uvicorn, but on SIGTERM or Ctrl-C the requests in flight are aborted first: uvicorn
    waits for open connections to finish, and a stream would otherwise run to its end.

    When the engine can no longer serve, the server stops ``exit_after_failure_s`` later
    (``/health`` answers 503 meanwhile) and ``exit_status`` is EXIT_ENGINE_DEAD: no rebuilding
    in place, a supervisor starts a fresh process."""

    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop,
                 exit_after_failure_s: float = 5.0) -> None:
        super().__init__(config)
        self.engine_loop = engine_loop
        self.exit_after_failure_s = exit_after_failure_s
        engine_loop.on_failure = self._engine_failed

    @property
    def exit_status(self) -> int:
        return 0 if self.engine_loop.failure is None else EXIT_ENGINE_DEAD

    def _engine_failed(self, reason: str) -> None:
        logger.error("GET /health answers 503 from now on; the server exits with status %d in "
                     "%g s, for a supervisor to start a fresh one", EXIT_ENGINE_DEAD,
                     self.exit_after_failure_s)
        timer = threading.Timer(self.exit_after_failure_s, self._exit)
        timer.daemon = True
        timer.start()

    def _exit(self) -> None:
        self.should_exit = True

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.engine_loop.abort_all()
        super().handle_exit(sig, frame)


def build_server(config: ServerConfig, lm: LoadedModel | None = None,
                 log_level: str = "warning") -> tuple[Server, socket.socket]:
    """The server and its listening socket (bound here, so ``port=0`` gets a free port that
    is known before anything runs)."""
    config.check_kv_cache()
    lm = lm or load_model(config.model, device=config.device, dtype=config.dtype)
    engine = config.make_engine(lm)
    app = create_app(lm, engine, config.model, config.max_waiting,
                     config.arrival_window_ms / 1e3, config.strict_fields,
                     config.max_request_bytes)
    sock = socket.create_server((config.host, config.port))
    host, port = sock.getsockname()[:2]
    # http: uvicorn's h11 protocol, closing with a linger after an answer sent before the
    # body ended (a 413 the client reads while still sending; .linger).
    uv_config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                               access_log=False, timeout_graceful_shutdown=10,
                               http=LingeringH11Protocol)
    return Server(uv_config, app.state.engine_loop, config.exit_after_failure_s), sock


def run_server(config: ServerConfig) -> None:
    """``python -m miniinfer serve``: serve until SIGTERM or Ctrl-C, then return normally; or
    until the engine can no longer serve, then exit with EXIT_ENGINE_DEAD."""
    server, sock = build_server(config)
    host, port = sock.getsockname()[:2]
    print(f"miniinfer: serving {config.model} with engine {config.engine} at "
          f"http://{host}:{port}/v1", flush=True)
    # After a graceful shutdown uvicorn raises the signal again for the handler that was
    # there before it; with Python's defaults that kills the process (SIGTERM) or raises
    # KeyboardInterrupt. These handlers make that second delivery a no-op, so we exit 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        server.engine_loop.engine.close()  # a tensor-parallel runner's processes end too
    if server.exit_status:
        print(f"miniinfer: error: the engine could no longer serve "
              f"({server.engine_loop.failure}); exiting with status {server.exit_status}",
              file=sys.stderr, flush=True)
        raise SystemExit(server.exit_status)

