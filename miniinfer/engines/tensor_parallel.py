"""Stage ``tensor-parallel``: chapter 08's continuous engine on a model split over N processes.

Nothing the engine does changes: the scheduler, the sampling, the stop rules and the serving API
are chapter 08's, and they stay in this process (rank 0), with the tokenizer. What changes is
one setting of the engine's config, ``tensor_parallel`` (2 here): the runner's forward
(:mod:`miniinfer.runner.tensor_parallel`) splits every layer's projections Megatron-style over
that many ranks of ``torch.distributed`` (gloo on a CPU, NCCL on GPUs), each rank holding whole
attention heads, its share of the MLP and a KV pool of its own heads only; two all-reduces per
layer make the hidden state whole again. Each step, rank 0 broadcasts the step's inputs (token
ids, positions, block tables, slot mapping) and samples from logits that never leave it.
``serve --engine tensor-parallel`` serves over HTTP.
"""

from __future__ import annotations

from .continuous import ContinuousEngine


class TensorParallelEngine(ContinuousEngine):
    name = "tensor-parallel"
    summary = "continuous batching on a model split Megatron-style over N processes"
    preset = {"tensor_parallel": 2}
