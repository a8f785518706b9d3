"""The engine registry: one name per stage of the book, all with the same interface."""

from __future__ import annotations

from ..core.errors import UnknownNameError
from ..core.models import LoadedModel
from .async_loop import AsyncEngine
from .base import Engine, GenerationResult
from .compiled import CompiledEngine
from .config import EngineConfig
from .continuous import ContinuousEngine
from .hf import HFEngine
from .naive import NaiveEngine
from .paged_attention import PagedAttentionEngine
from .paged_loop import PagedLoopEngine
from .paged_prealloc import PagedPreallocEngine
from .paged_vectorized import PagedVectorizedEngine
from .prefix_cache import PrefixCacheEngine
from .quantized import QuantizedEngine
from .speculative import SpeculativeEngine
from .tensor_parallel import TensorParallelEngine

ENGINES: dict[str, type[Engine]] = {
    cls.name: cls
    for cls in (HFEngine, NaiveEngine, PagedLoopEngine, PagedVectorizedEngine, PagedPreallocEngine,
                PagedAttentionEngine, AsyncEngine, ContinuousEngine, PrefixCacheEngine,
                CompiledEngine, TensorParallelEngine, QuantizedEngine, SpeculativeEngine)
}


def resolve_engine(name: str) -> tuple[type[Engine], dict[str, str]]:
    """The class and options ``name`` stands for, checked without building anything (so a
    typo fails before a model load). ``"stage:variant"`` picks a variant of a stage that has
    one: ``"async:overlap"`` is ``async`` with ``loop="overlap"``."""
    stage, _, variant = name.partition(":")
    if stage not in ENGINES:
        raise UnknownNameError(f"unknown engine {name!r}; available engines: {', '.join(ENGINES)}")
    cls = ENGINES[stage]
    if not variant:
        return cls, {}
    variants = getattr(cls, "variants", ())
    if variant not in variants:
        known = f"its variants: {', '.join(f'{stage}:{v}' for v in variants)}" if variants \
            else "it has no variants"
        raise UnknownNameError(f"unknown engine {name!r}; {known}")
    return cls, {cls.variant_option: variant}


def make_engine(name: str, lm: LoadedModel, **options) -> Engine:
    cls, variant_options = resolve_engine(name)
    return cls(lm, **variant_options, **options)


__all__ = ["ENGINES", "Engine", "EngineConfig", "GenerationResult", "make_engine",
           "resolve_engine"]
