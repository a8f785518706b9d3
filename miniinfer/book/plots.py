"""The book's figures, drawn from the recorded tables, in one style.

One style means: a stage (an engine, or a serving system) has one colour in every figure of
the book, and so has a phase of a decode step and an op of the roofline (:func:`stage_color`,
:data:`PHASE_COLORS`, :data:`OP_COLORS`); an axis of ratios or shares starts at zero; legends sit
outside the data; and a figure is at most :data:`WIDTH` inches wide, the width a notebook shows
without shrinking its text.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pandas as pd

from .analysis import SWEEP_PHASES

# Inches: what a notebook cell shows at full size.
WIDTH = 10.0

# Okabe-Ito hues (readable with any colour vision), one per stage family; a variant of a stage
# ("paged-attention:registry", "paged-prealloc/ranges-off") gets a lighter shade of its stage.
STAGE_COLORS = {
    "hf": "#4d4d4d",
    "naive": "#a0a0a0",
    "paged-loop": "#D55E00",
    "paged-vectorized": "#E69F00",
    "paged-prealloc": "#CC79A7",
    "paged-attention": "#0072B2",
    "async": "#56B4E9",
    "async:sync": "#56B4E9",
    "async:overlap": "#2a7fa8",
    "async:cuda-graph": "#1b4f6b",
    "continuous": "#009E73",
    "prefix-cache": "#7b3294",
    "static-paged-attention": "#0072B2",
    "static-hf": "#4d4d4d",
    "hf-cb": "#a6761d",
    "http": "#66a61e",
}
PHASE_COLORS = {
    "prepare_inputs": "#E69F00",
    "gather_batch_kv": "#D55E00",
    "build_cache": "#CC79A7",
    "model_forward": "#0072B2",
    "sample": "#009E73",
    "write_decode_kv": "#56B4E9",
    "read_tokens": "#b2182b",
    "(unlabelled)": "#bdbdbd",
    "decode_step": "#e8e8e8",
}
OP_COLORS = {"QKV": "#0072B2", "O": "#56B4E9", "gate/up": "#009E73", "down": "#E69F00",
             "LM head": "#D55E00", "attention": "#CC79A7"}
STYLE = {"figure.dpi": 100, "font.size": 10, "axes.titlesize": 10, "axes.labelsize": 10,
         "legend.fontsize": 9, "legend.frameon": False, "axes.spines.top": False,
         "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.3}


def _lighter(hex_color: str, amount: float = 0.45) -> str:
    rgb = [int(hex_color[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * amount):02x}" for c in rgb)


def stage_color(name: str) -> str:
    """The colour of a stage (or serving system) in every figure: its own, else a lighter
    shade of the stage it is a variant of, else a neutral grey."""
    if name in STAGE_COLORS:
        return STAGE_COLORS[name]
    for sep in (":", "/"):
        base = name.partition(sep)[0]
        if sep in name and base in STAGE_COLORS:
            return _lighter(STAGE_COLORS[base])
    return "#7f7f7f"


def batch_colors(batches) -> dict[int, str]:
    """Batch sizes, smallest to largest, light to dark blue: a batch is an amount, not a name."""
    import matplotlib

    batches = sorted(batches)
    cmap = matplotlib.colormaps["Blues"]
    return {b: matplotlib.colors.to_hex(cmap(0.35 + 0.6 * i / max(len(batches) - 1, 1)))
            for i, b in enumerate(batches)}


@contextmanager
def book_style() -> Iterator[None]:
    """The book's matplotlib settings for the figures drawn inside (notebook cells use it too)."""
    import matplotlib

    # Only the style's own settings are restored, not every setting as rc_context would: a
    # notebook's inline backend starts at the first figure, inside this block, and switches
    # interactive mode on; restoring that too would keep every later figure from being shown.
    saved = {key: matplotlib.rcParams[key] for key in STYLE}
    matplotlib.rcParams.update(STYLE)
    try:
        yield
    finally:
        matplotlib.rcParams.update(saved)


def legend_outside(ax, **kwargs) -> None:
    """A legend to the right of ``ax``, off the data."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0, **kwargs)


def plot_what_it_buys(df: pd.DataFrame, baseline: str = "hf"):
    """What each stage buys, per recorded device: % of ``baseline``'s tok/s per stage and batch
    size (the median of the per-repeat ratios; whiskers: the lowest and highest single repeat's
    ratio, where recorded), then the two phases of that end-to-end figure apart: decode-only
    tok/s and time to first token (prefill). The ratio axis starts at zero."""
    import matplotlib.pyplot as plt
    import numpy as np

    devices = list(dict.fromkeys(df.device_name))
    with book_style():
        fig, axes = plt.subplots(2 * len(devices), 2, figsize=(WIDTH, 6.4 * len(devices)),
                                 squeeze=False, height_ratios=[1.1, 1] * len(devices))
        for row, name in enumerate(devices):
            dev = df[df.device_name == name]
            batches = sorted(dev.batch_size.unique())
            engines = [e for e in dict.fromkeys(dev.engine) if e != baseline]
            top = fig.add_subplot(axes[2 * row][0].get_gridspec()[2 * row, :])
            axes[2 * row][0].remove()
            axes[2 * row][1].remove()
            width = 0.8 / max(len(engines), 1)
            for i, engine in enumerate(engines):
                rows = dev[dev.engine == engine].set_index("batch_size").reindex(batches)
                x = np.arange(len(batches)) + (i - (len(engines) - 1) / 2) * width
                err = None
                if {"pct_of_hf_min", "pct_of_hf_max"} <= set(rows.columns) \
                        and rows.pct_of_hf_min.notna().all():
                    err = [rows.pct_of_hf - rows.pct_of_hf_min, rows.pct_of_hf_max - rows.pct_of_hf]
                top.bar(x, rows.pct_of_hf, width, yerr=err, capsize=3, label=engine,
                        color=stage_color(engine))
            top.axhline(100, color="k", lw=1, ls="--")
            high = dev.get("pct_of_hf_max", dev.pct_of_hf).max()
            top.set(xticks=range(len(batches)), xticklabels=batches, xlabel="batch size",
                    ylabel=f"% of {baseline}'s tok/s", ylim=(0, max(110, high + 5)),
                    title=f"{name}: what each stage buys (median of per-repeat ratios; "
                          f"whiskers: lowest and highest repeat)")
            handles, labels = top.get_legend_handles_labels()
            handles.append(plt.Line2D([], [], marker="o", color=stage_color(baseline)))
            labels.append(f"{baseline} (lines below)")
            top.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1),
                       borderaxespad=0)
            decode = (dev.decode_tok_s if "decode_tok_s" in dev.columns
                      else dev.batch_size / dev.step_ms * 1e3)  # older runs: the median step
            left, right = axes[2 * row + 1]
            for engine, group in dev.assign(decode=decode).groupby("engine", sort=False):
                left.plot(group.batch_size, group.decode, marker="o", label=engine,
                          color=stage_color(engine))
                right.plot(group.batch_size, group.ttft_ms, marker="o", label=engine,
                           color=stage_color(engine))
            left.set(xlabel="batch size", ylabel="decode-only tokens / s", xticks=batches,
                     ylim=(0, None), title="decode (tokens after the first)")
            right.set(xlabel="batch size", ylabel="ms", xticks=batches, ylim=(0, None),
                      title="time to first token (prefill)")
        fig.tight_layout()
    return fig


def plot_context_sweep(df: pd.DataFrame):
    """Per recorded device: decode step time vs context length per engine (with the floor), and
    the paged stages' K/V bookkeeping per step from the profiled run: the engine's own phases
    (gather + build + write) and, where recorded, the gather that a CPU reference attention
    does inside the forward (dashed: same colour, "in-forward gather"). A stage whose
    in-forward gather was not recorded is labelled so: its line is the engine's share only."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    devices = list(dict.fromkeys(df.device_name))
    with book_style():
        fig, axes = plt.subplots(len(devices), 2, figsize=(WIDTH, 3.6 * len(devices)),
                                 squeeze=False)
        for row, name in enumerate(devices):
            dev = df[df.device_name == name]
            lengths = sorted(dev.context_len.unique())
            ax = axes[row][0]
            for engine, group in dev.groupby("engine", sort=False):
                ax.plot(group.context_len, group.step_ms, marker="o", label=engine,
                        color=stage_color(engine))
            floor = dev.drop_duplicates("context_len")
            ax.plot(floor.context_len, floor.floor_ms, "k--", label="speed of light")
            ax.set(xlabel="context length (tokens per request)", ylabel="ms per decode step",
                   title=f"{name}: batch {dev.batch_size.iloc[0]}", ylim=(0, None))
            ax = axes[row][1]
            kv_cols = [f"{p}_ms" for p in SWEEP_PHASES[:3] if f"{p}_ms" in dev]
            for engine, group in dev[dev.engine != "hf"].groupby("engine", sort=False):
                own = group[kv_cols].fillna(0).sum(axis=1)
                gather = group.get("attention_gather_ms")
                label = engine
                if engine.startswith("paged-attention") and (gather is None
                                                              or gather.isna().all()):
                    label = f"{engine} (engine's write only: in-forward gather not recorded)"
                ax.plot(group.context_len, own, marker="o", label=label,
                        color=stage_color(engine))
                if gather is not None and (gather.fillna(0) > 0).any():
                    ax.plot(group.context_len, own + gather.fillna(0), marker="s", ls="--",
                            color=stage_color(engine), label=f"{engine} + in-forward gather")
            ax.set(xlabel="context length", ylabel="ms per step (profiled)", ylim=(0, None),
                   title="K/V bookkeeping per step")
            for ax in axes[row]:
                # Log scale, one labelled tick per recorded length (its own minor labels overlap).
                ax.set_xscale("log")
                ax.set_xticks(lengths, map(str, lengths))
                ax.xaxis.set_minor_formatter(NullFormatter())
        handles = {}
        for ax in axes.flat:
            handles.update(zip(*reversed(ax.get_legend_handles_labels()), strict=True))
        fig.legend(handles.values(), handles.keys(), loc="upper center", ncol=2,
                   bbox_to_anchor=(0.5, 0.0))
        fig.tight_layout()
    return fig


def _timeline_lane(lane: str, name: str) -> str:
    """Which row of the Gantt chart a bar goes on: the device's kernels (CUDA), the forward (on a
    CPU the forward is the compute: the host runs it itself) and the host's bookkeeping."""
    if lane == "device":
        return "device kernels"
    return "forward" if name == "model_forward" else "host"


TIMELINE_PHASES = ("decode_step", "prepare_inputs", "model_forward", "sample", "read_tokens")


def plot_timelines(bars: pd.DataFrame, title: str = "", zoom_ms: float = 2.0):
    """Gantt chart of :func:`miniinfer.bench.profiling.timeline` bars, per engine a ``host`` row
    (the step as the host sees it, grey, with its bookkeeping phases on top), a ``forward`` row
    and, on a GPU, a ``device kernels`` row. Left: the whole run of steps; right: ``zoom_ms``
    either side of the first step boundary, where the host's bookkeeping (far thinner than a
    forward on a CPU) becomes visible. White space on the forward (or device) row is time the
    compute waits for the host."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    bars = bars.assign(row=[_timeline_lane(lane, name)
                            for lane, name in zip(bars.lane, bars.name, strict=True)])
    lanes = list(dict.fromkeys(zip(bars.engine, bars.row, strict=True)))
    with book_style():
        fig, (whole, zoom) = plt.subplots(1, 2, figsize=(WIDTH, 0.42 * len(lanes) + 1.8),
                                          sharey=True, width_ratios=[1.6, 1])
        boundaries = {}
        for engine, group in bars[bars.name == "decode_step"].groupby("engine", sort=False):
            first = group.sort_values("start_ms").iloc[0]
            boundaries[engine] = first.start_ms + first.dur_ms
        # Right panel: each loop's bars shifted so that its own first step ends at 0.
        for ax, aligned in ((whole, False), (zoom, True)):
            for y, (engine, row) in enumerate(lanes):
                rows = bars[(bars.engine == engine) & (bars.row == row)]
                offset = boundaries.get(engine, 0.0) if aligned else 0.0
                for name, group in rows.groupby("name", sort=False):
                    step = name == "decode_step"
                    color = PHASE_COLORS.get(name, "#7b3294")
                    ax.broken_barh(list(zip(group.start_ms - offset, group.dur_ms, strict=True)),
                                   (y - (0.4 if step else 0.3), 0.8 if step else 0.6),
                                   color=color, zorder=1 if step else 2)
            ax.grid(False)
        whole.set_yticks(range(len(lanes)), [f"{engine}: {row}" for engine, row in lanes])
        whole.invert_yaxis()
        whole.set(xlabel="ms from the first step's start", title=title)
        zoom.set_xlim(-zoom_ms, zoom_ms)
        zoom.axvline(0, color="k", lw=0.8, ls=":")
        zoom.set(xlabel="ms from the end of each loop's first step",
                 title=f"zoom: +-{zoom_ms:g} ms around that step's end")
        names = [n for n in TIMELINE_PHASES if n in set(bars.name)]
        handles = [Patch(color=PHASE_COLORS[n], label=n) for n in names]
        if "device" in set(bars.lane):
            handles.append(Patch(color="#7b3294", label="CUDA kernel"))
        fig.legend(handles=handles, loc="upper center", ncol=len(handles),
                   bbox_to_anchor=(0.5, 0.0))
        fig.tight_layout()
    return fig


def plot_stage_results(df: pd.DataFrame):
    """Per device, two panels: % of hf (median of per-repeat ratios) and % of the speed of
    light for every stage (book order), a bar per batch size (light to dark: small to large)."""
    import matplotlib.pyplot as plt

    devices = list(dict.fromkeys(df.device_name))
    with book_style():
        fig, axes = plt.subplots(2 * len(devices), 1, figsize=(WIDTH, 6.6 * len(devices)),
                                 squeeze=False)
        for i, name in enumerate(devices):
            dev = df[df.device_name == name]
            engines = list(dict.fromkeys(dev.engine))
            colors = batch_colors(dev.batch_size.unique())
            for ax, value, title in ((axes[2 * i][0], "pct_of_hf",
                                      "% of hf's tok/s, same run (median of per-repeat ratios)"),
                                     (axes[2 * i + 1][0], "pct_of_floor",
                                      "% of the speed of light")):
                table = dev.pivot_table(index="engine", columns="batch_size", values=value,
                                        sort=False).reindex(engines)
                table.plot.bar(ax=ax, rot=25, width=0.8,
                               color=[colors[b] for b in table.columns])
                if value == "pct_of_hf":
                    ax.axhline(100, color="k", lw=0.8, ls="--")
                ax.set(title=f"{name}, {dev.model.iloc[0]} {dev.dtype.iloc[0]}: {title}",
                       xlabel="", ylabel="%", ylim=(0, None))
                for label in ax.get_xticklabels():
                    label.set_ha("right")
                legend_outside(ax, title="batch")
        fig.tight_layout()
    return fig


def plot_phase_bars(phases: pd.DataFrame, title: str):
    """A decode step's outermost phases stacked per batch size (top), and the same without
    model_forward (bottom) so the small phases are visible; each phase has its colour of
    :data:`PHASE_COLORS` in both panels; whiskers: lowest and highest profiled repeat, where
    recorded."""
    import matplotlib.pyplot as plt

    from ..bench.profiling import PHASES

    inside = phases.get("inside", pd.Series("", index=phases.index))
    rows = phases[(inside.isna() | (inside == "")) & phases.phase.isin([*PHASES, "(unlabelled)"])]
    with book_style():
        fig, axes = plt.subplots(1, 2, figsize=(WIDTH, 3.6))
        for ax, part in zip(axes, (rows, rows[rows.phase != "model_forward"]), strict=True):
            table = part.pivot_table(index="batch_size", columns="phase", values="ms_per_step",
                                     sort=False)
            table.plot.bar(stacked=True, ax=ax, legend=False, rot=0,
                           color=[PHASE_COLORS[p] for p in table.columns])
            if "ms_min" in part:  # whiskers on each phase's own segment
                bottom = table.cumsum(axis=1) - table
                for i, b in enumerate(table.index):
                    for ph in table.columns:
                        r = part[(part.batch_size == b) & (part.phase == ph)].iloc[0]
                        y = bottom.loc[b, ph] + r.ms_per_step
                        ax.errorbar(i, y, yerr=[[r.ms_per_step - r.ms_min],
                                                [r.ms_max - r.ms_per_step]],
                                    color="k", capsize=2, lw=0.8)
            ax.set(ylabel="ms per decode step (profiled)", xlabel="batch size", ylim=(0, None))
        axes[0].set_title(title)
        axes[1].set_title("the same without model_forward")
        names = [p for p in [*PHASES, "(unlabelled)"] if p in set(rows.phase)]
        fig.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=PHASE_COLORS[p]) for p in names],
                   labels=names, loc="upper center", ncol=4, bbox_to_anchor=(0.5, 0.0))
        fig.tight_layout()
    return fig

