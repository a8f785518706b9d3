"""What each chapter's recording runs on a device: the model, the benchmark sizes, the sweeps and
the serving experiments. Defaults follow the device: on CUDA the reference posts' model
(random-weight Qwen2.5-7B, bf16), on CPU the real SmolLM2-135M in fp32."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from ..bench.offline import BenchConfig
from ..bench.serving import ServingBenchConfig, WorkloadConfig
from ..core.models import default_model
from .chapters import CHAPTERS


def default_workload(device: torch.device, chapter: str | None = None) -> tuple[str, BenchConfig]:
    """Model and benchmark sizes for a chapter run on this device (``chapter``: its own decode
    length where the registry gives one)."""
    if device.type == "cuda":
        # GPU timings are steady: 3 repeats do. 64 new tokens keep every chapter within one
        # device call (see COSTS and `repro all --dry-run`).
        return default_model(device), BenchConfig(batch_sizes=(1, 4, 8), prompt_len=64,
                                                  new_tokens=64, warmup=1, repeat=3)
    # The book's CPU tables are one recording of every chapter in one sitting (`repro all`, at
    # most 90 minutes on 2 cores), so a CPU run is batch 1 and 8 (what batching buys, without
    # the middle point), 32 decode steps (enough for a median step) and 3 repeats (a median
    # ratio and a min-max spread). MINIINFER_QUICK=1 halves the decode length (a reader in a
    # hurry).
    new_tokens = (chapter and CHAPTERS[chapter].new_tokens) or 32
    quick = os.environ.get("MINIINFER_QUICK") == "1"
    return default_model(device), BenchConfig(batch_sizes=(1, 8), prompt_len=64,
                                              new_tokens=new_tokens // 2 if quick else new_tokens,
                                              warmup=1, repeat=3)


@dataclass(frozen=True, slots=True)
class ContextSweep:
    """Chapters 03/04/06's context-length sweep: batch ``batch_size`` at each prompt length, one
    plain run per engine (decode step time) and, for the paged stages, one profiled run
    (per-phase ms per step). Fewer tokens and no repeats, unlike the chapter's benchmark: its
    long prefills are what cost time (a batch of 8 x 1024 tokens takes ~10 s on 2 cores)."""

    context_lens: tuple[int, ...]
    batch_size: int = 8
    new_tokens: int = 16
    profiled_steps: int = 4


def context_sweep(device: torch.device) -> ContextSweep:
    if device.type == "cuda":
        return ContextSweep((128, 512, 1024, 2048, 4096), new_tokens=32, profiled_steps=4)
    # The two ends of what a 2-core CPU prefills in seconds (a batch of 8 x 1024 tokens is
    # 8k tokens of prefill per run); 2048 would more than double the sweep.
    return ContextSweep((128, 1024), new_tokens=8, profiled_steps=3)


def chapter05_profile_steps(device: torch.device) -> int:
    return 20 if device.type == "cuda" else 8


def serving_experiments(device: torch.device) -> tuple[str, dict[str, ServingBenchConfig]]:
    """Model and the three serving experiments of chapter 08 on this device:

    - ``target``: every system on the same offline workload (32 requests on a CPU, 128 on a
      GPU; prompts of 16-256 tokens, 32-128 new tokens);
    - ``budget``: continuous batching at several token budgets on 32 requests with shorter
      outputs, all arriving at once so that every budget runs saturated (the chunked-prefill
      trade-off; each budget one point of the wde post's throughput-latency curve);
    - ``rate``: those 32 requests arriving at several request rates, from below what every
      system sustains to above it, per system.
    """
    static = ("static-paged-attention", "static-hf")
    if device.type == "cuda":
        # 128 requests of up to 384 tokens of Qwen2.5-7B K/V (56 KiB a token) need 2.7 GiB at
        # once: a pool of 8 GiB serves them without preemption, as transformers' would. Sized
        # so the chapter takes about 4 minutes on one H100 (static batching by 8 dominates);
        # the online experiments get 32 requests, a few seconds of arrivals each.
        target = WorkloadConfig(num_requests=128)
        kv = 8 << 30
        return default_model(device), {
            "target": ServingBenchConfig(target, ("continuous", *static, "hf-cb"),
                                         max_num_batched_tokens=(2048,), kv_cache_bytes=kv),
            "budget": ServingBenchConfig(replace(target, num_requests=32),
                                         ("continuous",),
                                         max_num_batched_tokens=(256, 512, 1024, 2048, 4096),
                                         kv_cache_bytes=kv),
            "rate": ServingBenchConfig(replace(target, num_requests=32),
                                       ("continuous", "static-paged-attention", "hf-cb"),
                                       request_rates=(4.0, 8.0, 16.0),
                                       max_num_batched_tokens=(2048,), kv_cache_bytes=kv),
        }
    # Sized for a few minutes on 2 cores (the whole book records in one sitting). The budget
    # sweep sends its requests all at once, so every budget is measured saturated. The rate
    # sweep has one rate below what every system sustains (hf-cb saturates near 1 request/s
    # here, continuous near 3) and one above it.
    online = WorkloadConfig(num_requests=16, output_len=(16, 64))
    return default_model(device), {
        "target": ServingBenchConfig(WorkloadConfig(num_requests=16),
                                     ("continuous", *static, "hf-cb"),
                                     max_num_batched_tokens=(512,)),
        "budget": ServingBenchConfig(online, ("continuous",),
                                     max_num_batched_tokens=(32, 128, 512)),
        "rate": ServingBenchConfig(online, ("continuous", "static-paged-attention", "hf-cb"),
                                   request_rates=(1.0, 4.0),
                                   max_num_batched_tokens=(512,)),
    }


PREFIX_LENS = (0, 128, 256, 512, 1024)
CPU_PREFIX_LENS = (0, 256, 1024)  # the ends and the middle: the sweep's prefills dominate a CPU


def prefix_cache_experiments(device: torch.device) -> tuple[str, dict[str, ServingBenchConfig]]:
    """Model and the serving experiments of chapter 09 on this device (EOS ignored):

    - ``shared-prefix``: 16 requests (128 on a GPU) arriving at once, one
      512-token system prompt, 16-64-token questions, 32-96 new tokens; with ``hf-cb``;
    - ``multi-turn``: 4 conversations (32 on a GPU) of 4 turns, messages of 16-64 tokens,
      replies of 32-96, turns 5 s apart;
    - ``nothing-shared``: chapter 08's workload (prompts 16-256, 32-128 new tokens), the cost of
      the bookkeeping when no prompt shares a block;
    - ``prefix-len``: 8 requests (64 on a GPU) at once, system prompts of 0 to 1024 tokens.
    """
    gpu = device.type == "cuda"
    # 8x on a GPU: the chapter stays within a couple of minutes on one H100, and within a few
    # on 2 CPU cores.
    scale = 8 if gpu else 1
    pair = ("continuous", "prefix-cache")
    shared = WorkloadConfig(num_requests=16 * scale, prompt_len=(16, 64), output_len=(32, 96),
                            kind="shared-prefix", shared_prefix_len=512)
    options = {"max_num_batched_tokens": (2048,), "kv_cache_bytes": 8 << 30} if gpu \
        else {"max_num_batched_tokens": (512,)}
    experiments = {
        "shared-prefix": ServingBenchConfig(shared, (*pair, "hf-cb"), chapter="09", **options),
        "multi-turn": ServingBenchConfig(
            replace(shared, kind="multi-turn", num_requests=16 * scale, turns=4, turn_gap_s=5.0),
            pair, chapter="09", **options),
        "nothing-shared": ServingBenchConfig(WorkloadConfig(num_requests=16 * scale), pair,
                                             chapter="09", **options),
    }
    for n in PREFIX_LENS if gpu else CPU_PREFIX_LENS:
        experiments[f"prefix-len-{n}"] = ServingBenchConfig(
            replace(shared, num_requests=8 * scale, output_len=(32, 64), shared_prefix_len=n),
            pair, chapter="09", **options)
    return default_model(device), experiments


# Chapter 12's split of SmolLM2: its 3 KV heads allow 3 ranks (and 9 query heads, 1536 MLP
# channels divide by 3).
TENSOR_PARALLEL = 3


def server_cost_workload(device: torch.device) -> WorkloadConfig:
    """Chapter 10's server-cost measurement: each request alone, in-process and over HTTP;
    enough of them for a p90, with answers short enough that one takes about a second on a
    CPU (shorter still on a GPU, where each chapter must fit one device call).
    """
    if device.type == "cuda":
        return WorkloadConfig(num_requests=50, prompt_len=(16, 128), output_len=(2, 6), seed=10)
    return WorkloadConfig(num_requests=40, prompt_len=(16, 256), output_len=(4, 12), seed=10)
