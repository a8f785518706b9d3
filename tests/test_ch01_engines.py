"""Chapter 01: the hand-written decode loop reproduces model.generate exactly."""

from __future__ import annotations

import pytest
from template import assert_greedy_matches_hf

from miniinfer import InvalidRequestError, SamplingParams, UnknownNameError, make_engine


def test_template_prompts_mix_lengths(template_prompts):
    lengths = [len(p) for p in template_prompts]
    assert len(lengths) >= 8 and len(set(lengths)) >= 8


def test_naive_greedy_matches_hf(smollm2, template_prompts, hf_greedy):
    assert_greedy_matches_hf(make_engine("naive", smollm2), template_prompts, hf_greedy)


def test_naive_stops_at_eos_like_hf(smollm2, hf_eos):
    naive = make_engine("naive", smollm2)
    assert naive.generate(hf_eos.prompts, hf_eos.params).token_ids == hf_eos.hf_batched


def test_unknown_engine_lists_names(tiny):
    with pytest.raises(UnknownNameError, match="available engines: hf, naive"):
        make_engine("nope", tiny)


@pytest.mark.parametrize("engine_name", ["hf", "naive"])
def test_bad_prompts_fail_clearly(tiny, engine_name):
    engine = make_engine(engine_name, tiny)
    with pytest.raises(InvalidRequestError, match="prompt 1 is empty"):
        engine.generate([[5, 6], []])
    with pytest.raises(InvalidRequestError, match="no prompts"):
        engine.generate([])
    with pytest.raises(InvalidRequestError, match="context of 512"):
        engine.generate([[5] * 500], SamplingParams(max_new_tokens=20))
    with pytest.raises(InvalidRequestError, match="outside"):
        engine.generate([[10**6]])


def test_timing_has_one_stamp_per_token(tiny):
    result = make_engine("naive", tiny).generate([[5, 6, 7]], SamplingParams(max_new_tokens=5,
                                                                             ignore_eos=True))
    assert len(result.token_times) == 5 and len(result.token_ids[0]) == 5
    assert result.start < result.token_times[0] <= result.token_times[-1] <= result.end
