"""Weights as they ship: int4 from the GGUF's own Q4_1 blocks, int8 weight-only (chapter 13).

At batch 1 a decode step reads every weight once, so its floor is the weights' bytes over
the memory bandwidth: fewer bytes per weight, a lower floor. SmolLM2-135M ships as a Q4_1
GGUF: each row of a matrix is cut into blocks of 32 weights, and each block stores a scale
``d`` and a minimum ``m`` (fp16 each) and 32 four-bit codes ``q`` in 0..15, the weight being
``w = d * q + m``: groupwise asymmetric int4, group 32, 5 bits a weight. transformers
de-quantizes that file to fp32 at load (4 bytes a weight); here the blocks are read back,
and multiplied by chapter 13's own kernel (:mod:`~miniinfer.core.kernels.cpu_quantized`) where
it runs (x86 with AVX2): the file's 20-byte blocks, repacked once at load into groups of 8
output rows (the same bytes, interleaved for the integer instructions), the activations quantized to
int8 per block of 32 in the kernel, integer dot products, each block's scales applied once;
``compute_dtype=torch.int8`` names that path. Elsewhere, or when asked for another
``compute_dtype``, PyTorch's weight-only ops run instead:

- :class:`Int4Linear` runs PyTorch's CPU int4 matmul (``_weight_int4pack_mm_for_cpu``),
  which computes with ``w = (q - 8) * scale + zero`` per group. With ``scale = d`` and
  ``zero = m + 8 d`` that is the file's ``d * q + m``: the codes are the file's, packed, not
  quantized again. With fp32 activations the op's weights equal the fp32 weights HF loads bit
  for bit (a test checks every Q4_1 tensor of the file); the op takes its scales in the
  activations' dtype, so in bf16 ``d`` and ``zero`` are rounded to bf16 (8 bits of mantissa
  where fp16 has 11).
- :class:`Int8Linear` is weight-only int8 per output channel (``_weight_int8pack_mm``):
  ``w = scale * q``, q in -127..127, quantized here from the fp32 weights.

The file's other tensors are not Q4_1: the norms are F32 and the token embedding (tied to the
LM head) is Q8_0 (blocks of 32 int8 codes with one fp16 scale). The embedding is only looked
up, a row per token, so it stays as HF loads it; the LM head, a third of SmolLM2's weights,
runs as :class:`Int8Linear` in both variants (8 bits, as the file ships it, but per channel
where the file has a scale per 32 weights: the op takes one scale per output row).

PyTorch's ops are slow with fp32 activations on a CPU (the int4 one by far: a plain loop,
where bf16 has vectorised kernels), so off the kernel the linears compute in bf16 and hand back
the model's dtype; the rest of the model (norms, RoPE, attention) stays fp32 either way.
A model without a shipped GGUF (the tiny test model, a random-weight config) gets its int4
blocks by Q4_1's own rule (:func:`q4_1_quantize`, gguf's ``quantize_blocks``).
"""

from __future__ import annotations

import dataclasses
import re
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from ..core.kernels import cpu_quantized
from ..core.models import LoadedModel
from .model import Linear, Model, load, swap_linears

if TYPE_CHECKING:  # imported when a forward is built: loading inductor costs seconds
    from .compiled import CompileOptions

GROUP = 32  # weights per Q4_1 block, and the int4 op's group size
Q4_1_BLOCK_BYTES = 20  # fp16 d, fp16 m, 16 bytes of 4-bit codes
# GGUF tensor name -> HF's (llama.cpp's convert script names them so).
GGUF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
              "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
              "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# Our fused linears (Model's names) -> the HF weights stacked in them, in order.
FUSED = {"attention.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "attention.out": ("self_attn.o_proj",),
         "feed_forward.gate_up": ("mlp.gate_proj", "mlp.up_proj"),
         "feed_forward.down": ("mlp.down_proj",)}
BITS = ("int4", "int8")


@dataclass(slots=True)
class Q4_1Weight:
    """A matrix as Q4_1 blocks: ``q`` ``[out, in]`` codes 0..15 (uint8), ``d`` and ``m``
    ``[out, in / 32]`` (fp16 values, held as fp32). The weight is ``d * q + m`` per block."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight, as gguf's ``dequantize`` (and so transformers) computes it."""
        return (self.d.repeat_interleave(GROUP, 1) * self.q.float()
                + self.m.repeat_interleave(GROUP, 1))

    def rows(self, index: torch.Tensor) -> Q4_1Weight:
        return Q4_1Weight(self.q[index], self.d[index], self.m[index])

    def file_blocks(self) -> torch.Tensor:
        """The blocks as the file stores them, ``[out, in / 32 * 20]`` uint8: per block fp16
        ``d``, fp16 ``m``, 16 bytes whose low nibbles are codes 0-15 and high nibbles 16-31
        (the inverse of :func:`q4_1_blocks`)."""
        rows, groups = self.d.shape
        halves = [t.half().contiguous().view(torch.uint8).view(rows, groups, 2)
                  for t in (self.d, self.m)]
        codes = self.q.view(rows, groups, GROUP)
        nibbles = (codes[..., :16] | (codes[..., 16:] << 4)).to(torch.uint8)
        return torch.cat([*halves, nibbles], dim=-1).reshape(rows, -1).contiguous()

    @staticmethod
    def stack(weights: list[Q4_1Weight]) -> Q4_1Weight:
        """Row-stacked, as the fused projections stack their weights."""
        return Q4_1Weight(*(torch.cat([getattr(w, f) for w in weights]) for f in ("q", "d", "m")))


def q4_1_blocks(raw: np.ndarray | torch.Tensor) -> Q4_1Weight:
    """Q4_1 blocks from a GGUF tensor's bytes ``[out, in / 32 * 20]``: per block fp16 ``d``,
    fp16 ``m``, then 16 bytes whose low nibbles are weights 0-15 and high nibbles 16-31."""
    raw = torch.from_numpy(np.array(raw, dtype=np.uint8))  # a writable copy
    rows = raw.shape[0]
    blocks = raw.view(rows, -1, Q4_1_BLOCK_BYTES)
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    m = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
    codes = blocks[..., 4:]
    q = torch.cat([codes & 0x0F, codes >> 4], dim=-1).reshape(rows, -1)
    return Q4_1Weight(q, d, m)


def q4_1_quantize(weight: torch.Tensor) -> Q4_1Weight:
    """Q4_1 blocks of ``weight`` ``[out, in]`` by gguf's own rule (``quants.Q4_1``): per
    block ``d = (max - min) / 15`` and ``m = min`` rounded to fp16, ``q = round((w - m) / d)``.
    For models that do not ship as Q4_1."""
    blocks = weight.detach().float().reshape(weight.shape[0], -1, GROUP)
    low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    d32 = (high - low) / 15
    inv = torch.where(d32 == 0, torch.zeros_like(d32), 1 / d32)
    q = torch.trunc((blocks - low) * inv + 0.5).clamp(0, 15).to(torch.uint8)
    d = d32.half().float().squeeze(-1)
    m = low.half().float().squeeze(-1)
    return Q4_1Weight(q.reshape(weight.shape), d, m)


def unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's RoPE permutation of a query or key matrix
    (transformers' ``LlamaTensorProcessor._reverse_permute_weights``): HF's row ``(h, j, i)``
    (head, half, index) is the file's row ``(h, i, j)``."""
    dim = rows // heads // 2
    return torch.arange(rows).view(heads, dim, 2).transpose(1, 2).reshape(-1)


def read_q4_1(path: str | Path, config) -> dict[str, Q4_1Weight]:
    """Every Q4_1 tensor of a Llama GGUF, under HF's name (``model.layers.0.self_attn.q_proj``)
    and in HF's row order (query and key rows un-permuted, as transformers does)."""
    from gguf import GGMLQuantizationType, GGUFReader

    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    out: dict[str, Q4_1Weight] = {}
    for tensor in GGUFReader(str(path)).tensors:
        match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", tensor.name)
        if tensor.tensor_type != GGMLQuantizationType.Q4_1 or not match \
                or match[2] not in GGUF_NAMES:
            continue
        weight = q4_1_blocks(tensor.data)
        if match[2] in ("attn_q", "attn_k"):
            weight = weight.rows(unpermute_rows(weight.q.shape[0],
                                                heads if match[2] == "attn_q" else kv_heads))
        out[f"model.layers.{match[1]}.{GGUF_NAMES[match[2]]}"] = weight
    return out


def _flat(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).to(dtype).contiguous()


def _unflat(y: torch.Tensor, x: torch.Tensor, out_features: int,
            bias: torch.Tensor | None) -> torch.Tensor:
    """``y``, the product of ``_flat(x)``, in ``x``'s dtype and leading shape, plus ``bias``.
    Sized by name: a step may need no logits (a prompt's first chunk), and zero rows of -1
    columns is no shape."""
    y = y.to(x.dtype).reshape(*x.shape[:-1], out_features)
    return y if bias is None else y + bias


def default_compute_dtype(in_features: int = GROUP) -> torch.dtype:
    """int8 (activations quantized per block in chapter 13's kernel) where the kernel runs and
    a row is whole blocks; else bf16 in PyTorch's weight-only ops."""
    if in_features % GROUP == 0 and cpu_quantized.load() is None:
        return torch.int8
    return torch.bfloat16


def _check_kernel(in_features: int) -> None:
    reason = cpu_quantized.load()
    if reason is None and in_features % GROUP:
        reason = f"in_features {in_features} is not a whole number of {GROUP}-weight blocks"
    if reason is not None:
        raise ValueError(f"compute_dtype=torch.int8 needs chapter 13's kernel: {reason}")


class Int4Linear(Linear):
    """``y = x W^T + b`` with ``W`` as Q4_1 blocks (CPU only). ``compute_dtype``: what the
    activations are inside the product. ``torch.int8`` (the default where it runs): chapter
    13's kernel over the file's blocks, repacked for it at load. Otherwise
    ``_weight_int4pack_mm_for_cpu`` in that dtype (fp32: the file's weights exactly, slowly;
    bf16: ``d`` and ``m + 8d`` rounded to bf16)."""

    def __init__(self, weight: Q4_1Weight, bias: torch.Tensor | None = None,
                 compute_dtype: torch.dtype | None = None) -> None:
        nn.Module.__init__(self)  # no dense weight: that is the point
        self._out_features, in_features = weight.q.shape
        self.compute_dtype = compute_dtype or default_compute_dtype(in_features)
        if self.compute_dtype == torch.int8:
            _check_kernel(in_features)
            self.register_buffer("blocks", cpu_quantized.pack_q4_1(weight.file_blocks()))
        else:
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                weight.q.to(torch.int32), 1))
            # [in / 32, out, 2]: per group and output row, (scale, zero) = (d, m + 8d).
            scales_and_zeros = torch.stack([weight.d, weight.m + 8 * weight.d], dim=-1)
            self.register_buffer("scales_and_zeros", scales_and_zeros.transpose(0, 1)
                                 .contiguous().to(self.compute_dtype))
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def out_features(self) -> int:
        return self._out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.compute_dtype == torch.int8:
            y = cpu_quantized.q4_1_linear(_flat(x, torch.float32), self.blocks, self.out_features)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                _flat(x, self.compute_dtype), self.packed, GROUP, self.scales_and_zeros)
        return _unflat(y, x, self.out_features, self.bias)


class Int8Linear(Linear):
    """``y = x W^T + b`` with ``W = scale * q`` per output row, q int8 in -127..127.
    ``compute_dtype`` as :class:`Int4Linear`'s: ``torch.int8``, chapter 13's kernel (fp32
    scales, the codes repacked for it); otherwise ``_weight_int8pack_mm`` in that dtype, the
    scale rounded to it before the codes are chosen, so the codes fit the scale the op uses."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 compute_dtype: torch.dtype | None = None) -> None:
        nn.Module.__init__(self)
        self._out_features = weight.shape[0]
        self.compute_dtype = compute_dtype or default_compute_dtype(weight.shape[1])
        if self.compute_dtype == torch.int8:
            _check_kernel(weight.shape[1])
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float16).tiny)
        scale = scale.to(torch.float32 if self.compute_dtype == torch.int8
                         else self.compute_dtype)
        self.register_buffer("scales", scale)
        codes = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
        if self.compute_dtype == torch.int8:
            self.register_buffer("groups", cpu_quantized.pack_int8(codes))
        else:
            self.register_buffer("codes", codes)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def out_features(self) -> int:
        return self._out_features

    def dequantize(self) -> torch.Tensor:
        if self.compute_dtype == torch.int8:
            codes = cpu_quantized.unpack_int8(self.groups, self.out_features)
        else:
            codes = self.codes
        return codes.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.compute_dtype == torch.int8:
            y = cpu_quantized.int8_linear(_flat(x, torch.float32), self.groups, self.scales)
        else:
            y = torch.ops.aten._weight_int8pack_mm(_flat(x, self.compute_dtype), self.codes,
                                                   self.scales)
        return _unflat(y, x, self.out_features, self.bias)


def int4_blocks(lm: LoadedModel) -> dict[str, Q4_1Weight] | None:
    """The shipped Q4_1 blocks of ``lm`` (SmolLM2's GGUF), or None for a model that does not
    ship as Q4_1."""
    if lm.name != "smollm2-135m":
        return None
    from ..core.models import smollm2_gguf

    return read_q4_1(smollm2_gguf(), lm.config)


def quantize_model(model: Model, bits: str, blocks: dict[str, Q4_1Weight] | None = None,
                   compute_dtype: torch.dtype | None = None) -> Model:
    """``model`` with its linears swapped: ``bits="int8"`` every linear :class:`Int8Linear`;
    ``"int4"`` every body linear :class:`Int4Linear` from ``blocks`` (HF names, as
    :func:`read_q4_1` gives; None: :func:`q4_1_quantize` of the fp32 weights) and the LM head
    :class:`Int8Linear`. The embedding and norms stay as they are."""
    if bits not in BITS:
        raise ValueError(f"unknown weights {bits!r}; choose {' or '.join(BITS)}")

    def factory(name: str, linear: Linear) -> Linear:
        match = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        if bits == "int8" or match is None:  # the LM head is int8 either way
            return Int8Linear(linear.weight, linear.bias, compute_dtype)
        if blocks is None:
            weight = q4_1_quantize(linear.weight)
        else:
            weight = Q4_1Weight.stack([blocks[f"model.layers.{match[1]}.{hf}"]
                                       for hf in FUSED[match[2]]])
        return Int4Linear(weight, linear.bias, compute_dtype)

    with torch.no_grad():
        return swap_linears(model, factory)


# One quantized model per loaded model and kind, shared by every engine over it (and so the
# compiled forward's graphs, keyed by model).
_QUANTIZED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def quantized(lm: LoadedModel, bits: str, compute_dtype: torch.dtype | None = None) -> Model:
    """``lm``'s model with ``bits`` weights (see :func:`quantize_model`; ``compute_dtype``
    None: each linear's default, chapter 13's kernel where it runs), built once."""
    if lm.device.type != "cpu":
        raise ValueError(f"quantized weights run on a CPU here (PyTorch's CPU weight-only "
                         f"kernels); {lm.name!r} is on {lm.device}")
    cache = _QUANTIZED.setdefault(lm.model, {})
    key = (bits, compute_dtype)
    if key not in cache:
        cache[key] = quantize_model(load(lm.model), bits,
                                    int4_blocks(lm) if bits == "int4" else None, compute_dtype)
    return cache[key]


def weight_bytes(model: Model) -> int:
    """Bytes a decode step reads: every linear's weights (codes and scales, or dense), the
    norms; not the embedding, of which a step reads one row a token (but a dense LM head tied
    to it is read whole)."""
    tensors = {t.data_ptr(): t for name, t in
               [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
               if name not in ("embed", "inv_freq")}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def quantized_compile_options(options: CompileOptions | None = None) -> CompileOptions:
    """Chapter 11's options for a quantized model: no oneDNN prepacking (it packs dense fp32
    weights; these have none), and ATen's weight-only kernels beside inductor's own C++
    templates for the autotuner to choose from (a template that cannot take a shape leaves
    ATen's op, not no choice at all)."""
    from .compiled import CompileOptions

    return dataclasses.replace(options or CompileOptions(), onednn_min_tokens=None,
                               onednn_min_tokens_bf16=None, onednn_min_tokens_avx2=None,
                               gemm_backends="CPP,ATEN")
