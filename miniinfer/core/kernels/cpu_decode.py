"""A C++ paged attention for CPU steps (chapter 11), compiled on this machine on first use.

Chapter 11's compiled forward first wrote attention as products and sums that inductor fuses
with the indexed loads from the pool. On decode steps that was still the largest part of a
step after the matmuls: inductor's loops read a context at a fraction of the memory bandwidth
(our measurements are in the chapter). ``cpu_decode.cpp`` is the kernel that the fused formula
is a specification of: per token, one pass over its context's keys and one over its values,
slot rows read whole and in order, the next block prefetched, vectors as wide as the CPU has;
and for a prompt chunk's tokens, which share a context, a tile of them at a time, each K and V
vector read once for the whole tile.

It is built with ``torch.utils.cpp_extension`` and the same ISA flags inductor picks for its
own kernels on this CPU (so it runs wherever inductor's kernels run), and registered as the op
``torch.ops.miniinfer.paged_token_attention``, with a fake for tracing, so a compiled graph
calls it like any other op. The build takes about half a minute once; torch keeps it in its
extensions cache. Where it cannot be built, :func:`load` says why and the caller keeps the
fused formula.
"""

from __future__ import annotations

import functools
import re
import time
from pathlib import Path

import torch

from ..errors import one_line

SOURCE = Path(__file__).with_name("cpu_decode.cpp")


@functools.cache
def load() -> str | None:
    """Build (or find already built) and register the op; None when it is ready, else why it
    is not."""
    try:
        from torch._inductor import cpu_vec_isa

        isa = cpu_vec_isa.pick_vec_isa()
        if not isa:
            return "inductor found no vector instruction set on this CPU"
        flags = [*isa.build_arch_flags().split(),
                 *(f"-D{macro}" for macro in isa.build_macro())]
        name = "miniinfer_cpu_decode_" + re.sub(r"\W+", "_", str(isa))  # one build per ISA
        build(name, SOURCE, flags)
    except Exception as error:  # noqa: BLE001 (whatever stops the build is the reason)
        return one_line(error)

    @torch.library.register_fake("miniinfer::paged_token_attention")
    def _(q, pool, k_base, v_base, block_size, tables, positions, scale):
        return q.new_empty(q.shape)

    return None


# A build takes a minute or two; a lock older than this was left by a process killed mid-build,
# and torch would wait on it forever.
STALE_LOCK_S = 600


def build(name: str, source: Path, flags: list[str]) -> None:
    """Build ``source`` as the torch extension ``name`` with OpenMP and ``flags`` (or find it
    built, in torch's cache) and load it, registering its ops. A lock left by a build that was
    killed is removed first."""
    from torch.utils import cpp_extension

    remove_stale_lock(Path(cpp_extension._get_build_directory(name, verbose=False)))
    cpp_extension.load(name, [str(source)], extra_cflags=["-O3", "-fopenmp", *flags],
                       extra_ldflags=["-fopenmp"], is_python_module=False)


def remove_stale_lock(build_dir: Path) -> None:
    """Remove the build's lock file when a killed build left it behind (torch's file baton
    waits for the file to go, with no timeout)."""
    lock = build_dir / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
            print(f"removed a stale build lock left by a killed build: {lock}")
    except FileNotFoundError:
        pass


def unavailable(head_dim: int) -> str | None:
    """Why the op cannot attend heads of ``head_dim`` here (None: it can): it is not built, or
    a head is not a whole number of the CPU's vectors."""
    reason = load()
    if reason is None:
        from torch._inductor import cpu_vec_isa

        lanes = cpu_vec_isa.pick_vec_isa().nelements()
        if head_dim % lanes:
            reason = f"head dim {head_dim} is not a multiple of this CPU's {lanes} fp32 lanes"
    return reason


def paged_token_attention(q: torch.Tensor, pool: torch.Tensor, k_base: int, v_base: int,
                          block_size: int, tables: torch.Tensor, positions: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """Each token of ``q`` ``[T, heads, dim]`` attends causally to positions ``0 ..
    positions[t]`` of its own block table ``tables[t]`` (int32 ``[T, W]``) over the flat
    ``pool`` ``[slots, kv_heads, dim]``, this layer's K from row ``k_base`` and V from
    ``v_base``: :func:`~miniinfer.runner.compiled_attention.fused_paged_attention`'s result,
    read in place. Call :func:`unavailable` first."""
    return torch.ops.miniinfer.paged_token_attention(q, pool, k_base, v_base, block_size,
                                                     tables, positions, scale)


# -- the op as an attention backend (chapter 06's contract: a layer's k_cache and v_cache) --------


def _layer_pool(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """One flat ``[slots, kv_heads, dim]`` pool holding a layer's K and V, with the rows each
    starts at. The engines' pools keep a layer's V blocks right after its K blocks, so that is
    a view over both; any other pair of caches is copied into one (correct, slower)."""
    num_blocks, block_size, kv_heads, dim = k_cache.shape
    slots = num_blocks * block_size
    if (k_cache.is_contiguous() and v_cache.is_contiguous()
            and v_cache.untyped_storage().data_ptr() == k_cache.untyped_storage().data_ptr()
            and v_cache.data_ptr() == k_cache.data_ptr() + k_cache.nbytes):
        pool = k_cache.as_strided((2 * slots, kv_heads, dim), (kv_heads * dim, dim, 1))
    else:
        pool = torch.cat([k_cache.reshape(slots, kv_heads, dim),
                          v_cache.reshape(slots, kv_heads, dim)])
    return pool, 0, slots


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """The backend contract's decode (see :mod:`.reference`): request ``i``'s one query sees
    its ``context_lens[i]`` tokens, the last of which it is."""
    return DecodePlan(block_tables, context_lens, k_cache.shape[1])(q, k_cache, v_cache, scale)


class DecodePlan:
    """:func:`paged_decode_attention` with the op's tables and positions made once a step, not
    once a layer (the contract's ``plan_decode``)."""

    def __init__(self, block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                 max_context_len: int | None = None) -> None:
        self.tables = block_tables.to(torch.int32)
        self.positions = context_lens.long() - 1
        self.block_size = block_size

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 scale: float) -> torch.Tensor:
        pool, k_base, v_base = _layer_pool(k_cache, v_cache)
        return paged_token_attention(q, pool, k_base, v_base, self.block_size, self.tables,
                                     self.positions, scale)


def paged_varlen_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float,
                           max_seqlen_q: int | None = None) -> torch.Tensor:
    """The backend contract's varlen (see :mod:`.reference`): each query token attends through
    its request's block table up to its own position, the end of the context counted back."""
    pool, k_base, v_base = _layer_pool(k_cache, v_cache)
    cu = cu_seqlens_q.long()
    rows = torch.arange(q.shape[0], device=q.device)
    request = torch.searchsorted(cu[1:], rows, right=True)
    positions = context_lens.long()[request] - (cu[request + 1] - rows)
    return paged_token_attention(q, pool, k_base, v_base, k_cache.shape[1],
                                 block_tables.to(torch.int32)[request], positions, scale)
