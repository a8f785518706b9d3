"""Chapter 10: the continuous-batching engine behind an OpenAI-compatible HTTP API.

- ``protocol``: request and response models (pydantic, parsed from the raw bytes), and errors
  in OpenAI's shape.
- ``generation``: a parsed request as engine requests (prompts, ``n``, ``best_of``, sampling
  parameters), and their tokens back as OpenAI's responses and stream chunks.
- ``tokens``: bounded tokenising off the event loop, and the output text as it grows (stop
  strings held back and cut).
- ``engine_loop``: the one thread that steps the engine; handlers only enqueue and read.
- ``metrics``: ``GET /metrics`` in Prometheus' text format, under vLLM's names.
- ``app``: the FastAPI app and the uvicorn server (``python -m miniinfer serve``).
- ``process``: a server in a child process (the notebook, ``make chapter-10``, tests).
"""

from .app import Server, ServerConfig, build_server, create_app, run_server
from .engine_loop import EngineLoop, RequestHandle, Update
from .generation import GenerationRequest
from .metrics import ServerMetrics
from .process import ServerProcess
from .protocol import APIError
from .tokens import PromptTokenizer, TextStream

__all__ = ["APIError", "EngineLoop", "GenerationRequest", "PromptTokenizer", "RequestHandle",
           "Server", "ServerConfig", "ServerMetrics", "ServerProcess", "TextStream", "Update",
           "build_server", "create_app", "run_server"]
