"""One model definition for the Llama/Qwen2 family: our own modules, owning their weights.

Chapter 06's first direct forward walked HF's module tree by attribute path
(``model.model.layers[i].self_attn.q_proj``), and chapter 11's compiled forward and chapter
12's sharded one each walked it again, with a decoder-layer loop of their own. A new kind of
weight (int8, int4) would have had to teach every one of those loops. Here the model is built
once from HF's state dict and after that nothing reads HF's modules:

- :class:`Model` is embedding, decoder layers, final norm and LM head; a decoder layer is
  RMSNorm, one fused query/key/value projection, RoPE, attention, the output projection,
  RMSNorm, one fused gate/up projection, SiLU-times-up and the down projection (vLLM's and
  gpt-fast's layout: 4 matmuls a layer instead of 7, each wider). The decoder-layer loop is
  written once, in :meth:`Model.body`.
- Every matmul is a :class:`Linear` module, and :func:`swap_linears` is the one place a kind
  of matmul is chosen: dense (``F.linear``) here, oneDNN's prepacked one for chapter 11's
  larger buckets (:mod:`.onednn_linear`), quantized ones next. A swap copies the module tree,
  not the weights, so one model can be run several ways at once.
- Attention is a function the forward passes in: ``attend(layer, q, k, v, scale)`` stores the
  new tokens' K/V and attends. The eager forward passes chapter 06/08's metadata's
  (:class:`PagedAttend`); the compiled forward passes one of its own that reads the pool
  inside the graph. Both run the same :meth:`Model.body`.

The model owns its weights: the fused projections are new tensors (query, key and value rows
stacked; gate and up rows stacked), every other weight a copy, and HF's parameters become views
of them (:func:`load`), since the HF model stays in use by the static stages: the weights are
held once. The arithmetic is HF's: the same RMSNorm in fp32, the same rotary frequencies
(read from HF's rotary module at load), the same activation. A fused matmul may round its
outputs differently from three separate ones, so logits agree with HF's modules to fp32
rounding, not bit for bit.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN

from ..core import kv_cache

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
# Rotary types whose frequencies are fixed at load (the others change with the sequence length).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class PagedAttend(Protocol):
    """A step's attention metadata (chapter 06's, chapter 08's mixed batches)."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        """Store the new tokens' K/V and attend: ``[T, heads, dim]`` in and out."""


# attend(layer_idx, q, k, v, scale): a PagedAttend's ``attend``, or the compiled forward's own.
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def unsupported_reason(model: PreTrainedModel) -> str | None:
    """Why :class:`Model` cannot run ``model``'s architecture (None: it can)."""
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return (f"model type {config.model_type!r} is not one of "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return "it splits its projections (pretraining_tp > 1)"
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in STATIC_ROPE_TYPES:
        return f"its rotary embedding ({rope!r}) changes with the sequence length"
    return None


class Linear(nn.Module):
    """``y = x W^T + b``: the dense matmul, and the type every other kind of matmul replaces
    (:func:`swap_linears`). ``weight``: ``[out, in]``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = _parameter(weight)
        self.bias = None if bias is None else _parameter(bias)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _parameter(t: torch.Tensor) -> nn.Parameter:
    """``t`` as a frozen parameter (itself, where it is one: a swap shares the weights)."""
    return t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False)


class RMSNorm(nn.Module):
    """HF's Llama RMSNorm: normalised in fp32, scaled in the model's dtype."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    """Fused QKV projection, RoPE, the step's attention, output projection. ``qkv_sizes``:
    the query, key and value widths of ``qkv``'s output (a tensor-parallel rank's are its
    own heads')."""

    def __init__(self, layer_idx: int, qkv: Linear, out: Linear,
                 qkv_sizes: tuple[int, int, int], head_dim: int, scale: float) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.qkv, self.out = qkv, out
        self.qkv_sizes, self.head_dim, self.scale = qkv_sizes, head_dim, scale

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: AttendFn) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = (t.reshape(tokens, -1, self.head_dim)
                   for t in self.qkv(x).split(self.qkv_sizes, dim=-1))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attend(self.layer_idx, q, k, v, self.scale)
        return self.out(out.reshape(tokens, -1))


class FeedForward(nn.Module):
    """Fused gate/up projection, ``act(gate) * up``, down projection."""

    def __init__(self, gate_up: Linear, down: Linear, act: Callable) -> None:
        super().__init__()
        self.gate_up, self.down, self.act = gate_up, down, act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


class DecoderLayer(nn.Module):
    """Our names, not HF's (``attention.qkv``, ``feed_forward.down``), so that a test can tell
    a read of HF's modules (``self_attn.q_proj``) from ours."""

    def __init__(self, input_norm: RMSNorm, attention: Attention, post_norm: RMSNorm,
                 feed_forward: FeedForward) -> None:
        super().__init__()
        self.input_norm, self.attention = input_norm, attention
        self.post_norm, self.feed_forward = post_norm, feed_forward

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: AttendFn) -> torch.Tensor:
        hidden = hidden + self.attention(self.input_norm(hidden), cos, sin, attend)
        return hidden + self.feed_forward(self.post_norm(hidden))


class Model(nn.Module):
    """The whole model as three calls: :meth:`rope` (cos and sin of the step's positions),
    :meth:`body` (embedding and decoder layers) and :meth:`head` (final norm and LM head).
    The eager forward (:class:`~miniinfer.runner.direct.DirectForward`), the compiled one and
    the sharded one call these; they differ only in how attention reaches the pool and
    where the calls run."""

    def __init__(self, embed: torch.Tensor, layers: list[DecoderLayer], norm: RMSNorm,
                 lm_head: Linear | None, inv_freq: torch.Tensor, rope_scaling: float) -> None:
        super().__init__()
        self.embed = nn.Parameter(embed, requires_grad=False)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = lm_head  # None: a rank that does not sample (chapter 12)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rope_scaling = rope_scaling

    def rope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of each position, ``[T, 1, head_dim]`` in the model's dtype (broadcast
        over the heads), computed in fp32 as HF's rotary embedding does."""
        freqs = position_ids.float()[:, None] * self.inv_freq.float()[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        dtype = self.embed.dtype
        cos = (angles.cos() * self.rope_scaling).to(dtype)
        sin = (angles.sin() * self.rope_scaling).to(dtype)
        return cos[:, None], sin[:, None]

    def body(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             attend: AttendFn) -> torch.Tensor:
        """Embedding through the last decoder layer: the hidden states ``[T, hidden]``."""
        hidden = F.embedding(input_ids, self.embed)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, attend)
        return hidden

    def head(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The final norm and the LM head: logits ``[rows, vocab]`` (None without a head)."""
        if self.lm_head is None:
            return None
        return self.lm_head(self.norm(hidden))

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's ``apply_rotary_pos_emb`` for one tensor: ``x * cos + rotate_half(x) * sin``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


def swap_linears(model: nn.Module,
                 factory: Callable[[str, Linear], nn.Module | None]) -> nn.Module:
    """A copy of ``model``'s module tree with every :class:`Linear` replaced by
    ``factory(name, linear)`` (``name`` as ``named_modules`` spells it, ``layers.3.attention.qkv``;
    None drops it); the weights are shared, not copied, and ``model`` itself is unchanged.
    The one place a kind of matmul (prepacked, quantized, parallel) enters the model."""
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    swapped = copy.deepcopy(model, memo=shared)
    for name, linear in [(n, m) for n, m in swapped.named_modules() if isinstance(m, Linear)]:
        parent, _, attr = name.rpartition(".")
        setattr(swapped.get_submodule(parent), attr, factory(name, linear))
    return swapped


def from_state_dict(config, state: dict[str, torch.Tensor], inv_freq: torch.Tensor,
                    rope_scaling: float) -> tuple[Model, dict[str, torch.Tensor]]:
    """The model from HF's Llama/Qwen2 state dict (names as HF's ``state_dict()`` has them),
    owning every weight: the fused projections are new tensors, every other weight a copy
    (one per tensor the state dict holds: a tied LM head stays the embedding). Also returns,
    by the state dict's names, the tensor of ours each HF weight equals (a row view of a
    fused projection, or the copy itself)."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = kv_cache.head_dim(config)
    eps = config.rms_norm_eps
    act = ACT2FN[config.hidden_act]
    ours: dict[str, torch.Tensor] = {}
    copies: dict[tuple, torch.Tensor] = {}  # by what a tensor views: tied weights copied once

    def own(name: str) -> torch.Tensor:
        t = state[name]
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
        if key not in copies:
            copies[key] = t.clone(memory_format=torch.contiguous_format)
        ours[name] = copies[key]
        return ours[name]

    def fused(names: list[str]) -> torch.Tensor:
        whole = torch.cat([state[name] for name in names])
        ours.update(zip(names, whole.split([state[name].shape[0] for name in names]), strict=True))
        return whole

    def projection(*names: str) -> Linear:
        weights = [f"{name}.weight" for name in names]
        biases = [f"{name}.bias" for name in names if f"{name}.bias" in state]
        if biases and len(biases) != len(names):
            raise ValueError(f"{', '.join(names)}: some have a bias and some do not")
        one = len(names) == 1
        weight = own(weights[0]) if one else fused(weights)
        bias = None if not biases else own(biases[0]) if one else fused(biases)
        return Linear(weight, bias)

    layers = []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        attention = Attention(
            i, projection(*(f"{p}self_attn.{n}_proj" for n in "qkv")),
            projection(f"{p}self_attn.o_proj"), (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim),
            head_dim, head_dim ** -0.5)
        feed_forward = FeedForward(projection(f"{p}mlp.gate_proj", f"{p}mlp.up_proj"),
                                   projection(f"{p}mlp.down_proj"), act)
        layers.append(DecoderLayer(RMSNorm(own(f"{p}input_layernorm.weight"), eps), attention,
                                   RMSNorm(own(f"{p}post_attention_layernorm.weight"), eps),
                                   feed_forward))
    embed = own("model.embed_tokens.weight")
    head = projection("lm_head") if "lm_head.weight" in state else Linear(embed)
    model = Model(embed, layers, RMSNorm(own("model.norm.weight"), eps), head, inv_freq,
                  rope_scaling)
    return model, ours


# One model per HF model, built at first use and shared by every runner over it; weak, so a
# model let go takes ours with it.
_MODELS: weakref.WeakKeyDictionary[PreTrainedModel, Model] = weakref.WeakKeyDictionary()


def load(hf_model: PreTrainedModel) -> Model:
    """Our model over ``hf_model``'s weights (once per HF model). Raises ValueError where
    :func:`unsupported_reason` says it cannot.

    After it, HF's parameters are views of ours, so the weights are held once: HF's modules
    (the static stages run them) compute with the same numbers (a row slice of a contiguous
    matrix is contiguous), the fused projections do not double the memory of the query, key,
    value, gate and up weights, and the memory map HF loaded the file into is let go."""
    if hf_model in _MODELS:
        return _MODELS[hf_model]
    reason = unsupported_reason(hf_model)
    if reason:
        raise ValueError(reason)
    rotary = hf_model.model.rotary_emb  # its frequencies, once (a buffer, not in the state dict)
    with torch.no_grad():
        model, ours = from_state_dict(hf_model.config, hf_model.state_dict(), rotary.inv_freq,
                                      float(rotary.attention_scaling))
        for name, param in hf_model.named_parameters():
            if name in ours:
                param.data = ours[name]
    _MODELS[hf_model] = model.eval()
    return model
