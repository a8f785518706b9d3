"""Stage ``compiled``: chapter 08's continuous engine on the direct forward compiled by
PyTorch's own compiler (chapter 11).

Nothing the engine does changes: the scheduler, the sampling, the stop rules and the serving API
are chapter 08's. What changes is the runner's forward (:mod:`miniinfer.runner.compiled`):
chapter 06's direct forward under ``torch.compile`` with inductor, the weights frozen into the
graph and repacked for its GEMM kernels, RMSNorm, RoPE and SiLU-times-up fused, attention
reading K/V from the pool's blocks in place, and one graph per token-count bucket, cached on
disk for the next process. A server or a benchmark compiles every bucket when the engine is
built (``warm_up=True``: no request or timed step waits on a compile); a one-off run
(``warm_up=False``, the ``generate`` command's) compiles a bucket the first time a step needs it. ``serve --engine compiled`` serves over HTTP on it; ``prefix-cache`` runs
on it with ``forward="compiled"``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.models import LoadedModel
from ..runner import ModelRunner
from .config import EngineConfig
from .continuous import ContinuousEngine

if TYPE_CHECKING:  # imported when a forward is built: loading inductor costs seconds
    from ..runner.compiled import CompileOptions


class CompiledEngine(ContinuousEngine):
    name = "compiled"
    summary = "continuous batching on the direct forward compiled by torch.compile (inductor)"
    compiles_ahead = True  # builds every bucket's graph before serving, unless warm_up=False

    def __init__(self, lm: LoadedModel, config: EngineConfig | None = None, *,
                 compile_options: CompileOptions | None = None, warm_up: bool = True,
                 **options) -> None:
        config = EngineConfig.of(config, **options)
        runner = ModelRunner(lm, config.kv_cache, forward="compiled",
                             attention_backend=config.attention_backend,
                             compile_options=compile_options)
        super().__init__(lm, config, runner=runner)
        if warm_up:
            runner.forward.warm_up()
