"""Chapters 02-04: the paged engines reproduce model.generate exactly, whatever their gather."""

from __future__ import annotations

import pytest
from template import assert_greedy_matches_hf
from torch.profiler import ProfilerActivity, profile

from miniinfer import ENGINES, KVCacheFull, SamplingParams, make_engine
from miniinfer.bench.profiling import set_ranges
from miniinfer.book.chapters import chapter_of_stage
from miniinfer.core.errors import UnknownNameError

PAGED = ["paged-loop", "paged-vectorized", "paged-prealloc"]
# Every paged engine, chapter 04's ablation variant too (the buffer, the old per-request write).
PAGED_ENGINES = [*PAGED, "paged-prealloc:per-request"]
DECODE_PHASES = ["prepare_inputs", "gather_batch_kv", "build_cache", "model_forward", "sample",
                 "write_decode_kv"]


def test_stages_are_registered_in_book_order():
    assert list(ENGINES)[: 2 + len(PAGED)] == ["hf", "naive", *PAGED]  # later stages follow
    assert [chapter_of_stage(name) for name in PAGED] == ["02", "03", "04"]


@pytest.mark.parametrize("engine_name", PAGED_ENGINES)
def test_paged_greedy_matches_hf(smollm2, template_prompts, hf_greedy, engine_name):
    engine = make_engine(engine_name, smollm2)
    assert_greedy_matches_hf(engine, template_prompts, hf_greedy)
    manager = engine.kv_cache.block_manager
    assert manager.num_free_blocks == manager.num_blocks


@pytest.mark.parametrize("engine_name", PAGED_ENGINES)
def test_paged_stops_at_eos_like_hf(smollm2, hf_eos, engine_name):
    ours = make_engine(engine_name, smollm2).generate(hf_eos.prompts, hf_eos.params).token_ids
    assert ours == hf_eos.hf_batched


@pytest.mark.parametrize("engine_name", PAGED_ENGINES)
def test_seeded_sampling_equals_naive(tiny, engine_name):
    # Same logits bit for bit, so the same draws from the same generator.
    prompts = [[5, 6, 7], list(range(20, 53)), [9] * 16]
    params = SamplingParams(max_new_tokens=20, temperature=0.8, top_k=50, top_p=0.9, seed=3,
                            ignore_eos=True)
    naive = make_engine("naive", tiny).generate(prompts, params).token_ids
    assert make_engine(engine_name, tiny).generate(prompts, params).token_ids == naive


@pytest.mark.parametrize("engine_name", PAGED_ENGINES)
def test_small_blocks_cross_many_block_boundaries(tiny, engine_name):
    prompts = [[5, 6, 7], list(range(20, 41)), [9] * 8]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    naive = make_engine("naive", tiny).generate(prompts, params).token_ids
    engine = make_engine(engine_name, tiny, block_size=3, num_blocks=40)
    assert engine.generate(prompts, params).token_ids == naive


@pytest.mark.parametrize("engine_name", PAGED_ENGINES)
def test_pool_too_small_raises_and_frees_everything(tiny, engine_name):
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    # The prompts alone need 2 + 2 blocks: the second request cannot start.
    engine = make_engine(engine_name, tiny, block_size=16, num_blocks=3)
    manager = engine.kv_cache.block_manager
    with pytest.raises(KVCacheFull, match=r"request 1 needs 2 more KV block\(s\) but only 1 of 3"):
        engine.generate([[5] * 20, [6] * 20], params)
    assert manager.num_free_blocks == 3 and not manager.block_tables
    # The prompts fit in 2 blocks; the first decoded token needs a third.
    with pytest.raises(KVCacheFull, match="request 0 needs 1 more KV block.*only 0 of 3"):
        engine.generate([[5] * 16, [6] * 32], params)
    assert manager.num_free_blocks == 3 and not manager.block_tables
    # The engine is still usable afterwards.
    assert len(engine.generate([[5] * 8], params).token_ids[0]) == 8


@pytest.mark.parametrize("engine_name", PAGED_ENGINES)
def test_timing_has_one_stamp_per_token(tiny, engine_name):
    result = make_engine(engine_name, tiny).generate(
        [[5, 6, 7]], SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert len(result.token_times) == 5 and len(result.token_ids[0]) == 5
    assert result.start < result.token_times[0] <= result.token_times[-1] <= result.end


def _ranges(engine, steps: int, prompts=([5, 6, 7], [8] * 20)) -> list:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.generate(list(prompts), SamplingParams(max_new_tokens=steps + 1, ignore_eos=True))
    return prof.events()


@pytest.mark.parametrize("engine_name", PAGED_ENGINES)
def test_decode_phases_are_profiler_ranges(tiny, engine_name):
    events = _ranges(make_engine(engine_name, tiny), steps=3)
    names = [e.name for e in events]
    assert names.count("decode_step") == 3 and names.count("prefill") == 1
    for step in (e for e in events if e.name == "decode_step"):
        assert [c.name for c in step.cpu_children if c.name in DECODE_PHASES] == DECODE_PHASES
    set_ranges(False)
    try:
        assert not any(e.name == "decode_step" for e in _ranges(make_engine(engine_name, tiny), 2))
    finally:
        set_ranges(True)


def _ops_under(events, range_name: str) -> list[str]:
    ops = []
    stack = [e for e in events if e.name == range_name]
    while stack:
        event = stack.pop()
        ops += [c.name for c in event.cpu_children]
        stack += event.cpu_children
    return ops


def test_prealloc_step_ops_do_not_grow_with_batch_or_layers(tiny):
    engine = make_engine("paged-prealloc", tiny)
    counts = {}
    for batch_size in (1, 5):
        events = _ranges(engine, steps=4, prompts=[[5] * (3 + i) for i in range(batch_size)])
        gather = _ops_under(events, "gather_batch_kv") + _ops_under(events, "build_cache")
        write = _ops_under(events, "write_decode_kv")
        assert "aten::cat" not in gather and "aten::zeros" not in gather
        assert gather.count("aten::index_select") == 4  # one per step for all layers
        assert write.count("aten::index_copy_") == 4
        counts[batch_size] = (len(gather), len(write))
    assert counts[1] == counts[5]


def test_prealloc_forward_appends_into_the_buffer(tiny):
    # DynamicLayer.update concatenates K and V in every layer; the buffer layer does not.
    def cats(name: str) -> int:
        events = _ranges(make_engine(name, tiny), steps=4)
        return _ops_under(events, "model_forward").count("aten::cat")

    layers = tiny.config.num_hidden_layers
    assert cats("paged-vectorized") - cats("paged-prealloc") == 4 * 2 * layers


def test_prealloc_reuses_its_gather_buffer(tiny):
    engine = make_engine("paged-prealloc", tiny)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    engine.generate([[5] * 10, [6] * 4], params)
    buffer = engine.gather_buffer.data_ptr()
    engine.generate([[5, 6, 7]], params)
    assert engine.gather_buffer.data_ptr() == buffer


def test_per_request_variant_keeps_the_buffer_and_writes_per_layer_and_request(tiny):
    # Chapter 04's ablation: the same gather and cache as the stage, the write of chapter 03.
    engine = make_engine("paged-prealloc:per-request", tiny)
    layers = tiny.config.num_hidden_layers
    events = _ranges(engine, steps=4, prompts=[[5] * 3, [6] * 7])
    write = _ops_under(events, "write_decode_kv")
    assert "aten::index_copy_" not in write
    assert write.count("aten::copy_") == 4 * 2 * layers * 2  # steps x (K, V) x layers x rows
    assert _ops_under(events, "gather_batch_kv").count("aten::index_select") == 4


def test_unknown_kv_write_is_refused(tiny):
    with pytest.raises(UnknownNameError, match="kv_write 'sideways'"):
        make_engine("paged-prealloc", tiny, kv_write="sideways")
    with pytest.raises(UnknownNameError, match="paged-prealloc:per-request"):
        make_engine("paged-prealloc:per-row", tiny)
