"""Sampling: validated params, seeded runs repeat, filters never pick outside the allowed set."""

from __future__ import annotations

import pytest
import torch

from miniinfer import InvalidRequestError, SamplingParams, make_engine
from miniinfer.sampling import filter_logits, make_generator, sample


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ],
)
def test_bad_values_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
    assert issubclass(InvalidRequestError, ValueError)


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 4.0, 4.5]])
    assert sample(logits, SamplingParams(), None).tolist() == [1, 0]


def test_top_k_never_picks_outside_top_k():
    torch.manual_seed(0)
    logits = torch.randn(4, 100)
    allowed = torch.topk(logits, 5).indices
    params = SamplingParams(temperature=1.5, top_k=5, seed=1)
    gen = make_generator(params, torch.device("cpu"))
    for _ in range(200):
        picked = sample(logits, params, gen)
        assert (allowed == picked[:, None]).any(dim=1).all()


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = filter_logits(probs.log(), top_k=0, top_p=0.8).isfinite()
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 + 0.3 reaches 0.8
    kept = filter_logits(probs.log(), top_k=0, top_p=0.81).isfinite()
    assert kept.tolist() == [[True, True, True, False]]
    # The most likely token survives even a tiny top_p.
    assert filter_logits(probs.log(), top_k=0, top_p=1e-6).isfinite().sum() == 1


def test_top_p_never_picks_outside_nucleus():
    probs = torch.tensor([[0.6, 0.25, 0.1, 0.05]])
    params = SamplingParams(temperature=1.0, top_p=0.7, seed=3)
    gen = make_generator(params, torch.device("cpu"))
    picks = {int(sample(probs.log(), params, gen)) for _ in range(300)}
    assert picks == {0, 1}


def test_seeded_runs_repeat_and_seeds_differ(tiny):
    engine = make_engine("naive", tiny)
    prompts = [[11, 12, 13], [14, 15]]
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=50, seed=7, ignore_eos=True)
    first = engine.generate(prompts, params).token_ids
    assert engine.generate(prompts, params).token_ids == first
    other = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=50, seed=8, ignore_eos=True)
    assert engine.generate(prompts, other).token_ids != first


def test_hf_engine_seeded_sampling_repeats(tiny):
    engine = make_engine("hf", tiny)
    params = SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    assert engine.generate([[20, 21]], params).token_ids == engine.generate([[20, 21]], params).token_ids
