"""What ``make chapter-NN`` runs: the chapter's benchmark on this machine, written to
``data/results/chNN/<device-slug>.csv``, then the notebook re-executed in place; and what
``python -m miniinfer repro all`` runs: every chapter's recording in order.

Defaults follow the device: on CUDA the reference posts' model (random-weight Qwen2.5-7B, bf16),
on CPU the real SmolLM2-135M in fp32.

Each chapter declares what it records (:class:`ChapterRun`: ``record``, by default the offline
benchmark of its ``engines``) and what that costs (``plan``: model, dtype, engines, batch
sizes, tokens, repeats and an estimated time, printed by ``repro all --dry-run`` without running
anything). A new chapter is one more entry in :data:`CHAPTERS`.
"""

from __future__ import annotations

import gc
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import pandas as pd
import torch

from .bench import BenchConfig, run_bench, summary_table
from .devices import REPO_ROOT, device_slug, device_speed
from .errors import UnknownNameError
from .models import MODELS, LoadedModel, load_model, resolve_device
from .serving import STEPPED_SYSTEMS, ServingBenchConfig, WorkloadConfig, run_serving_bench
from .serving import summary_table as serving_summary_table

RESULTS = REPO_ROOT / "data" / "results"
CHAPTERS_DIR = REPO_ROOT / "chapters"


@dataclass(frozen=True, slots=True)
class ChapterPlan:
    """What recording a chapter runs on a device, and about how long it takes."""

    model: str
    dtype: str
    engines: tuple[str, ...]
    batch_sizes: tuple[int, ...]
    tokens: str  # prompt and output lengths, in words
    repeats: int
    estimate_s: float


@dataclass(frozen=True, slots=True)
class ChapterRun:
    """A chapter's notebook and recording. ``record(device)`` writes its results (None: the
    offline benchmark of ``engines_for(device)``); ``plan(chapter, device)`` says what that
    runs and estimates its time without touching the device (None: the benchmark's plan). A
    chapter that records nothing gives a ``record`` that returns ``[]`` and a plan of 0 s."""

    notebook: str
    engines: tuple[str, ...]
    cuda_engines: tuple[str, ...] = ()  # added where the device is a GPU
    record: Callable[[torch.device], list[Path]] | None = field(default=None, compare=False)
    plan: Callable[[str, torch.device], ChapterPlan] | None = field(default=None, compare=False)

    def engines_for(self, device: torch.device) -> tuple[str, ...]:
        return self.engines + (self.cuda_engines if device.type == "cuda" else ())


# Each chapter benchmarks the stages it compares in one run, so its ratios are like for like.
_STAGES = ("hf", "naive", "paged-loop", "paged-vectorized", "paged-prealloc", "paged-attention")
CHAPTERS: dict[str, ChapterRun] = {
    # The overview measures nothing: it reads data/results, so its run only re-executes it.
    "00": ChapterRun("00_overview.ipynb", (), record=lambda device: _reads_results_only(),
                     plan=lambda chapter, device: ChapterPlan("-", "-", (), (), "none", 0, 0.0)),
    "01": ChapterRun("01_naive_hf_decode.ipynb", _STAGES[:2]),
    "02": ChapterRun("02_paged_kv_cache.ipynb", _STAGES[:3]),
    # From chapter 03 on, naive (== hf within noise, chapter 01) is left out to save time.
    "03": ChapterRun("03_vectorized_gather.ipynb", ("hf", *_STAGES[2:4])),
    # The stage's two changes measured apart: the buffer (no allocation, no cat) with the old
    # per-request K/V write, then the batched write on top.
    "04": ChapterRun("04_preallocated_buffers.ipynb",
                     ("hf", *_STAGES[2:4], "paged-prealloc:per-request", "paged-prealloc")),
    # Chapter 05 profiles instead of only benchmarking (see run_chapter05).
    "05": ChapterRun("05_decode_profiling.ipynb", ("hf", "paged-prealloc"),
                     record=lambda device: run_chapter05(device),
                     plan=lambda chapter, device: chapter05_plan(device)),
    # Both ways into the model: HF's modules (registry) and our direct forward (the default).
    "06": ChapterRun("06_paged_attention.ipynb",
                     ("hf", *_STAGES[3:5], "paged-attention:registry", "paged-attention")),
    # Chapter 07 also profiles each loop for its timelines (see run_chapter07).
    "07": ChapterRun("07_async_streams.ipynb",
                     ("hf", "paged-attention", "async:sync", "async:overlap"),
                     cuda_engines=("async:cuda-graph",),
                     record=lambda device: run_chapter07(device),
                     plan=lambda chapter, device: chapter07_plan(device)),
    # Chapter 08 serves workloads online instead (see run_chapter08).
    "08": ChapterRun("08_continuous_batching.ipynb", ("continuous",),
                     record=lambda device: run_chapter08(device),
                     plan=lambda chapter, device: chapter08_plan(device)),
    # Chapter 09 serves workloads that share prefixes (see run_chapter09).
    "09": ChapterRun("09_prefix_caching.ipynb", ("continuous", "prefix-cache"),
                     record=lambda device: run_chapter09(device),
                     plan=lambda chapter, device: serving_plan(*prefix_cache_experiments(device),
                                                               device, "shared-prefix")),
    # Chapter 10 serves chapter 08's target workload in-process and over HTTP (run_chapter10).
    "10": ChapterRun("10_openai_server.ipynb", ("continuous",),
                     record=lambda device: run_chapter10(device),
                     plan=lambda chapter, device: chapter10_plan(device)),
}


def _reads_results_only() -> list[Path]:
    print("chapter 00 reads the recorded results only: nothing to measure")
    return []


def default_workload(device: torch.device) -> tuple[str, BenchConfig]:
    """Model and benchmark sizes for a chapter run on this device."""
    if device.type == "cuda":
        # GPU timings are steady: 3 repeats do. 64 new tokens keep the whole `repro all` on one
        # H100 within 20 minutes (see COSTS and `repro all --dry-run`).
        return "qwen2.5-7b", BenchConfig(batch_sizes=(1, 4, 8), prompt_len=64, new_tokens=64,
                                         warmup=1, repeat=3)
    # A shared CPU drifts by 10-30% within minutes and single paired ratios move by 5-12
    # points, so 7 repeats: enough for a median ratio and a min-max spread that mean something.
    # MINIINFER_QUICK=1 halves the decode length and keeps 3 repeats (a reader in a hurry).
    quick = os.environ.get("MINIINFER_QUICK") == "1"
    return "smollm2-135m", BenchConfig(batch_sizes=(1, 4, 8), prompt_len=64,
                                       new_tokens=32 if quick else 64, warmup=1,
                                       repeat=3 if quick else 7)


def results_path(chapter: str, device: torch.device) -> Path:
    return RESULTS / f"ch{chapter}" / f"{device_slug(device)}.csv"


def run_chapter_bench(chapter: str, device: str | torch.device | None = "auto",
                      lm: LoadedModel | None = None) -> Path:
    """The chapter's offline benchmark (on ``lm``, or the device's default model)."""
    run = CHAPTERS[chapter]
    dev = resolve_device(device)
    model, base = default_workload(dev)
    config = BenchConfig(**{**{f: getattr(base, f) for f in base.__slots__},
                            "engines": run.engines_for(dev), "chapter": chapter})
    lm = lm or load_model(model, device=dev)
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
    steps = chapter05_profile_steps(dev)
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
    model, base = default_workload(dev)
    lm = load_model(model, device=dev)  # once: a second 7B would hold 15 GB more
    bench_path = run_chapter_bench("07", dev, lm)
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
        return "qwen2.5-7b", {
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
    # Sized to take about 14 minutes on 2 cores. The budget sweep sends its requests all at
    # once, so every budget is measured saturated (arriving at 1 request/s, 16 requests were
    # arrival-bound: throughput could not move). The rate sweep starts below what every system
    # sustains (hf-cb saturates near 1 request/s here, continuous near 3) and ends above it;
    # 32 requests, with arrival gaps that scale with 1 / rate (one seed), keep the curves
    # monotonic where 16 did not.
    online = WorkloadConfig(num_requests=32, output_len=(16, 64))
    return "smollm2-135m", {
        "target": ServingBenchConfig(WorkloadConfig(num_requests=32),
                                     ("continuous", *static, "hf-cb"),
                                     max_num_batched_tokens=(512,)),
        "budget": ServingBenchConfig(online, ("continuous",),
                                     max_num_batched_tokens=(32, 64, 128, 256, 512)),
        "rate": ServingBenchConfig(online, ("continuous", "static-paged-attention", "hf-cb"),
                                   request_rates=(0.5, 1.0, 2.0, 4.0),
                                   max_num_batched_tokens=(512,)),
    }


def run_chapter08(device: str | torch.device | None = "auto") -> list[Path]:
    """Serve the chapter's workloads with every system; writes ``<device>-runs.csv`` (one row
    per run), ``-requests.csv`` (per request) and ``-steps.csv`` (our engine's steps), each
    row tagged with its experiment."""
    dev = resolve_device(device)
    model, experiments = serving_experiments(dev)
    runs, written = record_serving(dev, "08", model, experiments)
    target = runs[runs.experiment == "target"].set_index("system").output_throughput
    for baseline in target.index.drop("continuous"):
        print(f"continuous / {baseline}: {target['continuous'] / target[baseline]:.2f}x "
              f"output tokens/s")
    return written


def record_serving(dev: torch.device, chapter: str, model: str,
                   experiments: dict[str, ServingBenchConfig]) -> tuple[pd.DataFrame, list[Path]]:
    """Run every serving experiment and write ``data/results/chNN/<device>-{runs,requests,
    steps}.csv``, each row tagged with its experiment; returns the runs table and the paths."""
    lm = load_model(model, device=dev)
    tables: dict[str, list[pd.DataFrame]] = {"runs": [], "requests": [], "steps": []}
    for name, config in experiments.items():
        results = run_serving_bench(lm, config)
        print(f"{name}:\n{serving_summary_table(results.runs).to_string(index=False)}")
        for kind, frames in tables.items():
            frames.append(getattr(results, kind).assign(experiment=name))
    out_dir = RESULTS / f"ch{chapter}"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for kind, frames in tables.items():
        path = out_dir / f"{device_slug(dev)}-{kind}.csv"
        pd.concat(frames, ignore_index=True).to_csv(path, index=False)
        written.append(path)
        print(f"wrote {path.relative_to(REPO_ROOT)}")
    return pd.concat(tables["runs"], ignore_index=True), written


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
    scale = 4 if gpu else 1  # 4x: the whole `repro all` stays within 20 minutes on one H100
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
    return ("qwen2.5-7b" if gpu else "smollm2-135m"), experiments


def run_chapter09(device: str | torch.device | None = "auto") -> list[Path]:
    """Serve chapter 09's workloads with and without prefix caching; writes
    ``data/results/ch09/<device>-{runs,requests,steps}.csv``, every row tagged with its
    experiment."""
    dev = resolve_device(device)
    model, experiments = prefix_cache_experiments(dev)
    return record_serving(dev, "09", model, experiments)[1]


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
    chapter = check_chapter(chapter)
    run = CHAPTERS[chapter]
    dev = resolve_device(device)
    if run.record is None:
        run_chapter_bench(chapter, dev)
    else:
        run.record(dev)
    if chapter in CONTEXT_SWEEP_ENGINES:
        run_chapter_context(chapter, dev)
    # The chapter's model is garbage by now: give its memory back before the notebook's kernel
    # (or the next chapter) loads one of its own.
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    if execute_notebook_too:
        execute_notebook(chapter)


def check_chapter(chapter: str) -> str:
    given = chapter.strip()
    chapter = given.zfill(2) if given.isdigit() else given  # "1" is chapter 01, "" none
    if chapter not in CHAPTERS:
        raise UnknownNameError(f"unknown chapter {given!r}; chapters: {', '.join(CHAPTERS)}")
    return chapter


def reproduce_all(chapters: list[str] | None = None, device: str | None = "auto",
                  execute_notebooks: bool = True, dry_run: bool = False) -> list[ChapterPlan]:
    """Every chapter's recording (or those in ``chapters``), in order, into data/results/.
    Notebooks are re-executed after their chapter where jupyter is installed (a headless
    machine only records; the notebooks can run later anywhere from the CSVs). ``dry_run``:
    run nothing, print each chapter's plan and the estimated total."""
    selected = [check_chapter(c) for c in chapters] if chapters else list(CHAPTERS)
    # Planning never touches the device: `--dry-run --device cuda` works on a CPU machine.
    dev = resolve_device(device) if not dry_run or device in (None, "auto") \
        else torch.device(device)
    plans = [plan_chapter(c, dev) for c in selected]
    print(plan_table(selected, plans, dev))
    if dry_run:
        return plans
    for chapter in selected:
        print(f"== chapter {chapter} ==", flush=True)
        reproduce(chapter, dev, execute_notebook_too=execute_notebooks)
    return plans


def plan_chapter(chapter: str, device: torch.device) -> ChapterPlan:
    run = CHAPTERS[chapter]
    if run.plan is not None:
        return run.plan(chapter, device)
    model, config = default_workload(device)
    return bench_plan(model, device, replace(config, engines=run.engines_for(device)))


def plan_table(chapters: list[str], plans: list[ChapterPlan], device: torch.device) -> str:
    """Two lines a chapter, then the total."""
    lines = [f"repro on {device} ({device_costs(device).basis}):"]
    for chapter, p in zip(chapters, plans, strict=True):
        batches = ",".join(map(str, p.batch_sizes))
        lines.append(f"  {chapter}  ~{p.estimate_s / 60:4.1f} min  {p.model} {p.dtype}  "
                     f"batch {batches}  {p.tokens}  {p.repeats} repeat(s)")
        lines.append(f"      engines: {', '.join(p.engines)}")
    total = sum(p.estimate_s for p in plans) / 60
    lines.append(f"estimated total: {total:.1f} min for {len(plans)} chapter(s) "
                 f"(recordings only; notebooks not counted)")
    return "\n".join(lines)


# -- estimates ----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class DeviceCosts:
    """A rough cost model of one device for the default model, for planning: seconds per
    decode step (``step_s + row_s * batch``, times the engine's factor), per prompt token of
    prefill, per model load, and output tokens/s of each serving system."""

    basis: str
    load_s: float
    step_s: float
    row_s: float
    prefill_token_s: float
    engine_factor: dict[str, float]
    serving_tok_s: dict[str, float]

    def step(self, engine: str, batch_size: int) -> float:
        factor = self.engine_factor.get(engine, self.engine_factor.get(engine.split(":")[0], 1))
        return (self.step_s + self.row_s * batch_size) * factor


COSTS = {
    # Fitted to the recorded CPU tables (shared 2-core EPYC, SmolLM2 fp32): hf at 21 tok/s at
    # batch 1 and ~100 at batch 8, prefill ~1.5 ms a token; chapter 08's target run.
    "cpu": DeviceCosts(
        "estimates fitted to the recorded runs on a 2-core CPU", load_s=5, step_s=0.044,
        row_s=0.0045, prefill_token_s=0.0015,
        engine_factor={"paged-loop": 1.25, "paged-vectorized": 1.1},
        serving_tok_s={"continuous": 114, "prefix-cache": 114, "static-paged-attention": 64,
                       "static-hf": 48, "hf-cb": 67}),
    # One H100 with Qwen2.5-7B bf16 (15 GB of weights: 4.5 ms a step at 3.35 TB/s), eager
    # engines bound by the host's kernel launches. Assumed, not measured yet: the first GPU
    # run's CSVs should replace these.
    "cuda": DeviceCosts(
        "assumed for one H100 and Qwen2.5-7B bf16, not yet measured", load_s=15,
        step_s=0.030, row_s=0.0002, prefill_token_s=0.00005,
        engine_factor={"paged-loop": 3.0, "paged-vectorized": 1.2, "paged-attention": 0.8,
                       "async:sync": 0.7, "async:overlap": 0.5, "async:cuda-graph": 0.25},
        serving_tok_s={"continuous": 2000, "prefix-cache": 2000, "static-paged-attention": 320,
                       "static-hf": 260, "hf-cb": 800}),
}


def device_costs(device: torch.device) -> DeviceCosts:
    return COSTS["cuda" if device.type == "cuda" else "cpu"]


def dtype_name(model: str) -> str:
    return str(MODELS[model].default_dtype).removeprefix("torch.")


def bench_seconds(config: BenchConfig, device: torch.device,
                  engines: tuple[str, ...] | None = None) -> float:
    """Every engine at every batch size, warm-up runs included."""
    costs = device_costs(device)
    runs = config.warmup + config.repeat
    return sum(runs * (costs.prefill_token_s * batch * config.prompt_len
                       + config.new_tokens * costs.step(engine, batch))
               for engine in engines or config.engines for batch in config.batch_sizes)


def bench_plan(model: str, device: torch.device, config: BenchConfig) -> ChapterPlan:
    seconds = device_costs(device).load_s + bench_seconds(config, device)
    return ChapterPlan(model, dtype_name(model), config.engines, config.batch_sizes,
                       f"prompt {config.prompt_len} + {config.new_tokens} new",
                       config.repeat, seconds)


def profile_seconds(device: torch.device, engine: str, batch_sizes: tuple[int, ...],
                    prompt_len: int, steps: int) -> float:
    """Profiled decode steps; the profiler and the trace export about triple their cost."""
    costs = device_costs(device)
    return 3 * sum(costs.prefill_token_s * b * prompt_len + steps * costs.step(engine, b)
                   for b in batch_sizes)


def chapter05_plan(device: torch.device) -> ChapterPlan:
    model, base = default_workload(device)
    engines = ("hf", "paged-prealloc", "paged-prealloc/ranges-off")
    steps = chapter05_profile_steps(device) + 2  # the warm-up steps are in the trace too
    seconds = (device_costs(device).load_s + bench_seconds(base, device, engines)
               + sum(profile_seconds(device, e, base.batch_sizes, base.prompt_len, steps)
                     for e in ("paged-prealloc", "paged-loop")))
    return ChapterPlan(model, dtype_name(model), engines, base.batch_sizes,
                       f"prompt {base.prompt_len} + {base.new_tokens} new; "
                       f"{steps} profiled steps", base.repeat, seconds)


def chapter05_profile_steps(device: torch.device) -> int:
    return 20 if device.type == "cuda" else 8


def chapter07_plan(device: torch.device) -> ChapterPlan:
    model, base = default_workload(device)
    engines = CHAPTERS["07"].engines_for(device)
    config = replace(base, engines=engines)
    loops = [e for e in engines if e.startswith("async")]
    seconds = (bench_plan(model, device, config).estimate_s
               + sum(profile_seconds(device, e, (8,), base.prompt_len, 6) for e in loops))
    return replace(bench_plan(model, device, config), estimate_s=seconds,
                   tokens=f"prompt {base.prompt_len} + {base.new_tokens} new; "
                          f"4 profiled steps per loop")


def chapter08_plan(device: torch.device) -> ChapterPlan:
    return serving_plan(*serving_experiments(device), device, "target")


def chapter10_plan(device: torch.device, rounds: int = 3) -> ChapterPlan:
    """Chapter 08's target run with ``continuous``, in-process and over HTTP, ``rounds`` times
    (the server loads a model of its own: a second load)."""
    model, experiments = serving_experiments(device)
    target = replace(experiments["target"], systems=("continuous",))
    one = serving_plan(model, {"target": target}, device, "target")
    load_s = device_costs(device).load_s
    return replace(one, engines=("continuous", "http"), repeats=rounds,
                   estimate_s=2 * load_s + 2 * rounds * (one.estimate_s - load_s))


def serving_plan(model: str, experiments: dict[str, ServingBenchConfig], device: torch.device,
                 main: str) -> ChapterPlan:
    """A serving chapter's plan: every experiment's runs; ``main`` names the one described."""
    costs = device_costs(device)
    seconds = costs.load_s
    systems: list[str] = []
    for config in experiments.values():
        w = config.workload
        output_tokens = w.num_requests * sum(w.output_len) / 2
        for rate in config.request_rates or (w.request_rate,):
            span = w.num_requests / rate if math.isfinite(rate) else 0.0
            for system in config.systems:
                budgets = len(config.max_num_batched_tokens) \
                    if system in (*STEPPED_SYSTEMS, "hf-cb") else 1
                # Arrivals take their span; the work queues behind them (upper bound).
                seconds += budgets * (span + output_tokens / costs.serving_tok_s[system])
                systems += [s for s in (system,) if s not in systems]
    target = experiments[main].workload
    return ChapterPlan(model, dtype_name(model), tuple(systems),
                       tuple(c.static_batch_size for c in experiments.values())[:1],
                       f"{target.num_requests} requests, prompts {target.prompt_len[0]}-"
                       f"{target.prompt_len[1]}, outputs {target.output_len[0]}-"
                       f"{target.output_len[1]}; {len(experiments)} experiments", 1, seconds)
