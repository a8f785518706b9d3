"""Helpers the chapter notebooks share: the run preset, the default model for the reader's device,
and the recorded results of every device."""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import json
import os
import pkgutil
import sys
import textwrap
from dataclasses import dataclass

import pandas as pd
import torch

from .bench import BenchConfig
from .devices import REPO_ROOT
from .models import resolve_device

RESULTS = REPO_ROOT / "data" / "results"


@dataclass(frozen=True, slots=True)
class Preset:
    """How big the notebook's live runs are. ``small`` keeps a chapter to a couple of minutes
    on 2 CPU cores (the test suite uses it); ``full`` is what ``make chapter-NN`` runs."""

    name: str
    device: torch.device
    model: str
    bench: BenchConfig


def preset(engines: tuple[str, ...], chapter: str) -> Preset:
    name = os.environ.get("MINIINFER_PRESET", "full")
    if name not in ("small", "full"):
        raise ValueError(f"MINIINFER_PRESET must be 'small' or 'full', got {name!r}")
    if name == "small":
        # CPU and the real SmolLM2 even where a GPU exists: the test suite checks the prose's
        # claims, it does not measure.
        return Preset(name, torch.device("cpu"), "smollm2-135m",
                      BenchConfig(engines, (1, 4), prompt_len=32, new_tokens=8, warmup=1,
                                  repeat=2, chapter=chapter))
    device = resolve_device(os.environ.get("MINIINFER_DEVICE", "auto"))
    model = os.environ.get("MINIINFER_MODEL") or (
        "qwen2.5-7b" if device.type == "cuda" else "smollm2-135m")
    return Preset(name, device, model,
                  BenchConfig(engines, (1, 4, 8), prompt_len=64, new_tokens=32, warmup=1,
                              repeat=3, chapter=chapter))


# Read as text: a commit like "2638e60" would otherwise parse as the number 2.638e63.
TEXT_COLUMNS = {"chapter": str, "git_sha": str, "date": str}


def read_results(path) -> pd.DataFrame:
    """A results CSV with its identifying columns kept as text."""
    return pd.read_csv(path, dtype=TEXT_COLUMNS)


def _is_sweep(path) -> bool:
    return path.name.endswith("-context.csv")


def recorded_results(chapter: str) -> pd.DataFrame:
    """Every device's benchmark CSV for a chapter, written by ``make chapter-NN`` runs."""
    files = sorted(f for f in (RESULTS / f"ch{chapter}").glob("*.csv") if not _is_sweep(f))
    if not files:
        return pd.DataFrame()
    return pd.concat([read_results(f) for f in files], ignore_index=True)


def tok_s_table(df: pd.DataFrame, value: str = "tok_s") -> pd.DataFrame:
    """Devices x batch sizes as rows, engines as columns."""
    return df.pivot_table(index=["device_name", "model", "dtype", "batch_size"], columns="engine",
                          values=value, sort=False).round(1)


def results_markdown() -> str:
    """Every recorded offline benchmark as markdown tables (one per chapter and device): tok/s
    and % of HF per engine and batch size. The README's results section is this output."""
    out = []
    needed = {"engine", "batch_size", "tok_s", "pct_of_hf"}
    for path in sorted(RESULTS.glob("ch*/*.csv")):
        dev = read_results(path)
        if not needed <= set(dev.columns) or _is_sweep(path):
            continue  # profiles, serving runs: their chapters show them
        table = dev.pivot_table(index="batch_size", columns="engine", values="tok_s", sort=False)
        cells = table.round(1).astype(str) + " (" + _pct_cells(dev) + ")"
        first = dev.iloc[0]
        spread = ", per-repeat min-max" if "pct_of_hf_min" in dev.columns else ""
        out.append(f"**{path.parent.name}** ({path.name}): {first.device_name}, {first.model} "
                   f"{first['dtype']}, prompt {first.prompt_len}, {first.new_tokens} new tokens, "
                   f"p50 of {first.repeats}, torch {first.torch}, transformers "
                   f"{first.transformers}, git {first.git_sha}. tok/s (% of hf{spread}):\n")
        out.append(_markdown(cells.reset_index()) + "\n")
    return "\n".join(out)


def _markdown(df: pd.DataFrame) -> str:
    rows = [list(map(str, df.columns)), ["---"] * len(df.columns)]
    rows += [list(map(str, r)) for r in df.itertuples(index=False)]
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def pct_of_hf_table(df: pd.DataFrame) -> pd.DataFrame:
    """% of HF tok/s (same run) per device and batch size, engines as columns in stage order."""
    return tok_s_table(df, "pct_of_hf")


def _pct_cells(df: pd.DataFrame, index: str | list[str] = "batch_size") -> pd.DataFrame:
    """ "97% [91-104]": the median paired ratio to hf and its per-repeat extremes (runs
    recorded before the extremes were kept show the median alone)."""
    def pivot(value: str) -> pd.DataFrame:
        return df.pivot_table(index=index, columns="engine", values=value, sort=False,
                              dropna=False).round(0).astype("Int64").astype(str)

    cells = pivot("pct_of_hf") + "%"
    if "pct_of_hf_min" in df.columns and df.pct_of_hf_min.notna().all():
        spread = " [" + pivot("pct_of_hf_min") + "-" + pivot("pct_of_hf_max") + "]"
        # hf against itself is 100% in every repeat: no range to show.
        cells = cells + spread.drop(columns="hf", errors="ignore").reindex(
            columns=cells.columns, fill_value="")
    return cells


def ablation_table(df: pd.DataFrame, steps: list[tuple[str, str, str]]) -> pd.DataFrame:
    """Each ``(before, after, change)`` in ``steps``: the change in median % of hf from stage
    ``before`` to ``after``, per device and batch size, and whether the run can tell it from
    noise (the two stages' per-repeat ranges do not overlap; runs without ranges: unknown)."""
    rows = []
    has_spread = "pct_of_hf_min" in df.columns and df.pct_of_hf_min.notna().all()
    for (device, batch), dev in df.groupby(["device_name", "batch_size"], sort=False):
        stage = dev.set_index("engine")
        for before, after, change in steps:
            if before not in stage.index or after not in stage.index:
                continue
            a, b = stage.loc[before], stage.loc[after]
            if has_spread:
                apart = a.pct_of_hf_max < b.pct_of_hf_min or b.pct_of_hf_max < a.pct_of_hf_min
                verdict = "yes" if apart else "no (ranges overlap)"
            else:
                verdict = "unknown (no per-repeat ranges)"
            rows.append({"device_name": device, "batch_size": batch, "change": change,
                         "from": before, "to": after,
                         "points of hf": round(b.pct_of_hf - a.pct_of_hf, 1),
                         "outside noise": verdict})
    return pd.DataFrame(rows).set_index(["device_name", "batch_size", "change"])


def pct_of_hf_spread_table(df: pd.DataFrame) -> pd.DataFrame:
    """:func:`pct_of_hf_table` with each cell's per-repeat range: "97% [91-104]" is a median
    paired ratio of 97% whose repeats ranged from 91% to 104%. Where two engines' ranges
    overlap this much, the run cannot tell them apart."""
    return _pct_cells(df, ["device_name", "model", "dtype", "batch_size"])


def load_note(df: pd.DataFrame) -> str:
    """One line on how busy the machine was while ``df`` was recorded (the load guard's
    columns): a run with competing work is marked "recorded on a busy machine"."""
    if "busy" not in df.columns:
        return "load: not recorded yet (this run predates the load guard)"
    busy = df[df.busy.astype(str).str.lower() == "true"]
    worst = df[["load_before", "load_after"]].max().max()
    steal = df.steal_pct.max() if "steal_pct" in df.columns else float("nan")
    steal_text = f", CPU steal up to {steal:.1f}%" if steal == steal else ""
    if busy.empty:
        return f"load: quiet machine (load per core up to {worst:.2f}{steal_text})"
    return (f"RECORDED ON A BUSY MACHINE: {len(busy)} of {len(df)} rows saw competing work "
            f"(load per core up to {worst:.2f}{steal_text}); read its numbers with care")


def device_table() -> pd.DataFrame:
    """The speed of light of every recorded device (``data/results/devices.csv``)."""
    from .devices import DEVICES_CSV

    return pd.read_csv(DEVICES_CSV) if DEVICES_CSV.exists() else pd.DataFrame()


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


def recorded_context_sweeps(chapter: str) -> pd.DataFrame:
    """Every device's context-length sweep for a chapter (``chNN/<device>-context.csv``);
    empty until ``make chapter-NN`` has recorded one."""
    files = sorted((RESULTS / f"ch{chapter}").glob("*-context.csv"))
    if not files:
        return pd.DataFrame()
    return pd.concat([read_results(f) for f in files], ignore_index=True)


SWEEP_PHASES = ("gather_batch_kv", "build_cache", "write_decode_kv", "model_forward")


def context_phase_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per device, engine and context length: the plain decode step and the profiled run's ms
    per step in each phase (phases an engine does not have are left blank)."""
    cols = ["step_ms", "pct_of_hf"] + [f"{p}_ms" for p in SWEEP_PHASES if f"{p}_ms" in df] \
        + (["unlabelled_ms"] if "unlabelled_ms" in df else [])
    return df.set_index(["device_name", "engine", "context_len"])[cols].round(1)


def context_sentences(df: pd.DataFrame) -> list[str]:
    """What a context sweep shows, as sentences computed from it: each engine's decode step from
    the shortest to the longest context, and the paged stages' K/V bookkeeping (gather + build +
    write, profiled) over the same range."""
    lines = []
    kv_cols = [f"{p}_ms" for p in SWEEP_PHASES[:3] if f"{p}_ms" in df]
    for name, dev in df.groupby("device_name", sort=False):
        short, long = dev.context_len.min(), dev.context_len.max()
        lines.append(f"{name}, batch {dev.batch_size.iloc[0]}, context {short} -> {long}:")
        for engine, rows in dev.groupby("engine", sort=False):
            rows = rows.set_index("context_len")
            line = (f"  {engine}: decode step {rows.step_ms[short]:.1f} -> {rows.step_ms[long]:.1f}"
                    f" ms ({rows.step_ms[long] / rows.step_ms[short]:.2f}x), "
                    f"{rows.pct_of_hf[short]:.0f}% -> {rows.pct_of_hf[long]:.0f}% of hf's step")
            if engine != "hf" and kv_cols:
                kv = rows[kv_cols].fillna(0).sum(axis=1)
                line += (f"; K/V bookkeeping {kv[short]:.1f} -> {kv[long]:.1f} ms per profiled "
                         f"step ({100 * kv[long] / rows.profiled_step_ms[long]:.0f}% of it at "
                         f"{long})")
            lines.append(line)
        # Each point is a single run: where hf's own step shrinks as its context grows, the
        # machine drifted between points by at least that much, and so may every ratio.
        hf = dev[dev.engine == "hf"].set_index("context_len").step_ms.sort_index()
        drops = [(a, b) for a, b in zip(hf.index, hf.index[1:], strict=False)
                 if hf[b] < 0.9 * hf[a]]
        for a, b in drops:
            lines.append(f"  caution: hf's step falls from {hf[a]:.1f} ms at context {a} to "
                         f"{hf[b]:.1f} ms at {b}; more context cannot take less time, so the "
                         f"machine drifted by {100 * (1 - hf[b] / hf[a]):.0f}% between those "
                         f"single runs: read differences of that size as noise")
    return lines


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
    """Gantt chart of :func:`miniinfer.profiling.timeline` bars, per engine a ``host`` row (the
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


def host_split(bars: pd.DataFrame) -> pd.DataFrame:
    """Per engine, from timeline bars: the mean decode step as the host sees it, the forward in
    it, the host bookkeeping (the rest of the step: inputs, sampling, waiting for tokens, and
    what no range covers) and the gap between one step's end and the next one's start."""
    rows = []
    for engine, group in bars[bars.lane == "host"].groupby("engine", sort=False):
        steps = group[group.name == "decode_step"].sort_values("start_ms")
        total = steps.dur_ms.sum()
        forward = group[group.name == "model_forward"].dur_ms.sum()
        gaps = (steps.start_ms.iloc[1:].to_numpy()
                - (steps.start_ms + steps.dur_ms).iloc[:-1].to_numpy())
        rows.append({"engine": engine, "steps": len(steps), "step_ms": total / len(steps),
                     "forward_ms": forward / len(steps),
                     "bookkeeping_ms": (total - forward) / len(steps),
                     "bookkeeping_pct": 100 * (total - forward) / total,
                     "between_steps_ms": gaps.mean() if len(gaps) else float("nan")})
    return pd.DataFrame(rows).set_index("engine")


def speed_of_light_table(chapters: tuple[str, ...] = ("01", "02", "03", "04", "06", "07")
                         ) -> pd.DataFrame:
    """Each stage's % of the decode floor per device and batch size, from the chapters'
    recorded benchmarks (a stage measured in several chapters: its latest chapter's run).

    Runs recorded before the device table measured their own copy bandwidth, which varies from
    run to run on a shared machine; so that runs of different chapters compare, each row's
    share is rescaled to one bandwidth per device: the device table's (``devices.csv``) where
    it has the device, else the median of its runs' (the share is bytes per step / bandwidth /
    step time, so it scales with 1 / bandwidth; a compute-bound floor is not rescaled)."""
    frames = [f for f in (recorded_results(c) for c in chapters) if not f.empty]
    if not frames:
        return pd.DataFrame()
    df = pd.concat(frames, ignore_index=True)
    df = df.drop_duplicates(["device_name", "model", "engine", "batch_size"], keep="last")
    # One bandwidth per run (a run's rows share it), then the median over a device's runs.
    per_run = df.drop_duplicates(["device_name", "bandwidth_gbs"])
    device_bandwidth = df.device_name.map(per_run.groupby("device_name").bandwidth_gbs.median())
    table = device_table()
    if not table.empty:
        recorded = df.device_name.map(table.set_index("name").bandwidth_gbs)
        device_bandwidth = recorded.fillna(device_bandwidth)
    compute_bound = (df.floor_bound.eq("compute") if "floor_bound" in df
                     else pd.Series(False, index=df.index))
    df = df.assign(pct_of_floor=df.pct_of_floor.where(
        compute_bound, df.pct_of_floor * df.bandwidth_gbs / device_bandwidth))
    return tok_s_table(df, "pct_of_floor")


def this_device_or_live(lm, p: Preset, engines: dict | None = None) -> tuple[pd.DataFrame, str]:
    """The chapter's benchmark on this machine. With the full preset, the CSV ``make
    chapter-NN`` has just written for this device is shown as is (re-measuring it would only
    double the wait); otherwise, and when this device has no CSV yet, it is measured now."""
    from .bench import run_bench
    from .devices import device_slug

    path = RESULTS / f"ch{p.bench.chapter}" / f"{device_slug(lm.device)}.csv"
    if p.name == "full" and path.exists():
        df = read_results(path)
        if df.model.iloc[0] == lm.name:
            return df, f"recorded by make chapter-{p.bench.chapter} on this device ({path.name})"
    return run_bench(lm, p.bench, engines), "measured live in this notebook"


# -- Each stage as a diff (chapters 02-08) ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class MethodChange:
    """One method a stage defines: ``overrides`` one it inherits (``diff`` against the
    inherited source) or ``adds`` a new one (``diff`` is all additions)."""
    name: str
    kind: str  # "overrides" | "adds"
    inherited_from: str | None  # the class whose version it replaces
    diff: str  # unified diff, full method as context


@dataclass(frozen=True, slots=True, repr=False)
class StageDiff:
    """What a stage's class changes against its parent class, read from the package's source.
    Jupyter renders it as HTML (one diff block per method); ``str`` gives plain text."""
    stage: str
    cls: type
    parent: type
    changes: tuple[MethodChange, ...]
    module_extras: tuple[str, ...]  # other classes and functions its module defines

    def header(self) -> str:
        parent_stage = getattr(self.parent, "name", None)
        parent = f"`{parent_stage}` ({self.parent.__name__}, chapter {self.parent.chapter})" \
            if parent_stage else f"`{self.parent.__name__}`"
        overrides = [c.name for c in self.changes if c.kind == "overrides"]
        adds = [c.name for c in self.changes if c.kind == "adds"]
        lines = [f"`{self.stage}` ({self.cls.__name__} in `{self.cls.__module__}`, chapter "
                 f"{getattr(self.cls, 'chapter', '?')}) subclasses {parent}.",
                 f"It overrides {_names(overrides)} and adds {_names(adds)}; everything else is "
                 f"inherited."]
        if self.module_extras:
            lines.append(f"Its module also defines {_names(list(self.module_extras))}.")
        return " ".join(lines)

    def _repr_html_(self) -> str:
        """A block per method, lines coloured as in a code review; new methods start folded."""
        from html import escape

        colours = {"+": "#e6ffec", "-": "#ffebe9", "@": "#ddf4ff"}
        parts = [f"<p>{escape(self.header()).replace('`', '')}</p>"]
        for change in self.changes:
            lines = "".join(
                f'<span style="display:block;background:{colours.get(line[:1], "transparent")}">'
                f"{escape(line) or '&nbsp;'}</span>"
                for line in change.diff.splitlines()[2:])  # the ---/+++ names are in the summary
            verb = (f"overrides {change.inherited_from}.{change.name}"
                    if change.kind == "overrides" else "new method")
            parts.append(f"<details{' open' if change.kind == 'overrides' else ''}><summary>"
                         f"<code>{escape(change.name)}</code> ({escape(verb)})</summary>"
                         f'<pre style="font-size:85%;line-height:1.25">{lines}</pre></details>')
        return "\n".join(parts)

    def __str__(self) -> str:
        return "\n\n".join([self.header(), *(c.diff for c in self.changes)])

    __repr__ = __str__  # the plain-text view where HTML is not shown


def _names(names: list[str]) -> str:
    return ", ".join(f"`{n}`" for n in names) if names else "nothing"


def stage_diff(stage: str) -> StageDiff:
    """The methods ``stage``'s class defines itself (``"stage:variant"`` names the stage's
    class too), each as a unified diff against the version it inherits."""
    from .engines import resolve_engine

    return class_diff(resolve_engine(stage)[0], stage)


def class_diff(cls: type, stage: str | None = None) -> StageDiff:
    """:func:`stage_diff` for any class: every method it defines, diffed against the version
    its parent would have given it (found along the parent's MRO), with the whole method as
    context so the reader sees it in full; a method new to it is all additions."""
    parent = cls.__mro__[1]
    changes = []
    for name, member in vars(cls).items():
        func = _function_of(member)
        if func is None:
            continue
        source = textwrap.dedent(inspect.getsource(func)).splitlines()
        owner = next((base for base in parent.__mro__ if name in vars(base)), None)
        if owner is None:
            before, kind = [], "adds"
        else:
            inherited = _function_of(vars(owner)[name])
            before = textwrap.dedent(inspect.getsource(inherited)).splitlines() \
                if inherited is not None else []
            kind = "overrides"
        diff = difflib.unified_diff(before, source,
                                    f"{owner.__name__}.{name}" if owner else "(new)",
                                    f"{cls.__name__}.{name}", n=max(len(before), len(source)),
                                    lineterm="")
        changes.append(MethodChange(name, kind, owner.__name__ if owner else None,
                                    "\n".join(diff)))
    module = sys.modules[cls.__module__]
    extras = tuple(name for name, obj in vars(module).items()
                   if (inspect.isclass(obj) or inspect.isfunction(obj)) and obj is not cls
                   and getattr(obj, "__module__", None) == module.__name__)
    return StageDiff(stage or getattr(cls, "name", cls.__name__), cls, parent, tuple(changes),
                     extras)


def _function_of(member) -> object | None:
    """The function behind a class attribute (method, static/class method, property getter),
    None for data attributes such as ``name`` or ``summary``."""
    if isinstance(member, (staticmethod, classmethod)):
        return member.__func__
    if isinstance(member, property):
        return member.fget
    return member if inspect.isfunction(member) else None


def show_diff(stage: str) -> StageDiff:
    """:func:`stage_diff`, for a notebook cell's last line: Jupyter renders the returned object
    as a diff block per method."""
    return stage_diff(stage)


# -- The overview (chapter 00) ----------------------------------------------------------------

CHAPTERS_DIR = REPO_ROOT / "chapters"


@dataclass(frozen=True, slots=True)
class BookChapter:
    """A chapter as the plan has it. Its title, modules and status are read from the tree at run
    time (the notebook's heading, the registry's classes, importable modules), so the overview
    stays current as chapters land."""
    number: str
    stages: tuple[str, ...]  # engine registry names it adds
    modules: tuple[str, ...]  # supporting modules it adds (shown once importable)
    planned_title: str
    idea: str = ""  # for a chapter without a stage (05) or one not built yet


BOOK: tuple[BookChapter, ...] = (
    BookChapter("01", ("hf", "naive"), ("miniinfer.models", "miniinfer.bench",
                                        "miniinfer.devices"), "Decoding by hand"),
    BookChapter("02", ("paged-loop",), ("miniinfer.kv_cache",), "A paged KV cache"),
    BookChapter("03", ("paged-vectorized",), (), "One gather per layer"),
    BookChapter("04", ("paged-prealloc",), (), "Preallocated buffers"),
    BookChapter("05", (), ("miniinfer.ranges", "miniinfer.profiling"), "Decode profiling",
                "named profiler ranges over every phase of a step, and SQL over the exported "
                "trace to see where the time goes"),
    BookChapter("06", ("paged-attention",), ("miniinfer.kernels",
                                             "miniinfer.engines.direct_forward"),
                "Paged attention"),
    BookChapter("07", ("async",), (), "Async loops and CUDA graphs"),
    BookChapter("08", ("continuous",), ("miniinfer.scheduler", "miniinfer.serving"),
                "Continuous batching"),
    BookChapter("09", ("prefix-cache",), (), "Prefix caching",
                "hash-chained full blocks with ref counts and LRU eviction: a shared prompt "
                "beginning is computed once"),
    BookChapter("10", (), ("miniinfer.server",), "An OpenAI-compatible server",
                "the engine behind an OpenAI-compatible HTTP API, driven by the official client"),
)


def _notebook(number: str):
    found = sorted(CHAPTERS_DIR.glob(f"{number}_*.ipynb"))
    return found[0] if found else None


def _notebook_title(path) -> str | None:
    """The notebook's first heading without its "Chapter NN —" prefix."""
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "markdown":
            first = "".join(cell["source"]).lstrip().splitlines()[0]
            return first.lstrip("# ").split(" — ", 1)[-1]
    return None


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def recorded_devices(chapter: str) -> list[str]:
    """Device names with any recorded CSV for a chapter (benchmarks, profiles, serving runs)."""
    names: dict[str, None] = {}
    for path in sorted((RESULTS / f"ch{chapter}").rglob("*.csv")):
        names.update(dict.fromkeys(read_results(path).get("device_name", pd.Series()).dropna()))
    return list(names)


def chapter_table() -> pd.DataFrame:
    """Every chapter of the plan: what it adds (stages from the engine registry, with the
    module each lives in and its one-sentence summary) and whether it is in the book yet and
    recorded on which devices."""
    from .engines import ENGINES

    rows = []
    for ch in BOOK:
        notebook = _notebook(ch.number)
        stages = [s for s in ch.stages if s in ENGINES]
        modules = [ENGINES[s].__module__ for s in stages] + [m for m in ch.modules
                                                             if _importable(m)]
        ideas = [f"`{s}`: {ENGINES[s].summary}" for s in stages]
        rows.append({
            "chapter": ch.number,
            "title": _notebook_title(notebook) if notebook else ch.planned_title,
            "notebook": notebook.name if notebook else "",
            "stage": ", ".join(stages or ch.stages) or "(none)",
            "modules": ", ".join(modules),
            "idea": "; ".join(ideas) or ch.idea,
            "status": "in the book" if notebook and (stages or not ch.stages) else "coming",
            "recorded on": ", ".join(recorded_devices(ch.number)),
        })
    return pd.DataFrame(rows)


def stage_tree() -> str:
    """The engine classes as a tree of who subclasses whom, from the registry's classes."""
    from .engines import ENGINES, Engine

    def label(cls: type) -> str:
        if cls is Engine:
            return f"Engine ({cls.__module__})"
        return f"{cls.name}: {cls.__name__} ({cls.__module__}, chapter {cls.chapter})"

    classes = list(ENGINES.values())
    lines: list[str] = []

    def walk(cls: type, prefix: str, last: bool, root: bool) -> None:
        lines.append(label(cls) if root else f"{prefix}{'└── ' if last else '├── '}{label(cls)}")
        children = [c for c in classes if c.__mro__[1] is cls]
        inner = "" if root else prefix + ("    " if last else "│   ")
        for i, child in enumerate(children):
            walk(child, inner, i == len(children) - 1, False)

    walk(Engine, "", True, True)
    return "\n".join(lines)


def stage_results(chapters: tuple[str, ...] = ("01", "02", "03", "04", "06", "07")
                  ) -> pd.DataFrame:
    """Every stage's % of hf and % of the speed of light per recorded device and batch size,
    one row each: a stage measured in several chapters is taken from its latest chapter's run
    (its % of hf is from that run; its % of the floor is rescaled to one bandwidth per device
    as in :func:`speed_of_light_table`)."""
    from .engines import resolve_engine

    frames = [f for f in (recorded_results(c) for c in chapters) if not f.empty]
    if not frames:
        return pd.DataFrame()
    df = pd.concat(frames, ignore_index=True)
    df = df.drop_duplicates(["device_name", "model", "engine", "batch_size"], keep="last")
    floor = speed_of_light_table(chapters).stack().rename("pct_of_floor").reset_index()
    df = df.drop(columns="pct_of_floor").merge(
        floor, on=["device_name", "model", "dtype", "batch_size", "engine"], how="left")
    df["stage_chapter"] = [resolve_engine(e)[0].chapter for e in df.engine]
    df["is_baseline"] = df.engine != "hf"  # False sorts first: hf leads its chapter's stages
    df = df.sort_values(["device_name", "stage_chapter", "is_baseline"], kind="stable")
    return df[["device_name", "model", "dtype", "stage_chapter", "engine", "chapter",
               "batch_size", "pct_of_hf", "pct_of_floor"]].reset_index(drop=True)


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


def package_map() -> pd.DataFrame:
    """Every module of the package, the chapter that adds it (per :data:`BOOK` and the engine
    registry; "-" for what every chapter uses) and its docstring's first paragraph."""
    from .engines import ENGINES

    chapter_of = {m: ch.number for ch in BOOK for m in ch.modules}
    chapter_of.update({cls.__module__: cls.chapter for cls in ENGINES.values()})
    rows = []
    for info in pkgutil.walk_packages(sys.modules[__package__].__path__, __package__ + "."):
        if info.name.endswith("__main__"):
            continue
        owner = next((chapter_of[m] for m in chapter_of
                      if info.name == m or info.name.startswith(m + ".")), "-")
        doc = (importlib.import_module(info.name).__doc__ or "").strip()
        rows.append({"module": info.name, "chapter": owner,
                     "what it is": " ".join(doc.split("\n\n")[0].split())})
    return pd.DataFrame(rows).sort_values(["chapter", "module"], ignore_index=True)


def recorded_runs() -> pd.DataFrame:
    """One row per recorded results file: chapter, file, and the device, model, software and
    commit of the run that wrote it."""
    columns = ["device_name", "model", "dtype", "torch", "transformers", "git_sha", "date"]
    rows = []
    for path in sorted(RESULTS.glob("ch*/**/*.csv")):
        first = read_results(path).iloc[0]
        rows.append({"chapter": path.relative_to(RESULTS).parts[0][2:],
                     "file": str(path.relative_to(RESULTS)),
                     **{c: first.get(c, "") for c in columns}})
    return pd.DataFrame(rows)
