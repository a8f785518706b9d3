"""Chapter 08's scheduler on its own, on tiny pools: who is scheduled, who is preempted, and what
runs after. The engine's tests check that preemption never changes a request's tokens
(recomputation hides the policy); these check the policy: the newest running request gives its
blocks up, the oldest keeps going, and the preempted request comes back as one prefill of its
prompt and the tokens it had generated."""

from __future__ import annotations

from miniinfer import SamplingParams
from miniinfer.core.kv_cache import BlockManager
from miniinfer.core.scheduler import (
    FinishReason,
    Request,
    RequestTimeline,
    Scheduler,
    SchedulerConfig,
)


def make_scheduler(num_blocks: int, block_size: int = 2) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64),
                     BlockManager(num_blocks, block_size))


def add(scheduler: Scheduler, name: str, prompt_len: int, max_new_tokens: int) -> Request:
    request = Request(name, list(range(10, 10 + prompt_len)),
                      SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
                      RequestTimeline(0.0))
    scheduler.add(request)
    return request


def step(scheduler: Scheduler) -> tuple[list[tuple[str, int]], list[str]]:
    """One step as the engine runs it, with token 0 as every sample: returns (request id, tokens
    fed) of what was scheduled and the ids preempted."""
    batch = scheduler.schedule()
    for request, n in batch.scheduled:
        request.num_computed_tokens += n
        if request.num_computed_tokens == request.num_tokens:
            request.output_ids.append(0)
            if len(request.output_ids) >= request.params.max_new_tokens:
                scheduler.finish(request, FinishReason.LENGTH, 0.0)
    return ([(r.request_id, n) for r, n in batch.scheduled],
            [r.request_id for r in batch.preempted])


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
