"""What ``make chapter-NN`` runs: the chapter's benchmark on this machine, written to
``data/results/chNN/<device-slug>.csv``, then the notebook re-executed in place.

Defaults follow the device: on CUDA the reference posts' model (random-weight Qwen2.5-7B, bf16),
on CPU the real SmolLM2-135M in fp32.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd
import torch

from .bench import BenchConfig, run_bench, summary_table
from .devices import REPO_ROOT, device_slug
from .errors import UnknownNameError
from .models import load_model, resolve_device
from .serving import ServingBenchConfig, WorkloadConfig, run_serving_bench
from .serving import summary_table as serving_summary_table

RESULTS = REPO_ROOT / "data" / "results"
CHAPTERS_DIR = REPO_ROOT / "chapters"


@dataclass(frozen=True, slots=True)
class ChapterRun:
    notebook: str
    engines: tuple[str, ...]
    cuda_engines: tuple[str, ...] = ()  # added where the device is a GPU

    def engines_for(self, device: torch.device) -> tuple[str, ...]:
        return self.engines + (self.cuda_engines if device.type == "cuda" else ())


# Each chapter benchmarks the stages it compares in one run, so its ratios are like for like.
_STAGES = ("hf", "naive", "paged-loop", "paged-vectorized", "paged-prealloc", "paged-attention")
CHAPTERS: dict[str, ChapterRun] = {
    "01": ChapterRun("01_naive_hf_decode.ipynb", _STAGES[:2]),
    "02": ChapterRun("02_paged_kv_cache.ipynb", _STAGES[:3]),
    # From chapter 03 on, naive (== hf within noise, chapter 01) is left out to save time.
    "03": ChapterRun("03_vectorized_gather.ipynb", ("hf", *_STAGES[2:4])),
    "04": ChapterRun("04_preallocated_buffers.ipynb", ("hf", *_STAGES[2:5])),
    # Chapter 05 profiles instead of only benchmarking (see run_chapter05).
    "05": ChapterRun("05_decode_profiling.ipynb", ("hf", "paged-prealloc")),
    # Both ways into the model: HF's modules (registry) and our direct forward (the default).
    "06": ChapterRun("06_paged_attention.ipynb",
                     ("hf", *_STAGES[3:5], "paged-attention:registry", "paged-attention")),
    # Chapter 07 also profiles each loop for its timelines (see run_chapter07).
    "07": ChapterRun("07_async_streams.ipynb",
                     ("hf", "paged-attention", "async:sync", "async:overlap"),
                     cuda_engines=("async:cuda-graph",)),
    # Chapter 08 serves workloads online instead (see run_chapter08).
    "08": ChapterRun("08_continuous_batching.ipynb", ("continuous",)),
    # Chapter 10 serves chapter 08's target workload in-process and over HTTP (run_chapter10).
    "10": ChapterRun("10_openai_server.ipynb", ("continuous",)),
}


def default_workload(device: torch.device) -> tuple[str, BenchConfig]:
    """Model and benchmark sizes for a chapter run on this device."""
    if device.type == "cuda":
        return "qwen2.5-7b", BenchConfig(batch_sizes=(1, 4, 8), prompt_len=64, new_tokens=128,
                                         warmup=2, repeat=5)
    # A shared CPU drifts by 10-30% within minutes and single paired ratios move by 5-12
    # points, so 7 repeats: enough for a median ratio and a min-max spread that mean something.
    # MINIINFER_QUICK=1 halves the decode length and keeps 3 repeats (a reader in a hurry).
    quick = os.environ.get("MINIINFER_QUICK") == "1"
    return "smollm2-135m", BenchConfig(batch_sizes=(1, 4, 8), prompt_len=64,
                                       new_tokens=32 if quick else 64, warmup=1,
                                       repeat=3 if quick else 7)


def results_path(chapter: str, device: torch.device) -> Path:
    return RESULTS / f"ch{chapter}" / f"{device_slug(device)}.csv"


def run_chapter_bench(chapter: str, device: str | torch.device | None = "auto") -> Path:
    run = CHAPTERS[chapter]
    dev = resolve_device(device)
    model, base = default_workload(dev)
    config = BenchConfig(**{**{f: getattr(base, f) for f in base.__slots__},
                            "engines": run.engines_for(dev), "chapter": chapter})
    lm = load_model(model, device=dev)
    df = run_bench(lm, config)
    print(summary_table(df).to_string(index=False))
    out = results_path(chapter, dev)
    out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(out, index=False)
    print(f"wrote {out.relative_to(REPO_ROOT)}")
    return out


def run_chapter05(device: str | torch.device | None = "auto") -> list[Path]:
    """Profile ``paged-prealloc`` (phases, top ops/kernels) and ``paged-loop`` (op counts) at
    batch 1/4/8, and benchmark hf vs paged-prealloc with ranges on and off in one run."""
    from .engines import make_engine
    from .profiling import RangesOff, profile_stages

    dev = resolve_device(device)
    model, base = default_workload(dev)
    lm = load_model(model, device=dev)
    slug = device_slug(dev)
    out_dir = RESULTS / "ch05"
    steps = 20 if dev.type == "cuda" else 6
    prof = profile_stages(lm, base.batch_sizes, base.prompt_len, steps, trace_dir=out_dir,
                          trace_prefix=f"{slug}-")
    prealloc = make_engine("paged-prealloc", lm)
    config = BenchConfig(**{**{f: getattr(base, f) for f in base.__slots__},
                            "engines": ("hf", "paged-prealloc", "paged-prealloc/ranges-off"),
                            "chapter": "05"})
    bench = run_bench(lm, config, {"hf": make_engine("hf", lm), "paged-prealloc": prealloc,
                                   "paged-prealloc/ranges-off": RangesOff(prealloc)})
    print(summary_table(bench).to_string(index=False))
    meta = bench.iloc[0][["model", "dtype", "device", "device_name", "torch", "transformers",
                          "git_sha", "date"]].to_dict()
    written = []
    for kind, df in (("phases", prof.phases), ("ops", prof.ops), ("top", prof.top),
                     ("bench", bench)):
        path = out_dir / f"{slug}-{kind}.csv"
        df.assign(**{k: v for k, v in meta.items() if k not in df}).to_csv(path, index=False)
        written.append(path)
        print(f"wrote {path.relative_to(REPO_ROOT)}")
    return written


def run_chapter07(device: str | torch.device | None = "auto") -> list[Path]:
    """The benchmark of every loop (``<device>.csv``), then a few profiled decode steps of each
    loop at batch 8 as Gantt bars (``timeline/<device>.csv``)."""
    from .bench import make_prompts
    from .book import read_results
    from .engines import make_engine
    from .profiling import profile_decode, timeline

    dev = resolve_device(device)
    bench_path = run_chapter_bench("07", dev)
    model, base = default_workload(dev)
    lm = load_model(model, device=dev)
    prompts = make_prompts(lm, 8, base.prompt_len)
    bars = []
    for name in CHAPTERS["07"].engines_for(dev):
        if name.startswith("async"):
            trace = profile_decode(make_engine(name, lm), prompts, steps=4)
            bars.append(timeline(trace).assign(engine=name, batch_size=8))
    # A folder of its own: the chapter's benchmark CSVs are every *.csv directly in ch07/.
    path = RESULTS / "ch07" / "timeline" / f"{device_slug(dev)}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = read_results(bench_path).iloc[0][["model", "dtype", "device", "device_name", "torch",
                                            "git_sha", "date"]].to_dict()
    pd.concat(bars, ignore_index=True).assign(**meta).to_csv(path, index=False)
    print(f"wrote {path.relative_to(REPO_ROOT)}")
    return [bench_path, path]


def serving_experiments(device: torch.device) -> tuple[str, dict[str, ServingBenchConfig]]:
    """Model and the three serving experiments of chapter 08 on this device:

    - ``target``: the issue's comparison, every system on the same offline workload (32
      requests on a CPU, 256 on a GPU; prompts of 16-256 tokens, 32-128 new tokens);
    - ``budget``: continuous batching at several token budgets, on a smaller workload arriving
      online (the chunked-prefill trade-off; each budget one point of the wde post's
      throughput-latency curve);
    - ``rate``: that workload arriving at several request rates, per system.
    """
    static = ("static-paged-attention", "static-hf")
    if device.type == "cuda":
        # 256 requests of up to 384 tokens of Qwen2.5-7B K/V (56 KiB a token) need 5.3 GiB at
        # once: a pool of 8 GiB serves them without preemption, as transformers' would.
        target = WorkloadConfig(num_requests=256)
        kv = 8 << 30
        return "qwen2.5-7b", {
            "target": ServingBenchConfig(target, ("continuous", *static, "hf-cb"),
                                         max_num_batched_tokens=(2048,), kv_cache_bytes=kv),
            "budget": ServingBenchConfig(replace(target, num_requests=128, request_rate=8.0),
                                         ("continuous",),
                                         max_num_batched_tokens=(256, 512, 1024, 2048, 4096),
                                         kv_cache_bytes=kv),
            "rate": ServingBenchConfig(replace(target, num_requests=128),
                                       ("continuous", "static-paged-attention", "hf-cb"),
                                       request_rates=(4.0, 8.0, 16.0),
                                       max_num_batched_tokens=(2048,), kv_cache_bytes=kv),
        }
    # Sized to take about 8 minutes on 2 cores: the smaller online workload answers in ~40 s of
    # work, and 1 request/s is below what continuous batching sustains on it.
    online = WorkloadConfig(num_requests=16, request_rate=1.0, output_len=(16, 64))
    return "smollm2-135m", {
        "target": ServingBenchConfig(WorkloadConfig(num_requests=32),
                                     ("continuous", *static, "hf-cb"),
                                     max_num_batched_tokens=(512,)),
        "budget": ServingBenchConfig(online, ("continuous",),
                                     max_num_batched_tokens=(32, 64, 128, 256, 512)),
        "rate": ServingBenchConfig(online, ("continuous", "static-paged-attention", "hf-cb"),
                                   request_rates=(1.0, 2.0, 4.0), max_num_batched_tokens=(512,)),
    }


def run_chapter08(device: str | torch.device | None = "auto") -> list[Path]:
    """Serve the chapter's workloads with every system; writes ``<device>-runs.csv`` (one row
    per run), ``-requests.csv`` (per request) and ``-steps.csv`` (our engine's steps), each
    row tagged with its experiment."""
    dev = resolve_device(device)
    model, experiments = serving_experiments(dev)
    lm = load_model(model, device=dev)
    tables: dict[str, list[pd.DataFrame]] = {"runs": [], "requests": [], "steps": []}
    for name, config in experiments.items():
        results = run_serving_bench(lm, config)
        print(f"{name}:\n{serving_summary_table(results.runs).to_string(index=False)}")
        for kind, frames in tables.items():
            frames.append(getattr(results, kind).assign(experiment=name))
    target = tables["runs"][0].set_index("system").output_throughput
    for baseline in target.index.drop("continuous"):
        print(f"continuous / {baseline}: {target['continuous'] / target[baseline]:.2f}x "
              f"output tokens/s")
    out_dir = RESULTS / "ch08"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for kind, frames in tables.items():
        path = out_dir / f"{device_slug(dev)}-{kind}.csv"
        pd.concat(frames, ignore_index=True).to_csv(path, index=False)
        written.append(path)
        print(f"wrote {path.relative_to(REPO_ROOT)}")
    return written


def run_chapter10(device: str | torch.device | None = "auto", rounds: int = 3) -> list[Path]:
    """Chapter 08's ``target`` workload served by the same engine twice per round: in this
    process (``continuous``, as chapter 08 measures it) and over HTTP (``http``: a ``serve``
    child process on this machine, measured at the client), the order alternating between
    rounds so drift hits both alike. Writes ``<device>-runs.csv`` and ``-requests.csv``."""
    from .server import ServerProcess
    from .serving import default_pool_bytes
    from .serving.http import run_http_bench

    dev = resolve_device(device)
    model, experiments = serving_experiments(dev)
    target = replace(experiments["target"], systems=("continuous",), chapter="10")
    lm = load_model(model, device=dev)
    # The server's engine gets the same token budget and KV pool as the in-process one.
    server_args = ["--device", str(dev),
                   "--max-num-batched-tokens", str(target.max_num_batched_tokens[0]),
                   "--kv-cache-bytes", str(target.kv_cache_bytes or default_pool_bytes(lm))]
    runs, requests = [], []
    with ServerProcess(model, *server_args) as server:
        for round_ in range(rounds):
            for mode in ("in-process", "http")[:: 1 if round_ % 2 == 0 else -1]:
                results = (run_http_bench(lm, server.base_url, target.workload, chapter="10")
                           if mode == "http" else run_serving_bench(lm, target, progress=False))
                runs.append(results.runs.assign(experiment="target", round=round_))
                requests.append(results.requests.assign(experiment="target", round=round_))
                print(f"round {round_} {mode}:\n"
                      f"{serving_summary_table(results.runs).to_string(index=False)}")
    table = pd.concat(runs, ignore_index=True)
    by_round = table.pivot_table(index="round", columns="system",
                                 values=["output_throughput", "ttft_p50_ms"])
    ratio = (by_round.output_throughput.http / by_round.output_throughput.continuous).median()
    overhead = (by_round.ttft_p50_ms.http - by_round.ttft_p50_ms.continuous).median()
    print(f"http / in-process output tokens/s: {ratio:.3f} (median of {rounds} rounds); "
          f"TTFT p50 overhead: {overhead:.1f} ms")
    out_dir = RESULTS / "ch10"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for kind, frame in (("runs", table), ("requests", pd.concat(requests, ignore_index=True))):
        path = out_dir / f"{device_slug(dev)}-{kind}.csv"
        frame.to_csv(path, index=False)
        written.append(path)
        print(f"wrote {path.relative_to(REPO_ROOT)}")
    return written


def execute_notebook(chapter: str) -> None:
    """Re-execute the chapter notebook in place with the full preset. Headless machines
    without jupyter (our GPU box) skip this step; the CSV is what they contribute."""
    try:
        import nbformat
        from nbclient import NotebookClient
    except ImportError:
        print("nbclient not installed: notebook not re-executed (the CSV is written)")
        return
    path = CHAPTERS_DIR / CHAPTERS[chapter].notebook
    nb = nbformat.read(path, as_version=4)
    os.environ.setdefault("MINIINFER_PRESET", "full")
    NotebookClient(nb, timeout=3600, kernel_name="python3",
                   resources={"metadata": {"path": str(CHAPTERS_DIR)}}).execute()
    nbformat.write(nb, path)
    print(f"re-executed {path.relative_to(REPO_ROOT)}")


def reproduce(chapter: str, device: str | None = "auto", execute_notebook_too: bool = True) -> None:
    chapter = chapter.zfill(2)
    if chapter not in CHAPTERS:
        raise UnknownNameError(f"unknown chapter {chapter!r}; chapters: {', '.join(CHAPTERS)}")
    if chapter == "05":
        run_chapter05(device)
    elif chapter == "07":
        run_chapter07(device)
    elif chapter == "08":
        run_chapter08(device)
    elif chapter == "10":
        run_chapter10(device)
    else:
        run_chapter_bench(chapter, device)
    if execute_notebook_too:
        execute_notebook(chapter)
