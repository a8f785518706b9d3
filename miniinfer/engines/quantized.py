"""Stage ``quantized``: chapter 08's continuous engine on int4 or int8 weights (chapter 13).

Nothing the engine does changes: the scheduler, the sampling, the stop rules and the serving
API are chapter 08's. What changes is the model the runner's forward runs
(:mod:`miniinfer.runner.quantized`): its linears swapped for weight-only int4 ones built from
the GGUF's own Q4_1 blocks, or int8 ones per output channel. ``quantized:int4`` and
``quantized:int8`` run it under chapter 11's compiled forward; ``quantized:int4-eager`` and
``quantized:int8-eager`` run it eagerly (chapter 06's direct forward), nothing to compile.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ..core.errors import MiniInferError
from ..core.models import LoadedModel
from ..runner import ModelRunner
from ..runner.direct import DirectForward
from ..runner.quantized import quantized, weight_bytes
from .config import EngineConfig
from .continuous import ContinuousEngine

if TYPE_CHECKING:  # imported when a forward is built: loading inductor costs seconds
    from ..runner.compiled import CompileOptions

WEIGHTS = ("int4", "int8", "int4-eager", "int8-eager")


def quantized_compile_options(options: CompileOptions | None = None) -> CompileOptions:
    """Chapter 11's options for a quantized model: no oneDNN prepacking (it packs dense fp32
    weights; these have none), and ATen's weight-only kernels beside inductor's own C++
    templates for the autotuner to choose from (a template that cannot take a shape leaves
    ATen's op, not no choice at all)."""
    from ..runner.compiled import CompileOptions

    return dataclasses.replace(options or CompileOptions(), onednn_min_tokens=None,
                               onednn_min_tokens_bf16=None, onednn_min_tokens_avx2=None,
                               gemm_backends="CPP,ATEN")


class QuantizedEngine(ContinuousEngine):
    name = "quantized"
    summary = ("continuous batching on weight-only int4 (the GGUF's own Q4_1 blocks) or int8 "
               "linears, compiled or eager")
    variant_option = "weights"
    variants = WEIGHTS
    compiles_ahead = True  # the compiled variants build every bucket's graph, unless warm_up=False

    def __init__(self, lm: LoadedModel, config: EngineConfig | None = None, *,
                 weights: str = "int4", compile_options: CompileOptions | None = None,
                 warm_up: bool = True, **options) -> None:
        if weights not in WEIGHTS:
            raise MiniInferError(f"unknown weights {weights!r}; choose one of {', '.join(WEIGHTS)}")
        bits, _, eager = weights.partition("-")
        try:
            model = quantized(lm, bits)
        except ValueError as error:
            raise MiniInferError(str(error)) from None
        config = EngineConfig.of(config, **options)
        runner = ModelRunner(lm, config.kv_cache, forward="direct",
                             attention_backend=config.attention_backend)
        # The runner's own forwards run the model HF's weights make; this one runs ours.
        if eager:
            runner.forward = DirectForward(model, runner.attention)
        else:
            from ..runner.compiled import CompiledForward

            runner.forward = CompiledForward(model, runner.kv_cache,
                                             quantized_compile_options(compile_options),
                                             attention=runner.attention)
            runner.forward_name = "compiled"
        super().__init__(lm, config, runner=runner)
        # What a decode step reads (codes and scales): its bandwidth floor, not the fp32 one.
        self.weight_bytes = weight_bytes(model)
        if warm_up and not eager:
            runner.forward.warm_up()
