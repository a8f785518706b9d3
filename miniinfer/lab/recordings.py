"""Each chapter's recording, into ``data/results/chNN/<device-slug>*.csv``: :data:`RECORDERS`
maps a chapter's ``recording`` (in the chapter registry) to the function that records it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch

from ..bench.devices import REPO_ROOT, device_slug, device_speed, recording_root, run_metadata
from ..bench.offline import run_bench, summary_table
from ..bench.serving import WorkloadConfig, run_serving_bench
from ..bench.serving import summary_table as serving_summary_table
from ..book.chapters import CHAPTERS
from ..book.workloads import (
    ContextSweep,
    chapter05_profile_steps,
    context_sweep,
    default_workload,
    prefix_cache_experiments,
    server_cost_workload,
    serving_experiments,
)
from ..core.errors import MiniInferError
from ..core.models import LoadedModel, dtype_name, load_model, resolve_device
from .catching import run_chapter11
from .client_bench import record_vllm_bench_serve
from .parallel import run_chapter12
from .quantization import record_llama_cpp, record_quality
from .serving_records import record_serving
from .speculation import record_speculation


def results_path(chapter: str, device: torch.device) -> Path:
    return recording_root() / f"ch{chapter}" / f"{device_slug(device)}.csv"


def run_chapter_bench(chapter: str, device: str | torch.device | None = "auto",
                      lm: LoadedModel | None = None) -> Path:
    """The chapter's offline benchmark (on ``lm``, or the device's default model)."""
    dev = resolve_device(device)
    model, base = default_workload(dev, chapter)
    config = replace(base, engines=CHAPTERS[chapter].engines_for(dev.type), chapter=chapter)
    lm = lm or load_model(model, device=dev)
    df = run_bench(lm, config, speed=device_speed(dev, store=True))
    print(summary_table(df).to_string(index=False))
    out = results_path(chapter, dev)
    out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(out, index=False)
    print(f"wrote {out.relative_to(REPO_ROOT)}")
    return out


def run_context_sweep(lm, engines: tuple[str, ...], sweep: ContextSweep, speed,
                      chapter: str = "") -> pd.DataFrame:
    """One row per engine x context length: plain decode ``step_ms``, ``decode_tok_s``,
    ``ttft_ms``, ``pct_of_hf`` (decode step, hf's over the engine's), the decode floor, and for
    paged stages ``<phase>_ms`` per step from a profiled run (``profiled_step_ms`` is that run's
    step: the profiler adds its own cost per op, so read phases as shares of it), and
    ``attention_gather_ms``, the block gather a reference paged attention does inside the
    forward (0 for stages that gather in the engine, or for a kernel that reads blocks in
    place)."""
    from ..bench.devices import LoadGuard, decode_floor, run_metadata
    from ..bench.offline import make_prompts, own_threads, run_metrics
    from ..bench.profiling import phase_table, profile_decode
    from ..book.profiles import attention_gather_ms
    from ..core.kv_cache import DEFAULT_BLOCK_SIZE, blocks_for
    from ..core.sampling import SamplingParams
    from ..engines import make_engine

    # The default pool (1 GiB) holds 8 x 2,340 tokens of Qwen2.5-7B: a GPU sweep's longest
    # contexts need a pool sized for them, or the last point fails with its KV cache full.
    pool = {"num_blocks": sweep.batch_size * blocks_for(max(sweep.context_lens)
                                                        + sweep.new_tokens, DEFAULT_BLOCK_SIZE)}
    made = {name: make_engine(name, lm, **({} if name == "hf" else pool)) for name in engines}
    params = SamplingParams(max_new_tokens=sweep.new_tokens, ignore_eos=True)
    meta = run_metadata(lm.device)
    warm = make_prompts(lm, sweep.batch_size, min(sweep.context_lens))
    for engine in made.values():
        engine.generate(warm, params)
    # Every plain run before the first profiled one: on a GPU, steps after a profiler session
    # in the same process ran slower (hf 18.8 ms, then 64-84 ms on the H100; see the README).
    measured: dict[int, dict[str, dict]] = {}
    loads = {}
    prompts = {n: make_prompts(lm, sweep.batch_size, n) for n in sweep.context_lens}
    for context_len in sweep.context_lens:
        with LoadGuard(own_threads(lm)) as loads[context_len]:
            measured[context_len] = {
                name: run_metrics(engine.generate(prompts[context_len], params),
                                  sweep.batch_size, sweep.new_tokens)
                for name, engine in made.items()}
        loads[context_len].warn(f"context {context_len}")
    for context_len, row_of in measured.items():
        for name in [name for name in made if name != "hf"]:
            trace = profile_decode(made[name], prompts[context_len], sweep.profiled_steps,
                                   warmup_steps=1, warm=False)
            phases = phase_table(trace).set_index("phase").ms_per_step
            row_of[name] |= {("profiled_step" if k == "decode_step" else k.strip("()")) + "_ms": v
                             for k, v in phases.items()}
            row_of[name]["attention_gather_ms"] = attention_gather_ms(trace)
    rows = []
    for context_len, row_of in measured.items():
        floor = decode_floor(lm, sweep.batch_size, context_len + sweep.new_tokens // 2,
                             speed.bandwidth, speed.peak_flops)
        hf_step = row_of["hf"]["step_ms"] if "hf" in row_of else float("nan")
        for name, row in row_of.items():
            rows.append({"chapter": chapter, "engine": name, "model": lm.name,
                         "dtype": dtype_name(lm.dtype),
                         "batch_size": sweep.batch_size, "context_len": context_len,
                         "new_tokens": sweep.new_tokens, **row,
                         "pct_of_hf": 100 * hf_step / row["step_ms"],
                         "floor_ms": floor.step_ms, "floor_bound": floor.bound,
                         "kv_mb_per_step": floor.kv_bytes / 2**20,
                         "pct_of_floor": 100 * floor.step_ms / row["step_ms"],
                         **loads[context_len].columns(), **meta})
    return pd.DataFrame(rows)


def run_chapter_context(chapter: str, device: str | torch.device | None = "auto") -> Path:
    """The context sweep of ``chapter`` on this device -> ``chNN/<device>-context.csv``."""
    dev = resolve_device(device)
    model, _ = default_workload(dev)
    lm = load_model(model, device=dev)
    df = run_context_sweep(lm, CHAPTERS[chapter].context_sweep, context_sweep(dev),
                           device_speed(dev, store=True), chapter)
    print(df.pivot_table(index="context_len", columns="engine", values="step_ms",
                         sort=False).round(1).to_string())
    out = recording_root() / f"ch{chapter}" / f"{device_slug(dev)}-context.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(out, index=False)
    print(f"wrote {out.relative_to(REPO_ROOT)}")
    return out


def run_chapter05(device: str | torch.device | None = "auto") -> list[Path]:
    """Benchmark hf vs paged-prealloc with ranges on and off in one run (first: see
    :func:`run_context_sweep`); then profile ``paged-prealloc`` at batch 1/4/8: its phases over
    several profiled repeats (median and min-max), its top ops and a trace per batch size, and
    ``paged-loop``'s op counts; on a CPU, every op of a decode step timed at the roofline's
    batch sizes (``-roofline.csv``)."""
    from ..bench.profiling import RangesOff, phase_repeats, profile_stages
    from ..book.roofline import BATCH_SIZES as ROOFLINE_BATCHES
    from ..book.roofline import record_op_times
    from ..engines import make_engine

    dev = resolve_device(device)
    model, base = default_workload(dev)
    lm = load_model(model, device=dev)
    slug = device_slug(dev)
    out_dir = recording_root() / "ch05"
    steps = chapter05_profile_steps(dev)
    prealloc = make_engine("paged-prealloc", lm)
    config = replace(base, engines=("hf", "paged-prealloc", "paged-prealloc/ranges-off"),
                     chapter="05")
    bench = run_bench(lm, config, {"hf": make_engine("hf", lm), "paged-prealloc": prealloc,
                                   "paged-prealloc/ranges-off": RangesOff(prealloc)},
                      speed=device_speed(dev, store=True))
    print(summary_table(bench).to_string(index=False))
    prof = profile_stages(lm, base.batch_sizes, base.prompt_len, steps, trace_dir=out_dir,
                          trace_prefix=f"{slug}-")
    phases = phase_repeats(lm, "paged-prealloc", base.batch_sizes, base.prompt_len, steps,
                           repeats=5)
    if "device_ms_per_step" in prof.phases:  # CUDA: the device time of one profiled run
        phases = phases.merge(prof.phases[["batch_size", "phase", "device_ms_per_step"]],
                              on=["batch_size", "phase"], how="left")
    # The roofline's achieved points: every op of a decode step timed at each of its batch
    # sizes (a CPU's profile only: on a GPU an op's CPU span is its launch, see roofline).
    roofline = (record_op_times(lm, ROOFLINE_BATCHES, base.prompt_len) if dev.type == "cpu"
                else None)
    meta = bench.iloc[0][["model", "dtype", "device", "device_name", "isa", "torch",
                          "transformers", "git_sha", "date"]].to_dict()
    written = []
    tables = [("phases", phases), ("ops", prof.ops), ("top", prof.top), ("bench", bench)]
    if roofline is not None:
        tables.append(("roofline", roofline))
    for kind, df in tables:
        path = out_dir / f"{slug}-{kind}.csv"
        df.assign(**{k: v for k, v in meta.items() if k not in df}).to_csv(path, index=False)
        written.append(path)
        print(f"wrote {path.relative_to(REPO_ROOT)}")
    return written


def run_chapter06(device: str | torch.device | None = "auto") -> list[Path]:
    """The chapter's offline benchmark; on a GPU, then the decode kernel alone timed as a memory
    stream at batch 8 and 1-4k tokens of context (``kernel/<device>.csv``: a folder of its own,
    since the benchmark CSVs are every *.csv directly in ch06/)."""
    from ..bench.kernels import decode_kernel_bandwidth

    dev = resolve_device(device)
    written = [run_chapter_bench("06", dev)]
    if dev.type == "cuda":
        df = decode_kernel_bandwidth(dev).assign(chapter="06")
        print(df[["context_len", "backend", "kv_mb", "kernel_us", "gbs", "pct_of_copy"]]
              .round(1).to_string(index=False))
        path = recording_root() / "ch06" / "kernel" / f"{device_slug(dev)}.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        df.to_csv(path, index=False)
        print(f"wrote {path.relative_to(REPO_ROOT)}")
        written.append(path)
    return written


def run_chapter07(device: str | torch.device | None = "auto") -> list[Path]:
    """The benchmark of every loop (``<device>.csv``), then a few profiled decode steps of each
    loop at batch 8 as Gantt bars (``timeline/<device>.csv.gz``)."""
    from ..bench.offline import make_prompts
    from ..bench.profiling import profile_decode, timeline
    from ..engines import make_engine

    dev = resolve_device(device)
    model, base = default_workload(dev)
    lm = load_model(model, device=dev)  # once: a second 7B would hold 15 GB more
    bench_path = run_chapter_bench("07", dev, lm)
    prompts = make_prompts(lm, 8, base.prompt_len)
    bars = []
    for name in CHAPTERS["07"].engines_for(dev.type):
        if name.startswith("async") or name == "paged-attention":
            trace = profile_decode(make_engine(name, lm), prompts, steps=4)
            bars.append(timeline(trace).assign(engine=name, batch_size=8))
    # A folder of its own (the chapter's benchmark CSVs are every *.csv in ch07/), gzipped (a
    # GPU's bars are a row per kernel). Its metadata as written: read_results labels the CPU.
    path = recording_root() / "ch07" / "timeline" / f"{device_slug(dev)}.csv.gz"
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = pd.read_csv(bench_path, dtype=str).iloc[0][[
        "model", "dtype", "device", "device_name", "isa", "torch", "git_sha", "date"]].to_dict()
    pd.concat(bars, ignore_index=True).assign(**meta).to_csv(path, index=False)
    print(f"wrote {path.relative_to(REPO_ROOT)}")
    return [bench_path, path]


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
    rounds so drift hits both alike. Writes ``<device>-runs.csv`` and ``-requests.csv``; then,
    with the same server, the server's own cost per request (:func:`record_server_cost`,
    ``-server-cost.csv``); last, with the peer installed, vLLM's own load client against a
    fresh server and ``vllm serve`` (``-vllm-bench.csv``, :mod:`.client_bench`)."""
    from ..bench.serving import default_pool_bytes
    from ..bench.serving.http import run_http_bench
    from ..book.analysis import server_cost_table
    from ..engines import make_engine
    from ..server import ServerProcess

    dev = resolve_device(device)
    model, experiments = serving_experiments(dev)
    target = replace(experiments["target"], systems=("continuous",), chapter="10")
    lm = load_model(model, device=dev)
    # The server's engine gets the same token budget and KV pool as the in-process one.
    server_args = ["--device", str(dev), "--dtype", dtype_name(lm.dtype),
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
        # The server's own cost, where nothing queues: the same engine settings in-process.
        cost = record_server_cost(lm, make_engine(
            "continuous", lm, max_num_batched_tokens=target.max_num_batched_tokens[0],
            kv_cache_bytes=target.kv_cache_bytes or default_pool_bytes(lm)), server.base_url,
            server_cost_workload(dev))
    print(server_cost_table(cost).round(1).to_string())
    # The field's own client against our server and vLLM's (when the peer is installed).
    client_runs = record_vllm_bench_serve(dev, model, server_args,
                                          target.max_num_batched_tokens[0],
                                          dtype=dtype_name(lm.dtype))
    table = pd.concat(runs, ignore_index=True)
    by_round = table.pivot_table(index="round", columns="system",
                                 values=["output_throughput", "ttft_p50_ms"])
    ratio = (by_round.output_throughput.http / by_round.output_throughput.continuous).median()
    overhead = (by_round.ttft_p50_ms.http - by_round.ttft_p50_ms.continuous).median()
    print(f"http / in-process output tokens/s: {ratio:.3f} (median of {rounds} rounds); "
          f"TTFT p50 overhead: {overhead:.1f} ms")
    out_dir = recording_root() / "ch10"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for kind, frame in (("runs", table), ("requests", pd.concat(requests, ignore_index=True)),
                        ("server-cost", cost)):
        path = out_dir / f"{device_slug(dev)}-{kind}.csv"
        frame.to_csv(path, index=False)
        written.append(path)
        print(f"wrote {path.relative_to(REPO_ROOT)}")
    return written + client_runs


def record_server_cost(lm: LoadedModel, engine, base_url: str, workload: WorkloadConfig,
                       warmup: int = 3) -> pd.DataFrame:
    """The server's own cost per request: each request of ``workload`` sent alone to an idle
    engine, in this process (``engine``: a continuous engine configured as the server's) and
    over HTTP to the server at ``base_url``, streamed and not; the in-process run comes first
    for one request and last for the next, so that drift hits both sides alike. Two rows per
    request, one per mode (``stream``: TTFT at the first chunk, and the whole request;
    ``no-stream``: the whole request, one response at the end), each paired with the same
    in-process run (in this process there is nothing to stream), times in ms as each side's
    client sees them. Nothing else runs meanwhile: what HTTP adds is the server's work
    (parsing, the queue hop to its engine thread, its arrival window, detokenizing, the socket)
    and the client's."""
    import httpx

    from ..bench.serving import make_workload, request_table, serve_continuous
    from ..bench.serving.http import serve_http

    requests = [replace(w, arrival_s=0.0) for w in make_workload(lm, workload)]

    def in_process(w) -> dict[str, float]:
        row = request_table(serve_continuous(engine, [w])).iloc[0]
        return {"in_process_ttft_ms": row.ttft_ms, "in_process_e2e_ms": row.e2e_ms}

    def streamed(w) -> dict[str, float]:
        row = request_table(serve_http(base_url, lm.name, [w])).iloc[0]
        return {"stream_ttft_ms": row.ttft_ms, "stream_e2e_ms": row.e2e_ms}

    client = httpx.Client(base_url=base_url, timeout=None)

    def whole(w) -> dict[str, float]:
        body = {"model": lm.name, "prompt": w.prompt_ids, "max_tokens": w.max_new_tokens,
                "temperature": 0, "ignore_eos": True}
        start = time.perf_counter()
        response = client.post("/completions", json=body)
        e2e = (time.perf_counter() - start) * 1e3
        response.raise_for_status()
        generated = response.json()["usage"]["completion_tokens"]
        if generated != w.max_new_tokens:
            raise MiniInferError(f"request {w.index}: the server generated {generated} tokens, "
                                 f"asked {w.max_new_tokens}")
        return {"whole_e2e_ms": e2e}

    with client:
        for w in requests[:warmup]:  # allocator, kernels and connections warm on both sides
            in_process(w), streamed(w), whole(w)
        rows = []
        for i, w in enumerate(requests):
            runs = (in_process, streamed, whole) if i % 2 == 0 else (streamed, whole, in_process)
            t = {k: v for run in runs for k, v in run(w).items()}
            common = {"request": w.index, "prompt_len": len(w.prompt_ids),
                      "output_len": w.max_new_tokens, "in_process_e2e_ms": t["in_process_e2e_ms"]}
            rows.append({**common, "mode": "stream", "in_process_ttft_ms": t["in_process_ttft_ms"],
                         "http_ttft_ms": t["stream_ttft_ms"], "http_e2e_ms": t["stream_e2e_ms"]})
            # One response at the end: no first chunk to time.
            rows.append({**common, "mode": "no-stream", "in_process_ttft_ms": float("nan"),
                         "http_ttft_ms": float("nan"), "http_e2e_ms": t["whole_e2e_ms"]})
    meta = run_metadata(lm.device)
    return pd.DataFrame(rows).assign(chapter="10", model=lm.name, dtype=dtype_name(lm.dtype),
                                      base_url=base_url, **meta)


def _record_deploy(device: torch.device) -> Path:
    from .deploy import record_deploy

    return record_deploy(device)


def _reads_results_only(chapter: str, device: torch.device) -> list[Path]:
    print(f"chapter {chapter} reads the recorded results only: nothing to measure")
    return []


# A chapter's `recording` in the registry -> what records it: (chapter, device) -> files.
RECORDERS: dict[str, Callable[[str, torch.device], list[Path]]] = {
    "none": _reads_results_only,
    "bench": lambda chapter, device: [run_chapter_bench(chapter, device)],
    "paged": lambda chapter, device: run_chapter06(device),
    "profile": lambda chapter, device: run_chapter05(device),
    "async": lambda chapter, device: run_chapter07(device),
    "serving": lambda chapter, device: run_chapter08(device),
    "prefix": lambda chapter, device: run_chapter09(device),
    "server": lambda chapter, device: run_chapter10(device),
    "catching": lambda chapter, device: run_chapter11(device),  # book/catching.py
    "parallel": lambda chapter, device: run_chapter12(device),  # book/parallel.py
    "quantized": lambda ch, d: [run_chapter_bench(ch, d), *record_llama_cpp(d), *record_quality(d)],
    "speculative": lambda chapter, device: [record_speculation(device)],  # book/speculation.py
    "composed": lambda chapter, device: [_record_deploy(device)],  # lab/deploy.py
}
