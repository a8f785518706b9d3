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
from miniinfer.core.sampling import filter_logits, make_generator, sample, sample_batch
from miniinfer.core.scheduler import Request, RequestTimeline


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


# -- the batched sampler of the continuous engines: vLLM's extras -----------------------------

EOS = 6  # stands for the EOS id in the 8-token distributions below


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": float("nan")}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"logit_bias": ((5, 101.0),)}, "logit_bias must be a tuple"),
        ({"logit_bias": {5: 1.0}}, "logit_bias must be a tuple"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids must be a tuple of token ids"),
        ({"min_tokens": 40}, r"min_tokens must be an integer in \[0, max_new_tokens=32\]"),
        ({"logprobs": 21}, r"logprobs must be None or an integer in \[0, 20\]"),
        ({"logprobs": True}, "logprobs must be None"),
    ],
)
def test_bad_extras_raise_value_error(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


def test_static_engines_refuse_the_extras_they_do_not_apply(tiny):
    with pytest.raises(InvalidRequestError, match="min_p.*continuous engines"):
        make_engine("naive", tiny).generate([[1, 2]], SamplingParams(min_p=0.1))


@pytest.fixture(scope="module")
def tiny_logits(tiny) -> torch.Tensor:
    """The tiny model's next-token logits after a prompt, over its 8 most likely tokens: a
    real, uneven distribution small enough to count every token's frequency."""
    ids = torch.tensor([tiny.tokenizer.encode("The capital of France is")])
    with torch.inference_mode():
        logits = tiny.model(input_ids=ids).logits[0, -1].float()
    return logits.topk(8).values


def _requests(params: SamplingParams, count: int, prompt: list[int] = (0,),
              output: list[int] = ()) -> list[Request]:
    return [Request(i, list(prompt), params, RequestTimeline(0.0),
                    generator=make_generator(params, torch.device("cpu")),
                    output_ids=list(output)) for i in range(count)]


def _draw(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    torch.manual_seed(0)  # the unseeded rows share the global generator's draw
    return torch.tensor(sample_batch(logits.expand(len(requests), -1), requests,
                                     EOS).token_ids)


T = 0.1  # sharpens the tiny model's close logits into a distribution worth testing


def test_min_p_keeps_tokens_above_min_p_times_the_top(tiny_logits):
    probs = (tiny_logits / T).softmax(-1)
    min_p = 0.13
    kept = probs >= min_p * probs.max()
    assert 1 < kept.sum() < 8, "min_p must cut some tokens and keep several"
    expected = torch.where(kept, probs, 0) / probs[kept].sum()
    picks = _draw(tiny_logits, _requests(SamplingParams(temperature=T, min_p=min_p), DRAWS))
    assert_frequencies_match(picks, expected)


def test_repetition_penalty_on_prompt_and_output_tokens(tiny_logits):
    penalty, seen = 1.5, [0, 3, 5]  # 0 and 3 in the prompt, 5 in the output
    by_hand = tiny_logits.clone()
    for t in seen:
        by_hand[t] = by_hand[t] / penalty if by_hand[t] > 0 else by_hand[t] * penalty
    requests = _requests(SamplingParams(temperature=T, repetition_penalty=penalty), DRAWS,
                         prompt=[0, 3, 3], output=[5])
    assert_frequencies_match(_draw(tiny_logits, requests), (by_hand / T).softmax(-1))


def test_frequency_and_presence_penalties_count_the_output(tiny_logits):
    output = [0, 0, 0, 1]
    counts = torch.bincount(torch.tensor(output), minlength=8).float()
    by_hand = tiny_logits - 0.05 * counts - 0.08 * (counts > 0)
    params = SamplingParams(temperature=T, frequency_penalty=0.05, presence_penalty=0.08)
    # The prompt holds token 0 too: frequency and presence penalties ignore the prompt.
    requests = _requests(params, DRAWS, prompt=[0, 2], output=output)
    assert_frequencies_match(_draw(tiny_logits, requests), (by_hand / T).softmax(-1))


def test_logit_bias_adds_to_the_logits(tiny_logits):
    bias = ((2, 0.3), (0, -0.2), (7, 0.25))
    by_hand = tiny_logits.clone()
    for token, value in bias:
        by_hand[token] += value
    requests = _requests(SamplingParams(temperature=T, logit_bias=bias), DRAWS)
    assert_frequencies_match(_draw(tiny_logits, requests), (by_hand / T).softmax(-1))


def test_min_tokens_masks_eos_and_stop_tokens_until_reached(tiny_logits):
    params = SamplingParams(temperature=T, min_tokens=3, stop_token_ids=(1,))
    probs = (tiny_logits / T).softmax(-1)
    masked = probs.clone()
    masked[[1, EOS]] = 0
    early = _requests(params, DRAWS, output=[4])
    assert_frequencies_match(_draw(tiny_logits, early), masked / masked.sum())
    late = _requests(params, DRAWS, output=[4, 4, 4])
    assert_frequencies_match(_draw(tiny_logits, late), probs)
    ignoring = _requests(SamplingParams(temperature=T, min_tokens=3, ignore_eos=True), DRAWS)
    unmasked = _draw(tiny_logits, ignoring)  # ignore_eos: EOS is an ordinary token
    assert_frequencies_match(unmasked, probs)


def test_one_batch_of_rows_with_different_parameters(tiny_logits):
    """The sampler's one pass serves rows that each have their own temperature, top-k, top-p,
    min-p and penalties: each group of rows follows its own distribution."""
    groups = [SamplingParams(temperature=0.05, top_k=3),
              SamplingParams(temperature=0.2, top_p=0.6),
              SamplingParams(temperature=T, min_p=0.5, frequency_penalty=0.1),
              SamplingParams(temperature=0.0, repetition_penalty=1.2)]
    size = DRAWS // 2
    requests = [r for p in groups for r in _requests(p, size, output=[0, 0])]
    picks = _draw(tiny_logits, requests).view(len(groups), size)

    def alone(p: SamplingParams) -> torch.Tensor:
        return _draw(tiny_logits, _requests(p, size, output=[0, 0]))

    for row, params in enumerate(groups):
        if params.greedy:
            assert (picks[row] == alone(params)).all()
            continue
        counts = torch.bincount(alone(params), minlength=8).double() / size
        assert_frequencies_match(picks[row], counts.float())


def test_top_k_and_top_p_by_hand_in_one_batch(tiny_logits):
    probs_k = (tiny_logits / T).softmax(-1)
    expected_k = torch.cat([probs_k[:3] / probs_k[:3].sum(), torch.zeros(5)])
    probs_p = (tiny_logits / T).softmax(-1)
    before = probs_p.cumsum(-1) - probs_p  # the logits are sorted, most likely first
    kept = before < 0.7
    expected_p = torch.where(kept, probs_p, 0) / probs_p[kept].sum()
    requests = (_requests(SamplingParams(temperature=T, top_k=3), DRAWS)
                + _requests(SamplingParams(temperature=T, top_p=0.7), DRAWS))
    picks = _draw(tiny_logits, requests)
    assert_frequencies_match(picks[:DRAWS], expected_k)
    assert_frequencies_match(picks[DRAWS:], expected_p)


def test_a_seeded_row_draws_what_the_single_request_sampler_drew():
    """Seeded rows draw from their own generators, so a seed gives the same token alone, in
    any batch, and as the static stages' ``sample`` draws it."""
    torch.manual_seed(1)
    logits = torch.randn(5, 300)
    params = [SamplingParams(temperature=0.8, seed=s, top_k=k, top_p=p)
              for s, k, p in [(1, 0, 1.0), (2, 20, 1.0), (3, 0, 0.9), (4, 50, 0.5), (5, 0, 1.0)]]
    requests = [r for p in params for r in _requests(p, 1)]
    batched = sample_batch(logits, requests, EOS).token_ids
    alone = [int(sample(logits[i: i + 1], p, make_generator(p, torch.device("cpu")))[0])
             for i, p in enumerate(params)]
    assert batched == alone
    # Again with a greedy row and unseeded rows around them: the seeded rows do not move.
    mixed = [*_requests(SamplingParams(), 1), *_requests(SamplingParams(temperature=1.0), 1)]
    again = [r for p in params for r in _requests(p, 1)]
    tokens = sample_batch(torch.cat([logits[:1], logits[:1], logits]), mixed + again,
                          EOS).token_ids
    assert tokens[2:] == alone and tokens[0] == int(logits[0].argmax())


def test_logprobs_equal_log_softmax_of_hf_logits(tiny):
    """The engine's logprobs for greedy and sampled requests against HF's forward on the same
    tokens: the sampled token's, and the top 5 (ids and values)."""
    engine = make_engine("continuous", tiny)
    prompt = tiny.tokenizer.encode("Once upon a time, in a small village")
    runs = {"greedy": SamplingParams(max_new_tokens=6, logprobs=5, ignore_eos=True),
            "sampled": SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, logprobs=5,
                                      ignore_eos=True, repetition_penalty=1.3)}
    ids = {name: engine.add_request(prompt, params) for name, params in runs.items()}
    done = {}
    while engine.has_unfinished_requests():
        done.update((r.request_id, r) for r in engine.step().outputs if r.finished)
    for name in runs:
        request = done[ids[name]]
        tokens = prompt + request.output_ids
        with torch.inference_mode():
            logits = tiny.model(input_ids=torch.tensor([tokens[:-1]])).logits[0].float()
        expected = logits[len(prompt) - 1:].log_softmax(-1)
        assert len(request.output_logprobs) == 6
        for step, entry in enumerate(request.output_logprobs):
            assert entry.token_id == request.output_ids[step]
            assert entry.logprob == pytest.approx(expected[step, entry.token_id].item(),
                                                  abs=1e-4)
            top = expected[step].topk(5)
            assert [t for t, _ in entry.top] == top.indices.tolist()
            assert [lp for _, lp in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert request.cumulative_logprob == pytest.approx(
            sum(e.logprob for e in request.output_logprobs))


def test_top_p_of_one_and_top_k_of_the_vocabulary_filter_nothing():
    # The running sum of these probabilities is 1.0 in float32 long before the last token:
    # a filter applied at top_p=1.0 would drop the unlikely ones.
    logits = torch.tensor([[0.0, -100.0, -100.0, -120.0]])
    assert filter_logits(logits, top_k=0, top_p=1.0).isfinite().all()
    for top_k in (4, 5):
        assert filter_logits(logits, top_k=top_k, top_p=1.0).isfinite().all()
    # The k-th largest logit itself is kept.
    assert filter_logits(logits, top_k=2, top_p=1.0).isfinite().tolist() == \
        [[True, True, True, False]]  # a tie at the 2nd largest keeps both


def test_generators_greedy_none_seeded_repeatable_unseeded_fresh():
    cpu = torch.device("cpu")
    assert make_generator(SamplingParams(), cpu) is None
    assert make_generator(SamplingParams(temperature=1.0, seed=123), cpu).initial_seed() == 123
    unseeded = {make_generator(SamplingParams(temperature=1.0), cpu).initial_seed()
                for _ in range(3)}
    assert len(unseeded) == 3  # each from fresh entropy, not one default seed


def test_a_request_may_have_several_rows_each_sampled_in_turn():
    """A speculative step scores k + 1 positions of one request: ``sample_batch`` takes the
    request once per row, and a seeded request draws its rows' noise in row order."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    greedy = Request("g", [1], SamplingParams(), RequestTimeline(0.0))
    seeded = Request("s", [1], SamplingParams(temperature=1.0, seed=3), RequestTimeline(0.0))
    seeded.generator = torch.Generator().manual_seed(3)
    tokens = sample_batch(logits, [greedy, greedy, seeded, seeded], None).token_ids
    assert tokens[:2] == logits[:2].argmax(-1).tolist()
    # The same two rows sampled one at a time from a fresh generator with the same seed.
    seeded.generator = torch.Generator().manual_seed(3)
    one_by_one = [sample_batch(logits[i : i + 1], [seeded], None).token_ids[0] for i in (2, 3)]
    assert tokens[2:] == one_by_one
