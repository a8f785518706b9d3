"""Paged KV cache (chapter 02 onward): K/V live in fixed-size blocks of one preallocated pool.

A request does not own a contiguous ``[max_context, ...]`` slab; it owns a *block table*, the
list of pool blocks holding its tokens in order. Token ``t`` of a request lives in *slot*
``block_table[t // block_size] * block_size + t % block_size`` of the pool, and a list of such
slots is a *slot mapping*. Memory is taken one block at a time as a sequence grows and all of it
comes back the moment the request finishes, so no request reserves room it may never use.

``BlockManager`` is the bookkeeping (a free list and the block tables, pure Python);
``PagedKVCache`` adds the tensor the blocks index into.
"""

from __future__ import annotations

import mmap
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from .errors import InvalidRequestError, KVCacheFull
from .models import LoadedModel

DEFAULT_BLOCK_SIZE = 16
# The pool is allocated when an engine is built, used or not, next to the model on whatever
# device the reader has (a laptop CPU included): 1 GiB bounds it. A model with a short context
# needs far less, so the default also stops at room for this many full-context sequences, the
# largest batch the chapters benchmark: the tiny test model then gets a few MB, not 1 GiB.
DEFAULT_MEMORY_BYTES = 1 << 30
DEFAULT_MAX_SEQUENCES = 8

RequestId = Hashable


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def head_dim(model_config) -> int:
    """Each attention head's width: the config's own, or the hidden size split over the heads
    (HF's rule for configs that do not name it)."""
    return getattr(model_config, "head_dim", None) or \
        model_config.hidden_size // model_config.num_attention_heads


def kv_bytes_per_block(model_config, dtype: torch.dtype, block_size: int) -> int:
    """Bytes one block of ``block_size`` tokens takes in the pool: K and V, every layer."""
    return (model_config.num_hidden_layers * 2 * block_size * model_config.num_key_value_heads
            * head_dim(model_config) * dtype.itemsize)


@dataclass(slots=True)
class KVCacheConfig:
    """How big the block pool is: ``num_blocks`` blocks, or as many as ``kv_cache_bytes`` holds.
    With neither, see ``DEFAULT_MEMORY_BYTES``."""

    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None

    def __post_init__(self) -> None:
        for field, value in (("block_size", self.block_size), ("num_blocks", self.num_blocks),
                             ("kv_cache_bytes", self.kv_cache_bytes)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise InvalidRequestError(f"{field} must be an integer >= 1, got {value!r}")
        if self.num_blocks is not None and self.kv_cache_bytes is not None:
            raise InvalidRequestError("give num_blocks or kv_cache_bytes, not both")

    def resolve_num_blocks(self, bytes_per_block: int, max_context: int) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        if self.kv_cache_bytes is not None:
            if self.kv_cache_bytes < bytes_per_block:
                raise InvalidRequestError(
                    f"kv_cache_bytes={self.kv_cache_bytes} holds no KV block; one block of "
                    f"{self.block_size} tokens takes {bytes_per_block} bytes"
                )
            return self.kv_cache_bytes // bytes_per_block
        enough = DEFAULT_MAX_SEQUENCES * blocks_for(max_context, self.block_size)
        return max(1, min(DEFAULT_MEMORY_BYTES // bytes_per_block, enough))


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
                ) -> torch.Tensor:
    """A KV pool of zeros. Zeros, not empty: a dense gather may read a slot no token was
    written to yet (its value is then masked or overwritten), and garbage there could be NaN,
    which a zero attention weight does not cancel.

    On a CPU the zeros are the operating system's: anonymous memory it maps page by page on
    first write, so the pool costs resident memory only for the blocks requests have used
    (``torch.zeros`` would write, and so make resident, every page of it up front)."""
    device = torch.device(device)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    # The tensor holds the mapping (frombuffer keeps its buffer alive) and unmaps it with it.
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


class BlockManager:
    """Hands out pool blocks from a free list and keeps each request's block table.

    Every call either succeeds or changes nothing: a request that cannot get all the blocks it
    needs gets none, so a ``KVCacheFull`` leaves the manager as it was.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_list: deque[int] = deque(range(num_blocks))
        self.block_tables: dict[RequestId, list[int]] = {}
        self.num_tokens: dict[RequestId, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_list)

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a reusable prefix (chapter 09); this manager keeps none."""
        return 0

    def __contains__(self, request_id: RequestId) -> bool:
        return request_id in self.block_tables

    def add(self, request_id: RequestId, num_tokens: int) -> list[int]:
        """Start a request with room for its ``num_tokens`` prompt tokens; returns its blocks."""
        if request_id in self.block_tables:
            raise InvalidRequestError(f"request {request_id!r} already holds KV blocks")
        if num_tokens < 0:
            raise InvalidRequestError(f"num_tokens must be >= 0, got {num_tokens}")
        self.block_tables[request_id] = self._take(request_id, blocks_for(num_tokens,
                                                                           self.block_size))
        self.num_tokens[request_id] = num_tokens
        return self.block_tables[request_id]

    def append(self, request_id: RequestId, n: int = 1) -> list[int]:
        """Make room for ``n`` more tokens. A new block is taken only when the last one is full;
        returns the blocks taken (usually none)."""
        table = self._table(request_id)
        total = self.num_tokens[request_id] + n
        new = self._take(request_id, blocks_for(total, self.block_size) - len(table))
        table.extend(new)
        self.num_tokens[request_id] = total
        return new

    def free(self, request_id: RequestId) -> None:
        """Give all of a request's blocks back (it finished or was aborted)."""
        self._release(self._table(request_id))
        del self.block_tables[request_id]
        del self.num_tokens[request_id]

    def truncate(self, request_id: RequestId, n: int) -> list[int]:
        """Take back the request's last ``n`` tokens (a speculative step's rejected draft
        tokens): its length drops by ``n`` and the blocks that leaves empty are given back;
        returns them, in block-table order. Their K/V need not be erased: the request's next
        tokens overwrite those slots before anything reads them."""
        table = self._table(request_id)
        total = self.num_tokens[request_id]
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= total:
            raise InvalidRequestError(f"request {request_id!r} holds {total} tokens; cannot "
                                      f"take back {n!r}")
        keep = blocks_for(total - n, self.block_size)
        freed = table[keep:]
        del table[keep:]
        self.num_tokens[request_id] = total - n
        self._release(freed[::-1])
        return freed

    def _release(self, blocks: list[int]) -> None:
        """Blocks a request let go of (a subclass may keep them for others: chapter 09). They
        are the next taken, the last given first: a pool whose memory the OS maps on first
        write (``zeroed_pool``) then stays resident only up to the most blocks ever in use at
        once, not the whole pool, and a block taken again is still warm in the caches."""
        self.free_list.extendleft(blocks)

    def slot(self, request_id: RequestId, t: int) -> int:
        """Where token ``t`` of the request lives in the pool, counted in tokens."""
        if not 0 <= t < self.num_tokens.get(request_id, 0):
            raise IndexError(f"request {request_id!r} has no token {t}")
        return self.block_tables[request_id][t // self.block_size] * self.block_size \
            + t % self.block_size

    def _table(self, request_id: RequestId) -> list[int]:
        if request_id not in self.block_tables:
            raise InvalidRequestError(f"request {request_id!r} holds no KV blocks")
        return self.block_tables[request_id]

    def _take(self, request_id: RequestId, needed: int) -> list[int]:
        if needed > len(self.free_list):
            raise KVCacheFull(
                f"request {request_id!r} needs {needed} more KV block(s) but only "
                f"{len(self.free_list)} of {self.num_blocks} are free "
                f"(block_size={self.block_size} tokens)"
            )
        return [self.free_list.popleft() for _ in range(needed)]


class PagedKVCache:
    """The block pool of a model plus the ``BlockManager`` that owns its blocks.

    ``kv`` holds every layer's K and V in one tensor of shape
    ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``: ``kv[layer, 0]`` is that
    layer's K blocks in the layout paged-attention kernels take (``flash_attn_with_kvcache``'s
    ``k_cache``), and ``slots`` views the same memory token by token.

    ``kv_heads``: how many KV heads the pool holds (None: the model's). A tensor-parallel rank
    holds only its own (chapter 12); the number of blocks is the engine's either way.
    ``block_manager``: the class that keeps the blocks (chapter 09's remembers prefixes).
    """

    def __init__(self, lm: LoadedModel, config: KVCacheConfig | None = None,
                 kv_heads: int | None = None,
                 block_manager: type[BlockManager] | None = None) -> None:
        self.config = config or KVCacheConfig()
        model_config = lm.config
        self.num_layers = model_config.num_hidden_layers
        self.kv_heads = kv_heads or model_config.num_key_value_heads
        self.head_dim = head_dim(model_config)
        block_size = self.config.block_size
        bytes_per_block = kv_bytes_per_block(model_config, lm.dtype, block_size)
        num_blocks = self.config.resolve_num_blocks(bytes_per_block, lm.max_context)
        self.block_manager = (block_manager or BlockManager)(num_blocks, block_size)
        self.kv = zeroed_pool(
            (self.num_layers, 2, num_blocks, block_size, self.kv_heads, self.head_dim),
            lm.dtype, lm.device)

    @property
    def block_size(self) -> int:
        return self.block_manager.block_size

    @property
    def num_blocks(self) -> int:
        return self.block_manager.num_blocks

    @property
    def slots(self) -> torch.Tensor:
        """``kv`` as ``[num_layers, 2, num_blocks * block_size, kv_heads, head_dim]``."""
        return self.kv.flatten(2, 3)

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes
