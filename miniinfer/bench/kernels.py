"""The paged decode kernel alone, timed as a memory stream (chapter 06's kernel table).

At decode a kernel reads every cached K/V element once for a few FLOPs per query head that
shares it, so its speed of light is the cache's bytes over the device's bandwidth: the bytes
it must read over its time is its achieved bandwidth, set beside the device's copy bandwidth.
"""

from __future__ import annotations

import statistics
import time

import pandas as pd
import torch

from ..core.kernels import get_backend
from ..core.models import dtype_name
from .devices import device_speed, run_metadata, sync

# Qwen2.5-7B's attention: 28 query heads sharing 4 K/V heads of 128.
QWEN_HEADS, QWEN_KV_HEADS, QWEN_HEAD_DIM = 28, 4, 128


def decode_kernel_bandwidth(device: torch.device, backend: str = "auto",
                            contexts: tuple[int, ...] = (1024, 2048, 4096),
                            batch_size: int = 8, block_size: int = 16,
                            heads: int = QWEN_HEADS, kv_heads: int = QWEN_KV_HEADS,
                            head_dim: int = QWEN_HEAD_DIM, dtype: torch.dtype = torch.bfloat16,
                            rotate_bytes: int = 256 << 20, repeats: int = 20) -> pd.DataFrame:
    """One row per context length: the kernel's median time over ``repeats`` calls, the K/V
    bytes it reads, their rate (``gbs``) and its share of the device's copy bandwidth.

    The caches rotate among enough copies to make ``rotate_bytes`` together (a few times an
    H200's 60 MB L2), so that no call finds its K/V in the cache left by the one before."""
    kernel = get_backend(backend, device, block_size)
    speed = device_speed(device)
    gen = torch.Generator(device).manual_seed(0)
    rows = []
    for context in contexts:
        blocks = batch_size * -(-context // block_size)
        shape = (blocks, block_size, kv_heads, head_dim)
        kv_bytes = 2 * blocks * block_size * kv_heads * head_dim * dtype.itemsize
        sets = [tuple(torch.randn(shape, generator=gen, device=device, dtype=dtype)
                      for _ in range(2))
                for _ in range(max(1, -(-rotate_bytes // kv_bytes)))]
        tables = torch.arange(blocks, device=device, dtype=torch.int32).view(batch_size, -1)
        lens = torch.full((batch_size,), context, device=device, dtype=torch.int32)
        q = torch.randn(batch_size, heads, head_dim, generator=gen, device=device, dtype=dtype)
        seconds = _kernel_seconds(device, repeats, lambda n, sets=sets, q=q, tables=tables,
                                  lens=lens: kernel.decode(q, *sets[n % len(sets)], tables,
                                                           lens, head_dim ** -0.5))
        rows.append({"context_len": context, "batch_size": batch_size, "backend": kernel.name,
                     "kv_mb": kv_bytes / 2**20, "kernel_us": seconds * 1e6,
                     "gbs": kv_bytes / seconds / 1e9, "copy_gbs": speed.bandwidth_gbs,
                     "pct_of_copy": 100 * kv_bytes / seconds / 1e9 / speed.bandwidth_gbs,
                     "rotated_sets": len(sets)})
        del sets
    return pd.DataFrame(rows).assign(heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                     block_size=block_size, dtype=dtype_name(dtype),
                                     **run_metadata(device))


def _kernel_seconds(device: torch.device, repeats: int, call) -> float:
    """Median seconds of ``call(n)`` after 3 calls that compile, tune and warm it: CUDA events
    around each on a GPU (the launch is asynchronous), the host clock around each on a CPU."""
    for n in range(3):
        call(n)
    times = []
    for n in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call(n)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            sync(device)
            t0 = time.perf_counter()
            call(n)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def quantized_linear_rows(lm, bits: str, rows: tuple[int, ...] = (1, 2, 4, 8),
                          repeats: int = 15, isa: str = "auto") -> pd.DataFrame:
    """Every linear of ``lm``'s ``bits`` model (the body's and the LM head, as a decode step
    calls them), back to back through chapter 13's kernel on instruction path ``isa``, at each
    row count: the median time of the pass, the bytes of weights it read over that time, and
    its cost against the first row count (issue 92: a verification of ``k + 1`` rows should
    cost about one row's read of the weights)."""
    from ..core.kernels import cpu_quantized
    from ..core.kernels.cpu_quantized import BLOCK
    from ..runner.quantized import Int4Linear, Int8Linear, quantized, weight_bytes

    model = quantized(lm, bits, compute_dtype=torch.int8)
    calls = []  # (op, packed weight, its third argument): the kernel as each linear calls it
    for module in model.modules():
        if isinstance(module, Int4Linear):
            calls.append((cpu_quantized.q4_1_linear, module.blocks, module.out_features))
        elif isinstance(module, Int8Linear):
            calls.append((cpu_quantized.int8_linear, module.groups, module.scales))
    size = weight_bytes(model)
    out = []
    for m in rows:
        # A packed weight is [groups, blocks of in_features, bytes]: its input width.
        xs = {w.shape[1] * BLOCK: torch.randn(m, w.shape[1] * BLOCK) for _, w, _ in calls}

        def step(_call: int, xs=xs) -> None:
            for op, weight, third in calls:
                op(xs[weight.shape[1] * BLOCK], weight, third, isa)

        seconds = _kernel_seconds(lm.device, repeats, step)
        out.append({"bits": bits, "isa": isa, "rows": m, "linears": len(calls),
                    "ms": seconds * 1e3, "weight_mb": size / 1e6, "gb_s": size / seconds / 1e9})
    df = pd.DataFrame(out)
    df["vs_one_row"] = df["ms"] / df["ms"].iloc[0]
    meta = run_metadata(lm.device)
    return df.assign(**{k: v for k, v in meta.items() if k != "isa"}, cpu_isa=meta["isa"])
