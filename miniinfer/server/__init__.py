"""Chapter 10: the continuous-batching engine behind an OpenAI-compatible HTTP API.

- ``protocol``: request bodies checked into engine requests; responses, stream chunks and
  errors in OpenAI's shapes; the output text as it grows (stop strings held back and cut).
- ``engine_loop``: the one thread that steps the engine; handlers only enqueue and read.
- ``metrics``: ``GET /metrics`` in Prometheus' text format.
- ``app``: the FastAPI app and the uvicorn server (``python -m miniinfer serve``).
- ``process``: a server in a child process (the notebook, ``make chapter-10``, tests).
"""

from .app import Server, ServerConfig, build_server, create_app, run_server
from .engine_loop import EngineLoop, RequestHandle, Update
from .metrics import ServerMetrics
from .process import ServerProcess
from .protocol import APIError, GenerationRequest, TextStream, parse_request

__all__ = ["APIError", "EngineLoop", "GenerationRequest", "RequestHandle", "Server",
           "ServerConfig", "ServerMetrics", "ServerProcess", "TextStream", "Update",
           "build_server", "create_app", "parse_request", "run_server"]
