"""Chapter 06: attention reads K/V through block tables; the model never sees a dense cache or
mask, and still reproduces model.generate token for token."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from template import assert_greedy_matches_hf
from torch.profiler import ProfilerActivity, profile
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, masking_utils
from transformers.masking_utils import AttentionMaskInterface

from miniinfer import ENGINES, KVCacheFull, MiniInferError, SamplingParams, make_engine
from miniinfer.book.chapters import chapter_of_stage
from miniinfer.core.errors import UnknownNameError
from miniinfer.core.kernels import triton_attention
from miniinfer.engines.paged_attention import PagedAttentionEngine
from miniinfer.runner.attention import ATTN_IMPLEMENTATION, attn_implementation

DECODE_PHASES = ["prepare_inputs", "model_forward", "sample"]


def test_registered_after_paged_prealloc():
    names = list(ENGINES)
    assert names.index("paged-attention") == names.index("paged-prealloc") + 1
    assert ENGINES["paged-attention"] is PagedAttentionEngine
    assert chapter_of_stage(PagedAttentionEngine.name) == "06"


@pytest.mark.parametrize("name", ["paged-attention", "paged-attention:registry"])
def test_greedy_matches_hf(smollm2, template_prompts, hf_greedy, name):
    engine = make_engine(name, smollm2)
    assert engine.runner.backend.name == "torch"  # "auto" on a CPU
    assert engine.runner.forward_name == ("registry" if name.endswith("registry") else "direct")
    assert_greedy_matches_hf(engine, template_prompts, hf_greedy)
    manager = engine.kv_cache.block_manager
    assert manager.num_free_blocks == manager.num_blocks


def test_other_engines_unaffected_afterwards(smollm2, template_prompts, hf_greedy):
    # The model is shared: the paged run must hand it back with HF's attention and masks.
    attention = smollm2.model.config._attn_implementation
    make_engine("paged-attention", smollm2).generate(
        template_prompts[:2], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert smollm2.model.config._attn_implementation == attention
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    naive = make_engine("naive", smollm2)
    for prompt, ref in zip(template_prompts[:2], hf_greedy["single"], strict=False):
        assert naive.generate([prompt], params).token_ids[0] == ref[:8]


def test_stops_at_eos_like_hf(smollm2, hf_eos):
    ours = make_engine("paged-attention", smollm2).generate(hf_eos.prompts, hf_eos.params)
    assert ours.token_ids == hf_eos.hf_batched


def test_seeded_sampling_is_reproducible(tiny):
    """Same seed, same tokens; another seed, other tokens; and the naive engine, which shares
    the sampler and one generator per batch, draws exactly these tokens from the same seed."""
    prompts = [[5, 6, 7], list(range(20, 53))]
    params = SamplingParams(max_new_tokens=20, temperature=0.8, top_k=50, top_p=0.9, seed=3,
                            ignore_eos=True)
    engine = make_engine("paged-attention", tiny)
    first = engine.generate(prompts, params).token_ids
    assert all(len(row) == 20 for row in first)
    assert engine.generate(prompts, params).token_ids == first
    assert make_engine("naive", tiny).generate(prompts, params).token_ids == first
    other_seed = engine.generate(prompts, replace(params, seed=4)).token_ids
    assert all(a != b for a, b in zip(other_seed, first, strict=True))
    greedy = engine.generate(prompts, replace(params, temperature=0.0)).token_ids
    assert all(a != b for a, b in zip(greedy, first, strict=True))  # it did sample


def test_device_block_tables_follow_the_block_manager(tiny):
    # Blocks of 3 tokens: the tables gain entries every few steps, at different steps per row.
    prompts = [[5, 6, 7], list(range(20, 41)), [9] * 8]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    engine = make_engine("paged-attention", tiny, block_size=3, num_blocks=40)
    manager = engine.kv_cache.block_manager
    decode_step = engine.decode_step
    checked = []

    def checking_decode_step(batch, *args):
        tokens = decode_step(batch, *args)
        for row, rid in enumerate(batch.request_ids):
            table = manager.block_tables[rid]
            assert batch.block_tables[row, : len(table)].tolist() == table
            assert not batch.block_tables[row, len(table):].any()  # padding stays 0
        checked.append(True)
        return tokens

    engine.decode_step = checking_decode_step
    ours = engine.generate(prompts, params).token_ids
    assert len(checked) == 11
    assert ours == make_engine("naive", tiny).generate(prompts, params).token_ids


def test_attention_sees_no_mask_and_no_cache(tiny, monkeypatch):
    calls = []
    paged = AttentionInterface._global_mapping[ATTN_IMPLEMENTATION]

    def spy(module, query, key, value, attention_mask, *args, **kwargs):
        calls.append((attention_mask, kwargs.get("past_key_values"), query.shape))
        return paged(module, query, key, value, attention_mask, *args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, ATTN_IMPLEMENTATION, spy)
    # Mask creation bails out before its packed-sequence scan for a name it does not know.
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices",
                        lambda *a, **k: pytest.fail("a mask was being prepared"))
    assert ATTN_IMPLEMENTATION not in AttentionMaskInterface._global_mapping
    make_engine("paged-attention:registry", tiny).generate(
        [[5, 6, 7], [8] * 20], SamplingParams(max_new_tokens=4, ignore_eos=True))
    layers = tiny.config.num_hidden_layers
    assert len(calls) == 4 * layers  # prefill and three decode steps
    assert all(mask is None and cache is None for mask, cache, _ in calls)
    # Prefill: both prompts as one flat sequence; decode: one token per request.
    assert [shape[2] for _, _, shape in calls[::layers]] == [23, 2, 2, 2]


def test_direct_forward_gives_hf_modules_logits_bit_for_bit(tiny, monkeypatch):
    # Same ops on the same weights in the same order: prefill logits are equal, not close.
    prompts = [[5, 6, 7], [8] * 20, list(range(100, 117))]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    logits = {}
    for forward in ("registry", "direct"):
        engine = make_engine("paged-attention", tiny, forward=forward)
        with torch.inference_mode(), attn_implementation(tiny.model, ATTN_IMPLEMENTATION):
            logits[forward] = engine.prefill([0, 1, 2], prompts, params)[1]
    assert logits["direct"].shape == (3, tiny.config.vocab_size)
    assert torch.equal(logits["direct"], logits["registry"])
    # And the direct forward never goes through HF's modules' attention.
    monkeypatch.setitem(AttentionInterface._global_mapping, ATTN_IMPLEMENTATION,
                        lambda *a, **k: pytest.fail("HF's attention was called"))
    direct = make_engine("paged-attention:direct", tiny).generate(prompts, params).token_ids
    assert direct == make_engine("hf", tiny).generate(prompts, params).token_ids


def _tiny_model(lm, model_type: str, **overrides):
    """A random model of another architecture with ``lm``'s tokenizer and vocabulary."""
    config = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=256,
                                  vocab_size=lm.config.vocab_size, **overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    return replace(lm, name=f"tiny-{model_type}", model=model)


def test_direct_forward_runs_qwen2_with_its_biases(tiny):
    qwen2 = _tiny_model(tiny, "qwen2")
    assert qwen2.model.model.layers[0].self_attn.q_proj.bias is not None
    prompts = [[5, 6, 7], [8] * 20, list(range(100, 117))]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    engine = make_engine("paged-attention", qwen2)
    assert engine.runner.forward_name == "direct"
    assert engine.generate(prompts, params).token_ids == \
        make_engine("hf", qwen2).generate(prompts, params).token_ids


def test_other_architectures_fall_back_to_the_registry(tiny):
    mistral = _tiny_model(tiny, "mistral", sliding_window=None)
    engine = make_engine("paged-attention", mistral)
    assert engine.runner.forward_name == "registry"
    prompts, params = [[5, 6, 7], [8] * 20], SamplingParams(max_new_tokens=6, ignore_eos=True)
    assert engine.generate(prompts, params).token_ids == \
        make_engine("hf", mistral).generate(prompts, params).token_ids
    with pytest.raises(MiniInferError, match="forward 'direct' cannot run 'tiny-mistral': "
                                             "model type 'mistral' is not one of llama, qwen2"):
        make_engine("paged-attention:direct", mistral)
    with pytest.raises(UnknownNameError, match="unknown forward 'fast'"):
        make_engine("paged-attention", tiny, forward="fast")


@pytest.mark.parametrize("model_type, options", [
    ("mistral", {"sliding_window": 8}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}),
])
def test_sliding_window_models_are_refused(tiny, model_type, options):
    model = _tiny_model(tiny, model_type, **options)
    with pytest.raises(MiniInferError, match="sliding-window attention layers"):
        make_engine("paged-attention", model)


def test_pool_too_small_raises_and_frees_everything(tiny):
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    engine = make_engine("paged-attention", tiny, block_size=16, num_blocks=3)
    manager = engine.kv_cache.block_manager
    with pytest.raises(KVCacheFull, match=r"request 1 needs 2 more KV block\(s\) but only 1 of 3"):
        engine.generate([[5] * 20, [6] * 20], params)
    assert manager.num_free_blocks == 3 and not manager.block_tables
    # The prompts fit in 2 blocks; the first decoded token needs a third.
    with pytest.raises(KVCacheFull, match="request 0 needs 1 more KV block.*only 0 of 3"):
        engine.generate([[5] * 16, [6] * 32], params)
    assert manager.num_free_blocks == 3 and not manager.block_tables
    assert tiny.model.config._attn_implementation == "sdpa"
    assert len(engine.generate([[5] * 8], params).token_ids[0]) == 8


def test_attention_outside_the_engine_says_what_is_missing(tiny):
    with attn_implementation(tiny.model, ATTN_IMPLEMENTATION), \
            pytest.raises(MiniInferError, match="paged_attention metadata"):
        tiny.model(input_ids=torch.tensor([[5, 6, 7]]))
    assert tiny.model.config._attn_implementation == "sdpa"


def test_backend_option(tiny):
    prompts = [[5, 6, 7], [8] * 20]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    auto = make_engine("paged-attention", tiny).generate(prompts, params).token_ids
    engine = make_engine("paged-attention", tiny, attention_backend="torch")
    assert engine.generate(prompts, params).token_ids == auto
    with pytest.raises(MiniInferError, match="not available on cpu"):
        make_engine("paged-attention", tiny, attention_backend="flash-attn")


def _ranges(engine, steps: int) -> list:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.generate([[5, 6, 7], [8] * 20],
                        SamplingParams(max_new_tokens=steps + 1, ignore_eos=True))
    return prof.events()


def test_decode_phases_are_profiler_ranges(tiny):
    events = _ranges(make_engine("paged-attention", tiny), steps=3)
    names = [e.name for e in events]
    layers = tiny.config.num_hidden_layers
    assert names.count("decode_step") == 3 and names.count("prefill") == 1
    # The gather and the cache object of chapters 02-04 are gone; K/V writes are per layer,
    # inside the forward.
    assert "gather_batch_kv" not in names and "build_cache" not in names
    assert names.count("write_prefill_kv") == layers
    assert names.count("write_decode_kv") == 3 * layers
    for step in (e for e in events if e.name == "decode_step"):
        assert [c.name for c in step.cpu_children if c.name in DECODE_PHASES] == DECODE_PHASES


_TRITON_SCRIPT = """
from miniinfer import SamplingParams, load_model, make_engine
tiny = load_model("tiny", device="cpu")
prompts = [[5, 6, 7], list(range(20, 41)), [9] * 8]
params = SamplingParams(max_new_tokens=5, ignore_eos=True)
engine = make_engine("paged-attention", tiny, attention_backend="triton", block_size=16)
assert engine.runner.backend.name == "triton"
ours = engine.generate(prompts, params).token_ids
assert ours == make_engine("naive", tiny).generate(prompts, params).token_ids, ours
print("ok")
"""


def test_triton_backend_in_the_interpreter():
    """The GPU path (our Triton kernel for prefill and decode), run by Triton's interpreter."""
    if triton_attention.triton is None:
        pytest.skip("triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT], capture_output=True,
                            text=True, env=env, cwd=Path(__file__).parent.parent, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stdout + result.stderr
