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
from .devices import REPO_ROOT, device_slug, device_speed
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
    df = run_bench(lm, config, speed=device_speed(dev, store=True))
    print(summary_table(df).to_string(index=False))
    out = results_path(chapter, dev)
    out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(out, index=False)
    print(f"wrote {out.relative_to(REPO_ROOT)}")
    return out


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
        return ContextSweep((128, 512, 1024, 2048, 4096), new_tokens=32, profiled_steps=8)
    # About 2-3 minutes per chapter on 2 cores; 2048 would more than double it (prefill).
    return ContextSweep((128, 256, 512, 1024))


# The stages each chapter sweeps: hf and the chapter's paged stages (HF's-modules variant of
# paged-attention left out: its ablation is chapter 06's benchmark).
CONTEXT_SWEEP_ENGINES = {
    "03": ("hf", "paged-loop", "paged-vectorized"),
    "04": ("hf", "paged-loop", "paged-vectorized", "paged-prealloc"),
    "06": ("hf", "paged-vectorized", "paged-prealloc", "paged-attention"),
}


def run_context_sweep(lm, engines: tuple[str, ...], sweep: ContextSweep, speed,
                      chapter: str = "") -> pd.DataFrame:
    """One row per engine x context length: plain decode ``step_ms``, ``decode_tok_s``,
    ``ttft_ms``, ``pct_of_hf`` (decode step, hf's over the engine's), the decode floor, and for
    paged stages ``<phase>_ms`` per step from a profiled run (``profiled_step_ms`` is that run's
    step: the profiler adds its own cost per op, so read phases as shares of it)."""
    from .bench import make_prompts, own_threads, run_metrics
    from .devices import LoadGuard, decode_floor, run_metadata
    from .engines import make_engine
    from .profiling import phase_table, profile_decode
    from .sampling import SamplingParams

    made = {name: make_engine(name, lm) for name in engines}
    params = SamplingParams(max_new_tokens=sweep.new_tokens, ignore_eos=True)
    meta = run_metadata(lm.device)
    warm = make_prompts(lm, sweep.batch_size, min(sweep.context_lens))
    for engine in made.values():
        engine.generate(warm, params)
    rows = []
    for context_len in sweep.context_lens:
        prompts = make_prompts(lm, sweep.batch_size, context_len)
        floor = decode_floor(lm, sweep.batch_size, context_len + sweep.new_tokens // 2,
                             speed.bandwidth, speed.peak_flops)
        with LoadGuard(own_threads(lm)) as load:
            measured = {}
            for name, engine in made.items():
                result = engine.generate(prompts, params)
                row = run_metrics(result, sweep.batch_size, sweep.new_tokens)
                if name != "hf":
                    trace = profile_decode(engine, prompts, sweep.profiled_steps, warmup_steps=1,
                                           warm=False)
                    phases = phase_table(trace).set_index("phase").ms_per_step
                    row |= {("profiled_step" if k == "decode_step" else k.strip("()")) + "_ms": v
                            for k, v in phases.items()}
                measured[name] = row
        load.warn(f"context {context_len}")
        for name, row in measured.items():
            hf_step = measured["hf"]["step_ms"] if "hf" in measured else float("nan")
            rows.append({"chapter": chapter, "engine": name, "model": lm.name,
                         "dtype": str(lm.dtype).removeprefix("torch."),
                         "batch_size": sweep.batch_size, "context_len": context_len,
                         "new_tokens": sweep.new_tokens, **row,
                         "pct_of_hf": 100 * hf_step / row["step_ms"],
                         "floor_ms": floor.step_ms, "floor_bound": floor.bound,
                         "kv_mb_per_step": floor.kv_bytes / 2**20,
                         "pct_of_floor": 100 * floor.step_ms / row["step_ms"],
                         **load.columns(), **meta})
    return pd.DataFrame(rows)


def run_chapter_context(chapter: str, device: str | torch.device | None = "auto") -> Path:
    """The context sweep of ``chapter`` on this device -> ``chNN/<device>-context.csv``."""
    dev = resolve_device(device)
    model, _ = default_workload(dev)
    lm = load_model(model, device=dev)
    df = run_context_sweep(lm, CONTEXT_SWEEP_ENGINES[chapter], context_sweep(dev),
                           device_speed(dev, store=True), chapter)
    print(df.pivot_table(index="context_len", columns="engine", values="step_ms",
                         sort=False).round(1).to_string())
    out = RESULTS / f"ch{chapter}" / f"{device_slug(dev)}-context.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(out, index=False)
    print(f"wrote {out.relative_to(REPO_ROOT)}")
    return out


def run_chapter05(device: str | torch.device | None = "auto") -> list[Path]:
    """Profile ``paged-prealloc`` at batch 1/4/8: its phases over several profiled repeats (median
    and min-max), its top ops and a trace per batch size, and ``paged-loop``'s op counts; then
    benchmark hf vs paged-prealloc with ranges on and off in one run."""
    from .engines import make_engine
    from .profiling import RangesOff, phase_repeats, profile_stages

    dev = resolve_device(device)
    model, base = default_workload(dev)
    lm = load_model(model, device=dev)
    slug = device_slug(dev)
    out_dir = RESULTS / "ch05"
    steps = 20 if dev.type == "cuda" else 8
    prof = profile_stages(lm, base.batch_sizes, base.prompt_len, steps, trace_dir=out_dir,
                          trace_prefix=f"{slug}-")
    phases = phase_repeats(lm, "paged-prealloc", base.batch_sizes, base.prompt_len, steps,
                           repeats=5)
    if "device_ms_per_step" in prof.phases:  # CUDA: the device time of one profiled run
        phases = phases.merge(prof.phases[["batch_size", "phase", "device_ms_per_step"]],
                              on=["batch_size", "phase"], how="left")
    prealloc = make_engine("paged-prealloc", lm)
    config = BenchConfig(**{**{f: getattr(base, f) for f in base.__slots__},
                            "engines": ("hf", "paged-prealloc", "paged-prealloc/ranges-off"),
                            "chapter": "05"})
    bench = run_bench(lm, config, {"hf": make_engine("hf", lm), "paged-prealloc": prealloc,
                                   "paged-prealloc/ranges-off": RangesOff(prealloc)},
                      speed=device_speed(dev, store=True))
    print(summary_table(bench).to_string(index=False))
    meta = bench.iloc[0][["model", "dtype", "device", "device_name", "torch", "transformers",
                          "git_sha", "date"]].to_dict()
    written = []
    for kind, df in (("phases", phases), ("ops", prof.ops), ("top", prof.top),
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
        if name.startswith("async") or name == "paged-attention":
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
    else:
        run_chapter_bench(chapter, device)
    if chapter in CONTEXT_SWEEP_ENGINES:
        run_chapter_context(chapter, device)
    if execute_notebook_too:
        execute_notebook(chapter)
