"""One serving engine's settings in one object, instead of the same keywords threaded through
every stage's constructor: the scheduler's budget, the KV pool's size and block size, and the
runner's choices (forward, attention backend, tensor parallelism). A stage takes
``make_engine(name, lm, **options)`` as before; :meth:`EngineConfig.of` turns the options into
a config, and an option no engine has is an error that names it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..core.errors import InvalidRequestError
from ..core.kv_cache import DEFAULT_BLOCK_SIZE, KVCacheConfig
from ..core.scheduler import SchedulerConfig


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What chapter 08's continuous engine and every stage built on it are configured by."""

    max_num_batched_tokens: int = 512  # the token budget of one step
    max_num_seqs: int = 256  # requests running at once
    chunked_prefill: bool = True
    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int | None = None  # the pool's size in blocks (None: from kv_cache_bytes)
    kv_cache_bytes: int | None = None  # the pool's size in bytes (None: the default pool)
    attention_backend: str | None = None  # None: the best available
    forward: str = "auto"  # a name in the runner's FORWARDS
    tensor_parallel: int = 1

    @classmethod
    def of(cls, config: EngineConfig | None = None, **options) -> EngineConfig:
        """``config`` (default: the defaults) with ``options`` set."""
        names = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise InvalidRequestError(f"unknown engine option(s) {', '.join(unknown)}; "
                                      f"options: {', '.join(names)}")
        return dataclasses.replace(config or cls(), **options)

    @property
    def kv_cache(self) -> KVCacheConfig:
        return KVCacheConfig(self.block_size, self.num_blocks, self.kv_cache_bytes)

    @property
    def scheduler(self) -> SchedulerConfig:
        return SchedulerConfig(self.max_num_batched_tokens, self.max_num_seqs,
                               self.chunked_prefill)
