"""The recorded results (``data/results/chNN/<device>.csv``) read back as tables for the book."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from ..bench.devices import RESULTS_DIR, YOURS_DIR, cpu_label
from .chapters import REFERENCE_DEVICES, chapter_of_stage, reference_device
from .presets import Preset

# The book's recordings; a reader's own ``make chapter-NN`` writes under YOURS instead.
RESULTS = RESULTS_DIR
YOURS = YOURS_DIR


# Read as text: a commit like "2638e60" would otherwise parse as the number 2.638e63.
TEXT_COLUMNS = {"chapter": str, "git_sha": str, "date": str}


def read_results(path) -> pd.DataFrame:
    """A results CSV with its identifying columns kept as text, and a CPU's ``device_name``
    followed by its instruction set, "AMD EPYC (AVX512)": the tables group rows by device
    name, and hosts sold under one CPU name are different machines (see ``device_slug``)."""
    df = pd.read_csv(path, dtype=TEXT_COLUMNS)
    if {"device", "device_name", "isa"} <= set(df.columns):
        cpu = (df.device == "cpu") & df.isa.notna()
        df.loc[cpu, "device_name"] = with_isa(df.device_name[cpu], df.isa[cpu])
    return df


def with_isa(names: pd.Series, isa: pd.Series) -> pd.Series:
    """CPUs' names as the tables show them (:func:`~miniinfer.bench.devices.cpu_label`)."""
    return pd.Series([cpu_label(n, i) for n, i in zip(names, isa, strict=True)],
                     index=names.index, dtype=object)


def _is_sweep(path) -> bool:
    return path.name.endswith("-context.csv")


def is_reference(path: Path, chapter: str) -> bool:
    """Whether a results file is one of the chapter's reference recordings (its name starts
    with the reference CPU's or GPU's slug: ``<slug>.csv``, ``<slug>-runs.csv``, ...)."""
    return any(_of_device(path, reference_device(chapter, kind)) for kind in REFERENCE_DEVICES)


def reference_files(chapter: str, pattern: str = "*.csv", every_device: bool = False
                    ) -> list[Path]:
    """The chapter's results files matching ``pattern`` (``"*-runs.csv"``, ``"kernel/*.csv"``):
    the reference recordings only, unless ``every_device`` (the overview's other machines).
    Where the reference device of a kind (CPU, GPU) has no such file, one other device of that
    kind that has it stands in (chapters 08-09 and the decode kernel were recorded on an H100
    only), so a chapter shows one CPU and one GPU."""
    files = sorted((RESULTS / f"ch{chapter}").glob(pattern))
    if every_device:
        return files
    chosen = []
    for kind in REFERENCE_DEVICES:
        own = [f for f in files if is_reference(f, chapter) and f.name.startswith(f"{kind}-")]
        others = [slug for slug in sorted(_known_slugs()) if slug.startswith(f"{kind}-")
                  and any(_of_device(f, slug) for f in files)]
        chosen += own or [f for f in files if others and _of_device(f, others[0])]
    return sorted(chosen)


def _of_device(path: Path, slug: str) -> bool:
    return path.name.startswith((f"{slug}.", f"{slug}-"))


def _known_slugs() -> set[str]:
    """Every device the device table knows (a results file's name starts with one)."""
    table = device_table()
    return set(table.slug) if not table.empty else set()


def recorded_results(chapter: str, every_device: bool = False) -> pd.DataFrame:
    """The chapter's offline benchmark from its reference recordings (CPU and GPU), or from
    every device that recorded it."""
    files = [f for f in reference_files(chapter, every_device=every_device) if not _is_sweep(f)]
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
        first = dev.iloc[0]
        if dev.pct_of_hf.isna().all():  # a run without hf (chapter 11's ablation): tok/s alone
            cells, unit = table.round(1).astype(str), "tok/s (no hf in this run)"
        else:
            cells = table.round(1).astype(str) + " (" + _pct_cells(dev) + ")"
            unit = ("tok/s (% of hf: the median of per-repeat ratios"
                    + (" [lowest-highest])" if "pct_of_hf_min" in dev.columns else ")"))
        out.append(f"**{path.parent.name}** ({path.name}): {first.device_name}, {first.model} "
                   f"{first['dtype']}, prompt {first.prompt_len}, {first.new_tokens} new tokens, "
                   f"p50 of {first.repeats}, torch {first.torch}, transformers "
                   f"{first.transformers}, git {first.git_sha}. {unit}:\n")
        out.append(_markdown(cells.reset_index()) + "\n")
    return "\n".join(out)


def _markdown(df: pd.DataFrame) -> str:
    rows = [list(map(str, df.columns)), ["---"] * len(df.columns)]
    rows += [list(map(str, r)) for r in df.itertuples(index=False)]
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def _pct_cells(df: pd.DataFrame, index: str | list[str] = "batch_size") -> pd.DataFrame:
    """ "97% [91-104]": the median paired ratio to hf and its per-repeat extremes (runs
    recorded before the extremes were kept show the median alone)."""
    def pivot(value: str) -> pd.DataFrame:
        # dropna=False keeps an engine's column where it lacks a batch size, but with several
        # index levels it also builds their whole product (an H200 row for the CPU's model):
        # keep only the index rows something was recorded for.
        table = df.pivot_table(index=index, columns="engine", values=value, sort=False,
                               dropna=False)
        return table[recorded].round(0).astype("Int64").astype(str)

    recorded = df.pivot_table(index=index, columns="engine", values="pct_of_hf", sort=False,
                              dropna=False).notna().any(axis=1)

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
    """% of hf per device and batch size, engines as columns, with each cell's per-repeat range: "97% [91-104]" is a median
    paired ratio of 97% whose repeats ranged from 91% to 104%. Where two engines' ranges
    overlap this much, the run cannot tell them apart."""
    return _pct_cells(df, ["device_name", "model", "dtype", "batch_size"])


def device_table() -> pd.DataFrame:
    """The speed of light of every recorded device (``data/results/devices.csv``)."""
    from ..bench.devices import DEVICES_CSV

    return pd.read_csv(DEVICES_CSV) if DEVICES_CSV.exists() else pd.DataFrame()


def recorded_timelines() -> list[Path]:
    """Chapter 07's recorded Gantt bars, one file per device (``ch07/timeline/<device>.csv.gz``;
    plain ``.csv`` from runs before they were gzipped)."""
    return reference_files("07", "timeline/*.csv") + reference_files("07", "timeline/*.csv.gz")


def recorded_context_sweeps(chapter: str) -> pd.DataFrame:
    """Every device's context-length sweep for a chapter (``chNN/<device>-context.csv``);
    empty until ``make chapter-NN`` has recorded one."""
    files = reference_files(chapter, "*-context.csv")
    if not files:
        return pd.DataFrame()
    return pd.concat([read_results(f) for f in files], ignore_index=True)


def one_row_per_stage(chapters: tuple[str, ...]) -> pd.DataFrame:
    """The chapters' benchmark rows, one per device, model, stage and batch size: a stage
    measured in several chapters from the run of the chapter that adds it (so the overview
    shows what that chapter shows), else from the latest chapter's run."""
    frames = [f for f in (recorded_results(c) for c in chapters) if not f.empty]
    if not frames:
        return pd.DataFrame()
    df = pd.concat(frames, ignore_index=True)
    chapter = df.chapter if "chapter" in df else pd.Series("", index=df.index)
    own = pd.Series([chapter_of_stage(e) for e in df.engine], index=df.index) == chapter
    df = df.assign(own=own).sort_values("own", kind="stable")  # its own chapter's run last
    return df.drop_duplicates(["device_name", "model", "engine", "batch_size"], keep="last")


def speed_of_light_table(chapters: tuple[str, ...] = ("01", "02", "03", "04", "06", "07")
                         ) -> pd.DataFrame:
    """Each stage's % of the decode floor per device and batch size, from the chapters'
    recorded benchmarks (a stage measured in several chapters: :func:`one_row_per_stage`).

    Runs recorded before the device table measured their own copy bandwidth, which varies from
    run to run on a shared machine; so that runs of different chapters compare, each row's
    share is rescaled to one bandwidth per device: the device table's (``devices.csv``) where
    it has the device, else the median of its runs' (the share is bytes per step / bandwidth /
    step time, so it scales with 1 / bandwidth; a compute-bound floor is not rescaled)."""
    df = one_row_per_stage(chapters)
    if df.empty:
        return df
    # One bandwidth per run (a run's rows share it), then the median over a device's runs.
    per_run = df.drop_duplicates(["device_name", "bandwidth_gbs"])
    device_bandwidth = df.device_name.map(per_run.groupby("device_name").bandwidth_gbs.median())
    table = device_table()
    if not table.empty:
        # A device is its name and instruction set: one name here was two hosts, 49 and 16 GB/s.
        # Rows read back name a CPU with its set already (read_results): either form is found.
        isa = df.isa if "isa" in df else pd.Series("", index=df.index)
        rows = pd.MultiIndex.from_arrays([df.device_name, isa])
        named = pd.concat([table, table.assign(name=with_isa(table.name, table.isa))])
        recorded = pd.Series(named.set_index(["name", "isa"]).bandwidth_gbs.reindex(rows)
                             .to_numpy(), index=df.index)
        device_bandwidth = recorded.fillna(device_bandwidth)
    compute_bound = (df.floor_bound.eq("compute") if "floor_bound" in df
                     else pd.Series(False, index=df.index))
    df = df.assign(pct_of_floor=df.pct_of_floor.where(
        compute_bound, df.pct_of_floor * df.bandwidth_gbs / device_bandwidth))
    return tok_s_table(df, "pct_of_floor")


def this_device_or_live(lm, p: Preset, engines: dict | None = None,
                        suffix: str = "") -> tuple[pd.DataFrame, str]:
    """The chapter's benchmark on this machine ("your machine"). With the full preset, the CSV
    the reader's ``make chapter-NN`` has just written for this device
    (``data/yours/chNN/<device><suffix>.csv``) is shown as is (re-measuring it would only double
    the wait); otherwise, and when this device has no CSV yet, it is measured now."""
    from ..bench.devices import device_slug, recording_for_book, recording_root
    from ..bench.offline import run_bench

    path = recording_root() / f"ch{p.bench.chapter}" / f"{device_slug(lm.device)}{suffix}.csv"
    if p.name == "full" and path.exists():
        df = read_results(path)
        if df.model.iloc[0] == lm.name:
            # The book's sitting (``repro --for-book``) writes the reference files, not a reader's.
            whose = ("the book's reference recording" if recording_for_book()
                     else f"recorded by your make chapter-{p.bench.chapter}")
            return df, f"{whose} on this device ({df.device_name.iloc[0]}; {path.name})"
    return run_bench(lm, p.bench, engines), "measured live in this notebook"


def your_recordings(chapter: str, pattern: str) -> list[Path]:
    """This machine's own recordings of a chapter (what the reader's ``make chapter-NN`` wrote
    under ``data/yours/chNN/``) matching ``pattern``; when there are none, one line saying how
    to record them. The book's own sitting (``repro --for-book``) lists none: what it records
    is the reference the chapter already shows, not a reader's."""
    from ..bench.devices import recording_for_book, recording_root

    files = [] if recording_for_book() else sorted(
        (recording_root() / f"ch{chapter}").glob(pattern))
    if not files:
        print(f"no recording of yours yet ({pattern}): make chapter-{chapter} records one")
    return files


def recorded_rows(chapters: list[str]) -> pd.DataFrame:
    """Every row of the chapters' recorded CSVs (benchmarks, profiles, serving runs), in one
    frame (empty where none is recorded)."""
    files = [p for chapter in chapters for p in sorted((RESULTS / f"ch{chapter}").rglob("*.csv"))]
    return pd.concat([read_results(p) for p in files], ignore_index=True) if files \
        else pd.DataFrame()


def device_names(rows: pd.DataFrame) -> list[str]:
    """The device names in ``rows``, in order of first appearance."""
    return list(dict.fromkeys(rows.get("device_name", pd.Series(dtype=str)).dropna()))


def recorded_devices(chapter: str) -> list[str]:
    """Device names with any recorded CSV for a chapter (benchmarks, profiles, serving runs)."""
    return device_names(recorded_rows([chapter]))


# The chapters whose benchmarks compare engine stages with hf (batch 1, 4, 8).
STAGE_CHAPTERS = ("01", "02", "03", "04", "06", "07")


def stage_results(chapters: tuple[str, ...] = STAGE_CHAPTERS) -> pd.DataFrame:
    """Every stage's % of hf and % of the speed of light per recorded device and batch size,
    one row each (:func:`one_row_per_stage`; its % of the floor rescaled to one bandwidth per
    device as in :func:`speed_of_light_table`)."""

    df = one_row_per_stage(chapters)
    if df.empty:
        return df
    floor = speed_of_light_table(chapters).stack().rename("pct_of_floor").reset_index()
    df = df.drop(columns="pct_of_floor").merge(
        floor, on=["device_name", "model", "dtype", "batch_size", "engine"], how="left")
    df["stage_chapter"] = [chapter_of_stage(e) for e in df.engine]
    df["is_baseline"] = df.engine != "hf"  # False sorts first: hf leads its chapter's stages
    df = df.sort_values(["device_name", "stage_chapter", "is_baseline"], kind="stable")
    return df[["device_name", "model", "dtype", "stage_chapter", "engine", "chapter",
               "batch_size", "pct_of_hf", "pct_of_floor"]].reset_index(drop=True)


def recorded_runs() -> pd.DataFrame:
    """One row per recorded results file: chapter, file, and the device, model, software and
    commit of the run that wrote it (every commit and date in the order met, where one of its
    experiments was recorded again on its own)."""
    columns = ["device_name", "isa", "model", "dtype", "torch", "transformers", "git_sha", "date"]
    rows = []
    for path in sorted([*RESULTS.glob("ch*/**/*.csv"), *RESULTS.glob("ch*/**/*.csv.gz")]):
        table = read_results(path)
        row = {c: table[c].iloc[0] if c in table else "" for c in columns}
        for c in ("git_sha", "date"):
            if c in table:
                row[c] = ", ".join(table[c].dropna().astype(str).unique())
        rows.append({"chapter": path.relative_to(RESULTS).parts[0][2:],
                     "file": str(path.relative_to(RESULTS)), **row})
    return pd.DataFrame(rows)
