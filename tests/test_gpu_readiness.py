"""GPU paths checked on a CPU (issue 12), so a GPU's first run is not spent on bugs a CPU finds:

- the Triton kernel compiled for sm_90 and sm_80 (``triton.compile`` with a ``GPUTarget``:
  Triton's bundled ptxas, no GPU) for every launch configuration the chapters use, with the
  arguments exactly as the engines pass them; and no recompiles for the staged metadata;
- capture safety: the function a CUDA graph captures and the overlapped loop's step, run under a
  dispatch mode that fails on any host read or data-dependent shape, for every attention backend
  the loops can run with (Triton's kernel and flash-attn's call stubbed on a CPU: only the torch
  code around them runs here);
- the fallbacks: Triton probed before ``auto`` picks it, the cuda-graph loop with the torch
  reference, and sampling without a host check.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import pandas as pd
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from miniinfer import SamplingParams, make_engine
from miniinfer.bench.equality import EXACT_LAYERS, check_engines, compare_greedy, equality_model
from miniinfer.core.kernels import BACKENDS, flash, get_backend, reference, triton_attention
from miniinfer.core.kv_cache import DEFAULT_BLOCK_SIZE
from miniinfer.core.sampling import make_generator, sample
from miniinfer.engines import async_loop
from miniinfer.runner.cuda_graphs import GRAPH_BUCKETS, DecodeGraphs

try:  # the compile tests use Triton's compiler API (triton 3.x)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature
except ImportError:
    triton = None

aten = torch.ops.aten

# -- host reads and data-dependent shapes ---------------------------------------------------

# Ops whose result the host must wait for, or whose output shape depends on tensor values.
HOST_READS = {
    aten._local_scalar_dense.default: "a host read (.item(), int(), float(), bool())",
    # Under inference_mode (every engine's decode) the read dispatches as item itself.
    aten.item.default: "a host read (.item(), int(), float(), bool())",
    aten.nonzero.default: "nonzero (data-dependent shape)",
    aten.masked_select.default: "masked_select (data-dependent shape)",
    aten.equal.default: "torch.equal (a host read)",
    aten.is_nonzero.default: "a tensor's truth value (a host read)",
    aten.lift_fresh.default: "a tensor built from host data (torch.tensor)",
    # Below the dispatcher it checks its input with .item(): a sync on CUDA every call.
    aten.multinomial.default: "torch.multinomial (checks its input on the host)",
    aten.repeat_interleave.Tensor: "repeat_interleave (data-dependent shape)",
    aten._unique2.default: "unique (data-dependent shape)",
    aten.unique_dim.default: "unique (data-dependent shape)",
    aten.unique_consecutive.default: "unique (data-dependent shape)",
}


class HostReadError(AssertionError):
    pass


class NoHostReads(TorchDispatchMode):
    """Fails on any op that reads device values back to the host or whose shape depends on
    them: what a CUDA graph cannot capture and what makes a "non-blocking" step wait."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READS:
            raise HostReadError(f"{func}: {HOST_READS[func]}")
        if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                    aten._index_put_impl_.default):
            indices = args[1]
            if any(i is not None and i.dtype == torch.bool for i in indices):
                raise HostReadError(f"{func}: boolean-mask indexing (data-dependent shape)")
        return func(*args, **kwargs)


@contextmanager
def no_host_reads():
    # tolist() reads the data without dispatching an op, so it is caught here.
    real_tolist = torch.Tensor.tolist

    def tolist(self):
        raise HostReadError("Tensor.tolist (a host read)")

    torch.Tensor.tolist = tolist
    try:
        with NoHostReads():
            yield
    finally:
        torch.Tensor.tolist = real_tolist


@pytest.mark.parametrize("bad", [
    lambda x: x.max().item(),
    lambda x: int(x.sum()),
    lambda x: x.nonzero(),
    lambda x: x[x > 2],
    lambda x: x.masked_select(x > 2),
    lambda x: x.tolist(),
    lambda x: torch.tensor([1, 2]),
    lambda x: torch.repeat_interleave(x),
    lambda x: x.unique(),
    lambda x: bool(x.any()),
], ids=["item", "int", "nonzero", "bool-index", "masked_select", "tolist", "from-host",
        "repeat_interleave", "unique", "truth"])
@pytest.mark.parametrize("inference", [False, True], ids=["grad-mode", "inference-mode"])
def test_the_mode_catches_every_kind_of_host_read(bad, inference):
    x = torch.arange(5)
    with torch.inference_mode(inference), pytest.raises(HostReadError), no_host_reads():
        bad(x if not inference else x + 0)
    with no_host_reads():  # device-only work passes
        torch.where(x > 2, x, 0).cumsum(0).argmax()


# -- the captured function and the overlapped step, per backend --------------------------------

class KernelStub:
    """Stands in for the compiled Triton kernel on a CPU: takes the launch (grid, arguments as
    the wrapper passes them) and writes zeros to the output; only the torch code runs."""

    def __init__(self) -> None:
        self.launches = 0

    def __getitem__(self, grid):
        def launch(*args, **constants):
            self.launches += 1
            args[1].zero_()

        return launch


@pytest.fixture
def backend_stubs(monkeypatch):
    """Triton and flash-attn made "available" on this CPU, their device code replaced; the
    torch reference takes the path it takes on CUDA (masking, not listing, stale positions)."""
    monkeypatch.setattr(reference, "MASK_STALE_ON", {"cpu", "cuda"})
    stub = KernelStub()
    monkeypatch.setattr(triton_attention, "_paged_attention_kernel", stub)
    monkeypatch.setattr(triton_attention, "unavailable_reason", lambda *args: None)
    monkeypatch.setattr(flash, "unavailable_reason", lambda *args: None)
    monkeypatch.setattr(flash, "flash_attn_with_kvcache",
                        lambda q, *args, **kwargs: torch.zeros_like(q))
    return stub


BACKEND_FORWARDS = [("torch", "direct"), ("torch", "registry"), ("triton", "direct"),
                    ("flash-attn", "direct")]
GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=8, temperature=0.8, top_k=20, top_p=0.9, seed=1,
                         ignore_eos=True)


@pytest.mark.parametrize("backend,forward", BACKEND_FORWARDS)
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_overlapped_step_reads_nothing_from_the_device(tiny, backend_stubs, backend, forward,
                                                       params):
    engine = make_engine("async:overlap", tiny, attention_backend=backend, forward=forward)
    steps = []
    real_step = engine.decode_step

    def strict_step(*args, **kwargs):
        with no_host_reads():
            out = real_step(*args, **kwargs)
        steps.append(out)
        return out

    engine.decode_step = strict_step
    prompts = [[5, 6, 7], list(range(20, 53)), [9] * 16]
    # The loop itself reads each step's tokens (one step late); the step reads nothing.
    result = engine.generate(prompts, params)
    assert len(steps) == params.max_new_tokens - 1
    assert [len(t) for t in result.token_ids] == [params.max_new_tokens] * 3
    if backend == "triton":
        assert backend_stubs.launches > 0


@pytest.mark.parametrize("backend", ["triton", "flash-attn"])
def test_graph_captured_function_reads_nothing_from_the_device(tiny, backend_stubs, backend):
    # What DecodeGraph captures: forward_step over the static state of a bucket, on a batch
    # loaded into it. The torch reference is never captured (test_cuda_graph_loop_...).
    engine = make_engine("async:overlap", tiny, attention_backend=backend)
    engine.kv_cache.block_manager.add(async_loop.SCRATCH_REQUEST, engine.kv_cache.block_size)
    scratch = engine.kv_cache.block_manager.block_tables[async_loop.SCRATCH_REQUEST][0]
    state = async_loop.graph_state(engine, 4, scratch)
    state.context_lens[:3] = torch.tensor([3, 33, 16], dtype=torch.int32)
    tokens = torch.tensor([1, 2, 3, 4])
    with torch.inference_mode(), no_host_reads():
        for _ in range(2):  # capture runs it once; the warm-up before it twice
            logits = engine.forward_step(state, tokens)
    assert logits.shape == (4, tiny.config.vocab_size)


@pytest.mark.parametrize("backend", ["triton", "flash-attn"])
def test_the_serving_engines_decode_buckets_read_nothing_from_the_device(tiny, backend_stubs,
                                                                          backend):
    # What the runner captures for continuous batching (miniinfer.runner.cuda_graphs): every
    # bucket's static step run as its capture runs it, and a real step replayed into it.
    engine = make_engine("continuous", tiny, forward="direct", attention_backend=backend)
    runner = engine.runner
    graphs = DecodeGraphs(runner.forward, runner.kv_cache, tiny.max_context, emulate=True)
    for prompt in ([5, 6, 7], list(range(20, 53)), [9] * 16):
        engine.add_request(prompt, GREEDY)
    engine.step()  # the prompts
    with torch.inference_mode():  # as the engine's step runs
        step, _ = runner.prepare_step(
            engine.scheduler.schedule().plan(runner.kv_cache.block_manager))
    assert graphs.fits(step) and step.num_tokens == 3
    with torch.inference_mode():
        for size in GRAPH_BUCKETS:
            static = graphs.static(size)
            with no_host_reads():
                for _ in range(3):  # capture runs it once; the warm-up before it twice
                    assert static.run().shape == (size, tiny.config.vocab_size)
        with no_host_reads():
            logits = graphs.replay(step)
    assert logits.shape == (3, tiny.config.vocab_size)
    if backend == "triton":
        assert backend_stubs.launches > 0


def test_the_reference_decode_reads_the_device_without_a_bound(tiny, backend_stubs):
    # The check above is not vacuous: the paged-attention engine's own decode plan (no host
    # bound) does read the context lens back.
    engine = make_engine("async:overlap", tiny, attention_backend="torch")
    engine.kv_cache.block_manager.add(async_loop.SCRATCH_REQUEST, engine.kv_cache.block_size)
    scratch = engine.kv_cache.block_manager.block_tables[async_loop.SCRATCH_REQUEST][0]
    state = async_loop.graph_state(engine, 2, scratch)
    step = engine.prepare_inputs(state, torch.tensor([1, 2]))
    step.max_context_len = None
    with torch.inference_mode(), pytest.raises(HostReadError, match="host read"), \
            no_host_reads():
        engine.model_forward(step)


def test_reference_masks_stale_positions_as_it_lists_them(monkeypatch):
    # CUDA's path (a mask, no host read) gives what the CPU's (listing stale rows) gives, with
    # every never-written slot NaN and a bound past the longest context.
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.full((9, 16, 2, 16), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    tables = torch.tensor([[1, 2, 3], [4, 0, 0], [5, 6, 0]], dtype=torch.int32)
    lens = torch.tensor([40, 3, 17], dtype=torch.int32)
    for row, n in enumerate(lens.tolist()):
        for t in range(n):
            block, slot = int(tables[row, t // 16]), t % 16
            k_cache[block, slot] = torch.randn(2, 16, generator=gen)
            v_cache[block, slot] = torch.randn(2, 16, generator=gen)
    q = torch.randn(3, 4, 16, generator=gen)
    listed = reference.DecodePlan(tables, lens, 16)(q, k_cache, v_cache, 0.25)
    monkeypatch.setattr(reference, "MASK_STALE_ON", {"cpu"})
    masked = reference.DecodePlan(tables, lens, 16, max_context_len=48)(q, k_cache, v_cache, 0.25)
    assert not listed.isnan().any()
    torch.testing.assert_close(masked, listed)


def test_cuda_graph_loop_with_the_torch_reference_falls_back_to_overlap():
    cuda = torch.device("cuda")
    with pytest.warns(RuntimeWarning, match="running loop 'overlap' instead"):
        assert async_loop.choose_loop("cuda-graph", cuda, BACKENDS["torch"]) == \
            ("cuda-graph", "overlap")
    with pytest.warns(RuntimeWarning, match="overlap"):
        assert async_loop.choose_loop("auto", cuda, BACKENDS["torch"])[1] == "overlap"
    assert async_loop.choose_loop("auto", cuda, BACKENDS["triton"]) == ("cuda-graph",) * 2
    assert async_loop.choose_loop("cuda-graph", torch.device("cpu"), BACKENDS["triton"]) == \
        ("cuda-graph", "overlap")
    assert async_loop.choose_loop("auto", torch.device("cpu"), BACKENDS["torch"]) == \
        ("sync", "sync")


# -- sampling ------------------------------------------------------------------------------

def test_sampling_draws_from_the_softmax():
    # The exponential race picks token i with probability p_i: 20k draws of a known
    # distribution land within 4 standard errors of it.
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    params = SamplingParams(temperature=1.0, seed=0)
    gen = make_generator(params, torch.device("cpu"))
    draws = sample(probs.log().expand(20_000, -1), params, gen)
    freq = torch.bincount(draws, minlength=5).double() / len(draws)
    stderr = (probs.double() * (1 - probs.double()) / len(draws)).sqrt()
    assert ((freq - probs.double()).abs() < 4 * stderr).all(), freq


def test_sampling_draws_what_multinomial_drew():
    # torch.multinomial draws one sample by the same race (after its host-side check), so a
    # seed gives the tokens it gave before this change.
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.8, top_k=50, seed=3)
    ours = sample(logits, params, make_generator(params, torch.device("cpu")))
    probs = (logits / 0.8).masked_fill(logits < logits.topk(50).values[:, -1:], float("-inf"))
    theirs = torch.multinomial(probs.softmax(-1), 1,
                               generator=make_generator(params, torch.device("cpu")))
    assert torch.equal(ours, theirs.squeeze(-1))


def test_sampling_is_seeded_and_device_only():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.7, top_k=10, top_p=0.95, seed=4)
    with no_host_reads():
        first = sample(logits, params, make_generator(params, torch.device("cpu")))
        again = sample(logits, params, make_generator(params, torch.device("cpu")))
    assert torch.equal(first, again)


# -- Triton: probed before auto picks it; compiled for real GPUs ----------------------------

def test_auto_probes_triton_and_falls_back_with_a_reason(monkeypatch):
    # On a machine where the test launch fails (here: no CUDA at all), auto says why and
    # takes the reference instead of failing later in the middle of a run.
    if torch.cuda.is_available():
        pytest.skip("this machine can launch Triton")
    monkeypatch.setattr(flash, "unavailable_reason", lambda *args: "no flash-attn here")
    triton_attention.probe.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="test launch of the Triton kernel failed"):
            assert get_backend("auto", torch.device("cuda"), DEFAULT_BLOCK_SIZE).name == "torch"
    finally:
        triton_attention.probe.cache_clear()



# Head layouts (heads, kv heads, head dim) the book runs: SmolLM2-135M, Qwen2.5-7B, tiny.
LAYOUTS = {"smollm2": (9, 3, 64), "qwen2.5-7b": (28, 4, 128), "tiny": (4, 2, 16)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
KERNEL = getattr(triton_attention, "_paged_attention_kernel", None)
compiled_natively = pytest.mark.skipif(
    triton is None or not isinstance(KERNEL, JITFunction),
    reason="needs triton, and TRITON_INTERPRET unset at import (else the kernel is interpreted)")


def launch(layout: str, dtype: torch.dtype, max_seqlen_q: int, *, table_offset: int = 0,
           width: int = 8):
    """The kernel's arguments for a batch of 3 requests of this layout, built by the same
    ``launch_config`` the engines call; the tables and lens can sit at an offset inside one
    staged int32 buffer, as chapter 08 passes them."""
    heads, kv_heads, head_dim = LAYOUTS[layout]
    q = torch.zeros(3 * max_seqlen_q, heads, head_dim, dtype=dtype)
    k_cache = torch.zeros(64, DEFAULT_BLOCK_SIZE, kv_heads, head_dim, dtype=dtype)
    staged = torch.zeros(table_offset + 3 * width + 3 + 4, dtype=torch.int32)
    tables = staged[table_offset: table_offset + 3 * width].view(3, width)
    lens = staged[table_offset + 3 * width: table_offset + 3 * width + 3]
    cu_seqlens = staged[table_offset + 3 * width + 3:]
    return triton_attention.launch_config(q, torch.empty_like(q), k_cache, k_cache.clone(),
                                          cu_seqlens, tables, lens, 0.125, max_seqlen_q)


def specialization(arch: int, layout: str, dtype: torch.dtype, max_seqlen_q: int, **kwargs):
    """What Triton's JIT would compile for this launch on ``sm_<arch>``: signature, constants,
    attributes (alignment, divisibility) and options, from the real arguments."""
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(KERNEL.signature, KERNEL.params, backend)
    _, args, constants = launch(layout, dtype, max_seqlen_q, **kwargs)
    bound, spec, options = binder(*args, **constants)
    return target, KERNEL._pack_args(backend, constants, bound, spec, options)


def tile_sizes(layout: str) -> list[int]:
    """One query length per compiled tile size of this layout (decode first)."""
    heads, kv_heads, _ = LAYOUTS[layout]
    first: dict[int, int] = {}
    for n in range(1, 65):
        first.setdefault(triton_attention.tile_rows(heads // kv_heads, n), n)
    return list(first.values())


# Every layout, dtype and tile size (decode and each varlen tile) for sm_90; sm_80 (A100) for
# the GPU chapters' model layout. About a second per compile on our CPU.
COMPILES = [] if triton is None else [
    *[(90, layout, dtype, n) for layout in LAYOUTS for dtype in DTYPES
      for n in tile_sizes(layout)],
    *[(80, "qwen2.5-7b", dtype, n) for dtype in DTYPES for n in tile_sizes("qwen2.5-7b")]]


@pytest.fixture(scope="module")
def triton_cache(tmp_path_factory):
    # A cache of our own: the test compiles every time, never reads someone else's cubin.
    old = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))
    yield
    if old is None:
        os.environ.pop("TRITON_CACHE_DIR")
    else:
        os.environ["TRITON_CACHE_DIR"] = old


@compiled_natively
@pytest.mark.parametrize("arch,layout,dtype,max_seqlen_q", COMPILES,
                         ids=[f"sm{a}-{lay}-{d}-q{n}" for a, lay, d, n in COMPILES])
def test_kernel_compiles_for_the_gpu(triton_cache, arch, layout, dtype, max_seqlen_q):
    target, (options, signature, constants, attrs) = specialization(
        arch, layout, DTYPES[dtype], max_seqlen_q)
    kernel = triton.compile(ASTSource(KERNEL, signature, constants, attrs), target=target,
                            options=options.__dict__)
    assert kernel.asm["cubin"]  # ptxas assembled it for this architecture
    assert f"sm_{arch}" in kernel.asm["ptx"]


SPLIT_KERNEL = getattr(triton_attention, "_paged_decode_split_kernel", None)


@compiled_natively
@pytest.mark.parametrize("arch,layout,dtype", [(90, lay, d) for lay in LAYOUTS for d in DTYPES]
                         + [(80, "qwen2.5-7b", d) for d in DTYPES])
def test_split_decode_kernel_compiles_for_the_gpu(triton_cache, arch, layout, dtype,
                                                  monkeypatch):
    # Flash-decoding's kernel, with the arguments split_decode_attention launches it with
    # (captured from a call whose launch is replaced), compiled for the GPU here.
    heads, kv_heads, head_dim = LAYOUTS[layout]
    launched = {}

    class Capture:
        def __getitem__(self, grid):
            return lambda *args, **constants: launched.update(args=args, constants=constants)

    monkeypatch.setattr(triton_attention, "_paged_decode_split_kernel", Capture())
    monkeypatch.setattr(triton_attention, "combine_splits", lambda a, m, s: a.sum(2))
    q = torch.zeros(2, heads, head_dim, dtype=DTYPES[dtype])
    k_cache = torch.zeros(64, DEFAULT_BLOCK_SIZE, kv_heads, head_dim, dtype=DTYPES[dtype])
    triton_attention.split_decode_attention(
        q, k_cache, k_cache.clone(), torch.zeros(2, 32, dtype=torch.int32),
        torch.tensor([300, 17], dtype=torch.int32), 0.125, splits=4)
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(SPLIT_KERNEL.signature, SPLIT_KERNEL.params, backend)
    bound, spec, options = binder(*launched["args"], **launched["constants"])
    options, signature, constants, attrs = SPLIT_KERNEL._pack_args(
        backend, launched["constants"], bound, spec, options)
    kernel = triton.compile(ASTSource(SPLIT_KERNEL, signature, constants, attrs), target=target,
                            options=options.__dict__)
    assert kernel.asm["cubin"] and f"sm_{arch}" in kernel.asm["ptx"]


@compiled_natively
def test_staged_metadata_compiles_one_variant():
    # Chapter 08 passes tables, lens and cu_seqlens as slices of one staged buffer at offsets
    # that change every step, with a table width that is sometimes 1: all one variant.
    variants = {repr(specialization(90, "qwen2.5-7b", torch.bfloat16, 1, table_offset=offset,
                                    width=width)[1])
                for offset in (0, 1, 2, 3) for width in (1, 3, 16)}
    assert len(variants) == 1


# -- token equality: exact in fp32, near-ties only in bf16 ----------------------------------

@pytest.fixture(scope="module")
def tiny_bf16():
    from miniinfer import load_model

    return load_model("tiny", dtype="bf16")


def test_equality_model_is_fp32_with_the_same_weights(tiny, tiny_bf16):
    assert equality_model(tiny) is tiny
    exact = equality_model(tiny_bf16)
    assert exact.dtype == torch.float32 and exact.config.num_hidden_layers == 3
    for ours, theirs in zip(exact.model.parameters(), tiny.model.parameters(), strict=True):
        assert torch.equal(ours, theirs)  # seeded like the named model


def test_equality_model_cuts_a_big_random_model_to_a_few_layers(tiny):
    # Qwen2's config carries one layer type per layer; the stand-in must rebuild it.
    from transformers import AutoModelForCausalLM, Qwen2Config

    from miniinfer.core.models import LoadedModel

    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=tiny.config.vocab_size)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    lm = LoadedModel("qwen-like", model, tiny.tokenizer, torch.device("cpu"), torch.bfloat16,
                     tiny.eos_token_id, tiny.pad_token_id)
    exact = equality_model(lm)
    assert exact.dtype == torch.float32
    assert exact.config.num_hidden_layers == EXACT_LAYERS == len(exact.model.model.layers)
    assert len(exact.config.layer_types) == EXACT_LAYERS


def test_fp32_equality_is_exact(tiny):
    prompts = [[5, 6, 7]]
    assert "token for token" in compare_greedy(tiny, prompts, [[1, 2, 3]], [[1, 2, 3]])
    with pytest.raises(AssertionError, match="first differs at new token 2"):
        compare_greedy(tiny, prompts, [[1, 2, 4]], [[1, 2, 3]])


def test_bf16_equality_allows_only_near_ties(tiny_bf16):
    # Of 64 random prompts, the one whose two best next tokens are closest: a flip that bf16
    # rounding can cause. Its worst token is not.
    prompts = torch.randint(20, 1000, (64, 4), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        logits = tiny_bf16.model(prompts).logits[:, -1].float()
    top2 = logits.topk(2).values
    i = int((top2[:, 0] - top2[:, 1]).argmin())
    best, second = logits[i].topk(2).indices.tolist()
    prompt, far = prompts[i].tolist(), int(logits[i].argmin())
    line = compare_greedy(tiny_bf16, [prompt], [[second, 9]], [[best, 10]])
    assert "1 near-tie flip" in line
    with pytest.raises(AssertionError, match="not a near-tie"):
        compare_greedy(tiny_bf16, [prompt], [[far, 9]], [[best, 10]])
    with pytest.raises(AssertionError, match="first differs at new token 0"):  # fp32: exact
        compare_greedy(equality_model(tiny_bf16), [prompt], [[second, 9]], [[best, 10]])


def test_a_near_tie_is_counted_in_units_of_the_last_place():
    from miniinfer.bench.equality import NEAR_TIE_ULPS, ulp

    # bf16 keeps 8 significant bits: its unit is 2**-5 between 4 and 8, 2**-6 between 2 and 4.
    assert ulp(4.0, torch.bfloat16) == ulp(5.56, torch.bfloat16) == ulp(7.99, torch.bfloat16) == 2**-5
    assert ulp(3.99, torch.bfloat16) == 2**-6
    assert ulp(5.56, torch.float16) == 2**-8
    # The H100's flip (two logits near 5.6, 0.094 apart: 3 units) is a near-tie; 5 units is not.
    assert 0.09375 <= NEAR_TIE_ULPS * ulp(5.56, torch.bfloat16) < 5 * 2**-5
    # Next to the representable neighbours themselves:
    x = torch.tensor(5.56, dtype=torch.bfloat16)
    assert float(torch.nextafter(x, torch.tensor(8.0, dtype=torch.bfloat16)) - x) == \
        ulp(float(x), torch.bfloat16)


def test_check_engines_runs_fp32_exactly_and_bf16_within_tolerance(tiny_bf16):
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    lines = check_engines(tiny_bf16, "paged-attention", [[5, 6, 7], list(range(20, 40))],
                          params, one_by_one=True)
    assert len(lines) == 2
    assert "token for token" in lines[0] and "float32" in lines[0]
    assert "bfloat16" in lines[1]


# -- repro all: the plan --------------------------------------------------------------------

def test_repro_plan_fits_one_h100(capsys):
    from miniinfer.book.chapters import CHAPTERS
    from miniinfer.cli import main
    from miniinfer.lab.plans import plan_chapter

    cuda = torch.device("cuda")  # planning only: no CUDA call, works on this CPU machine
    plans = {chapter: plan_chapter(chapter, cuda) for chapter in CHAPTERS}
    # Each chapter fits one device call (10 minutes, less the machine's start and set-up); the
    # whole book takes several sessions' device time (15 minutes each), in chapter groups.
    assert all(p.estimate_s < 8 * 60 for p in plans.values())
    assert plans["06"].model == "qwen2.5-7b" and plans["06"].dtype == "bfloat16"
    assert plans["06"].repeats == 3
    assert "async:cuda-graph" in plans["07"].engines
    assert main(["repro", "all", "--dry-run", "--device", "cuda", "--chapters", "05,6"]) == 0
    out = capsys.readouterr().out
    assert "  05  ~" in out and "  06  ~" in out and "  07  ~" not in out
    assert "estimated total" in out
    assert main(["repro", "all", "--dry-run", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {chapter}  ~" in out for chapter in CHAPTERS)
    assert "smollm2-135m float32" in out
    assert main(["repro", "all", "--dry-run", "--chapters", "42"]) == 2
    assert main(["repro", "01", "--dry-run"]) == 2


def test_chapter07_loads_its_model_once(tiny, monkeypatch, tmp_path):
    # A second Qwen2.5-7B would hold 15 GB more while the notebook's kernel loads its own.
    from miniinfer.bench.offline import BenchConfig
    from miniinfer.lab import recordings as repro

    loads = []
    monkeypatch.setattr(repro, "load_model", lambda name, device: loads.append(name) or tiny)
    monkeypatch.setattr(repro, "REPO_ROOT", tmp_path)
    monkeypatch.setattr("miniinfer.bench.devices.YOURS_DIR", tmp_path / "results")
    monkeypatch.delenv("MINIINFER_RECORD_FOR_BOOK", raising=False)
    monkeypatch.setattr(repro, "default_workload", lambda device, chapter=None: (
        "tiny", BenchConfig(batch_sizes=(1,), prompt_len=8, new_tokens=3, warmup=0, repeat=1)))
    bench, timeline = repro.run_chapter07("cpu")
    assert loads == ["tiny"]
    assert bench.is_file() and timeline.is_file()
    from miniinfer.bench.devices import device_isa
    assert set(pd.read_csv(timeline).isa) == {device_isa(tiny.device)}  # which host drew it


def test_the_plan_counts_context_sweeps_and_turn_gaps():
    from dataclasses import replace

    from miniinfer.book.chapters import CHAPTERS
    from miniinfer.book.workloads import default_workload, prefix_cache_experiments
    from miniinfer.lab.plans import bench_plan, plan_chapter, serving_plan, sweep_seconds

    cuda = torch.device("cuda")  # planning only
    model, base = default_workload(cuda)
    # Chapter 06 sweeps 4 stages over 5 context lengths after its benchmark: on the H100 that
    # took longer than the benchmark itself (about 130 s against 100).
    bench_only = bench_plan(model, cuda, replace(base, engines=CHAPTERS["06"].engines_for("cuda")))
    with_sweep = plan_chapter("06", cuda)
    sweep = sweep_seconds(CHAPTERS["06"].context_sweep, cuda)
    assert with_sweep.estimate_s == pytest.approx(bench_only.estimate_s + sweep)
    assert sweep > 60 and "context sweep 128,512,1024,2048,4096" in with_sweep.tokens
    assert plan_chapter("01", cuda).estimate_s == pytest.approx(bench_plan(
        model, cuda, replace(base, engines=CHAPTERS["01"].engines_for("cuda"))).estimate_s)
    # Multi-turn: each conversation's last turn is sent 3 gaps after its first, whatever the
    # engine's speed (on the H100 each run took 17.6 s where its tokens alone took 3).
    _, experiments = prefix_cache_experiments(cuda)
    multi = experiments["multi-turn"]
    no_gap = replace(multi, workload=replace(multi.workload, turn_gap_s=0.0))
    runs = len(multi.systems)
    gaps = serving_plan(model, {"m": multi}, cuda, "m").estimate_s \
        - serving_plan(model, {"m": no_gap}, cuda, "m").estimate_s
    assert gaps == pytest.approx(runs * 3 * 5.0)


def test_the_plan_counts_each_round_of_a_repeated_run(monkeypatch):
    from dataclasses import replace

    from miniinfer.book.workloads import serving_experiments
    from miniinfer.lab import catching
    from miniinfer.lab.plans import chapter11_plan, device_costs, serving_plan

    cpu = torch.device("cpu")  # planning only
    model, experiments = serving_experiments(cpu)
    once = experiments["target"]
    load_s = device_costs(cpu).load_s
    one, three = (serving_plan(model, {"t": replace(once, repeats=n)}, cpu, "t").estimate_s
                  for n in (1, 3))
    assert three - load_s == pytest.approx(3 * (one - load_s))
    # Chapter 11 repeats the target workload in-process and over HTTP, ours and vLLM's.
    compiled = serving_plan(model, {"t": replace(once, systems=("compiled",))}, cpu,
                            "t").estimate_s
    rounds = chapter11_plan(cpu).estimate_s
    monkeypatch.setattr(catching, "SERVED_REPEATS", 1)
    assert rounds > chapter11_plan(cpu).estimate_s + 2 * (compiled - load_s)
