"""What tensor parallelism costs (chapter 12): the all-reduces measured on this machine, and
the arithmetic of TP for big models on H100s, on paper.

A TP step does ``2 x num_layers`` all-reduces of ``tokens x hidden`` values (one after o_proj,
one after down_proj; see :mod:`.tensor_parallel`), each between two matmuls that need its
result, so none of them hides behind compute. What TP buys is that each device reads only
``1 / N`` of the layers' weights per step; what it costs is those all-reduces. At batch 1 a
message is a few KB, so each all-reduce costs its *latency*, not bandwidth.

- :func:`measure_all_reduce` times one all-reduce per message size on gloo (the CPU backend),
  with N processes on this machine. On a 2-core CPU TP cannot be faster: N processes share the
  same cores and the same memory bandwidth, so splitting the weights splits no bottleneck, and
  every all-reduce is added on top.
- :func:`paper_tensor_parallel` is the same bookkeeping for a model on H100s, from the
  assumptions below (named, so the chapter prints them next to the table).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..core.models import CONFIG_DIR, dtype_name
from .tensor_parallel import (
    DEFAULT_START_TIMEOUT_S,
    EXIT_GRACE_S,
    LOCALHOST,
    STORE_PREFIX,
    Rendezvous,
    Workers,
    _layout_problems,
    check_no_process_group,
    report_ready,
    wait_ready,
)

# 1 KiB .. 4 MiB by powers of 4. A decode step's message is batch x hidden x dtype bytes:
# SmolLM2 fp32 at batch 1 is 2.3 KB; Qwen2.5-7B bf16 at batch 64 is 459 KB.
DEFAULT_MESSAGE_BYTES = tuple(1024 * 4 ** k for k in range(7))
MEASURE_TIMEOUT_S = 120.0

# -- assumptions of the paper model (H100 SXM, one 8-GPU NVLink node) ----------------------------
H100_MEMORY_BYTES = 80e9
H100_HBM_BYTES_PER_S = 3.35e12  # HBM3 peak
NVLINK_BYTES_PER_S = 450e9  # NVLink 4: 900 GB/s per GPU in both directions, 450 GB/s each way
# A small-message all-reduce over NVLink is latency-bound: about 5 us at best, 10 us typical.
ALL_REDUCE_LATENCY_BEST_S = 5e-6
ALL_REDUCE_LATENCY_TYPICAL_S = 10e-6
PAPER_DTYPE_BYTES = 2  # bf16 weights and activations
PAPER_TP_SIZES = (1, 2, 4, 8)


# What the timed all-reduces sum: a TP step's activations in fp32 (4 bytes an element).
MESSAGE_DTYPE = torch.float32


def measure_all_reduce(world_sizes: tuple[int, ...] = (2, 3),
                       message_bytes: tuple[int, ...] = DEFAULT_MESSAGE_BYTES,
                       repeats: int = 20, warmup: int = 3) -> list[dict]:
    """Time one float32 all-reduce per message size on gloo with N local processes (this one
    is rank 0): every repeat starts with a barrier, so all ranks enter together, as they do
    in a TP step. One row per (N, size): p50 and min in microseconds and the bandwidths
    (algbw = bytes / time; busbw = algbw x 2 (N - 1) / N, what a ring moves per rank, the
    convention of nccl-tests), for the chapter's table."""
    rows = []
    for n in world_sizes:
        if n < 2:
            raise ValueError(f"an all-reduce needs at least 2 ranks, got world size {n}")
        check_no_process_group()
        workers = Workers(n, _timing_worker, (message_bytes, repeats, warmup),
                          DEFAULT_START_TIMEOUT_S)
        rdv = workers.rendezvous(n, 0)
        try:
            wait_ready(rdv, workers, "start", DEFAULT_START_TIMEOUT_S)
            _join_gloo(rdv)
            times = _time_all_reduces(message_bytes, repeats, warmup)
        except Exception:
            workers.wait_for_exit(EXIT_GRACE_S)  # a worker that died is named
            raise
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            workers.stop(grace_s=10.0)
        workers.check()  # a worker that failed at the end says so here
        for nbytes, seconds in times.items():
            p50 = statistics.median(seconds)
            algbw = nbytes / p50 / 1e9
            rows.append({"world_size": n, "backend": "gloo", "message_bytes": nbytes,
                         "p50_us": p50 * 1e6, "min_us": min(seconds) * 1e6,
                         "algbw_GBps": algbw, "busbw_GBps": algbw * 2 * (n - 1) / n,
                         "repeats": repeats, "dtype": dtype_name(MESSAGE_DTYPE)})
    return rows


def _join_gloo(rdv: Rendezvous) -> None:
    dist.init_process_group("gloo", store=dist.PrefixStore("pg/", rdv.store), rank=rdv.rank,
                            world_size=rdv.world_size,
                            timeout=timedelta(seconds=MEASURE_TIMEOUT_S))


def _time_all_reduces(message_bytes: tuple[int, ...], repeats: int,
                      warmup: int) -> dict[int, list[float]]:
    times = {}
    for nbytes in message_bytes:
        x = torch.zeros(nbytes // 4, dtype=MESSAGE_DTYPE)  # zeros: sums stay finite
        for _ in range(warmup):
            dist.all_reduce(x)
        seconds = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            seconds.append(time.perf_counter() - start)
        times[nbytes] = seconds
    return times


def _timing_worker(index: int, port: int, world_size: int, start_timeout_s: float,
                   cuda_base: int, message_bytes: tuple[int, ...], repeats: int,
                   warmup: int) -> None:
    store = dist.TCPStore(LOCALHOST, port, world_size, is_master=False,
                          timeout=timedelta(seconds=start_timeout_s))
    rdv = Rendezvous(index + 1, world_size, cuda_base, dist.PrefixStore(STORE_PREFIX, store))
    report_ready(rdv)
    _join_gloo(rdv)
    _time_all_reduces(message_bytes, repeats, warmup)
    dist.destroy_process_group()


# -- the paper model -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Architecture:
    """The numbers of a Llama/Qwen2 model that TP arithmetic needs (HF config field names)."""

    name: str
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v biases (Qwen2)

    @classmethod
    def from_config(cls, name: str, config: dict) -> Architecture:
        heads = config["num_attention_heads"]
        return cls(name, config["num_hidden_layers"], config["hidden_size"], heads,
                   config.get("num_key_value_heads", heads),
                   config.get("head_dim") or config["hidden_size"] // heads,
                   config["intermediate_size"], config["vocab_size"],
                   config.get("tie_word_embeddings", False),
                   config.get("attention_bias", config.get("model_type") == "qwen2"))

    def layer_params(self, tensor_parallel: int = 1) -> int:
        """One decoder layer's parameters on one rank at TP=N (KV heads replicated past N)."""
        n, d, h = tensor_parallel, self.head_dim, self.hidden_size
        q_out = self.num_attention_heads // n * d
        kv_out = max(1, self.num_key_value_heads // n) * d
        attention = h * (q_out + 2 * kv_out) + q_out * h
        if self.attention_bias:
            attention += q_out + 2 * kv_out
        return attention + 3 * h * (self.intermediate_size // n) + 2 * h  # + the two norms

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size


def qwen25_7b() -> Architecture:
    config = json.loads((CONFIG_DIR / "qwen2.5-7b-instruct.json").read_text())
    return Architecture.from_config("Qwen2.5-7B", config)


# Llama-3-70B's config.json (meta-llama/Meta-Llama-3-70B), written out: not in data/configs,
# since no engine builds it.
LLAMA_70B = Architecture("Llama-3-70B", num_hidden_layers=80, hidden_size=8192,
                         num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                         intermediate_size=28672, vocab_size=128256, tie_word_embeddings=False,
                         attention_bias=False)


def paper_tensor_parallel(arch: Architecture, tp_sizes: tuple[int, ...] = PAPER_TP_SIZES,
                          batch_size: int = 1) -> list[dict]:
    """TP=N of ``arch`` on H100s in bf16, with this package's layout (embedding on every rank,
    LM head on rank 0; rank 0 is the one that reads most, so its numbers are the step's):

    - weights per device and whether they fit an 80 GB H100 (the rest is KV cache room);
    - the bandwidth floor of a decode step: rank 0's weight bytes / HBM bandwidth;
    - ``2 x layers`` all-reduces of ``batch x hidden`` bf16 values, each ``latency + 2 (N-1)/N
      x bytes / NVLink bandwidth`` (a ring), at the best and the typical latency;
    - the step floor, bandwidth floor + all-reduces (they do not overlap: each sits between
      matmuls that need its result), and the speed-up over TP=1.

    A size that cannot split the model's heads gets a row with the reason instead."""
    rows = []
    base_ms = None
    for n in tp_sizes:
        row: dict = {"model": arch.name, "tp": n, "batch_size": batch_size}
        if problems := _layout_problems(arch, n):
            rows.append(row | {"note": "; ".join(problems)})
            continue
        layers = arch.num_hidden_layers * arch.layer_params(n)
        lm_head = 0 if arch.tie_word_embeddings else arch.embedding_params
        rank0 = (layers + arch.embedding_params + lm_head + arch.hidden_size) * PAPER_DTYPE_BYTES
        # A decode step reads every layer weight and the LM head (tied: the embedding); the
        # embedding lookup reads only batch rows.
        read = (layers + arch.embedding_params + arch.hidden_size) * PAPER_DTYPE_BYTES
        floor_ms = read / H100_HBM_BYTES_PER_S * 1e3
        message = batch_size * arch.hidden_size * PAPER_DTYPE_BYTES
        count = 2 * arch.num_hidden_layers if n > 1 else 0
        wire_s = 2 * (n - 1) / n * message / NVLINK_BYTES_PER_S
        comm_best_ms = count * (ALL_REDUCE_LATENCY_BEST_S + wire_s) * 1e3
        comm_typical_ms = count * (ALL_REDUCE_LATENCY_TYPICAL_S + wire_s) * 1e3
        kv_per_token = (arch.num_hidden_layers * 2 * max(1, arch.num_key_value_heads // n)
                        * arch.head_dim * PAPER_DTYPE_BYTES)
        if base_ms is None and n == 1:
            base_ms = floor_ms
        row |= {
            "weights_per_device_GB": rank0 / 1e9,
            "fits_h100": rank0 < H100_MEMORY_BYTES,
            "kv_room_GB": max(0.0, (H100_MEMORY_BYTES - rank0) / 1e9),
            "kv_bytes_per_token_per_device": kv_per_token,
            "bandwidth_floor_ms": floor_ms,
            "all_reduces_per_step": count,
            "all_reduce_message_bytes": message,
            "all_reduce_us_best": (ALL_REDUCE_LATENCY_BEST_S + wire_s) * 1e6 if count else 0.0,
            "comm_ms_best": comm_best_ms,
            "comm_ms_typical": comm_typical_ms,
            "step_floor_ms_best": floor_ms + comm_best_ms,
            "step_floor_ms_typical": floor_ms + comm_typical_ms,
        }
        if base_ms is not None:
            row["speedup_best"] = base_ms / row["step_floor_ms_best"]
            row["speedup_typical"] = base_ms / row["step_floor_ms_typical"]
        rows.append(row)
    return rows


def paper_assumptions() -> dict[str, float]:
    """The constants :func:`paper_tensor_parallel` assumes, for the chapter to print."""
    return {"h100_memory_bytes": H100_MEMORY_BYTES, "hbm_bytes_per_s": H100_HBM_BYTES_PER_S,
            "nvlink_bytes_per_s_per_direction": NVLINK_BYTES_PER_S,
            "all_reduce_latency_best_s": ALL_REDUCE_LATENCY_BEST_S,
            "all_reduce_latency_typical_s": ALL_REDUCE_LATENCY_TYPICAL_S,
            "dtype_bytes": PAPER_DTYPE_BYTES}


__all__ = ["LLAMA_70B", "Architecture", "measure_all_reduce", "paper_assumptions",
           "paper_tensor_parallel", "qwen25_7b"]
