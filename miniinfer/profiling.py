"""Profiler ranges for the engines' decode step (chapter 05 builds the analysis on top).

``phase(name)`` marks a named range with ``torch.profiler.record_function``. Ranges can be
switched off entirely (``set_ranges(False)``) so chapter 05 can measure what they cost when no
profiler is running.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from torch.profiler import record_function

_ranges_on = True


def set_ranges(enabled: bool) -> None:
    global _ranges_on
    _ranges_on = enabled


def phase(name: str) -> AbstractContextManager:
    return record_function(name) if _ranges_on else nullcontext()
