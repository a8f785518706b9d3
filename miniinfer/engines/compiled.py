"""Stage ``compiled``: chapter 08's continuous engine on the direct forward compiled by
PyTorch's own compiler (chapter 11).

Nothing the engine does changes: the scheduler, the sampling, the stop rules and the serving API
are chapter 08's. What changes is one setting of the engine's config, ``forward="compiled"``:
the runner runs chapter 06's direct forward under ``torch.compile`` with inductor
(:mod:`miniinfer.runner.compiled`), the weights frozen into the graph and repacked for its GEMM
kernels, RMSNorm, RoPE and SiLU-times-up fused, attention reading K/V from the pool's blocks in
place, and one graph per token-count bucket, cached on disk for the next process. A server or a
benchmark compiles every bucket when the engine is built (``warm_up=True``: no request or timed
step waits on a compile); a one-off run (``warm_up=False``, the ``generate`` command's) compiles
a bucket the first time a step needs it. Any other setting composes with it:
``make_engine("compiled", lm, prefix_caching=True)``.
"""

from __future__ import annotations

from .continuous import ContinuousEngine


class CompiledEngine(ContinuousEngine):
    name = "compiled"
    summary = "continuous batching on the direct forward compiled by torch.compile (inductor)"
    preset = {"forward": "compiled"}
