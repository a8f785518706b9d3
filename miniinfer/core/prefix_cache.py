"""Prefix caching (chapter 09): a prompt's shared beginning is computed once.

Chapter 08's block manager forgets a block's contents the moment its request lets go. Here a
full block keeps a name, the hash of its tokens *and of everything before them*:

    hash(block i) = blake2b(hash(block i - 1) + token ids of block i)

so two prompts get the same hash for block i exactly when their first ``(i + 1) * block_size``
tokens are equal (the chain makes position part of the name: the same 16 tokens after a
different beginning have different K/V, and a different hash). blake2b with 128 bits makes a
collision, which would silently serve another prompt's K/V, as unlikely as a hardware fault.

- ``cached`` maps a hash to the block holding those tokens' K/V. Only *full* blocks get a hash:
  a partial block is still being written by its request, so it is never shared.
- every block has a *ref count*, the number of requests whose block table holds it. A block
  whose count drops to 0 goes back to the free list if it has no hash, and to ``evictable`` if
  it has one: it is free to reuse, but until then a new request can still hit it.
- a request that needs a new block takes a truly free one first; only when there is none does it
  *evict* the least recently released cached block (and forget its hash).
- admission (``PrefixCacheScheduler._admit``) looks the prompt's chain up block by block, takes
  the longest run of hits (their counts go up) and leaves only the rest to prefill. The last
  prompt token is always computed, because its logits give the first new token: a prompt that
  is cached whole still recomputes its last block.
- a request's blocks get their hash as soon as they are full and computed (before every step's
  admissions, and when it finishes or is preempted), so requests admitted a few steps after it
  already hit, and a preempted request may find its own blocks again when it comes back.

vLLM's automatic prefix caching and nano-vllm's block manager work this way; SGLang keeps the
same information in a radix tree over token ids instead of a hash table.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .errors import InvalidRequestError, KVCacheFull
from .kv_cache import BlockManager, RequestId, blocks_for
from .scheduler import FinishReason, Request, RequestStatus, ScheduledBatch, Scheduler

ROOT_HASH = b""  # the parent of a prompt's first block


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The name of a full block: its tokens and, through ``parent``, every token before them."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


@dataclass(frozen=True, slots=True)
class CachedBlock:
    """What a hashed block holds, kept so a hit can be checked and the cache drawn."""

    block_hash: bytes
    parent: bytes
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The longest cached run of a prompt's full blocks: the blocks and their hashes."""

    blocks: list[int]
    hashes: list[bytes]


class PrefixCacheBlockManager(BlockManager):
    """Chapter 08's block manager plus hashes, ref counts and LRU eviction.

    ``num_free_blocks`` counts every block a request may take (free or evictable), so the
    scheduler's arithmetic is unchanged; ``num_cached_blocks`` the evictable ones.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self.ref_counts = [0] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block
        self.contents: dict[int, CachedBlock] = {}  # block -> its hash and tokens (hashed only)
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 and hashed; LRU first
        self.chains: dict[RequestId, list[bytes]] = {}  # each request's full blocks' hashes

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_list) + len(self.evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.evictable)

    def lookup(self, token_ids: Sequence[int]) -> PrefixHit:
        """The cached run of full blocks at the start of ``token_ids``, short of its last token
        (which must be computed for its logits). Changes nothing."""
        blocks: list[int] = []
        hashes: list[bytes] = []
        parent = ROOT_HASH
        size = self.block_size
        for start in range(0, (len(token_ids) - 1) // size * size, size):
            parent = hash_block(parent, token_ids[start : start + size])
            block = self.cached.get(parent)
            if block is None:
                break
            blocks.append(block)
            hashes.append(parent)
        return PrefixHit(blocks, hashes)

    def add_with_prefix(self, request_id: RequestId, hit: PrefixHit, num_new_tokens: int) -> None:
        """Start a request on the cached blocks of ``hit`` plus room for ``num_new_tokens``
        after them. All or nothing, like ``add``."""
        if request_id in self.block_tables:
            raise InvalidRequestError(f"request {request_id!r} already holds KV blocks")
        num_tokens = len(hit.blocks) * self.block_size + num_new_tokens
        needed = blocks_for(num_tokens, self.block_size) - len(hit.blocks)
        # A hit on an evictable block takes it off the evictable list: it cannot also be new.
        revived = sum(self.ref_counts[b] == 0 for b in hit.blocks)
        if needed > self.num_free_blocks - revived:
            raise KVCacheFull(
                f"request {request_id!r} needs {needed} more KV block(s) but only "
                f"{self.num_free_blocks - revived} of {self.num_blocks} are free "
                f"(block_size={self.block_size} tokens)")
        for block in hit.blocks:
            self.ref_counts[block] += 1
            self.evictable.pop(block, None)
        self.block_tables[request_id] = hit.blocks + self._take(request_id, needed)
        self.num_tokens[request_id] = num_tokens
        self.chains[request_id] = list(hit.hashes)

    def cache_full_blocks(self, request_id: RequestId, num_computed_tokens: int,
                          token_ids: Callable[[int, int], list[int]]) -> None:
        """Give a hash to each block of the request that is now full and computed;
        ``token_ids(start, end)`` reads the request's tokens. Only committed tokens are ever
        counted here (the caller passes at most the request's own prompt and output: a
        speculative step's draft tokens, computed but not yet verified, never get a hash). A
        block whose hash another block already has stays unhashed (a duplicate computed before
        the first was cached)."""
        chain = self.chains.setdefault(request_id, [])
        table = self.block_tables[request_id]
        size = self.block_size
        for i in range(len(chain), num_computed_tokens // size):
            parent = chain[-1] if chain else ROOT_HASH
            tokens = token_ids(i * size, (i + 1) * size)
            block_hash = hash_block(parent, tokens)
            chain.append(block_hash)
            if block_hash not in self.cached:
                self.cached[block_hash] = table[i]
                self.contents[table[i]] = CachedBlock(block_hash, parent, tuple(tokens))

    def free(self, request_id: RequestId) -> None:
        """Drop the request's references. Blocks nobody holds any more go back to the free list,
        or to the end of the evictable list if hashed; the request's last block first, so its
        first block, which more prompts share, is evicted last."""
        self._release(self._table(request_id)[::-1])
        del self.block_tables[request_id]
        del self.num_tokens[request_id]
        self.chains.pop(request_id, None)

    def truncate(self, request_id: RequestId, n: int) -> list[int]:
        """Chapter 08's ``truncate``; the request's chain of hashes keeps only its blocks that
        are still full."""
        freed = super().truncate(request_id, n)
        chain = self.chains.get(request_id)
        if chain is not None:
            del chain[self.num_tokens[request_id] // self.block_size:]
        return freed

    def _release(self, blocks: list[int]) -> None:
        """Drop one reference to each block: one nobody holds any more goes back to the free
        list, or to the end of the evictable list if hashed."""
        for block in blocks:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if block in self.contents:
                    self.evictable[block] = None
                else:
                    self.free_list.append(block)

    def evict_all(self) -> None:
        """Forget every cached block nobody holds (a benchmark run that must start cold)."""
        for block in self.evictable:
            del self.cached[self.contents.pop(block).block_hash]
            self.free_list.append(block)
        self.evictable.clear()

    def _take(self, request_id: RequestId, needed: int) -> list[int]:
        if needed > self.num_free_blocks:
            raise KVCacheFull(
                f"request {request_id!r} needs {needed} more KV block(s) but only "
                f"{self.num_free_blocks} of {self.num_blocks} are free "
                f"(block_size={self.block_size} tokens)")
        taken = []
        for _ in range(needed):
            if self.free_list:
                block = self.free_list.popleft()
            else:  # evict the least recently released cached block
                block, _ = self.evictable.popitem(last=False)
                del self.cached[self.contents.pop(block).block_hash]
            self.ref_counts[block] = 1
            taken.append(block)
        return taken


class PrefixCacheScheduler(Scheduler):
    """Chapter 08's scheduler; admission starts a request after its cached prefix, and full
    blocks are hashed before every step's admissions and whenever a request lets go."""

    block_manager: PrefixCacheBlockManager

    def schedule(self) -> ScheduledBatch:
        for request in self.running:
            self._cache_full_blocks(request)
        return super().schedule()

    def _admit(self, request: Request, budget: int, alone: bool) -> int:
        hit = self.block_manager.lookup(request.token_ids(0, request.num_tokens))
        request.num_computed_tokens = len(hit.blocks) * self.block_manager.block_size
        n = self._num_new_tokens(request, budget, alone)
        if n:
            try:
                self.block_manager.add_with_prefix(request.request_id, hit, n)
            except KVCacheFull:
                n = 0
        if n == 0:
            request.num_computed_tokens = 0
        elif request.timeline.first_scheduled is None:  # a re-admission hits its own blocks
            request.num_cached_tokens = request.num_computed_tokens
        return n

    def preempt(self, request: Request) -> None:
        self._cache_full_blocks(request)
        super().preempt(request)

    def finish(self, request: Request, reason: FinishReason, now: float) -> None:
        if request.status is RequestStatus.RUNNING:
            self._cache_full_blocks(request)
        super().finish(request, reason, now)

    def _cache_full_blocks(self, request: Request) -> None:
        # Committed tokens only: a step may have computed draft tokens past the request's own.
        committed = min(request.num_computed_tokens, request.num_tokens)
        self.block_manager.cache_full_blocks(request.request_id, committed, request.token_ids)
