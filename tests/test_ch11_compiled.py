"""Chapter 11: the direct forward compiled by inductor computes what the eager one does (logits
within fp32 tolerance, HF's greedy tokens) through chapter 06's static batches and chapter 08's
mixed batches, and after warm-up no step compiles anything again. Only the tiny model is
compiled here (a compile on 2 cores takes seconds per graph even for it); SmolLM2 is checked by
hand and in the chapter."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch._dynamo.utils import counters

from miniinfer import SamplingParams, load_model, make_engine
from miniinfer.core.config import MAX_DRAFT_TOKENS
from miniinfer.core.errors import MiniInferError
from miniinfer.core.kernels import cpu_decode
from miniinfer.runner import compiled, compiled_attention
from miniinfer.runner.compiled import CompiledForward, CompileOptions
from miniinfer.runner.compiled_attention import segment_attention
from miniinfer.runner.model import load
from miniinfer.runner.onednn_linear import (
    PrepackedLinear,
    is_prepacked,
    onednn_available,
    onednn_linear,
    prepacked,
)
from miniinfer.runner.onednn_linear import calls as onednn_calls

# Few buckets and no autotuning keep compiling to seconds (and the second engine's forward
# reuses the first one's graphs: same weights, same shapes); the largest bucket is small
# enough that prompts run in several chunks, and without the C++ kernel attends by segment
# past its first 4 tokens (so decodes, prompt chunks and padding all go through both kinds of
# attention there; with it, every token goes through the kernel). The 16-token
# bucket runs its matmuls through oneDNN's prepacked weights on every CPU (by default a CPU with
# AVX2 only would not), the smaller ones through inductor's.
OPTIONS = CompileOptions(token_buckets=(1, 4, 16), max_autotune=False,
                         segment_attention_min_tokens=16, fused_attention_rows=4,
                         onednn_min_tokens=16, onednn_min_tokens_avx2=16)
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)
# Lengths that end on a block boundary (16, 32), one past it (17) and sum past 64 (chunks).
PROMPT_LENGTHS = (3, 16, 17, 32, 9)


def prompts(lengths=PROMPT_LENGTHS) -> list[list[int]]:
    return [[(31 * i + 7 * j) % 4000 + 10 for j in range(n)] for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def paged(tiny):
    """A ``paged-attention`` engine on the compiled forward, and the eager forward it had."""
    engine = make_engine("paged-attention", tiny)
    eager = engine.runner.forward
    engine.runner.forward = CompiledForward(tiny.model, engine.kv_cache, OPTIONS)
    return engine, eager


@pytest.fixture(scope="module")
def continuous(tiny):
    """The ``compiled`` stage (chapter 08's engine on the compiled forward), with a token budget
    that splits prompts into chunks and mixes them with decodes; every bucket compiled up
    front."""
    engine = make_engine("compiled", tiny, compile_options=OPTIONS, max_num_batched_tokens=24)
    assert engine.runner.forward_name == "compiled"
    engine.runner.forward.warm_up()
    return engine, engine.runner.forward.eager


@pytest.fixture(scope="module")
def hf_alone(tiny) -> list[list[int]]:
    hf = make_engine("hf", tiny)
    return [hf.generate([p], GREEDY).token_ids[0] for p in prompts()]


class Compared:
    """Runs the eager and the compiled forward on every call (eager first: both write the same
    K/V, the compiled forward's then stays) and records how far their logits are apart."""

    def __init__(self, eager, compiled: CompiledForward) -> None:
        self.eager, self.compiled = eager, compiled
        self.calls: list[tuple[int, int, float]] = []  # (tokens, logits rows, max abs diff)

    def __call__(self, batch):
        expected = self.eager(batch)
        logits = self.compiled(batch)
        assert logits.shape == expected.shape
        self.calls.append((batch.num_tokens, len(logits),
                           float((logits - expected).abs().max())))
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
        return logits


def test_logits_match_eager_through_prefill_chunks_and_padded_decodes(paged):
    engine, eager = paged
    compiled = engine.runner.forward
    engine.runner.forward = Compared(eager, compiled)
    before = dict(onednn_calls)
    compiled_attention._last_plan = None
    try:
        engine.generate(prompts(), GREEDY)
        calls = engine.runner.forward.calls
    finally:
        engine.runner.forward = compiled
    # Every 16-token step's matmuls went through a packed weight: a layer's 4 (q/k/v and
    # gate/up merged) in each of the 5 prefill chunks and 11 decode steps, and the LM head's
    # once for the prefill's last rows and once a decode step.
    layers = engine.kv_cache.num_layers
    assert compiled._gemm(16) == "onednn" and compiled._gemm(4) == "template"
    assert onednn_calls["packed"] - before["packed"] == (5 + 11) * 4 * layers + (1 + 11)
    assert onednn_calls["unpacked"] == before["unpacked"]
    total = sum(PROMPT_LENGTHS)
    # The prefill (77 tokens: four chunks of 16, then 13 padded to 16) and every decode step
    # (5 tokens padded to 16), each compared.
    assert calls[0][:2] == (total, len(PROMPT_LENGTHS))
    assert [c[:2] for c in calls[1:]] == [(5, 5)] * (GREEDY.max_new_tokens - 1)
    # The 16-token bucket's graphs ran (compiled by this forward or, in another order of the
    # tests, by an earlier one with the same options, which shares them).
    assert {("body", 16), ("head", 16)} <= compiled._compiled
    # With the C++ kernel every token attends through it, a prompt chunk's a tile at a time.
    assert compiled.reason_fused is None
    assert not compiled._by_segment(16) and not compiled._by_segment(4)
    assert compiled_attention._last_plan is None  # the segment op never ran
    assert compiled.compiled and compiled.reason_eager is None


def test_without_the_kernel_prompt_chunks_attend_by_segment_and_match_eager(tiny):
    """The fused formula's forward (where the C++ kernel does not build): past its first 4
    tokens a 16-token bucket attends by segment, one SDPA per prompt chunk."""
    engine = make_engine("paged-attention", tiny)
    eager = engine.runner.forward
    compiled = CompiledForward(tiny.model, engine.kv_cache, replace(OPTIONS, attention_kernel=False))
    assert compiled._by_segment(16) and not compiled._by_segment(4)
    engine.runner.forward = Compared(eager, compiled)
    compiled_attention._last_plan = None
    engine.generate(prompts(), GREEDY)
    assert engine.runner.forward.calls[0][:2] == (sum(PROMPT_LENGTHS), len(PROMPT_LENGTHS))
    assert compiled_attention._last_plan is not None  # the segment op planned a step: it ran
    assert ("body", 16) in compiled._compiled  # compiled here or shared (see above)


def test_greedy_matches_hf_in_a_static_batch(paged, tiny, hf_alone):
    engine, _ = paged
    hf = make_engine("hf", tiny)
    assert engine.generate(prompts(), GREEDY).token_ids == \
        hf.generate(prompts(), GREEDY).token_ids
    for prompt, ref in zip(prompts(), hf_alone, strict=True):
        assert engine.generate([prompt], GREEDY).token_ids[0] == ref
    manager = engine.kv_cache.block_manager
    assert manager.num_free_blocks == manager.num_blocks


def run_requests(engine, lengths_and_new_tokens) -> tuple[dict, list]:
    """Add every request at once (each its own max_new_tokens), step until idle; returns the
    finished requests by id and the steps."""
    for rid, (prompt, new) in enumerate(lengths_and_new_tokens):
        engine.add_request(prompt, SamplingParams(max_new_tokens=new, ignore_eos=True),
                           request_id=rid)
    finished, steps = {}, []
    while engine.has_unfinished_requests():
        result = engine.step()
        steps.append(result)
        finished.update((r.request_id, r) for r in result.outputs if r.finished)
    return finished, steps


def test_continuous_mixed_batches_match_eager_and_hf(continuous, tiny):
    engine, eager = continuous
    compiled = engine.runner.forward
    engine.runner.forward = Compared(eager, compiled)
    hf = make_engine("hf", tiny)
    new_tokens = (12, 5, 9, 12, 3)
    try:
        finished, steps = run_requests(engine, list(zip(prompts(), new_tokens, strict=True)))
        calls = engine.runner.forward.calls
    finally:
        engine.runner.forward = compiled
    assert any(s.num_decodes and s.num_prefill_tokens for s in steps)  # mixed steps ran
    assert len(calls) == len(steps)
    for rid, (prompt, new) in enumerate(zip(prompts(), new_tokens, strict=True)):
        ref = hf.generate([prompt], SamplingParams(max_new_tokens=new, ignore_eos=True))
        assert finished[rid].output_ids == ref.token_ids[0], f"request {rid}"


def test_nothing_recompiles_after_warm_up_as_batch_sizes_change(continuous):
    engine, _ = continuous
    forward = engine.runner.forward
    graphs, compiles = counters["stats"]["unique_graphs"], forward.num_compiles
    compiled_buckets = dict(forward.compile_seconds)
    # Requests that finish at different steps: the decode batch shrinks from 5 to 1, and
    # prompts of several lengths chunk into mixed steps of several token counts.
    work = list(zip(prompts((5, 40, 12, 3, 21, 16)), (2, 18, 6, 9, 4, 11), strict=True))
    finished, steps = run_requests(engine, work)
    assert len(finished) == len(work)
    token_counts = {s.num_decodes + s.num_prefill_tokens for s in steps}
    assert {forward.bucket(n) for n in token_counts} == {1, 4, 16}  # every bucket, and
    assert max(token_counts) > 16  # steps chunked past the largest
    assert len({s.num_decodes for s in steps}) >= 5
    assert counters["stats"]["unique_graphs"] == graphs
    assert forward.num_compiles == compiles
    assert forward.compile_seconds == compiled_buckets


def test_forwards_over_one_model_share_their_graphs(paged, tiny):
    engine, _ = paged
    first = engine.runner.forward
    first.warm_up()
    # What a serving benchmark does for each token budget: a new engine, a new pool (of the
    # same size), the same model and options.
    again = CompiledForward(tiny.model, make_engine("paged-attention", tiny).kv_cache, OPTIONS)
    assert again._graphs is first._graphs and again._heads is first._heads
    assert again.body("template", False) is first.body("template", False)
    # It knows which buckets are compiled already: only a first compile runs with oneDNN off.
    assert again._compiled is first._compiled and ("body", 16) in again._compiled
    assert again.warm_up() == {} and again.num_compiles == 0
    other = CompiledForward(tiny.model, engine.kv_cache, replace(OPTIONS, fused_attention_rows=2))
    assert other.body is not first.body


def test_falls_back_to_eager_and_says_why(tiny):
    engine = make_engine("paged-attention", tiny)
    eager = engine.runner.forward
    # No C++ compiler: what a CPU without one looks like to inductor. (Inductor's own patch:
    # monkeypatch's undo deleted the setting, and every later compile in the process fell
    # back to eager.)
    with (torch._inductor.config.patch({"cpp.cxx": ("no-such-c++-compiler",)}),
          pytest.warns(RuntimeWarning, match=r"compiled forward unavailable \(InvalidCxxCompiler"
                                             r".*no-such-c\+\+-compiler.*\); running the eager")):
        forward = CompiledForward(tiny.model, engine.kv_cache, OPTIONS)
    assert not forward.compiled and "no-such-c++-compiler" in forward.reason_eager
    graphs = counters["stats"]["unique_graphs"]
    engine.runner.forward = forward
    tokens = engine.generate(prompts()[:2], GREEDY).token_ids
    engine.runner.forward = eager
    assert tokens == engine.generate(prompts()[:2], GREEDY).token_ids
    assert counters["stats"]["unique_graphs"] == graphs and not forward.compile_seconds


def test_a_step_runs_as_the_cheapest_chunks_of_buckets(tiny):
    engine = make_engine("paged-attention", tiny)
    forward = CompiledForward(tiny.model, engine.kv_cache, CompileOptions())
    assert [forward.chunk_sizes(n) for n in (1, 3, 33, 48, 500, 512)] == \
        [[1], [3], [33], [48], [500], [512]]  # one chunk, padded to its bucket
    # Past 256, padding to 512 would cost more than one more chunk: 259 as 256 + 3.
    assert forward.chunk_sizes(259) == [256, 3]
    assert forward.chunk_sizes(1030) == [512, 512, 6]
    per_chunk = forward.options.chunk_cost_tokens

    def cost(sizes):  # tokens run, padding included, and the cost of each chunk
        return sum(forward.bucket(s) + per_chunk for s in sizes)

    for n in range(1, 1100, 7):
        sizes = forward.chunk_sizes(n)
        assert sum(sizes) == n and all(s in forward.options.token_buckets for s in sizes[:-1])
        # No dearer than one padded chunk, or than chunks of the largest bucket.
        assert cost(sizes) <= cost([512] * (n // 512) + [n % 512] * (n % 512 > 0))


def test_rejects_bad_buckets():
    for buckets in ((), (4, 2), (0, 1), (2, 2)):
        with pytest.raises(MiniInferError, match="token_buckets"):
            CompileOptions(token_buckets=buckets)
    for name, value in (("fused_attention_rows", 0), ("chunk_cost_tokens", -1),
                        ("segment_attention_min_tokens", 0), ("fused_attention_rows", True),
                        ("chunk_cost_tokens", 2.5)):
        with pytest.raises(MiniInferError, match=f"{name} must be a whole number"):
            CompileOptions(**{name: value})
    assert CompileOptions(segment_attention_min_tokens=None).segment_attention_min_tokens is None
    with pytest.raises(MiniInferError, match="onednn_min_tokens must be a whole number"):
        CompileOptions(onednn_min_tokens=0)
    with pytest.raises(MiniInferError, match="onednn_min_tokens_bf16 must be a whole number"):
        CompileOptions(onednn_min_tokens_bf16=0)
    with pytest.raises(MiniInferError, match="onednn_min_tokens_avx2 must be a whole number"):
        CompileOptions(onednn_min_tokens_avx2=0)
    assert CompileOptions(onednn_min_tokens=None).onednn_min_tokens is None


@pytest.mark.skipif(not onednn_available(torch.device("cpu")), reason="no oneDNN in this torch")
def test_the_onednn_threshold_follows_the_models_dtype_and_the_cpus_vectors(tiny):
    fp32 = CompiledForward(tiny.model, make_engine("paged-attention", tiny).kv_cache)
    assert fp32.cpu_isa == torch.backends.cpu.get_cpu_capability()
    # AVX-512 and others: from 16 tokens; AVX2 only: past the autotuned buckets (up to 32).
    for isa, kinds in (("AVX512", ["template", "template", "onednn", "onednn", "onednn"]),
                       ("AVX2", ["template", "template", "template", "template", "onednn"])):
        fp32.cpu_isa = isa
        assert [fp32._gemm(n) for n in (4, 8, 16, 32, 48)] == kinds, isa
    bf16 = load_model("tiny", dtype=torch.bfloat16)
    forward = CompiledForward(bf16.model, make_engine("paged-attention", bf16).kv_cache)
    if onednn_available(torch.device("cpu"), torch.bfloat16):
        assert [forward._gemm(n) for n in (4, 8, 16)] == ["template", "onednn", "onednn"]
    else:  # a CPU without bf16 arithmetic (AVX2 only): oneDNN refuses bf16 weights
        assert [forward._gemm(n) for n in (4, 8, 16, 64)] == \
            ["template", "template", "template", "aten"]
        # Built without prepacking (which raised on such a CPU), no weight has a oneDNN copy.
        assert not is_prepacked(bf16.model.lm_head.weight)
    never = CompileOptions(onednn_min_tokens_bf16=None)
    forward = CompiledForward(bf16.model, make_engine("paged-attention", bf16).kv_cache, never)
    assert forward._gemm(16) == "template" and forward._gemm(64) == "aten"


# Two small buckets through the autotuned GEMM template (as the stage ships), 16 through oneDNN.
TEMPLATE_OPTIONS = CompileOptions(token_buckets=(4, 8, 16), onednn_min_tokens=16,
                                  onednn_min_tokens_avx2=16)


@pytest.mark.skipif(not onednn_available(torch.device("cpu")), reason="no oneDNN in this torch")
def test_autotuned_template_graphs_match_eager_beside_the_merged_projections(tiny):
    """The other tests compile without autotuning (seconds, not minutes), so none runs
    inductor's C++ GEMM template, which the stage as it ships runs for its small buckets. That
    template (torch 2.13) packs a frozen weight from the start of its storage, whatever the
    view's offset: while the merged projections were views into the model's weights, the
    template graphs computed the key, value and up projections from the query's and gate's
    first rows (SmolLM2's logits off by up to 58; here the hidden states by about 0.1). This
    test autotunes one small bucket's body after the weights are merged and prepacked."""
    engine = make_engine("paged-attention", tiny)
    forward = CompiledForward(tiny.model, engine.kv_cache, TEMPLATE_OPTIONS)
    assert forward._gemm(8) == "template" and forward._gemm(16) == "onednn"
    # Packed before the graph compiles.
    assert is_prepacked(prepacked(load(tiny.model)).layers[0].attention.qkv.weight)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 4000, (8,), generator=generator)
    positions, slots = torch.arange(8), torch.arange(8) + 16  # block 1, its first 8 slots
    tables = torch.tensor([[1, 2]] * 8, dtype=torch.int32)
    graph = forward.body("template", forward._by_segment(8))
    with torch.inference_mode():
        pool = forward.pool.clone()
        compiled = forward._body(ids, positions, slots, tables).clone()
        compiled_pool = forward.pool.clone()
        forward.pool.copy_(pool)
        cos, sin = forward.model.rope(positions)
        eager = graph._orig_mod(ids, positions, cos, sin, slots, torch.arange(8), tables,
                                forward.pool)
    assert forward.compile_seconds.keys() == {("body", 8)}
    torch.testing.assert_close(compiled_pool, forward.pool, rtol=1e-4, atol=1e-4)  # K and V
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)


def test_forwards_that_differ_only_in_inductor_config_compile_graphs_of_their_own(tiny):
    """Dynamo hands a compiled graph to any torch.compile with equal options: freezing and the
    kernel profile, patched in around the calls, once ran the first forward's graphs (chapter
    11's ablation measured its "+ freezing" row on the unfrozen graphs)."""
    engine = make_engine("paged-attention", tiny)
    # A bucket no other test compiles, no autotuning, no ops called out of the graph.
    plain = CompileOptions(token_buckets=(5,), max_autotune=False, freezing=False,
                           segment_attention_min_tokens=None, attention_kernel=False,
                           onednn_min_tokens=None, onednn_min_tokens_avx2=None,
                           onednn_min_tokens_bf16=None)
    compiles = {}
    for name, options in (("plain", plain), ("frozen", replace(plain, freezing=True)),
                          ("profiled", replace(plain, kernel_profile=True))):
        forward = CompiledForward(tiny.model, engine.kv_cache, options)
        forward.warm_up([5])
        compiles[name] = forward.num_compiles
    assert compiles == {"plain": 2, "frozen": 2, "profiled": 2}  # a body and a head each


def test_template_buckets_hold_one_packed_copy_of_the_weights(tiny):
    """Each autotuned bucket's graph packs the weights for the template the same way; its
    copies share the first graph's memory (SmolLM2 on a CPU, every bucket compiled: 10.4 ->
    4.6 GiB resident), the shared graphs still compute what the eager forward does, and
    compiling leaves no copy of the cache entries in torch's in-memory artifact record."""
    from torch._inductor.codecache import PyCodeCache
    from torch.compiler._cache import CacheArtifactManager

    engine = make_engine("paged-attention", tiny)
    eager = engine.runner.forward
    forward = CompiledForward(tiny.model, engine.kv_cache, TEMPLATE_OPTIONS)
    loaded, recorded = len(PyCodeCache.modules), len(CacheArtifactManager._seen_artifacts)
    forward.warm_up([4, 8])  # the head's graphs are new here, whichever test ran first
    big = [value for module in PyCodeCache.modules[loaded:] for value in vars(module).values()
           if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)
           and value.untyped_storage().nbytes() >= compiled.SHARE_MIN_BYTES]
    assert len(big) >= 2  # the LM head packed by each bucket's head graph
    held = compiled._CONSTANTS[tiny.model]
    for value in big:  # one storage per distinct value, the registered one
        layout = held[(tuple(value.shape), value.stride(), value.dtype, value.device)]
        (same,) = [t for t in layout if torch.equal(t, value)]
        assert same.untyped_storage().data_ptr() == value.untyped_storage().data_ptr()
    assert forward.shared_constant_bytes >= big[0].untyped_storage().nbytes()
    assert len(CacheArtifactManager._seen_artifacts) == recorded
    compared = Compared(eager, forward)
    engine.runner.forward = compared
    engine.generate(prompts((3, 5)), SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert {forward.bucket(tokens) for tokens, _, _ in compared.calls} == {4, 8}


@pytest.mark.skipif(not onednn_available(torch.device("cpu")), reason="no oneDNN in this torch")
def test_prepacked_linears_share_the_models_fused_weights_and_fall_back_without(tiny):
    model = load(tiny.model)
    packed = prepacked(model)
    assert prepacked(model) is packed and load(tiny.model) is model  # once per model
    dense, qkv = model.layers[0].attention.qkv, packed.layers[0].attention.qkv
    assert isinstance(qkv, PrepackedLinear) and qkv.weight is dense.weight  # swapped, shared
    assert type(dense).forward is not PrepackedLinear.forward  # the dense model is unchanged
    attn, mlp = tiny.model.model.layers[0].self_attn, tiny.model.model.layers[0].mlp
    # Every weight the graphs see is a whole tensor of its own (views into one tensor misled
    # inductor's GEMM template, see the test above); HF's own projections, which no graph
    # sees, are the views: rows of the fused weights.
    for weight in (p for p in packed.parameters() if p.dim() == 2):
        assert weight.storage_offset() == 0
        assert weight.untyped_storage().nbytes() == weight.numel() * weight.element_size()
    gate_up = packed.layers[0].feed_forward.gate_up.weight
    for projection, fused in ((attn.q_proj, qkv.weight), (attn.k_proj, qkv.weight),
                              (attn.v_proj, qkv.weight), (mlp.gate_proj, gate_up),
                              (mlp.up_proj, gate_up)):
        assert projection.weight.untyped_storage().data_ptr() == \
            fused.untyped_storage().data_ptr()
    torch.testing.assert_close(
        qkv.weight, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    x = torch.randn(5, qkv.weight.shape[1])
    before = dict(onednn_calls)
    torch.testing.assert_close(qkv(x), dense(x), rtol=1e-5, atol=1e-5)
    assert onednn_calls["packed"] == before["packed"] + 1
    loose = torch.randn(7, qkv.weight.shape[1])  # never prepacked: F.linear, exactly
    assert torch.equal(onednn_linear(x, loose), torch.nn.functional.linear(x, loose))
    assert onednn_calls["unpacked"] == before["unpacked"] + 1


def test_segment_attention_equals_each_tokens_own_attention():
    """Decodes, prompt chunks of four requests back to back (one starting mid-prompt, two
    of one length from position 0, which attend as one batch, one shorter) and padding, cut
    into segments by request and position; each real token's output is the softmax over
    exactly its request's positions up to its own."""
    torch.manual_seed(0)
    block_size, num_blocks, kv_heads, heads, dim = 4, 12, 2, 4, 8
    slots = num_blocks * block_size
    pool = torch.randn(2 * slots, kv_heads, dim)
    tables = torch.tensor([[3, 7, 0], [5, 1, 9], [2, 8, 0], [6, 4, 0], [10, 11, 0], [0, 3, 0]],
                          dtype=torch.int32)
    # (request, position) of each token: two decodes, a chunk at 3..7, two chunks at 0..3, one
    # at 0..2.
    tokens = [(0, 9), (1, 5), *[(2, p) for p in range(3, 8)], *[(3, p) for p in range(4)],
              *[(4, p) for p in range(4)], *[(5, p) for p in range(3)]]
    num_padding = 3
    request = torch.tensor([r for r, _ in tokens] + [0] * num_padding)
    positions = torch.tensor([p for _, p in tokens] + [0] * num_padding)
    real = torch.arange(len(request)) < len(tokens)
    q = torch.randn(len(request), heads, dim)
    out = segment_attention(q, pool, 0, slots, block_size, real, positions, tables[request],
                            0.3)
    plan = compiled_attention._last_plan[1]
    assert [(start, end, count) for start, end, _, _, count in plan.chunks] == \
        [(2, 7, 1), (7, 15, 2), (15, 18, 1)]
    for row, (r, p) in enumerate(tokens):
        context = torch.arange(p + 1)
        slot = tables[r][context // block_size].long() * block_size + context % block_size
        keys = pool[slot].repeat_interleave(heads // kv_heads, 1)  # [context, heads, dim]
        values = pool[slots + slot].repeat_interleave(heads // kv_heads, 1)
        weights = torch.softmax((q[row] * keys).sum(-1) * 0.3, dim=0)  # [context, heads]
        expected = (weights[..., None] * values).sum(0)
        torch.testing.assert_close(out[row], expected, rtol=1e-5, atol=1e-5)
    assert not out[len(tokens):].any()


def test_segment_attention_keeps_its_plan_only_for_the_same_step():
    """A step's layers share one plan (made from the positions and tables, which every layer
    passes alike); a call with other values of the same shapes (the next step) gets a plan of
    its own, never the last step's: its output is what a fresh plan gives."""
    torch.manual_seed(0)
    block_size, kv_heads, heads, dim = 4, 2, 4, 8
    slots = 12 * block_size
    pool = torch.randn(2 * slots, kv_heads, dim)
    q = torch.randn(6, heads, dim)
    real = torch.ones(6, dtype=torch.bool)
    tables = torch.tensor([[3, 7, 0]], dtype=torch.int32).expand(6, 3)

    def attend(positions, tables):
        return segment_attention(q, pool, 0, slots, block_size, real, positions, tables, 0.3)

    first = attend(torch.arange(6), tables)
    plan = compiled_attention._last_plan[1]
    assert torch.equal(attend(torch.arange(6), tables.clone()), first)
    assert compiled_attention._last_plan[1] is plan  # the same values: the same plan
    for positions, step_tables in ((torch.arange(6), tables.flip(1)),  # another request
                                   (torch.arange(1, 7), tables)):  # one position on
        out = attend(positions, step_tables)
        assert compiled_attention._last_plan[1] is not plan and not torch.equal(out, first)
        compiled_attention._last_plan = None
        assert torch.equal(attend(positions, step_tables), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 48])
@pytest.mark.parametrize("kv_heads", [3, 1, 9])
def test_the_cpp_kernel_equals_each_tokens_own_attention(dtype, dim, kv_heads):
    """Each token (decodes of two requests, prompt chunks of two requests, one starting a
    prompt and running into the next block and one of an odd length deep in its request, a
    token whose position lies past its table, as a padding row's may) attends to exactly its
    own request's positions up to its own, read from this layer's K and V rows of the pool
    (another layer's rows around them hold other values). In fp32 the 21-token chunk goes in
    tiles (its tokens with the 9, 3 or 1 heads of each kv head: a tile of 6 tokens, of 2, and
    none, one token at a time), the 7-token one a token at a time; a head of 48 is not a whole number of four AVX2 or AVX-512 vectors
    (the per-token path's leftover vectors), nor of two AVX-512 vectors (no tiles there)."""
    if (reason := cpu_decode.unavailable(dim)) is not None:
        pytest.fail(f"the C++ kernel should build wherever inductor does: {reason}")
    torch.manual_seed(0)
    block_size, num_blocks, heads = 16, 12, 9
    slots = num_blocks * block_size
    pool = torch.randn(4 * slots, kv_heads, dim).to(dtype)  # two layers' K and V
    k_base, v_base = 2 * slots, 3 * slots  # the second layer
    tables = torch.tensor([[3, 7, 0, 0], [5, 1, 9, 11], [2, 8, 4, 0]], dtype=torch.int32)
    tokens = [(0, 20), (1, 63), *[(2, p) for p in range(30, 37)], (0, 0), (2, 90),
              *[(0, p) for p in range(0, 21)], (1, 40)]
    request = torch.tensor([r for r, _ in tokens])
    positions = torch.tensor([p for _, p in tokens])
    q = torch.randn(len(tokens), heads, dim).to(dtype)
    out = cpu_decode.paged_token_attention(q, pool, k_base, v_base, block_size,
                                           tables[request], positions, 0.125)
    assert out.dtype == dtype and out.shape == q.shape
    for row, (r, p) in enumerate(tokens):
        context = torch.arange(min(p + 1, tables.shape[1] * block_size))
        slot = tables[r][context // block_size].long() * block_size + context % block_size
        keys = pool[k_base + slot].float().repeat_interleave(heads // kv_heads, 1)
        values = pool[v_base + slot].float().repeat_interleave(heads // kv_heads, 1)
        weights = torch.softmax((q[row].float() * keys).sum(-1) * 0.125, dim=0)
        expected = (weights[..., None] * values).sum(0).to(dtype)
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out[row], expected, rtol=tolerance, atol=tolerance)
    with pytest.raises(RuntimeError, match="int32 tables"):
        cpu_decode.paged_token_attention(q, pool, k_base, v_base, block_size,
                                         tables[request].long(), positions, 0.125)
    if kv_heads > 1:  # 8 heads over 3 or 9 kv heads
        with pytest.raises(RuntimeError, match="multiple of kv heads"):
            cpu_decode.paged_token_attention(q[:, :8], pool, k_base, v_base, block_size,
                                             tables[request], positions, 0.125)


def test_rope_read_from_the_table_is_the_models_rope_bit_for_bit(tiny):
    """The compiled forward reads cos and sin from a table of positions (grown when a position
    passes its end) instead of computing them each step: the same values exactly."""
    engine = make_engine("paged-attention", tiny)
    forward = CompiledForward(tiny.model, engine.kv_cache, CompileOptions(token_buckets=(4,)))
    for positions in (torch.tensor([0, 5, 1023]), torch.tensor([7, 1024, 3000, 2])):
        got = forward.rope(positions, int(positions.max()))
        want = forward.model.rope(positions)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert forward._rope_table[0].shape[0] == 4096  # grown by doubling past 3000
    assert all(torch.equal(g, w) for g, w in zip(forward.rope(torch.tensor([9])),
                                                   forward.model.rope(torch.tensor([9])),
                                                   strict=True))  # no bound: computed


@pytest.mark.parametrize("kv_heads", [3, 1])
def test_fewer_tokens_than_threads_split_a_tokens_kv_heads_and_agree_bit_for_bit(kv_heads):
    """A batch-1 decode is one token: with two threads its kv heads go to both (each head's
    arithmetic is the same wherever it runs), so the output equals the one-thread output
    exactly, and a step of as many tokens as threads keeps each token whole."""
    if (reason := cpu_decode.unavailable(64)) is not None:
        pytest.fail(f"the C++ kernel should build wherever inductor does: {reason}")
    torch.manual_seed(1)
    block_size, slots, heads = 16, 8 * 16, 9
    pool = torch.randn(2 * slots, kv_heads, 64)
    tables = torch.tensor([[3, 7, 0, 5, 1, 2, 4, 6]], dtype=torch.int32)  # 128 positions
    threads = torch.get_num_threads()
    try:
        for positions in (torch.tensor([100]), torch.tensor([100, 37])):
            q = torch.randn(len(positions), heads, 64)
            step_tables = tables.expand(len(positions), -1).contiguous()
            outs = []
            for n in (1, 2):
                torch.set_num_threads(n)
                outs.append(cpu_decode.paged_token_attention(q, pool, 0, slots, block_size,
                                                             step_tables, positions, 0.125))
            assert torch.equal(outs[0], outs[1])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_verification_run_attends_bit_for_bit_as_its_tokens_decoded(dtype):
    """The longest verification a config allows (``MAX_DRAFT_TOKENS`` + 1 consecutive tokens
    of one request) attends exactly, to the last bit, as the same tokens each alone in a step,
    as decodes (beside another request's decode), so a kept draft is the token the step
    without drafts would have chosen. A prompt chunk of 16 tokens goes in tiles: the same to
    rounding, summed in another order."""
    if (reason := cpu_decode.unavailable(64)) is not None:
        pytest.fail(f"the C++ kernel should build wherever inductor does: {reason}")
    torch.manual_seed(0)
    block_size, slots, heads, kv_heads, dim = 16, 12 * 16, 9, 3, 64
    pool = torch.randn(2 * slots, kv_heads, dim).to(dtype)
    tables = torch.tensor([[3, 7, 0, 5], [2, 8, 4, 1]], dtype=torch.int32)

    def attend(q, rows):
        request, positions = torch.tensor([r for r, _ in rows]), torch.tensor([p for _, p in rows])
        return cpu_decode.paged_token_attention(q, pool, 0, slots, block_size, tables[request],
                                                positions, 0.125)

    for length in (MAX_DRAFT_TOKENS + 1, 16):
        run = [(0, p) for p in range(40, 40 + length)]
        q = torch.randn(length + 1, heads, dim).to(dtype)
        together = attend(q, [*run, (1, 30)])
        alone = torch.cat([attend(q[i:i + 1], [row]) for i, row in enumerate(run)])
        if length <= MAX_DRAFT_TOKENS + 1:
            assert torch.equal(together[:length], alone)
        else:
            torch.testing.assert_close(together[:length], alone, rtol=1e-5, atol=1e-5)
        assert torch.equal(together[length:], attend(q[length:], [(1, 30)]))


def test_fused_tokens_attend_through_the_kernel_or_say_why_not(tiny, monkeypatch):
    engine = make_engine("paged-attention", tiny)
    forward = CompiledForward(tiny.model, engine.kv_cache, OPTIONS)
    assert forward.reason_fused is None
    assert all(body.token_kernel for body in _bodies(forward))
    off = CompiledForward(tiny.model, engine.kv_cache, replace(OPTIONS, attention_kernel=False))
    assert off.reason_fused == "off in the options"
    assert not any(body.token_kernel for body in _bodies(off))
    # A machine where it cannot be built: one warning naming why, and the fused formula.
    monkeypatch.setattr(cpu_decode, "unavailable", lambda head_dim: "no compiler here")
    with pytest.warns(RuntimeWarning, match=r"C\+\+ attention kernel unavailable \(no compiler "
                                            r"here\); attending with the fused formula"):
        failed = CompiledForward(tiny.model, engine.kv_cache, OPTIONS)
    assert failed.reason_fused == "no compiler here"
    assert not any(body.token_kernel for body in _bodies(failed))
    # The fused formula's graphs give the kernel's tokens (and the eager forward's).
    expected = engine.generate(prompts()[:3], GREEDY).token_ids
    engine.runner.forward = failed
    assert engine.generate(prompts()[:3], GREEDY).token_ids == expected
    engine.runner.forward = forward
    assert engine.generate(prompts()[:3], GREEDY).token_ids == expected


def _bodies(forward: CompiledForward) -> list[torch.nn.Module]:
    """The _Body modules behind a forward's compiled functions."""
    return [forward.body(gemm, by_segment)._orig_mod for gemm in ("template", "aten", "onednn")
            for by_segment in (True, False)]
