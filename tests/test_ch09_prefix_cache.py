"""Chapter 09: prefix caching. Requests that share a prompt's beginning reuse its K/V, and every
request still gets, token for token, what HF generate (and chapter 08's engine) gives its prompt
alone: block-aligned prefixes, prompts cached whole, hits after eviction and after preemption,
many requests on one prefix at once. A state machine checks the cache's bookkeeping."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from template import assert_each_equals_naive, drive_requests, first_difference

from miniinfer import ENGINES, InvalidRequestError, SamplingParams, make_engine
from miniinfer.bench.serving import (
    ServingBenchConfig,
    WorkloadConfig,
    make_workload,
    run_serving_bench,
)
from miniinfer.book.chapters import chapter_of_stage
from miniinfer.core.errors import KVCacheFull
from miniinfer.core.prefix_cache import ROOT_HASH, PrefixCacheBlockManager, hash_block
from miniinfer.engines.prefix_cache import PrefixCacheEngine

NEW = 12
GREEDY = SamplingParams(max_new_tokens=NEW, ignore_eos=True)


def run_to_end(engine: PrefixCacheEngine, arrivals: dict[int, list[tuple]] | None = None,
               check=None) -> tuple[dict, list]:
    """Step until idle, adding ``arrivals[step]`` = [(prompt, params, request id)] on the way."""
    arrivals = arrivals or {}
    finished, steps = {}, []
    while engine.has_unfinished_requests() or any(s >= len(steps) for s in arrivals):
        for prompt, params, rid in arrivals.get(len(steps), []):
            engine.add_request(prompt, params, request_id=rid)
        steps.append(engine.step())
        assert steps[-1].num_decodes + steps[-1].num_prefill_tokens or \
            not engine.has_unfinished_requests(), "a step ran nothing: the engine is stuck"
        if check:
            check(engine.kv_cache.block_manager)
        finished.update((r.request_id, r) for r in steps[-1].outputs if r.finished)
    return finished, steps


def check_manager(manager: PrefixCacheBlockManager) -> None:
    """The cache's invariants, as the issue states them."""
    held: dict[int, int] = {}
    for table in manager.block_tables.values():
        for block in table:
            held[block] = held.get(block, 0) + 1
    assert all(c >= 0 for c in manager.ref_counts), "a negative ref count"
    assert held == {b: c for b, c in enumerate(manager.ref_counts) if c}, "ref counts are wrong"
    free, evictable = set(manager.free_list), set(manager.evictable)
    assert not (free | evictable) & set(held), "a block is both free and referenced"
    assert not free & evictable and len(free) + len(evictable) + len(held) == manager.num_blocks
    assert all(b in manager.contents for b in evictable), "an evictable block has no hash"
    for block_hash, block in manager.cached.items():
        content = manager.contents[block]
        assert content.block_hash == block_hash
        assert len(content.token_ids) == manager.block_size, "a partial block has a hash"
        assert hash_block(content.parent, content.token_ids) == block_hash


def assert_idle_cache(engine: PrefixCacheEngine) -> None:
    manager = engine.kv_cache.block_manager
    check_manager(manager)
    assert not manager.block_tables and manager.num_free_blocks == manager.num_blocks
    assert not any(manager.ref_counts)


def test_registered_after_continuous():
    names = list(ENGINES)
    assert names.index("prefix-cache") == names.index("continuous") + 1
    assert ENGINES["prefix-cache"] is PrefixCacheEngine and chapter_of_stage("prefix-cache") == "09"


# -- the real model: greedy tokens equal HF's -------------------------------------------------

@pytest.fixture(scope="module")
def shared_prompts(smollm2) -> dict[str, list[int]]:
    from conftest import LONG_TEXT, TEXTS

    long_ids = smollm2.tokenizer.encode(LONG_TEXT + " " + LONG_TEXT)
    questions = [smollm2.tokenizer.encode(" " + t) for t in TEXTS[:4]]
    prompts = {f"aligned{i}": long_ids[:32] + q for i, q in enumerate(questions)}  # 2 blocks
    prompts |= {f"unaligned{i}": long_ids[:37] + q for i, q in enumerate(questions[:2])}
    prompts |= {"whole32": long_ids[:32], "whole40": long_ids[:40], "other": long_ids[40:90]}
    return prompts


@pytest.fixture(scope="module")
def hf_alone(smollm2, shared_prompts) -> dict[str, list[int]]:
    hf = make_engine("hf", smollm2)
    return {name: hf.generate([p], GREEDY).token_ids[0] for name, p in shared_prompts.items()}


def assert_matches(finished: dict, hf_alone: dict) -> None:
    for rid, request in finished.items():
        name = rid.split("#")[0]
        assert request.output_ids == hf_alone[name], f"{rid} ({request.num_cached_tokens} " \
            f"cached tokens): " + first_difference(request.output_ids, hf_alone[name])


def test_shared_prefixes_match_hf(smollm2, shared_prompts, hf_alone):
    """Block-aligned and unaligned prefixes, prompts cached whole, and many requests on one
    prefix at once, against HF alone (and so chapter 08's engine, which equals it)."""
    engine = make_engine("prefix-cache", smollm2, max_num_batched_tokens=64)
    p = shared_prompts
    # The first request computes the prefix; two steps later four arrive at once and hit it.
    arrivals = {0: [(p["aligned0"], GREEDY, "aligned0")],
                2: [(p[n], GREEDY, n) for n in ("aligned1", "aligned2", "aligned3", "unaligned0")],
                3: [(p["unaligned1"], GREEDY, "unaligned1"), (p["whole32"], GREEDY, "whole32"),
                    (p["whole40"], GREEDY, "whole40")]}
    finished, _ = run_to_end(engine, arrivals, check_manager)
    assert_matches(finished, hf_alone)
    cached = {rid: r.num_cached_tokens for rid, r in finished.items()}
    assert cached["aligned0"] == 0
    assert all(cached[f"aligned{i}"] == 32 for i in (1, 2, 3)), cached
    assert cached["unaligned0"] == cached["unaligned1"] == 32  # the 33rd-37th: a partial block
    assert cached["whole32"] == 16  # cached whole: the last block is recomputed for its logits
    assert cached["whole40"] == 32
    # Again, now every prompt is in the cache: the last token is still computed.
    finished, _ = run_to_end(engine, {0: [(p[n], GREEDY, f"{n}#2") for n in p if n != "other"]},
                             check_manager)
    assert_matches(finished, hf_alone)
    assert all(r.num_cached_tokens == (len(r.prompt_ids) - 1) // 16 * 16
               for r in finished.values())
    assert_idle_cache(engine)


def test_hits_after_eviction_and_preemption_match_hf(smollm2, shared_prompts, hf_alone):
    """A pool of 5 blocks: the prompts evict each other's cached blocks, and running together
    they preempt each other; a re-admitted request may hit its own blocks."""
    p = shared_prompts
    engine = make_engine("prefix-cache", smollm2, max_num_batched_tokens=32, num_blocks=5)
    admissions = []
    admit = engine.scheduler._admit

    def spy(request, budget, alone):
        n = admit(request, budget, alone)
        if n:
            admissions.append((request.request_id, request.num_preemptions,
                               request.num_computed_tokens))
        return n

    engine.scheduler._admit = spy
    for name in ("aligned0", "other", "aligned1"):  # "other" (4 blocks) evicts aligned0's
        finished, _ = run_to_end(engine, {0: [(p[name], GREEDY, name)]}, check_manager)
        assert_matches(finished, hf_alone)
    assert finished["aligned1"].num_cached_tokens < 32  # part of the prefix was evicted
    finished, steps = run_to_end(engine, {0: [(p[n], GREEDY, f"{n}#2") for n in
                                              ("aligned2", "aligned3", "unaligned0", "whole40")]},
                                 check_manager)
    assert_matches(finished, hf_alone)
    assert sum(len(s.preempted) for s in steps) > 0
    assert any(preempted and computed for _, preempted, computed in admissions), \
        "no re-admission after a preemption found its own blocks"
    assert_idle_cache(engine)


# -- the tiny model: bookkeeping, sampling, errors ------------------------------------------

def test_blocks_are_shared_as_soon_as_they_are_full(tiny):
    """A request admitted while another is still prefilling hits the blocks that request has
    computed so far."""
    engine = make_engine("prefix-cache", tiny, max_num_batched_tokens=16, block_size=4)
    prompt = list(range(100, 140))
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    engine.add_request(prompt, params, request_id="first")
    engine.step()  # 16 of its 40 tokens: 4 full blocks
    engine.add_request(prompt[:30] + [7, 8], params, request_id="second")
    finished, _ = run_to_end(engine, check=check_manager)
    assert finished["second"].num_cached_tokens >= 16
    naive = make_engine("naive", tiny)
    assert finished["second"].output_ids == \
        naive.generate([prompt[:30] + [7, 8]], params).token_ids[0]
    assert_idle_cache(engine)


def test_seeded_sampling_and_validation_are_chapter_08s(tiny):
    prompt = list(range(20, 53))
    sampled = SamplingParams(max_new_tokens=10, temperature=0.9, top_k=40, seed=3,
                             ignore_eos=True)
    alone = make_engine("continuous", tiny).generate([prompt], sampled).token_ids[0]
    engine = make_engine("prefix-cache", tiny, block_size=4, num_blocks=16)
    first = engine.generate([prompt], sampled).token_ids[0]
    again = engine.generate([prompt], sampled).token_ids[0]  # from the cache this time
    assert first == again == alone
    with pytest.raises(InvalidRequestError, match="needs 17 KV blocks, more than the whole pool"):
        engine.add_request([5] * 60, SamplingParams(max_new_tokens=6))
    engine.add_request(prompt, sampled, request_id="a", stop=["x"])
    engine.step()
    assert engine.abort("a") and not engine.abort("a")
    assert_idle_cache(engine)


def test_stress_shared_prefixes_aborts_and_a_small_pool(tiny):
    """Random requests built from a few shared beginnings, random arrivals and aborts, a pool
    far smaller than the load: every finished request equals the naive engine on its prompt
    alone, the invariants hold after every step, and at the end every block is free or
    cached."""
    rng = random.Random(1)
    naive = make_engine("naive", tiny)
    engine = make_engine("prefix-cache", tiny, max_num_batched_tokens=rng.choice([9, 16, 33]),
                         block_size=4, num_blocks=24, max_num_seqs=6)
    stems = [[rng.randrange(17, 49152) for _ in range(rng.randint(4, 24))] for _ in range(4)]
    requests = {}
    for rid in range(40):
        prompt = rng.choice(stems) + [rng.randrange(17, 49152) for _ in range(rng.randint(0, 12))]
        requests[rid] = (prompt, SamplingParams(max_new_tokens=rng.randint(1, 12),
                                                ignore_eos=True))
    arrival = {rid: rng.randrange(0, 50) for rid in requests}
    to_abort = {rid: arrival[rid] + rng.randrange(0, 8) for rid in rng.sample(range(40), 6)}
    finished, aborted = drive_requests(
        engine, requests, arrival, to_abort, min_steps=50,
        after_step=lambda engine: check_manager(engine.kv_cache.block_manager))
    assert set(finished) | aborted == set(requests)
    assert sum(r.num_preemptions for r in finished.values()) > 0
    assert sum(r.num_cached_tokens for r in finished.values()) > 0
    assert_each_equals_naive(finished, requests, naive)
    assert_idle_cache(engine)


# -- the cache alone: a state machine -------------------------------------------------------

TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=14)  # few symbols: many shared blocks


class PrefixCacheMachine(RuleBasedStateMachine):
    """Requests start (with whatever the cache holds), grow, finish or are preempted (both let
    go of their blocks) in any order. ``written`` models the pool: which tokens' K/V each block
    holds, so a hit on the wrong block, or a block taken from a request that still reads it,
    shows up as a request whose blocks do not hold its own tokens."""

    BLOCK_SIZE = 3
    NUM_BLOCKS = 10

    def __init__(self) -> None:
        super().__init__()
        self.manager = PrefixCacheBlockManager(self.NUM_BLOCKS, self.BLOCK_SIZE)
        self.tokens: dict[int, list[int]] = {}
        self.written: dict[int, tuple[int, ...]] = {}  # block -> the sequence up to its end
        self.next_id = 0

    def compute(self, rid: int, start: int) -> None:
        """The forward of tokens ``start:`` of ``rid``, then its full blocks get their hash."""
        tokens, table, size = self.tokens[rid], self.manager.block_tables[rid], self.BLOCK_SIZE
        for i in range(start // size, len(table)):
            self.written[table[i]] = tuple(tokens[: min((i + 1) * size, len(tokens))])
        self.manager.cache_full_blocks(rid, len(tokens), lambda a, b: tokens[a:b])

    @rule(tokens=TOKENS)
    def admit(self, tokens: list[int]) -> None:
        hit = self.manager.lookup(tokens)
        cached = len(hit.blocks) * self.BLOCK_SIZE
        assert cached < len(tokens), "the last prompt token must be computed"
        for i, block in enumerate(hit.blocks):
            assert self.written[block] == tuple(tokens[: (i + 1) * self.BLOCK_SIZE]), \
                "a hit on a block that holds other tokens"
        rid, self.next_id = self.next_id, self.next_id + 1
        before = (list(self.manager.ref_counts), list(self.manager.free_list),
                  list(self.manager.evictable), dict(self.manager.cached))
        try:
            self.manager.add_with_prefix(rid, hit, len(tokens) - cached)
        except KVCacheFull:
            assert before == (self.manager.ref_counts, list(self.manager.free_list),
                              list(self.manager.evictable), self.manager.cached)
            return
        self.tokens[rid] = list(tokens)
        self.compute(rid, cached)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new=TOKENS)
    def grow(self, data: st.DataObject, new: list[int]) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        try:
            self.manager.append(rid, len(new))
        except KVCacheFull:
            return
        start = len(self.tokens[rid])
        self.tokens[rid] += new
        self.compute(rid, start)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        """Finish, abort or preempt: the manager sees the same thing."""
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.manager.free(rid)
        del self.tokens[rid]

    @rule()
    def evict_all(self) -> None:
        self.manager.evict_all()

    @invariant()
    def bookkeeping_holds(self) -> None:
        check_manager(self.manager)

    @invariant()
    def every_request_reads_its_own_tokens(self) -> None:
        size = self.BLOCK_SIZE
        for rid, tokens in self.tokens.items():
            for i, block in enumerate(self.manager.block_tables[rid]):
                assert self.written[block] == tuple(tokens[: min((i + 1) * size, len(tokens))])
        for block_hash, block in self.manager.cached.items():
            # The hash names the whole sequence the block's K/V was computed from.
            sequence, chain = self.written[block], ROOT_HASH
            for start in range(0, len(sequence), size):
                chain = hash_block(chain, sequence[start : start + size])
            assert chain == block_hash, "a hash entry names a block holding other tokens"

    def teardown(self) -> None:
        for rid in list(self.tokens):
            self.manager.free(rid)
        check_manager(self.manager)
        assert len(self.manager.free_list) + len(self.manager.evictable) == self.NUM_BLOCKS


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=150, stateful_step_count=40,
                                           deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])


# -- workloads and the serving benchmark ----------------------------------------------------

def test_workloads_share_what_they_say(tiny):
    shared = make_workload(tiny, WorkloadConfig(num_requests=6, prompt_len=(4, 8),
                                                kind="shared-prefix", shared_prefix_len=20))
    assert len({tuple(w.prompt_ids[:20]) for w in shared}) == 1
    assert len({tuple(w.prompt_ids[20:]) for w in shared}) == 6
    chats = make_workload(tiny, WorkloadConfig(num_requests=6, kind="multi-turn", turns=3,
                                               turn_gap_s=2.0, request_rate=1.0, seed=3))
    assert [(w.conversation, w.turn) for w in chats] == [(c, t) for c in (0, 1) for t in (1, 2, 3)]
    for prev, turn in zip(chats, chats[1:], strict=False):
        if turn.conversation == prev.conversation:
            assert turn.prompt_ids[: len(prev.prompt_ids)] == prev.prompt_ids
            # The scripted reply follows the previous prompt, then the new message.
            assert len(turn.prompt_ids) > len(prev.prompt_ids) + prev.max_new_tokens
            assert turn.arrival_s == pytest.approx(prev.arrival_s + 2.0)
    assert chats[3].arrival_s > 0  # conversations start at Poisson arrivals
    # Chapter 08's workload is unchanged by the new fields.
    assert make_workload(tiny, WorkloadConfig(num_requests=3, request_rate=2.0)) == \
        make_workload(tiny, WorkloadConfig(num_requests=3, request_rate=2.0, turns=2))


@pytest.mark.parametrize("kwargs, message", [
    ({"kind": "radix"}, "unknown workload 'radix'"),
    ({"kind": "multi-turn", "num_requests": 7}, "must be a multiple of turns"),
    ({"shared_prefix_len": -1}, "shared_prefix_len must be"),
    ({"turns": 0}, "need turns >= 1"),
])
def test_workload_config_rejects_bad_values(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        WorkloadConfig(**kwargs)


def test_bench_serving_reports_hit_rates_and_starts_cold(tiny):
    workload = WorkloadConfig(num_requests=6, prompt_len=(4, 8), output_len=(2, 4),
                              kind="shared-prefix", shared_prefix_len=64)
    results = run_serving_bench(tiny, ServingBenchConfig(
        workload, ("continuous", "prefix-cache"), max_num_batched_tokens=(64,), chapter="09"),
        progress=False)
    rate = results.runs.set_index("system").prefix_cache_hit_rate
    assert rate["continuous"] == 0 and 0 < rate["prefix-cache"] < 1
    requests = results.requests[results.requests.system == "prefix-cache"].set_index("request")
    assert requests.cached_tokens[0] == 0, "the warm-up's blocks were still cached"
    assert requests.cached_tokens[1:].min() == 64  # one request per step: the rest hit
    assert rate["prefix-cache"] == pytest.approx(requests.cached_tokens.sum()
                                                 / requests.prompt_len.sum())
    steps = results.steps[results.steps.system == "prefix-cache"]
    assert steps.num_blocks_cached.iloc[-1] > 0 and steps.num_blocks_in_use.iloc[-1] == 0
    assert results.runs.workload.eq("shared-prefix").all()
    assert results.runs.peer_version.eq("").all()  # ours, not a peer's
    assert set(results.requests.turn) == {1}
