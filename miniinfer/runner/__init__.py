"""The model runner: weights, the paged KV pool and the forward of one step (see
:mod:`miniinfer.runner.model_runner`)."""

from .attention import MixedBatchMetadata, PagedAttention, PagedAttentionMetadata
from .model_runner import FORWARDS, ForwardFn, ModelRunner
from .step import StepBatch, decode_batch

__all__ = ["FORWARDS", "ForwardFn", "MixedBatchMetadata", "ModelRunner", "PagedAttention",
           "PagedAttentionMetadata", "StepBatch", "decode_batch"]
