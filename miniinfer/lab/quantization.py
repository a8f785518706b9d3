"""Chapter 13's recording: our weight-only int8/int4 stages (the offline benchmark), then, where
``make peers-llama`` has built it, llama.cpp on the same weights: the shipped Q4_1 GGUF and the
Q8_0 and F32 files its quantizer makes from it, at the benchmark's batch sizes and lengths ->
``<device>-llama-cpp.csv``. Each format's floor is its bytes read once per decode step at the
device's measured bandwidth (every weight is read once a step, whatever the batch). Last, what
fewer bits cost in quality (:mod:`miniinfer.bench.quality`) -> ``<device>-quality.csv``."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch

from ..bench.devices import REPO_ROOT, device_slug, device_speed, recording_root, run_metadata
from ..bench.peers import PeerMissingError, llama_cpp
from ..bench.quality import quality_rows
from ..book.workloads import default_workload
from ..core.models import LoadedModel, cache_dir, load_model, smollm2_gguf


def llama_cpp_rows(device: torch.device, repeats: int | None = None) -> pd.DataFrame:
    """llama.cpp's decode tok/s per format and batch size, with each format's floor."""
    _, config = default_workload(device, "13")
    repeats = repeats or config.repeat
    speed = device_speed(device, store=True)
    threads = torch.get_num_threads()
    shipped = smollm2_gguf()
    rows = []
    for ours, fmt in llama_cpp.FORMATS.items():
        model = llama_cpp.gguf_file(ours, shipped, cache_dir() / "llama.cpp")
        size = model.stat().st_size
        floor_ms = size / speed.bandwidth * 1e3
        for r in llama_cpp.batched_bench(model, config.batch_sizes, config.prompt_len,
                                         config.new_tokens, threads, repeats):
            # dtype: the weights' format (every recorded table names its dtype)
            rows.append({"chapter": "13", "system": llama_cpp.LLAMA_CPP, "format": fmt, "dtype": fmt,
                         "ours": ours, **r, "prompt_len": config.prompt_len,
                         "new_tokens": config.new_tokens, "repeats": repeats,
                         "threads": threads, "file_mb": size / 1e6, "floor_ms": floor_ms,
                         # the floor's tok/s: every sequence's token once per floor step
                         "pct_of_floor": r["decode_tok_s"] * floor_ms / (10 * r["batch_size"]),
                         "bandwidth_gbs": speed.bandwidth_gbs,
                         "peer_version": llama_cpp.version()})
    meta = {k: v for k, v in run_metadata(device).items() if k != "threads"}
    return pd.DataFrame(rows).assign(**meta)


def record_llama_cpp(device: torch.device) -> list[Path]:
    """``<device>-llama-cpp.csv`` when llama.cpp is built (for this CPU: on a GPU machine,
    nothing); otherwise says why, writes nothing."""
    if device.type != "cpu":
        return []
    try:
        llama_cpp.find_llama_cpp()
    except PeerMissingError as missing:
        print(f"chapter 13 records our rows only: {missing}")
        return []
    df = llama_cpp_rows(device)
    out = recording_root() / "ch13" / f"{device_slug(device)}-llama-cpp.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(out, index=False)
    print(df[["format", "batch_size", "decode_tok_s", "decode_tok_s_min", "decode_tok_s_max",
              "pct_of_floor"]].round(1).to_string(index=False))
    print(f"wrote {out.relative_to(REPO_ROOT)}")
    return [out]


def record_quality(device: torch.device, lm: LoadedModel | None = None) -> list[Path]:
    """``<device>-quality.csv``: perplexity and top-1 agreement with fp32 of the fp32, int8 and
    int4 weights of ``lm`` (default: the chapter's model), on a CPU; on a GPU nothing, and says
    why. A quality table, not a timing one: about a minute of 2 cores' time for SmolLM2-135M."""
    if device.type != "cpu":
        print("chapter 13's quality table is recorded on the CPU only: the int8/int4 weights run "
              "on PyTorch's CPU weight-only ops here, and the weights (so the numbers) are the "
              "same on any device")
        return []
    lm = lm or load_model(default_workload(device)[0], device=device)
    df = pd.DataFrame(quality_rows(lm)).assign(**run_metadata(device))
    out = recording_root() / "ch13" / f"{device_slug(device)}-quality.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(out, index=False)
    print(df[["weights", "perplexity", "ppl_change_pct", "tokens_scored", "agreement"]]
          .round(4).to_string(index=False))
    print(f"wrote {out.relative_to(REPO_ROOT) if out.is_relative_to(REPO_ROOT) else out}")
    return [out]
