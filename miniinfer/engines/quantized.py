"""Stage ``quantized``: chapter 11's compiled engine on int4 or int8 weights (chapter 13).

Nothing the engine does changes: the scheduler, the sampling, the stop rules and the serving
API are chapter 08's, and the forward is chapter 11's. What changes is one setting of the
engine's config, ``weights``: the runner builds the model with its linears swapped for
weight-only int4 ones built from the GGUF's own Q4_1 blocks, or int8 ones per output channel
(:mod:`miniinfer.runner.quantized`), before it builds the forward over it.
``quantized:int4`` and ``quantized:int8`` run it compiled; ``quantized:int4-eager`` and
``quantized:int8-eager`` eagerly (chapter 06's direct forward), nothing to compile.
"""

from __future__ import annotations

from .compiled import CompiledEngine

WEIGHTS = ("int4", "int8", "int4-eager", "int8-eager")


class QuantizedEngine(CompiledEngine):
    name = "quantized"
    summary = ("continuous batching on weight-only int4 (the GGUF's own Q4_1 blocks) or int8 "
               "linears, compiled or eager")
    preset = {**CompiledEngine.preset, "weights": "int4"}
    variants = WEIGHTS

    @classmethod
    def variant_options(cls, variant: str) -> dict[str, object]:
        bits, _, eager = variant.partition("-")
        return {"weights": bits, "forward": "direct"} if eager else {"weights": bits}
