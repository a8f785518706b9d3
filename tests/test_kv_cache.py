"""The block manager and the block pool behind the paged engines (chapter 02 onward)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from miniinfer import InvalidRequestError, KVCacheFull
from miniinfer.core.kv_cache import (
    DEFAULT_MEMORY_BYTES,
    BlockManager,
    KVCacheConfig,
    PagedKVCache,
    blocks_for,
    zeroed_pool,
)


def test_append_takes_a_block_only_when_the_last_is_full():
    manager = BlockManager(num_blocks=4, block_size=16)
    assert manager.add("a", 16) == [0]
    assert manager.append("a") == [1]  # token 16 opens a second block
    assert [manager.append("a") for _ in range(15)] == [[]] * 15
    assert manager.block_tables["a"] == [0, 1] and manager.num_tokens["a"] == 32
    assert manager.append("a", 3) == [2]
    assert manager.num_free_blocks == 1


def test_slot_follows_the_block_table():
    manager = BlockManager(num_blocks=8, block_size=4)
    manager.add("a", 3)  # block 0
    manager.add("b", 6)  # blocks 1, 2
    manager.append("a", 2)  # token 4 opens block 3
    assert manager.block_tables["a"] == [0, 3]
    assert [manager.slot("a", t) for t in range(5)] == [0, 1, 2, 3, 12]
    assert [manager.slot("b", t) for t in range(6)] == [4, 5, 6, 7, 8, 9]
    with pytest.raises(IndexError):
        manager.slot("a", 5)
    with pytest.raises(IndexError):
        manager.slot("nobody", 0)
    assert manager.num_cached_blocks == 0  # chapter 08's pool keeps no prefix


def test_free_returns_every_block():
    manager = BlockManager(num_blocks=5, block_size=2)
    manager.add(0, 5)
    manager.add(1, 1)
    manager.free(0)
    assert manager.num_free_blocks == 4 and 0 not in manager
    manager.free(1)
    assert sorted(manager.free_list) == list(range(5))
    assert manager.block_tables == {} and manager.num_tokens == {}


def test_exhaustion_names_the_numbers_and_changes_nothing():
    manager = BlockManager(num_blocks=3, block_size=16)
    manager.add("a", 20)  # 2 blocks
    with pytest.raises(KVCacheFull, match=r"request 'b' needs 2 more KV block\(s\) but only 1 of "
                                          r"3 are free \(block_size=16 tokens\)"):
        manager.add("b", 17)
    assert "b" not in manager and manager.num_free_blocks == 1
    manager.append("a", 28)  # 48 tokens: the last free block, full
    with pytest.raises(KVCacheFull, match="request 'a' needs 1 more KV block.* only 0 of 3"):
        manager.append("a")
    assert manager.num_tokens["a"] == 48 and manager.block_tables["a"] == [0, 1, 2]


def test_misuse_is_refused():
    manager = BlockManager(num_blocks=2, block_size=4)
    manager.add("a", 1)
    with pytest.raises(InvalidRequestError, match="already holds"):
        manager.add("a", 1)
    with pytest.raises(InvalidRequestError, match="holds no KV blocks"):
        manager.free("b")
    with pytest.raises(InvalidRequestError, match="holds no KV blocks"):
        manager.append("b")


class BlockManagerMachine(RuleBasedStateMachine):
    """Random interleavings of requests starting, growing, finishing and being aborted."""

    NUM_BLOCKS, BLOCK_SIZE = 12, 4

    def __init__(self) -> None:
        super().__init__()
        self.manager = BlockManager(self.NUM_BLOCKS, self.BLOCK_SIZE)
        self.tokens: dict[int, int] = {}  # the model: tokens each live request holds
        self.next_id = 0

    def _expect(self, rid: int, needed: int, action) -> bool:
        """Run ``action``; it must fail with KVCacheFull exactly when too few blocks are free,
        and then leave the manager untouched."""
        free = self.manager.num_free_blocks
        tables = {r: list(t) for r, t in self.manager.block_tables.items()}
        if needed <= free:
            action()
            return True
        with pytest.raises(KVCacheFull, match=f"request {rid} needs {needed} more KV block.*"
                                              f"only {free} of {self.NUM_BLOCKS} are free"):
            action()
        assert self.manager.num_free_blocks == free and self.manager.block_tables == tables
        return False

    @rule(num_tokens=st.integers(0, 20))
    def add(self, num_tokens: int) -> None:
        rid, self.next_id = self.next_id, self.next_id + 1
        if self._expect(rid, blocks_for(num_tokens, self.BLOCK_SIZE),
                        lambda: self.manager.add(rid, num_tokens)):
            self.tokens[rid] = num_tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), n=st.integers(1, 9))
    def append(self, data, n: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        total = self.tokens[rid] + n
        needed = blocks_for(total, self.BLOCK_SIZE) - len(self.manager.block_tables[rid])
        if self._expect(rid, needed, lambda: self.manager.append(rid, n)):
            self.tokens[rid] = total

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def finish(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.manager.free(rid)
        del self.tokens[rid]

    @precondition(lambda self: self.tokens)
    @rule()
    def abort_newest(self) -> None:
        rid = max(self.tokens)
        self.manager.free(rid)
        del self.tokens[rid]

    @invariant()
    def blocks_are_partitioned(self) -> None:
        owned = [b for table in self.manager.block_tables.values() for b in table]
        assert len(owned) == len(set(owned)), "a block is in two block tables"
        assert sorted(owned + list(self.manager.free_list)) == list(range(self.NUM_BLOCKS))

    @invariant()
    def tables_cover_exactly_their_tokens(self) -> None:
        assert self.manager.num_tokens == self.tokens
        slots = []
        for rid, n in self.tokens.items():
            assert len(self.manager.block_tables[rid]) == blocks_for(n, self.BLOCK_SIZE)
            slots += [self.manager.slot(rid, t) for t in range(n)]
        assert len(slots) == len(set(slots)), "two tokens share a slot"
        assert all(0 <= s < self.NUM_BLOCKS * self.BLOCK_SIZE for s in slots)

    def teardown(self) -> None:
        for rid in list(self.tokens):
            self.manager.free(rid)
        assert sorted(self.manager.free_list) == list(range(self.NUM_BLOCKS))


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=60, stateful_step_count=40,
                                            deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("kwargs, message", [
    ({"block_size": 0}, "block_size must be an integer >= 1"),
    ({"num_blocks": 0}, "num_blocks must be an integer >= 1"),
    ({"kv_cache_bytes": -1}, "kv_cache_bytes must be"),
    ({"num_blocks": 4, "kv_cache_bytes": 1 << 20}, "not both"),
])
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        KVCacheConfig(**kwargs)


def test_config_sizes_the_pool():
    assert KVCacheConfig(num_blocks=7).resolve_num_blocks(1000, 512) == 7
    assert KVCacheConfig(kv_cache_bytes=10_500).resolve_num_blocks(1000, 512) == 10
    with pytest.raises(InvalidRequestError, match="holds no KV block"):
        KVCacheConfig(kv_cache_bytes=999).resolve_num_blocks(1000, 512)
    # Default: 1 GiB, unless a few full-context sequences need less.
    assert KVCacheConfig().resolve_num_blocks(1 << 20, 8192) == DEFAULT_MEMORY_BYTES >> 20
    assert KVCacheConfig(block_size=16).resolve_num_blocks(1000, 512) == 8 * 512 // 16


def test_pool_holds_all_layers_in_one_tensor(tiny):
    cache = PagedKVCache(tiny, KVCacheConfig(block_size=8, num_blocks=5))
    assert cache.kv.shape == (3, 2, 5, 8, 2, 16)  # layers, K/V, blocks, block_size, heads, dim
    assert cache.kv.dtype == tiny.dtype and cache.kv.device == tiny.device
    assert cache.slots.shape == (3, 2, 40, 2, 16)
    assert cache.slots.data_ptr() == cache.kv.data_ptr()  # a view, not a copy
    assert torch.count_nonzero(cache.kv) == 0
    assert cache.block_manager.num_blocks == 5 and cache.nbytes == cache.kv.numel() * 4


def test_truncate_takes_back_tokens_and_frees_exactly_the_blocks_it_empties():
    manager = BlockManager(num_blocks=6, block_size=4)
    manager.add("a", 6)  # blocks 0, 1
    manager.add("b", 1)  # block 2
    assert manager.append("a", 7) == [3, 4]  # 13 tokens (a speculative step's drafts)
    assert manager.truncate("a", 1) == [4]  # 12 tokens: block 4 held only token 12
    assert manager.num_tokens["a"] == 12 and manager.block_tables["a"] == [0, 1, 3]
    assert manager.truncate("a", 3) == []  # 9 tokens: block 3 still holds token 8
    assert manager.truncate("a", 4) == [3]  # 5 tokens: blocks 0 and 1 only
    assert manager.num_tokens["a"] == 5 and manager.block_tables["a"] == [0, 1]
    assert manager.num_free_blocks == 3 and manager.block_tables["b"] == [2]
    assert manager.slot("a", 4) == 4 and manager.truncate("a", 0) == []
    with pytest.raises(IndexError):
        manager.slot("a", 5)
    with pytest.raises(InvalidRequestError, match="holds 5 tokens; cannot take back 6"):
        manager.truncate("a", 6)
    assert manager.append("a", 4) == [3]  # 9 tokens: the block given back last comes first
    assert manager.truncate("a", 9) == [0, 1, 3]  # all of it: an empty table
    assert manager.block_tables["a"] == [] and manager.num_tokens["a"] == 0
    manager.free("a")
    assert manager.num_free_blocks == 5


def test_blocks_given_back_are_taken_again_first():
    # So a pool the OS maps on first write stays resident only up to the most blocks ever in
    # use at once: requests that come and go one at a time reuse the same few blocks.
    manager = BlockManager(num_blocks=8, block_size=4)
    used = set()
    for n in range(20):
        manager.add(n, 6)
        manager.append(n, 3)  # a third block for tokens 8-9
        used.update(last := list(manager.block_tables[n]))
        manager.free(n)
    assert used == {0, 1, 2}  # never more than one request's three blocks
    assert list(manager.free_list)[:3] == last[::-1]  # the last request's, its last block first
    assert manager.add("a", 4) == [last[2]] and manager.add("b", 4) == [last[1]]
    manager.free("a")
    assert manager.add("c", 4) == [last[2]]


def _resident_anon_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssAnon"))


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"),
                    reason="resident memory read from Linux's /proc")
def test_a_cpu_pool_is_resident_only_where_written():
    before = _resident_anon_kib()
    pool = zeroed_pool((4, 2, 1024, 16, 8, 64), torch.float32, "cpu")  # 256 MiB of zeros
    assert pool.nbytes == 256 << 20 and pool.is_contiguous()
    assert _resident_anon_kib() - before < 32 << 10  # not written: not resident
    pool[0, 0, 3] = 1.0  # one block of one layer
    assert _resident_anon_kib() - before < 32 << 10
    assert torch.count_nonzero(pool[0, 0, :8]) == 16 * 8 * 64  # the rest of them read as 0
    assert _resident_anon_kib() - before < 32 << 10
    assert zeroed_pool((2, 3), torch.bfloat16, "cpu").eq(0).all()
