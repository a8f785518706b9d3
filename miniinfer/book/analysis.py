"""The analysis sentences and tables the chapters print, computed from their recorded CSVs."""

from __future__ import annotations

import pandas as pd

SWEEP_PHASES = ("gather_batch_kv", "build_cache", "write_decode_kv", "model_forward")


def context_phase_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per device, engine and context length: the plain decode step and the profiled run's ms
    per step in each phase (phases an engine does not have are left blank)."""
    cols = ["step_ms", "pct_of_hf"] + [f"{p}_ms" for p in SWEEP_PHASES if f"{p}_ms" in df] \
        + [c for c in ("attention_gather_ms", "unlabelled_ms") if c in df]
    return df.set_index(["device_name", "engine", "context_len"])[cols].round(1)


def context_sentences(df: pd.DataFrame) -> list[str]:
    """What a context sweep shows, as sentences computed from it: each engine's decode step from
    the shortest to the longest context, and the paged stages' K/V bookkeeping (gather + build +
    write, profiled, plus the block gather a reference paged attention does inside the forward
    where the sweep recorded it) over the same range."""
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
                gather = rows.get("attention_gather_ms")
                in_forward = gather is not None and gather.notna().all()
                if in_forward:
                    kv = kv + gather
                line += (f"; K/V bookkeeping {kv[short]:.1f} -> {kv[long]:.1f} ms per profiled "
                         f"step ({100 * kv[long] / rows.profiled_step_ms[long]:.0f}% of it at "
                         f"{long})")
                if in_forward and gather[long] > 0:
                    line += (f", of which the attention's in-forward block gather "
                             f"{gather[short]:.1f} -> {gather[long]:.1f} ms")
                elif not in_forward and engine.startswith("paged-attention"):
                    line += (" (the engine's K/V write only: this sweep did not record the "
                             "gather a reference attention does inside the forward)")
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


def hf_ratio_sentences(df: pd.DataFrame, engines: list[str] | None = None) -> list[str]:
    """One line per engine (other than hf) and batch size: both figures and the verdict."""
    table = hf_ratio_table(df).reset_index()
    table = table[table.engine != "hf"]
    if engines is not None:
        table = table[table.engine.isin(engines)]
    lines = []
    for r in table.itertuples():
        spread = ("" if r.pct_of_hf_min != r.pct_of_hf_min
                  else f" [{r.pct_of_hf_min:.0f}-{r.pct_of_hf_max:.0f}]")
        said = {"faster": f"every repeat favoured {r.engine}", "slower": "every repeat favoured hf",
                "within noise": "the repeats disagree: within noise"}.get(r.verdict, r.verdict)
        lines.append(f"{r.device_name}, batch {r.batch_size}: {r.engine} at {r.pct_of_hf:.0f}%"
                     f"{spread} of hf (median of per-repeat ratios), {r.tok_s_pct_of_hf:.0f}% as "
                     f"a ratio of median tok/s: {said}")
    return lines


# -- chapter 01: the step against both roofs ------------------------------------------------

# A roof "binds" when the measured step is within this factor of it: the step is then mostly
# the roof's resource, and more of that resource is what would make it faster.
BINDS_WITHIN = 1.5


def roof_sentences(df: pd.DataFrame, engine: str = "hf") -> list[str]:
    """Per device and batch size: ``engine``'s measured decode step against the floor's memory
    roof (bytes / bandwidth) and compute roof (FLOPs / peak), and whether either binds."""
    lines = []
    for name, dev in df[df.engine == engine].groupby("device_name", sort=False):
        for r in dev.sort_values("batch_size").itertuples():
            over_memory = r.step_ms / r.floor_memory_ms
            over_compute = r.step_ms / r.floor_compute_ms
            binding = [roof for roof, over in (("memory", over_memory), ("compute", over_compute))
                       if over <= BINDS_WITHIN]
            verdict = (f"the {' and '.join(binding)} roof binds" if binding else
                       "neither roof binds: the step runs far below both")
            lines.append(f"{name}, batch {r.batch_size}: {engine}'s step {r.step_ms:.1f} ms is "
                         f"{over_memory:.1f}x the memory roof ({r.floor_memory_ms:.1f} ms) and "
                         f"{over_compute:.1f}x the compute roof ({r.floor_compute_ms:.1f} ms): "
                         f"{verdict}")
    return lines


def step_growth_sentence(df: pd.DataFrame, engine: str = "hf") -> list[str]:
    """Per device: how ``engine``'s decode step grows from the smallest to the largest batch,
    and any point where a larger batch took less time (drift, not physics)."""
    lines = []
    for name, dev in df[df.engine == engine].groupby("device_name", sort=False):
        steps = dev.set_index("batch_size").step_ms.sort_index()
        first, last = steps.index[0], steps.index[-1]
        lines.append(f"{name}: {engine}'s decode step takes " + ", ".join(
            f"{ms:.1f} ms at batch {b}" for b, ms in steps.items())
            + f": {steps[last] / steps[first]:.2f}x the time for {last // first}x the tokens")
        for a, b in zip(steps.index, steps.index[1:], strict=False):
            if steps[a] > steps[b]:
                lines.append(f"  batch {a}'s step ({steps[a]:.1f} ms) is slower than batch {b}'s "
                             f"({steps[b]:.1f} ms): more work cannot take less time, so this is "
                             "the machine's drift between the two; read ratios within a batch")
    return lines


# -- chapters 08-10: serving runs ------------------------------------------------------------

def trend(values: pd.Series) -> str:
    """``rises``, ``falls`` or ``not monotonic`` along the series' own order (equal neighbours
    count as neither a rise nor a fall)."""
    steps = values.diff().dropna()
    if (steps >= 0).all():
        return "rises"
    if (steps <= 0).all():
        return "falls"
    return "not monotonic"


METRIC_NAMES = {"output_throughput": ("output tokens/s", "{:.1f}"),
                "ttft_p50_ms": ("TTFT p50", "{:.0f} ms"), "tpot_p50_ms": ("TPOT p50", "{:.0f} ms"),
                "itl_p99_ms": ("ITL p99", "{:.0f} ms"), "e2e_p50_ms": ("e2e p50", "{:.0f} ms")}


def trend_sentences(runs: pd.DataFrame, x: str, metrics: tuple[str, ...],
                    x_name: str | None = None) -> list[str]:
    """Per device, each metric along ``x`` (sorted): whether it rises, falls or neither, with
    its values, so that no prose has to guess the shape of a sweep."""
    lines = []
    for name, dev in runs.groupby("device_name", sort=False):
        dev = dev.sort_values(x)
        xs = ", ".join(f"{v:g}" for v in dev[x])
        lines.append(f"{name}, {x_name or x} {xs}:")
        for metric in metrics:
            label, fmt = METRIC_NAMES.get(metric, (metric, "{:.1f}"))
            values = dev.set_index(x)[metric]
            lines.append(f"  {label} {trend(values)}: "
                         + " -> ".join(fmt.format(v) for v in values))
    return lines


def experiment_sentences(runs: pd.DataFrame, requests: pd.DataFrame) -> list[str]:
    """What each recorded serving experiment served, from its rows: the systems, the requests
    per run with their prompt and output lengths, the budgets and rates swept, and whether every
    system served the same requests (same count and same summed prompt and output tokens), so
    that a comparison across experiments or systems can say what it compares."""
    lines = []
    for (name, experiment), dev in runs.groupby(["device_name", "experiment"], sort=False):
        reqs = requests[(requests.device_name == name) & (requests.experiment == experiment)]
        per_system = reqs.groupby("system").agg(n=("request", "count"),
                                                prompt=("prompt_len", "sum"),
                                                output=("output_len", "sum"))
        counts = sorted(set(dev.num_requests.astype(int)))
        first = dev.iloc[0]
        what = [f"{'/'.join(map(str, counts))} requests per run"]
        if "prompt_len_range" in dev and isinstance(first.prompt_len_range, str):
            what.append(f"prompts of {first.prompt_len_range} tokens, outputs of "
                        f"{first.output_len_range}")
        if "shared_prefix_len" in dev and first.get("shared_prefix_len", 0) > 0:
            what.append(f"a shared prefix of {int(first.shared_prefix_len)} tokens")
        budgets = sorted(dev.max_num_batched_tokens.dropna().unique())
        if len(budgets) > 1:
            what.append("budgets " + ", ".join(f"{b:g}" for b in budgets))
        rates = sorted(dev.request_rate.unique())
        if len(rates) > 1:
            what.append("rates " + ", ".join(f"{r:g}" for r in rates) + " requests/s")
        systems = list(dict.fromkeys(dev.system))
        same = len(per_system.drop_duplicates()) <= 1
        verdict = ("" if len(systems) == 1 else
                   ": the same requests on every system" if same else
                   ": NOT the same requests on every system")
        lines.append(f"{name}, {experiment}: {', '.join(systems)}; {'; '.join(what)}{verdict}")
    return lines


# -- chapter 10: what HTTP costs -------------------------------------------------------------

# What chapter 10 asks of the server (its notebook states the same two numbers).
HTTP_OVERHEAD_GOAL_MS = 20.0  # server's own cost per request (TTFT), at most


def http_throughput_sentences(runs: pd.DataFrame) -> list[str]:
    """Per device, from chapter 10's rounds of the target workload (in-process and over HTTP,
    alternating): the throughput ratio against its goal, and what the same runs can say about a
    per-request overhead: nothing finer than the round-to-round spread of their TTFT
    difference, which queueing behind the other prompts dominates."""
    lines = []
    for (name, model), dev in runs.groupby(["device_name", "model"], sort=False):
        by_round = dev.pivot_table(index="round", columns="system",
                                   values=["output_throughput", "ttft_p50_ms"])
        ratio = (by_round.output_throughput.http / by_round.output_throughput.continuous).median()
        per_round = by_round.ttft_p50_ms.http - by_round.ttft_p50_ms.continuous
        spread = per_round.max() - per_round.min()
        queued = by_round.ttft_p50_ms.continuous.median()
        lines.append(f"{name} ({model}): over HTTP / in-process output tokens/s {ratio:.2f}, "
                     f"median of {len(by_round)} rounds")
        lines.append("  TTFT p50, HTTP minus in-process, per round: "
                     + ", ".join(f"{v:+.0f} ms" for v in per_round)
                     + f": a spread of {spread:.0f} ms, "
                     + (f"wider than the {HTTP_OVERHEAD_GOAL_MS:.0f} ms a server's own cost should "
                        "stay under, so this workload cannot measure the server's own cost (a "
                        "TTFT here is "
                        f"mostly queueing behind the other prompts: {queued:.0f} ms in-process); "
                        "the one-request-at-a-time measurement below does"
                        if spread > HTTP_OVERHEAD_GOAL_MS else
                        "narrow enough to read the median as the server's cost"))
    return lines


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


def server_cost_sentences(cost: pd.DataFrame) -> list[str]:
    """The server's own cost per request, from :func:`server_cost_table`."""
    lines = []
    for (name, mode), r in server_cost_table(cost).iterrows():
        metric = "ttft_ms" if mode == "stream" else "e2e_ms"
        what = "time to first token" if mode == "stream" else "whole request"
        p50, p99 = r[f"{metric} p50 diff"], r[f"{metric} p99 diff"]
        lines.append(f"{name}, {mode}: HTTP adds {p50:+.1f} ms at p50 and {p99:+.1f} ms at p99 to "
                     f"the {what}, over {int(r.requests)} requests one at a time")
    return lines


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
