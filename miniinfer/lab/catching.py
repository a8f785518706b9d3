"""Chapter 11's recording: our engine before and after ``torch.compile``, beside vLLM.

By default, what the chapter shows, each table's rows from one run so that its ratios compare
like with like:

- the offline benchmark (``<device>.csv``): hf, chapter 06's ``paged-attention`` (our best
  eager stage), ``compiled`` and, when installed, the peer ``vllm``, at batch 1 and 8; the
  compile time per graph goes to ``<device>-compile.csv``;
- chapter 08's ``target`` workload in-process (``<device>-{runs,requests,steps}.csv``):
  ``compiled`` and vLLM's ``LLM.generate``, :data:`SERVED_REPEATS` rounds of the two in turn;
- the same workload over HTTP (``<device>-http.csv``), measured at the client as chapter 10
  does: ``serve --engine compiled`` and ``vllm serve``, one row per server and round.

The probes behind its lab notes take over an hour on 2 cores and run only with
``MINIINFER_CH11_PROBES=1``: the budget sweep, the bf16 benchmark and served rows
(``-bf16.csv``, ``bf16/``), both engines under torch.profiler (``-profile.csv``), the steps
kernel by kernel (``-kernels.csv``, :mod:`.step_kernels`) and the ablation (``-ablation.csv``:
chapter 06's engine with the compiled forward's fixes added one at a time).

On a GPU it records nothing for now (see :func:`run_chapter11`). Without the peer (``make
peers``) the chapter records our rows and says so.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
import torch

from ..bench.devices import REPO_ROOT, device_slug, device_speed, recording_root, run_metadata
from ..bench.offline import make_bench_engine, run_bench, summary_table
from ..bench.peers import VLLM, PeerMissingError, check_peer
from ..bench.serving import ServingBenchConfig
from ..bench.serving.http import run_http_bench
from ..book.chapters import CHAPTERS
from ..book.workloads import default_workload, serving_experiments
from ..core.models import LoadedModel, dtype_name, load_model, resolve_device, smollm2_cache
from ..core.sampling import SamplingParams
from ..engines import make_engine
from ..runner.onednn_linear import onednn_available
from .client_bench import free_port
from .serving_records import record_serving

if TYPE_CHECKING:  # imported when used: loading inductor costs seconds
    from ..runner.compiled import CompileOptions

BATCH_SIZES = (1, 8)  # the rows: one request alone, and a batch
# Rounds of the target workload, in-process (each system in turn) and over HTTP: the target is
# a ratio near 1, and one system's runs of it spread by up to a third on a shared 2-core machine
# (ServingBenchConfig says where that was seen).
SERVED_REPEATS = 2
# Our compiled server compiles (or loads from inductor's cache) a graph per bucket before its
# port answers: 3-4 minutes from a warm cache on 2 cores, over 10 from a cold one.
SERVER_START_S = 1800.0
# In a profile, the code inductor generated: its fused loops and, where autotuned, GEMM templates.
COMPILED_GRAPHS = "compiled graphs (inductor's generated code)"
PROBES_ENV = "MINIINFER_CH11_PROBES"  # set to 1: the probes too (the module's docstring)


def peer_available() -> bool:
    """Whether vLLM is installed as a peer; prints why not (one line) when it is not."""
    try:
        check_peer(VLLM)
    except PeerMissingError as missing:
        print(f"chapter 11 records our rows only: {missing}")
        return False
    return True


def run_chapter11(device: str | torch.device | None = "auto") -> list[Path]:
    """Chapter 11 on this machine: the offline benchmark and the compile times, then chapter
    08's target workload served by each system, in-process and over HTTP; with the probes (see
    the module's docstring) the rest. Each part writes its files when it ends."""
    dev = resolve_device(device)
    if dev.type == "cuda":
        # The GPU plan has no room left in a session's device time (lab.plans), and the
        # device machine cannot install the peer.
        print("chapter 11 records on a CPU only for now; nothing to measure here")
        return []
    peer = peer_available()
    model, _ = default_workload(dev)
    lm = load_model(model, device=dev)
    written = record_offline(lm, peer)
    probes = os.environ.get(PROBES_ENV) == "1"
    written += record_served(lm, peer, budget_sweep=probes)
    target = served_experiments(dev, peer)["target"]
    written.append(record_http(lm, target, peer))
    if not probes:
        return written
    if bf16_supported(dev):
        bf16 = load_model(model, device=dev, dtype=torch.bfloat16)
        written += [record_bf16(bf16, peer), *record_served_bf16(bf16, peer)]
    written.append(record_profiles(lm, target, peer))
    written.append(record_step_kernels(lm, with_peer=peer))
    # Last: its four compiled forwards' graphs stay in memory with the process.
    written.append(record_ablation(lm))
    return written


def record_offline(lm: LoadedModel, peer: bool) -> list[Path]:
    """The offline benchmark (hf, paged-attention, compiled, vLLM) at batch 1 and 8 ->
    ``<device>.csv``, and the compiled forward's compile time per graph -> ``-compile.csv``."""
    dev = lm.device
    systems = tuple(e for e in CHAPTERS["11"].engines_for(dev.type) if e != VLLM or peer)
    engines = {name: make_bench_engine(name, lm) for name in systems}
    bench = _bench_and_close(lm, engines, device_speed(dev, store=True))
    bench_path = _path(dev, "")
    bench.to_csv(bench_path, index=False)
    forward = engines["compiled"].runner.forward
    compile_path = _path(dev, "-compile")
    pd.DataFrame([{"graph": graph, "tokens": tokens, "compile_s": seconds}
                  for (graph, tokens), seconds in sorted(forward.compile_seconds.items())]) \
        .assign(compiled=forward.compiled, reason_eager=forward.reason_eager or "",
                model=lm.name, dtype=dtype_name(lm.dtype), **run_metadata(dev)) \
        .to_csv(compile_path, index=False)
    return _wrote(bench_path, compile_path)


def ablation_options() -> dict[str, CompileOptions]:
    """The compiled forward's fixes, added one at a time: fusion alone (inductor's loops around
    MKL's GEMMs, attention reading the pool in place), then the weights frozen into the graph,
    then the GEMMs autotuned (inductor's C++ template, up to 32 tokens), then the larger steps'
    prompt chunks attended by segment, then the matmuls of steps from 16 tokens (48 on a CPU
    with AVX2 only) through oneDNN's prepacked weights, then the C++ kernel: the stage as it
    ships (in the recordings up to git afd74f1 the kernel took each step's first 32 tokens and
    the prompt chunks past them went by segment; it now takes every token, a prompt chunk's in
    tiles)."""
    from ..runner.compiled import CompileOptions

    fused = CompileOptions(attention_kernel=False)
    eager_gemms = replace(fused, onednn_min_tokens=None, onednn_min_tokens_bf16=None,
                          onednn_min_tokens_avx2=None)
    return {"fusion": replace(eager_gemms, max_autotune=False, freezing=False,
                              segment_attention_min_tokens=None),
            "+ freezing": replace(eager_gemms, max_autotune=False,
                                  segment_attention_min_tokens=None),
            "+ autotuned GEMMs": replace(eager_gemms, segment_attention_min_tokens=None),
            "+ attention by segment": eager_gemms,
            "+ oneDNN prepacked GEMMs": fused,
            "+ C++ attention kernel": CompileOptions()}


def record_ablation(lm: LoadedModel) -> Path:
    """What each fix bought: chapter 06's static ``paged-attention`` engine on its eager forward
    and on the compiled forward with each of :func:`ablation_options`, in one offline benchmark
    (batch 1 and 8; at batch 8 the TTFT is one 512-token prompt step) -> ``-ablation.csv``."""
    from ..runner.compiled import CompiledForward

    dev = lm.device
    base = default_workload(dev)[1]
    # Every step the benchmark runs: both prompts (batch x prompt tokens) and both decodes.
    steps = (*BATCH_SIZES, *(b * base.prompt_len for b in BATCH_SIZES))
    engines = {"paged-attention": make_engine("paged-attention", lm)}
    for fix, options in ablation_options().items():
        engine = make_engine("paged-attention", lm)
        engine.runner.forward = CompiledForward(lm.model, engine.kv_cache, options)
        engine.runner.forward.warm_up(steps)
        engines[f"compiled: {fix}"] = engine
    config = replace(base, engines=tuple(engines), batch_sizes=BATCH_SIZES, chapter="11")
    bench = run_bench(lm, config, engines, speed=device_speed(dev))
    print(summary_table(bench, ("tok_s", "step_ms", "ttft_ms")).to_string(index=False))
    path = _path(dev, "-ablation")
    bench.to_csv(path, index=False)
    return _wrote(path)[0]


def _bench_and_close(lm: LoadedModel, engines: dict, speed) -> pd.DataFrame:
    """The offline benchmark of ``engines`` at :data:`BATCH_SIZES`, in one run; the engines
    (a peer's process among them) are closed after it, and its summary printed."""
    config = replace(default_workload(lm.device)[1], engines=tuple(engines),
                     batch_sizes=BATCH_SIZES, chapter="11")
    try:
        bench = run_bench(lm, config, engines, speed=speed)
    finally:
        for engine in engines.values():
            if hasattr(engine, "close"):
                engine.close()
    print(summary_table(bench).to_string(index=False))
    return bench


def bf16_supported(dev: torch.device) -> bool:
    """Whether this CPU computes in bf16 as oneDNN needs it (AVX-512 or AVX-NE-CONVERT):
    without it, bf16 runs as emulated conversions, and a bf16 row would measure those."""
    return onednn_available(dev, torch.bfloat16)


def record_bf16(bf16: LoadedModel, peer: bool) -> Path:
    """The offline benchmark of ``bf16`` (the model in bfloat16): hf, ``compiled`` and vLLM,
    at batch 1 and 8 -> ``-bf16.csv``. The compiled stage compiles the buckets the benchmark
    meets (its first warm-up step does), not all of them."""
    systems = ("hf", "compiled", *((VLLM,) if peer else ()))
    engines = {name: make_bench_engine(name, bf16, **({"warm_up": False}
                                                       if name == "compiled" else {}))
               for name in systems}
    bench = _bench_and_close(bf16, engines, device_speed(bf16.device))
    path = _path(bf16.device, "-bf16")
    bench.to_csv(path, index=False)
    return _wrote(path)[0]


def served_experiments(dev: torch.device, peer: bool) -> dict[str, ServingBenchConfig]:
    """Chapter 08's ``target`` workload with ``compiled`` and vLLM, in
    :data:`SERVED_REPEATS` rounds, and its ``budget`` sweep with ``compiled`` and vLLM in turn
    at each budget, once (each budget one point of the wde post's throughput-latency curve)."""
    _, experiments = serving_experiments(dev)
    vllm = (VLLM,) if peer else ()
    # Chapter 08 shows `continuous` on this workload; here the compiled stage meets the peer.
    return {"target": replace(experiments["target"], systems=("compiled", *vllm),
                              chapter="11", repeats=SERVED_REPEATS),
            "budget": replace(experiments["budget"], systems=("compiled", *vllm),
                              chapter="11")}


def record_served(lm: LoadedModel, peer: bool, budget_sweep: bool = True) -> list[Path]:
    """:func:`served_experiments` in-process (the budget sweep only if ``budget_sweep``) ->
    ``-{runs,requests,steps}.csv``."""
    experiments = served_experiments(lm.device, peer)
    if not budget_sweep:
        del experiments["budget"]
    return record_serving(lm.device, "11", lm.name, experiments)[1]


def record_served_bf16(bf16: LoadedModel, peer: bool) -> list[Path]:
    """The target workload with ``bf16`` (the model in bfloat16), ``compiled`` and vLLM,
    in-process and over HTTP -> ``bf16/<device>-{runs,requests,steps,http}.csv`` (a folder of
    their own: the fp32 tables' readers glob this one's)."""
    target = served_experiments(bf16.device, peer)["target"]
    target = replace(target, systems=tuple(s for s in target.systems if s != "continuous"))
    _, written = record_serving(bf16.device, "11", bf16.name, {"target": target},
                                dtype=bf16.dtype, subdir="bf16")
    return [*written, record_http(bf16, target, peer, subdir="bf16")]


def record_http(lm: LoadedModel, target: ServingBenchConfig, with_peer: bool,
                subdir: str = "") -> Path:
    """The target workload over HTTP, measured at the client (chapter 10's ``bench-serving
    --base-url``): our server on the compiled stage, then (``with_peer``) ``vllm serve``, each
    with the target's token budget and ``lm``'s dtype, the target's rounds against each ->
    ``[<subdir>/]<device>-http.csv``, one row per server and round. vLLM serves SmolLM2 from its directory, so with another model only ours is
    recorded."""
    from ..bench.peers.vllm_server import start_vllm_server
    from ..server import ServerProcess

    budget = target.max_num_batched_tokens[0]
    dtype = dtype_name(lm.dtype)
    runs = []
    with ServerProcess(lm.name, "--engine", "compiled", "--dtype", dtype,
                       "--max-num-batched-tokens", str(budget), timeout=SERVER_START_S) as ours:
        runs.append(run_http_bench(lm, ours.base_url, target.workload, chapter="11",
                                   repeats=target.repeats)
                    .runs.assign(server="compiled", peer_version=""))
    if with_peer and lm.name == "smollm2-135m":
        with start_vllm_server(smollm2_cache(), lm.name, port=free_port(), dtype=dtype,
                               max_num_batched_tokens=budget) as vllm_serve:
            runs.append(run_http_bench(lm, vllm_serve.base_url, target.workload, chapter="11",
                                       repeats=target.repeats)
                        .runs.assign(server=VLLM, peer_version=vllm_serve.version))
    table = pd.concat(runs, ignore_index=True).assign(max_num_batched_tokens=budget)
    print(table[["server", "repeat", "output_throughput", "ttft_p50_ms", "itl_p50_ms",
                 "itl_p99_ms"]].to_string(index=False))
    path = _path(lm.device, "-http", subdir)
    table.to_csv(path, index=False)
    return _wrote(path)[0]


def record_profiles(lm: LoadedModel, target: ServingBenchConfig, with_peer: bool) -> Path:
    """The target workload once more per engine, under torch.profiler (CPU activity), after a
    plain run: ``compiled`` in this process and, ``with_peer``, vLLM with its engine core in
    its driver's process -> ``-profile.csv``, every op's calls and self time per engine, with
    its share of the run. (Inductor's generated loops and GEMM templates count as the
    compiled graphs' own time, one entry: :data:`COMPILED_GRAPHS`.)"""
    from torch.profiler import ProfilerActivity, profile

    from ..bench.peers.vllm_peer import VLLMEngine
    from ..bench.serving import make_workload, serve_continuous

    budget = target.max_num_batched_tokens[0]
    workload = make_workload(lm, target.workload)
    tables = []
    engine = make_engine("compiled", lm, max_num_batched_tokens=budget)
    serve_continuous(engine, workload)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run = serve_continuous(engine, workload)
    ops = [{"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3,
            "total_ms": e.cpu_time_total / 1e3} for e in prof.key_averages()]
    tables.append(_ops_table(ops, "compiled", run.end - run.start))
    engine.close()
    if with_peer:
        vllm = VLLMEngine(lm, max_num_batched_tokens=budget, in_process=True)
        try:
            peer_run, ops = vllm.profile(
                [{"prompt_ids": w.prompt_ids, "max_tokens": w.max_new_tokens} for w in workload],
                SamplingParams(ignore_eos=True))
        finally:
            vllm.close()
        tables.append(_ops_table(ops, VLLM, peer_run["duration_s"]).assign(
            peer_version=vllm.version))
    table = pd.concat(tables, ignore_index=True).assign(
        max_num_batched_tokens=budget, num_requests=len(workload), model=lm.name,
        dtype=dtype_name(lm.dtype), **run_metadata(lm.device))
    for system, ops in table.groupby("system", sort=False):
        print(f"{system}:\n{ops.head(8)[['op', 'calls', 'self_ms', 'share_pct']].to_string(index=False)}")
    path = _path(lm.device, "-profile")
    table.to_csv(path, index=False)
    return _wrote(path)[0]


def record_step_kernels(lm: LoadedModel, decode_steps: int = 10, mixed_steps: int = 4,
                        with_peer: bool = False, rounds: int = 3) -> Path:
    """:data:`.step_kernels.SCENARIOS` on the compiled stage, its profiled steps on a forward
    compiled with inductor's kernel profile (graphs of its own, compiled for the scenarios'
    four buckets as they first need them), and ``with_peer`` the same scenarios on vLLM
    (its engine core in its driver's process, the same token budget), in ``rounds`` rounds,
    the two systems taken in turn; in each, a scenario's steps profiled and then the same steps
    again with no profiler (on our engine's own forward) -> ``-kernels.csv``: each system's
    and scenario's parts in ms per step, from its round of median step time
    (:func:`.step_kernels.kept_rounds`), and its median step with no profiler; vLLM's rows
    also its unprofiled step over ours, round by round."""
    from ..bench.peers.vllm_peer import VLLMEngine
    from ..runner.compiled import CompiledForward, CompileOptions
    from .step_kernels import (
        SCENARIOS,
        kept_rounds,
        profile_scenario,
        profile_vllm_steps,
        time_scenario,
        time_vllm_steps,
    )

    engine = make_engine("compiled", lm, warm_up=False)
    budget = engine.scheduler.config.max_num_batched_tokens
    profiled = CompiledForward(lm.model, engine.kv_cache, CompileOptions(kernel_profile=True))
    vllm = None
    profiles: dict[tuple[str, str], list[pd.DataFrame]] = {}

    def unprofiled(step_s: list[float]) -> dict[str, float]:
        return {"unprofiled_step_ms": statistics.median(step_s) * 1e3}

    try:
        if with_peer:
            vllm = VLLMEngine(lm, max_num_batched_tokens=budget, in_process=True)
        for _ in range(rounds):
            for scenario in SCENARIOS:
                steps = mixed_steps if scenario.new_prompts else decode_steps
                profiles.setdefault(("compiled", scenario.name), []).append(
                    profile_scenario(engine, scenario, steps, forward=profiled)
                    .assign(**unprofiled(time_scenario(engine, scenario, steps))))
                if vllm is not None:
                    profiles.setdefault(("vLLM", scenario.name), []).append(
                        profile_vllm_steps(vllm, lm, scenario, steps)
                        .assign(**unprofiled(time_vllm_steps(vllm, lm, scenario, steps)),
                                peer_version=vllm.version))
    finally:
        engine.close()
        if vllm is not None:
            vllm.close()
    table = kept_rounds(profiles).assign(model=lm.name, dtype=dtype_name(lm.dtype),
                                         **run_metadata(lm.device))
    for (system, name), parts in table.groupby(["system", "scenario"], sort=False):
        first = parts.iloc[0]
        print(f"{system}, {name}: {first.step_ms:.1f} ms a step profiled (median of "
              f"{first.rounds} rounds, {first.step_ms_min:.1f}-{first.step_ms_max:.1f}), "
              f"{first.unprofiled_step_ms:.1f} not ({first.unprofiled_ms_min:.1f}-"
              f"{first.unprofiled_ms_max:.1f})"
              + (f", {first.unprofiled_vs_compiled:.2f}x ours round by round "
                 f"({first.unprofiled_vs_compiled_min:.2f}-{first.unprofiled_vs_compiled_max:.2f})"
                 if system != "compiled" else "") + "\n"
              f"{parts[['part', 'ms_per_step', 'share_pct']].round(1).to_string(index=False)}")
    path = _path(lm.device, "-kernels")
    table.to_csv(path, index=False)
    return _wrote(path)[0]


def _ops_table(ops: list[dict], system: str, run_s: float) -> pd.DataFrame:
    """Ops by self time, each compiled graph's calls (named by a hash) counted as one op."""
    table = pd.DataFrame(ops)
    table["op"] = table.op.str.replace(r"^## Call CompiledFxGraph .* ##$", COMPILED_GRAPHS,
                                       regex=True)
    table = table.groupby("op", as_index=False)[["calls", "self_ms", "total_ms"]].sum() \
        .sort_values("self_ms", ascending=False, ignore_index=True)
    return table.assign(system=system, run_s=run_s,
                        share_pct=100 * table.self_ms / table.self_ms.sum())


def _path(dev: torch.device, suffix: str, subdir: str = "") -> Path:
    out_dir = recording_root() / "ch11" / subdir
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir / f"{device_slug(dev)}{suffix}.csv"


def _wrote(*paths: Path) -> list[Path]:
    for path in paths:
        print(f"wrote {path.relative_to(REPO_ROOT)}")
    return list(paths)
