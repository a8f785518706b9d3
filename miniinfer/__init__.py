"""miniinfer: an LLM inference engine built one chapter at a time.

>>> import miniinfer
>>> lm = miniinfer.load_model("smollm2-135m")
>>> engine = miniinfer.make_engine("naive", lm)
>>> engine.generate([lm.tokenizer.encode("The capital of France is")],
...                 miniinfer.SamplingParams(max_new_tokens=8)).token_ids
"""

from .core.errors import InvalidRequestError, KVCacheFull, MiniInferError, UnknownNameError
from .core.models import MODELS, LoadedModel, load_model
from .core.sampling import SamplingParams
from .engines import ENGINES, Engine, GenerationResult, make_engine

__all__ = [
    "ENGINES",
    "MODELS",
    "Engine",
    "GenerationResult",
    "InvalidRequestError",
    "KVCacheFull",
    "LoadedModel",
    "MiniInferError",
    "SamplingParams",
    "UnknownNameError",
    "load_model",
    "make_engine",
]
