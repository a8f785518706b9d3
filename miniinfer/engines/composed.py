"""Stage ``composed``: every optimisation of the book at once, the engine a reader would deploy
(chapter 15).

Nothing new runs here: it is chapter 14's speculative engine with every setting of the config
that pays on the device turned on. On a CPU: int4 weights from the GGUF's own Q4_1 blocks
(chapter 13), the compiled forward (chapter 11), prefix caching (chapter 09), adaptive n-gram
drafts priced by the measured step costs (chapter 14), over chapter 08's continuous batching
with chunked prefill. On a GPU: the model's own weights and dtype on the direct forward, whose
decode steps replay chapter 07's CUDA graphs, with the same prefix caching and drafts. Any
setting can still be turned off by name (``make_engine("composed", lm, speculative=None)``),
which is how chapter 15 measures what each is worth on top of the others.
"""

from __future__ import annotations

import torch

from .speculative import SpeculativeEngine

# What pays on a GPU instead: there a decode step waits on launches, which the CUDA graphs
# remove, and bf16 weights are already half of fp32's bytes.
GPU_SETTINGS = {"weights": "dense", "forward": "auto", "cuda_graphs": True}


class ComposedEngine(SpeculativeEngine):
    name = "composed"
    summary = ("every optimisation at once: int4, compiled, prefix caching, adaptive drafts, "
               "chunked prefill (on a GPU: its own weights with CUDA graphs)")
    preset = {**SpeculativeEngine.preset, "weights": "int4", "forward": "compiled",
              "prefix_caching": True, "chunked_prefill": True, "speculative": "ngram",
              "draft_policy": "adaptive"}
    variants = ()

    @classmethod
    def device_settings(cls, device: torch.device) -> dict[str, object]:
        return GPU_SETTINGS if device.type == "cuda" else {}
