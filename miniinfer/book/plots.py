"""The book's figures, drawn from the recorded tables."""

from __future__ import annotations

import pandas as pd

from .analysis import SWEEP_PHASES


def plot_by_device(df: pd.DataFrame, value: str = "tok_s", ylabel: str = "tokens / s",
                   floor: bool = True):
    """One column per recorded device: ``value`` vs batch size, a line per engine; with
    ``floor``, a second row gives each engine's step time as % of the speed of light (the
    floor step: weights and K/V over the bandwidth, or FLOPs over peak compute where that takes
    longer, marked under the batch size). The floor gets its own axis so that, several times
    above the engines, it does not flatten their lines."""
    import matplotlib.pyplot as plt

    devices = list(dict.fromkeys(df.device_name))
    rows = 2 if floor and "pct_of_floor" in df.columns else 1
    fig, axes = plt.subplots(rows, len(devices), figsize=(5.5 * len(devices), 3.6 * rows),
                             squeeze=False)
    for col, name in enumerate(devices):
        dev = df[df.device_name == name]
        batches = sorted(dev.batch_size.unique())
        ax = axes[0][col]
        for engine, group in dev.groupby("engine", sort=False):
            ax.plot(group.batch_size, group[value], marker="o", label=engine)
        ax.set(title=f"{name}\n{dev.model.iloc[0]}, {dev.dtype.iloc[0]}", xlabel="batch size",
               ylabel=ylabel, xticks=batches)
        ax.legend(fontsize="small")
        if rows == 2:
            ax = axes[1][col]
            for engine, group in dev.groupby("engine", sort=False):
                ax.plot(group.batch_size, group.pct_of_floor, marker="o", label=engine)
            ax.axhline(100, color="k", ls="--", lw=1)
            bound = (dev.drop_duplicates("batch_size").set_index("batch_size").floor_bound
                     if "floor_bound" in dev.columns else pd.Series("memory", index=batches))
            ax.set(xlabel="batch size (bound of the floor)", ylabel="% of speed of light",
                   ylim=(0, max(105, dev.pct_of_floor.max() * 1.1)), xticks=batches,
                   xticklabels=[f"{b}\n{bound.get(b, 'memory')}" for b in batches])
    fig.tight_layout()
    return fig


def plot_what_it_buys(df: pd.DataFrame, baseline: str = "hf"):
    """What each stage buys, per recorded device: % of ``baseline``'s tok/s per stage and batch
    size (the median paired ratio; whiskers: the lowest and highest single repeat's ratio,
    where recorded), then the two phases of that end-to-end figure apart: decode-only tok/s
    and time to first token (prefill)."""
    import matplotlib.pyplot as plt
    import numpy as np

    devices = list(dict.fromkeys(df.device_name))
    colours = {e: f"C{i}" for i, e in enumerate(dict.fromkeys(df.engine))}  # same in every panel
    fig, axes = plt.subplots(len(devices), 3, figsize=(15, 3.8 * len(devices) + 0.6),
                             squeeze=False)
    for row, name in enumerate(devices):
        dev = df[df.device_name == name]
        batches = sorted(dev.batch_size.unique())
        engines = [e for e in dict.fromkeys(dev.engine) if e != baseline]
        ax = axes[row][0]
        width = 0.8 / max(len(engines), 1)
        for i, engine in enumerate(engines):
            rows = dev[dev.engine == engine].set_index("batch_size").reindex(batches)
            x = np.arange(len(batches)) + (i - (len(engines) - 1) / 2) * width
            err = None
            if {"pct_of_hf_min", "pct_of_hf_max"} <= set(rows.columns) \
                    and rows.pct_of_hf_min.notna().all():
                err = [rows.pct_of_hf - rows.pct_of_hf_min, rows.pct_of_hf_max - rows.pct_of_hf]
            ax.bar(x, rows.pct_of_hf, width, yerr=err, capsize=3, label=engine,
                   color=colours[engine])
        ax.axhline(100, color="k", lw=1)
        low = dev.get("pct_of_hf_min", dev.pct_of_hf).min()
        ax.set(xticks=range(len(batches)), xticklabels=batches, xlabel="batch size",
               ylabel=f"% of {baseline} tok/s (end to end)",
               ylim=(min(50, low - 5), None), title=f"{name}: what each stage buys")
        decode = (dev.decode_tok_s if "decode_tok_s" in dev.columns
                  else dev.batch_size / dev.step_ms * 1e3)  # older runs: from the median step
        for engine, group in dev.assign(decode=decode).groupby("engine", sort=False):
            axes[row][1].plot(group.batch_size, group.decode, marker="o", label=engine,
                              color=colours[engine])
            axes[row][2].plot(group.batch_size, group.ttft_ms, marker="o", label=engine,
                              color=colours[engine])
        axes[row][1].set(xlabel="batch size", ylabel="decode-only tokens / s", xticks=batches,
                         title="decode (tokens after the first)")
        axes[row][2].set(xlabel="batch size", ylabel="ms", xticks=batches,
                         title="time to first token (prefill)")
    # One legend for the figure, under it: inside an axis it would cover bars or lines.
    fig.legend(*axes[0][1].get_legend_handles_labels(), loc="lower center",
               ncol=len(colours), fontsize="small", frameon=False)
    fig.tight_layout(rect=(0, 0.6 / fig.get_figheight(), 1, 1))
    return fig


def plot_context_sweep(df: pd.DataFrame):
    """Per recorded device: decode step time vs context length per engine (with the floor), and
    the paged stages' K/V phases (gather + build + write, from the profiled run) vs context."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    devices = list(dict.fromkeys(df.device_name))
    # One colour per engine in both panels (hf has no bookkeeping panel line).
    colours = {e: f"C{i}" for i, e in enumerate(dict.fromkeys(df.engine))}
    fig, axes = plt.subplots(len(devices), 2, figsize=(12, 4 * len(devices)), squeeze=False)
    for row, name in enumerate(devices):
        dev = df[df.device_name == name]
        lengths = sorted(dev.context_len.unique())
        ax = axes[row][0]
        for engine, group in dev.groupby("engine", sort=False):
            ax.plot(group.context_len, group.step_ms, marker="o", label=engine,
                    color=colours[engine])
        floor = dev.drop_duplicates("context_len")
        ax.plot(floor.context_len, floor.floor_ms, "k--", label="speed of light")
        ax.set(xlabel="context length (tokens per request)", ylabel="ms per decode step",
               title=f"{name}: batch {dev.batch_size.iloc[0]}", ylim=(0, None))
        ax = axes[row][1]
        kv_cols = [f"{p}_ms" for p in SWEEP_PHASES[:3] if f"{p}_ms" in dev]
        for engine, group in dev[dev.engine != "hf"].groupby("engine", sort=False):
            ax.plot(group.context_len, group[kv_cols].fillna(0).sum(axis=1), marker="o",
                    label=engine, color=colours[engine])
        ax.set(xlabel="context length", ylabel="ms per step (profiled)", ylim=(0, None),
               title="K/V bookkeeping: gather + build + write")
        for ax in axes[row]:
            # Log scale, one labelled tick per recorded length (its own minor labels overlap).
            ax.set_xscale("log")
            ax.set_xticks(lengths, map(str, lengths))
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


TIMELINE_COLORS = {"decode_step": "#dddddd", "prepare_inputs": "tab:orange",
                   "model_forward": "tab:blue", "sample": "tab:green", "read_tokens": "tab:red"}


def _timeline_lane(lane: str, name: str) -> str:
    """Which row of the Gantt chart a bar goes on: the device's kernels (CUDA), the forward (on a
    CPU the forward is the compute: the host runs it itself) and the host's bookkeeping."""
    if lane == "device":
        return "device kernels"
    return "forward" if name == "model_forward" else "host"


def plot_timelines(bars: pd.DataFrame, title: str = ""):
    """Gantt chart of :func:`miniinfer.bench.profiling.timeline` bars, per engine a ``host`` row (the
    step as the host sees it, grey, with its bookkeeping phases on top), a ``forward`` row and,
    on a GPU, a ``device kernels`` row. White space on the forward (or device) row is time the
    compute waits for the host."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    bars = bars.assign(row=[_timeline_lane(lane, name)
                            for lane, name in zip(bars.lane, bars.name, strict=True)])
    lanes = list(dict.fromkeys(zip(bars.engine, bars.row, strict=True)))
    fig, ax = plt.subplots(figsize=(11, 0.5 * len(lanes) + 1.4))
    for y, (engine, row) in enumerate(lanes):
        rows = bars[(bars.engine == engine) & (bars.row == row)]
        for name, group in rows.groupby("name", sort=False):
            step = name == "decode_step"
            ax.broken_barh(list(zip(group.start_ms, group.dur_ms, strict=True)),
                           (y - (0.4 if step else 0.3), 0.8 if step else 0.6),
                           color=TIMELINE_COLORS.get(name, "tab:purple"), zorder=1 if step else 2)
    ax.set_yticks(range(len(lanes)), [f"{engine}: {row}" for engine, row in lanes])
    ax.invert_yaxis()
    ax.set(xlabel="ms from the first step's start", title=title)
    ax.legend(handles=[Patch(color=c, label=n) for n, c in TIMELINE_COLORS.items()]
              + ([Patch(color="tab:purple", label="CUDA kernel")] if "device" in set(bars.lane)
                 else []), loc="upper left", bbox_to_anchor=(1, 1), fontsize="small")
    fig.tight_layout()
    return fig


def plot_stage_results(df: pd.DataFrame):
    """One row of two panels per device: % of hf and % of the speed of light for every stage
    (book order), a bar per batch size."""
    import matplotlib.pyplot as plt

    devices = list(dict.fromkeys(df.device_name))
    fig, axes = plt.subplots(len(devices), 2, figsize=(14, 4.2 * len(devices)), squeeze=False)
    for row, name in zip(axes, devices, strict=True):
        dev = df[df.device_name == name]
        engines = list(dict.fromkeys(dev.engine))
        for ax, value, title in ((row[0], "pct_of_hf", "% of hf (same run)"),
                                 (row[1], "pct_of_floor", "% of the speed of light")):
            table = dev.pivot_table(index="engine", columns="batch_size", values=value,
                                    sort=False).reindex(engines)
            table.plot.bar(ax=ax, rot=30, width=0.8)
            if value == "pct_of_hf":
                ax.axhline(100, color="k", lw=0.8, ls="--")
            ax.set(title=f"{name}, {dev.model.iloc[0]} {dev.dtype.iloc[0]}: {title}",
                   xlabel="", ylabel="%")
            ax.legend(title="batch", fontsize=8)
    fig.tight_layout()
    return fig
