"""Chapter 12's recording: the cost of tensor parallelism on this machine."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch

from ..bench.devices import REPO_ROOT, device_slug, device_speed, recording_root
from ..bench.offline import run_bench, summary_table
from ..book.chapters import CHAPTERS
from ..book.workloads import default_workload
from ..core.models import load_model, resolve_device


def run_chapter12(device: str | torch.device | None = "auto") -> list[Path]:
    """Chapter 12 on this machine: the time of one gloo all-reduce by message size at N = 2
    and 3 (``<device>-allreduce.csv``), then hf, ``continuous`` (TP=1) and ``tensor-parallel``
    at TP=3 benchmarked in one run (``<device>.csv``; SmolLM2's 3 KV heads allow 3)."""
    from ..bench.devices import run_metadata
    from ..book.workloads import TENSOR_PARALLEL
    from ..engines import make_engine
    from ..runner.tensor_parallel_costs import measure_all_reduce

    dev = resolve_device(device)
    if dev.type == "cuda":
        # TP=3 does not divide Qwen2.5-7B's 28 heads, and NCCL ranks want a GPU each: a GPU
        # run of this chapter keeps the paper model until a machine with 2+ GPUs records it.
        print("chapter 12 records on a CPU only for now (the GPU case is the chapter's paper "
              "model); nothing to measure here")
        return []
    out_dir = recording_root() / "ch12"
    out_dir.mkdir(parents=True, exist_ok=True)
    reduce_path = out_dir / f"{device_slug(dev)}-allreduce.csv"
    pd.DataFrame(measure_all_reduce((2, 3))).assign(**run_metadata(dev)).to_csv(reduce_path,
                                                                                index=False)
    print(f"wrote {reduce_path.relative_to(REPO_ROOT)}")
    model, base = default_workload(dev)
    lm = load_model(model, device=dev)
    config = replace(base, engines=CHAPTERS["12"].engines, chapter="12", new_tokens=16,
                     repeat=3)
    engines = {"hf": make_engine("hf", lm), "continuous": make_engine("continuous", lm),
               "tensor-parallel": make_engine("tensor-parallel", lm,
                                              tensor_parallel=TENSOR_PARALLEL)}
    try:
        df = run_bench(lm, config, engines, speed=device_speed(dev, store=True))
    finally:
        engines["tensor-parallel"].close()
    print(summary_table(df).to_string(index=False))
    bench_path = out_dir / f"{device_slug(dev)}.csv"
    df.assign(tensor_parallel=[TENSOR_PARALLEL if e == "tensor-parallel" else 1
                               for e in df.engine]).to_csv(bench_path, index=False)
    print(f"wrote {bench_path.relative_to(REPO_ROOT)}")
    return [reduce_path, bench_path]
