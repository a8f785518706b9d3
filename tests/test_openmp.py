"""core.openmp: a thread that ran parallel torch ops gives its OpenMP workers back, so that a
process serving from another thread holds one team (see the module's docstring)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from miniinfer.core.openmp import _openmp_runtime, release_openmp_threads

TASKS = Path(f"/proc/{os.getpid()}/task")

# What watching a team's threads come and go needs (the callers' tests need none of it).
_CANNOT_WATCH = ("reads the process's threads from /proc" if not TASKS.exists()
                 else "one torch thread runs no team" if torch.get_num_threads() < 2
                 else "no OpenMP runtime with omp_pause_resource_all in this torch"
                 if _openmp_runtime() is None else None)
watches_threads = pytest.mark.skipif(_CANNOT_WATCH is not None, reason=str(_CANNOT_WATCH))


def _thread_ids() -> set[int]:
    return {int(task.name) for task in TASKS.iterdir()}


def _parallel_op() -> None:
    torch.ones(1 << 22).mul_(2).sum()  # far past ATen's grain size: an OpenMP region


def _gone(ids: set[int], deadline_s: float = 30.0) -> bool:
    """Whether every thread in ``ids`` has exited (released workers leave their barrier before
    the kernel reaps them, so this waits for that, up to a deadline)."""
    deadline = time.monotonic() + deadline_s
    while ids & _thread_ids():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@watches_threads
def test_a_thread_gives_its_team_back_and_gets_a_new_one_when_it_needs_it():
    """Thread ids, not counts: other tests' threads may come and go meanwhile."""
    seen: dict[str, set[int]] = {}
    released: list[bool] = []

    def in_a_new_thread() -> None:
        before = _thread_ids()
        _parallel_op()
        seen["team"] = _thread_ids() - before
        released.append(release_openmp_threads())
        seen["gone"] = seen["team"] if _gone(seen["team"]) else set()
        before = _thread_ids()
        _parallel_op()
        seen["new team"] = _thread_ids() - before
        release_openmp_threads()

    thread = threading.Thread(target=in_a_new_thread)
    thread.start()
    thread.join()
    assert seen["team"], "the thread's first region started no workers of its own"
    assert released == [True]
    assert seen["gone"] == seen["team"], "released workers still running"
    assert seen["new team"], "the next region found no workers"


@watches_threads
def test_releasing_without_a_team_or_twice_is_harmless():
    assert release_openmp_threads() is True  # the test's own thread, with or without a team
    assert release_openmp_threads() is True  # nothing left to release: still fine
    _parallel_op()  # and torch keeps working


def _recording_release(calls: list, thread_busy) -> object:
    """A stand-in for release_openmp_threads that records the calling thread and whether the
    thread it makes way for (``thread_busy()``) was already running."""
    def release() -> bool:
        calls.append((threading.current_thread(), thread_busy()))
        return True
    return release


def test_the_server_releases_the_loading_threads_team_before_its_loop_starts(monkeypatch):
    from miniinfer.core.config import EngineConfig
    from miniinfer.server import engine_loop

    idle_engine = SimpleNamespace(has_unfinished_requests=lambda: False,
                                  kv_cache=SimpleNamespace(block_manager=object()),
                                  config=EngineConfig())
    loop = engine_loop.EngineLoop(idle_engine, None, max_waiting=1)
    calls: list = []
    monkeypatch.setattr(engine_loop, "release_openmp_threads",
                        _recording_release(calls, loop._thread.is_alive))
    loop.start()
    loop.stop(timeout=30)
    assert not loop._thread.is_alive()
    assert calls == [(threading.current_thread(), False)], \
        "the starting thread must give its team back before the loop thread runs"


def test_the_serving_benchmark_releases_the_main_threads_team_before_every_run(tiny, monkeypatch):
    from miniinfer.bench.serving import (
        ServingBenchConfig,
        WorkloadConfig,
        benchmark,
        run_serving_bench,
    )

    calls: list = []
    monkeypatch.setattr(benchmark, "release_openmp_threads",
                        _recording_release(calls, lambda: None))
    workload = WorkloadConfig(num_requests=2, prompt_len=(4, 8), output_len=(2, 3))
    results = run_serving_bench(tiny, ServingBenchConfig(
        workload, ("continuous",), max_num_batched_tokens=(16, 32)), progress=False)
    assert len(results.runs) == 2
    assert [thread for thread, _ in calls] == [threading.current_thread()] * 2
