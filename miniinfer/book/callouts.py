"""What a reader will see, told before the first cell runs: every chapter opens with two lines
on what a CPU shows, computed from the chapter's recorded rows, and two on what a GPU shows: the
same lines from a recorded GPU row once one exists, until then a reference post's figure, cited.

The callout is generated, never typed: ``callout(chapter)`` is the markdown a notebook's first
cell carries under its title (a test checks that it does, so a re-recording that changes the
numbers fails until the notebooks are updated:
:func:`~miniinfer.book.notebook_callouts.update_notebooks` rewrites them).
"""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd

from ..bench.serving.metrics import median_of_repeats
from . import analysis
from .callout_rows import (
    CALLOUT_SOURCES,
    bench_of,
    ch04_sources,
    device_of,
    experiments_of,
    floor_line,
    on_device,
    overview_sources,
    pcts,
    runs_of,
    span,
    verdicts,
)
from .gpu_figures import GPU_FIGURES
from .profiles import host_share
from .references import POSTS
from .results import (
    device_names,
    read_results,
    recorded_context_sweeps,
    recorded_results,
    recorded_rows,
    recorded_timelines,
)
from .roofline import FAR_BELOW

MARK = "**On a CPU you will see**"


# Each chapter's two lines from its recorded rows of one kind of device (None: nothing recorded).
def _ch00(gpu: bool) -> list[str] | None:
    from .results import stage_results

    stages = stage_results()
    recorded, *serving_runs = overview_sources(gpu)
    names = set(recorded.get("device_name", ()))
    stages = stages[stages.device_name.isin(names)] if not stages.empty else stages
    serving = experiments_of("08", gpu, "target")
    prefix = experiments_of("09", gpu, "shared-prefix")
    # Name the serving runs' device where it is not the stages' (the heading lists both).
    elsewhere = [n for n in device_names(pd.concat(serving_runs, ignore_index=True))
                 if n not in names]
    on = f" (on the {', '.join(elsewhere)})" if elsewhere else ""
    if stages.empty or (not gpu and (serving is None or prefix is None)):
        return None
    largest = stages[stages.batch_size == stages.batch_size.max()]
    paged = largest[largest.stage_chapter.between("02", "07")]
    batch = largest.batch_size.iloc[0]
    if gpu:
        graph = paged[paged.engine == "async:cuda-graph"].pct_of_hf
        eager = paged[paged.engine != "async:cuda-graph"].pct_of_hf
        chapters = paged.stage_chapter
        first = (f"the eager stages of chapters {chapters.min()}-{chapters.max()} end between "
                 f"{eager.min():.0f}% and {eager.max():.0f}% of hf at batch {batch}: a step is "
                 f"the host launching its kernels one op at a time"
                 + (f"; chapter 07's CUDA graph replays them at {graph.iloc[0]:.0f}%;"
                    if len(graph) else ";"))
        if serving is None or prefix is None:
            return [first, "the serving chapters (08-10) are not recorded on a GPU yet."]
    else:
        first = (f"the static-batch stages of chapters 02-07 end between {paged.pct_of_hf.min():.0f}"
                 f"% and {paged.pct_of_hf.max():.0f}% of hf at batch {batch}: flat, because a CPU "
                 f"step is its matmuls, not the bookkeeping those chapters remove;")
    target, shared = serving[0].output_throughput, prefix[0].output_throughput
    return [first,
            f"the serving chapters win on any device{on}: continuous batching "
            f"{target['continuous'] / target['hf-cb']:.2f}x transformers' own (chapter 08), prefix "
            f"caching {shared['prefix-cache'] / shared['continuous']:.2f}x continuous's output "
            f"tokens/s on a shared prompt (chapter 09)."]


def _ch01(gpu: bool) -> list[str] | None:
    df = on_device(recorded_results("01"), gpu)
    if df.empty:
        return None
    hf = df[df.engine == "hf"].set_index("batch_size").sort_index()
    last = hf.index[-1]
    over = min(hf.step_ms[last] / hf.floor_memory_ms[last],
               hf.step_ms[last] / hf.floor_compute_ms[last])
    return [f"`naive` at {pcts(df, 'naive')} ({verdicts(df, 'naive')}): the same decode as "
            f"`generate`;",
            f"hf's step {hf.step_ms.iloc[0]:.0f} ms at batch {hf.index[0]} and "
            f"{hf.step_ms[last]:.0f} ms at batch {last}, {over:.1f}x above the nearer of the two "
            f"roofs: neither memory nor compute binds ({device_of(df)})."]


def _ch02(gpu: bool) -> list[str] | None:
    df = on_device(recorded_results("02"), gpu)
    if df.empty:
        return None
    pct = df[df.engine == "paged-loop"].set_index("batch_size").pct_of_hf.sort_index()
    # Bytes per token cancel out of both the ratio and the shares: any value will do.
    lengths = analysis.MIXED_LENGTHS
    memory = analysis.kv_reservation(lengths, bytes_per_token=1)
    hf, paged = memory.reserved_tokens.iloc[0], memory.reserved_tokens.iloc[1]
    return [f"`paged-loop` at {pcts(df, 'paged-loop')}: its Python-loop gather "
            + {"falls": "loses ground as the batch grows", "rises": "gains as the batch grows",
               "not monotonic": "moves with the batch, though not one way"}[analysis.trend(pct)]
            + ";",
            f"the memory paging saves (arithmetic on the shapes, the same on any device): on "
            f"{len(lengths)} requests of {min(lengths)}-"
            f"{max(lengths)} tokens HF's padded cache reserves {hf / paged:.1f}x the paged "
            f"pool's K/V bytes, {memory.fragmentation_pct.iloc[0]:.0f}% of them unused against "
            f"{memory.fragmentation_pct.iloc[1]:.0f}%."]


def _ch03(gpu: bool) -> list[str] | None:
    df = on_device(recorded_results("03"), gpu)
    sweep = on_device(recorded_context_sweeps("03"), gpu)
    if df.empty:
        return None
    lines = [f"`paged-vectorized` at {pcts(df, 'paged-vectorized')}, `paged-loop` at "
             f"{pcts(df, 'paged-loop')};"]
    if sweep.empty:  # a device whose run ended before its context sweep (the H200's)
        b, step = int(df.batch_size.max()), df.set_index(["batch_size", "engine"]).step_ms
        return lines + [f"at batch {b} a step takes {step[b, 'paged-loop']:.1f} ms with the loop, "
                        f"{step[b, 'paged-vectorized']:.1f} ms vectorized and {step[b, 'hf']:.1f}"
                        f" ms in hf (no context sweep recorded on this device)."]
    loop = sweep[sweep.engine == "paged-loop"].set_index("context_len").step_ms.sort_index()
    vec = sweep[sweep.engine == "paged-vectorized"].set_index("context_len").step_ms.sort_index()
    return lines + [f"from {loop.index[0]} to {loop.index[-1]} tokens of context the loop's step "
                    f"grows {loop.iloc[-1] / loop.iloc[0]:.1f}x and the vectorized one's "
                    f"{vec.iloc[-1] / vec.iloc[0]:.1f}x (batch {sweep.batch_size.iloc[0]}, one "
                    f"run per point)."]


def _ch04(gpu: bool) -> list[str] | None:
    df, ops = ch04_sources(gpu)
    if df.empty or "paged-prealloc" not in set(df.engine) or ops.empty:
        return None
    where = "" if (df.chapter.str.zfill(2) == "04").all() else " in chapter 05's benchmark"
    write = ops[ops.window == "write_decode_kv"].groupby(["engine", "batch_size"])["count"].sum()
    b = int(ops.batch_size.max())
    return [f"`paged-prealloc`{where} at {pcts(df, 'paged-prealloc')} "
            f"({verdicts(df, 'paged-prealloc')});",
            f"the K/V write-back goes from {write[('paged-loop', b)]} ops per step to "
            f"{write[('paged-prealloc', b)]} at batch {b}: "
            + ("fewer ops, and on a GPU each was a kernel launch." if gpu else
               "fewer ops, which a CPU step barely notices.")]


def _ch05(gpu: bool) -> list[str] | None:
    phases = on_device(runs_of("05", "phases"), gpu)
    if phases.empty:
        return None
    share = host_share(phases)
    forward = 100 * share.forward_ms / share.step_ms
    first = (f"the model forward is {span(forward)}% of a decode step; everything else the "
             f"host does, {span(share.host_pct, 1)}%;")
    if gpu:  # a GPU profile times each op's launch on the host, not its kernel: no roofline
        bench = on_device(runs_of("05", "bench"), gpu)
        return [first, f"yet hf's step is {floor_line(bench, 'hf')}: the GPU waits on the "
                       f"host's kernel launches (chapter 07 removes them)."]
    rooflines = _rooflines(phases.model.iloc[0])
    if not rooflines:
        return [first, "its roofline: each op's achieved point against both roofs (drawn once "
                       "the recorded model's config is at hand)."]
    r = rooflines[0]
    matmuls = r.table[(r.table.op != "attention") & r.table.ms_per_step.notna()]
    per_batch = matmuls.groupby("batch_size")[["bytes", "flops", "ms_per_step"]].sum()
    lo, hi = per_batch.index[0], per_batch.index[-1]
    gbs = per_batch.bytes[lo] / per_batch.ms_per_step[lo] / 1e6
    gflops = per_batch.flops[hi] / per_batch.ms_per_step[hi] / 1e6
    return [first,
            f"its roofline: the matmuls move {gbs:.1f} GB/s at batch {lo} "
            f"({100 * gbs / r.bandwidth_gbs:.0f}% of the bandwidth) and do {gflops:.0f} GFLOP/s "
            f"at batch {hi} ({100 * gflops / r.peak_gflops:.0f}% of peak)"
            + (": far below both roofs." if max(gbs / r.bandwidth_gbs, gflops / r.peak_gflops)
               < FAR_BELOW else ".")]


def _rooflines(model: str) -> list:
    """Chapter 05's recorded rooflines, for the recorded model when its config is at hand."""
    from transformers import AutoConfig

    from ..core.models import smollm2_cache
    from .roofline import recorded_rooflines

    if model != "smollm2-135m":
        return []
    return recorded_rooflines(AutoConfig.from_pretrained(smollm2_cache()))


def _ch06(gpu: bool) -> list[str] | None:
    df = on_device(recorded_results("06"), gpu)
    sweep = on_device(recorded_context_sweeps("06"), gpu)
    if gpu and not df.empty:
        first = (f"`paged-attention` at {pcts(df, 'paged-attention')} "
                 f"({verdicts(df, 'paged-attention')}): its Triton kernel reads K/V from the "
                 f"blocks in place, and the step stays launch-bound, "
                 f"{floor_line(df, 'paged-attention')};")
        if sweep.empty:
            return [first, "its context sweep is not recorded on a GPU yet (`make chapter-06` "
                           "records it)."]
        growth = sweep[sweep.engine == "paged-attention"].set_index("context_len").step_ms
        growth = growth.sort_index()
        return [first, f"from {growth.index[0]} to {growth.index[-1]} tokens of context its "
                       f"step grows {growth.iloc[-1] / growth.iloc[0]:.2f}x."]
    if df.empty or sweep.empty:
        return None
    growth = {e: g.set_index("context_len").step_ms.sort_index() for e, g in sweep.groupby("engine")}
    pa, pp = growth["paged-attention"], growth["paged-prealloc"]
    return [f"`paged-attention` at {pcts(df, 'paged-attention')} "
            f"({verdicts(df, 'paged-attention')}): on a CPU the reference kernel still copies "
            f"every block, inside the forward;",
            f"from {pa.index[0]} to {pa.index[-1]} tokens of context its step grows "
            f"{pa.iloc[-1] / pa.iloc[0]:.2f}x, `paged-prealloc`'s {pp.iloc[-1] / pp.iloc[0]:.2f}x."]


def _ch07(gpu: bool) -> list[str] | None:
    df = on_device(recorded_results("07"), gpu)
    files = recorded_timelines()
    timeline = on_device(pd.concat([read_results(f) for f in files]) if files else pd.DataFrame(), gpu)
    if df.empty or timeline.empty:
        return None
    split = analysis.host_split(timeline)
    lat = df[df.engine.isin(["async:sync", "async:overlap"])].pivot_table(
        index="batch_size", columns="engine", values="ttft_ms")
    ratio = lat["async:overlap"] / lat["async:sync"]
    if gpu and "async:cuda-graph" in set(df.engine):
        busy = split.device_busy_pct
        return [f"`cuda-graph` at {pcts(df, 'async:cuda-graph')}: one replay per step instead of "
                f"a launch per op, {floor_line(df, 'async:cuda-graph')};",
                f"`sync` and `overlap` tie hf ({pcts(df, 'async:sync')} for `sync`): in the "
                f"profiled timeline the GPU is busy {busy['async:sync']:.0f}% of the time under "
                f"`sync`, {busy['async:overlap']:.0f}% under `overlap` and "
                f"{busy['async:cuda-graph']:.0f}% under `cuda-graph`; `overlap` delivers the "
                f"first token {ratio.min():.2f}-{ratio.max():.2f}x later."]
    return [f"the loops tie hf ({pcts(df, 'async:sync')} for `sync`): the host's bookkeeping "
            f"is {split.bookkeeping_pct.min():.1f}-{split.bookkeeping_pct.max():.1f}% of a step, "
            f"all a loop could win;",
            f"`overlap` delivers the first token {ratio.min():.2f}-{ratio.max():.2f}x later than "
            f"`sync`: one step of latency, bought for nothing where nothing overlaps."]


def _ch08(gpu: bool) -> list[str] | None:
    experiments = experiments_of("08", gpu, "target")
    if experiments is None:
        return None
    t, = experiments
    c, st = t.loc["continuous"], t.loc["static-paged-attention"]
    return [f"continuous batching {c.output_throughput / t.output_throughput['hf-cb']:.2f}x "
            f"transformers' own and {c.output_throughput / st.output_throughput:.2f}x static "
            f"batching's output tokens/s on {int(c.num_requests)} requests;",
            f"TTFT p50 {st.ttft_p50_ms / c.ttft_p50_ms:.1f}x lower than static batching's, for a "
            f"TPOT p50 {c.tpot_p50_ms / st.tpot_p50_ms:.1f}x "
            f"{'higher' if c.tpot_p50_ms > st.tpot_p50_ms else 'lower'}: more requests per step."]


def _ch09(gpu: bool) -> list[str] | None:
    experiments = experiments_of("09", gpu, "shared-prefix", "nothing-shared")
    if experiments is None:
        return None
    s, n = experiments
    nothing = n.output_throughput['prefix-cache'] / n.output_throughput['continuous']
    return [f"with a shared {int(s.shared_prefix_len.iloc[0])}-token prompt, TTFT p50 "
            f"{s.ttft_p50_ms['continuous'] / s.ttft_p50_ms['prefix-cache']:.1f}x lower and output "
            f"tokens/s {s.output_throughput['prefix-cache'] / s.output_throughput['continuous']:.2f}x "
            f"(hit rate {s.prefix_cache_hit_rate['prefix-cache']:.0%});",
            f"with nothing shared, {nothing:.2f}x: "
            + ("no slower (with no hits to use, a lead this size is the runs' own spread), so "
               "the bookkeeping costs next to nothing." if nothing >= 1.05 else
               "the bookkeeping costs next to nothing." if nothing >= 0.95 else
               "what the bookkeeping costs.")]


def _ch10(gpu: bool) -> list[str] | None:
    runs = on_device(runs_of("10", "runs"), gpu)
    if runs.empty:
        return None
    by_round = runs.pivot_table(index="round", columns="system", values="output_throughput")
    ratio = (by_round.http / by_round.continuous).median()
    cost = on_device(runs_of("10", "server-cost"), gpu)
    own = ("the server's own cost per request: not recorded yet (the chapter's server-cost "
           "recording measures it one request at a time)." if cost.empty else
           analysis.server_cost_sentences(cost)[0].split(": ", 1)[1] + ".")
    return [f"over HTTP {ratio:.2f}x the in-process output tokens/s on chapter 08's workload;",
            own]


# Chapter 11's tables beside its offline benchmark (``<device>-<table>.csv``).
CH11_TABLES = ("-compile", "-bf16", "-ablation", "-runs", "-requests", "-steps", "-http", "-profile",
               "-kernels")


def _ch11(gpu: bool) -> list[str] | None:
    bench = bench_of("11", gpu, others=CH11_TABLES)
    if bench.empty:
        return None
    tok_s = bench.pivot_table(index="batch_size", columns="engine", values="tok_s")
    eager = "/".join(f"{r:.1f}" for r in tok_s.compiled / tok_s["paged-attention"])
    batches = "/".join(map(str, tok_s.index))
    first = (f"`compiled` makes {eager}x the tok/s of chapter 06's eager `paged-attention` at "
             f"batch {batches}")
    if "vllm" not in tok_s:
        return [first + ";", "vLLM not recorded here (`make peers` installs it)."]
    target = experiments_of("11", gpu, "target")
    served = {} if target is None else target[0].output_throughput
    http = on_device(runs_of("11", "http"), gpu)
    over_http = median_of_repeats(http, by="server").set_index("server").output_throughput \
        if not http.empty else {}
    line = (f"on chapter 08's workload {served['compiled'] / served['vllm']:.2f}x vLLM's output "
            f"tokens/s in-process" if "vllm" in served else "vLLM's served workload not recorded")
    line += (f", {over_http['compiled'] / over_http['vllm']:.2f}x `vllm serve`'s over HTTP."
             if "vllm" in over_http else ".")
    vs = "/".join(f"{r:.2f}" for r in tok_s.compiled / tok_s.vllm)
    return [f"{first}, and {vs}x vLLM CPU's;", line]


def _ch12(gpu: bool) -> list[str] | None:
    bench = bench_of("12", gpu, others=("-allreduce",))
    reduce = on_device(runs_of("12", "allreduce"), gpu)
    if bench.empty or reduce.empty:
        return None
    tok_s = bench.pivot_table(index="batch_size", columns="engine", values="tok_s").iloc[0]
    small = reduce[reduce.message_bytes == reduce.message_bytes.min()]
    us = small.set_index("world_size").p50_us
    n = int(bench.tensor_parallel.max())
    return [f"the split model's exact tokens, at {tok_s['tensor-parallel'] / tok_s['continuous']:.2f}x "
            f"the whole model's tok/s at batch {tok_s.name} (TP={n} vs TP=1, p50 of "
            f"{int(bench.repeats.max())} repeats in one run);",
            f"one gloo all-reduce of {small.message_bytes.iloc[0]} bytes: {us.get(n, us.iloc[-1]):.0f} "
            f"µs with {n} processes, and a step does two per layer."]


CPU_LINES: dict[str, Callable[[bool], list[str] | None]] = {
    "00": _ch00, "01": _ch01, "02": _ch02, "03": _ch03, "04": _ch04, "05": _ch05, "06": _ch06,
    "07": _ch07, "08": _ch08, "09": _ch09, "10": _ch10, "11": _ch11, "12": _ch12}

def callout(chapter: str) -> str:
    """The chapter's opening callout: two lines for a CPU, two for a GPU (markdown)."""
    cpu = CPU_LINES[chapter](False)
    gpu = CPU_LINES[chapter](True)
    def recorded_on(gpu: bool) -> list[str]:
        if chapter in CALLOUT_SOURCES:  # lines that read several sources, each from its latest device
            return device_names(pd.concat(CALLOUT_SOURCES[chapter](gpu), ignore_index=True))
        return device_names(on_device(recorded_rows([chapter]), gpu))

    where = ", ".join(recorded_on(gpu=False)) or "no CPU yet"
    lines = [f"> {MARK} (recorded on {where}):"]
    lines += [f"> - {line}" for line in cpu] if cpu else \
        ["> - nothing recorded yet: `make chapter-" + chapter + "` records it;",
         "> - the numbers appear here once it has."]
    lines.append(">")
    if gpu:
        lines.append(f"> **On a GPU you will see** (recorded on {', '.join(recorded_on(gpu=True))}):")
        lines += [f"> - {line}" for line in gpu]
    else:
        key, figure = GPU_FIGURES[chapter]
        source = f", from {POSTS[key].cite()}" if key else ""
        lines.append(f"> **On a GPU you will see** (no GPU row recorded yet{source}):")
        lines += [f"> - {line}" for line in figure]
    return "\n".join(lines)
