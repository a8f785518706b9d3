"""Stage ``prefix-cache``: chapter 08's continuous engine on a block manager that remembers.

The forward, the sampling, the stop conditions and the serving API (``add_request``, ``step``,
``abort``, ``has_unfinished_requests``) are chapter 08's, untouched. One setting of the engine's
config changes, ``prefix_caching=True``, and with it two parts the engine is built with (see
:mod:`miniinfer.core.prefix_cache`):

- the KV pool's bookkeeping is a :class:`~miniinfer.core.prefix_cache.PrefixCacheBlockManager`:
  hash-chained full blocks, ref counts, and released blocks that stay cached until a new block
  is needed (LRU);
- the scheduler is a :class:`~miniinfer.core.prefix_cache.PrefixCacheScheduler`: a request is
  admitted with ``num_computed_tokens`` already at the end of its cached prefix, so chapter 08's
  chunked prefill feeds only the rest. Chunked prefill already let a chunk's queries attend to
  K/V that earlier steps put in the cache; a cached prefix is just K/V that another request put
  there.
"""

from __future__ import annotations

from .continuous import ContinuousEngine


class PrefixCacheEngine(ContinuousEngine):
    name = "prefix-cache"
    summary = "continuous batching + prefix caching: hash-chained blocks, ref counts, LRU"
    preset = {"prefix_caching": True}
