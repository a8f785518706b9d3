"""Our own paged attention kernel in Triton: it reads K/V straight from the blocks named by the
block table, with no gather into a dense copy and no dense mask.

One kernel serves decode and varlen (prefill chunks, mixed with decodes): a program owns one
(request, kv head, tile of query rows). A query row is one (query token, query head of the
GQA group) pair, so the heads that share a kv head share every K/V load; decode is the case of
one token per request, where the tile holds the whole group and the grid is one program per
(request, kv head). The program walks the request's block table one block at a time and keeps
an online softmax: a running max and running sum per row, and an fp32 accumulator rescaled
whenever the max grows, so the context never has to fit in one tile.

A decode step of few requests gives the GPU few programs (requests x kv heads), each walking a
whole long context alone, so most multiprocessors idle: there a second kernel cuts each context
into splits, one program per (request, kv head, split), and merges the splits' softmaxes
afterwards (flash-decoding; :func:`decode_splits` decides from shapes alone).

Layouts and the block table padding convention are those of :mod:`.reference`.

Importing this module never fails: without Triton, :func:`unavailable_reason` says why. On a
CPU the kernel runs only in Triton's interpreter, which ``@triton.jit`` chooses when this module
is imported, if ``TRITON_INTERPRET=1`` is set by then (see :mod:`miniinfer.core.kernels`).
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
except ImportError as exc:
    triton = None
    _IMPORT_ERROR = f"triton is not installed ({exc})"

# Query rows per program for prefill tiles. tl.dot needs every dimension >= 16.
_PREFILL_ROWS = 64
_MIN_DOT_DIM = 16


if triton is not None:

    @triton.jit
    def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        # Triton 3.9's interpreter multiplies bf16 tiles as their raw uint16 bits. Products of
        # bf16 numbers are exact in fp32, so upcasting there computes what the GPU's bf16 dot
        # with fp32 accumulation computes.
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        return tl.dot(a, b, input_precision=PRECISION)

    @triton.jit
    def _paged_attention_kernel(
        q_ptr, out_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
        cu_seqlens_q_ptr, scale,
        stride_q_token, stride_q_head,
        stride_out_token, stride_out_head,
        stride_cache_block, stride_cache_slot, stride_cache_head,
        stride_block_tables,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, GROUP: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr, DOT_PRECISION: tl.constexpr,
        DOT_UPCAST: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        tile = tl.program_id(2)

        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        # The grid is sized for the longest request; shorter ones have fewer tiles.
        if tile * ROWS // GROUP >= q_len:
            return
        context_len = tl.load(context_lens_ptr + seq)

        rows = tile * ROWS + tl.arange(0, ROWS)
        token = rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        row_valid = token < q_len
        dims = tl.arange(0, HEAD_DIM_PADDED)
        dim_valid = dims < HEAD_DIM

        q = tl.load(q_ptr + (q_start + token)[:, None] * stride_q_token
                    + head[:, None] * stride_q_head + dims[None, :],
                    mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
        # Causal limit per row: the queries are the last q_len tokens of the context. Padding
        # rows borrow the last real row's limit, so every row sees position 0 and the running
        # max is finite after the first block (no inf - inf = NaN).
        q_position = context_len - q_len + tl.minimum(token, q_len - 1)
        # Blocks past the tile's last visible position are skipped, not masked.
        last_token = tl.minimum((tile * ROWS + ROWS - 1) // GROUP, q_len - 1)
        kv_end = context_len - q_len + last_token + 1

        running_max = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        running_sum = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM_PADDED], dtype=tl.float32)
        slots = tl.arange(0, BLOCK_SIZE)
        head_offset = kv_head * stride_cache_head
        for block_index in range(0, tl.cdiv(kv_end, BLOCK_SIZE)):
            block = tl.load(block_tables_ptr + seq * stride_block_tables + block_index)
            # int64: block * stride can pass 2**31 elements in a large cache.
            block_offset = block.to(tl.int64) * stride_cache_block + head_offset
            positions = block_index * BLOCK_SIZE + slots
            # Slots past kv_end (the tail of a request's last block) may be stale or never
            # written, NaN included, so they are not loaded: 0 * NaN would poison the sum.
            in_context = positions < kv_end
            k = tl.load(k_cache_ptr + block_offset + slots[None, :] * stride_cache_slot
                        + dims[:, None],
                        mask=in_context[None, :] & dim_valid[:, None], other=0.0)
            scores = _dot(q, k, DOT_PRECISION, DOT_UPCAST) * scale  # [ROWS, BLOCK_SIZE]
            scores = tl.where(positions[None, :] <= q_position[:, None], scores, float("-inf"))

            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            rescale = tl.exp(running_max - new_max)
            probs = tl.exp(scores - new_max[:, None])
            running_sum = running_sum * rescale + tl.sum(probs, axis=1)
            v = tl.load(v_cache_ptr + block_offset + slots[:, None] * stride_cache_slot
                        + dims[None, :],
                        mask=in_context[:, None] & dim_valid[None, :], other=0.0)
            acc = acc * rescale[:, None] + _dot(probs.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
            running_max = new_max

        out = acc / running_sum[:, None]
        tl.store(out_ptr + (q_start + token)[:, None] * stride_out_token
                 + head[:, None] * stride_out_head + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])

    # The block tables, context lens and cu_seqlens of chapter 08's steps are slices of one
    # staged buffer at offsets that change every step, and the table width (its row stride) is
    # sometimes 1. By default Triton compiles one variant per pointer alignment and per
    # "stride == 1 / stride % 16 == 0" case (14-16 variants in one chapter 08 run, a JIT compile
    # of 1-3 s each inside timed runs); these loads are a few scalars per program, so
    # specialising on them buys nothing. (Jitted again rather than given these options in the
    # decorator above, to keep the kernel's header short where chapter 06 prints it.)
    _paged_attention_kernel = triton.jit(
        _paged_attention_kernel.fn, do_not_specialize=["stride_block_tables"],
        do_not_specialize_on_alignment=["block_tables_ptr", "context_lens_ptr",
                                        "cu_seqlens_q_ptr"])

    # Whether @triton.jit built the interpreted kernel (TRITON_INTERPRET=1 at import).
    INTERPRETED = isinstance(_paged_attention_kernel, InterpretedFunction)
else:
    INTERPRETED = False


if triton is not None:

    @triton.jit
    def _paged_decode_split_kernel(
        q_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, k_cache_ptr, v_cache_ptr,
        block_tables_ptr, context_lens_ptr, scale,
        stride_q_token, stride_q_head,
        stride_cache_block, stride_cache_slot, stride_cache_head,
        stride_block_tables,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, GROUP: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr,
        DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    ):
        # Flash-decoding: one decode token per request, its context cut into splits of
        # BLOCKS_PER_SPLIT blocks, one program per (request, kv head, split). Each program
        # keeps the same online softmax over its part of the context and writes its running
        # max, running sum and unnormalised output; combine_splits merges them. With few
        # requests a long context then spreads over the GPU's multiprocessors instead of one.
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        context_len = tl.load(context_lens_ptr + seq)
        rows = tl.arange(0, ROWS)
        head = kv_head * GROUP + rows
        row_valid = rows < GROUP
        dims = tl.arange(0, HEAD_DIM_PADDED)
        dim_valid = dims < HEAD_DIM
        part = ((seq * tl.num_programs(1) + kv_head) * tl.num_programs(2) + split) * ROWS + rows
        q = tl.load(q_ptr + seq * stride_q_token + head[:, None] * stride_q_head + dims[None, :],
                    mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
        running_max = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        running_sum = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM_PADDED], dtype=tl.float32)
        slots = tl.arange(0, BLOCK_SIZE)
        head_offset = kv_head * stride_cache_head
        first = split * BLOCKS_PER_SPLIT
        # A split past the context's last block keeps max -inf and sum 0: it weighs nothing.
        last = tl.minimum(first + BLOCKS_PER_SPLIT, tl.cdiv(context_len, BLOCK_SIZE))
        for block_index in range(first, last):
            block = tl.load(block_tables_ptr + seq * stride_block_tables + block_index)
            block_offset = block.to(tl.int64) * stride_cache_block + head_offset
            positions = block_index * BLOCK_SIZE + slots
            in_context = positions < context_len
            k = tl.load(k_cache_ptr + block_offset + slots[None, :] * stride_cache_slot
                        + dims[:, None],
                        mask=in_context[None, :] & dim_valid[:, None], other=0.0)
            scores = _dot(q, k, DOT_PRECISION, DOT_UPCAST) * scale
            scores = tl.where(in_context[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            rescale = tl.exp(running_max - new_max)
            probs = tl.exp(scores - new_max[:, None])
            running_sum = running_sum * rescale + tl.sum(probs, axis=1)
            v = tl.load(v_cache_ptr + block_offset + slots[:, None] * stride_cache_slot
                        + dims[None, :],
                        mask=in_context[:, None] & dim_valid[None, :], other=0.0)
            acc = acc * rescale[:, None] + _dot(probs.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
            running_max = new_max
        tl.store(part_max_ptr + part, running_max)
        tl.store(part_sum_ptr + part, running_sum)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PADDED + dims[None, :], acc)


def unavailable_reason(device: torch.device, block_size: int | None = None) -> str | None:
    """Why the kernel cannot run on ``device`` (None: it can)."""
    if triton is None:
        return _IMPORT_ERROR
    if device.type == "cpu" and not INTERPRETED:
        return ("Triton runs on a CPU only in its interpreter: set TRITON_INTERPRET=1 in the "
                "environment before miniinfer.core.kernels is imported")
    if device.type not in ("cpu", "cuda"):
        return f"the Triton kernel runs on CUDA (or interpreted on CPU), not {device.type}"
    if block_size is not None and (block_size < _MIN_DOT_DIM or block_size & (block_size - 1)):
        return f"the Triton kernel needs a power-of-two block size >= {_MIN_DOT_DIM}, got {block_size}"
    return None


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Same contract as :func:`.reference.paged_decode_attention`."""
    cu_seqlens_q = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_varlen_attention(q, k_cache, v_cache, cu_seqlens_q, block_tables,
                                  context_lens, scale, max_seqlen_q=1)


def paged_varlen_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float,
                           max_seqlen_q: int | None = None) -> torch.Tensor:
    """Same contract as :func:`.reference.paged_varlen_attention`."""
    if reason := unavailable_reason(q.device, k_cache.shape[1]):
        raise RuntimeError(reason)
    if max_seqlen_q == 1 and len(context_lens) == q.shape[0]:
        splits = decode_splits(len(context_lens), k_cache.shape[2], block_tables.shape[1],
                               q.device)
        if splits > 1:
            return split_decode_attention(q, k_cache, v_cache, block_tables, context_lens,
                                          scale, splits)
    out = torch.empty_like(q)
    grid, args, constants = launch_config(q, out, k_cache, v_cache, cu_seqlens_q, block_tables,
                                          context_lens, scale, max_seqlen_q)
    _paged_attention_kernel[grid](*args, **constants)
    return out


# Flash-decoding: programs to aim for (two waves of an H100's or H200's 132 multiprocessors),
# and the fewest blocks a split walks (below that, writing and merging partials costs more than
# the parallelism buys).
_TARGET_PROGRAMS = 264
_MIN_BLOCKS_PER_SPLIT = 4


def decode_splits(num_requests: int, num_kv_heads: int, table_width: int,
                  device: torch.device) -> int:
    """How many splits a decode step's contexts are cut into: 1 (no split) unless requests x kv
    heads leave the GPU's multiprocessors idle and the block tables are long enough. Decided
    from shapes only (the table width bounds every context), so a CUDA graph can capture it."""
    if device.type != "cuda":
        return 1  # the interpreter gains nothing from splits; tests call split_decode_attention
    programs = num_requests * num_kv_heads
    return max(1, min(triton.cdiv(_TARGET_PROGRAMS, programs),
                      table_width // _MIN_BLOCKS_PER_SPLIT))


def split_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           splits: int) -> torch.Tensor:
    """Decode attention (one token per request, ``q`` [requests, heads, dim]) with each
    context cut into ``splits`` parts attended by programs of their own, then merged."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    rows = max(_MIN_DOT_DIM, triton.next_power_of_2(group))
    padded = max(_MIN_DOT_DIM, triton.next_power_of_2(head_dim))
    blocks_per_split = triton.cdiv(block_tables.shape[1], splits)
    parts = (len(context_lens), num_kv_heads, splits, rows)
    part_acc = torch.empty(*parts, padded, dtype=torch.float32, device=q.device)
    part_max = torch.empty(parts, dtype=torch.float32, device=q.device)
    part_sum = torch.empty(parts, dtype=torch.float32, device=q.device)
    _paged_decode_split_kernel[(len(context_lens), num_kv_heads, splits)](
        q, part_acc, part_max, part_sum, k_cache, v_cache, block_tables, context_lens, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        HEAD_DIM=head_dim, HEAD_DIM_PADDED=padded, GROUP=group, BLOCK_SIZE=block_size,
        ROWS=rows, BLOCKS_PER_SPLIT=blocks_per_split,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        DOT_UPCAST=INTERPRETED and q.dtype == torch.bfloat16)
    out = combine_splits(part_acc, part_max, part_sum)[:, :, :group, :head_dim]
    return out.reshape(q.shape).to(q.dtype)


def combine_splits(part_acc: torch.Tensor, part_max: torch.Tensor,
                   part_sum: torch.Tensor) -> torch.Tensor:
    """Merge the splits' online softmaxes: each split's output and sum rescaled by
    exp(its max - the global max); a split that saw no position (max -inf) weighs 0."""
    global_max = part_max.amax(dim=2, keepdim=True)
    weight = torch.exp(part_max - global_max).nan_to_num(0.0)  # -inf - -inf: an empty row
    total = (part_sum * weight).sum(dim=2)
    return (part_acc * weight[..., None]).sum(dim=2) / total[..., None]


def launch_config(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor, scale: float, max_seqlen_q: int | None = None
                  ) -> tuple[tuple[int, int, int], tuple, dict[str, object]]:
    """The grid, positional arguments and compile-time constants of the kernel launch for
    these inputs (the tests compile exactly this for sm_80/sm_90 on a machine without a GPU)."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q, k_cache and v_cache must have a contiguous last (head_dim) dim")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same layout (strides)")
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    rows_per_tile = tile_rows(group, max_seqlen_q)
    grid = (len(context_lens), num_kv_heads, triton.cdiv(max_seqlen_q * group, rows_per_tile))
    args = (q, out, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, scale,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0))
    constants = dict(
        HEAD_DIM=head_dim, HEAD_DIM_PADDED=max(_MIN_DOT_DIM, triton.next_power_of_2(head_dim)),
        GROUP=group, BLOCK_SIZE=block_size, ROWS=rows_per_tile,
        # fp32 inputs would otherwise run as TF32 on tensor cores (about 3 decimal digits);
        # bf16/fp16 keep the backend's default.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        DOT_UPCAST=INTERPRETED and q.dtype == torch.bfloat16,
    )
    return grid, args, constants


def tile_rows(group: int, max_seqlen_q: int) -> int:
    """Query rows per program: decode fits the whole group in one tile (one program per
    request and kv head); longer queries are cut into tiles of ``_PREFILL_ROWS`` rows. Each
    distinct value is one compiled variant of the kernel."""
    return max(_MIN_DOT_DIM, min(_PREFILL_ROWS, triton.next_power_of_2(group * max_seqlen_q)))


def warm_up(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
            dtype: torch.dtype) -> None:
    """Compile every variant of the kernel that this cache and head layout can launch (one per
    tile size: decode and each prefill tile), so no JIT compile lands inside a timed run. The
    launches read block 0 of the cache and write only their own output."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    group = num_heads // num_kv_heads
    device = k_cache.device
    seen = set()
    for max_seqlen_q in range(1, _PREFILL_ROWS + 1):
        rows = tile_rows(group, max_seqlen_q)
        if rows in seen:
            continue
        seen.add(rows)
        q = torch.zeros(max_seqlen_q, num_heads, head_dim, dtype=dtype, device=device)
        cu_seqlens_q = torch.tensor([0, max_seqlen_q], dtype=torch.int32, device=device)
        # Every entry block 0: the queries' context (their own positions) spans several blocks.
        width = triton.cdiv(max_seqlen_q, k_cache.shape[1])
        block_tables = torch.zeros(1, width, dtype=torch.int32, device=device)
        context_lens = cu_seqlens_q[1:]
        paged_varlen_attention(q, k_cache, v_cache, cu_seqlens_q, block_tables, context_lens,
                               1.0, max_seqlen_q)


@functools.cache
def probe(device: torch.device) -> str | None:
    """Launch the kernel once on a tiny input (what ``auto`` checks before picking Triton):
    Triton builds a C launcher on first use, so a machine without a C compiler, or with a
    driver Triton cannot talk to, fails here instead of in the middle of a run. None: it
    works; otherwise why not."""
    if (reason := unavailable_reason(device)) is not None:
        return reason
    from .reference import paged_decode_attention as reference_decode

    generator = torch.Generator().manual_seed(0)
    k_cache = torch.randn(2, _MIN_DOT_DIM, 1, _MIN_DOT_DIM, generator=generator)
    v_cache = torch.randn(k_cache.shape, generator=generator)
    q = torch.randn(1, 1, _MIN_DOT_DIM, generator=generator)
    tables = torch.tensor([[1]], dtype=torch.int32)
    lens = torch.tensor([5], dtype=torch.int32)
    expected = reference_decode(q, k_cache, v_cache, tables, lens, 0.25)
    try:
        got = paged_decode_attention(*(t.to(device) for t in (q, k_cache, v_cache, tables, lens)),
                                     0.25).cpu()
    except Exception as exc:  # noqa: BLE001 - any failure means: do not pick Triton
        return f"a test launch of the Triton kernel failed ({type(exc).__name__}: {exc})"
    if not torch.allclose(got, expected, atol=1e-4):
        return "a test launch of the Triton kernel gave wrong results"
    return None
