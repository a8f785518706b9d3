"""The analysis tables the chapters show, computed from their recorded CSVs."""

from __future__ import annotations

import pandas as pd

SWEEP_PHASES = ("gather_batch_kv", "build_cache", "write_decode_kv", "model_forward")


def host_split(bars: pd.DataFrame) -> pd.DataFrame:
    """Per engine, from timeline bars: the mean decode step as the host sees it, the forward in
    it, the host bookkeeping (the rest of the step: inputs, sampling, waiting for tokens, and
    what no range covers) and the gap between one step's end and the next one's start. Where
    the bars have a ``device`` lane (a GPU), also the kernels' busy time per step and
    ``device_busy_pct``, the share of the steps' window (first start to last end) in which
    some kernel ran: on a GPU the host's split says little, since a step's launches return
    before its kernels finish; whether the queue runs dry is this share."""
    rows = []
    for engine, group in bars[bars.lane == "host"].groupby("engine", sort=False):
        steps = group[group.name == "decode_step"].sort_values("start_ms")
        total = steps.dur_ms.sum()
        forward = group[group.name == "model_forward"].dur_ms.sum()
        gaps = (steps.start_ms.iloc[1:].to_numpy()
                - (steps.start_ms + steps.dur_ms).iloc[:-1].to_numpy())
        row = {"engine": engine, "steps": len(steps), "step_ms": total / len(steps),
               "forward_ms": forward / len(steps),
               "bookkeeping_ms": (total - forward) / len(steps),
               "bookkeeping_pct": 100 * (total - forward) / total,
               "between_steps_ms": gaps.mean() if len(gaps) else float("nan")}
        kernels = bars[(bars.engine == engine) & (bars.lane == "device")]
        if len(kernels):
            start, end = steps.start_ms.min(), (steps.start_ms + steps.dur_ms).max()
            busy = _covered_ms(kernels.start_ms, kernels.start_ms + kernels.dur_ms, start, end)
            row |= {"device_busy_ms": busy / len(steps), "device_busy_pct": 100 * busy / (end - start)}
        rows.append(row)
    return pd.DataFrame(rows).set_index("engine")


def _covered_ms(starts: pd.Series, ends: pd.Series, lo: float, hi: float) -> float:
    """How much of [lo, hi] the union of the intervals covers (kernels may overlap)."""
    covered, reach = 0.0, lo
    for start, end in sorted(zip(starts.clip(lo, hi), ends.clip(lo, hi), strict=True)):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered


# -- "% of hf": two figures, one conclusion -------------------------------------------------

def hf_verdict(pct_min: float, pct_max: float) -> str:
    """What a run can conclude about an engine against hf from its per-repeat ratios (each a
    paired tok/s ratio of runs seconds apart): ``faster`` where every repeat favoured the
    engine, ``slower`` where every repeat favoured hf, else ``within noise``."""
    if pct_min != pct_min or pct_max != pct_max:  # NaN: a run from before ranges were kept
        return "unknown (no per-repeat range)"
    return "faster" if pct_min > 100 else "slower" if pct_max < 100 else "within noise"


def hf_ratio_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per device, engine and batch size, the two ways of setting an engine beside hf:

    * ``pct_of_hf`` (the benchmark's column): the **median of the per-repeat ratios**, each
      repeat's tok/s over hf's tok/s in the same round;
    * ``tok_s_pct_of_hf``: the **ratio of the medians**, the engine's median tok/s over hf's.

    They differ because a median of ratios is not a ratio of medians: on a machine whose speed
    drifts between rounds, the round in which hf ran fastest need not be the one in which the
    engine did. ``verdict`` is what the run concludes (:func:`hf_verdict`), and ``agree`` says
    that neither figure points the other way: where the verdict is ``faster`` (``slower``)
    both are above (below) 100%; ``within noise`` agrees with either side."""
    rows = []
    for (device, batch), dev in df.groupby(["device_name", "batch_size"], sort=False):
        hf = dev.loc[dev.engine == "hf", "tok_s"]
        for _, r in dev.iterrows():
            ratio = 100 * r.tok_s / hf.iloc[0] if len(hf) else float("nan")
            verdict = hf_verdict(r.get("pct_of_hf_min", float("nan")),
                                 r.get("pct_of_hf_max", float("nan")))
            agree = {"faster": r.pct_of_hf > 100 and ratio > 100,
                     "slower": r.pct_of_hf < 100 and ratio < 100}.get(verdict, True)
            rows.append({"device_name": device, "batch_size": batch, "engine": r.engine,
                         "tok_s": r.tok_s, "pct_of_hf": r.pct_of_hf,
                         "pct_of_hf_min": r.get("pct_of_hf_min", float("nan")),
                         "pct_of_hf_max": r.get("pct_of_hf_max", float("nan")),
                         "tok_s_pct_of_hf": ratio, "verdict": verdict, "agree": agree})
    return pd.DataFrame(rows).set_index(["device_name", "batch_size", "engine"])


# -- chapter 10: what HTTP costs -------------------------------------------------------------

def server_cost_table(cost: pd.DataFrame) -> pd.DataFrame:
    """Chapter 10's server-cost recording (one request at a time, the same prompt in-process and
    over HTTP): per device and mode (streamed or not), the p50 and p99 over requests of the
    difference HTTP minus in-process, for the time to first token (streamed) and the whole
    request."""
    rows = []
    for (name, mode), dev in cost.groupby(["device_name", "mode"], sort=False):
        row = {"device_name": name, "mode": mode, "requests": len(dev)}
        for metric in ("ttft_ms", "e2e_ms"):
            if dev[f"http_{metric}"].notna().any():
                diff = dev[f"http_{metric}"] - dev[f"in_process_{metric}"]
                row[f"{metric} p50 diff"] = diff.median()
                row[f"{metric} p99 diff"] = diff.quantile(0.99)
        rows.append(row)
    return pd.DataFrame(rows).set_index(["device_name", "mode"])


# -- chapter 02: the memory paging saves ------------------------------------------------------

# A batch of mixed total lengths (prompt + output, tokens), as a server holds at once.
MIXED_LENGTHS = (23, 57, 91, 130, 177, 212, 268, 344)


def kv_reservation(lengths: tuple[int, ...], bytes_per_token: int, block_size: int = 16
                   ) -> pd.DataFrame:
    """K/V bytes a batch of requests of these lengths holds: what its tokens need (``used``),
    what HF's contiguous cache reserves (one dense ``[batch, longest]`` tensor per layer, every
    row padded to the longest request) and what a paged pool reserves (whole blocks, at most
    one partly filled per request); fragmentation is the reserved share no token uses."""
    used = sum(lengths) * bytes_per_token
    reserved = {"HF contiguous cache (padded to the longest)": len(lengths) * max(lengths),
                f"paged pool (blocks of {block_size})":
                    sum(-(-n // block_size) * block_size for n in lengths)}
    return pd.DataFrame([{"cache": name, "reserved_tokens": tokens,
                          "reserved_MiB": tokens * bytes_per_token / 2**20,
                          "used_MiB": used / 2**20,
                          "fragmentation_pct": 100 * (1 - used / (tokens * bytes_per_token))}
                         for name, tokens in reserved.items()]).set_index("cache")
