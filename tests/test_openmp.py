"""core.openmp: a thread that ran parallel torch ops gives its OpenMP workers back, so that a
process serving from another thread holds one team (see the module's docstring)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from miniinfer.core.openmp import _openmp_runtime, release_openmp_threads

TASKS = Path(f"/proc/{os.getpid()}/task")

pytestmark = [
    pytest.mark.skipif(not TASKS.exists(), reason="counts threads through /proc"),
    pytest.mark.skipif(torch.get_num_threads() < 2, reason="one torch thread runs no team"),
    pytest.mark.skipif(_openmp_runtime() is None,
                       reason="no OpenMP runtime with omp_pause_resource_all in this torch"),
]


def _threads() -> int:
    return len(list(TASKS.iterdir()))


def _parallel_op() -> None:
    torch.ones(1 << 22).mul_(2).sum()  # far past ATen's grain size: an OpenMP region


def test_a_thread_gives_its_team_back_and_gets_a_new_one_when_it_needs_it():
    counts: dict[str, int] = {}
    released: list[bool] = []

    def in_a_new_thread() -> None:
        counts["before"] = _threads()
        _parallel_op()
        counts["with its team"] = _threads()
        released.append(release_openmp_threads())
        counts["released"] = _threads()
        _parallel_op()
        counts["again"] = _threads()
        release_openmp_threads()

    thread = threading.Thread(target=in_a_new_thread)
    thread.start()
    thread.join()
    workers = counts["with its team"] - counts["before"]
    assert workers >= 1, counts  # the thread's first region started a team of its own
    assert released == [True]
    assert counts["released"] == counts["before"], counts  # its workers are gone
    assert counts["again"] == counts["with its team"], counts  # and come back when needed


def test_releasing_without_a_team_or_twice_is_harmless():
    assert release_openmp_threads() is True  # the test's own thread, with or without a team
    assert release_openmp_threads() is True  # nothing left to release: still fine
    _parallel_op()  # and torch keeps working
