"""The step batch: one forward's tokens as plain tensors, the one thing every forward takes.

A step flattens its requests' new tokens into one sequence ``[T]``: decodes first (one token
each, chapter 06), then prompt chunks (chapter 08), then, for a request scored at ``k + 1``
positions (chapter 14's verification), its ``k + 1`` tokens like a chunk. What the forward needs
to know about them is a handful of flat tensors and three numbers, collected here:

- ``input_ids``, ``positions``: the tokens and where they sit in their sequence;
- ``slot_mapping``: the pool slot each token's K/V is written to;
- ``block_tables``, ``context_lens``: one row per request, its blocks and how many tokens it
  has cached once this step's are written;
- ``query_starts``: where each chunk's tokens start (``cu_seqlens_q``), counted from the first
  chunk token; ``token_rows``: each token's request row (what a compiled forward gathers its
  block table by);
- ``logits_rows``: the positions the LM head scores (None: every one).

The eager forwards turn it into attention metadata through
:class:`~miniinfer.runner.attention.PagedAttention`; the compiled forward reads the pool with it
inside its graph; the tensor-parallel forward sends it to every rank by walking its fields
(:meth:`StepBatch.pack`), with no wire format of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Fields held as int32 (block tables and lengths, as the kernels read them); the others int64.
INT32_FIELDS = ("block_tables", "context_lens", "query_starts", "token_rows")
# The fields that are numbers on the host, not tensors.
NUMBER_FIELDS = ("num_decodes", "max_query_len", "max_context_len")


@dataclass(slots=True)
class StepBatch:
    """One forward's tokens, flattened (decodes first), and where their K/V live."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # int64 [T]
    block_tables: torch.Tensor  # int32 [R, W], padded with 0; decode rows first
    context_lens: torch.Tensor  # int32 [R], cached tokens including this step's
    token_rows: torch.Tensor  # [T], each token's row in block_tables
    num_decodes: int  # the first num_decodes rows feed one token each (tokens [0, num_decodes))
    query_starts: torch.Tensor | None = None  # int32 [R - num_decodes + 1]; None: no chunks
    max_query_len: int = 1  # the longest chunk
    logits_rows: torch.Tensor | None = None  # [rows] scored; None: every token
    # A bound on context_lens known on the host (None: a kernel that needs one reads it back).
    max_context_len: int | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_chunks(self) -> int:
        return self.block_tables.shape[0] - self.num_decodes

    def pack(self) -> tuple[list[int], torch.Tensor]:
        """The batch as a header of ints (per field: a tensor's shape, -1 for None, or the
        number itself) and one flat int64 payload of every tensor, in field order."""
        header, tensors = [], []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, torch.Tensor):
                rows, cols = (*value.shape, -1) if value.dim() == 1 else value.shape
                header += [rows, cols]
                tensors.append(value.flatten().long())
            elif value is None:
                header += [-1, -1]
            else:
                header += [int(value), -1]
        return header, torch.cat(tensors)

    @classmethod
    def unpack(cls, header: Sequence[int], payload: torch.Tensor) -> StepBatch:
        """:meth:`pack` undone (on another rank, with the payload on its device)."""
        values, offset = {}, 0
        for i, field in enumerate(dataclasses.fields(cls)):
            rows, cols = header[2 * i : 2 * i + 2]
            if field.name in NUMBER_FIELDS:
                values[field.name] = None if rows < 0 else rows
                continue
            if rows < 0:
                values[field.name] = None
                continue
            size = rows * cols if cols >= 0 else rows
            tensor = payload[offset : offset + size]
            offset += size
            if cols >= 0:
                tensor = tensor.view(rows, cols)
            values[field.name] = tensor.int() if field.name in INT32_FIELDS else tensor
        return cls(**values)

    @staticmethod
    def header_len() -> int:
        return 2 * len(dataclasses.fields(StepBatch))

    @staticmethod
    def payload_len(header: Sequence[int]) -> int:
        """How many int64s :meth:`pack`'s payload holds, from its header."""
        total = 0
        for i, field in enumerate(dataclasses.fields(StepBatch)):
            rows, cols = header[2 * i : 2 * i + 2]
            if field.name not in NUMBER_FIELDS and rows >= 0:
                total += rows * cols if cols >= 0 else rows
        return total


def decode_batch(input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor,
                 token_rows: torch.Tensor | None = None,
                 max_context_len: int | None = None) -> StepBatch:
    """A step of decodes only: one token per request, every row scored."""
    if token_rows is None:
        token_rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    return StepBatch(input_ids, positions, slot_mapping, block_tables, context_lens, token_rows,
                     num_decodes=input_ids.shape[0], max_context_len=max_context_len)
