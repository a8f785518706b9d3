"""One engine config object (issue 67): the options every serving stage takes, in one place."""

from __future__ import annotations

import pytest

from miniinfer import InvalidRequestError, make_engine
from miniinfer.core.config import EngineConfig


def test_options_become_the_engines_config_and_reach_its_parts(tiny):
    engine = make_engine("prefix-cache", tiny, max_num_batched_tokens=24, max_num_seqs=3,
                         block_size=8, num_blocks=40, forward="registry")
    assert engine.config == EngineConfig(max_num_batched_tokens=24, max_num_seqs=3,
                                         block_size=8, num_blocks=40, forward="registry",
                                         prefix_caching=True)
    assert engine.scheduler.config.max_num_batched_tokens == 24
    assert engine.scheduler.config.max_num_seqs == 3
    assert engine.kv_cache.block_size == 8 and engine.kv_cache.num_blocks == 40
    assert engine.runner.forward_name == "registry"


def test_a_config_object_and_options_on_top(tiny):
    base = EngineConfig(max_num_batched_tokens=16, num_blocks=32)
    engine = make_engine("continuous", tiny, config=base, max_num_seqs=2)
    assert engine.config == EngineConfig(max_num_batched_tokens=16, num_blocks=32,
                                         max_num_seqs=2)
    assert base.max_num_seqs == 256, "the caller's config is not changed"


@pytest.mark.parametrize("name", ["continuous", "quantized:int8-eager", "compiled"])
def test_an_unknown_option_is_named(tiny, name):
    with pytest.raises(InvalidRequestError, match=r"unknown engine option\(s\) max_batch; "
                                                  r"options: max_num_batched_tokens"):
        make_engine(name, tiny, max_batch=8, warm_up=False) if name == "compiled" else \
            make_engine(name, tiny, max_batch=8)


def test_the_cpu_kernel_as_the_engines_attention_gives_the_same_tokens(tiny):
    from miniinfer import SamplingParams
    from miniinfer.core.kernels import cpu_decode

    if cpu_decode.load() is not None:
        pytest.skip(f"the C++ kernel does not build here: {cpu_decode.load()}")
    prompts = [list(range(5, 30)), list(range(40, 47)), list(range(60, 100))]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    engine = make_engine("continuous", tiny, attention_backend="cpu", max_num_batched_tokens=32)
    assert engine.runner.attention.backend.name == "cpu"
    assert engine.runner.attention.prefill_backend.name == "cpu"  # chunks through it too
    expected = make_engine("continuous", tiny, max_num_batched_tokens=32).generate(prompts, params)
    assert engine.generate(prompts, params).token_ids == expected.token_ids
