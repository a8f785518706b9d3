"""The roofline of a decode step (chapters 05-07): each op's arithmetic intensity from the
model's shapes, the two roofs of the device (measured bandwidth and peak FLOP/s, from the device
table), and each op's achieved point from a profiled step.

A decode step of a Llama-family model is, per layer, four matrix multiplies over the weights
(QKV, O, gate/up, down) and an attention over the cached K/V, then one LM head. A matmul of
``batch`` rows through a ``k x n`` weight does ``2 * batch * k * n`` FLOPs and must read the
weight once (plus the rows in and out), so its intensity grows with the batch: about
``batch / 2`` FLOP per byte in fp32. Attention reads every cached K/V element for a few FLOPs
per query head sharing it, whatever the batch. The roofline says how fast each op *could* run
on a device: ``min(peak, bandwidth x intensity)``; the profiled time says how fast it *did*.

Ops are found in a trace by their order, not their shapes (the profiler does not record shapes
unless asked, and the recorded traces of chapter 05 did not): within one decode step the
projections run as ``aten::mm`` in the same order every layer, q, k, v, o, gate, up, down, and
the LM head last. :func:`op_times` checks the count per step before it trusts the order.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from ..core import kv_cache
from ..core.errors import MiniInferError

# The ops of a decode step, in the order the book draws them.
OPS = ("QKV", "O", "gate/up", "down", "LM head", "attention")
# Which op each aten::mm of a layer belongs to, in execution order (HF's Llama modules and
# DirectForward alike): q, k, v, o, gate, up, down.
LAYER_MMS = ("QKV", "QKV", "QKV", "O", "gate/up", "gate/up", "down")
# Far below a roof: under this share of it.
FAR_BELOW = 0.5
# The batch sizes chapter 05 draws: GEMV, the CPU's ridge, and two well past it.
BATCH_SIZES = (1, 8, 32, 128)


def _shape(config) -> dict[str, int]:
    head_dim = kv_cache.head_dim(config)
    return {"hidden": config.hidden_size, "intermediate": config.intermediate_size,
            "heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads,
            "head_dim": head_dim, "layers": config.num_hidden_layers, "vocab": config.vocab_size}


def decode_ops(config, batch_size: int, context_len: int, itemsize: int = 4) -> pd.DataFrame:
    """FLOPs and bytes of each op of one decode step (all layers), its arithmetic intensity
    (FLOP per byte) and the weight bytes it reads. ``context_len``: cached tokens per request."""
    s = _shape(config)
    b, d, layers = batch_size, s["head_dim"], s["layers"]
    q, kv = s["heads"] * d, s["kv_heads"] * d

    def matmul(k: int, n: int, times: int) -> tuple[float, float, float]:
        weight = k * n * itemsize
        return (times * 2 * b * k * n, times * (weight + b * (k + n) * itemsize), times * weight)

    rows = {
        "QKV": matmul(s["hidden"], q + 2 * kv, layers),
        "O": matmul(q, s["hidden"], layers),
        "gate/up": matmul(s["hidden"], 2 * s["intermediate"], layers),
        "down": matmul(s["intermediate"], s["hidden"], layers),
        "LM head": matmul(s["hidden"], s["vocab"], 1),
        # Scores and the weighted sum: 2 FLOPs each per query head, cached token and dim; the
        # bytes are the cached K and V (read once per kv head) and the queries in and out.
        "attention": (layers * 4 * b * s["heads"] * context_len * d,
                      layers * (2 * b * context_len * kv + 2 * b * q) * itemsize, 0.0),
    }
    df = pd.DataFrame([{"op": op, "flops": f, "bytes": by, "weight_bytes": w}
                       for op, (f, by, w) in rows.items()])
    df["intensity"] = df.flops / df.bytes
    return df.assign(batch_size=batch_size, context_len=context_len)


def attainable_gflops(intensity: float, bandwidth_gbs: float, peak_gflops: float) -> float:
    """The roofline: what an op of this intensity can reach on the device (GFLOP/s)."""
    return min(peak_gflops, bandwidth_gbs * intensity)


def op_times(trace, num_layers: int) -> pd.DataFrame:
    """ms per measured decode step of each op in a profiled trace
    (:func:`miniinfer.bench.profiling.profile_decode`): the ``aten::mm`` calls of a step
    attributed by their order (``LAYER_MMS`` per layer, then the LM head) and attention as its
    ``aten::scaled_dot_product_attention`` calls. Raises where a step has another number of
    matmuls than the order expects (a model or a forward this attribution does not know)."""
    from ..bench.profiling import _STEPS_SQL, STEP

    query = _STEPS_SQL + """
        , measured AS (SELECT * FROM steps WHERE step >= 0)
        SELECT s.step, e.name, e.ts, e.dur FROM events e JOIN measured s
          ON e.tid = s.tid AND e.ts >= s.ts AND e.ts + e.dur <= s.te
        WHERE e.cat = 'cpu_op' AND e.name IN ('aten::mm', 'aten::scaled_dot_product_attention')
        ORDER BY s.step, e.ts
    """
    if (trace.events.cat == "kernel").any():
        # On a GPU an aten op's CPU span is its launch, not its run: the device's time would
        # need the kernels attributed to ops, which this order-based reading does not do.
        raise MiniInferError("op_times reads CPU traces only: this trace ran on a GPU")
    events = trace.sql(query, {"warmup": trace.warmup_steps, "step_name": STEP})
    steps = events.step.nunique()
    if not steps:
        raise MiniInferError("the trace has no measured decode step")
    mms = events[events.name == "aten::mm"].copy()
    per_step = mms.groupby("step").size()
    expected = len(LAYER_MMS) * num_layers + 1
    if (per_step != expected).any():
        raise MiniInferError(f"expected {expected} aten::mm per decode step ({num_layers} layers x "
                             f"{len(LAYER_MMS)} + the LM head), found "
                             f"{sorted(set(per_step))}: the ops cannot be told apart by order")
    index = mms.groupby("step").cumcount()
    mms["op"] = [LAYER_MMS[k % len(LAYER_MMS)] if k < expected - 1 else "LM head" for k in index]
    attention = events[events.name != "aten::mm"].assign(op="attention")
    both = pd.concat([mms, attention])
    table = both.groupby("op").agg(calls=("dur", "size"), us=("dur", "sum"))
    table = pd.DataFrame({"count_per_step": table.calls / steps,
                          "ms_per_step": table.us / 1e3 / steps})
    return table.reindex([op for op in OPS if op in table.index]).reset_index()


def measured_context(trace, prompt_len: int) -> float:
    """The mean context length (cached tokens per request) over a trace's measured decode
    steps: the prompt, the warm-up steps, then half of the measured ones and the one each
    measured step feeds."""
    steps = int((trace.events.name == "decode_step").sum()) - trace.warmup_steps
    return prompt_len + trace.warmup_steps + (steps + 1) / 2


def recorded_trace_op_times(traces: dict[int, object], num_layers: int, prompt_len: int
                            ) -> pd.DataFrame:
    """:func:`op_times` of chapter 05's recorded traces, one per batch size (``{batch: trace}``),
    with each trace's mean context length."""
    frames = [op_times(trace, num_layers).assign(batch_size=b,
                                                 context_len=measured_context(trace, prompt_len))
              for b, trace in sorted(traces.items())]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def record_op_times(lm, batch_sizes: tuple[int, ...], prompt_len: int, steps: int = 4,
                    warmup_steps: int = 1, engine: str = "paged-prealloc") -> pd.DataFrame:
    """Profile ``engine``'s decode steps at each batch size and attribute their time to the
    ops (:func:`op_times`): one row per batch size and op, with the mean context length of the
    measured steps (what attention's intensity depends on)."""
    from ..bench.offline import make_prompts
    from ..bench.profiling import profile_decode
    from ..engines import make_engine

    eng = make_engine(engine, lm)
    frames = []
    for batch_size in batch_sizes:
        trace = profile_decode(eng, make_prompts(lm, batch_size, prompt_len), steps,
                               warmup_steps)
        frames.append(op_times(trace, lm.config.num_hidden_layers).assign(
            engine=engine, batch_size=batch_size,
            context_len=measured_context(trace, prompt_len)))
    return pd.concat(frames, ignore_index=True)


def roofline_table(config, op_ms: pd.DataFrame, bandwidth_gbs: float, peak_gflops: float,
                   batch_sizes: tuple[int, ...] = BATCH_SIZES, context_len: float = 96,
                   itemsize: int = 4) -> pd.DataFrame:
    """Every op at every batch size of ``batch_sizes`` (and of ``op_ms``): its intensity, the
    roof it could reach, and where ``op_ms`` (batch_size, op, ms_per_step[, context_len]) has it,
    what it achieved: GB/s and GFLOP/s, each as % of its roof. Missing points stay NaN."""
    batches = sorted(set(batch_sizes) | set(op_ms.batch_size if len(op_ms) else ()))
    contexts = (op_ms.groupby("batch_size").context_len.first()
                if "context_len" in op_ms and len(op_ms) else pd.Series(dtype=float))
    frames = [decode_ops(config, b, contexts.get(b, context_len), itemsize) for b in batches]
    df = pd.concat(frames, ignore_index=True)
    df["attainable_gflops"] = [attainable_gflops(i, bandwidth_gbs, peak_gflops)
                               for i in df.intensity]
    df["bound"] = ["compute" if i * bandwidth_gbs >= peak_gflops else "memory"
                   for i in df.intensity]
    if len(op_ms):
        df = df.merge(op_ms[["batch_size", "op", "ms_per_step"]], on=["batch_size", "op"],
                      how="left")
    else:
        df["ms_per_step"] = float("nan")
    seconds = df.ms_per_step / 1e3
    df["achieved_gbs"] = df.bytes / seconds / 1e9
    df["achieved_gflops"] = df.flops / seconds / 1e9
    df["pct_of_bandwidth"] = 100 * df.achieved_gbs / bandwidth_gbs
    df["pct_of_peak"] = 100 * df.achieved_gflops / peak_gflops
    df["pct_of_roof"] = 100 * df.achieved_gflops / df.attainable_gflops
    return df


def plot_roofline(table: pd.DataFrame, bandwidth_gbs: float, peak_gflops: float, title: str):
    """The roofline of a decode step (:func:`miniinfer.book.roofline.roofline_table`): the two
    roofs of the device, every op at every batch size at its arithmetic intensity, hollow where
    the roofline puts it (what it could reach) and filled where it was measured (what it did),
    a dotted line between the two. An op's colour is :data:`OP_COLORS`'; its batch size is the
    number beside the point."""
    import matplotlib.pyplot as plt
    import numpy as np

    from .plots import OP_COLORS, WIDTH, book_style

    with book_style():
        fig, ax = plt.subplots(figsize=(WIDTH * 0.8, 5.0))
        lo = min(0.1, table.intensity.min() / 2)
        hi = max(200.0, table.intensity.max() * 2)
        x = np.geomspace(lo, hi, 200)
        ax.plot(x, np.minimum(peak_gflops, bandwidth_gbs * x), "k-", lw=1.5)
        ax.annotate(f"{bandwidth_gbs:.0f} GB/s", (lo * 1.5, bandwidth_gbs * lo * 2.2),
                    rotation=32, fontsize=9)
        ax.annotate(f"peak {peak_gflops:.0f} GFLOP/s", (hi / 1.3, peak_gflops / 1.25),
                    fontsize=9, ha="right", va="top")
        # Ops of one batch size share an intensity (about batch / 2 in fp32): each op is drawn
        # a few percent to the right of the one before so that none hides another.
        ops = list(dict.fromkeys(table.op))
        for op, rows in table.groupby("op", sort=False):
            color = OP_COLORS.get(op, "#7f7f7f")
            shift = 1.07 ** (ops.index(op) - (len(ops) - 1) / 2)
            ax.scatter(rows.intensity * shift, rows.attainable_gflops, facecolors="none",
                       edgecolors=color, s=36)
            measured = rows[rows.achieved_gflops.notna()]
            ax.scatter(measured.intensity * shift, measured.achieved_gflops, color=color, s=36,
                       label=op)
            for r in measured.itertuples():
                ax.plot([r.intensity * shift] * 2, [r.achieved_gflops, r.attainable_gflops], ":",
                        color=color, lw=1)
        matmuls = table[table.op != "attention"].groupby("batch_size")
        for b, rows in matmuls:
            ax.annotate(f"batch {b}", (rows.intensity.min() / 1.15, rows.attainable_gflops.max()),
                        textcoords="offset points", xytext=(0, 8), fontsize=8, ha="center")
        attention = table[table.op == "attention"]
        if len(attention):
            ax.annotate("attention:\nany batch", (attention.intensity.median(),
                                                    attention.attainable_gflops.median()),
                        textcoords="offset points", xytext=(-8, 10), fontsize=8, ha="right",
                        color=OP_COLORS["attention"])
        achieved = table.achieved_gflops.dropna()
        ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP / byte)",
               ylabel="GFLOP/s", title=title, xlim=(lo, hi),
               ylim=(max(0.5, achieved.min() / 3) if len(achieved) else 0.5, peak_gflops * 3))
        handles, labels = ax.get_legend_handles_labels()
        handles += [plt.Line2D([], [], marker="o", ls="", mfc="none", mec="k"),
                    plt.Line2D([], [], marker="o", ls="", color="k")]
        labels += ["roofline (could reach)", "measured (did)"]
        ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
        fig.tight_layout()
    return fig


@dataclass(slots=True)
class DeviceRoofline:
    """One recorded device's roofline of a decode step, as chapters 05-07 draw it."""

    device_name: str
    dtype: str
    bandwidth_gbs: float
    peak_gflops: float
    table: pd.DataFrame  # roofline_table
    source: str  # where the achieved points come from

    @property
    def measured(self) -> list[int]:
        return sorted(set(self.table.batch_size[self.table.ms_per_step.notna()]))

    @property
    def missing(self) -> list[int]:
        return sorted(set(self.table.batch_size[self.table.ms_per_step.isna()]))

    def matmuls_against_roofs(self) -> pd.DataFrame:
        """Per batch size, the step's matmuls: their measured ms, the ms they would take at
        their roofs (each op's FLOPs at its attainable rate), and how many times that they
        took: chapter 05's cost model in one row per batch."""
        matmuls = self.table[(self.table.op != "attention") & self.table.ms_per_step.notna()]
        by_batch = matmuls.groupby("batch_size")
        measured = by_batch.ms_per_step.sum()
        at_roofs = (matmuls.flops / matmuls.attainable_gflops / 1e6).groupby(
            matmuls.batch_size).sum()
        return pd.DataFrame({"matmuls ms per step": measured, "at their roofs": at_roofs,
                             "x their roofs' time": measured / at_roofs,
                             "bytes": by_batch.bytes.sum(), "flops": by_batch.flops.sum()})

    def plot(self):
        return plot_roofline(self.table, self.bandwidth_gbs, self.peak_gflops,
                             f"a decode step on {self.device_name} ({self.dtype})")


def recorded_rooflines(config) -> list[DeviceRoofline]:
    """The roofline of every CPU device chapter 05 recorded, for a model of ``config`` (the
    recorded model's): achieved points from ``<device>-roofline.csv`` where recorded, else from
    the chapter's recorded traces (batch 1, 4 and 8)."""
    from ..bench.profiling import load_trace
    from .results import RESULTS, device_table, read_results, reference_files

    out_dir = RESULTS / "ch05"
    speeds = device_table()
    rooflines = []
    for path in reference_files("05", "*-bench.csv"):
        bench = read_results(path)
        slug = path.name.removesuffix("-bench.csv")
        # The host is the slug and the instruction set the bench ran with (one name, two hosts).
        key = slug, bench.isa.iloc[0]
        known = set(zip(speeds.slug, speeds.isa, strict=True)) if not speeds.empty else set()
        if bench.device.iloc[0].startswith("cuda") or key not in known:
            continue  # a GPU profile times launches per op, not kernels
        speed = speeds.set_index(["slug", "isa"]).loc[key]
        recorded = out_dir / f"{slug}-roofline.csv"
        if recorded.exists():
            op_ms, source = read_results(recorded), recorded.name
        else:
            traces = {int(p.name.split("-b")[-1].split(".")[0]): load_trace(p)
                      for p in sorted(out_dir.glob(f"{slug}-paged-prealloc-b*.json.gz"))}
            op_ms = recorded_trace_op_times(traces, config.num_hidden_layers,
                                            int(bench.prompt_len.iloc[0]))
            source = "the recorded traces (no -roofline.csv for this device yet)"
        table = roofline_table(config, op_ms, speed.bandwidth_gbs, speed.peak_gflops)
        rooflines.append(DeviceRoofline(speed["name"], bench.dtype.iloc[0], speed.bandwidth_gbs,
                                        speed.peak_gflops, table, source))
    return rooflines
