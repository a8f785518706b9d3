"""The HTTP side: a FastAPI app whose handlers parse, enqueue and stream, and the uvicorn server
that runs it (``python -m miniinfer serve``)."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..core.errors import InvalidRequestError, MiniInferError
from ..core.models import LoadedModel, load_model
from ..engines import make_engine, resolve_engine
from ..engines.continuous import ContinuousEngine
from .engine_loop import EngineLoop, RequestHandle
from .metrics import ServerMetrics
from .protocol import (
    APIError,
    GenerationRequest,
    Responder,
    TextStream,
    invalid,
    parse_json,
    parse_request,
)

logger = logging.getLogger("miniinfer.server")


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

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_waiting", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.arrival_window_ms <= 1000:
            raise InvalidRequestError(f"arrival_window_ms must be in 0-1000, got "
                                      f"{self.arrival_window_ms}")
        if not 0 <= self.port <= 65535:
            raise InvalidRequestError(f"port must be in 0-65535, got {self.port}")
        cls, _ = resolve_engine(self.engine)
        # The server adds requests one by one and steps: the interface chapter 08 built.
        if not issubclass(cls, ContinuousEngine):
            raise InvalidRequestError(
                f"serve needs an engine that takes requests while it runs (add_request, step, "
                f"abort): continuous or a stage built on it; {self.engine!r} runs static batches")

    def make_engine(self, lm: LoadedModel) -> ContinuousEngine:
        return make_engine(self.engine, lm, max_num_seqs=self.max_num_seqs,
                           max_num_batched_tokens=self.max_num_batched_tokens,
                           kv_cache_bytes=self.kv_cache_bytes)


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def create_app(lm: LoadedModel, engine: ContinuousEngine, model_name: str,
               max_waiting: int = 1024, arrival_window_s: float = 0.0) -> FastAPI:
    """The app; its lifespan starts the engine loop and stops it (aborting what is left)."""
    metrics = ServerMetrics(engine)
    engine_loop = EngineLoop(engine, metrics, max_waiting, arrival_window_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine_loop.start()
        yield
        engine_loop.stop()

    app = FastAPI(title="miniinfer", lifespan=lifespan)
    app.state.engine_loop = engine_loop

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(APIError(500, f"{type(exc).__name__}: {exc}", "server_error").body(),
                            status_code=500)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "miniinfer",
                                            "max_model_len": lm.max_context}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate("completion", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate("chat", request)

    async def _generate(kind: str, http_request: Request) -> Response:
        body = parse_json(await http_request.body())
        model = body.get("model")
        if isinstance(model, str) and model and model != model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                           f"{model_name!r}", param="model", code="model_not_found")
        request = parse_request(kind, body, lm)
        try:  # prompt too long for the context or the KV pool, token ids outside the vocab
            engine.validate([request.prompt_ids], request.params)
        except MiniInferError as exc:
            raise invalid(str(exc), "messages" if kind == "chat" else "prompt") from None
        responder = Responder.new(request)
        handle = RequestHandle(responder.request_id, request.prompt_ids, request.params,
                               request.stop, asyncio.get_running_loop())
        engine_loop.submit(handle)  # a 429 when the queue is full
        if request.stream:
            return StreamingResponse(_stream(request, responder, handle),
                                     media_type="text/event-stream")
        return JSONResponse(await _collect(request, responder, handle, http_request))

    async def _collect(request: GenerationRequest, responder: Responder,
                       handle: RequestHandle, http_request: Request) -> dict[str, Any]:
        """The whole answer at once. Nothing is written until the end, so nobody notices a
        client that hangs up meanwhile; a watcher does: with the body read, the connection's
        next ASGI message is ``http.disconnect``, and it only comes if the client goes."""
        token_ids: list[int] = []
        finished = False
        gone = asyncio.ensure_future(_disconnected(http_request))
        try:
            while True:
                next_update = asyncio.ensure_future(handle.updates.get())
                await asyncio.wait((next_update, gone), return_when=asyncio.FIRST_COMPLETED)
                if not next_update.done():
                    next_update.cancel()
                    logger.info("client of %s went away; aborting it", handle.request_id)
                    return {}  # nobody reads it; the finally aborts the request
                update = next_update.result()
                if update.error is not None:
                    finished = True
                    raise update.error
                token_ids += update.token_ids
                if update.finish_reason is not None:
                    finished = True
                    text = TextStream(lm, request.stop).add(token_ids, update.finish_reason)
                    return responder.response(text, token_ids, update.finish_reason)
        finally:
            gone.cancel()
            if not finished:  # failed, cancelled or abandoned: free the request's blocks
                engine_loop.abort(handle.request_id)

    async def _disconnected(http_request: Request) -> None:
        while (await http_request.receive())["type"] != "http.disconnect":
            pass

    async def _stream(request: GenerationRequest, responder: Responder,
                      handle: RequestHandle) -> AsyncIterator[str]:
        """Server-sent events. A client that disconnects cancels this generator (Starlette
        watches the connection), and the ``finally`` aborts the request."""
        text = TextStream(lm, request.stop)
        finished = False
        try:
            if request.kind == "chat":
                yield _sse(responder.role_chunk())
            while True:
                update = await handle.updates.get()
                if update.error is not None:
                    finished = True
                    yield _sse(update.error.body())  # the status line has gone out already
                    return
                delta = text.add(update.token_ids, update.finish_reason)
                yield _sse(responder.chunk(delta, update.token_ids, update.finish_reason))
                if update.finish_reason is not None:
                    break
            finished = True
            if request.include_usage:
                yield _sse(responder.usage_chunk(len(text.token_ids)))
            yield _sse("[DONE]")
        except Exception as exc:
            logger.exception("stream of %s failed", handle.request_id)
            yield _sse(APIError(500, f"{type(exc).__name__}: {exc}", "server_error").body())
        finally:
            if not finished:
                engine_loop.abort(handle.request_id)

    return app


class Server(uvicorn.Server):
    """uvicorn, but on SIGTERM or Ctrl-C the requests in flight are aborted first: uvicorn
    waits for open connections to finish, and a stream would otherwise run to its end."""

    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop) -> None:
        super().__init__(config)
        self.engine_loop = engine_loop

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.engine_loop.abort_all()
        super().handle_exit(sig, frame)


def build_server(config: ServerConfig, lm: LoadedModel | None = None,
                 log_level: str = "warning") -> tuple[Server, socket.socket]:
    """The server and its listening socket (bound here, so ``port=0`` gets a free port that
    is known before anything runs)."""
    lm = lm or load_model(config.model, device=config.device, dtype=config.dtype)
    engine = config.make_engine(lm)
    app = create_app(lm, engine, config.model, config.max_waiting,
                     config.arrival_window_ms / 1e3)
    sock = socket.create_server((config.host, config.port))
    host, port = sock.getsockname()[:2]
    uv_config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                               access_log=False, timeout_graceful_shutdown=10)
    return Server(uv_config, app.state.engine_loop), sock


def run_server(config: ServerConfig) -> None:
    """``python -m miniinfer serve``: serve until SIGTERM or Ctrl-C, then return normally."""
    server, sock = build_server(config)
    host, port = sock.getsockname()[:2]
    print(f"miniinfer: serving {config.model} with engine {config.engine} at "
          f"http://{host}:{port}/v1", flush=True)
    # After a graceful shutdown uvicorn raises the signal again for the handler that was
    # there before it; with Python's defaults that kills the process (SIGTERM) or raises
    # KeyboardInterrupt. These handlers make that second delivery a no-op, so we exit 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
