"""The engine registry: one name per stage of the book, all with the same interface."""

from __future__ import annotations

from ..core.config import EngineConfig
from ..core.errors import UnknownNameError
from ..core.models import LoadedModel
from .async_loop import AsyncEngine
from .base import Engine, GenerationResult
from .compiled import CompiledEngine
from .composed import ComposedEngine
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
                CompiledEngine, TensorParallelEngine, QuantizedEngine, SpeculativeEngine,
                ComposedEngine)
}


def resolve_engine(name: str) -> tuple[type[Engine], dict[str, object]]:
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
    return cls, cls.variant_options(variant)


def engine_config(name: str, **options) -> EngineConfig | None:
    """The config the engine ``name`` would run with these options, checked (a combination
    that cannot run is refused here, naming both settings), without loading a model; None for
    the static-batch stages, which have no config."""
    cls, variant_options = resolve_engine(name)
    if not issubclass(cls, ContinuousEngine):
        return None
    settings = {k: v for k, v in {**variant_options, **options}.items()
                if k not in ("config", "runner")}
    return EngineConfig.of(options.get("config"), **{**cls.preset, **settings})


def make_engine(name: str, lm: LoadedModel, **options) -> Engine:
    """The engine ``name`` (a stage, or a stage's variant) with ``options`` set on top of its
    preset: any setting composes with any stage built on chapter 08's engine. Drafts are the
    one setting that needs its stage's methods, so a config that drafts runs on the speculative
    stage whatever preset it came from."""
    cls, variant_options = resolve_engine(name)
    options = {**variant_options, **options}
    if issubclass(cls, ContinuousEngine):
        options = {**cls.device_settings(lm.device), **options}
        config = engine_config(name, **options)
        drafting = SpeculativeEngine if config.speculative is not None else ContinuousEngine
        if issubclass(cls, SpeculativeEngine) != issubclass(drafting, SpeculativeEngine):
            # The config as it is: the other stage's preset is not applied over it.
            return drafting(lm, config, **{k: getattr(config, k) for k in drafting.preset},
                            **{k: v for k, v in options.items() if k == "runner"})
    return cls(lm, **options)


__all__ = ["ENGINES", "Engine", "EngineConfig", "GenerationResult", "engine_config",
           "make_engine", "resolve_engine"]
