"""Sampling: validated params, seeded runs repeat, filters never pick outside the allowed set,
and sampled tokens follow softmax(logits / temperature) over the allowed set.

The distribution tests draw many tokens in one call (a batch of identical rows) and hold every
token's frequency to within 5 standard errors of its probability, sqrt(p (1 - p) / draws): a
correct sampler fails that with probability under 1e-5 per token (and the seeds are fixed), while
the bugs they are there for (temperature applied twice, a filter that keeps the wrong set) move
some frequency by 10 or more standard errors."""

from __future__ import annotations

import math

import pytest
import torch

from miniinfer import InvalidRequestError, SamplingParams, make_engine
from miniinfer.core.sampling import filter_logits, make_generator, sample


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


def test_top_p_exact_boundary_drops_the_token_after_it():
    # Powers of two: the softmax and its running sum are exact in float32, so the first two
    # tokens hold exactly top_p = 0.75 and the third must go (0.5 + 0.3 would be 0.80000007).
    logits = torch.tensor([[0.5, 0.25, 0.25]]).log()
    probs = logits.softmax(dim=-1)
    assert (probs.cumsum(dim=-1) - probs).tolist() == [[0.0, 0.5, 0.75]]
    assert filter_logits(logits, top_k=0, top_p=0.75).isfinite().tolist() == [[True, True, False]]
    assert filter_logits(logits, top_k=0, top_p=0.5).isfinite().tolist() == [[True, False, False]]
    assert filter_logits(logits, top_k=0, top_p=0.76).isfinite().all()
    params = SamplingParams(temperature=1.0, top_p=0.75, seed=0)
    picks = sample(logits.expand(4000, -1), params, make_generator(params, torch.device("cpu")))
    assert set(picks.tolist()) == {0, 1}


DRAWS = 20_000


def assert_frequencies_match(picks: torch.Tensor, expected: torch.Tensor) -> None:
    """Each token's share of ``picks`` is within 5 standard errors of ``expected`` [V]."""
    freqs = torch.bincount(picks, minlength=len(expected)).double() / len(picks)
    expected = expected.double()
    bound = 5 * (expected * (1 - expected) / len(picks)).sqrt()
    assert ((freqs - expected).abs() <= bound).all(), \
        f"frequencies {freqs.tolist()} vs expected {expected.tolist()} (bound {bound.tolist()})"


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_sampled_frequencies_follow_softmax_at_the_temperature(temperature):
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0])
    params = SamplingParams(temperature=temperature, seed=11)
    picks = sample(logits.expand(DRAWS, -1), params, make_generator(params, torch.device("cpu")))
    expected = (logits / temperature).softmax(dim=-1)
    # The bound is far tighter than the distance to the usual mistakes.
    twice = (logits / temperature**2).softmax(dim=-1)
    assert (twice - expected).abs().max() > 10 * math.sqrt(0.25 / DRAWS)
    assert_frequencies_match(picks, expected)


def test_sampled_frequencies_renormalise_over_top_k_and_top_p():
    # At temperature 0.5 the probabilities are softmax([0, 2, 4, 6, 8]): top_k=4 drops token 0;
    # of the rest, tokens 4, 3, 2 hold 0.865, 0.982 and 0.998 cumulatively, so top_p=0.99 keeps
    # token 2 (0.982 before it) and drops token 1.
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0])
    params = SamplingParams(temperature=0.5, top_k=4, top_p=0.99, seed=12)
    picks = sample(logits.expand(DRAWS, -1), params, make_generator(params, torch.device("cpu")))
    kept = (logits[2:] / 0.5).softmax(dim=-1)
    assert_frequencies_match(picks, torch.cat([torch.zeros(2), kept]))


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
    """Our seed, not the global RNG's state, decides what the hf engine samples."""
    engine = make_engine("hf", tiny)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    runs = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)  # whatever ran before leaves the global RNG anywhere
        runs.append(engine.generate([[20, 21], [30]], params).token_ids)
    assert runs[0] == runs[1]
    other = SamplingParams(max_new_tokens=8, temperature=1.0, seed=6, ignore_eos=True)
    torch.manual_seed(1)
    assert engine.generate([[20, 21], [30]], other).token_ids != runs[0]
