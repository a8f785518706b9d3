"""Chapter 06: every paged attention backend agrees with dense attention and with the others.

Each case stores random K/V for a few requests into a paged cache through shuffled block tables
and compares the kernels with a naive float64 softmax(QK^T)V over the dense K/V. Cache slots
that were never written, including the padding of the block tables, are NaN, so a kernel that
reads past a context length fails loudly. Every other case uses a softmax scale that is not
``head_dim ** -0.5`` (SDPA's default), so a backend that drops ``scale`` fails half the sweep.

Backends the device cannot run are skipped in-process. On a CPU the Triton kernel runs in its
interpreter, which must be switched on before the kernel is imported, so
``test_triton_cases_in_subprocess`` runs this file's Triton cases in a subprocess with
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from miniinfer import MiniInferError, UnknownNameError
from miniinfer.core import kernels
from miniinfer.core.kernels import (
    BACKENDS,
    available_backends,
    cpu_decode,
    get_backend,
    store_kv,
    triton_attention,
    unavailable_reason,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CONTEXT_LENS = (1, 15, 16, 17, 33, 100)  # inside, at and just past block boundaries
NUM_KV_HEADS = 2
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# Softmax scale of case i: head_dim ** -0.5 times SCALE_FACTORS[i % 2]. Models whose scale is
# not the default exist (Gemma's query_pre_attn_scalar, muP's 1 / head_dim).
SCALE_FACTORS = (1.0, 0.3)
# (block size, GQA group, head dim, dtype); 256 is the smallest block flash-attn accepts.
SHAPES = [(block_size, group, head_dim, dtype)
          for block_size in (16, 32) for group in (1, 3, 4, 7) for head_dim in (64, 128)
          for dtype in (torch.float32, torch.bfloat16)]
FLASH_SHAPES = [(256, 4, 128, torch.bfloat16), (256, 1, 64, torch.bfloat16)]
# The interpreter is slow: on a CPU, Triton gets the shapes of five sweep cases that between
# them cover every block size, group, head dim, dtype and context length, with batches of 3-5.
INTERPRETER_SHAPES = [(16, 3, 64, torch.float32), (16, 7, 64, torch.bfloat16),
                      (32, 1, 128, torch.bfloat16), (32, 3, 128, torch.float32),
                      (32, 4, 128, torch.bfloat16)]


@dataclass
class PagedCase:
    q: torch.Tensor  # [total_q, num_heads, head_dim]
    cu_seqlens_q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    dense_k: list[torch.Tensor]  # per request [context_len, num_kv_heads, head_dim]
    dense_v: list[torch.Tensor]
    scale: float

    @property
    def max_seqlen_q(self) -> int:
        return int((self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1]).max())


def make_case(seed: int, context_lens: list[int], q_lens: list[int], block_size: int,
              group: int, head_dim: int, dtype: torch.dtype,
              scale_factor: float = 1.0) -> PagedCase:
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    # One spare block is never written: it stays NaN and is what the table padding points at.
    num_blocks = sum(blocks_per_seq) + 1
    shuffled = torch.randperm(num_blocks, generator=gen)
    never_written = int(shuffled[-1])
    shape = (num_blocks, block_size, NUM_KV_HEADS, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    block_tables = torch.full((len(context_lens), max(blocks_per_seq) + 1), never_written,
                              dtype=torch.int32)
    dense_k, dense_v, slot_mapping = [], [], []
    first = 0
    for i, (context_len, n_blocks) in enumerate(zip(context_lens, blocks_per_seq, strict=True)):
        blocks = shuffled[first:first + n_blocks]
        first += n_blocks
        block_tables[i, :n_blocks] = blocks
        tokens = torch.arange(context_len)
        slot_mapping.append(blocks[tokens // block_size] * block_size + tokens % block_size)
        kv_shape = (context_len, NUM_KV_HEADS, head_dim)
        dense_k.append(torch.randn(kv_shape, generator=gen).to(dtype))
        dense_v.append(torch.randn(kv_shape, generator=gen).to(dtype))
    store_kv(torch.cat(dense_k), torch.cat(dense_v), k_cache, v_cache, torch.cat(slot_mapping))

    cu_seqlens_q = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu_seqlens_q[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn(sum(q_lens), NUM_KV_HEADS * group, head_dim, generator=gen).to(dtype)
    to_device = {"device": DEVICE}
    return PagedCase(q.to(**to_device), cu_seqlens_q.to(**to_device), k_cache.to(**to_device),
                     v_cache.to(**to_device), block_tables.to(**to_device),
                     torch.tensor(context_lens, dtype=torch.int32, device=DEVICE),
                     dense_k, dense_v, head_dim**-0.5 * scale_factor)


def sweep_case(index: int, shape: tuple, prefill: bool) -> PagedCase:
    """Case ``index`` of the sweep: batch 1..5, context lens cycling through CONTEXT_LENS; with
    ``prefill``, query counts cycle through a whole prompt, a decode and half a prompt; the
    softmax scale alternates between the default and another one."""
    block_size, group, head_dim, dtype = shape
    batch = 1 + index % 5
    context_lens = [CONTEXT_LENS[(index + j) % len(CONTEXT_LENS)] for j in range(batch)]
    q_lens = [(n, 1, (n + 1) // 2)[j % 3] if prefill else 1 for j, n in enumerate(context_lens)]
    return make_case(index, context_lens, q_lens, block_size, group, head_dim, dtype,
                     SCALE_FACTORS[index % len(SCALE_FACTORS)])


def naive_attention(case: PagedCase) -> torch.Tensor:
    """Dense causal attention per request in float64, GQA by repeating the kv heads."""
    group = case.q.shape[1] // NUM_KV_HEADS
    outs = []
    for i, (k, v) in enumerate(zip(case.dense_k, case.dense_v, strict=True)):
        q = case.q[case.cu_seqlens_q[i]:case.cu_seqlens_q[i + 1]].cpu().double()
        k = k.double().repeat_interleave(group, dim=1)
        v = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * case.scale
        q_positions = len(k) - len(q) + torch.arange(len(q))
        visible = torch.arange(len(k))[None, :] <= q_positions[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, v))
    return torch.cat(outs)


def require(backend: str, block_size: int, dtype: torch.dtype) -> None:
    if reason := unavailable_reason(backend, DEVICE, block_size):
        pytest.skip(reason)
    if backend == "flash-attn" and dtype == torch.float32:
        pytest.skip("flash-attn computes in fp16/bf16 only")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype and not actual.isnan().any()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.cpu().double(), expected.cpu().double(), atol=tol, rtol=tol)


def shape_id(shape: tuple) -> str:
    block_size, group, head_dim, dtype = shape
    return f"bs{block_size}-g{group}-d{head_dim}-{str(dtype).removeprefix('torch.')}"


def sweep_params(shapes: list[tuple], varlen: bool) -> list:
    params = []
    for name, backend in BACKENDS.items():
        if varlen and backend.varlen is None:
            continue
        interpreted = name == "triton" and DEVICE.type == "cpu"
        params += [pytest.param(name, index, shape, id=f"{name}-{shape_id(shape)}")
                   for index, shape in enumerate(shapes)
                   if not interpreted or shape in INTERPRETER_SHAPES]
    return params


DECODE_PARAMS = sweep_params(SHAPES + FLASH_SHAPES, varlen=False)
VARLEN_PARAMS = sweep_params(SHAPES, varlen=True)


@pytest.mark.parametrize(("backend", "index", "shape"), DECODE_PARAMS)
def test_decode_matches_dense_attention(backend, index, shape):
    require(backend, shape[0], shape[3])
    case = sweep_case(index, shape, prefill=False)
    out = get_backend(backend, DEVICE).decode(case.q, case.k_cache, case.v_cache,
                                              case.block_tables, case.context_lens, case.scale)
    assert_close(out, naive_attention(case), shape[3])
    if backend != "torch":
        reference = BACKENDS["torch"].decode(case.q, case.k_cache, case.v_cache,
                                             case.block_tables, case.context_lens, case.scale)
        assert_close(out, reference, shape[3])


@pytest.mark.parametrize(("backend", "index", "shape"), VARLEN_PARAMS)
def test_varlen_matches_dense_attention(backend, index, shape):
    """Whole prompts, decodes and prompt chunks (the later half of a prompt whose first half
    is already cached) in one call, as chunked prefill issues them."""
    require(backend, shape[0], shape[3])
    case = sweep_case(index, shape, prefill=True)
    args = (case.q, case.k_cache, case.v_cache, case.cu_seqlens_q, case.block_tables,
            case.context_lens, case.scale)
    out = get_backend(backend, DEVICE).varlen(*args, max_seqlen_q=case.max_seqlen_q)
    assert_close(out, naive_attention(case), shape[3])
    if backend != "torch":
        assert_close(out, BACKENDS["torch"].varlen(*args), shape[3])


@pytest.mark.parametrize("backend", [name for name, b in BACKENDS.items() if b.varlen])
def test_decode_is_varlen_with_one_query(backend):
    require(backend, 16, torch.float32)
    case = sweep_case(4, (16, 4, 64, torch.float32), prefill=False)
    impl = get_backend(backend, DEVICE)
    decode = impl.decode(case.q, case.k_cache, case.v_cache, case.block_tables,
                         case.context_lens, case.scale)
    varlen = impl.varlen(case.q, case.k_cache, case.v_cache, case.cu_seqlens_q,
                         case.block_tables, case.context_lens, case.scale)
    torch.testing.assert_close(decode, varlen, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_short_runs_attend_bit_for_bit_as_lone_decodes(backend):
    """A verification step's tokens (fewer than 16 a request) each attend exactly as a decode
    of its context would alone: chapter 14's drafts are kept only where the step without them
    would have chosen the same token, and int8-rounded activations (chapter 13) turn a last-bit
    difference into another token. Beside a 20-token prompt, the C++ kernel still attends them
    alone; the reference then batches them with it (correct, not bit for bit)."""
    require(backend, 16, torch.float32)
    for q_lens in ([3, 5, 1], [3, 20]):
        case = make_case(7, [40, 71, 33][:len(q_lens)], q_lens, 16, 3, 64, torch.float32)
        impl = get_backend(backend, DEVICE)
        varlen = impl.varlen(case.q, case.k_cache, case.v_cache, case.cu_seqlens_q,
                             case.block_tables, case.context_lens, case.scale)
        row = 0
        for i, q_len in enumerate(q_lens):
            for j in range(q_len):
                if q_len < 16 and (backend == "cpu" or max(q_lens) < 16):
                    context = case.context_lens[i:i + 1] - q_len + j + 1
                    alone = impl.decode(case.q[row:row + 1], case.k_cache, case.v_cache,
                                        case.block_tables[i:i + 1], context, case.scale)
                    assert torch.equal(varlen[row:row + 1], alone), (q_lens, i, j)
                row += 1
        torch.testing.assert_close(varlen, naive_attention(case).to(varlen.dtype), atol=1e-5,
                                   rtol=1e-5)


def test_store_kv_round_trip():
    case = make_case(0, [17, 33], [1, 1], 16, 1, 64, torch.float32)
    flat_k = case.k_cache.view(-1, NUM_KV_HEADS, 64)
    flat_v = case.v_cache.view(-1, NUM_KV_HEADS, 64)
    block_size = case.k_cache.shape[1]
    written = 0
    for i, (k, v) in enumerate(zip(case.dense_k, case.dense_v, strict=True)):
        tokens = torch.arange(len(k), device=DEVICE)
        slots = case.block_tables[i, tokens // block_size].long() * block_size + tokens % block_size
        torch.testing.assert_close(flat_k[slots].cpu(), k)
        torch.testing.assert_close(flat_v[slots].cpu(), v)
        written += len(k)
    # Every other slot is untouched: exactly the written ones lost their NaN.
    assert int((~flat_k.isnan()).all(dim=(1, 2)).sum()) == written
    assert int((~flat_v.isnan()).all(dim=(1, 2)).sum()) == written


def test_auto_picks_the_reference_off_cuda():
    assert get_backend(None, "cpu").name == "torch"
    assert get_backend("auto", "cpu").name == "torch"
    assert "torch" in available_backends("cpu")


def test_unknown_backend_lists_the_names():
    with pytest.raises(UnknownNameError, match="flash-attn, triton, cpu, torch"):
        get_backend("cudnn", "cpu")


def test_unavailable_backend_says_why():
    with pytest.raises(MiniInferError, match="'flash-attn' is not available on cpu"):
        get_backend("flash-attn", "cpu")
    if triton_attention.triton is not None and not triton_attention.INTERPRETED:
        with pytest.raises(MiniInferError, match="TRITON_INTERPRET=1"):
            get_backend("triton", "cpu")


def test_the_cpu_kernel_is_a_backend_for_cpus_only():
    assert "not cuda" in unavailable_reason("cpu", "cuda")
    if cpu_decode.load() is not None:
        pytest.skip(f"the C++ kernel does not build here: {cpu_decode.load()}")
    assert "cpu" in available_backends("cpu") and get_backend("cpu", "cpu").varlen is not None
    # The engines' layout (a layer's V blocks right after its K blocks) is read in place; any
    # other pair of caches is copied into one pool first, with the same result.
    case = make_case(0, [5, 17, 33], [1, 1, 1], 16, 2, 32, torch.float32)
    kv = torch.stack([case.k_cache, case.v_cache])
    args = (case.block_tables, case.context_lens, case.scale)
    q = case.q
    in_place = cpu_decode.paged_decode_attention(q, kv[0], kv[1], *args)
    apart = cpu_decode.paged_decode_attention(q, case.k_cache, case.v_cache.clone(), *args)
    assert torch.equal(in_place, apart)
    assert_close(in_place, BACKENDS["torch"].decode(q, case.k_cache, case.v_cache, *args),
                 torch.float32)
    # Planned once a step, run once a layer: the same result.
    plan = BACKENDS["cpu"].plan_decode(case.block_tables, case.context_lens, 16)
    assert torch.equal(plan(q, kv[0], kv[1], case.scale), in_place)
    # Heads the kernel's vectors do not divide are refused by name, not deep in the op.
    with pytest.raises(MiniInferError, match="head dim 20 is not a multiple"):
        get_backend("cpu", "cpu", 16, head_dim=20)


def test_triton_refuses_blocks_it_cannot_tile():
    if triton_attention.triton is None:
        pytest.skip("triton is not installed")
    assert "power-of-two" in unavailable_reason("triton", "cuda", block_size=8)


@pytest.mark.parametrize(("module", "package"), [("triton_attention", "triton"),
                                                 ("flash", "flash_attn")])
def test_kernels_import_when_optional_packages_are_missing(monkeypatch, module, package):
    monkeypatch.setitem(sys.modules, package, None)  # makes `import <package>` fail
    path = Path(kernels.__file__).with_name(f"{module}.py")
    spec = importlib.util.spec_from_file_location(f"without_{package}", path)
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    assert fresh.unavailable_reason(torch.device("cuda")).startswith(package)


def test_triton_cases_in_subprocess():
    """The Triton cases of this file, run by Triton's interpreter on CPU tensors."""
    if triton_attention.triton is None:
        pytest.skip("triton is not installed")
    if unavailable_reason("triton", DEVICE) is None:
        pytest.skip("the Triton cases already ran in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)),
         "-k", "triton and not subprocess"],
        capture_output=True, text=True, env=env, cwd=Path(__file__).parent.parent, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout


def test_triton_interpreter_runs_on_cpu_tensors():
    """Run in the interpreter subprocess: the kernel really is interpreted, on CPU tensors,
    and gives the reference's output (decode and varlen, with a non-default scale)."""
    if not triton_attention.INTERPRETED:
        pytest.skip("needs TRITON_INTERPRET=1 at import (see test_triton_cases_in_subprocess)")
    case = sweep_case(1, (16, 3, 64, torch.float32), prefill=True)
    assert case.scale != 64**-0.5 and DEVICE.type == "cpu"
    caches = (case.k_cache, case.v_cache)
    out = triton_attention.paged_decode_attention(case.q[case.cu_seqlens_q[1:] - 1], *caches,
                                                  case.block_tables, case.context_lens,
                                                  case.scale)
    reference = BACKENDS["torch"].decode(case.q[case.cu_seqlens_q[1:] - 1], *caches,
                                         case.block_tables, case.context_lens, case.scale)
    assert out.device.type == "cpu"
    assert_close(out, reference, torch.float32)
    args = (case.q, *caches, case.cu_seqlens_q, case.block_tables, case.context_lens, case.scale)
    assert_close(triton_attention.paged_varlen_attention(*args), BACKENDS["torch"].varlen(*args),
                 torch.float32)
    assert [name for name in available_backends("cpu") if name != "cpu"] == ["triton", "torch"]
    assert get_backend("auto", "cpu").name == "torch"


def test_kernel_bandwidth_counts_the_cache_bytes_and_rotates_past_the_l2(monkeypatch):
    """Chapter 06's kernel table, run here with the reference on small shapes: the bytes are
    K and V of every block the batch holds, the caches rotate so that together they pass
    ``rotate_bytes``, and the rate is those bytes over the median time."""
    from miniinfer.bench import kernels as kernel_bench
    from miniinfer.bench.devices import DeviceSpeed

    monkeypatch.setattr(kernel_bench, "device_speed",
                        lambda device: DeviceSpeed("cpu-x", "x", 10.0, 100.0, 1, "test", "t"))
    calls = []
    real = kernels.get_backend("torch").decode

    def counted(q, k, v, *args):
        calls.append(k.data_ptr())
        return real(q, k, v, *args)

    monkeypatch.setattr(kernel_bench, "get_backend",
                        lambda *a: kernels.AttentionBackend("torch", counted, None))
    df = kernel_bench.decode_kernel_bandwidth(
        torch.device("cpu"), "torch", contexts=(20, 40), batch_size=2, block_size=8, heads=4,
        kv_heads=2, head_dim=16, dtype=torch.float32, rotate_bytes=40_000, repeats=4)
    # 2 requests x 3 blocks of 8 tokens at context 20; 2 x 5 at 40.
    kv = [2 * 2 * blocks * 8 * 2 * 16 * 4 for blocks in (3, 5)]
    assert df.kv_mb.tolist() == pytest.approx([b / 2**20 for b in kv])
    assert df.rotated_sets.tolist() == [-(-40_000 // b) for b in kv]
    assert len(set(calls[:7])) == min(7, df.rotated_sets[0])  # consecutive calls, fresh caches
    assert df.gbs.tolist() == pytest.approx([b / (us / 1e6) / 1e9 for b, us
                                             in zip(kv, df.kernel_us, strict=True)])
    assert df.pct_of_copy.tolist() == pytest.approx((100 * df.gbs / 10.0).tolist())
    assert set(df.backend) == {"torch"}


@pytest.mark.parametrize("splits", [2, 3, 8])
@pytest.mark.parametrize("shape", [(16, 3, 64, torch.float32), (16, 7, 64, torch.bfloat16),
                                   (32, 4, 128, torch.float32)])
def test_triton_split_decode_equals_the_reference(shape, splits):
    """Flash-decoding (each context cut into splits, merged afterwards) gives the reference's
    decode output, with contexts shorter than one split (empty splits weigh nothing), ragged
    contexts, NaN in every slot never written, and a non-default scale."""
    if not triton_attention.INTERPRETED and DEVICE.type != "cuda":
        pytest.skip("needs TRITON_INTERPRET=1 at import (see test_triton_cases_in_subprocess)")
    block_size, group, head_dim, dtype = shape
    context_lens = [1, 17, 100, 300]  # 1 block to 19: every split count leaves some empty
    case = make_case(splits, context_lens, [1] * 4, block_size, group, head_dim, dtype, 0.3)
    q = case.q
    caches = (case.k_cache, case.v_cache)
    out = triton_attention.split_decode_attention(q, *caches, case.block_tables,
                                                  case.context_lens, case.scale, splits)
    reference = BACKENDS["torch"].decode(q, *caches, case.block_tables, case.context_lens,
                                         case.scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, reference, shape[3])


def test_triton_decode_splits_only_where_the_gpu_would_idle():
    if triton_attention.triton is None:
        pytest.skip("triton is not installed")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    # One request of a 7B layout (4 kv heads) over 4k tokens (256 blocks of 16): split.
    assert triton_attention.decode_splits(1, 4, 256, cuda) > 1
    # A batch that fills the GPU, or a context of a few blocks: one program each, as before.
    assert triton_attention.decode_splits(128, 4, 256, cuda) == 1
    assert triton_attention.decode_splits(1, 4, 4, cuda) == 1
    assert triton_attention.decode_splits(1, 4, 256, cpu) == 1


def test_a_killed_builds_lock_is_removed_and_a_live_ones_kept(tmp_path):
    """torch waits forever on a build lock; one left by a killed build must not hang the next
    process that loads the CPU decode kernel."""
    import os
    import time

    from miniinfer.core.kernels.cpu_decode import STALE_LOCK_S, remove_stale_lock

    lock = tmp_path / "lock"
    lock.touch()
    remove_stale_lock(tmp_path)
    assert lock.exists()  # a build may be running right now
    old = time.time() - STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    remove_stale_lock(tmp_path)
    assert not lock.exists()
    remove_stale_lock(tmp_path)  # no lock: nothing to do
