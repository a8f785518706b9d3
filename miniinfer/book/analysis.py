"""The analysis sentences and tables the chapters print, computed from their recorded CSVs."""

from __future__ import annotations

import pandas as pd

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
