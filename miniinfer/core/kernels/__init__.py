"""Paged attention kernels (chapter 06): attention that reads K/V through block tables.

Three backends share one contract (layouts, block table padding and context lens are described
in :mod:`.reference`):

========== ====================================== ===================================
name       implementation                         runs on
========== ====================================== ===================================
flash-attn ``flash_attn_with_kvcache`` (decode)   CUDA, sm80+, block size % 256 == 0
triton     our kernel, :mod:`.triton_attention`   CUDA; CPU only through the interpreter
cpu        chapter 11's C++ op, :mod:`.cpu_decode`     CPU, where it builds
torch      the reference, :mod:`.reference`       anywhere
========== ====================================== ===================================

Chapter 11 wrote :mod:`.cpu_decode` for the compiled forward's graphs (a token-by-token paged
attention over the flat pool); as the ``cpu`` backend it serves the eager forwards too, by name (an engine's
``attention_backend="cpu"``). "auto" keeps the reference on a CPU: the eager chapters were
recorded with it, and in their engines, whose steps go to the matmuls and Python, the two
were within noise of each other.

Use::

    backend = get_backend("auto", device, block_size=k_cache.shape[1])
    backend.store_kv(key, value, k_cache, v_cache, slot_mapping)  # the new tokens first
    out = backend.decode(q, k_cache, v_cache, block_tables, context_lens, scale)

Triton on a CPU: ``@triton.jit`` decides once, when :mod:`.triton_attention` is imported (that
is, when this package is), whether the kernel is compiled for a GPU or run by Triton's
interpreter, and it reads ``TRITON_INTERPRET=1`` from the environment to choose the
interpreter. Set it in the shell (``TRITON_INTERPRET=1 python ...``) or before the first import
of ``miniinfer.core.kernels``; setting it later has no effect on the already-built kernel. The
interpreter runs on CPU tensors with numpy, thousands of times slower than a GPU: it is for
reading and testing the kernel, which is why "auto" never picks it.

Triton on CUDA: before Triton counts as available it is launched once on a tiny input
(:func:`.triton_attention.probe`). Triton builds a C launcher on first use, which needs a C
compiler; a machine without one falls back to the reference at start-up (with a warning that
says why) instead of failing in the middle of a run.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import MiniInferError, UnknownNameError
from . import cpu_decode, flash, reference, triton_attention
from .reference import store_kv

DecodeFn = Callable[..., torch.Tensor]
VarlenFn = Callable[..., torch.Tensor]


@dataclass(frozen=True, slots=True)
class AttentionBackend:
    """``decode(q, k_cache, v_cache, block_tables, context_lens, scale)`` and
    ``varlen(q, k_cache, v_cache, cu_seqlens_q, block_tables, context_lens, scale,
    max_seqlen_q=None)`` (None where the backend has no varlen kernel); ``store_kv`` is the
    same for every backend.

    ``plan_decode(block_tables, context_lens, block_size, max_context_len=None)``, where not
    None, returns ``run(q, k_cache, v_cache, scale)``, equal to ``decode`` with those tables
    and lens but with the work that does not depend on the layer done once: call it once per
    decode step and ``run`` in every layer. ``max_context_len`` is a bound on the lens known on
    the host, which spares the plan a read from the device. A GPU kernel reads the tables
    itself and needs no plan."""

    name: str
    decode: DecodeFn
    varlen: VarlenFn | None
    store_kv: Callable[..., None] = store_kv
    plan_decode: Callable[..., DecodeFn] | None = None


# Best first: the order "auto" tries them in.
BACKENDS: dict[str, AttentionBackend] = {
    "flash-attn": AttentionBackend("flash-attn", flash.paged_decode_attention, None),
    "triton": AttentionBackend("triton", triton_attention.paged_decode_attention,
                               triton_attention.paged_varlen_attention),
    "cpu": AttentionBackend("cpu", cpu_decode.paged_decode_attention,
                            cpu_decode.paged_varlen_attention,
                            plan_decode=cpu_decode.DecodePlan),
    "torch": AttentionBackend("torch", reference.paged_decode_attention,
                              reference.paged_varlen_attention,
                              plan_decode=reference.DecodePlan),
}


def unavailable_reason(name: str, device: torch.device | str,
                       block_size: int | None = None, head_dim: int | None = None) -> str | None:
    """Why backend ``name`` cannot run on ``device`` with KV blocks of ``block_size`` tokens
    and heads of ``head_dim`` (None: it can; an unknown size is assumed to suit it)."""
    device = torch.device(device)
    if name == "flash-attn":
        return flash.unavailable_reason(device, block_size)
    if name == "triton":
        reason = triton_attention.unavailable_reason(device, block_size)
        if reason is None and device.type == "cuda":
            reason = triton_attention.probe(device)  # once per device: a tiny launch
        return reason
    if name == "cpu":
        if device.type != "cpu":
            return f"it is a kernel for CPUs, not {device.type}"
        return cpu_decode.load() if head_dim is None else cpu_decode.unavailable(head_dim)
    if name == "torch":
        return None
    raise UnknownNameError(f"unknown attention backend {name!r}; "
                           f"known backends: {', '.join(BACKENDS)}")


def available_backends(device: torch.device | str, block_size: int | None = None) -> list[str]:
    """Backends that can run on ``device``, best first."""
    return [name for name in BACKENDS if unavailable_reason(name, device, block_size) is None]


def get_backend(name: str | None = None, device: torch.device | str = "cpu",
                block_size: int | None = None, head_dim: int | None = None) -> AttentionBackend:
    """The backend called ``name``, or for None/"auto" the best one for ``device``: flash-attn,
    then Triton on CUDA; the torch reference elsewhere (on a CPU even when the Triton
    interpreter is on, since it is far slower). Pass the cache's ``block_size`` so that "auto"
    skips flash-attn when the blocks are too small for it, and its ``head_dim`` so that a
    named backend that cannot take the heads says so here."""
    device = torch.device(device)
    if name is None or name == "auto":
        if device.type != "cuda":
            return BACKENDS["torch"]
        best = available_backends(device, block_size)[0]
        if best == "torch":
            # On a GPU the reference is a last resort, and several times slower: say why.
            warnings.warn(f"attention backend 'triton' cannot run on {device} "
                          f"({unavailable_reason('triton', device, block_size)}); "
                          f"falling back to the torch reference", RuntimeWarning, stacklevel=2)
        return BACKENDS[best]
    if reason := unavailable_reason(name, device, block_size, head_dim):
        raise MiniInferError(f"attention backend {name!r} is not available on {device}: {reason}; "
                             f"available: {', '.join(available_backends(device, block_size))}")
    return BACKENDS[name]


__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "available_backends",
    "get_backend",
    "store_kv",
    "unavailable_reason",
]
