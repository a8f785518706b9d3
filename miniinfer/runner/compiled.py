"""The direct forward compiled by PyTorch's own compiler (chapter 11).

Chapter 06's :class:`~miniinfer.runner.direct.DirectForward` removed HF's module tree,
and on a CPU it still decodes at HF-eager speed. Where a decode step's time goes there (the
guide's "CPU speed" section): the matmuls through ``F.linear`` read their weights well under the machine's copy bandwidth; RMSNorm, RoPE and SiLU-times-up are separate
passes over small tensors, each a dispatch; and the CPU attention reference copies every
request's blocks into a dense tensor in every layer of every step.

:class:`CompiledForward` has DirectForward's call contract and removes those costs with
``torch.compile`` (inductor):

- **freezing**: the weights become constants of the compiled graph, so inductor may repack them
  once, ahead of time, in the layout its GEMM kernels read fastest; with ``max_autotune`` and
  the C++ GEMM template (``max_autotune_gemm_backends="CPP"``) each projection picks the
  fastest of inductor's own micro-kernels for its shape;
- **fusion**: RMSNorm, RoPE, the residual adds and SiLU-times-up become a few fused loops;
- **attention without the copy**: each token's keys and values are read from the pool through
  its request's block table *inside* the compiled graph (an index, not a copy), so inductor
  fuses the read into the score and output reductions. Every token attends causally by its
  position, which covers decodes, prompt chunks and chapter 08's mixed batches with one
  formula; the new tokens' K/V are written into the pool in place first (the pool is an input
  of the graph that it mutates; written as an ``index_put_`` on the flat pool, inductor does it
  in place rather than copying the pool). That fused formula reads a context once per token,
  which suits decodes; a prompt chunk's tokens share one context. On a CPU every token attends
  through a C++ kernel the graph calls instead, which reads K/V in place the same way, a
  decode's context in one pass and a prompt chunk's tokens a tile at a time
  (:mod:`~miniinfer.core.kernels.cpu_decode`); where it does not build, from 64 tokens the
  tokens past a step's first 32 attend *by segment*: an op the graph calls, one SDPA per
  prompt chunk over its own request's K/V (:mod:`.compiled_attention`);
- **shape buckets**: the token count is padded up to a bucket (powers of two; 6, where a
  verification of 4 drafts sits, since past 4 rows each row adds to a CPU step's matmuls; and
  24 and 48 where a serving engine's decode batches sit: past 16 tokens a CPU step is
  compute-bound and every padded token costs its share), so a step only
  ever meets a graph compiled for its bucket; the context width is a dynamic dimension of the
  graph (the attention loops run to a symbolic bound). After warm-up nothing recompiles.
  A step runs as the cheapest chunks of buckets (:func:`chunk_sizes`: 259 tokens as 256 + 3,
  not padded to 512; prompts longer than the largest bucket in several), each chunk's
  attention reading the K/V the previous chunk wrote, as chunked prefill does.
- compiled graphs (and autotuning results) persist in inductor's on-disk cache (its own
  default place, ``/tmp/torchinductor_<user>``, or ``TORCHINDUCTOR_CACHE_DIR``), so a second
  process reuses them instead of compiling again.
- **one packed copy of the weights per kind of GEMM**: every bucket's graph packs the weights
  for its GEMM template the same way, and inductor keeps each graph's packed copy (and, for
  its in-memory "mega-cache", the bytes of each cache entry again). On a CPU the copies that
  equal one already held share its memory, the cache entries' bytes are let go, and the heap
  memory a compile freed is given back to the OS. The weights are then held three times: as
  they are (the model's), packed for the template and packed for oneDNN.

Where ``torch.compile`` cannot run (a torch without the needed inductor, no C++ compiler, a
platform inductor cannot build for), the forward says why in one warning and runs the eager
direct forward. On CUDA the graphs are compiled with ``mode="reduce-overhead"`` (CUDA graphs).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import time
import warnings
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch._inductor.codecache import PyCodeCache
from transformers import PreTrainedModel

from ..core.errors import MiniInferError, one_line
from ..core.hardware import device_isa
from ..core.kernels import cpu_decode
from ..core.kv_cache import PagedKVCache
from .attention import PagedAttention
from .compiled_attention import fused_paged_attention, segment_attention
from .direct import DirectForward
from .model import Model
from .onednn_linear import onednn_available, prepacked
from .step import StepBatch

# Graphs dynamo may keep per compiled function (see CompiledForward.__init__).
RECOMPILE_LIMIT = 512
# The oldest torch whose inductor has the C++ GEMM template and freezing on CPU as used here.
MIN_TORCH = (2, 6)
# Part of every cache key of our graphs (torch.compiler.config.cache_key_tag), so that graphs
# that a machine's inductor cache holds from an earlier version of this forward are not found:
# a frozen graph's key does not cover what its weights are views of, and the graphs compiled
# while the merged projections were views into the model's weights (see onednn_linear) hold
# wrongly packed weights. Change it whenever cached graphs must not be reused.
CACHE_KEY_TAG = "miniinfer-compiled-3"


@dataclass(slots=True)
class CompileOptions:
    """How the forward is compiled. ``token_buckets``: the token counts graphs are compiled
    for (a step's count is padded up to the next one; past the largest, the tokens run in
    chunks of it); ``max_autotune``: let each GEMM pick its fastest kernel (slow to compile,
    cached on disk) among ``gemm_backends``, in the buckets up to ``autotune_max_tokens``;
    ``freezing``: weights as constants of the graph, prepacked."""

    token_buckets: tuple[int, ...] = (1, 2, 4, 6, 8, 16, 24, 32, 48, 64, 128, 256, 512)
    max_autotune: bool = True
    # Where a step reads more weights than it computes with (decodes, small mixed steps) the
    # GEMM kernel decides the step's time (at 32 tokens autotuning still made the body 5-7%
    # faster on our CPU); past this, a step is compute-bound and MKL does as well, so the
    # larger buckets skip autotuning and compile in a fraction of the time.
    autotune_max_tokens: int = 32
    # Inductor's own C++ GEMM template only: its autotuner times each candidate on weights
    # that stay in cache, while a decode step streams every weight from memory once, and
    # there it picked MKL for batch-8 GEMMs that the template runs faster.
    gemm_backends: str = "CPP"
    # From this many tokens a bucket's matmuls run through oneDNN over weights reordered for
    # it once, at load (onednn_linear): what vLLM's CPU steps spend their time in. On our CPU
    # the step of 16 decodes took 0.75x the autotuned template's time, of 32 0.6x; at 1-8
    # rows the template was as fast or faster (at 1 row, 0.55x oneDNN's). CPU only; None: never.
    onednn_min_tokens: int | None = 16
    # The same threshold for a bfloat16 model: there the template's step of 8 tokens was 1.7x
    # oneDNN's (52 vs 30 ms, mixed contexts of 50-380 on our CPU), at 1-4 rows 0.7x.
    onednn_min_tokens_bf16: int | None = 8
    # The fp32 threshold on a CPU whose widest vectors are AVX2. The figures above are from a
    # Zen 4 (AVX-512); on a Zen 3 (AVX2) oneDNN lost to the autotuned template in every
    # autotuned bucket from 16: a served step of 32 decodes (contexts 50-380) took 213 ms
    # through oneDNN and 181 ms through the template, of 24 decodes 195 and 157 ms, of 16 177
    # and 130 ms (medians of 24 steps, the two interleaved), so there oneDNN starts past them.
    onednn_min_tokens_avx2: int | None = 48
    freezing: bool = True
    # What running one more chunk costs, in tokens' worth of a compute-bound step: reading
    # every weight again, about as long as 16 tokens' matmuls on our CPU (chunk_sizes).
    chunk_cost_tokens: int = 16
    # On a CPU, every token attends through a C++ kernel (core.kernels.cpu_decode) where it
    # builds: a decode reads its context at about twice the speed of inductor's fused loops,
    # and a prompt chunk's tokens go a tile at a time, faster than an SDPA per chunk at every
    # context we measured. False (or where it does not build): the fused formula, compiled by
    # inductor, with prompt chunks by segment (the next two options).
    attention_kernel: bool = True
    # Without the kernel, from this many tokens a bucket attends by segment (an SDPA per prompt
    # chunk, see compiled_attention), not with the fused formula, whose per-token reads of a
    # shared context cost more than the step's matmuls at 512-token prompt chunks. CPU only
    # (the op reads its segments back to the host); None: every bucket fuses.
    segment_attention_min_tokens: int | None = 64
    # In those buckets the first this many tokens, where chapter 08's mixed steps put their
    # decodes, still attend fused: the fused formula reads a decode's context in place, where
    # the op would copy it (3-4x slower per decode on our CPU).
    fused_attention_rows: int = 32
    # Every loop and GEMM template inductor generates for a CPU reports itself to
    # torch.profiler by name (inductor's cpp.enable_kernel_profile), so a profile splits the
    # graphs' own time (chapter 11's step profile). A setting of inductor's, so its graphs are
    # compiled and cached apart from the stage's; off, the stage never pays for it.
    kernel_profile: bool = False
    # After a bucket's first call, run only the guards that choose among its graphs (torch's
    # skip_guard_eval_unsafe): safe because every graph is static but for the context width,
    # compiled once per bucket, and nothing the other guards check changes after warm-up.
    skip_guards: bool = True
    # On a CPU, each graph's kernels called from C++ (inductor's cpp_wrapper), not from a
    # Python wrapper a kernel at a time (a GPU's graphs replay as CUDA graphs instead).
    cpp_wrapper: bool = True

    def __post_init__(self) -> None:
        buckets = self.token_buckets
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise MiniInferError(f"token_buckets must be increasing token counts >= 1, "
                                 f"got {buckets!r}")
        for name, least in (("fused_attention_rows", 1), ("chunk_cost_tokens", 0),
                            ("segment_attention_min_tokens", 1), ("onednn_min_tokens", 1),
                            ("onednn_min_tokens_bf16", 1), ("onednn_min_tokens_avx2", 1)):
            value = getattr(self, name)
            if value is None and "_min_tokens" in name:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise MiniInferError(f"{name} must be a whole number >= {least}, got {value!r}")


def compile_unavailable_reason(device: torch.device) -> str | None:
    """Why ``torch.compile`` cannot run the forward on ``device`` (None: it can): too old a
    torch, a Python dynamo does not support, no C++ compiler (looked for directly: a graph
    served from inductor's cache would not need one, the next new bucket would), or anything
    else that stops inductor from compiling and running one tiny function here."""
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if version < MIN_TORCH:
        return f"torch {torch.__version__} is older than {'.'.join(map(str, MIN_TORCH))}"
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile does not support this Python"
    try:
        if device.type == "cpu":
            from torch._inductor.cpp_builder import get_cpp_compiler
            get_cpp_compiler()
        probe = torch.compile(lambda x: x * 2 + 1, dynamic=False, fullgraph=True)
        probe(torch.ones(3, device=device))
    except Exception as error:  # noqa: BLE001 (whatever stops inductor here is the reason)
        return one_line(error)
    return None


class _Body(nn.Module):
    """The model's body over ``T`` tokens (a bucket's count), attending through the pool inside
    the graph. The model is held, not copied: its parameters are what freezing makes constants
    of."""

    def __init__(self, model: Model, block_size: int, by_segment: bool, fused_rows: int,
                 token_kernel: bool = False) -> None:
        super().__init__()
        # Whether tokens past the first `fused_rows` attend through segment_attention.
        self.by_segment, self.fused_rows = by_segment, fused_rows
        # Whether those first tokens (every token, when not by segment) attend through the
        # C++ kernel instead of the fused formula.
        self.token_kernel = token_kernel
        self.model = model
        self.block_size = block_size

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                write_rows: torch.Tensor, token_tables: torch.Tensor,
                pool: torch.Tensor) -> torch.Tensor:
        """``cos``/``sin``: the rotary embedding of each token's position, ``[T, 1, head_dim]``;
        ``pool``: the whole KV pool as ``[layers * 2 * slots, kv_heads, head_dim]`` (layer
        ``i``'s K at ``2i * slots``, its V at ``(2i + 1) * slots``); ``token_tables``: each
        token's block table ``[T, W]``; ``write_rows``: the row whose K/V each token writes
        (itself, or for padding a real token writing the same values again)."""
        tokens = input_ids.shape[0]
        block_size = self.block_size
        num_slots = pool.shape[0] // (2 * self.model.num_layers)
        # The first `fused` tokens attend with the fused formula, the rest (if any) by segment.
        fused = min(self.fused_rows, tokens) if self.by_segment else tokens
        # Slot of each context position of each fused token's request, and which it sees.
        offsets = torch.arange(block_size, device=pool.device)
        context_slots = (token_tables[:fused, :, None].long() * block_size
                         + offsets).flatten(1)
        positions = torch.arange(context_slots.shape[1], device=pool.device)
        visible = positions[None, :] <= position_ids[:fused, None]  # [fused, context]
        real = write_rows == torch.arange(tokens, device=pool.device)  # padding writes again

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   scale: float) -> torch.Tensor:
            k_base, v_base = 2 * i * num_slots, (2 * i + 1) * num_slots
            pool.index_put_((slot_mapping + k_base,), k[write_rows])
            pool.index_put_((slot_mapping + v_base,), v[write_rows])
            if self.token_kernel:
                out = cpu_decode.paged_token_attention(
                    q[:fused], pool, k_base, v_base, block_size, token_tables[:fused],
                    position_ids[:fused], scale)
            else:
                out = fused_paged_attention(q[:fused], pool[context_slots + k_base],
                                            pool[context_slots + v_base], visible, scale)
            if fused < tokens:
                out = torch.cat([out, segment_attention(
                    q[fused:], pool, k_base, v_base, block_size, real[fused:],
                    position_ids[fused:], token_tables[fused:], scale)])
            return out

        return self.model.body(input_ids, cos, sin, attend)


class _Head(nn.Module):
    """The final norm and the LM head over the rows that need logits."""

    def __init__(self, model: Model) -> None:
        super().__init__()
        self.model = model

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.head(hidden)


# Each model's compiled functions, by options (see CompiledForward.__init__); weak, so a
# model let go takes its graphs with it.
_SHARED: weakref.WeakKeyDictionary[PreTrainedModel, dict[tuple, tuple[dict, dict, set]]] = \
    weakref.WeakKeyDictionary()


# Each model's copy with prepacked oneDNN linears, made when a graph first needs it.
_PREPACKED: weakref.WeakKeyDictionary[Model, Model] = weakref.WeakKeyDictionary()


# Each model's graph constants by (shape, strides, dtype, device), for share_constants.
_CONSTANTS: weakref.WeakKeyDictionary[PreTrainedModel, dict[tuple, list[torch.Tensor]]] = \
    weakref.WeakKeyDictionary()
# Constants smaller than this are not worth comparing.
SHARE_MIN_BYTES = 1 << 20


class CompiledForward:
    """DirectForward compiled: ``forward(batch)`` -> logits of the rows ``batch.logits_rows``
    picks (None: every token), ``[rows, vocab]``, for a step batch over ``kv_cache``'s pool
    (the graphs attend through the pool themselves; ``attention`` is the eager forward's, where
    the device cannot compile: by default the best backend over the pool).

    Graphs compile lazily, one per token bucket the first time a step needs it (or all at once
    with :meth:`warm_up`); ``compile_seconds`` says what each took. ``reason_eager`` is why the
    forward runs eagerly instead (None when compiled)."""

    def __init__(self, model: PreTrainedModel, kv_cache: PagedKVCache,
                 options: CompileOptions | None = None, *,
                 attention: PagedAttention | None = None) -> None:
        self.options = options or CompileOptions()
        if attention is None:  # the best backend over the pool, as a runner would choose
            attention = PagedAttention.over([(k, v) for k, v in kv_cache.kv], kv_cache.kv.device,
                                            kv_cache.block_size)
        self.eager = DirectForward(model, attention)
        self.model = self.eager.model
        self.kv_cache = kv_cache
        self.device = kv_cache.kv.device
        self.block_size = kv_cache.block_size
        self.dtype = kv_cache.kv.dtype
        # The vectors the CPU's kernels use (decides where oneDNN's matmuls pay; None on a GPU).
        self.cpu_isa = device_isa(self.device) if self.device.type == "cpu" else None
        # The pool as one flat tensor of slot rows (a view: the same memory the engine owns).
        self.pool = kv_cache.kv.view(-1, kv_cache.kv_heads, kv_cache.head_dim)
        self.compile_seconds: dict[tuple[str, int], float] = {}
        self.num_compiles = 0  # graphs compiled by this forward, recompiles included
        # Bytes of graph constants that share another graph's equal constant (see _run).
        self.shared_constant_bytes = 0
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # see rope()
        # Inductor's config that changes what a graph is: patched in while dynamo traces, not
        # only while inductor compiles (what torch.compile's options= covers), since freezing
        # decides how dynamo lifts the weights; and passed as options= too (see _compile).
        self._graph_config = {"freezing": self.options.freezing,
                              "cpp.enable_kernel_profile": self.options.kernel_profile,
                              "cpp_wrapper": self.options.cpp_wrapper
                              and self.device.type == "cpu"}
        # Patched around every call too: one graph per bucket, for the body and the head each,
        # is more than dynamo keeps for one function by default (8); forwards with other
        # options (chapter 11's ablation) add theirs to the same code, and past the limit
        # dynamo would silently run a bucket eagerly. Our graphs are one per bucket and kind
        # by design (a test keeps the count flat after warm-up), so the limit only has to be
        # out of the way. Prebuilt patches: entering one costs ~7 us.
        self._patches = (
            torch._inductor.config.patch(self._graph_config),
            torch._dynamo.config.patch(recompile_limit=max(
                torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)),
            torch.compiler.config.patch(
                cache_key_tag=torch.compiler.config.cache_key_tag + CACHE_KEY_TAG),
        )
        self.reason_eager = compile_unavailable_reason(self.device)
        if self.reason_eager is not None:
            self.reason_fused = self.reason_eager
            warnings.warn(f"compiled forward unavailable ({self.reason_eager}); running the "
                          f"eager direct forward", RuntimeWarning, stacklevel=2)
            return
        # Why the fused tokens attend with the fused formula, not the C++ kernel (None: they
        # use the kernel). Not on a GPU, where the graphs run as CUDA graphs.
        if not self.options.attention_kernel:
            self.reason_fused = "off in the options"
        elif self.device.type != "cpu":
            self.reason_fused = "not on a CPU"
        else:
            self.reason_fused = cpu_decode.unavailable(kv_cache.head_dim)
            if self.reason_fused is not None:
                warnings.warn(f"C++ attention kernel unavailable ({self.reason_fused}); "
                              f"attending with the fused formula", RuntimeWarning, stacklevel=2)
        # One compiled function per kind of bucket (autotuned or not; attending fused or by
        # segment), each with its graphs, shared with every other forward over this model with
        # the same options and block size: a serving benchmark builds an engine per token
        # budget, and each would otherwise trace and load every bucket again (minutes on a
        # CPU, even from inductor's disk cache), and pile up graphs on the same code.
        shared = _SHARED.setdefault(model, {})
        key = (dataclasses.astuple(self.options), self.block_size, str(self.device),
               self.reason_fused is None)
        if key not in shared:
            # The oneDNN graphs run the model with its linears swapped for prepacked ones
            # (packed once per model, kept while the model lives): packed when a bucket first
            # needs them, so a run that never meets one (a short generate) holds no such copy.
            shared[key] = ({}, {}, set())
        # The (graph, bucket) pairs any sharer has compiled (see _run).
        self._graphs, self._heads, self._compiled = shared[key]
        # The graph constants every later graph over this model may share (see _run).
        self._constants = _CONSTANTS.setdefault(model, {})
        if self.device.type == "cuda":
            # CUDA graphs replay fixed addresses: the pool, which every step writes, must be
            # an address the graphs may keep (mutating any other input would disable them).
            torch._dynamo.mark_static_address(self.pool)

    @property
    def compiled(self) -> bool:
        return self.reason_eager is None

    def _model_for(self, gemm: str) -> Model:
        if gemm != "onednn":
            return self.model
        packed = _PREPACKED.get(self.model)
        if packed is None:
            packed = _PREPACKED[self.model] = prepacked(self.model)
        return packed

    def body(self, gemm: str, by_segment: bool):
        """The compiled body whose matmuls are ``gemm``'s, made the first time it is asked."""
        graph = self._graphs.get((gemm, by_segment))
        if graph is None:
            graph = self._graphs[gemm, by_segment] = self._compile(
                _Body(self._model_for(gemm), self.block_size, by_segment,
                      self.options.fused_attention_rows, self.reason_fused is None),
                gemm == "template")
        return graph

    def head(self, gemm: str):
        graph = self._heads.get(gemm)
        if graph is None:
            graph = self._heads[gemm] = self._compile(_Head(self._model_for(gemm)),
                                                      gemm == "template")
        return graph

    @property
    def _onednn_min_tokens(self) -> int | None:
        """From how many tokens a bucket's matmuls run through oneDNN (None: never)."""
        if not onednn_available(self.device, self.dtype):
            return None
        if self.dtype == torch.bfloat16:
            return self.options.onednn_min_tokens_bf16
        if self.cpu_isa == "AVX2":
            return self.options.onednn_min_tokens_avx2
        return self.options.onednn_min_tokens

    @property
    def _uses_onednn(self) -> bool:
        return self._onednn_min_tokens is not None

    def _compile(self, module: nn.Module, tuned: bool):
        autotune = self.options.max_autotune and tuned
        if self.device.type == "cuda":
            # mode="reduce-overhead" (CUDA graphs) spelt as options, which torch.compile does
            # not take together with a mode; GEMMs autotune over inductor's default backends.
            inductor = {"triton.cudagraphs": True, "max_autotune": autotune}
        else:
            inductor = {"max_autotune": True,
                        "max_autotune_gemm_backends": self.options.gemm_backends} \
                if autotune else {}
        # Dynamo keeps compiled graphs on the code they came from (every _Body's forward) and
        # hands them to any torch.compile whose options are equal: a forward that differed
        # only in config patched around the call (freezing, the kernel profile) ran the first
        # such forward's graphs. In options= they make the compiles differ.
        inductor.update(self._graph_config)
        # One static graph per bucket (dynamic=False: no automatic dynamic shapes, which would
        # swap a bucket's graph for a slower generic one); only the context width is dynamic.
        return torch.compile(module, dynamic=False, fullgraph=True, options=inductor)

    def chunk_sizes(self, num_tokens: int) -> list[int]:
        """How a step of ``num_tokens`` runs (see :func:`chunk_sizes`)."""
        return chunk_sizes(num_tokens, self.options.token_buckets, self.options.chunk_cost_tokens)

    def bucket(self, num_tokens: int) -> int:
        """The token count a step of ``num_tokens`` is padded to (the largest bucket past it:
        such steps run in chunks of it)."""
        buckets = self.options.token_buckets
        return next((b for b in buckets if b >= num_tokens), buckets[-1])

    def __call__(self, batch: StepBatch) -> torch.Tensor:
        if not self.compiled:
            return self.eager(batch)
        # Each token's block table: its request's row.
        tables = batch.block_tables[batch.token_rows.long()]
        # One dtype and layout per input whatever the engine staged: each is part of a
        # graph's guards, and a mismatch would compile the bucket again.
        input_ids, position_ids = batch.input_ids.long(), batch.positions.long()
        slot_mapping = batch.slot_mapping.long()
        logits_rows = batch.logits_rows
        # Only the blocks up to the furthest position anyone sees (on a CPU the read costs no
        # wait; on CUDA it would, so the tables keep their width).
        highest = None  # the furthest position, where reading it costs no wait
        if self.device.type == "cpu":
            highest = int(position_ids.max())
            tables = tables[:, :-(-(highest + 1) // self.block_size)]
        if tables.shape[1] < 2:  # a dynamic dimension of size 1 would be specialised
            tables = F.pad(tables, (0, 2 - tables.shape[1]))
        # Standard strides even where .contiguous() would keep a view's (a row of one).
        tables = tables.to(torch.int32).clone(memory_format=torch.contiguous_format)
        num_tokens = input_ids.shape[0]
        parts, start = [], 0
        for size in self.chunk_sizes(num_tokens):
            end = start + size
            parts.append(self._body(input_ids[start:end], position_ids[start:end],
                                    slot_mapping[start:end], tables[start:end], highest)[:size])
            start = end
        hidden = parts[0] if len(parts) == 1 else torch.cat(parts)
        if logits_rows is None:
            return self._head(hidden, num_tokens)
        return self._head(hidden[logits_rows], len(logits_rows))

    def _body(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
              slot_mapping: torch.Tensor, tables: torch.Tensor,
              highest: int | None = None) -> torch.Tensor:
        """The body over one bucket's worth of tokens (``highest``: a bound on their positions
        where the caller knows one); returns ``[bucket, hidden]`` (rows past
        the real tokens are padding)."""
        num_tokens = input_ids.shape[0]
        bucket = self.bucket(num_tokens)
        pad = bucket - num_tokens
        rows = torch.arange(bucket, device=input_ids.device)
        if pad:
            # Padding tokens write the first real token's K/V to its slot again: the same
            # values to the same place, so the order of the duplicate writes cannot matter.
            rows[num_tokens:] = 0
            input_ids, position_ids = F.pad(input_ids, (0, pad)), F.pad(position_ids, (0, pad))
            slot_mapping = torch.cat([slot_mapping, slot_mapping[:1].expand(pad)])
            tables = F.pad(tables, (0, 0, 0, pad))
        # The rotary embedding outside the graph: inside, inductor would recompute its cos
        # and sin wherever RoPE is read, which in attention is once per context position.
        cos, sin = self.rope(position_ids, highest)
        torch._dynamo.mark_dynamic(tables, 1)
        graph = self.body(self._gemm(bucket), self._by_segment(bucket))
        return self._run(("body", bucket), graph, input_ids, position_ids, cos, sin,
                         slot_mapping, rows, tables, self.pool)

    def rope(self, position_ids: torch.Tensor,
             highest: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's ``rope(position_ids)``, read from a table of every position up to
        ``highest`` (made once, grown by doubling) where that bound is known: two lookups
        instead of a dozen small ops a step, and the same values, each row computed from its
        position by the same arithmetic."""
        if highest is None:
            return self.model.rope(position_ids)
        if self._rope_table is None or highest >= self._rope_table[0].shape[0]:
            size = max(1024, 1 << highest.bit_length())
            self._rope_table = self.model.rope(torch.arange(size, device=position_ids.device))
        cos, sin = self._rope_table
        return cos[position_ids], sin[position_ids]

    def _head(self, hidden: torch.Tensor, num_rows: int) -> torch.Tensor:
        """Logits of the first ``num_rows`` rows of ``hidden`` (more rows may be padding)."""
        chunk = self.options.token_buckets[-1]
        if num_rows > chunk:
            return torch.cat([self._head(hidden[s : min(s + chunk, num_rows)],
                                         min(chunk, num_rows - s))
                              for s in range(0, num_rows, chunk)])
        bucket = self.bucket(num_rows)
        if hidden.shape[0] != bucket:
            hidden = F.pad(hidden[:num_rows], (0, 0, 0, bucket - num_rows))
        return self._run(("head", bucket), self.head(self._gemm(bucket)), hidden)[:num_rows]

    def _gemm(self, bucket: int) -> str:
        """Which matmuls a bucket's graph runs: ``onednn`` (prepacked, see onednn_linear),
        ``template`` (inductor's autotuned GEMM template) or ``aten`` (MKL, untuned)."""
        threshold = self._onednn_min_tokens
        if threshold is not None and bucket >= threshold:
            return "onednn"
        return "template" if bucket <= self.options.autotune_max_tokens else "aten"

    def _by_segment(self, bucket: int) -> bool:
        """Whether a bucket's tokens past its fused rows attend by segment: on a CPU, from
        ``segment_attention_min_tokens``, where the C++ kernel does not attend them all."""
        threshold = self.options.segment_attention_min_tokens
        return (self.device.type == "cpu" and self.reason_fused is not None
                and threshold is not None and bucket >= threshold)

    def _run(self, key: tuple[str, int], graph, *args: torch.Tensor) -> torch.Tensor:
        """``graph(*args)``, timing it into ``compile_seconds[key]`` when it compiled."""
        stats = counters["stats"]
        graphs = stats["unique_graphs"]
        start = time.perf_counter()
        # A bucket's first call compiles it: with oneDNN off, so that freezing leaves the
        # weights to inductor's own GEMM template (packed as plain tensors) instead of packing
        # them as oneDNN/MKL tensors, which inductor's on-disk cache cannot store (every
        # process would compile again). The compiled graph does not depend on the flag.
        first = key not in self._compiled
        loaded = len(_loaded_graph_modules())
        if self.device.type == "cuda":
            # Under CUDA graphs (inductor's cudagraph trees) a graph's output lives in memory
            # its next replay overwrites, and feeding one graph's output to the next (body to
            # head) failed on an H200 ("accessing tensor output of CUDAGraphs that has been
            # overwritten"). Each call starts a step of its own and its output is copied out:
            # a hidden state or a step's logits, small beside the weights the step reads.
            torch.compiler.cudagraph_mark_step_begin()
        # Any call may compile (a first one, or a recompile: which the guards decide), so
        # none adds to the in-memory artifact record (about 12 us a call).
        out = None
        if not first and self.options.skip_guards:
            # A bucket's graph, once compiled, is chosen by the guards that told the graphs
            # apart when they were compiled (the token count), not by all of them: a frozen
            # model's every guard is checked otherwise, on every call of every step. Where those guards find no graph (a shape no graph was compiled for),
            # torch refuses before running anything, and the call below compiles one.
            try:
                with _guards_skipped():
                    out = graph(*args)
            except RuntimeError as error:
                if "skip_guard_eval_unsafe" not in str(error):
                    raise
        if out is None:
            with self._patches[0], self._patches[1], self._patches[2], \
                    _onednn_disabled() if first else nullcontext(), _no_mega_cache():
                out = graph(*args)
        if self.device.type == "cuda":
            out = out.clone()
        if first:
            self._compiled.add(key)
        if stats["unique_graphs"] != graphs:
            self.num_compiles += stats["unique_graphs"] - graphs
            self.compile_seconds[key] = self.compile_seconds.get(key, 0.0) \
                + time.perf_counter() - start
            if self.device.type == "cpu":
                self.shared_constant_bytes += share_constants(
                    _loaded_graph_modules()[loaded:], self._constants)
                _return_freed_heap()
        return out

    def warm_up(self, token_counts: Sequence[int] | None = None) -> dict[tuple[str, int], float]:
        """Compile the graphs for ``token_counts`` (default: every bucket) now, so that no
        timed step pays for it; returns the compile seconds of each graph."""
        if not self.compiled:
            return {}
        counts = self.options.token_buckets if token_counts is None else token_counts
        # Warm-up tokens write their K/V to slot 0 of every layer: keep what is there.
        first_slots = torch.arange(2 * self.kv_cache.num_layers, device=self.device) \
            * (self.pool.shape[0] // (2 * self.kv_cache.num_layers))
        saved = self.pool[first_slots].clone()
        with torch.inference_mode():
            for n in sorted({self.bucket(n) for n in counts}):
                # Three tensors, not one thrice: dynamo guards on which inputs alias.
                ids, positions, slots = torch.zeros(3, n, dtype=torch.long,
                                                    device=self.device).unbind()
                tables = torch.zeros(n, 2, dtype=torch.int32, device=self.device)
                self._head(self._body(ids, positions, slots, tables), n)
            self.pool.index_copy_(0, first_slots, saved)
        return dict(self.compile_seconds)


@functools.lru_cache(maxsize=4096)
def chunk_sizes(num_tokens: int, buckets: tuple[int, ...], chunk_cost_tokens: int) -> list[int]:
    """How the compiled forward runs a step of ``num_tokens``: consecutive chunks of these many
    tokens, each a whole bucket but the last, which is padded up to its bucket. Each chunk's
    attention reads the K/V the chunks before it wrote, as chunked prefill does, so any split
    is correct; this is the cheapest, counting a padded token as a real one (past a few tokens
    a CPU step's time grows with its token count) and each chunk as ``chunk_cost_tokens``
    more: 259 tokens run as 256 + 3, not padded to 512. (Read-only: the list is cached.)"""
    # (cost, first chunk's size) of the cheapest split of every count m up to num_tokens, from
    # the smallest up: the best over buckets of a whole bucket then the best split of the
    # rest, or the bucket padded over all m (on a tie the larger first chunk, so the padded
    # one comes last).
    plans = [(0, 0)]
    for m in range(1, num_tokens + 1):
        cost, first = min((b + chunk_cost_tokens + (plans[m - b][0] if b < m else 0), -min(b, m))
                          for b in buckets)
        plans.append((cost, -first))
    sizes = []
    while num_tokens:
        sizes.append(plans[num_tokens][1])
        num_tokens -= sizes[-1]
    return sizes


def _loaded_graph_modules() -> list:
    """The Python modules of every graph inductor has loaded, oldest first (inductor keeps
    this list to clean up after them; empty where a torch does not have it)."""
    return getattr(PyCodeCache, "modules", [])


def share_constants(modules: Sequence, held: dict[tuple, list[torch.Tensor]]) -> int:
    """Make each tensor constant of the graph ``modules`` that equals one in ``held`` (same
    shape, strides, dtype, device and values) share that tensor's memory; the others join
    ``held``. Returns the bytes of the constants that now share (their copies are freed unless
    another view still holds one).

    A frozen graph's constants are module globals its code reads at every call, also held by
    inductor's record of the graph; ``set_`` repoints the tensor object itself, so every holder
    sees the shared memory and the copy is freed. Parameters are never touched (they are the
    model's own, already shared)."""
    saved = 0
    for module in modules:
        for value in list(vars(module).values()):
            if (not isinstance(value, torch.Tensor) or isinstance(value, nn.Parameter)
                    or value.requires_grad
                    or value.untyped_storage().nbytes() < SHARE_MIN_BYTES):
                continue
            same_layout = held.setdefault(
                (tuple(value.shape), value.stride(), value.dtype, value.device), [])
            ptr = value.untyped_storage().data_ptr()
            if any(t.untyped_storage().data_ptr() == ptr for t in same_layout):
                continue
            equal = next((t for t in same_layout if torch.equal(t, value)), None)
            if equal is None:
                same_layout.append(value)
                continue
            saved += value.numel() * value.element_size()
            with torch.inference_mode(value.is_inference()):
                value.set_(equal)
    return saved


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim`` (None where the C library has none: macOS, musl)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def _return_freed_heap() -> None:
    """Give the heap memory a compile freed back to the OS. Compiling (or loading) a graph
    allocates and frees many weight-sized tensors (packed copies, copies that share_constants
    then frees), each under glibc's threshold for a memory map of its own, so they come from
    the heap and freeing them leaves it as large as it was: resident, unused memory."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@contextmanager
def _no_mega_cache() -> Iterator[None]:
    """Compile without adding to torch's in-memory record of every cache artifact loaded or
    saved (``torch.compiler.save_cache_artifacts``' "mega-cache"), which keeps each entry's
    bytes for the life of the process: with frozen weights, a copy of them per graph. We use
    the on-disk cache only."""
    try:
        from torch.compiler._cache import CacheArtifactManager
    except ImportError:  # a torch without it records nothing
        yield
        return
    with CacheArtifactManager.with_fresh_cache():
        yield


def _guards_skipped():
    return torch.compiler.set_stance(skip_guard_eval_unsafe=True)


@contextmanager
def _onednn_disabled() -> Iterator[None]:
    previous = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(previous)
