"""Chapter 08: the continuous engine serves requests that come and go (arrivals at different
steps, chunked prompts, preemptions, aborts) and each request still gets, token for token, what
HF generate gives its prompt alone."""

from __future__ import annotations

import random

import pytest
from conftest import NEW_TOKENS
from template import (
    assert_each_equals_naive,
    assert_greedy_matches_hf,
    drive_requests,
    first_difference,
)

from miniinfer import ENGINES, InvalidRequestError, MiniInferError, SamplingParams, make_engine
from miniinfer.book.chapters import chapter_of_stage
from miniinfer.core.scheduler import FinishReason
from miniinfer.engines.continuous import ContinuousEngine

GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)


def run_to_end(engine: ContinuousEngine, arrivals: dict[int, list[tuple]] | None = None,
               budget_check: int | None = None) -> tuple[dict, list]:
    """Step until idle, adding ``arrivals[step]`` = [(prompt, params, request id)] on the way;
    returns the finished requests by id and every step's result."""
    arrivals = arrivals or {}
    finished, steps = {}, []
    while engine.has_unfinished_requests() or any(s >= len(steps) for s in arrivals):
        for prompt, params, rid in arrivals.get(len(steps), []):
            engine.add_request(prompt, params, request_id=rid)
        result = engine.step()
        if budget_check is not None:
            assert result.num_decodes + result.num_prefill_tokens <= budget_check
        steps.append(result)
        finished.update((r.request_id, r) for r in result.outputs if r.finished)
    return finished, steps


def assert_all_blocks_free(engine: ContinuousEngine) -> None:
    manager = engine.kv_cache.block_manager
    assert manager.num_free_blocks == manager.num_blocks and not manager.block_tables
    assert not engine.scheduler.waiting and not engine.scheduler.running


def test_registered_after_paged_attention():
    names = list(ENGINES)
    assert names.index("continuous") > names.index("paged-attention")
    assert ENGINES["continuous"] is ContinuousEngine and chapter_of_stage("continuous") == "08"


def test_greedy_matches_hf(smollm2, template_prompts, hf_greedy):
    engine = make_engine("continuous", smollm2)
    assert_greedy_matches_hf(engine, template_prompts, hf_greedy)
    assert_all_blocks_free(engine)


def test_arrivals_chunks_and_preemptions_match_hf_alone(smollm2, template_prompts, hf_greedy):
    """Real SmolLM2: a third of the prompts at step 0, the rest one every other step; a 24-token
    budget chunks every prompt longer than that, and 14 blocks of 16 tokens (about a quarter of
    what all requests would hold at once) force preemptions."""
    engine = make_engine("continuous", smollm2, max_num_batched_tokens=24, block_size=16,
                         num_blocks=14)
    arrivals = {0: [(p, GREEDY, i) for i, p in enumerate(template_prompts[:4])]}
    for k, (i, p) in enumerate(enumerate(template_prompts[4:], start=4)):
        arrivals[2 * (k + 1)] = [(p, GREEDY, i)]
    finished, steps = run_to_end(engine, arrivals, budget_check=24)
    for i, ref in enumerate(hf_greedy["single"]):
        ours = finished[i].output_ids
        assert ours == ref, f"request {i} ({len(template_prompts[i])} tokens, " \
                            f"{finished[i].num_preemptions} preemptions): " \
                            + first_difference(ours, ref)
        assert finished[i].finish_reason is FinishReason.LENGTH
    assert sum(len(s.preempted) for s in steps) > 0
    assert any(s.num_decodes and s.num_prefill_tokens for s in steps), "no mixed step"
    # A prompt longer than the budget took several steps before its first token.
    long = max(range(len(template_prompts)), key=lambda i: len(template_prompts[i]))
    assert len(template_prompts[long]) > 24 and len(finished[long].timeline.steps) > NEW_TOKENS
    assert_all_blocks_free(engine)


def test_stops_at_eos_like_hf(smollm2, hf_eos):
    engine = make_engine("continuous", smollm2)
    rid = engine.add_request(hf_eos.prompts[0], hf_eos.params)
    finished, _ = run_to_end(engine)
    assert finished[rid].output_ids == hf_eos.hf_alone
    assert finished[rid].finish_reason is FinishReason.EOS


def test_stop_strings_end_a_request_on_the_token_that_completes_them(smollm2):
    tok = smollm2.tokenizer
    prompt = tok.encode("1, 2, 3, 4,")
    engine = make_engine("continuous", smollm2)
    full = engine.generate([prompt], SamplingParams(max_new_tokens=16, ignore_eos=True))
    text = tok.decode(full.token_ids[0])
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    expected = next(full.token_ids[0][:n] for n in range(1, 17)
                    if stop in tok.decode(full.token_ids[0][:n]))
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=16, ignore_eos=True),
                             stop=["never appears", stop])
    finished, _ = run_to_end(engine)
    assert finished[rid].output_ids == expected
    assert finished[rid].finish_reason is FinishReason.STOP
    assert_all_blocks_free(engine)


def test_stop_strings_are_looked_for_in_the_tail_only(smollm2, monkeypatch):
    # Decoding a request's whole output at every token would be quadratic in its length.
    tok = smollm2.tokenizer
    decoded = []
    decode = tok.decode
    monkeypatch.setattr(tok, "decode", lambda ids, *a, **k: decoded.append(len(ids)) or
                        decode(ids, *a, **k))
    engine = make_engine("continuous", smollm2)
    rid = engine.add_request(tok.encode("1, 2, 3, 4,"),
                             SamplingParams(max_new_tokens=40, ignore_eos=True), stop=["@@"])
    finished, _ = run_to_end(engine)
    assert len(finished[rid].output_ids) == 40 and len(decoded) == 40
    assert max(decoded) == 4 * 2 + 2


def test_per_request_sampling_params_and_seeds(tiny):
    prompts = [[5, 6, 7], list(range(20, 53))]
    sampled = SamplingParams(max_new_tokens=12, temperature=0.9, top_k=40, top_p=0.9, seed=7,
                             ignore_eos=True)
    greedy = SamplingParams(max_new_tokens=8, ignore_eos=True)
    engine = make_engine("continuous", tiny)
    alone = engine.generate([prompts[1]], sampled).token_ids[0]
    engine.add_request(prompts[0], greedy, request_id="greedy")
    engine.add_request(prompts[1], sampled, request_id="sampled")
    finished, _ = run_to_end(engine)
    # The seed belongs to the request: its tokens do not depend on who shares its steps.
    assert finished["sampled"].output_ids == alone and len(alone) == 12
    assert finished["greedy"].output_ids == \
        make_engine("naive", tiny).generate([prompts[0]], greedy).token_ids[0]
    other_seed = SamplingParams(max_new_tokens=12, temperature=0.9, top_k=40, top_p=0.9, seed=8,
                                ignore_eos=True)
    assert engine.generate([prompts[1]], other_seed).token_ids[0] != alone


def test_request_validation(tiny):
    engine = make_engine("continuous", tiny, block_size=4, num_blocks=8)
    params = SamplingParams(max_new_tokens=4)
    with pytest.raises(InvalidRequestError, match="needs 9 KV blocks, more than the whole pool"):
        engine.add_request([5] * 30, SamplingParams(max_new_tokens=6))
    with pytest.raises(InvalidRequestError, match="stop must be a sequence"):
        engine.add_request([5], params, stop="x")
    with pytest.raises(InvalidRequestError, match="prompt 0 is empty"):
        engine.add_request([], params)
    with pytest.raises(InvalidRequestError, match="max_new_tokens must be >= 1"):
        SamplingParams(max_new_tokens=0)
    engine.add_request([5], params, request_id="a")
    with pytest.raises(InvalidRequestError, match="request id 'a' is already in use"):
        engine.add_request([6], params, request_id="a")
    with pytest.raises(MiniInferError, match="generate needs an idle engine"):
        engine.generate([[7]], params)
    assert engine.abort("a") and not engine.abort("a") and not engine.abort("nobody")
    assert_all_blocks_free(engine)


def test_abort_waiting_and_running_requests_frees_their_blocks(tiny):
    engine = make_engine("continuous", tiny, max_num_batched_tokens=8, block_size=4,
                         num_blocks=16)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    for rid in range(3):
        engine.add_request(list(range(10, 30)), params, request_id=rid)
    engine.step()  # request 0 has its first chunk in the cache, 1 and 2 wait
    assert [r.request_id for r in engine.scheduler.running] == [0]
    assert engine.abort(0) and engine.abort(2)
    finished, _ = run_to_end(engine)
    assert list(finished) == [1] and len(finished[1].output_ids) == 20
    assert_all_blocks_free(engine)


def test_unchunked_prompt_over_budget_runs_alone(tiny):
    engine = make_engine("continuous", tiny, max_num_batched_tokens=8, chunked_prefill=False)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    engine.add_request([5, 6], params, request_id="short")
    engine.add_request(list(range(10, 30)), params, request_id="long")
    first = engine.step()
    assert first.num_prefill_tokens == 2  # the long prompt does not fit next to it
    finished, steps = run_to_end(engine)
    assert {s.num_prefill_tokens for s in steps} >= {20}  # whole, alone, over the budget
    ref = make_engine("naive", tiny).generate([list(range(10, 30))], params).token_ids[0]
    assert finished["long"].output_ids == ref


def test_a_failed_step_drops_nothing(tiny, monkeypatch):
    engine = make_engine("continuous", tiny, max_num_batched_tokens=16)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    prompts = [list(range(10, 40)), [5, 6, 7]]
    for rid, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=rid)
    engine.step()

    def boom(*args, **kwargs):
        raise RuntimeError("device lost")

    with monkeypatch.context() as patch:
        patch.setattr(engine.runner, "forward", boom)
        with pytest.raises(RuntimeError, match="device lost"):
            engine.step()
    manager = engine.kv_cache.block_manager
    assert manager.num_free_blocks == manager.num_blocks  # both back to waiting, recomputed
    finished, _ = run_to_end(engine)
    naive = make_engine("naive", tiny)
    assert [finished[i].output_ids for i in range(2)] == \
        [naive.generate([p], params).token_ids[0] for p in prompts]


def test_stress_random_arrivals_aborts_and_a_small_pool(tiny):
    """Many random requests, random arrival steps, random aborts, random budgets and a pool far
    smaller than the load: every request that was not aborted matches the naive engine on its
    prompt alone, and at the end every block is free."""
    rng = random.Random(0)
    naive = make_engine("naive", tiny)
    engine = make_engine("continuous", tiny, max_num_batched_tokens=rng.choice([7, 16, 33]),
                         block_size=4, num_blocks=24, max_num_seqs=6)
    requests = {}
    for rid in range(40):
        prompt = [rng.randrange(17, 49152) for _ in range(rng.randint(1, 40))]
        requests[rid] = (prompt, SamplingParams(max_new_tokens=rng.randint(1, 16),
                                                ignore_eos=True))
    arrival = {rid: rng.randrange(0, 60) for rid in requests}
    to_abort = {rid: arrival[rid] + rng.randrange(0, 10) for rid in rng.sample(range(40), 8)}
    finished, aborted = drive_requests(engine, requests, arrival, to_abort, min_steps=60)
    assert set(finished) | aborted == set(requests) and not set(finished) & aborted
    preemptions = sum(r.num_preemptions for r in finished.values())
    assert preemptions > 0 and aborted
    assert_each_equals_naive(finished, requests, naive)
    assert_all_blocks_free(engine)


def test_decodes_and_chunks_use_their_own_kernels(tiny, monkeypatch):
    engine = make_engine("continuous", tiny, max_num_batched_tokens=12)
    calls = []
    backend = engine.runner.backend

    def spy(kind, fn):
        def wrapped(q, *args, **kwargs):
            calls.append((kind, q.shape[0]))
            return fn(q, *args, **kwargs)
        return wrapped

    spied = type(backend)(backend.name, spy("decode", backend.decode),
                          spy("varlen", backend.varlen))
    monkeypatch.setattr(engine.runner.attention, "backend", spied)
    monkeypatch.setattr(engine.runner.attention, "prefill_backend", spied)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    engine.add_request([5, 6, 7], params)
    engine.step()  # prefill of 3 tokens
    engine.add_request(list(range(10, 30)), params)
    calls.clear()
    engine.step()  # 1 decode + an 11-token chunk
    layers = tiny.config.num_hidden_layers
    assert calls == [("decode", 1), ("varlen", 11)] * layers


class StubRunner:
    """A runner that runs no model: its logits make each request's next token its own count of
    tokens so far (prompt + output), so the expected output is known without any forward. It
    keeps the real pool's block bookkeeping, which the scheduler needs."""

    def __init__(self, kv_cache, vocab: int) -> None:
        self.kv_cache = kv_cache
        self.vocab = vocab
        self.steps: list[list[tuple]] = []  # per step: (request id, tokens fed)

    def paged_attention(self):
        import contextlib

        return contextlib.nullcontext()

    def execute(self, plan):
        import dataclasses

        import torch

        # Plain data only: ids, token ids, positions, block ids; no live request.
        for part in plan.requests:
            assert all(isinstance(getattr(part, f.name), int | list | str)
                       for f in dataclasses.fields(part)), part
        self.steps.append([(r.request_id, len(r.token_ids)) for r in plan.requests])
        rows = [i for i, r in enumerate(plan.requests) if r.num_scored]
        logits = torch.zeros(len(rows), self.vocab)
        for j, i in enumerate(rows):
            logits[j, plan.requests[i].end % self.vocab] = 1.0
        return logits, rows


def test_continuous_engine_loops_over_any_runner(tiny):
    """The engine loops, the scheduler decides, the runner runs: on a stub runner the engine
    produces the stub's tokens, with chapter 08's policy (a chunked prompt, then decodes)."""
    from miniinfer.runner import ModelRunner

    real = ModelRunner(tiny)
    stub = StubRunner(real.kv_cache, tiny.config.vocab_size)
    engine = ContinuousEngine(tiny, max_num_batched_tokens=8, runner=stub)
    assert engine.runner is stub and engine.kv_cache is real.kv_cache
    rid = engine.add_request(list(range(1, 13)), SamplingParams(max_new_tokens=3,
                                                                ignore_eos=True))
    finished, _ = run_to_end(engine)
    request = finished[rid]
    assert request.output_ids == [12, 13, 14]  # the count of tokens before each new one
    assert request.finish_reason is FinishReason.LENGTH
    # A 12-token prompt under a budget of 8: chunks of 8 and 4, then one token per step (the
    # third output token is sampled from the step that fed the second).
    assert stub.steps == [[(rid, 8)], [(rid, 4)], [(rid, 1)], [(rid, 1)]]
    assert_all_blocks_free(engine)
    # The same engine class on the real runner serves the real model.
    assert make_engine("continuous", tiny).runner.forward_name == "direct"


def test_bools_are_refused_as_token_ids_and_as_sizes(tiny):
    """``True`` is an int to Python (``operator.index(True) == 1``), never a token id or a size."""
    from miniinfer.core.errors import InvalidRequestError
    from miniinfer.core.scheduler import SchedulerConfig

    engine = make_engine("continuous", tiny)
    with pytest.raises(InvalidRequestError, match="integer token ids"):
        engine.add_request([5, True, 7])
    assert not engine.has_unfinished_requests()
    assert engine.add_request([5, 6, 7]) is not None  # ints still are
    with pytest.raises(InvalidRequestError, match=r"max_num_seqs must be an integer >= 1, got True"):
        SchedulerConfig(max_num_seqs=True)


def test_a_batch_is_stamped_when_every_request_has_its_kth_token(tiny, monkeypatch):
    """``generate``'s stamps, which the offline benchmark reads as the time to first token and
    the decode steps: four prompts of 12 tokens under a budget of 16 prefill over three steps,
    and the first stamp is the step that gave the last of them its first token (a static
    batch's and vLLM's meaning), not the first step that gave anyone one."""
    engine = make_engine("continuous", tiny, max_num_batched_tokens=16)
    steps = []

    def step(original=engine.step):
        steps.append(original())
        return steps[-1]

    monkeypatch.setattr(engine, "step", step)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    result = engine.generate([list(range(20 + 12 * i, 32 + 12 * i)) for i in range(4)], params)
    seen, all_started = set(), None
    for s in steps:
        seen.update(r.request_id for r in s.outputs)
        if len(seen) == 4 and all_started is None:
            all_started = s
    emitting = [s for s in steps if s.outputs]
    assert emitting[0] is not all_started and len(emitting) > 4  # the prefill was staggered
    assert result.token_times[0] == all_started.end
    assert len(result.token_times) == 4 and result.token_times[-1] == steps[-1].end
