"""The model runner: weights, the paged KV pool and the forward of one step (see
:mod:`miniinfer.runner.model_runner`)."""

from .attention import MixedBatchMetadata, PagedAttentionMetadata
from .model_runner import FORWARDS, ForwardFn, ModelRunner

__all__ = ["FORWARDS", "ForwardFn", "MixedBatchMetadata", "ModelRunner", "PagedAttentionMetadata"]
