"""Every stage's greedy tokens against hf's on a GPU (issue 25): exact on an fp32 model of
Qwen2.5-7B's layout (a few layers, random weights: :func:`~miniinfer.bench.equality.equality_model`)
and up to near-ties on the bf16 model itself. A CPU runs the same checks on SmolLM2 in each
chapter's tests; here they need CUDA and skip without it."""

from __future__ import annotations

import pytest
import torch

from miniinfer import SamplingParams
from miniinfer.bench.equality import check_engines

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="the GPU equality checks need a CUDA device")

# Every stage of chapters 01-09 with the variants a GPU runs differently (HF's modules with the
# paged kernel, the CUDA-graph loop). Chapter 11's compiled stage is checked below, on the tiny
# model; chapter 12's processes by their own tests.
STAGES = ("naive", "paged-loop", "paged-vectorized", "paged-prealloc", "paged-attention",
          "paged-attention:registry", "async:overlap", "async:cuda-graph", "continuous",
          "prefix-cache")


@pytest.fixture(scope="module")
def qwen_bf16():
    from miniinfer.core.models import load_model

    return load_model("qwen2.5-7b", device="cuda")


def ragged_prompts(count: int = 4) -> list[list[int]]:
    gen = torch.Generator().manual_seed(25)
    return [torch.randint(17, 30000, (n,), generator=gen).tolist()
            for n in (64, 17, 33, 100)[:count]]


@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_matches_hf_on_the_gpu(qwen_bf16, stage):
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    lines = check_engines(qwen_bf16, stage, ragged_prompts(), params)
    assert len(lines) == 2 and "token for token" in lines[0], lines  # fp32 exact, then bf16


def test_compiled_stage_matches_hf_under_cuda_graphs():
    """Chapter 11's stage on a GPU runs its graphs under CUDA graphs (inductor's cudagraph
    trees), where one graph's output fed to the next (body to head) was overwritten before it
    was read (the H200, 2026-11-27). Tiny model in fp32, a few buckets, no GEMM autotuning (to
    compile in seconds): greedy tokens equal hf's, with batches that change from step to step
    (ragged prompts finish prefill in different chunks)."""
    from miniinfer.core.models import load_model
    from miniinfer.engines import make_engine
    from miniinfer.engines.compiled import CompiledEngine
    from miniinfer.runner.compiled import CompileOptions

    lm = load_model("tiny", device="cuda", dtype="float32")
    engine = CompiledEngine(lm, compile_options=CompileOptions(token_buckets=(1, 8, 64),
                                                               max_autotune=False))
    assert engine.runner.forward.compiled
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    prompts = ragged_prompts()  # ids below tiny's vocabulary (SmolLM2's, 49152)
    want = make_engine("hf", lm).generate(prompts, params).token_ids
    compiled = engine.runner.forward.num_compiles  # every bucket's graphs, at warm-up
    for batch in (prompts[:1], prompts):
        assert engine.generate(batch, params).token_ids == want[:len(batch)]
    assert engine.runner.forward.num_compiles == compiled  # no step recompiled


def test_continuous_engine_replays_captured_decode_steps_with_hf_tokens(qwen_bf16):
    """The serving engine's decode steps under the runner's CUDA graphs (issue 67): greedy
    tokens equal hf's on the fp32 model of Qwen2.5-7B's layout, with ragged prompts (the batch
    shrinks and grows as requests finish), and decode buckets were captured."""
    from miniinfer.bench.equality import equality_model
    from miniinfer.engines import make_engine

    lm = equality_model(qwen_bf16)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    prompts = ragged_prompts()
    want = make_engine("hf", lm).generate(prompts, params).token_ids
    engine = make_engine("continuous", lm)
    assert engine.runner.decode_graphs is not None, "auto: graphs on a GPU with Triton"
    assert engine.generate(prompts, params).token_ids == want
    assert engine.runner.decode_graphs.graphs, "some decode step replayed a captured graph"
