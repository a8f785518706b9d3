"""The metrics serving systems are judged by, with the usual definitions (vLLM's
``benchmark_serving``): TTFT = first token - arrival; end-to-end latency = last token - arrival;
TPOT = (latency - TTFT) / (output tokens - 1), per request; ITL = the gaps between a request's
consecutive tokens, pooled over requests; request and output-token throughput over the run's
duration (start to the last finish). Each latency is reported as mean, p50, p90 and p99.
Chapter 09 adds the prefix-cache hit rate: prompt tokens served from the cache / prompt tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

from .systems import ServingRun
from .workloads import WorkloadRequest

LATENCIES = ("ttft", "tpot", "itl", "e2e")
PERCENTILES = (50, 90, 99)


def request_table(run: ServingRun,
                  workload: Sequence[WorkloadRequest] | None = None) -> pd.DataFrame:
    """One row per request: its timeline relative to the run's start (s), its latencies (ms)
    and its prompt tokens found in a prefix cache (NaN: the system does not say); with the
    ``workload``, also each request's conversation and turn."""
    turns = {w.index: (w.conversation, w.turn) for w in workload or ()}
    rows = []
    for r in run.requests:
        t = r.timeline
        n = len(t.token_times)
        e2e = t.finish - t.arrival
        ttft = t.first_token - t.arrival
        rows.append({
            "request": r.index, "prompt_len": r.prompt_len, "output_len": n,
            "arrival_s": t.arrival - run.start, "first_scheduled_s": t.first_scheduled - run.start,
            "first_token_s": t.first_token - run.start, "finish_s": t.finish - run.start,
            "queue_ms": (t.first_scheduled - t.arrival) * 1e3, "ttft_ms": ttft * 1e3,
            "tpot_ms": (e2e - ttft) / (n - 1) * 1e3 if n > 1 else math.nan,
            "e2e_ms": e2e * 1e3, "num_preemptions": r.num_preemptions,
            "cached_tokens": math.nan if r.num_cached_tokens is None else r.num_cached_tokens,
            **(dict(zip(("conversation", "turn"), turns[r.index], strict=True))
               if turns else {}),
        })
    return pd.DataFrame(rows)


def step_table(run: ServingRun) -> pd.DataFrame:
    """Our engine's steps, relative to the run's start: what each forward held."""
    return pd.DataFrame([{
        "step": i, "start_s": s.start - run.start, "end_s": s.end - run.start,
        "num_decodes": s.num_decodes, "num_prefill_tokens": s.num_prefill_tokens,
        "num_preempted": len(s.preempted), "num_blocks_in_use": s.num_blocks_in_use,
        "num_blocks_cached": s.num_blocks_cached,
    } for i, s in enumerate(run.steps)])


def _stats(name: str, values: Sequence[float]) -> dict[str, float]:
    values = np.asarray([v for v in values if not math.isnan(v)], dtype=float)
    if not len(values):
        return {f"{name}_mean_ms": math.nan, **{f"{name}_p{p}_ms": math.nan for p in PERCENTILES}}
    return {f"{name}_mean_ms": float(values.mean()),
            **{f"{name}_p{p}_ms": float(np.percentile(values, p)) for p in PERCENTILES}}


def summarize(run: ServingRun) -> dict[str, float]:
    """The run's throughputs and latency statistics (one row of the results CSV)."""
    table = request_table(run)
    itl = [(b - a) * 1e3 for r in run.requests
           for a, b in zip(r.timeline.token_times, r.timeline.token_times[1:], strict=False)]
    duration = run.end - run.start
    out = {"num_requests": len(table), "output_tokens": int(table.output_len.sum()),
           "duration_s": duration, "request_throughput": len(table) / duration,
           "output_throughput": table.output_len.sum() / duration,
           # NaN unless the system reports every request's cached tokens.
           "prefix_cache_hit_rate": table.cached_tokens.sum(min_count=len(table))
           / table.prompt_len.sum()}
    for name in LATENCIES:
        out |= _stats(name, itl if name == "itl" else table[f"{name}_ms"])
    return out


# What tells one run's identity apart from another's in a runs table (beside the system).
RUN_KEYS = ("experiment", "request_rate", "max_num_batched_tokens")


def median_of_repeats(runs: pd.DataFrame, by: str = "system") -> pd.DataFrame:
    """One row per run in ``runs`` that was repeated (the same ``by`` column, experiment, rate
    and budget, differing only in ``repeat``), in the order first met: each numeric column's
    median over the repeats (a latency percentile: the median of each run's), the rest the
    first run's, plus ``runs`` (how many) and ``output_throughput_min``/``_max``. A table of
    single runs comes back as it was, with ``runs`` 1."""
    keys = [by, *(k for k in RUN_KEYS if k in runs)]
    groups = runs.groupby(keys, sort=False, dropna=False)
    numeric = runs.select_dtypes("number").columns.difference(keys)
    table = groups.first()
    table[numeric] = groups[list(numeric)].median()
    table["runs"] = groups.size()
    table["output_throughput_min"] = groups.output_throughput.min()
    table["output_throughput_max"] = groups.output_throughput.max()
    return table.reset_index().drop(columns="repeat", errors="ignore")
