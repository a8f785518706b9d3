"""Chapter 08's scheduler on its own, on tiny pools: who is scheduled, who is preempted, and what
runs after. The engine's tests check that preemption never changes a request's tokens
(recomputation hides the policy); these check the policy: the newest running request gives its
blocks up, the oldest keeps going, and the preempted request comes back as one prefill of its
prompt and the tokens it had generated."""

from __future__ import annotations

import pytest
from conftest import scheduler_step

from miniinfer import SamplingParams
from miniinfer.core.kv_cache import BlockManager
from miniinfer.core.scheduler import (
    FinishReason,
    Request,
    RequestTimeline,
    ScheduledBatch,
    Scheduler,
    SchedulerConfig,
)


def make_scheduler(num_blocks: int, block_size: int = 2, **config: int | bool) -> Scheduler:
    return Scheduler(SchedulerConfig(**{"max_num_batched_tokens": 64, **config}),
                     BlockManager(num_blocks, block_size))


def add(scheduler: Scheduler, name: str, prompt_len: int, max_new_tokens: int) -> Request:
    request = Request(name, list(range(10, 10 + prompt_len)),
                      SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
                      RequestTimeline(0.0))
    scheduler.add(request)
    return request


def step(scheduler: Scheduler) -> tuple[list[tuple[str, int]], list[str]]:
    """One step as the engine runs it (conftest's ``scheduler_step``)."""
    return scheduler_step(scheduler)


def test_the_newest_request_is_preempted_and_recomputed_after():
    # 4 blocks of 2 tokens; two 4-token prompts fill the pool.
    scheduler = make_scheduler(num_blocks=4)
    a = add(scheduler, "a", prompt_len=4, max_new_tokens=3)
    b = add(scheduler, "b", prompt_len=4, max_new_tokens=3)
    assert step(scheduler) == ([("a", 4), ("b", 4)], [])
    # a's first output token needs a fifth slot, a new block: b, the newest, gives its two up.
    assert step(scheduler) == ([("a", 1)], ["b"])
    assert b.num_preemptions == 1 and b.num_computed_tokens == 0 and b.output_ids == [0]
    assert list(scheduler.waiting) == [b] and scheduler.running == [a]
    assert a.num_preemptions == 0
    # b needs 3 blocks for its prompt and its token, only one is free: a decodes alone.
    assert step(scheduler) == ([("a", 1)], [])
    assert a.finished and scheduler.block_manager.num_free_blocks == 4
    # b comes back: its prompt and its one output token, recomputed as one prefill.
    assert step(scheduler) == ([("b", 5)], [])
    assert b.output_ids == [0, 0]
    assert step(scheduler) == ([("b", 1)], [])
    assert b.finished and not scheduler.num_unfinished


def test_preemption_takes_from_the_newest_end_and_keeps_arrival_order():
    # 3 blocks of 2 tokens, three 2-token prompts: after the prefill every request needs a
    # new block for its next token. c (newest) is preempted for a; then b would need one too
    # and is the newest left, so it gives its own block up rather than take a's.
    scheduler = make_scheduler(num_blocks=3)
    a, b, c = (add(scheduler, name, prompt_len=2, max_new_tokens=4) for name in "abc")
    assert step(scheduler) == ([("a", 2), ("b", 2), ("c", 2)], [])
    assert step(scheduler) == ([("a", 1)], ["c", "b"])
    assert scheduler.running == [a] and list(scheduler.waiting) == [b, c]  # oldest first
    assert (a.num_preemptions, b.num_preemptions, c.num_preemptions) == (0, 1, 1)


def test_a_step_that_preempts_admits_nobody():
    # 2 blocks of 2 tokens, a budget of 3. a (1 token) and b (2 tokens) fill a block each; at
    # b's first decode it needs a new block and none is free, so it gives its own up. The
    # block it freed and the budget left would take a 2-token chunk of its recomputation, but
    # a step that had to preempt admits no one: b would only be preempted again next step.
    scheduler = make_scheduler(num_blocks=2, max_num_batched_tokens=3)
    a = add(scheduler, "a", prompt_len=1, max_new_tokens=3)
    b = add(scheduler, "b", prompt_len=2, max_new_tokens=3)
    assert step(scheduler) == ([("a", 1), ("b", 2)], [])
    assert step(scheduler) == ([("a", 1)], ["b"])
    assert scheduler.running == [a] and list(scheduler.waiting) == [b]
    assert b.num_computed_tokens == 0 and "b" not in scheduler.block_manager
    assert scheduler.block_manager.num_free_blocks == 1
    # Next step a finishes and b runs again: its prompt and its token, recomputed in one go.
    assert step(scheduler) == ([("a", 1)], [])
    assert a.finished
    assert step(scheduler) == ([("b", 3)], [])
    assert b.num_preemptions == 1


def test_max_num_seqs_caps_the_running_requests():
    scheduler = make_scheduler(num_blocks=16, max_num_seqs=2)
    a, b, c = (add(scheduler, name, prompt_len=2, max_new_tokens=2) for name in "abc")
    assert step(scheduler) == ([("a", 2), ("b", 2)], [])
    assert scheduler.running == [a, b] and list(scheduler.waiting) == [c]
    assert "c" not in scheduler.block_manager  # a waiting request holds no blocks
    # Budget and blocks are there for c, the cap is not: it starts only when a and b are done.
    assert step(scheduler) == ([("a", 1), ("b", 1)], [])
    assert a.finished and b.finished
    assert step(scheduler) == ([("c", 2)], [])


def test_unchunked_prompts_that_fill_the_budget_exactly_run_together():
    scheduler = make_scheduler(num_blocks=16, max_num_batched_tokens=8, chunked_prefill=False)
    a, b, c = (add(scheduler, name, prompt_len=n, max_new_tokens=2)
               for name, n in (("a", 4), ("b", 4), ("c", 1)))
    # b's 4 tokens are exactly what a left of the budget; c waits for the next step.
    assert step(scheduler) == ([("a", 4), ("b", 4)], [])
    assert list(scheduler.waiting) == [c]
    assert step(scheduler) == ([("a", 1), ("b", 1), ("c", 1)], [])


def test_chunked_prefill_cuts_a_prompt_at_the_budget_and_decodes_go_first():
    scheduler = make_scheduler(num_blocks=16, max_num_batched_tokens=5)
    a = add(scheduler, "a", prompt_len=3, max_new_tokens=3)
    b = add(scheduler, "b", prompt_len=7, max_new_tokens=2)
    assert step(scheduler) == ([("a", 3), ("b", 2)], [])  # b gets what a left
    assert b.num_computed_tokens == 2 and not b.output_ids
    # a's decode first (the decode kernel's rows), then the next chunk of b.
    assert step(scheduler) == ([("a", 1), ("b", 4)], [])
    assert step(scheduler) == ([("a", 1), ("b", 1)], [])  # b's last prompt token
    assert b.output_ids == [0] and a.finished
    assert step(scheduler) == ([("b", 1)], [])
    assert b.finished and not scheduler.num_unfinished
    assert scheduler.block_manager.num_free_blocks == 16


def test_a_prompt_over_the_budget_is_chunked_even_alone():
    scheduler = make_scheduler(num_blocks=16, max_num_batched_tokens=5)
    a = add(scheduler, "a", prompt_len=7, max_new_tokens=1)
    assert step(scheduler) == ([("a", 5)], [])
    assert a.num_computed_tokens == 5 and not a.output_ids
    assert step(scheduler) == ([("a", 2)], [])
    assert a.finished and a.finish_reason is FinishReason.LENGTH


def test_unchunked_prompt_over_what_is_left_waits_for_a_step_of_its_own():
    scheduler = make_scheduler(num_blocks=16, max_num_batched_tokens=8, chunked_prefill=False)
    a = add(scheduler, "a", prompt_len=4, max_new_tokens=2)
    b = add(scheduler, "b", prompt_len=6, max_new_tokens=1)
    assert step(scheduler) == ([("a", 4)], [])  # b needs 6 of the 4 left: it waits whole
    assert "b" not in scheduler.block_manager and b.num_computed_tokens == 0
    assert step(scheduler) == ([("a", 1), ("b", 6)], [])  # a's decode leaves 7
    assert a.finished and b.finished


def test_one_token_rows_go_first_where_the_decode_kernel_takes_them():
    scheduler = make_scheduler(num_blocks=16, max_num_batched_tokens=4)
    a = add(scheduler, "a", prompt_len=10, max_new_tokens=2)
    b = add(scheduler, "b", prompt_len=1, max_new_tokens=2)
    assert step(scheduler) == ([("a", 4)], [])
    assert step(scheduler) == ([("a", 4)], [])
    # a's last chunk and b's one-token prompt, admitted after it: b's row goes first.
    assert step(scheduler) == ([("b", 1), ("a", 2)], [])
    assert step(scheduler) == ([("a", 1), ("b", 1)], [])
    assert a.finished and b.finished


def test_the_last_token_of_the_budget_is_spent():
    # A budget of 2: two one-token prompts, then their two decodes, each step exactly full.
    scheduler = make_scheduler(num_blocks=16, max_num_batched_tokens=2)
    a = add(scheduler, "a", prompt_len=1, max_new_tokens=2)
    b = add(scheduler, "b", prompt_len=1, max_new_tokens=2)
    assert step(scheduler) == ([("a", 1), ("b", 1)], [])
    assert step(scheduler) == ([("a", 1), ("b", 1)], [])
    assert a.finished and b.finished


def test_finish_and_abort_record_why_and_when_and_free_the_blocks():
    scheduler = make_scheduler(num_blocks=8)
    a = add(scheduler, "a", prompt_len=3, max_new_tokens=5)
    b = add(scheduler, "b", prompt_len=3, max_new_tokens=5)
    assert scheduler.num_unfinished == 2
    step(scheduler)
    c = add(scheduler, "c", prompt_len=3, max_new_tokens=5)
    assert (len(scheduler.running), len(scheduler.waiting), scheduler.num_unfinished) == (2, 1, 3)
    scheduler.finish(a, FinishReason.EOS, 7.0)
    scheduler.finish(c, FinishReason.ABORT, 8.0)  # a waiting request: it held no blocks
    assert a.num_cached_tokens == 0  # no prefix cache here (chapter 09 sets it)
    assert (a.finish_reason, a.timeline.finish, a.finished) == (FinishReason.EOS, 7.0, True)
    assert (c.finish_reason, c.timeline.finish, c.finished) == (FinishReason.ABORT, 8.0, True)
    assert scheduler.running == [b] and not scheduler.waiting and scheduler.num_unfinished == 1
    assert "a" not in scheduler.block_manager and scheduler.block_manager.num_free_blocks == 6


def test_first_scheduled_is_the_first_admission_not_a_readmission():
    scheduler = make_scheduler(num_blocks=4)
    add(scheduler, "a", prompt_len=4, max_new_tokens=3)
    b = add(scheduler, "b", prompt_len=4, max_new_tokens=3)
    assert b.timeline.first_scheduled is None
    step(scheduler)
    first = b.timeline.first_scheduled
    assert first is not None and first > 0
    assert step(scheduler)[1] == ["b"]
    while not b.finished:
        step(scheduler)
    assert b.num_preemptions == 1 and b.timeline.first_scheduled == first


def test_config_defaults_are_the_engine_s_and_bad_values_are_refused():
    import dataclasses

    from miniinfer import InvalidRequestError
    from miniinfer.engines import EngineConfig

    engine_defaults = dataclasses.asdict(EngineConfig())
    assert EngineConfig().scheduler == SchedulerConfig()
    config = SchedulerConfig()
    for name in ("max_num_batched_tokens", "max_num_seqs", "chunked_prefill"):
        assert getattr(config, name) == engine_defaults[name], name
    assert SchedulerConfig(max_num_batched_tokens=1, max_num_seqs=1).max_num_seqs == 1
    for bad in (0, -1, 2.5, "8"):
        with pytest.raises(InvalidRequestError, match="must be an integer >= 1"):
            SchedulerConfig(max_num_seqs=bad)
        with pytest.raises(InvalidRequestError, match="must be an integer >= 1"):
            SchedulerConfig(max_num_batched_tokens=bad)


def test_token_ids_read_the_prompt_then_the_output():
    request = Request("r", [1, 2, 3], SamplingParams(), RequestTimeline(0.0), output_ids=[4, 5])
    tokens = [1, 2, 3, 4, 5]
    assert request.num_tokens == 5
    for start in range(6):
        for end in range(start, 6):
            assert request.token_ids(start, end) == tokens[start:end], (start, end)


def test_a_batch_counts_its_decodes_and_tokens_and_a_timeline_its_first_token():
    a, b, c = (Request(name, [1], SamplingParams(), RequestTimeline(0.0)) for name in "abc")
    batch = ScheduledBatch([(a, 1), (b, 5), (c, 1)], [])
    assert (batch.num_decodes, batch.num_tokens) == (2, 7)
    timeline = RequestTimeline(1.0)
    assert timeline.first_token is None
    timeline.token_times += [2.5, 3.0]
    assert timeline.first_token == 2.5


def test_a_batch_scores_each_requests_last_token_unless_told_how_many():
    from miniinfer import InvalidRequestError

    a, b, c = (Request(name, [1, 2, 3, 4], SamplingParams(), RequestTimeline(0.0))
               for name in "abc")
    c.num_computed_tokens = 2
    # a: its whole prompt (scores its last position); b: a partial chunk (none); c: its last
    # two tokens, told to score both (a speculative step's k + 1 = 2 positions).
    batch = ScheduledBatch([(a, 4), (b, 2), (c, 2)], [], num_scored={"c": 2})
    assert [batch.scored(r, n) for r, n in batch.scheduled] == [1, 0, 2]
    with pytest.raises(InvalidRequestError, match="is fed 2 token.* cannot score 3"):
        ScheduledBatch([(c, 2)], [], num_scored={"c": 3}).scored(c, 2)
