"""Chapter 07: the async stage's execution loops give the same tokens as HF generate (and as
each other); decode steps need nothing from the host; CUDA graphs are tested where CUDA is."""

from __future__ import annotations

import pytest
import torch
from template import assert_greedy_matches_hf

from miniinfer import ENGINES, KVCacheFull, SamplingParams, UnknownNameError, make_engine
from miniinfer.book.chapters import chapter_of_stage
from miniinfer.engines import async_loop, resolve_engine
from miniinfer.engines.async_loop import LOOPS, AsyncEngine

CPU_LOOPS = ["sync", "overlap"]


def test_registered_after_paged_attention():
    names = list(ENGINES)
    assert names.index("async") == names.index("paged-attention") + 1
    assert chapter_of_stage(AsyncEngine.name) == "07"
    assert set(LOOPS) <= set(AsyncEngine.variants)


@pytest.mark.parametrize("loop", CPU_LOOPS)
def test_greedy_matches_hf(smollm2, template_prompts, hf_greedy, loop):
    engine = make_engine(f"async:{loop}", smollm2)
    assert engine.loop == loop
    assert_greedy_matches_hf(engine, template_prompts, hf_greedy)
    manager = engine.kv_cache.block_manager
    assert manager.num_free_blocks == manager.num_blocks


@pytest.mark.parametrize("loop", CPU_LOOPS)
def test_stops_at_eos_like_hf(smollm2, loop, hf_eos):
    # The first prompt ends on EOS early; the second runs to max_new_tokens; the first alone
    # makes the whole batch stop early (the overlapped loop then drops one step's padding).
    engine = make_engine(f"async:{loop}", smollm2)
    assert engine.generate(hf_eos.prompts, hf_eos.params).token_ids == hf_eos.hf_batched
    alone = engine.generate(hf_eos.prompts[:1], hf_eos.params)
    assert alone.token_ids[0] == hf_eos.hf_alone
    assert len(alone.token_times) == len(alone.token_ids[0])  # one stamp per emitted step


def test_loops_agree_when_sampling(tiny):
    prompts = [[5, 6, 7], list(range(20, 53)), [9] * 16]
    params = SamplingParams(max_new_tokens=24, temperature=0.8, top_k=50, top_p=0.9, seed=3,
                            ignore_eos=True)
    outputs = {loop: make_engine(f"async:{loop}", tiny).generate(prompts, params).token_ids
               for loop in CPU_LOOPS}
    assert outputs["sync"] == outputs["overlap"]
    assert outputs["sync"] == make_engine("paged-attention", tiny).generate(prompts,
                                                                           params).token_ids


def test_cuda_graph_loop_falls_back_off_cuda(tiny):
    engine = make_engine("async:cuda-graph", tiny)
    assert engine.requested_loop == "cuda-graph"
    assert engine.loop == "overlap"
    assert make_engine("async", tiny).loop == "sync"  # auto, on a CPU
    prompts = [[5, 6, 7], [8] * 20]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    assert engine.generate(prompts, params).token_ids == \
        make_engine("paged-attention", tiny).generate(prompts, params).token_ids


@pytest.mark.parametrize("loop", CPU_LOOPS)
def test_decode_steps_ask_nothing_of_the_block_manager(tiny, monkeypatch, loop):
    # Blocks are taken at admission for every token a request can reach; a decode step only
    # does arithmetic on device tensors.
    engine = make_engine(f"async:{loop}", tiny, block_size=4)
    manager = engine.kv_cache.block_manager
    seen: list[int] = []
    real_add = manager.add

    def add(request_id, num_tokens):
        seen.append(num_tokens)
        return real_add(request_id, num_tokens)

    def fail(*args, **kwargs):
        raise AssertionError("a decode step asked the block manager for room")

    monkeypatch.setattr(manager, "add", add)
    monkeypatch.setattr(manager, "append", fail)
    prompts = [[5, 6, 7], list(range(20, 41))]
    engine.generate(prompts, SamplingParams(max_new_tokens=9, ignore_eos=True))
    assert seen == [3 + 8, 21 + 8]
    assert manager.num_free_blocks == manager.num_blocks


def test_full_pool_fails_at_admission_and_frees_everything(tiny):
    # 4 blocks of 4 tokens: a 10-token prompt with 8 new tokens needs 5 blocks up front.
    engine = make_engine("async:overlap", tiny, block_size=4, num_blocks=4)
    manager = engine.kv_cache.block_manager
    with pytest.raises(KVCacheFull, match="needs 5 more KV block"):
        engine.generate([[7] * 10], SamplingParams(max_new_tokens=8))
    assert manager.num_free_blocks == 4
    out = engine.generate([[7] * 10], SamplingParams(max_new_tokens=7, ignore_eos=True))
    assert len(out.token_ids[0]) == 7


def test_variant_names_are_checked(tiny):
    assert resolve_engine("async:overlap") == (AsyncEngine, {"loop": "overlap"})
    with pytest.raises(UnknownNameError, match="async:sync"):
        resolve_engine("async:bogus")
    with pytest.raises(UnknownNameError, match="no variants"):
        resolve_engine("paged-vectorized:sync")
    with pytest.raises(UnknownNameError, match="paged-attention:registry"):
        resolve_engine("paged-attention:sync")
    with pytest.raises(UnknownNameError, match="unknown loop"):
        AsyncEngine(tiny, loop="threads")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA streams and graphs need a GPU")


@pytest.fixture(scope="module")
def qwen_bf16():
    from miniinfer.core.models import load_model

    return load_model("qwen2.5-7b", device="cuda")


def gpu_prompts(batch_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(batch_size)
    return [torch.randint(17, 30000, (n,), generator=gen).tolist()
            for n in (64, 17, 33, 100, 16, 5, 48, 80)[:batch_size]]


@needs_cuda
@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_every_loop_matches_paged_attention_on_gpu(qwen_bf16, batch_size):
    # Exact tokens in fp32 (Qwen2.5-7B's layout, a few layers): a graph replays the bucket
    # (4 rows for a batch of 3), and in bf16 a GEMM of another shape may take another cuBLAS
    # algorithm and flip a near-tie. Those flips are checked against a logit tolerance below.
    from miniinfer.bench.equality import equality_model

    lm = equality_model(qwen_bf16)
    prompts = gpu_prompts(batch_size)
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    ref = make_engine("paged-attention", lm).generate(prompts, params).token_ids
    for loop in LOOPS:
        engine = make_engine(f"async:{loop}", lm)
        assert engine.loop == loop
        for _ in range(2):  # the second run replays the graph captured by the first
            assert engine.generate(prompts, params).token_ids == ref, loop


@needs_cuda
@pytest.mark.parametrize("batch_size", [3, 4])
def test_graph_replay_equals_eager_in_bf16(qwen_bf16, batch_size):
    # Like with like: at a bucket's own size the graph runs the eager step's kernels on the
    # same shapes, so bf16 tokens are equal; padded to a bucket they may flip near-ties only.
    from miniinfer.bench.equality import compare_greedy

    prompts = gpu_prompts(batch_size)
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    eager = make_engine("async:sync", qwen_bf16).generate(prompts, params).token_ids
    graph = make_engine("async:cuda-graph", qwen_bf16).generate(prompts, params).token_ids
    if batch_size in async_loop.GRAPH_BUCKETS:
        assert graph == eager
    else:
        compare_greedy(qwen_bf16, prompts, graph, eager, "cuda-graph vs sync")
