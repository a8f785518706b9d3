"""Chapter 10's judge from the field: vLLM's own load client, ``vllm bench serve``, driving our
server and ``vllm serve`` with the same random prompts, through both of its OpenAI backends
(``openai``: /v1/completions; ``openai-chat``: /v1/chat/completions). Needs the peer
(``make peers``); without it the chapter says so and records nothing here."""

from __future__ import annotations

import socket
from pathlib import Path

import pandas as pd
import torch

from ..bench.devices import REPO_ROOT, device_slug, recording_root, run_metadata
from ..bench.peers import VLLM, PeerMissingError, check_peer
from ..bench.peers.vllm_bench_serve import ENDPOINTS, RandomPrompts, run_vllm_bench_serve
from ..bench.peers.vllm_server import start_vllm_server
from ..core.models import smollm2_cache


def free_port() -> int:
    """A TCP port nothing on this machine listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def record_vllm_bench_serve(dev: torch.device, model: str, serve_args: list[str],
                            max_num_batched_tokens: int,
                            prompts: RandomPrompts | None = None,
                            dtype: str = "float32") -> list[Path]:
    """``vllm bench serve`` with each backend against ``miniinfer serve`` (``serve_args``) and
    against ``vllm serve`` with the same token budget and ``dtype`` (the one ``serve_args``
    give ours) -> ``ch10/<device>-vllm-bench.csv``, one row per server and backend. SmolLM2
    only: the client reads the tokenizer from its directory, and vLLM serves that directory."""
    from ..server import ServerProcess

    prompts = prompts or RandomPrompts()
    try:
        check_peer(VLLM)
    except PeerMissingError as missing:
        print(f"vllm bench serve not recorded: {missing}")
        return []
    if model != "smollm2-135m" or dev.type != "cpu":
        print(f"vllm bench serve is recorded with smollm2-135m on a CPU; not for {model} on {dev}")
        return []
    tokenizer = smollm2_cache()
    rows = []
    with ServerProcess(model, *serve_args) as ours:
        for backend in ENDPOINTS:
            rows.append({"server": "miniinfer", "backend": backend,
                         **run_vllm_bench_serve(ours.url, model, tokenizer, backend, prompts)})
            print(rows[-1])
    with start_vllm_server(tokenizer, model, port=free_port(), dtype=dtype,
                           max_num_batched_tokens=max_num_batched_tokens) as peer:
        for backend in ENDPOINTS:
            rows.append({"server": f"vllm serve ({peer.version})", "backend": backend,
                         **run_vllm_bench_serve(peer.base_url.removesuffix("/v1"), model,
                                                tokenizer, backend, prompts)})
            print(rows[-1])
    path = recording_root() / "ch10" / f"{device_slug(dev)}-vllm-bench.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).assign(chapter="10", model=model, dtype=dtype,
                              num_prompts=prompts.num_prompts,
                              input_len=prompts.input_len, output_len=prompts.output_len,
                              **run_metadata(dev)).to_csv(path, index=False)
    print(f"wrote {path.relative_to(REPO_ROOT)}")
    return [path]
