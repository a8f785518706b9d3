"""Profiler ranges around the phases of a decode step: what the engines import (chapters 04-07).

``phase(name)`` marks a named range with ``torch.profiler.record_function``. Ranges can be
switched off entirely (``set_ranges(False)``) so chapter 05 can measure what they cost when no
profiler is running. The analysis of the traces these ranges produce lives in ``profiling``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

from torch.profiler import record_function

_ranges_on = True

# The labelled phases of a paged engine's decode step, in execution order.
STEP = "decode_step"
PHASES = ("prepare_inputs", "gather_batch_kv", "build_cache", "model_forward", "sample",
          "write_decode_kv")
# Where a decode loop waits for a step's tokens to reach the host (chapter 07).
READ_TOKENS = "read_tokens"


def set_ranges(enabled: bool) -> None:
    global _ranges_on
    _ranges_on = enabled


@contextmanager
def ranges_disabled() -> Iterator[None]:
    previous = _ranges_on
    set_ranges(False)
    try:
        yield
    finally:
        set_ranges(previous)


def phase(name: str) -> AbstractContextManager:
    return record_function(name) if _ranges_on else nullcontext()
