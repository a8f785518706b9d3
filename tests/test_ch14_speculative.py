"""Chapter 14: speculative decoding. Drafts from prompt lookup, k + 1 positions verified in one
step, and the same tokens out: greedy tokens equal the non-speculative engine's and HF's (tiny
and SmolLM2), sampled tokens follow the model's distribution (a chi-square test), and the
rollback leaves the request and its blocks exactly as the kept tokens need them."""

from __future__ import annotations

import pytest
import torch
from template import first_difference

from miniinfer import ENGINES, MiniInferError, SamplingParams, make_engine
from miniinfer.core.errors import InvalidRequestError
from miniinfer.core.kernels import unavailable_reason
from miniinfer.core.sampling import sampling_probs
from miniinfer.core.speculative import (
    Acceptance,
    DraftBudget,
    NgramIndex,
    StepCosts,
    SuffixIndex,
    accept_greedy,
    accept_sampled,
)
from miniinfer.engines.speculative import SpeculationStats, SpeculativeEngine

GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


def repetitive_prompts(lm) -> list[list[int]]:
    """Prompts whose continuations copy earlier text, so drafts get accepted."""
    tok = lm.tokenizer
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Repeat this sentence three times: The quick brown fox "
                                     "jumps over the lazy dog."}], add_generation_prompt=True)
    chat = chat["input_ids"] if hasattr(chat, "keys") else list(chat)
    return [tok.encode("Copy the list exactly.\nList: apples, bananas, cherries, dates, "
                       "elderberries, figs, grapes, honeydew.\nCopy: apples, bananas,"), chat,
            [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]]


# -- the pieces ---------------------------------------------------------------------------------


def test_prompt_lookup_matches_the_longest_suffix_at_its_latest_occurrence():
    index = NgramIndex()
    text = [1, 2, 3, 4, 5, 1, 2, 3]
    assert index.propose(text, 3) == [4, 5, 1]  # "1 2 3" occurred at 0: "4 5 1" followed
    assert index.propose([*text, 9], 3) == []  # 9 never occurred before
    assert NgramIndex().propose([4, 1, 2, 8, 1, 2], 2) == [8, 1]  # 2-gram "1 2", latest: at 4
    assert NgramIndex().propose([7, 3, 7], 4) == [3, 7, 3, 7]  # the copy goes on from itself
    assert NgramIndex().propose([1, 2, 3], 4) == [] and NgramIndex().propose([1], 2) == []


def test_the_longest_match_drafts_first_up_to_three_tokens_down_to_one():
    # "2 3 4" last occurred before 8, "1 2 3 4" before 9: a match is at most 3 tokens long.
    assert NgramIndex().propose([1, 2, 3, 4, 9, 5, 2, 3, 4, 8, 1, 2, 3, 4], 1) == [8]
    # "1 2" (before 9) outranks the later "2" (before 7): the 2-gram is tried before the 1-gram.
    assert NgramIndex().propose([1, 2, 9, 3, 2, 7, 1, 2], 1) == [9]
    # Only a 1-gram occurred before: it still drafts.
    assert NgramIndex().propose([5, 6, 7, 5], 2) == [6, 7]
    assert NgramIndex().propose([5, 6, 7, 5], 0) == []


class CountingDict(dict):
    writes = 0

    def __setitem__(self, key, value) -> None:
        type(self).writes += 1
        super().__setitem__(key, value)


def test_the_index_grows_with_the_text_three_writes_a_token():
    CountingDict.writes = 0
    index = NgramIndex(followers=CountingDict())
    text = [(7 * i) % 11 for i in range(60)]
    index.propose(text, 2)
    first = CountingDict.writes
    assert first <= 3 * len(text) and index.num_indexed == len(text)
    for token in (3, 4, 5):  # one token a step: only the n-grams ending at the new one
        text.append(token)
        index.propose(text, 2)
    assert CountingDict.writes - first == 3 * 3 and index.num_indexed == len(text)


def test_suffix_lookup_drafts_from_the_longest_match_as_far_as_the_match_runs():
    # "1 2 3" matches 3 tokens at 0-2 (where "4 5 9" followed); the later "3" at 6 only 1.
    text = [1, 2, 3, 4, 5, 9, 3, 8, 1, 2, 3]
    assert SuffixIndex().propose(text, 8) == [4, 5, 9]  # as long as the match: 3 tokens
    assert SuffixIndex().propose(text, 2) == [4, 5]  # never more than asked
    assert SuffixIndex(alpha=2.0).propose(text, 8) == [4, 5, 9, 3, 8, 1]
    # A one-token match drafts one token; of equal matches the latest wins.
    assert SuffixIndex().propose([7, 1, 9, 2, 1, 6, 1], 4) == [6]
    assert SuffixIndex().propose(text, 1) == [4]
    # A match ends at the first token that differs: "2 3" (7 and 9 differ before it).
    assert SuffixIndex().propose([7, 2, 3, 4, 5, 8, 9, 2, 3], 8) == [4, 5]
    assert SuffixIndex().propose([1, 2, 3], 3) == [] and SuffixIndex().propose([4], 2) == []
    assert SuffixIndex().propose([], 2) == [] and SuffixIndex().propose([3, 3], 2) == [3]
    # A copy that reaches the end of the text goes on from what it copied.
    assert SuffixIndex().propose([7, 7, 7, 7], 3) == [7, 7, 7]
    index = SuffixIndex()  # the index grows with the text: each token once
    index.propose([1, 2, 1], 1)
    index.propose([1, 2, 1, 2, 1], 1)
    assert index.positions == {1: [0, 2], 2: [1, 3]} and index.num_indexed == 4


def test_measured_step_costs_read_by_key_rise_and_extend_by_their_mean_step(tmp_path):
    path = tmp_path / "costs.csv"
    rows = ["model,forward,weights,tokens,relative_cost", "m,compiled,int4,1,1.0",
            "m,compiled,int4,2,1.2", "m,compiled,int4,3,1.1", "m,compiled,int4,4,1.6",
            "m,direct,dense,1,1.0", "m,direct,dense,3,2.0", "m,direct,int8,1,1.0",
            "m,direct,int8,2,1.3"]
    path.write_text("\n".join(rows) + "\n")
    costs = StepCosts.read(path, model="m", forward="compiled", weights="int4")
    assert costs.relative == (1.0, 1.2, 1.2, 1.6)  # a dip is noise: the curve never falls
    assert costs(0) == costs(1) == 1.0 and costs(4) == 1.6
    assert costs(6) == pytest.approx(1.6 + 2 * 0.6 / 3)
    assert StepCosts.read(path, model="m", forward="direct", weights="dense") is None  # no 2
    assert StepCosts.read(path, model="m", forward="direct", weights="int8").relative == (1.0, 1.3)
    assert StepCosts.read(path, model="x", forward="compiled", weights="int4") is None
    assert StepCosts.read(tmp_path / "none.csv", model="m") is None
    with pytest.raises(ValueError, match="positive"):
        StepCosts((1.0, 0.0))
    assert StepCosts((1.0,))(3) == 3.0  # one count measured: a token costs a step
    assert StepCosts((1.0, 1.5))(4) == 2.5
    budget = DraftBudget(4, 8.0, 0.25, measured=costs)
    assert budget.step_cost(2) == 1.2 and DraftBudget(4, 8.0, 0.25).step_cost(2) == 1.5


def test_the_engine_drafts_by_its_devices_measured_costs_unless_the_config_models_them(
        tiny, tmp_path, monkeypatch):
    from miniinfer.bench.step_costs import measure_step_costs, write_step_costs
    from miniinfer.engines import speculative

    monkeypatch.setattr(speculative, "YOURS_DIR", tmp_path / "yours")
    monkeypatch.setattr(speculative, "RESULTS_DIR", tmp_path / "book")
    assert make_engine("speculative", tiny).draft_budget.measured is None  # none recorded
    rows = measure_step_costs(tiny, max_tokens=3, context=12, repeats=1, forward="direct")
    assert [r["tokens"] for r in rows] == [1, 2, 3] and rows[0]["relative_cost"] == 1.0
    assert {(r["model"], r["forward"], r["weights"]) for r in rows} == {
        ("tiny", "direct", "dense")}
    path = speculative.step_costs_file(tmp_path / "book", tiny.device)
    write_step_costs(rows, path, {"device_name": "here"})
    write_step_costs(rows, path, {"device_name": "here"})  # a second run replaces the first
    assert len(path.read_text().splitlines()) == 1 + 3
    engine = make_engine("speculative", tiny, forward="direct")
    assert engine.draft_budget.measured.relative[0] == 1.0
    assert len(engine.draft_budget.measured.relative) == 3
    assert make_engine("speculative", tiny, forward="registry").draft_budget.measured is None
    assert make_engine("speculative", tiny, forward="direct",
                       token_cost=0.1).draft_budget.measured is None


def test_suffix_drafts_keep_the_plain_engines_tokens(tiny):
    prompts = repetitive_prompts(tiny)
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    expected = make_engine("continuous", tiny, block_size=4).generate(prompts, params).token_ids
    engine = make_engine("speculative", tiny, block_size=4, speculative="suffix")
    assert engine.generate(prompts, params).token_ids == expected
    assert engine.stats.accepted > 0
    rid = engine.add_request(prompts[0], params)
    assert isinstance(engine._drafter(engine.requests[rid]).index, SuffixIndex)


def test_greedy_acceptance_keeps_drafts_while_they_equal_the_argmax_then_one_of_its_own():
    assert accept_greedy([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]  # third draft wrong: corrected
    assert accept_greedy([5, 6, 7], [5, 6, 7, 1]) == [5, 6, 7, 1]  # all kept, plus a bonus
    assert accept_greedy([5, 6], [4, 6, 7]) == [4]  # first wrong: still one token
    assert accept_greedy([], [3]) == [3]


def test_sampled_acceptance_keeps_a_sure_draft_and_never_redraws_a_rejected_one():
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5], [0.0, 0.0, 1.0]])
    g = torch.Generator().manual_seed(0)
    assert accept_sampled([1, 1], probs, g)[:1] == [1]  # p(1) = 1: always kept
    for seed in range(20):  # p(1) = 0 at row 1: rejected, and the redraw avoids it
        out = accept_sampled([1, 1], probs, torch.Generator().manual_seed(seed))
        assert out[0] == 1 and out[1] in (0, 2) and len(out) == 2


def test_draft_budget_drafts_alone_not_in_a_full_batch_and_stops_when_drafts_fail():
    budget = DraftBudget(max_draft=4, knee_tokens=8, token_cost=0.02)
    assert budget.allocate(1, 1, [(4, 0.8)]) == [4]  # batch 1: memory-bound, verify is free
    assert budget.allocate(64, 64, [(4, 0.8)] * 64) == [0] * 64  # compute-bound: none pays
    assert budget.allocate(1, 1, [(4, 0.01)]) == [0]  # drafts that fail cost more than they give
    assert budget.allocate(1, 1, [(2, 0.9)]) == [2]  # never more than the lookup found
    mixed = budget.allocate(4, 4, [(4, 0.9), (4, 0.1), (4, 0.5), (0, 0.9)])
    assert mixed[0] >= mixed[2] >= mixed[1] and mixed[3] == 0  # the likelier drafts first


def test_draft_budget_spends_tokens_best_gain_first_until_the_next_one_stops_paying():
    budget = DraftBudget(max_draft=4, knee_tokens=8, token_cost=0.25)
    # Two requests, the likelier listed second: it drafts first, and as the step fills (more
    # decodes already in it) its draft shrinks one token at a time, then goes.
    got = [budget.allocate(base, base, [(4, 0.3), (4, 0.9)]) for base in range(1, 10)]
    assert got == [[0, 4]] * 4 + [[0, 3], [0, 2], [0, 1], [0, 0], [0, 0]]
    assert DraftBudget(4, 8, 0.02).allocate(1, 1, [(4, 0.3), (4, 0.9)]) == [2, 4]
    assert DraftBudget(4, 8, 0.02).allocate(2, 2, [(4, 0.3), (4, 0.9)]) == [1, 4]
    assert budget.allocate(1, 1, [(1, 0.9)]) == [1]  # one token found: one drafted
    # An exact tie between what a draft gives and what it costs is not drafted: with a knee of
    # 1 and no token cost, 1 + 0.5 tokens in a step of cost 2 equals 1 token a step of cost 3.
    assert DraftBudget(4, 1.0, 0.0).allocate(2, 1.0, [(1, 0.5)]) == [0]


def test_the_acceptance_rate_counts_kept_drafts_over_tested_ones_and_forgets():
    acceptance = Acceptance()
    assert acceptance.rate == 1 / 2  # one success in two pseudo-trials
    acceptance.update(4, 2)  # 2 kept, the 3rd rejected, the 4th never tested: 2 of 3
    assert (acceptance.successes, acceptance.trials) == (2, 3)
    assert acceptance.rate == 3 / 5
    acceptance.update(3, 3)  # all kept: 3 of 3, the past weighed by 0.8
    assert acceptance.successes == pytest.approx(0.8 * 2 + 3)
    assert acceptance.trials == pytest.approx(0.8 * 3 + 3)
    acceptance.update(0, 0)  # no draft: nothing learnt
    assert acceptance.trials == pytest.approx(0.8 * 3 + 3)


def test_sampled_acceptance_keeps_every_sure_draft_then_draws_the_bonus_token():
    probs = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    assert accept_sampled([1], probs, torch.Generator().manual_seed(0)) == [1, 3]
    with pytest.raises(InvalidRequestError, match="1 drafts need 2 rows"):
        accept_sampled([1], probs[:1], None)
    # A draft the target gives half its mass: when rejected, the redraw is never that draft.
    halves = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    outs = [accept_sampled([0], halves, torch.Generator().manual_seed(seed))
            for seed in range(40)]
    assert {tuple(o) for o in outs} == {(0, 2), (1,)}  # kept then the bonus, or replaced by 1


# -- lossless, greedy ---------------------------------------------------------------------------


def test_the_stage_is_registered_on_chapter_09s_engine():
    assert ENGINES["speculative"] is SpeculativeEngine
    assert SpeculativeEngine.__mro__[1] is ENGINES["prefix-cache"]


def test_greedy_tokens_equal_the_plain_engines_on_tiny_in_one_batch_and_alone(tiny):
    prompts = repetitive_prompts(tiny) + [[20 + (3 * j) % 50 for j in range(40)]]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    expected = make_engine("continuous", tiny, block_size=4).generate(prompts, params).token_ids
    for name in ("speculative", "speculative:fixed"):
        engine = make_engine(name, tiny, block_size=4)
        assert engine.generate(prompts, params).token_ids == expected, name
        for prompt, ref in zip(prompts, expected, strict=True):
            ours = engine.generate([prompt], params).token_ids[0]
            assert ours == ref, f"{name} alone: " + first_difference(ours, ref)
        assert engine.stats.accepted > 0 and engine.stats.drafted > engine.stats.accepted
        assert engine.kv_cache.block_manager.block_tables == {}  # every block given back


def test_greedy_tokens_equal_hf_and_the_plain_engine_on_smollm2(smollm2):
    prompts = repetitive_prompts(smollm2)[:2]
    hf = make_engine("hf", smollm2)
    plain = make_engine("prefix-cache", smollm2)
    engine = make_engine("speculative", smollm2)
    for prompt in prompts:
        ref = hf.generate([prompt], GREEDY).token_ids[0]
        assert plain.generate([prompt], GREEDY).token_ids[0] == ref
        ours = engine.generate([prompt], GREEDY).token_ids[0]
        assert ours == ref, first_difference(ours, ref)
    # The copy prompt's continuation is its list: most drafts are right.
    assert engine.stats.accepted >= 8 and engine.stats.tokens_per_step > 1.3


@pytest.mark.parametrize("attention", ["cpu", "torch"])
def test_int4_greedy_tokens_with_drafts_equal_those_without_on_smollm2(smollm2, attention):
    """int4's kernel rounds each activation row to int8, where a last-bit difference in
    attention moves a code: a verified token must attend exactly as its decode would (the C++
    kernel's short runs go a token at a time; the reference's when a step has only short runs).
    With verification runs in the C++ kernel's tiles, this prompt's tokens parted at the 16th;
    in the reference's batched SDPA, at the 16th too."""
    from miniinfer.core.models import chat_text
    from miniinfer.lab.speculation import OPEN_ENDED

    prompt = smollm2.tokenizer.encode(
        chat_text(smollm2.tokenizer, [{"role": "user", "content": OPEN_ENDED[0]}]),
        add_special_tokens=False)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    if attention == "cpu" and (reason := unavailable_reason("cpu", "cpu")):
        pytest.skip(f"the C++ attention kernel: {reason}")
    settings = {"forward": "direct", "weights": "int4", "attention_backend": attention}
    expected = make_engine("prefix-cache", smollm2, **settings).generate([prompt], params)
    engine = make_engine("speculative", smollm2, **settings)
    ours = engine.generate([prompt], params).token_ids[0]
    assert ours == expected.token_ids[0], first_difference(ours, expected.token_ids[0])
    # Verified drafts, all rejected here: each verification's token came from a 2-5 token run.
    assert engine.stats.drafted_steps > 0


def test_stop_tokens_and_logprobs_inside_accepted_drafts(tiny):
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    plain = make_engine("continuous", tiny)
    engine = make_engine("speculative:fixed", tiny)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True, logprobs=2)
    done = {}
    for e in (plain, engine):
        e.add_request(prompt, params)
        while e.has_unfinished_requests():
            for r in e.step().outputs:
                if r.finished:
                    done[e] = r
    a, b = done[plain], done[engine]
    assert b.output_ids == a.output_ids and len(b.output_logprobs) == len(b.output_ids)
    assert [lp.token_id for lp in b.output_logprobs] == b.output_ids
    assert abs(b.cumulative_logprob - a.cumulative_logprob) < 1e-3
    # A stop token that a draft carries ends the request there: the tokens after it are
    # dropped, and their logprobs, from the list and from the sum.
    prompt = list(range(60, 75))
    expected = plain.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))
    expected = expected.token_ids[0]
    stop = expected[7]
    assert stop not in expected[:7]
    cut = ForcedDrafts(tiny, draft_policy="fixed", num_draft_tokens=9)
    cut.drafts = {1: expected[1:10]}  # all right: the step keeps 9 drafts and the bonus
    request = cut.requests[cut.add_request(prompt, SamplingParams(
        max_new_tokens=12, ignore_eos=True, stop_token_ids=(stop,), logprobs=2))]
    while cut.has_unfinished_requests():
        cut.step()
    assert request.output_ids == expected[:8] and cut.stats.tokens == 8
    assert (cut.stats.drafted, cut.stats.accepted) == (9, 9)
    assert [lp.token_id for lp in request.output_logprobs] == expected[:8]
    assert abs(request.cumulative_logprob
               - sum(lp.logprob for lp in request.output_logprobs)) < 1e-6


# -- acceptance and rollback state --------------------------------------------------------------


class ForcedDrafts(SpeculativeEngine):
    """Drafts chosen by the test: ``drafts[len(output)]`` for a request's output so far."""

    drafts: dict[int, list[int]] = {}

    def propose(self, request, k):
        return list(self.drafts.get(len(request.output_ids), []))


def test_rollback_keeps_the_accepted_drafts_kv_and_frees_the_rejected_blocks(tiny):
    prompt = list(range(20, 30))  # 10 tokens, block size 4: blocks 0-2 hold tokens 0-11
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    expected = make_engine("continuous", tiny, block_size=4).generate([prompt], params).token_ids[0]
    engine = ForcedDrafts(tiny, block_size=4, num_draft_tokens=6, draft_policy="fixed")
    # After the first token: 2 right drafts, then 4 wrong ones (to 17 tokens, into block 4).
    wrong = [t + 1 for t in expected[3:7]]
    engine.drafts = {1: [expected[1], expected[2], *wrong]}
    rid = engine.add_request(prompt, params)
    request = engine.requests[rid]
    manager = engine.kv_cache.block_manager
    engine.step()  # the prompt: one token
    assert request.output_ids == expected[:1] and request.num_computed_tokens == 10
    free_before = manager.num_free_blocks
    truncated = []
    original = manager.truncate
    manager.truncate = lambda request_id, n: truncated.append((n, original(request_id, n))) \
        or truncated[-1][1]
    step = engine.step()  # fed 7 tokens at 10..16; kept 2 drafts and the model's token
    assert step.num_prefill_tokens == 7 and step.num_decodes == 0
    assert request.output_ids == expected[:4]
    assert request.num_computed_tokens == 13 and request.num_tokens == 14
    assert manager.num_tokens[rid] == 13 and len(manager.block_tables[rid]) == 4
    assert truncated[0][0] == 4 and len(truncated[0][1]) == 1  # block 4 (tokens 16-) freed
    assert manager.num_free_blocks == free_before - 1  # block 3 stays: it holds tokens 12-13
    assert request.draft_ids == [] and (engine.stats.drafted, engine.stats.accepted) == (6, 2)
    # Two request-steps so far, one of them verified a draft; the request's own acceptance
    # estimate (what the draft budget reads) counted 2 kept of the 3 tested.
    assert (engine.stats.request_steps, engine.stats.drafted_steps) == (2, 1)
    assert engine.stats.kept_drafts == {2: 1}  # the histogram: one drafted step kept 2
    acceptance = engine._drafter(request).acceptance
    assert (acceptance.successes, acceptance.trials) == (2, 3)
    while engine.has_unfinished_requests():
        engine.step()
    assert request.output_ids == expected  # the K/V kept was right: the rest follows
    assert manager.block_tables == {} and engine.stats.tokens == len(expected)
    # No more drafts after the first: one request-step a token from then on.
    assert (engine.stats.request_steps, engine.stats.drafted_steps) == (len(expected) - 2, 1)
    # A single draft is a drafted step too.
    one = ForcedDrafts(tiny, block_size=4, num_draft_tokens=6, draft_policy="fixed")
    one.drafts = {1: [expected[1]]}
    one.add_request(prompt, params)
    one.step()
    one.step()
    assert (one.stats.drafted, one.stats.accepted, one.stats.drafted_steps) == (1, 1, 1)
    assert one.stats.kept_drafts == {1: 1}


def test_drafts_shrink_to_the_token_budget_and_give_way_before_a_preemption(tiny):
    engine = ForcedDrafts(tiny, block_size=4, num_draft_tokens=6, draft_policy="fixed",
                          max_num_batched_tokens=4)
    engine.drafts = {1: [1, 2, 3, 4, 5, 6]}
    engine.add_request(list(range(20, 24)), SamplingParams(max_new_tokens=8, ignore_eos=True))
    engine.step()
    step = engine.step()
    assert step.num_prefill_tokens == 4  # the last token and 3 drafts: the budget's 4
    assert engine.stats.drafted == 3


def scheduled_drafts(engine, request) -> list[tuple[int, list[int]]]:
    """Run ``engine`` to the end, noting at each schedule the request's output length and the
    drafts it is about to verify."""
    seen, schedule = [], engine.schedule

    def spy():
        batch = schedule()
        seen.append((len(request.output_ids), list(request.draft_ids)))
        return batch

    engine.schedule = spy
    while engine.has_unfinished_requests():
        engine.step()
    return seen


def test_a_draft_never_reaches_past_the_requests_last_token(tiny):
    # A step yields its drafts and one token more: with 1 token to go a request drafts none.
    engine = make_engine("speculative:fixed", tiny, block_size=4, num_draft_tokens=4)
    for max_new in (3, 6):
        rid = engine.add_request([5, 6, 7, 8] * 6, SamplingParams(max_new_tokens=max_new,
                                                                  ignore_eos=True))
        seen = scheduled_drafts(engine, engine.requests[rid])
        decodes = [(n, len(d)) for n, d in seen if n > 0]
        assert decodes and all(k == min(4, max_new - n - 1) for n, k in decodes), decodes
        assert any(k > 0 for _, k in decodes)


def test_a_request_that_cannot_draft_verifies_nothing_and_keeps_its_tokens(tiny):
    # A repetition penalty reads the committed output, which a draft would change mid-step.
    prompt = [5, 6, 7, 8] * 6
    penalised = SamplingParams(max_new_tokens=12, ignore_eos=True, repetition_penalty=1.3)
    expected = make_engine("continuous", tiny, block_size=4).generate([prompt], penalised)
    engine = make_engine("speculative:fixed", tiny, block_size=4)
    assert engine.generate([prompt], penalised).token_ids == expected.token_ids
    assert engine.stats.drafted == 0 and engine.stats.request_steps == 12


def test_drafts_are_the_steps_own_a_stale_one_is_dropped(tiny):
    engine = make_engine("speculative:fixed", tiny, block_size=4)
    rid = engine.add_request(list(range(20, 30)), SamplingParams(max_new_tokens=8,
                                                                 ignore_eos=True))
    engine.step()
    request = engine.requests[rid]
    request.draft_ids = [1, 2, 3]  # left from a step that never ran
    engine.propose = lambda request, k: []  # and no draft this step
    engine.schedule()
    assert request.draft_ids == []


def test_the_adaptive_budget_counts_only_the_prompt_tokens_still_to_compute(tiny):
    engine = make_engine("speculative", tiny, block_size=4, max_num_batched_tokens=32)
    engine.add_request([5, 6, 7, 8] * 4, SamplingParams(max_new_tokens=8, ignore_eos=True))
    engine.step()  # its prompt (16 tokens): decoding from the next step
    long = engine.requests[engine.add_request(list(range(100, 140)),
                                              SamplingParams(max_new_tokens=2, ignore_eos=True))]
    calls, allocate = [], engine.draft_budget.allocate
    engine.draft_budget = type("Spy", (), {
        "max_draft": engine.draft_budget.max_draft,
        "allocate": lambda self, base, yield_, candidates: calls.append(
            (base, long.num_tokens - long.num_computed_tokens)) or allocate(base, yield_,
                                                                           candidates)})()
    engine.step()  # the decode, its drafts and as much of the 40 prompt tokens as fits
    engine.step()  # the decode and the rest of the prompt
    # The step's other tokens: one decode, and the prompt that is still to compute (all 40,
    # then what the first step left), never more than the budget holds besides the decode.
    assert calls[0] == (1 + 31, 40) and 0 < calls[1][1] < 40
    assert calls[1][0] == 1 + calls[1][1]


def test_a_prompt_two_tokens_from_its_end_still_counts_as_prompt(tiny):
    engine = make_engine("speculative", tiny, block_size=4, max_num_batched_tokens=32)
    engine.add_request([5, 6, 7, 8] * 4, SamplingParams(max_new_tokens=8, ignore_eos=True))
    engine.step()
    long = engine.requests[engine.add_request(list(range(100, 133)),
                                              SamplingParams(max_new_tokens=2, ignore_eos=True))]
    engine.propose = lambda request, k: []  # no drafts: the decode and 31 of the 33 tokens
    engine.step()
    del engine.propose
    assert long.num_tokens - long.num_computed_tokens == 2
    calls, allocate = [], engine.draft_budget.allocate
    engine.draft_budget = type("Spy", (), {
        "max_draft": engine.draft_budget.max_draft,
        "allocate": lambda self, *args: calls.append(args[0]) or allocate(*args)})()
    engine.step()
    assert calls == [1 + 2]


def test_the_lookup_reads_the_whole_text_its_first_token_too(tiny):
    engine = make_engine("speculative", tiny, block_size=4)
    request = engine.requests[engine.add_request([9, 5, 9], GREEDY)]
    assert engine.propose(request, 2) == [5, 9]  # "9" occurred only as the text's first token


def test_drafts_wait_for_min_tokens_then_start_at_once(tiny):
    engine = make_engine("speculative:fixed", tiny, block_size=4, num_draft_tokens=4)
    rid = engine.add_request([5, 6, 7, 8] * 6, SamplingParams(max_new_tokens=12, min_tokens=3,
                                                              ignore_eos=True))
    seen = scheduled_drafts(engine, engine.requests[rid])
    assert [n for n, d in seen if n > 0][:3] == [1, 2, 3]  # one token a step until then
    assert [bool(d) for n, d in seen if 0 < n <= 3] == [False, False, True]


def test_an_undrafted_sampled_request_draws_the_plain_engines_tokens(tiny):
    # Without drafts, a seeded sampled request goes through chapter 08's sampler as it would
    # on the plain engine: the same draws, so the same tokens.
    params = SamplingParams(max_new_tokens=10, temperature=0.9, seed=7, ignore_eos=True)
    prompt = [5, 6, 7, 8] * 3
    plain = make_engine("continuous", tiny, block_size=4).generate([prompt], params)
    engine = make_engine("speculative", tiny, block_size=4)
    engine.propose = lambda request, k: []
    out = engine.generate([prompt], params)
    assert out.token_ids == plain.token_ids and engine.stats.drafted == 0


def test_a_seeded_sampled_request_with_drafts_draws_the_same_tokens_every_run(tiny):
    # Its drafts are verified with its own generator, not the process's: a rerun repeats it.
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=3, ignore_eos=True)
    prompt = [5, 6, 7, 8] * 6
    runs = []
    for global_seed in (0, 1):
        torch.manual_seed(global_seed)
        engine = ForcedDrafts(tiny, block_size=4, draft_policy="fixed")
        engine.drafts = {n: [5, 6, 7] for n in range(1, 16)}
        runs.append(engine.generate([prompt], params).token_ids)
        assert engine.stats.drafted > 0
    assert runs[0] == runs[1]


def test_sampled_requests_verified_in_one_step_each_read_their_own_rows(tiny):
    # Sampling with top_k=1 is greedy, taken through rejection sampling: a draft is kept
    # exactly when it is the argmax, so each request must get its own greedy tokens.
    prompts = [list(range(20, 30)), list(range(60, 75))]
    greedy = SamplingParams(max_new_tokens=6, ignore_eos=True)
    expected = make_engine("continuous", tiny, block_size=4).generate(prompts, greedy).token_ids
    sampled = SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=1.0, top_k=1, seed=0)
    engine = ForcedDrafts(tiny, block_size=4, draft_policy="fixed")
    engine.drafts = {n: [1, 2] for n in range(1, 6)}
    assert engine.generate(prompts, sampled).token_ids == expected
    assert engine.stats.drafted >= 4


def test_the_speculation_counters_divide_as_named():
    stats = SpeculationStats(drafted=8, accepted=6, request_steps=4, drafted_steps=3, tokens=10)
    assert (stats.acceptance_rate, stats.tokens_per_step) == (0.75, 2.5)
    assert (SpeculationStats().acceptance_rate, SpeculationStats().tokens_per_step) == (0.0, 0.0)


def test_preemption_under_speculation_recomputes_and_keeps_the_tokens(tiny):
    """A pool too small for every request: the scheduler drops drafts first, then preempts;
    a preempted request recomputes its committed tokens only, and every request still gets the
    tokens it gets alone."""
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 40 + i] for i in range(4)]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    expected = make_engine("continuous", tiny, block_size=4).generate(prompts, params).token_ids
    engine = make_engine("speculative:fixed", tiny, block_size=4, num_blocks=16)
    ids = [engine.add_request(p, params) for p in prompts]
    requests = [engine.requests[i] for i in ids]
    while engine.has_unfinished_requests():
        engine.step()
        manager = engine.kv_cache.block_manager
        for r in engine.scheduler.running:  # after a step: committed K/V only, no drafts left
            assert r.draft_ids == [] and manager.num_tokens[r.request_id] == \
                r.num_computed_tokens <= r.num_tokens
    assert [r.output_ids for r in requests] == expected
    assert sum(r.num_preemptions for r in requests) > 0 and engine.stats.accepted > 0


# -- lossless, sampled: the output follows the model's distribution ---------------------------


def test_sampled_tokens_after_a_forced_draft_follow_the_models_distribution(tiny):
    """Chi-square goodness of fit. 1,200 seeded requests share a prompt and sample with
    top_k = 4 at temperature 1; their first token t1 comes from a plain (prefill) step. For the
    requests whose t1 is the most common one, the next step verifies a forced draft: the
    second most likely token after (prompt, t1), kept with probability p(draft), else
    replaced by a draw from p without it. Their second token must follow p(. | prompt, t1),
    computed exactly from the model, over the 4 tokens top-k keeps: 3 degrees of freedom, and
    the test fails when the statistic exceeds 16.27, the chi-square quantile at 0.999 — a
    correct sampler fails with probability 0.1% over random seeds (the seeds are fixed, so
    the outcome is reproducible). A sampler that ignored the rejection (kept every draft) or
    redrew from p including the draft is caught at far smaller counts."""
    n = 1200
    prompt = [3, 141, 59, 26, 53, 58, 97, 93]
    params = [SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=1.0, top_k=4,
                             seed=seed) for seed in range(n)]
    # p(. | prompt) and, for the likeliest t1, p(. | prompt, t1): the model's own rows.
    with torch.inference_mode():
        logits = tiny.model(input_ids=torch.tensor([prompt])).logits[0, -1:]
    first = sampling_probs(logits, [_row(params[0])], None)[0]
    t1 = int(first.argmax())
    with torch.inference_mode():
        logits = tiny.model(input_ids=torch.tensor([[*prompt, t1]])).logits[0, -1:]
    p = sampling_probs(logits, [_row(params[0])], None)[0]
    support = p.nonzero()[:, 0].tolist()
    assert len(support) == 4
    draft = int(p.topk(2).indices[1])
    engine = ForcedDrafts(tiny, draft_policy="fixed", max_num_seqs=n,
                          max_num_batched_tokens=n * len(prompt), num_blocks=3 * n)
    engine.drafts = {1: [draft]}
    original = engine.propose
    engine.propose = lambda request, k: original(request, k) if request.output_ids == [t1] \
        else []
    ids = [engine.add_request(prompt, sp) for sp in params]
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((r.request_id, r.output_ids) for r in engine.step().outputs if r.finished)
    seconds = [outputs[i][1] for i in ids if outputs[i][0] == t1]
    assert len(seconds) > n // 8 and engine.stats.drafted == len(seconds)
    assert 0 < engine.stats.accepted < len(seconds)  # both branches taken
    counts = torch.tensor([seconds.count(t) for t in support], dtype=torch.float64)
    assert counts.sum() == len(seconds)  # never a token top-k removed
    expected = p[support].double() * len(seconds)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.27, (chi2, counts.tolist(), expected.tolist())
    # Where the draft was kept, the same step drew the bonus token from the draft's own row:
    # p(. | prompt, t1, draft), not the row before it.
    with torch.inference_mode():
        logits = tiny.model(input_ids=torch.tensor([[*prompt, t1, draft]])).logits[0, -1:]
    bonus_p = sampling_probs(logits, [_row(params[0])], None)[0]
    bonus_support = bonus_p.nonzero()[:, 0].tolist()
    thirds = [outputs[i][2] for i in ids if outputs[i][:2] == [t1, draft]]
    assert len(thirds) == engine.stats.accepted
    counts = torch.tensor([thirds.count(t) for t in bonus_support], dtype=torch.float64)
    assert counts.sum() == len(thirds)
    expected = bonus_p[bonus_support].double() * len(thirds)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.27, (chi2, counts.tolist(), expected.tolist())


def _row(params: SamplingParams):
    class Row:
        prompt_ids: list[int] = []
        output_ids: list[int] = []
        penalty_state = None
        generator = None

    row = Row()
    row.params = params
    return row


# -- the server: serve --speculative ngram ----------------------------------------------------


def test_the_server_speculates_with_the_same_tokens_and_counts_drafts_in_metrics(tiny):
    from server_helpers import running_server

    from miniinfer.server import ServerConfig

    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    texts = {}
    for speculative in (None, "ngram"):
        with running_server(tiny, speculative=speculative, num_speculative_tokens=3) as server:
            assert (server.engine.name == "speculative") == (speculative is not None)
            out = server.client().completions.create(model=tiny.name, **{
                k: v for k, v in body.items() if k != "ignore_eos"}, extra_body={
                "ignore_eos": True})
            texts[speculative] = out.choices[0].text
            metrics = server.metrics()
            if speculative:
                stats = server.engine.stats
                assert server.engine.draft_budget.max_draft == 3
                assert metrics["vllm:spec_decode_num_draft_tokens_total"] == stats.drafted > 0
                assert metrics["vllm:spec_decode_num_accepted_tokens_total"] == stats.accepted
                assert metrics["vllm:spec_decode_num_drafts_total"] == stats.drafted_steps
            else:
                assert not any(name.startswith("vllm:spec_decode") for name in metrics)
    assert texts["ngram"] == texts[None]
    with pytest.raises(MiniInferError, match="unknown speculative 'eagle'; choose one of ngram"):
        ServerConfig(speculative="eagle")
    # Drafts compose with any serving engine now (issue 78); what cannot combine is named.
    from miniinfer.engines import engine_config

    ServerConfig(engine="compiled", speculative="ngram")
    assert engine_config("compiled", speculative="ngram").forward == "compiled"
    with pytest.raises(InvalidRequestError, match="forward='compiled' and tensor_parallel=2"):
        ServerConfig(engine="compiled", speculative="ngram", tensor_parallel=2)
    # Longer verifications would attend in the CPU kernel's tiles, not as decodes.
    ServerConfig(speculative="ngram", num_speculative_tokens=14)
    with pytest.raises(InvalidRequestError, match="num_speculative_tokens must be in 0-14, got 15"):
        ServerConfig(speculative="ngram", num_speculative_tokens=15)
    with pytest.raises(InvalidRequestError, match="num_draft_tokens must be at most 14, got 15"):
        engine_config("compiled", speculative="ngram", num_draft_tokens=15)


# -- the recording (make chapter-14), rehearsed on tiny sizes ---------------------------------


def test_the_recording_writes_every_workload_at_batch_1_and_served(tiny, tmp_path):
    from miniinfer.book.results import read_results
    from miniinfer.lab.speculation import (
        DRAFTERS,
        HF_SYSTEMS,
        SpeculationConfig,
        record_speculation,
    )

    words = " ".join(f"word{i}" for i in range(40))
    text = tmp_path / "text.txt"
    text.write_text(f"Title\n\n{words}.\n\n{words} again.\n\nShort.")
    # The book's recording runs the compiled forward; the direct one rehearses it in seconds.
    config = SpeculationConfig(num_prompts=1, new_tokens=6, repeat=1, served_clients=3,
                               served_repeat=2, forward="direct", weights=("dense", "int8"),
                               step_cost_repeats=1)
    path = record_speculation("cpu", config, lm=tiny, out=tmp_path / "ch14.csv", text_path=text,
                              costs_root=tmp_path)
    # Each weights' verification cost curve, 1-9 tokens, in the step-cost file.
    costs = read_results(next((tmp_path / "ch14").glob("*-step-costs.csv")))
    assert sorted(costs.weights) == sorted(["dense", "int8"] * 9)
    assert (costs.groupby("weights").tokens.apply(sorted) == [list(range(1, 10))] * 2).all()
    assert (costs[costs.tokens == 1].relative_cost == 1.0).all()
    df = read_results(path)
    assert set(df.workload) == {"rewrite", "copy", "open-ended", "grounded"}
    batch1 = df[df.run == "batch-1"]
    # HF (with and without its prompt lookup) on the model's own weights only, on two
    # workloads.
    dense = batch1[batch1.weights == "dense"]
    assert sorted(dense.system) == sorted(list(DRAFTERS) * 3 + list(HF_SYSTEMS) * 2)
    assert set(dense[dense.system.isin(HF_SYSTEMS)].workload) == set(config.hf_workloads)
    assert sorted(batch1[batch1.weights == "int8"].system) == sorted(list(DRAFTERS) * 3)
    assert batch1.same_tokens.astype(str).str.lower().eq("true").all()  # HF's lookup included
    # The drafters' rows carry the histogram of drafts kept per drafted step, which sums to
    # the accepted drafts the acceptance rate was counted from.
    drafted = batch1[batch1.system.isin(["ngram", "suffix"])]
    assert drafted.kept_drafts.fillna("").str.fullmatch(r"(\d+:\d+( |$))*").all()
    assert batch1[batch1.system == "no drafts"].kept_drafts.fillna("").eq("").all()
    for row in drafted[drafted.kept_drafts.fillna("") != ""].itertuples():
        histogram = {int(k): int(n) for k, n in (p.split(":") for p in row.kept_drafts.split())}
        steps, kept = sum(histogram.values()), sum(k * n for k, n in histogram.items())
        assert kept == pytest.approx(row.acceptance_rate * row.drafts_per_drafted_step * steps)
    served = df[df.run == "served"]
    assert set(served.workload) == {"grounded", "open-ended"}
    assert len(served) == 2 * 2 * len(DRAFTERS) and (served.num_prompts == 3).all()
    assert (served.tok_s > 0).all() and (served.ttft_p50_ms > 0).all()
    assert (served.repeats == 2).all() and (served.tok_s_min <= served.tok_s).all() \
        and (served.tok_s <= served.tok_s_max).all()
    assert {"device", "device_name", "dtype", "torch", "git_sha", "date", "busy",
            "forward"} <= set(df) and set(df.forward) == {"direct"}
    # Every engine on one attention, recorded: on a CPU chapter 11's kernels where they build.
    from miniinfer.core.kernels import unavailable_reason
    head_dim = tiny.config.hidden_size // tiny.config.num_attention_heads
    assert set(df.attention_backend) == \
        {"cpu" if unavailable_reason("cpu", "cpu", head_dim=head_dim) is None else "auto"}
