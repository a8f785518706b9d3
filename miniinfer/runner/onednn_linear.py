"""oneDNN's prepacked fp32 matmul, as an op the compiled forward calls (chapter 11).

Profiled on the same workload, vLLM's CPU decode steps spend three quarters of their time in
one op, oneDNN's matmul over weights it reordered once, at load, into the blocked layout its
kernels read fastest. Ours spent theirs in MKL's ``sgemm`` (through ``F.linear``) or in
inductor's C++ GEMM template. Over SmolLM2's body projections
the prepacked oneDNN matmul beat ``F.linear`` from 4 rows up and the autotuned template from
16 tokens, while at 1-8 rows the template was as fast or faster (measured:
data/results/ch11/NOTES.md), so the compiled forward uses oneDNN from 16 tokens (on a CPU with
AVX2 only, from 48; see CompileOptions).

Inductor's own freezing pass packs fp32 weights for MKL, not oneDNN, and its on-disk cache
cannot store packed tensors (a second process would compile every graph again). So the packing
happens here, once per weight, outside any graph: :func:`prepack` reorders each projection's
weight for oneDNN and files it under the weight's storage; the graph calls :func:`onednn_linear`
with the plain weight, an opaque op to inductor (a ``torch.library`` custom op with a fake for
tracing), which looks the packed copy up. A weight with no packed copy (never prepacked, or on
a device oneDNN does not serve) goes through ``F.linear``: slower, never wrong.

The packed copy is a second copy of the weights (SmolLM2-135M: about 0.5 GB in fp32). One
copy serves every row count: oneDNN packs for a row-count hint, and a copy packed for 8 or 32
rows ran as fast at 4-64 rows as copies packed for each (packed for 1 row it was slower).

The model's projections are already fused (a layer's query, key and value projections run as
one matmul, and so do its gate and up projections: :mod:`.model`), so packing is a swap of
the model's linears (:func:`prepacked`): every :class:`~miniinfer.runner.model.Linear` becomes a
:class:`PrepackedLinear` over the same weight. Every weight the graphs see is a whole tensor of
its own, never a view into a larger one: inductor's C++ GEMM template (torch 2.13) packs a
frozen weight from the start of its storage, whatever the view's offset (once, with merged
projections as views into the model's weights, logits were off by up to 58 on SmolLM2; tests
check the template graphs against the eager forward).
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F

from .model import Linear, Model, swap_linears

# The row count oneDNN packs the weights for (see the module docstring).
PACK_ROWS_HINT = 32

# Each prepacked weight's oneDNN copy, by the weight's storage (address, shape, dtype): the
# compiled graph hands the op the parameter itself, or without freezing a view of it.
_PACKED: dict[tuple[int, tuple[int, ...], torch.dtype], torch.Tensor] = {}
# How many calls of the op found a packed copy and how many fell back to F.linear (a test
# reads these: equal logits would not show that the packed path ran).
calls = {"packed": 0, "unpacked": 0}


@functools.cache  # a fact of this machine and torch build; asked on every compiled step
def onednn_available(device: torch.device, dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch can reorder and run ``dtype`` linear weights with oneDNN on
    ``device``. Half-precision weights also need the CPU to compute in them (bf16: AVX-512 or
    AVX-NE-CONVERT; a CPU with AVX2 only, such as AMD's Zen 3, has neither, and oneDNN refuses
    to reorder its weights)."""
    if not (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return dtype == torch.float32


def _key(weight: torch.Tensor) -> tuple[int, tuple[int, ...], torch.dtype]:
    return weight.data_ptr(), tuple(weight.shape), weight.dtype


def prepack(weights: list[torch.Tensor]) -> None:
    """Reorder each weight for oneDNN, once (a weight already packed is skipped). A packed
    copy lives as long as its weight."""
    for weight in weights:
        key = _key(weight)
        if key in _PACKED:
            continue
        with torch.no_grad():
            _PACKED[key] = torch.ops.mkldnn._reorder_linear_weight(weight.detach(),
                                                                   PACK_ROWS_HINT)
        # When the weight goes, so does its copy (its address may be reused).
        weakref.finalize(weight, _PACKED.pop, key, None)


class PrepackedLinear(Linear):
    """A :class:`~miniinfer.runner.model.Linear` whose matmul runs through oneDNN over its
    weight reordered once, here (the same weight tensor: the dense model and this one share
    it; the packed copy is filed under it)."""

    def __init__(self, dense: Linear) -> None:
        super().__init__(dense.weight, dense.bias)
        prepack([self.weight])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, self.weight, self.bias)


_PREPACKED: weakref.WeakKeyDictionary[Model, Model] = weakref.WeakKeyDictionary()


def prepacked(model: Model) -> Model:
    """``model`` with every matmul a :class:`PrepackedLinear` (once per model: the packed
    copies are made on the first call)."""
    if model not in _PREPACKED:
        _PREPACKED[model] = swap_linears(model, lambda _, linear: PrepackedLinear(linear))
    return _PREPACKED[model]


def is_prepacked(weight: torch.Tensor) -> bool:
    return _key(weight) in _PACKED


@torch.library.custom_op("miniinfer::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the oneDNN copy :func:`prepack` made of
    ``weight`` (``x`` ``[rows, in]``), or through ``F.linear`` where there is none."""
    packed = _PACKED.get(_key(weight))
    if packed is None:
        calls["unpacked"] += 1
        return F.linear(x, weight, bias)
    calls["packed"] += 1
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@onednn_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
