"""One OpenMP team per process: what a CPU engine stepped from its own thread needs.

PyTorch's CPU kernels (ATen's loops, oneDNN's matmuls, the code inductor generates) run in
parallel through OpenMP, and GNU OpenMP (libgomp, which PyTorch's Linux wheels ship) gives every
thread that starts a parallel region a team of worker threads of its own, kept for as long as
that thread lives. While the process holds no more of those threads than it has cores, a worker
spins for a while (about 300,000 iterations) waiting for its next region; once it holds more,
libgomp cuts every wait to 100 iterations, and between regions the workers sleep. A decode step
is hundreds of short regions, and each then begins by waking a worker through the kernel.

That is the usual shape of a server or a benchmark: the model is loaded (and its graphs
compiled) in the main thread, which leaves a team behind, and the engine is stepped from
another thread, which gets a second one. Two teams on two cores
oversubscribe them: the served engine runs slower and switches context tens of thousands of
times a run (measured: data/results/ch11/NOTES.md). :func:`release_openmp_threads`, called by
the thread that loaded the model before another takes over, gives its team back (OpenMP 5.0's
``omp_pause_resource_all``).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

# omp_pause_resource_t: a hard pause frees the runtime's threads, not only parks them.
OMP_PAUSE_HARD = 2


@functools.cache
def _openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime PyTorch runs on (the one its own ``lib`` folder ships, else whatever
    the process has loaded), if it has ``omp_pause_resource_all``; None otherwise."""
    candidates = sorted((Path(torch.__file__).parent / "lib").glob("lib*omp*"))
    for path in [*map(str, candidates), None]:
        try:
            runtime = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(runtime, "omp_pause_resource_all"):
            return runtime
    return None


def release_openmp_threads() -> bool:
    """Give back the calling thread's OpenMP team, so that another thread stepping the engine
    is not slowed by it (see the module docstring). Returns whether a runtime took the request;
    where none can (no OpenMP runtime found, or the call comes from inside a parallel region)
    nothing changes and this returns False. A later parallel region in this thread simply
    builds a new team."""
    runtime = _openmp_runtime()
    return runtime is not None and runtime.omp_pause_resource_all(OMP_PAUSE_HARD) == 0
