"""vLLM's own load client, ``vllm bench serve``, run from the peer venv against any
OpenAI-compatible server: ours (``miniinfer serve``) or ``vllm serve``. Chapter 10 records both
with the same random prompts, so the field's standard client is the judge of our server.

    run_vllm_bench_serve("http://127.0.0.1:8000", "smollm2-135m", tokenizer_dir,
                         backend="openai-chat")
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import find_vllm
from .vllm_server import LAUNCHER

# vllm bench serve's backends for the two endpoints a server of ours answers.
ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
# What a row keeps of the client's result file (its names; times in ms).
RESULT_KEYS = ("completed", "failed", "total_input_tokens", "total_output_tokens", "duration",
               "request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms",
               "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms",
               "median_itl_ms", "p99_itl_ms")


@dataclass(frozen=True, slots=True)
class RandomPrompts:
    """vllm bench serve's ``random`` dataset: ``num_prompts`` prompts of ``input_len`` tokens,
    each asking for ``output_len`` tokens with EOS ignored, all sent at once."""

    num_prompts: int = 32
    input_len: int = 128
    output_len: int = 64
    seed: int = 0


def run_vllm_bench_serve(server_url: str, model: str, tokenizer: Path, backend: str = "openai",
                         prompts: RandomPrompts | None = None,
                         timeout_s: float = 1800) -> dict[str, Any]:
    """One ``vllm bench serve`` run against the server at ``server_url`` (no ``/v1``); returns
    :data:`RESULT_KEYS` of its result file, ``first_error`` (a failed request's reason) and
    ``client`` (the peer's build). Raises
    ``RuntimeError`` with the end of the client's output when it fails."""
    prompts = prompts or RandomPrompts()
    if backend not in ENDPOINTS:
        raise ValueError(f"backend must be one of {', '.join(ENDPOINTS)}, got {backend!r}")
    install = find_vllm()
    with tempfile.TemporaryDirectory(prefix="miniinfer-vllm-bench-") as out:
        args = ["bench", "serve", "--backend", backend, "--base-url", server_url.rstrip("/"),
                "--endpoint", ENDPOINTS[backend], "--model", model, "--tokenizer", str(tokenizer),
                "--dataset-name", "random", "--num-prompts", str(prompts.num_prompts),
                "--random-input-len", str(prompts.input_len),
                "--random-output-len", str(prompts.output_len), "--seed", str(prompts.seed),
                "--ignore-eos", "--disable-tqdm", "--save-result", "--result-dir", out,
                "--result-filename", "result.json"]
        done = subprocess.run([str(install.python), str(LAUNCHER), *args], capture_output=True,
                              text=True, timeout=timeout_s,
                              env=_client_env())
        path = Path(out) / "result.json"
        if done.returncode != 0 or not path.exists():
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-5:])
            raise RuntimeError(f"vllm bench serve --backend {backend} exited with status "
                               f"{done.returncode}: {tail}")
        result = json.loads(path.read_text())
    # A failed request's reason, as the client saw it (the first one; none when all completed).
    first_error = next((e for e in result.get("errors") or [] if e), "")
    return {key: result.get(key) for key in RESULT_KEYS} | {
        "first_error": first_error.strip().splitlines()[-1][:200] if first_error else "",
        "client": install.label}


def _client_env() -> dict[str, str]:
    """This process's environment for the peer's interpreter, less what points into ours, and
    offline: the client reads the tokenizer from a directory."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return env | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
