"""oneDNN's prepacked fp32 matmul, as an op the compiled forward calls (chapter 11).

Profiled on the same workload, vLLM's CPU decode steps spend three quarters of their time in
one op, oneDNN's matmul over weights it reordered once, at load, into the blocked layout its
kernels read fastest. Ours spent theirs in MKL's ``sgemm`` (through ``F.linear``) or in
inductor's C++ GEMM template. On our 2-core CPU, over SmolLM2's 210 body projections with
weights streamed from memory as in a real step, the prepacked oneDNN matmul took 0.4-0.6x
``F.linear``'s time from 4 to 64 rows (22 vs 54 ms at 4 rows, 44 vs 103 ms at 32; one run),
and whole decode steps of 16 and 32 tokens 0.75x and 0.6x the autotuned template's. At 1-8
rows the template was as fast or faster, so the compiled forward uses oneDNN from 16 tokens
(on a CPU with AVX2 only, from 48: there the template won at 16-32 rows; see CompileOptions).

Inductor's own freezing pass packs fp32 weights for MKL, not oneDNN, and its on-disk cache
cannot store packed tensors (a second process would compile every graph again). So the packing
happens here, once per weight, outside any graph: :func:`prepack` reorders each projection's
weight for oneDNN and files it under the weight's storage; the graph calls :func:`onednn_linear`
with the plain weight, an opaque op to inductor (a ``torch.library`` custom op with a fake for
tracing), which looks the packed copy up. A weight with no packed copy (never prepacked, or on
a device oneDNN does not serve) goes through ``F.linear``: slower, never wrong.

The packed copy is a second copy of the weights (SmolLM2-135M: about 0.5 GB in fp32). One
copy serves every row count: oneDNN packs for a row-count hint, and a copy packed for 8 or 32
rows ran as fast at 4-64 rows as copies packed for each (packed for 1 row it was 1.5x slower).

As vLLM's model definitions do, a layer's query, key and value projections run as one matmul,
and so do its gate and up projections (:func:`merge_projections`): 4 calls a layer instead of
7, and wider ones: 4-12% off the body's matmuls at 1-64 rows in one microbenchmark. The merged
weights are copies (SmolLM2-135M: about 0.3 GB more in fp32), not the model's own memory with
its projections turned into views into them, as they once were: inductor's C++ GEMM template
(torch 2.13) packs a frozen weight from the start of its storage, whatever the view's offset,
so the small buckets' graphs, which do not merge, computed the key, value and up projections
with the query's and gate's first rows (logits off by up to 58 on SmolLM2; tests check the
template graphs against the eager forward now).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

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


@dataclass(frozen=True, slots=True)
class MergedProjections:
    """One decoder layer's projections that read the same input, as one weight each: ``qkv``
    (query, key and value rows stacked, ``qkv_sizes`` rows each) and ``gate_up``."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    qkv_sizes: tuple[int, int, int]
    gate_up: torch.Tensor


_MERGED: weakref.WeakKeyDictionary[nn.Module, list[MergedProjections]] = \
    weakref.WeakKeyDictionary()


def merge_projections(model: nn.Module) -> list[MergedProjections]:
    """Each decoder layer's :class:`MergedProjections` (once per model): stacked copies of its
    weights, which stay as they were (see the module docstring for why not views)."""
    if model in _MERGED:
        return _MERGED[model]
    merged = []
    with torch.no_grad():
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            projections = (attn.q_proj, attn.k_proj, attn.v_proj)
            sizes = tuple(p.weight.shape[0] for p in projections)
            qkv = _stack([p.weight for p in projections])
            bias = None if attn.q_proj.bias is None else _stack([p.bias for p in projections])
            gate_up = _stack([mlp.gate_proj.weight, mlp.up_proj.weight])
            merged.append(MergedProjections(qkv, bias, sizes, gate_up))
    _MERGED[model] = merged
    return merged


def _stack(params: list[nn.Parameter]) -> torch.Tensor:
    """The parameters' rows stacked into one new tensor."""
    return torch.cat([p.detach() for p in params])


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


def prepack_model(model: nn.Module) -> list[MergedProjections]:
    """Merge ``model``'s projections and prepack every weight the oneDNN graphs read: the
    merged ones, the output and down projections, and the LM head."""
    merged = merge_projections(model)
    weights = [model.lm_head.weight]
    for layer, m in zip(model.model.layers, merged, strict=True):
        weights += [m.qkv, m.gate_up, layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight]
    prepack(weights)
    return merged


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
