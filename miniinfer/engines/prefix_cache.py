"""Stage ``prefix-cache``: chapter 08's continuous engine on a block manager that remembers.

The forward, the sampling, the stop conditions and the serving API (``add_request``, ``step``,
``abort``, ``has_unfinished_requests``) are chapter 08's, untouched. Two parts change (see
:mod:`miniinfer.core.prefix_cache`):

- the KV pool's bookkeeping is a :class:`PrefixCacheBlockManager`: hash-chained full blocks,
  ref counts, and released blocks that stay cached until a new block is needed (LRU);
- the scheduler is a :class:`PrefixCacheScheduler`: a request is admitted with
  ``num_computed_tokens`` already at the end of its cached prefix, so chapter 08's chunked
  prefill feeds only the rest. Chunked prefill already let a chunk's queries attend to K/V that
  earlier steps put in the cache; a cached prefix is just K/V that another request put there.
"""

from __future__ import annotations

from ..core.models import LoadedModel
from ..core.prefix_cache import PrefixCacheBlockManager, PrefixCacheScheduler
from .continuous import ContinuousEngine


class PrefixCacheEngine(ContinuousEngine):
    name = "prefix-cache"
    summary = "continuous batching + prefix caching: hash-chained blocks, ref counts, LRU"

    def __init__(self, lm: LoadedModel, **options) -> None:
        super().__init__(lm, **options)
        # Same pool tensor, new bookkeeping: the blocks are indexed the same way.
        manager = PrefixCacheBlockManager(self.kv_cache.num_blocks, self.kv_cache.block_size)
        self.kv_cache.block_manager = manager
        self.scheduler = PrefixCacheScheduler(self.scheduler.config, manager)

    def reset_prefix_cache(self) -> None:
        """Forget the cached blocks no request holds (blocks in use keep their hashes)."""
        self.kv_cache.block_manager.evict_all()
