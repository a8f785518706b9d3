"""What a chapter's recording will run and about how long it takes, without touching the device
(``python -m miniinfer repro all --dry-run``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..bench.offline import BenchConfig
from ..bench.serving import STEPPED_SYSTEMS, ServingBenchConfig
from ..book.chapters import CHAPTERS
from ..book.roofline import BATCH_SIZES as ROOFLINE_BATCHES
from ..book.workloads import (
    chapter05_profile_steps,
    context_sweep,
    default_workload,
    prefix_cache_experiments,
    server_cost_workload,
    serving_experiments,
)
from ..core.models import MODELS, dtype_name


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
    logged: bool = False  # the estimate is the last logged run's duration, not the cost model's


def plan_table(chapters: list[str], plans: list[ChapterPlan], device: torch.device) -> str:
    """Two lines a chapter, then the total."""
    lines = [f"repro on {device} ({device_costs(device).basis}):"]
    for chapter, p in zip(chapters, plans, strict=True):
        batches = ",".join(map(str, p.batch_sizes))
        basis = "logged" if p.logged else "model "
        lines.append(f"  {chapter}  ~{p.estimate_s / 60:4.1f} min ({basis})  {p.model} {p.dtype}  "
                     f"batch {batches}  {p.tokens}  {p.repeats} repeat(s)")
        lines.append(f"      engines: {', '.join(p.engines)}")
    total = sum(p.estimate_s for p in plans) / 60
    lines.append(f"estimated total: {total:.1f} min for {len(plans)} chapter(s) "
                 "(logged: the last --for-book run's duration, with its notebook where the log "
                 "says so; model: the cost model, recordings only)")
    return "\n".join(lines)


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
    # What the profiler adds per profiled step beyond the tripled step (a GPU step's thousand
    # kernels, each recorded and exported).
    profiled_step_s: float = 0.0
    # What each serving run costs beyond its tokens (the engine built, warmed and drained).
    serving_run_s: float = 0.0

    def step(self, engine: str, batch_size: int) -> float:
        factor = self.engine_factor.get(engine, self.engine_factor.get(engine.split(":")[0], 1))
        return (self.step_s + self.row_s * batch_size) * factor

    def generate(self, engine: str, batch_size: int, prompt_len: int, new_tokens: int) -> float:
        """One generate call: the batch's prompts prefilled, then ``new_tokens`` decode steps."""
        return (self.prefill_token_s * batch_size * prompt_len
                + new_tokens * self.step(engine, batch_size))


COSTS = {
    # Fitted to the recorded CPU tables (shared 2-core EPYC Zen 4, SmolLM2 fp32): hf at 21
    # tok/s at batch 1 and ~100 at batch 8, prefill ~1.5 ms a token; chapter 08's target run.
    # A Zen 3 sold under the same name is 2-3x slower: chapter 03's context sweep took 473 s
    # there against the 245 s planned (hf's batch-8 step 230-440 ms against the Zen 4's 88-121).
    "cpu": DeviceCosts(
        "estimates fitted to the recorded runs on a 2-core Zen 4 CPU; a Zen 3 takes 2-3x",
        load_s=5, step_s=0.044,
        row_s=0.0045, prefill_token_s=0.0015,
        engine_factor={"paged-loop": 1.25, "paged-vectorized": 1.1, "compiled": 0.45,
                       "vllm": 0.5, "quantized": 0.2},
        serving_tok_s={"continuous": 114, "prefix-cache": 114, "static-paged-attention": 64,
                       "static-hf": 48, "hf-cb": 67, "compiled": 120, "vllm": 120}),
    # Measured on one H200 and one H100 (2026-11-26, Qwen2.5-7B bf16, data/results/ch05-09
    # and the run logs in data/results/logs), each figure the slower GPU's, since a session may
    # get either: every eager stage is bound by the host's kernel launches, about 18-19 ms a
    # step whatever the batch (the floor is 3.7-5.2 ms); the CUDA-graph loop 6.7-7.1 ms (H200
    # only); chapter 08's target workload (128 requests: continuous 2,380 output tok/s on the
    # H100, 3,190 on the H200). Each serving run of chapter 09's short workloads took 0.5-1 s
    # more than its tokens at those rates. paged-loop and the load are still guesses.
    "cuda": DeviceCosts(
        "fitted to an H200 and an H100 run (chapters 05-09) with Qwen2.5-7B bf16", load_s=15,
        step_s=0.019, row_s=0.0, prefill_token_s=0.00005,
        engine_factor={"paged-loop": 3.0, "paged-vectorized": 1.3, "paged-attention": 1.0,
                       "paged-attention:registry": 1.2, "async:sync": 1.0,
                       "async:overlap": 1.0, "async:cuda-graph": 0.4},
        serving_tok_s={"continuous": 2380, "prefix-cache": 2380, "static-paged-attention": 242,
                       "static-hf": 145, "hf-cb": 756, "compiled": 2380, "vllm": 2380},
        serving_run_s=1.0,
        profiled_step_s=1.0),  # chapter 05: 132 profiled steps took ~130 s beyond its benchmark
}


def device_costs(device: torch.device) -> DeviceCosts:
    return COSTS["cuda" if device.type == "cuda" else "cpu"]


def bench_seconds(config: BenchConfig, device: torch.device,
                  engines: tuple[str, ...] | None = None) -> float:
    """Every engine at every batch size, warm-up runs included."""
    costs = device_costs(device)
    runs = config.warmup + config.repeat
    return sum(runs * costs.generate(engine, batch, config.prompt_len, config.new_tokens)
               for engine in engines or config.engines for batch in config.batch_sizes)


def bench_plan(model: str, device: torch.device, config: BenchConfig) -> ChapterPlan:
    seconds = device_costs(device).load_s + bench_seconds(config, device)
    return ChapterPlan(model, dtype_name(MODELS[model].default_dtype), config.engines, config.batch_sizes,
                       f"prompt {config.prompt_len} + {config.new_tokens} new",
                       config.repeat, seconds)


def sweep_seconds(engines: tuple[str, ...], device: torch.device) -> float:
    """A chapter's context sweep (recordings.run_context_sweep): a warm-up and a plain run per
    engine and length, then a profiled run per paged engine and length. (On the H100 chapter
    06's, 3 paged engines x 5 lengths x 9 profiled steps, took about 130 s.)"""
    costs, sweep = device_costs(device), context_sweep(device)
    b = sweep.batch_size
    warm = sum(costs.generate(e, b, min(sweep.context_lens), sweep.new_tokens) for e in engines)
    plain = sum(costs.generate(e, b, n, sweep.new_tokens)
                for e in engines for n in sweep.context_lens)
    profiled = sum(profile_seconds(device, e, (b,), n, sweep.profiled_steps + 1)
                   for e in engines if e != "hf" for n in sweep.context_lens)
    return warm + plain + profiled


def bench_chapter_plan(chapter: str, device: torch.device) -> ChapterPlan:
    """A benchmark chapter: its stages at batch 1, 4 and 8, and its context sweep if any."""
    model, base = default_workload(device, chapter)
    plan = bench_plan(model, device,
                      replace(base, engines=CHAPTERS[chapter].engines_for(device.type)))
    sweep = CHAPTERS[chapter].context_sweep
    if not sweep:
        return plan
    lengths = ",".join(map(str, context_sweep(device).context_lens))
    return replace(plan, estimate_s=plan.estimate_s + sweep_seconds(sweep, device),
                   tokens=f"{plan.tokens}; context sweep {lengths}")


def profile_seconds(device: torch.device, engine: str, batch_sizes: tuple[int, ...],
                    prompt_len: int, steps: int) -> float:
    """Profiled decode steps; the profiler and the trace export about triple their cost."""
    costs = device_costs(device)
    return sum(3 * costs.generate(engine, b, prompt_len, steps)
               + steps * costs.profiled_step_s for b in batch_sizes)


def chapter05_plan(device: torch.device) -> ChapterPlan:
    model, base = default_workload(device)
    engines = ("hf", "paged-prealloc", "paged-prealloc/ranges-off")
    steps = chapter05_profile_steps(device) + 2  # the warm-up steps are in the trace too
    seconds = (device_costs(device).load_s + bench_seconds(base, device, engines)
               + sum(profile_seconds(device, e, base.batch_sizes, base.prompt_len, steps)
                     for e in ("paged-prealloc", "paged-loop")))
    if device.type == "cpu":  # the roofline's op times: 1 warm-up + 4 profiled steps each
        seconds += profile_seconds(device, "paged-prealloc", ROOFLINE_BATCHES, base.prompt_len, 5)
    return ChapterPlan(model, dtype_name(MODELS[model].default_dtype), engines, base.batch_sizes,
                       f"prompt {base.prompt_len} + {base.new_tokens} new; "
                       f"{steps} profiled steps", base.repeat, seconds)


def chapter07_plan(device: torch.device) -> ChapterPlan:
    model, base = default_workload(device)
    engines = CHAPTERS["07"].engines_for(device.type)
    config = replace(base, engines=engines)
    loops = [e for e in engines if e.startswith("async")]
    seconds = (bench_plan(model, device, config).estimate_s
               + sum(profile_seconds(device, e, (8,), base.prompt_len, 6) for e in loops))
    return replace(bench_plan(model, device, config), estimate_s=seconds,
                   tokens=f"prompt {base.prompt_len} + {base.new_tokens} new; "
                          f"4 profiled steps per loop")


def chapter08_plan(device: torch.device) -> ChapterPlan:
    return serving_plan(*serving_experiments(device), device, "target")


# Fixed costs on a CPU, seen on a 2-core EPYC: the compiled stage's warm-up compiles a graph per
# token bucket, about 11 minutes from a cold inductor cache and 3-4 from a warm one (chapter 11
# compiles in two processes: its own, cold, and its server's, from the cache the first left);
# each vLLM engine or server starts in 2-6 minutes.
COMPILE_S = 660 + 240
# A compiled stage's offline benchmark compiles only the buckets it meets (1 and 8 decodes, 64
# and 512 prefill tokens): 311-469 s a stage from a cold inductor cache on the reference Xeon
# (chapter 13's recording), about 35 s from a warm one.
BENCH_COMPILE_S = 390
VLLM_START_S = 2 * 240


def chapter10_plan(device: torch.device, rounds: int = 3) -> ChapterPlan:
    """Chapter 08's target run with ``continuous``, in-process and over HTTP, ``rounds`` times
    (the server loads a model of its own: a second load), then the server's own cost."""
    model, experiments = serving_experiments(device)
    target = replace(experiments["target"], systems=("continuous",))
    one = serving_plan(model, {"target": target}, device, "target")
    costs = device_costs(device)
    # The server's own cost: each request alone, in-process and over HTTP (streamed and not).
    w = server_cost_workload(device)
    alone = (costs.prefill_token_s * sum(w.prompt_len) / 2
             + costs.step("continuous", 1) * sum(w.output_len) / 2)
    server_cost_s = 3 * w.num_requests * alone  # in-process, streamed and whole
    # With the peer, on a CPU (lab.client_bench): vllm bench serve, 2 backends x (our server,
    # vllm serve), and one vLLM start.
    client_s = VLLM_START_S / 2 + 4 * 32 * 64 / costs.serving_tok_s["vllm"] \
        if device.type == "cpu" else 0.0
    clients = ("vllm bench serve",) if device.type == "cpu" else ()
    return replace(one, engines=("continuous", "http", *clients), repeats=rounds,
                   estimate_s=2 * costs.load_s + 2 * rounds * (one.estimate_s - costs.load_s)
                   + server_cost_s + client_s)


def chapter11_plan(device: torch.device) -> ChapterPlan:
    """What the chapter shows: the offline benchmark at batch 1 and 8 with the compile, chapter
    08's target workload in-process with ``compiled`` and vLLM, and over HTTP
    against our compiled server and ``vllm serve`` (vLLM counted whether or not the peer is
    installed: an upper bound). The probes (``MINIINFER_CH11_PROBES=1``) are not counted."""
    from .catching import BATCH_SIZES, SERVED_REPEATS

    model, base = default_workload(device)
    if device.type == "cuda":  # lab.catching.run_chapter11 records on a CPU only for now
        return ChapterPlan(model, "-", (), (), "nothing on a GPU yet (CPU only for now)", 0, 0.0)
    config = replace(base, engines=CHAPTERS["11"].engines_for(device.type),
                     batch_sizes=BATCH_SIZES)
    target = replace(serving_experiments(device)[1]["target"], repeats=SERVED_REPEATS)
    ours = serving_plan(model, {"target": replace(target, systems=("compiled",))},
                        device, "target").estimate_s
    # The peer's runs are counted by hand (a config naming vllm needs the peer installed): the
    # target workload in-process and over HTTP, SERVED_REPEATS times each, each in a vLLM of
    # its own start; our server's runs over HTTP are more target runs, after its own compile.
    tok_s = device_costs(device).serving_tok_s["vllm"]
    target_s = target.workload.num_requests * sum(target.workload.output_len) / 2 / tok_s
    seconds = (bench_plan(model, device, config).estimate_s + COMPILE_S + ours
               + 2 * VLLM_START_S + 3 * SERVED_REPEATS * target_s)
    return replace(bench_plan(model, device, config), estimate_s=seconds,
                   tokens=f"prompt {base.prompt_len} + {base.new_tokens} new; chapter 08's "
                          f"target workload in-process and over HTTP")


def chapter12_plan(device: torch.device) -> ChapterPlan:
    """The all-reduce table (a few seconds a world size) and a short benchmark in which the
    tensor-parallel engine's N processes share this machine's cores (counted N times)."""
    model, base = default_workload(device)
    if device.type == "cuda":  # lab.parallel.run_chapter12 records on a CPU only
        return ChapterPlan(model, "-", (), (), "nothing on a GPU (the paper model)", 0, 0.0)
    config = replace(base, engines=CHAPTERS["12"].engines, new_tokens=16, repeat=3)
    seconds = bench_seconds(config, device) + 2 * bench_seconds(
        replace(config, engines=("tensor-parallel",)), device) + 60
    return replace(bench_plan(model, device, config), estimate_s=seconds,
                   tokens=f"prompt {config.prompt_len} + {config.new_tokens} new; "
                          f"gloo all-reduces, N = 2 and 3")


def chapter14_plan(device: torch.device) -> ChapterPlan:
    """lab.speculation: per weights and workload, each prompt alone through every system (a
    warm-up round and the repeats; speculation counted as plain decoding, an upper bound), then
    the served runs (the prompts from several clients at once); a compile per weights."""
    from .speculation import DRAFTERS, HF_SYSTEMS, SpeculationConfig

    config, costs = SpeculationConfig(), device_costs(device)
    prompt_len = 400  # the input-grounded prompts carry a paragraph or more of the text
    workloads = 3  # rewrite, copy (both from the text), open-ended
    runs = workloads * len(config.weights) * len(DRAFTERS) + len(config.hf_workloads) * len(
        HF_SYSTEMS) * 3  # HF on fp32 only, about a third of our compiled speed
    alone = config.num_prompts * (config.repeat + 1) * runs * costs.generate(
        "compiled", 1, prompt_len, config.new_tokens)
    served = len(config.weights) * 2 * len(DRAFTERS) * (config.served_repeat + 1) * (
        config.served_clients * config.new_tokens / costs.serving_tok_s["continuous"]
        + config.served_clients * prompt_len * costs.prefill_token_s + costs.serving_run_s)
    # Each weights' forward compiled once, for the buckets the runs meet (a warm-up round
    # each): from a cold inductor cache, the most a chapter's compiles took.
    compile_s = len(config.weights) * BENCH_COMPILE_S if device.type == "cpu" else 0
    return ChapterPlan("smollm2-135m", "float32 and int4", config.systems,
                       (1, config.served_clients),
                       f"{workloads} workloads x up to {config.num_prompts} chat prompts, "
                       f"{config.new_tokens} new tokens, k <= {config.num_draft_tokens}, "
                       f"{config.forward} forward", config.repeat,
                       costs.load_s + compile_s + alone + served)


def chapter15_plan(device: torch.device) -> ChapterPlan:
    """book.deploy: each server started in turn (ours compiles every bucket before it answers;
    vLLM counted whether or not the peer is built: an upper bound), every workload from each
    client count after a short warm-up, repeated; then the in-process ablation, whose runners
    compile what their warm-up round meets."""
    from .deploy import DeployConfig

    config, costs = DeployConfig(), device_costs(device)
    tok_s = costs.serving_tok_s["continuous"]
    workloads = 3  # chat, grounded, open-ended
    per_system = workloads * sum(
        (config.served_repeats + 1) * clients * config.requests_per_client * config.new_tokens
        / tok_s + costs.serving_run_s for clients in config.clients)
    starts = COMPILE_S + VLLM_START_S / 2 if device.type == "cpu" else 3 * costs.load_s
    runs = len(config.ablation) * len(config.ablation_workloads) * (config.ablation_repeats + 1)
    ablation = runs * 2 * config.ablation_clients * config.new_tokens / tok_s
    compiles = 2 * BENCH_COMPILE_S if device.type == "cpu" else 0  # fp32 and eager runners
    return ChapterPlan("smollm2-135m", "int4 (ours), Q4_1 (llama.cpp)", config.systems,
                       config.clients, f"{workloads} workloads x {config.new_tokens} new tokens "
                       f"a request; ablation from {config.ablation_clients} clients",
                       config.served_repeats,
                       costs.load_s + starts + len(config.systems) * per_system + ablation
                       + compiles)


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
            if w.kind == "multi-turn":  # a conversation's last turn waits for the ones before
                span += (w.turns - 1) * w.turn_gap_s
            for system in config.systems:
                budgets = len(config.max_num_batched_tokens) \
                    if system in (*STEPPED_SYSTEMS, "hf-cb") else 1
                # Arrivals take their span; the work queues behind them (upper bound).
                seconds += config.repeats * budgets * (
                    span + output_tokens / costs.serving_tok_s[system] + costs.serving_run_s)
                systems += [s for s in (system,) if s not in systems]
    target = experiments[main].workload
    return ChapterPlan(model, dtype_name(MODELS[model].default_dtype), tuple(systems),
                       tuple(c.static_batch_size for c in experiments.values())[:1],
                       f"{target.num_requests} requests, prompts {target.prompt_len[0]}-"
                       f"{target.prompt_len[1]}, outputs {target.output_len[0]}-"
                       f"{target.output_len[1]}; {len(experiments)} experiments", 1, seconds)


# A chapter's `recording` in the registry -> its plan: (chapter, device) -> ChapterPlan.
# SmolLM2's tokens of chapter 13's quality text (data/texts: the quality CSV's text_tokens).
QUALITY_TEXT_TOKENS = 2022


def chapter13_plan(device: torch.device) -> ChapterPlan:
    """The offline benchmark (on a CPU with each compiled stage's cold compile: the GPU's is not
    measured), then (on a CPU, where built) llama.cpp: three formats, each a
    process per repeat running every batch size (its F32 run about as long as an fp32 stage's,
    the others shorter: counted as three fp32 runs, an upper bound); then (on a CPU) the quality
    table."""
    plan = bench_chapter_plan("13", device)
    if device.type != "cpu":
        return plan
    # Each compiled stage compiles its benchmark's buckets in its warm-up run.
    compiled = sum(e == "compiled" or e.startswith("quantized:") for e in plan.engines)
    plan = replace(plan, estimate_s=plan.estimate_s + compiled * BENCH_COMPILE_S)
    _, config = default_workload(device, "13")
    costs = device_costs(device)
    peer = 3 * config.repeat * sum(costs.generate("hf", b, config.prompt_len, config.new_tokens)
                                   for b in config.batch_sizes)
    # The quality table (book/quantization.py: record_quality), rough: three loads (the model,
    # the GGUF's int4 blocks, int8 quantized from fp32), perplexity over the text in three
    # formats (fp32's one prefill, each weight-only format's about two: their prefill took
    # twice hf's time to first token at batch 8 in chapter 13's recording), and the agreement's
    # 8 prompts x 32 greedy tokens generated at once, then teacher-forced per format.
    quality = (3 * costs.load_s + 5 * QUALITY_TEXT_TOKENS * costs.prefill_token_s
               + 2 * costs.generate("hf", 8, 16, 32))
    return replace(plan, engines=(*plan.engines, "llama.cpp"),
                   estimate_s=plan.estimate_s + peer + quality)


PLANS: dict[str, Callable[[str, torch.device], ChapterPlan]] = {
    "none": lambda chapter, device: ChapterPlan("-", "-", (), (), "none", 0, 0.0),
    "bench": bench_chapter_plan,
    # The kernel table on a GPU: 3 contexts x 23 calls of well under a millisecond, plus
    # allocating 256 MB of caches for each: seconds, inside the estimate's rounding.
    "paged": bench_chapter_plan,
    "profile": lambda chapter, device: chapter05_plan(device),
    "async": lambda chapter, device: chapter07_plan(device),
    "serving": lambda chapter, device: chapter08_plan(device),
    "prefix": lambda chapter, device: serving_plan(*prefix_cache_experiments(device), device,
                                                   "shared-prefix"),
    "server": lambda chapter, device: chapter10_plan(device),
    "catching": lambda chapter, device: chapter11_plan(device),
    "parallel": lambda chapter, device: chapter12_plan(device),
    "quantized": lambda chapter, device: chapter13_plan(device),
    "speculative": lambda chapter, device: chapter14_plan(device),
    "composed": lambda chapter, device: chapter15_plan(device),
}


def plan_chapter(chapter: str, device: torch.device,
                 logged: dict[tuple[str, str], float] | None = None) -> ChapterPlan:
    """The chapter's plan; its estimate is the duration the last logged run took on this kind
    of device where there is one (its notebook too, where the log says so), else the
    cost model's."""
    plan = PLANS[CHAPTERS[chapter].recording](chapter, device)
    seconds = (logged or {}).get((chapter, device.type))
    return plan if seconds is None else replace(plan, estimate_s=seconds, logged=True)
