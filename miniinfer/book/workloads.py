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


def default_workload(device: torch.device) -> tuple[str, BenchConfig]:
    """Model and benchmark sizes for a chapter run on this device."""
    if device.type == "cuda":
        # GPU timings are steady: 3 repeats do. 64 new tokens keep every chapter within one
        # device call (see COSTS and `repro all --dry-run`).
        return default_model(device), BenchConfig(batch_sizes=(1, 4, 8), prompt_len=64,
                                                  new_tokens=64, warmup=1, repeat=3)
    # A shared CPU drifts by 10-30% within minutes and single paired ratios move by 5-12
    # points, so 5 repeats: enough for a median ratio and a min-max spread that mean something,
    # and the whole book still records in one sitting (`repro all --dry-run`).
    # MINIINFER_QUICK=1 halves the decode length and keeps 3 repeats (a reader in a hurry).
    quick = os.environ.get("MINIINFER_QUICK") == "1"
    return default_model(device), BenchConfig(batch_sizes=(1, 4, 8), prompt_len=64,
                                              new_tokens=32 if quick else 64, warmup=1,
                                       repeat=3 if quick else 5)


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
    # About 2 minutes per chapter on 2 cores; 2048 would more than double it (prefill).
    return ContextSweep((128, 512, 1024))


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
    # Sized to take about 12 minutes on 2 cores. The budget sweep sends its requests all at
    # once, so every budget is measured saturated (arriving at 1 request/s, 16 requests were
    # arrival-bound: throughput could not move). The rate sweep starts below what every system
    # sustains (hf-cb saturates near 1 request/s here, continuous near 3) and ends above it;
    # 32 requests, with arrival gaps that scale with 1 / rate (one seed), keep the curves
    # monotonic where 16 did not.
    online = WorkloadConfig(num_requests=32, output_len=(16, 64))
    return default_model(device), {
        "target": ServingBenchConfig(WorkloadConfig(num_requests=32),
                                     ("continuous", *static, "hf-cb"),
                                     max_num_batched_tokens=(512,)),
        "budget": ServingBenchConfig(online, ("continuous",),
                                     max_num_batched_tokens=(32, 64, 128, 256, 512)),
        "rate": ServingBenchConfig(online, ("continuous", "static-paged-attention", "hf-cb"),
                                   request_rates=(1.0, 2.0, 4.0),
                                   max_num_batched_tokens=(512,)),
    }


PREFIX_LENS = (0, 128, 256, 512, 1024)


def prefix_cache_experiments(device: torch.device) -> tuple[str, dict[str, ServingBenchConfig]]:
    """Model and the serving experiments of chapter 09 on this device (EOS ignored):

    - ``shared-prefix``: the issue's target, 32 requests (128 on a GPU) arriving at once, one
      512-token system prompt, 16-64-token questions, 32-96 new tokens; with ``hf-cb``;
    - ``multi-turn``: 8 conversations (32 on a GPU) of 4 turns, messages of 16-64 tokens,
      replies of 32-96, turns 5 s apart;
    - ``nothing-shared``: chapter 08's workload (prompts 16-256, 32-128 new tokens), the cost of
      the bookkeeping when no prompt shares a block;
    - ``prefix-len``: 16 requests (64 on a GPU) at once, system prompts of 0 to 1024 tokens.
    """
    gpu = device.type == "cuda"
    scale = 4 if gpu else 1  # 4x: the chapter stays within a couple of minutes on one H100
    pair = ("continuous", "prefix-cache")
    shared = WorkloadConfig(num_requests=32 * scale, prompt_len=(16, 64), output_len=(32, 96),
                            kind="shared-prefix", shared_prefix_len=512)
    options = {"max_num_batched_tokens": (2048,), "kv_cache_bytes": 8 << 30} if gpu \
        else {"max_num_batched_tokens": (512,)}
    experiments = {
        "shared-prefix": ServingBenchConfig(shared, (*pair, "hf-cb"), chapter="09", **options),
        "multi-turn": ServingBenchConfig(
            replace(shared, kind="multi-turn", num_requests=32 * scale, turns=4, turn_gap_s=5.0),
            pair, chapter="09", **options),
        "nothing-shared": ServingBenchConfig(WorkloadConfig(num_requests=32 * scale), pair,
                                             chapter="09", **options),
    }
    for n in PREFIX_LENS:
        experiments[f"prefix-len-{n}"] = ServingBenchConfig(
            replace(shared, num_requests=16 * scale, output_len=(32, 64), shared_prefix_len=n),
            pair, chapter="09", **options)
    return default_model(device), experiments


# Chapter 12's split of SmolLM2: its 3 KV heads allow 3 ranks (and 9 query heads, 1536 MLP
# channels divide by 3).
TENSOR_PARALLEL = 3


def server_cost_workload(device: torch.device) -> WorkloadConfig:
    """Chapter 10's server-cost measurement: each request alone, in-process and over HTTP;
    enough of them for a p99 (at least 50), with answers short enough that one takes about a
    second on a CPU (shorter still on a GPU, where each chapter must fit one device call)."""
    if device.type == "cuda":
        return WorkloadConfig(num_requests=50, prompt_len=(16, 128), output_len=(2, 6), seed=10)
    return WorkloadConfig(num_requests=60, prompt_len=(16, 256), output_len=(8, 24), seed=10)
