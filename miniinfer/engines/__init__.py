"""The engine registry: one name per stage of the book, all with the same interface."""

from __future__ import annotations

from ..errors import UnknownNameError
from ..models import LoadedModel
from .base import Engine, GenerationResult
from .continuous import ContinuousEngine
from .hf import HFEngine
from .naive import NaiveEngine
from .paged_attention import PagedAttentionEngine
from .paged_loop import PagedLoopEngine
from .paged_prealloc import PagedPreallocEngine
from .paged_vectorized import PagedVectorizedEngine

ENGINES: dict[str, type[Engine]] = {
    cls.name: cls
    for cls in (HFEngine, NaiveEngine, PagedLoopEngine, PagedVectorizedEngine, PagedPreallocEngine,
                PagedAttentionEngine, ContinuousEngine)
}


def make_engine(name: str, lm: LoadedModel, **options) -> Engine:
    if name not in ENGINES:
        raise UnknownNameError(f"unknown engine {name!r}; available engines: {', '.join(ENGINES)}")
    return ENGINES[name](lm, **options)


__all__ = ["ENGINES", "Engine", "GenerationResult", "make_engine"]
