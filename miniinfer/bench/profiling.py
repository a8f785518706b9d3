"""Trace analysis for chapters 04-07: the engines' decode steps under ``torch.profiler``.

The ranges themselves (``phase``, ``PHASES``) live in ``ranges``, which the engines import;
this module imports the engines, so keeping the two apart avoids an import cycle.

``profile_decode`` runs an engine under ``torch.profiler``, exports the Chrome trace (gzipped,
opens in Perfetto or chrome://tracing) and loads its events into DuckDB, so the questions of the
chapters are plain SQL: which ops ran inside the first ``write_decode_kv`` window, how many
milliseconds each phase takes per step.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pandas as pd
from torch.profiler import ProfilerActivity, profile

from ..core.ranges import PHASES, READ_TOKENS, STEP, phase, ranges_disabled, set_ranges
from ..core.sampling import SamplingParams

__all__ = ["PHASES", "READ_TOKENS", "STEP", "phase", "ranges_disabled", "set_ranges"]

@dataclass(slots=True)
class Trace:
    """A profiled run: its events in a DuckDB table ``events`` and the trace file on disk."""

    events: pd.DataFrame
    path: Path | None
    warmup_steps: int

    def sql(self, query: str, params: list | None = None) -> pd.DataFrame:
        con = duckdb.connect()
        con.register("events", self.events)
        return con.execute(query, params or []).df()


@contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """Hide what C++ code writes straight to file descriptor 2 (the profiler's ``USDT ...
    profiler_start`` lines, which a notebook shows as red noise). Only the profiler's start and
    stop run inside: errors of the profiled code still reach stderr."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def profile_decode(engine, prompts: list[list[int]], steps: int, warmup_steps: int = 2,
                   trace_path: str | Path | None = None, warm: bool = True) -> Trace:
    """Profile one generate of ``warmup_steps + steps`` tokens. The first ``warmup_steps``
    decode windows are kept in the trace but left out of the per-step figures. ``warm``: run
    the same generate once unprofiled first (skip it when the engine has just run these
    shapes: a long prefill is the costly part)."""
    activities = [ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    # +1: the first token comes from prefill, not from a decode step.
    params = SamplingParams(max_new_tokens=warmup_steps + steps + 1, ignore_eos=True)
    if warm:
        engine.generate(prompts, params)  # warm the allocator and kernels outside the trace
    prof = profile(activities=activities)
    with _native_stderr_silenced():
        prof.start()
    try:
        engine.generate(prompts, params)
    finally:
        with _native_stderr_silenced():
            prof.stop()
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        events = json.loads(raw.read_text())["traceEvents"]
        if trace_path is not None:
            trace_path = Path(trace_path)
            trace_path.parent.mkdir(parents=True, exist_ok=True)
            with raw.open("rb") as src, gzip.open(trace_path, "wb") as dst:
                shutil.copyfileobj(src, dst)
    return Trace(_events_frame(events), Path(trace_path) if trace_path else None, warmup_steps)


def load_trace(path: str | Path, warmup_steps: int = 2) -> Trace:
    """A Chrome trace written by :func:`profile_decode` (``.json`` or ``.json.gz``, e.g. the
    recorded ones in ``data/results/ch05/``), ready for the same SQL. ``warmup_steps``: the
    decode windows to leave out of per-step figures (``profile_stages`` records 2)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return Trace(_events_frame(events), path, warmup_steps)


def _events_frame(events: list[dict]) -> pd.DataFrame:
    """The complete events ("X": a name, a start and a duration) of a Chrome trace."""
    return pd.DataFrame([
        {"name": e["name"], "cat": e.get("cat", ""), "ts": float(e["ts"]), "dur": float(e["dur"]),
         "tid": str(e.get("tid")), "pid": str(e.get("pid"))}
        for e in events if e.get("ph") == "X" and "dur" in e
    ])


# Measured decode steps: the step windows after the warm-up ones, numbered from 0.
_STEPS_SQL = """
    WITH steps AS (
        SELECT ts, ts + dur AS te, dur, tid,
               row_number() OVER (ORDER BY ts) - 1 - $warmup AS step
        FROM events WHERE cat = 'user_annotation' AND name = $step_name
    )
"""


def phase_table(trace: Trace) -> pd.DataFrame:
    """CPU ms per decode step for each labelled phase, its share of the step, and what is left
    unlabelled. A phase that runs inside another (``write_decode_kv`` inside ``model_forward``
    when attention writes the cache) names its parent in ``inside`` and is not subtracted again:
    unlabelled time is the step minus the outermost phases only."""
    query = _STEPS_SQL + """
        , measured AS (SELECT * FROM steps WHERE step >= 0),
        ranges AS (
            SELECT e.name, e.ts, e.ts + e.dur AS te, e.dur, e.tid FROM events e JOIN measured s
              ON e.tid = s.tid AND e.ts >= s.ts AND e.ts + e.dur <= s.te
            WHERE e.cat = 'user_annotation' AND e.name IN (SELECT unnest($phases))
        ),
        parents AS (
            SELECT r.name, r.ts, r.dur,
                   (SELECT min(p.name) FROM ranges p
                    WHERE p.tid = r.tid AND p.ts <= r.ts AND p.te >= r.te
                      AND (p.ts, p.te, p.name) <> (r.ts, r.te, r.name)) AS inside
            FROM ranges r
        )
        SELECT name AS phase, sum(dur) / 1e3 / (SELECT count(*) FROM measured) AS ms_per_step,
               coalesce(min(inside), '') AS inside
        FROM parents GROUP BY name
    """
    params = {"warmup": trace.warmup_steps, "step_name": STEP, "phases": list(PHASES)}
    df = trace.sql(query, params)
    step_ms = trace.sql(_STEPS_SQL + "SELECT avg(dur) / 1e3 AS ms FROM steps WHERE step >= 0",
                        {"warmup": trace.warmup_steps, "step_name": STEP}).ms.iloc[0]
    order = {name: i for i, name in enumerate(PHASES)}
    df = df.sort_values("phase", key=lambda s: s.map(order)).reset_index(drop=True)
    unlabelled = step_ms - df.ms_per_step[df.inside == ""].sum()
    df = pd.concat([df, pd.DataFrame([{"phase": "(unlabelled)", "ms_per_step": unlabelled,
                                       "inside": ""},
                                      {"phase": STEP, "ms_per_step": step_ms, "inside": ""}])],
                   ignore_index=True)
    df["share_of_step"] = df.ms_per_step / step_ms
    return df


def ops_in_window(trace: Trace, range_name: str, step: int = 0) -> pd.DataFrame:
    """aten ops inside the ``range_name`` window of measured decode step ``step``: name, count,
    total ms and mean us (nested ops are counted too: ``aten::index_select`` calling
    ``aten::empty`` shows both)."""
    query = _STEPS_SQL + """
        , win AS (
            SELECT r.ts, r.ts + r.dur AS te, r.tid FROM events r JOIN steps s
              ON r.tid = s.tid AND r.ts >= s.ts AND r.ts + r.dur <= s.te
            WHERE s.step = $step AND r.cat = 'user_annotation' AND r.name = $range_name
        )
        SELECT e.name, count(*) AS count, sum(e.dur) / 1e3 AS total_ms, avg(e.dur) AS avg_us
        FROM events e JOIN win w ON e.tid = w.tid AND e.ts >= w.ts AND e.ts + e.dur <= w.te
        WHERE e.cat = 'cpu_op'
        GROUP BY e.name ORDER BY count DESC, total_ms DESC
    """
    return trace.sql(query, {"warmup": trace.warmup_steps, "step_name": STEP, "step": step,
                             "range_name": range_name})


def top_ops(trace: Trace, limit: int = 15, device: bool = False) -> pd.DataFrame:
    """The heaviest operators inside the measured decode steps (CPU, ms per step), or on CUDA
    the heaviest kernels (``device=True``) over the whole profiled run (kernels run on the
    device's own timeline, outside the host's step windows). Prefill and warm-up steps are left
    out of the CPU figures: a one-off cost there would otherwise read as a per-step one."""
    if device:
        return trace.sql(
            "SELECT name, count(*) AS count, sum(dur) / 1e3 AS total_ms FROM events "
            "WHERE cat = 'kernel' GROUP BY name ORDER BY total_ms DESC LIMIT $limit",
            {"limit": limit})
    query = _STEPS_SQL + """
        , measured AS (SELECT * FROM steps WHERE step >= 0)
        SELECT e.name, count(*) / (SELECT count(*) FROM measured) AS count_per_step,
               sum(e.dur) / 1e3 / (SELECT count(*) FROM measured) AS ms_per_step
        FROM events e JOIN measured s ON e.tid = s.tid AND e.ts >= s.ts AND e.ts + e.dur <= s.te
        WHERE e.cat = 'cpu_op'
        GROUP BY e.name ORDER BY ms_per_step DESC LIMIT $limit
    """
    return trace.sql(query, {"warmup": trace.warmup_steps, "step_name": STEP, "limit": limit})


def phase_repeats(lm, engine: str, batch_sizes: tuple[int, ...], prompt_len: int, steps: int,
                  repeats: int, warmup_steps: int = 2) -> pd.DataFrame:
    """:func:`phase_table` of ``engine`` profiled ``repeats`` times at each batch size, the
    repeats interleaved across batch sizes: per batch size and phase the median ms per step,
    its lowest and highest repeat (``ms_min``, ``ms_max``), the median share of the step and
    the ``inside`` of nested phases."""
    from ..engines import make_engine
    from .offline import make_prompts

    eng = make_engine(engine, lm)
    prompts = {b: make_prompts(lm, b, prompt_len) for b in batch_sizes}
    runs = [phase_table(profile_decode(eng, prompts[b], steps, warmup_steps))
            .assign(batch_size=b, repeat=r) for r in range(repeats) for b in batch_sizes]
    df = pd.concat(runs, ignore_index=True)
    agg = df.groupby(["batch_size", "phase"], sort=False).agg(
        ms_per_step=("ms_per_step", "median"), ms_min=("ms_per_step", "min"),
        ms_max=("ms_per_step", "max"), share_of_step=("share_of_step", "median"),
        inside=("inside", "first")).reset_index()
    return agg.assign(engine=engine, repeats=repeats)


def device_phase_ms(trace: Trace) -> pd.DataFrame:
    """On CUDA, the device time of each phase per measured step: kineto mirrors every
    ``record_function`` range on the GPU timeline (category ``gpu_user_annotation``) spanning
    the kernels launched inside it. Empty on CPU."""
    query = """
        WITH spans AS (
            SELECT name, ts, dur, row_number() OVER (PARTITION BY name ORDER BY ts) - 1 AS k
            FROM events WHERE cat = 'gpu_user_annotation'
        ),
        steps AS (SELECT count(*) - $warmup AS n FROM events
                  WHERE cat = 'user_annotation' AND name = $step_name)
        SELECT name AS phase, sum(dur) / 1e3 / (SELECT n FROM steps) AS device_ms_per_step
        FROM spans
        WHERE name IN (SELECT unnest($phases)) AND k >= $warmup
        GROUP BY name
    """
    return trace.sql(query, {"warmup": trace.warmup_steps, "step_name": STEP,
                             "phases": [*PHASES, STEP]})


def timeline(trace: Trace, first_step: int = 0, steps: int = 3) -> pd.DataFrame:
    """``steps`` measured decode steps from ``first_step`` as bars for a Gantt chart: ``lane``
    (``host``: the loop's ranges; ``device``: CUDA kernels, absent on a CPU), ``name``,
    ``start_ms`` (from the first step's start) and ``dur_ms``. Host bars cover the step, its
    phases and the waits for tokens; the time until the next step's start shows what the loop
    does between steps."""
    query = _STEPS_SQL + """
        , win AS (SELECT min(ts) AS t0, max(te) AS t1 FROM steps
                  WHERE step >= $first AND step < $first + $steps)
        SELECT CASE WHEN e.cat = 'kernel' THEN 'device' ELSE 'host' END AS lane, e.name,
               (e.ts - w.t0) / 1e3 AS start_ms, e.dur / 1e3 AS dur_ms
        FROM events e, win w
        WHERE e.ts >= w.t0 AND e.ts < w.t1
          AND ((e.cat = 'user_annotation' AND e.name IN (SELECT unnest($names)))
               OR e.cat = 'kernel')
        ORDER BY lane DESC, start_ms
    """
    return trace.sql(query, {"warmup": trace.warmup_steps, "step_name": STEP,
                             "first": first_step, "steps": steps,
                             "names": [STEP, "prepare_inputs", "model_forward", "sample",
                                       READ_TOKENS]})


@dataclass(slots=True)
class DecodeProfile:
    """Chapter 05's tables for one device (tidy, one row per batch size x item)."""

    phases: pd.DataFrame  # batch_size, phase, ms_per_step, share_of_step[, device_ms_per_step]
    ops: pd.DataFrame  # engine, batch_size, window, name, count, total_ms, avg_us
    top: pd.DataFrame  # batch_size, kind, name; cpu_op: count_per_step, ms_per_step; kernel: count, total_ms
    traces: dict[tuple[str, int], Trace]


def profile_stages(lm, batch_sizes: tuple[int, ...], prompt_len: int, steps: int,
                   warmup_steps: int = 2, engine: str = "paged-prealloc",
                   contrast: str = "paged-loop", trace_dir: Path | None = None,
                   trace_prefix: str = "") -> DecodeProfile:
    """Profile ``engine`` (phases, top ops/kernels) and ``contrast`` (op counts only) at each
    batch size. Traces of ``engine`` are written gzipped to ``trace_dir`` when given."""
    from ..engines import make_engine
    from .offline import make_prompts

    engines = {name: make_engine(name, lm) for name in (engine, contrast)}
    phases, ops, top, traces = [], [], [], {}
    for batch_size in batch_sizes:
        prompts = make_prompts(lm, batch_size, prompt_len)
        for name, eng in engines.items():
            path = None
            if trace_dir is not None and name == engine:
                path = Path(trace_dir) / f"{trace_prefix}{name}-b{batch_size}.json.gz"
            trace = profile_decode(eng, prompts, steps, warmup_steps, trace_path=path)
            traces[name, batch_size] = trace
            for window in ("gather_batch_kv", "build_cache", "write_decode_kv"):
                ops.append(ops_in_window(trace, window).assign(
                    engine=name, batch_size=batch_size, window=window))
            if name != engine:
                continue
            table = phase_table(trace)
            device = device_phase_ms(trace)
            if not device.empty:
                table = table.merge(device, on="phase", how="left")
            phases.append(table.assign(batch_size=batch_size))
            top.append(top_ops(trace, 10).assign(batch_size=batch_size, kind="cpu_op"))
            if lm.device.type == "cuda":
                top.append(top_ops(trace, 10, device=True).assign(batch_size=batch_size,
                                                                   kind="kernel"))
    return DecodeProfile(_tidy(phases, ["batch_size", "phase"]),
                         _tidy(ops, ["engine", "batch_size", "window"]),
                         _tidy(top, ["batch_size", "kind"]), traces)


def _tidy(frames: list[pd.DataFrame], first: list[str]) -> pd.DataFrame:
    df = pd.concat(frames, ignore_index=True)
    return df[first + [c for c in df.columns if c not in first]]


class RangesOff:
    """An engine run with its profiler ranges switched off, for the "zero cost when off"
    benchmark: same engine, same inputs, only the ``record_function`` calls gone."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def generate(self, prompts, params):
        with ranges_disabled():
            return self.engine.generate(prompts, params)
