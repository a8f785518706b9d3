"""``llama-server``, chapter 15's peer: the server CPU users deploy, on the very GGUF file our
model ships as (SmolLM2's Q4_1), driven over HTTP by the same client and workloads as ours.

``make peers-llama`` builds it beside chapter 13's tools, from the same pinned source, without
its web UI. It is started at its documented best for a small CPU: every core's thread for
decode and batch work, continuous batching on, one parallel slot per client the run can have
(each slot's context large enough for the longest request), prompts cached per slot, and the
model under our model's name so that the client's check of ``/v1/models`` passes.

    python -m miniinfer.bench.peers.llama_server --parallel 4      # then, in another shell:
    python -m miniinfer bench-serving --base-url http://127.0.0.1:8002/v1
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from . import PeerMissingError, answers
from .llama_cpp import INSTALL_HINT, llama_cpp_dir, version
from .vllm_peer import stop_process

STARTUP_TIMEOUT_S = 120.0


def find_llama_server() -> Path:
    """The built ``llama-server``; raises :class:`PeerMissingError` (one line saying how to
    build it) where it is not there."""
    path = llama_cpp_dir() / "bin" / "llama-server"
    if not os.access(path, os.X_OK):
        raise PeerMissingError(f"llama-server is not built as a peer ({path} is missing): "
                               f"{INSTALL_HINT}")
    return path


@dataclass(slots=True, weakref_slot=True, eq=False)
class LlamaServer:
    """A running ``llama-server``; stopped by ``close`` (or a ``with`` block, or at exit)."""

    process: subprocess.Popen
    base_url: str  # ends in /v1
    log_path: Path
    version: str
    _finalizer: weakref.finalize = field(init=False, repr=False)

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def server_args(gguf: Path, served_model_name: str, *, port: int, host: str, threads: int,
                parallel: int, context_per_slot: int) -> list[str]:
    """The command line: the settings llama.cpp's server documentation gives for serving
    several clients on a CPU."""
    return ["-m", str(gguf), "--alias", served_model_name, "--host", host, "--port", str(port),
            "-t", str(threads), "-tb", str(threads), "-np", str(parallel),
            "-c", str(parallel * context_per_slot), "-cb",
            "-b", "2048", "-ub", "512", "--seed", "0"]


def start_llama_server(gguf: Path, served_model_name: str, *, port: int = 8002,
                       host: str = "127.0.0.1", threads: int | None = None, parallel: int = 4,
                       context_per_slot: int = 2048,
                       timeout_s: float = STARTUP_TIMEOUT_S) -> LlamaServer:
    """Start ``llama-server`` on ``gguf`` and wait until its ``/v1/models`` answers."""
    binary = find_llama_server()
    threads = threads or os.cpu_count() or 1
    log = tempfile.NamedTemporaryFile("w", prefix="miniinfer-llama-server-", suffix=".log",
                                      delete=False)
    process = subprocess.Popen(
        [str(binary), *server_args(gguf, served_model_name, port=port, host=host,
                                   threads=threads, parallel=parallel,
                                   context_per_slot=context_per_slot)],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    server = LlamaServer(process, f"http://{host}:{port}/v1", Path(log.name), version())
    server._finalizer = weakref.finalize(server, stop_process, process, log, 0)
    deadline = time.monotonic() + timeout_s
    while not answers(f"{server.base_url}/models"):
        if process.poll() is not None or time.monotonic() > deadline:
            server.close()
            why = f"exited with status {process.returncode}" if process.returncode is not None \
                else f"did not answer in {timeout_s:.0f} s"
            tail = Path(log.name).read_text().strip().splitlines()[-1:] or ["(empty log)"]
            raise PeerMissingError(f"llama-server {why}; its log {log.name} ends: {tail[0]}")
        time.sleep(0.5)
    return server


def main(argv: list[str] | None = None) -> int:
    from ...core.models import smollm2_gguf

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8002)
    parser.add_argument("--parallel", type=int, default=4, help="slots (clients at once)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    with start_llama_server(smollm2_gguf(), "smollm2-135m", port=args.port, host=args.host,
                            threads=args.threads, parallel=args.parallel) as server:
        print(f"{server.version} serves smollm2-135m at {server.base_url} (log: "
              f"{server.log_path}); Ctrl-C stops it", flush=True)
        try:
            while server.process.poll() is None:
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
