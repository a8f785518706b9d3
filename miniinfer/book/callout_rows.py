"""The recorded rows a chapter's callout reads (:mod:`.callouts`), and the phrases it builds
from them: one kind of device's rows, an engine's % of hf and verdicts, a range, a step against
the speed of light."""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd

from ..bench.serving.metrics import median_of_repeats
from . import analysis
from .results import RESULTS, STAGE_CHAPTERS, read_results, recorded_results


def runs_of(chapter: str, kind: str) -> pd.DataFrame:
    files = sorted((RESULTS / f"ch{chapter}").glob(f"*-{kind}.csv"))
    return pd.concat([read_results(f) for f in files], ignore_index=True) if files else pd.DataFrame()


def bench_of(chapter: str, gpu: bool, others: tuple[str, ...]) -> pd.DataFrame:
    """A chapter's benchmark rows on one kind of device: its CSVs but those of the ``others``
    kinds (file names ending ``-<kind>``) that its recording writes beside them."""
    files = [f for f in sorted((RESULTS / f"ch{chapter}").glob("*.csv"))
             if not f.stem.endswith(others)]
    return on_device(pd.concat([read_results(f) for f in files], ignore_index=True), gpu) \
        if files else pd.DataFrame()


def of_kind(df: pd.DataFrame, gpu: bool) -> pd.DataFrame:
    """The rows of one kind of device (the ``device`` column: ``cpu`` or ``cuda:N``)."""
    if df.empty or "device" not in df:
        return df.iloc[0:0] if gpu else df
    cuda = df.device.astype(str).str.startswith("cuda")
    return df[cuda] if gpu else df[~cuda]


def on_device(df: pd.DataFrame, gpu: bool) -> pd.DataFrame:
    """One device's rows of that kind: the latest recorded where several devices (two GPUs, or
    two CPUs: names carry the instruction set) recorded the same table, since a phrase over two
    machines' rows (a range of % of hf, say) would describe neither."""
    df = of_kind(df, gpu)
    if "device_name" not in df or df.device_name.nunique() < 2:
        return df
    latest = df.groupby("device_name")["date"].max().idxmax() if "date" in df \
        else max(df.device_name)
    return df[df.device_name == latest]


def pcts(df: pd.DataFrame, engine: str) -> str:
    rows = df[df.engine == engine].sort_values("batch_size")
    return ", ".join(f"{p:.0f}%" for p in rows.pct_of_hf) + " of hf at batch " + \
        "/".join(str(b) for b in rows.batch_size)


def verdicts(df: pd.DataFrame, engine: str) -> str:
    table = analysis.hf_ratio_table(df).reset_index()
    rows = table[table.engine == engine].sort_values("batch_size")
    by_verdict = rows.groupby("verdict", sort=False).batch_size.apply(list)
    if len(by_verdict) == 1:
        return f"{by_verdict.index[0]} at every batch size"
    return ", ".join(f"{verdict} at batch {'/'.join(map(str, batches))}"
                     for verdict, batches in by_verdict.items())


def span(values: pd.Series, digits: int = 0) -> str:
    """``lo-hi`` of ``values`` at ``digits`` decimals, one number where both ends print alike."""
    lo, hi = f"{values.min():.{digits}f}", f"{values.max():.{digits}f}"
    return lo if lo == hi else f"{lo}-{hi}"


def floor_line(df: pd.DataFrame, engine: str) -> str:
    """``engine``'s step at its smallest batch against the speed of light recorded beside it."""
    row = df[df.engine == engine].sort_values("batch_size").iloc[0]
    return (f"{row.step_ms:.1f} ms at batch {row.batch_size}, {row.pct_of_floor:.0f}% of the "
            f"speed of light ({row.floor_ms:.1f} ms: weights and K/V over the measured "
            f"bandwidth)")


def device_of(df: pd.DataFrame) -> str:
    return df.device_name.iloc[0] if "device_name" in df and len(df) else "this device"


def experiments_of(chapter: str, gpu: bool, *names: str) -> list[pd.DataFrame] | None:
    """Each named experiment's rows of a chapter's recorded serving runs on this kind of
    device, indexed by system, a repeated run's medians (None: no runs recorded there)."""
    runs = on_device(runs_of(chapter, "runs"), gpu)
    if runs.empty:
        return None
    return [median_of_repeats(runs[runs.experiment == name]).set_index("system")
            for name in names]


def overview_sources(gpu: bool) -> list[pd.DataFrame]:
    """The overview's two sources, each on its own latest device of the kind: the stage
    chapters' benchmarks, and chapters 08 and 09's serving runs (a GPU may have recorded one and
    not the other)."""
    recorded = [f for f in (recorded_results(c) for c in STAGE_CHAPTERS) if not f.empty]
    stages = on_device(pd.concat(recorded, ignore_index=True), gpu) if recorded else pd.DataFrame()
    return [stages, on_device(runs_of("08", "runs"), gpu), on_device(runs_of("09", "runs"), gpu)]


def ch04_sources(gpu: bool) -> list[pd.DataFrame]:
    """Chapter 04's benchmark (or, where a device recorded none, chapter 05's, which runs the
    same stage: the H200 recorded only that one) and chapter 05's op counts."""
    bench = on_device(recorded_results("04"), gpu)
    if bench.empty:
        bench = on_device(runs_of("05", "bench"), gpu)
    return [bench, on_device(runs_of("05", "ops"), gpu)]


# The chapters whose lines read more than their own recorded rows.
CALLOUT_SOURCES: dict[str, Callable[[bool], list[pd.DataFrame]]] = {
    "00": overview_sources, "04": ch04_sources}
