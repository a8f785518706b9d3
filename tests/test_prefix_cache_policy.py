"""Chapter 09's block manager and scheduler on their own: which block a request gets, which
cached block is evicted, and what a lookup still finds after. The engine's tests check that a
hit never changes the tokens (a wrong eviction only costs a recomputation there); these check
the policy itself."""

from __future__ import annotations

import pytest
from conftest import scheduler_step

from miniinfer import InvalidRequestError, KVCacheFull, SamplingParams
from miniinfer.core.prefix_cache import (
    ROOT_HASH,
    PrefixCacheBlockManager,
    PrefixCacheScheduler,
    PrefixHit,
    hash_block,
)
from miniinfer.core.scheduler import FinishReason, Request, RequestTimeline, SchedulerConfig

NO_HIT = PrefixHit([], [])


def start(manager: PrefixCacheBlockManager, request_id: str, tokens: list[int]) -> list[int]:
    """A request that computed ``tokens`` (all of them hashed where full); its blocks."""
    manager.add_with_prefix(request_id, manager.lookup(tokens + [0]), 0)
    hit = len(manager.block_tables[request_id]) * manager.block_size
    manager.append(request_id, len(tokens) - hit)
    manager.cache_full_blocks(request_id, len(tokens), lambda a, b: tokens[a:b])
    return manager.block_tables[request_id]


def cached_run(manager: PrefixCacheBlockManager, tokens: list[int]) -> list[int]:
    """The blocks a new prompt beginning with ``tokens`` would start on."""
    return manager.lookup(tokens + [0]).blocks


def test_a_request_releases_its_last_block_first():
    # A 3-block prompt released: its blocks go to the evictable list tail first, so the first
    # block, the one other prompts share, is the last to be evicted.
    manager = PrefixCacheBlockManager(num_blocks=4, block_size=2)
    prompt = [10, 11, 12, 13, 14, 15]
    assert start(manager, "a", prompt) == [0, 1, 2]
    manager.free("a")
    assert list(manager.evictable) == [2, 1, 0] and list(manager.free_list) == [3]
    # Two new blocks: the free one, then the least recently released cached one, a's tail.
    assert start(manager, "b", [20, 21, 22, 23]) == [3, 2]
    assert cached_run(manager, prompt) == [0, 1]
    manager.add("c", 2)
    assert manager.block_tables["c"] == [1]
    assert cached_run(manager, prompt) == [0] and manager.num_cached_blocks == 1


def test_the_least_recently_released_block_is_evicted():
    manager = PrefixCacheBlockManager(num_blocks=2, block_size=2)
    first, second = [10, 11], [20, 21]
    assert start(manager, "a", first) == [0]
    assert start(manager, "b", second) == [1]
    manager.free("a")
    manager.free("b")
    assert list(manager.evictable) == [0, 1]
    manager.add("c", 1)  # a's block, released before b's
    assert manager.block_tables["c"] == [0]
    assert cached_run(manager, first) == [] and cached_run(manager, second) == [1]


def test_a_hit_makes_a_cached_block_recently_used_again():
    manager = PrefixCacheBlockManager(num_blocks=3, block_size=2)
    first, second = [10, 11], [20, 21]
    start(manager, "a", first)
    start(manager, "b", second)
    manager.free("a")
    manager.free("b")
    # A new request on a's prefix takes a's block off the evictable list...
    assert start(manager, "a2", first + [12]) == [0, 2]
    assert list(manager.evictable) == [1] and manager.ref_counts[0] == 1
    assert manager.num_free_blocks == 1
    manager.free("a2")
    # ... and hands it back after b's: b's is evicted first now.
    assert list(manager.evictable) == [1, 0] and list(manager.free_list) == [2]
    manager.add("c", 4)
    assert manager.block_tables["c"] == [2, 1]
    assert cached_run(manager, first) == [0] and cached_run(manager, second) == []


def test_a_shared_block_is_freed_only_by_its_last_holder():
    manager = PrefixCacheBlockManager(num_blocks=4, block_size=2)
    prompt = [10, 11, 12, 13]
    start(manager, "a", prompt)
    assert start(manager, "b", prompt + [14]) == [0, 1, 2]
    assert manager.ref_counts[:3] == [2, 2, 1]
    manager.free("a")
    assert manager.ref_counts[:3] == [1, 1, 1] and not manager.evictable
    assert manager.num_free_blocks == 1  # only block 3: a's blocks are still b's
    manager.free("b")
    # b's third block holds one token, so it has no hash: free, not cached.
    assert list(manager.evictable) == [1, 0] and list(manager.free_list) == [3, 2]
    assert manager.num_free_blocks == 4 and manager.num_cached_blocks == 2
    assert manager.chains == {} and manager.block_tables == {}


def test_lookup_stops_at_the_first_miss_and_never_takes_the_last_token():
    manager = PrefixCacheBlockManager(num_blocks=8, block_size=2)
    prompt = [10, 11, 12, 13, 14, 15]
    start(manager, "a", prompt)
    assert manager.lookup(prompt).blocks == [0, 1]  # the last block's logits are needed
    assert manager.lookup(prompt + [16]).blocks == [0, 1, 2]
    assert manager.lookup([10, 11, 99, 13, 14, 15, 16]).blocks == [0]
    assert manager.lookup([99, 11, 12, 13]).blocks == []
    # The chain makes position part of the name: a's second block after another beginning.
    assert manager.lookup([98, 99, 12, 13, 0]).blocks == []
    hit = manager.lookup(prompt + [16])
    assert hit.hashes[0] == hash_block(ROOT_HASH, [10, 11])
    assert hit.hashes[1] == hash_block(hit.hashes[0], [12, 13])


def test_a_block_s_name_is_its_tokens_and_everything_before_them():
    first = hash_block(ROOT_HASH, [10, 11])
    assert len(first) == 16  # 128 bits
    assert hash_block(ROOT_HASH, [10, 11]) == first
    assert hash_block(ROOT_HASH, [10, 12]) != first
    # The same tokens after a different beginning are a different block.
    assert hash_block(first, [12, 13]) != hash_block(ROOT_HASH, [12, 13])
    assert hash_block(first, [12, 13]) != hash_block(hash_block(ROOT_HASH, [9, 11]), [12, 13])


def test_a_duplicate_block_stays_unhashed_and_goes_back_free():
    manager = PrefixCacheBlockManager(num_blocks=4, block_size=2)
    # Both computed the same block before either was hashed: the first keeps the name.
    manager.add_with_prefix("a", NO_HIT, 2)
    manager.add_with_prefix("b", NO_HIT, 2)
    for rid in ("a", "b"):
        manager.cache_full_blocks(rid, 2, lambda a, b: [10, 11][a:b])
    assert manager.cached == {hash_block(ROOT_HASH, [10, 11]): 0}
    manager.free("b")
    assert list(manager.free_list) == [2, 3, 1] and not manager.evictable


def test_add_with_prefix_counts_revived_blocks_and_changes_nothing_when_full():
    manager = PrefixCacheBlockManager(num_blocks=3, block_size=2)
    prompt = [10, 11, 12, 13]
    start(manager, "a", prompt)
    manager.free("a")  # 2 cached blocks, 1 free: 3 blocks count as free
    assert manager.num_free_blocks == 3
    hit = manager.lookup(prompt + [14])
    # The hit revives both cached blocks; only the truly free one is left for new tokens.
    with pytest.raises(KVCacheFull, match="needs 2 more KV block.* only 1 of 3"):
        manager.add_with_prefix("b", hit, 3)
    assert "b" not in manager and list(manager.evictable) == [1, 0]
    assert manager.ref_counts == [0, 0, 0]
    manager.add_with_prefix("b", hit, 2)
    assert manager.block_tables["b"] == [0, 1, 2] and manager.num_free_blocks == 0
    with pytest.raises(InvalidRequestError, match="already holds"):
        manager.add_with_prefix("b", hit, 1)


def test_evict_all_forgets_only_what_nobody_holds():
    manager = PrefixCacheBlockManager(num_blocks=4, block_size=2)
    start(manager, "a", [10, 11])
    start(manager, "b", [20, 21])
    manager.free("a")
    manager.evict_all()
    assert cached_run(manager, [10, 11]) == [] and cached_run(manager, [20, 21]) == [1]
    assert manager.num_cached_blocks == 0 and sorted(manager.free_list) == [0, 2, 3]


def make_scheduler(num_blocks: int, budget: int = 64) -> PrefixCacheScheduler:
    return PrefixCacheScheduler(SchedulerConfig(max_num_batched_tokens=budget),
                                PrefixCacheBlockManager(num_blocks, block_size=2))


def add(scheduler: PrefixCacheScheduler, name: str, prompt: list[int],
        max_new_tokens: int = 2) -> Request:
    request = Request(name, prompt, SamplingParams(max_new_tokens=max_new_tokens,
                                                   ignore_eos=True), RequestTimeline(0.0))
    scheduler.add(request)
    return request


def step(scheduler: PrefixCacheScheduler) -> list[tuple[str, int]]:
    """One step with token 0 as every sample: (request id, tokens fed) of what ran."""
    return scheduler_step(scheduler)[0]


def test_admission_starts_after_the_cached_prefix():
    scheduler = make_scheduler(num_blocks=8)
    prompt = [10, 11, 12, 13, 14]
    a = add(scheduler, "a", prompt)
    assert step(scheduler) == [("a", 5)]
    a_blocks = list(scheduler.block_manager.block_tables["a"])
    # Blocks are hashed before the step's admissions: b, arriving while a runs, hits both.
    b = add(scheduler, "b", prompt[:4] + [99, 98])
    assert step(scheduler) == [("a", 1), ("b", 2)]
    assert b.num_cached_tokens == 4 and b.num_computed_tokens == 6
    assert scheduler.block_manager.block_tables["b"][:2] == a_blocks[:2]
    assert a.finished
    # A prompt cached whole recomputes its last block, for the logits of its last token.
    c = add(scheduler, "c", prompt[:4])
    assert step(scheduler) == [("b", 1), ("c", 2)]
    assert c.num_cached_tokens == 2
    # a's third block (its last prompt token and its first output) was hashed as it finished.
    d = add(scheduler, "d", prompt + [0, 7])
    assert step(scheduler)[-1] == ("d", 1) and d.num_cached_tokens == 6


def test_a_cache_hit_that_does_not_fit_the_pool_waits_with_nothing_computed():
    scheduler = make_scheduler(num_blocks=4)
    prompt = [10, 11, 12, 13, 14]
    add(scheduler, "a", prompt, max_new_tokens=1)
    assert step(scheduler) == [("a", 5)]  # finished: 2 cached blocks, 2 free
    add(scheduler, "hog", [50, 51, 52], max_new_tokens=4)
    assert step(scheduler) == [("hog", 3)]  # takes the 2 free blocks
    # b hits a's 2 blocks and needs 2 more for its other 3 tokens: the only blocks left to
    # take are the 2 it hits, so it cannot start.
    b = add(scheduler, "b", prompt[:4] + [20, 21, 22])
    assert step(scheduler) == [("hog", 1)]
    assert list(scheduler.waiting) == [b] and "b" not in scheduler.block_manager
    assert b.num_computed_tokens == 0 and b.timeline.first_scheduled is None
    assert scheduler.block_manager.num_cached_blocks == 2  # a's blocks: not taken, not lost


def test_a_preempted_request_finds_its_first_block_again():
    # 4 blocks of 2: a and b (4 tokens each) fill the pool. a's first decode needs a block:
    # b, the newest, is preempted; its full blocks are hashed as it lets go, tail first, so
    # the block a takes is b's second one and b's first is still cached when b comes back.
    scheduler = make_scheduler(num_blocks=4)
    a = add(scheduler, "a", [10, 11, 12, 13])
    b = add(scheduler, "b", [20, 21, 22, 23], max_new_tokens=3)
    assert step(scheduler) == [("a", 4), ("b", 4)]
    b_blocks = list(scheduler.block_manager.block_tables["b"])
    batch = scheduler.schedule()
    assert [(r.request_id, n) for r, n in batch.scheduled] == [("a", 1)]
    assert batch.preempted == [b] and b.num_preemptions == 1
    assert scheduler.block_manager.block_tables["a"][2] == b_blocks[1]
    assert list(scheduler.block_manager.evictable) == [b_blocks[0]]
    a.num_computed_tokens += 1
    scheduler.finish(a, FinishReason.LENGTH, 0.0)
    # b's prompt and its one token: the first block is a hit, 3 tokens are recomputed. A
    # re-admission is not counted as a prompt cache hit (it was b's own block).
    assert step(scheduler) == [("b", 3)]
    assert scheduler.block_manager.block_tables["b"][0] == b_blocks[0]
    assert b.num_cached_tokens == 0


def test_truncated_blocks_leave_the_chain_and_keep_their_hashes():
    manager = PrefixCacheBlockManager(num_blocks=6, block_size=2)
    tokens = [10, 11, 12, 13, 14, 15]
    blocks = list(start(manager, "a", tokens))  # 3 full blocks, hashed
    chain = list(manager.chains["a"])
    assert len(chain) == 3
    assert manager.truncate("a", 3) == blocks[2:]  # 3 tokens left: blocks 0 and 1
    assert manager.chains["a"] == chain[:1]  # block 1 is no longer full
    # The freed block keeps its hash (its K/V is still those tokens'): evictable, not free.
    assert manager.num_cached_blocks == 1 and blocks[2] in manager.evictable


def test_the_scheduler_hashes_only_committed_tokens():
    """A speculative step computes draft tokens past the request's own (prompt and output):
    their blocks are full and computed, but never hashed until the tokens are verified."""
    scheduler = make_scheduler(num_blocks=8)
    request = add(scheduler, "a", [10, 11, 12], max_new_tokens=8)
    assert step(scheduler) == [("a", 3)]  # 3 computed, output [0]: 4 committed tokens
    manager = scheduler.block_manager
    manager.append("a", 4)  # a step fed its last token and 3 drafts: 7 computed
    request.num_computed_tokens = 7
    scheduler._cache_full_blocks(request)  # what every step does before its admissions
    assert len(manager.chains["a"]) == 2  # tokens 0-3, not the drafts' block (4-5)
    assert len(manager.cached) == 2
