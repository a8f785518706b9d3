"""The serving benchmark: every system serves the same seeded workload, one run per system,
request rate and token budget, into three tidy tables (runs, requests, steps)."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from ..devices import run_metadata
from ..errors import InvalidRequestError
from ..models import LoadedModel
from .metrics import request_table, step_table, summarize
from .systems import STEPPED_SYSTEMS, Systems, check_system
from .workloads import WorkloadConfig, make_workload


@dataclass(frozen=True, slots=True)
class ServingBenchConfig:
    """Every system in ``systems`` serves the workload at every rate in ``request_rates``
    (none: the workload's own rate); ``continuous``, ``prefix-cache`` and ``hf-cb`` once per
    token budget in
    ``max_num_batched_tokens``."""

    workload: WorkloadConfig = WorkloadConfig()
    systems: tuple[str, ...] = ("continuous", "static-paged-attention", "hf-cb")
    request_rates: tuple[float, ...] = ()
    max_num_batched_tokens: tuple[int, ...] = (512,)
    static_batch_size: int = 8
    kv_cache_bytes: int | None = None  # our engine's pool and hf-cb's; None: the default pool
    warmup: bool = True
    chapter: str = "08"

    def __post_init__(self) -> None:
        if not self.systems or not self.max_num_batched_tokens:
            raise InvalidRequestError("need at least one system and one token budget")
        for system in self.systems:
            check_system(system)
        for rate in self.request_rates:
            replace(self.workload, request_rate=rate)  # validates
        if min(self.max_num_batched_tokens) < 1 or self.static_batch_size < 1:
            raise InvalidRequestError("max_num_batched_tokens and static_batch_size must be >= 1")


@dataclass(slots=True)
class ServingResults:
    runs: pd.DataFrame  # one row per system x rate x token budget
    requests: pd.DataFrame  # one row per request of every run
    steps: pd.DataFrame  # one row per step of every continuous run


def run_serving_bench(lm: LoadedModel, config: ServingBenchConfig,
                      progress: bool = True) -> ServingResults:
    """Every planned run after a short warm-up of its system; arrivals and lengths come from
    the same seed for every system, so each serves exactly the same requests."""
    meta = run_metadata(lm.device)
    tags = {"chapter": config.chapter, "model": lm.name,
            "dtype": str(lm.dtype).removeprefix("torch.")}
    budgets = config.max_num_batched_tokens
    rates = config.request_rates or (config.workload.request_rate,)
    plan = [(rate, system, budget) for system in config.systems
            for budget in (budgets if system in (*STEPPED_SYSTEMS, "hf-cb") else [0])
            for rate in rates]
    small = config.workload.turns if config.workload.kind == "multi-turn" else 4
    warmup = [replace(w, max_new_tokens=4, arrival_s=0.0) for w in make_workload(
        lm, replace(config.workload, num_requests=small, request_rate=math.inf))]
    systems = Systems(lm, config)
    runs, requests, steps = [], [], []
    # Every system serves from a worker thread, because transformers' continuous batching
    # always runs its loop in one: on our CPU machine PyTorch's matrix multiplies run
    # differently in the main thread than in others (like one thread; faster when the cores
    # are contended, slower when they are free), and a comparison must not hinge on that.
    with ThreadPoolExecutor(max_workers=1) as worker:
        for rate, system, budget in tqdm(plan, desc="bench-serving", disable=not progress,
                                         leave=False):
            if config.warmup:
                worker.submit(systems.serve, system, budget or budgets[0], warmup).result()
            workload = make_workload(lm, replace(config.workload, request_rate=rate))
            run = worker.submit(systems.serve, system, budget or budgets[0], workload).result()
            run_tags = {**tags, "system": system, "request_rate": rate,
                        "max_num_batched_tokens": budget or math.nan}
            runs.append({**run_tags, **summarize(run)})
            requests.append(request_table(run, workload).assign(**run_tags))
            if run.steps:
                steps.append(step_table(run).assign(**run_tags))
    w = config.workload
    workload_cols = {"num_requests_config": w.num_requests,
                     "prompt_len_range": f"{w.prompt_len[0]}-{w.prompt_len[1]}",
                     "output_len_range": f"{w.output_len[0]}-{w.output_len[1]}",
                     "dataset": Path(w.dataset).name if w.dataset else "", "seed": w.seed,
                     "workload": w.kind,
                     "shared_prefix_len": w.shared_prefix_len if w.kind == "shared-prefix" else 0,
                     "turns": w.turns if w.kind == "multi-turn" else 1,
                     "static_batch_size": config.static_batch_size}
    return ServingResults(
        pd.DataFrame(runs).assign(**workload_cols, **meta),
        pd.concat(requests, ignore_index=True).assign(**meta),
        pd.concat(steps, ignore_index=True).assign(**meta) if steps else pd.DataFrame())


def summary_table(runs: pd.DataFrame) -> pd.DataFrame:
    """The compact view printed after a run."""
    cols = ["system", "request_rate", "max_num_batched_tokens", "output_throughput",
            "request_throughput", "ttft_p50_ms", "tpot_p50_ms", "itl_p99_ms", "e2e_p50_ms",
            "prefix_cache_hit_rate"]
    return runs[cols].round(2).reset_index(drop=True)
