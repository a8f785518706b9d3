"""The serving benchmark: every system serves the same seeded workload, one run per system,
request rate and token budget (``repeats`` rounds of them), into three tidy tables (runs,
requests, steps)."""

from __future__ import annotations

import ctypes
import math
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import pandas as pd
from tqdm.auto import tqdm

from ...core.errors import InvalidRequestError, keep_on_interrupt
from ...core.models import LoadedModel, dtype_name
from ...core.openmp import release_openmp_threads
from ..devices import LoadGuard, run_metadata
from ..offline import own_threads
from ..peers import VLLM
from .metrics import request_table, step_table, summarize
from .systems import STEPPED_SYSTEMS, Systems, check_system
from .workloads import WorkloadConfig, check_workload, make_workload

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ServingBenchConfig:
    """Every system in ``systems`` serves the workload at every rate in ``request_rates``
    (none: the workload's own rate); ``continuous``, ``prefix-cache`` and ``hf-cb`` once per
    token budget in
    ``max_num_batched_tokens``. With ``repeats`` above 1 the whole plan runs that many rounds,
    one after another, each system's engine kept between them: on a shared 2-core machine one
    system's runs of chapter 08's target workload took from 26.0 to 34.2 s over two
    recordings (our compiled stage on a Zen 3), so two systems are compared by the medians of
    runs taken in turn (:func:`~.metrics.median_of_repeats`), not by one run each."""

    workload: WorkloadConfig = WorkloadConfig()
    systems: tuple[str, ...] = ("continuous", "static-paged-attention", "hf-cb")
    request_rates: tuple[float, ...] = ()
    max_num_batched_tokens: tuple[int, ...] = (512,)
    static_batch_size: int = 8
    kv_cache_bytes: int | None = None  # our engine's pool and hf-cb's; None: the default pool
    warmup: bool = True
    chapter: str = "08"
    tensor_parallel: int | None = None  # the stepped systems' runners (None: their default)
    repeats: int = 1  # rounds of the whole plan; each run's row says its round (``repeat``)

    def __post_init__(self) -> None:
        if not self.systems or not self.max_num_batched_tokens:
            raise InvalidRequestError("need at least one system and one token budget")
        if self.repeats < 1:
            raise InvalidRequestError(f"repeats must be >= 1, got {self.repeats}")
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


class _Worker:
    """One worker thread that serves, and that Ctrl-C reaches: Python delivers SIGINT to the
    main thread only, so on KeyboardInterrupt there the same exception is raised in the worker,
    where it lands at its next Python bytecode, within a step (not after the whole run, which
    the main thread would otherwise have to wait for)."""

    def __init__(self, executor: ThreadPoolExecutor) -> None:
        self.executor = executor
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)  # notified when a call ends
        self.busy_thread: int | None = None  # the worker's id while it runs a call
        self.interrupted = False  # Ctrl-C came before the worker started the call

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        with self.lock:
            if self.interrupted:
                raise KeyboardInterrupt
            self.busy_thread = threading.get_ident()
        try:
            return fn(*args)
        finally:
            # An interrupt sent before the worker is marked idle lands in here at the latest,
            # never later in the executor's own loop; one landing here is the same Ctrl-C.
            while True:
                try:
                    with self.lock:
                        self.busy_thread = None
                        self.idle.notify_all()
                    break
                except KeyboardInterrupt:
                    continue

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        self.interrupted = False
        try:  # from the submit on: Ctrl-C may land after the call is queued
            return self.executor.submit(self._call, fn, *args).result()
        except KeyboardInterrupt:
            with self.lock:
                if self.busy_thread is None:  # not started yet: it must not start, or the
                    self.interrupted = True  # executor waits for all of it
                # Raised in the worker again each second until the call has ended: one that
                # lands while the worker runs a finalizer (a __del__, a weakref callback) is
                # only printed there, and the run would go on. Waited for by the worker's own
                # state, not the future: Ctrl-C can land inside ``submit`` after the call has
                # started, before the future is returned (a CI run's bench-serving then went
                # on for the 10 minutes the test allows).
                while self.busy_thread is not None:
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(
                        ctypes.c_ulong(self.busy_thread), ctypes.py_object(KeyboardInterrupt))
                    self.idle.wait(timeout=1.0)
            raise


def run_serving_bench(lm: LoadedModel, config: ServingBenchConfig,
                      progress: bool = True) -> ServingResults:
    """Every planned run after a short warm-up of its system; arrivals and lengths come from
    the same seed for every system, so each serves exactly the same requests. Every workload is
    checked against the model before the first run. Ctrl-C stops within a step and raises
    ``Interrupted`` holding the runs that had finished (None when none had)."""
    meta = run_metadata(lm.device)
    tags = {"chapter": config.chapter, "model": lm.name,
            "dtype": dtype_name(lm.dtype)}
    budgets = config.max_num_batched_tokens
    rates = config.request_rates or (config.workload.request_rate,)
    workloads = {rate: make_workload(lm, replace(config.workload, request_rate=rate))
                 for rate in rates}
    for workload in workloads.values():
        check_workload(lm, workload)
    # At each token budget every system takes its turn before the next budget: on a drifting
    # host two systems' runs at one budget are then minutes apart, not a whole sweep (a
    # 2-core Xeon's vLLM, run after all of our compiled stage's budgets, made 44.1-54.6 output
    # tokens/s at 32-128 tokens and 143.1-149.8 at 256-512). A system without a budget serves
    # once, in the first budget's turn; a system's rates stay back to back (one engine each).
    budgeted = {s for s in config.systems if s in (*STEPPED_SYSTEMS, "hf-cb", VLLM)}
    plan = [(repeat, rate, system, budget if system in budgeted else 0)
            for repeat in range(config.repeats) for budget in budgets
            for system in config.systems if system in budgeted or budget == budgets[0]
            for rate in rates]
    small = config.workload.turns if config.workload.kind == "multi-turn" else 4
    warmup = [replace(w, max_new_tokens=4, arrival_s=0.0) for w in make_workload(
        lm, replace(config.workload, num_requests=small, request_rate=math.inf))]
    # Over several rounds every engine is kept (rebuilding a compiled one, or starting the
    # peer, costs minutes); over one, each goes before the next is built.
    systems = Systems(lm, config.kv_cache_bytes, config.static_batch_size, config.tensor_parallel,
                      keep_engines=config.repeats > 1)
    runs, requests, steps = [], [], []
    # Every system serves from a worker thread, because transformers' continuous batching
    # always runs its loop in one, and a comparison must not hinge on which thread steps a
    # model. Before each run the main thread, which loaded the model, gives its OpenMP team
    # back: a second team beside the stepping thread's makes both sleep between parallel
    # regions (core.openmp; releasing it took our compiled stage's served throughput from
    # 97.8 to 106.6 output tokens/s on a 2-core Zen 3).
    with (keep_on_interrupt(lambda: _results(config, meta, runs, requests, steps) if runs
                            else None),
          ThreadPoolExecutor(max_workers=1) as executor):
        worker = _Worker(executor)
        # The last engine is let go in the worker thread that built it (a tensor-parallel
        # runner's processes are tied to that thread).
        executor_close = executor.submit
        for repeat, rate, system, budget in tqdm(plan, desc="bench-serving", disable=not progress,
                                         leave=False):
            release_openmp_threads()
            if config.warmup:
                worker.run(systems.serve, system, budget or budgets[0], warmup)
            with LoadGuard(own_threads(lm)) as load:
                run = worker.run(systems.serve, system, budget or budgets[0], workloads[rate])
            load.warn(f"{system} at {rate} req/s")
            run_tags = {**tags, "system": system, "request_rate": rate,
                        "max_num_batched_tokens": budget or math.nan, "repeat": repeat}
            runs.append({**run_tags, **summarize(run), **load.columns(),
                         "peer_version": run.peer_version})
            requests.append(request_table(run, workloads[rate]).assign(**run_tags))
            if run.steps:
                steps.append(step_table(run).assign(**run_tags))
        executor_close(systems.close).result()
    return _results(config, meta, runs, requests, steps)


def _results(config: ServingBenchConfig, meta: dict[str, str | int], runs: list[dict],
             requests: list[pd.DataFrame], steps: list[pd.DataFrame]) -> ServingResults:
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
    cols = ["system", *(["repeat"] if runs.get("repeat", pd.Series([0])).nunique() > 1 else []),
            "request_rate", "max_num_batched_tokens", "output_throughput",
            "request_throughput", "ttft_p50_ms", "tpot_p50_ms", "itl_p99_ms", "e2e_p50_ms",
            "prefix_cache_hit_rate"]
    return runs[cols].round(2).reset_index(drop=True)
