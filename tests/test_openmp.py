"""core.openmp: a thread that ran parallel torch ops gives its OpenMP workers back, so that a
process serving from another thread holds one team (see the module's docstring)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from miniinfer.core.openmp import _openmp_runtime, release_openmp_threads

TASKS = Path(f"/proc/{os.getpid()}/task")

pytestmark = [
    pytest.mark.skipif(not TASKS.exists(), reason="reads the process's threads from /proc"),
    pytest.mark.skipif(torch.get_num_threads() < 2, reason="one torch thread runs no team"),
    pytest.mark.skipif(_openmp_runtime() is None,
                       reason="no OpenMP runtime with omp_pause_resource_all in this torch"),
]


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


def test_releasing_without_a_team_or_twice_is_harmless():
    assert release_openmp_threads() is True  # the test's own thread, with or without a team
    assert release_openmp_threads() is True  # nothing left to release: still fine
    _parallel_op()  # and torch keeps working
