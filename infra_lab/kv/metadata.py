"""What one forward step over a batch needs to know about memory, as serving engines pass it
(vLLM's attention metadata, nano-vllm's `Context`): the caller builds it, the model's layers
only read it.

The new tokens of every sequence are flattened into one batch of N rows. Sequence b owns rows
query_starts[b]:query_starts[b + 1] and, once this step's keys and values are written, holds
context_lens[b] tokens; its block table says where they live, and slot_mapping[i] is the slot
(block * block_size + offset) where row i's key and value are written.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from infra_lab.kernels import paged_shapes


@dataclass(frozen=True)
class StepMetadata:
    query_starts: np.ndarray  # (B + 1,) int64: 0, then each sequence's last row + 1
    context_lens: np.ndarray  # (B,) int64: tokens per sequence after this step
    block_tables: np.ndarray  # (B, max_blocks) int64, -1 past a sequence's blocks
    slot_mapping: np.ndarray  # (N,) int64: where each new token's K and V go
    block_size: int
    _device_copies: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def n_tokens(self) -> int:
        return len(self.slot_mapping)

    @cached_property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_starts)

    @property
    def is_decode(self) -> bool:
        """Every sequence adds one token: the decode kernel's case."""
        return len(self.slot_mapping) == len(self.context_lens)

    @cached_property
    def positions(self) -> np.ndarray:
        """(N,) each new token's position in its sequence."""
        return paged_shapes.positions(self.query_starts, self.context_lens)

    @property
    def last_rows(self) -> np.ndarray:
        """(B,) each sequence's last row: where its next-token logits come from."""
        return self.query_starts[1:] - 1

    def check(self, num_blocks: int) -> None:
        """Raise ValueError, naming the first thing wrong, unless the arrays agree with each other
        and with a pool of `num_blocks` blocks."""
        starts, context, tables, slots = self.query_starts, self.context_lens, self.block_tables, self.slot_mapping
        batch = len(context)
        if context.ndim != 1 or batch < 1 or starts.shape != (batch + 1,) or tables.ndim != 2 \
                or len(tables) != batch or slots.ndim != 1:
            raise ValueError(f"need context_lens (B,) with B >= 1, query_starts (B + 1,), block_tables (B, "
                             f"max_blocks) and slot_mapping (N,); got {context.shape}, {starts.shape}, "
                             f"{tables.shape} and {slots.shape}")
        paged_shapes.check_queries(starts, context, len(slots))
        if (context > tables.shape[1] * self.block_size).any():
            b = int(np.argmax(context > tables.shape[1] * self.block_size))
            raise ValueError(f"sequence {b}: context_lens {context[b]} must be at most its table's "
                             f"{tables.shape[1] * self.block_size} slots")
        paged_shapes.check_tables(tables, context, num_blocks, self.block_size)
        if ((slots < 0) | (slots >= num_blocks * self.block_size)).any():
            bad = slots[(slots < 0) | (slots >= num_blocks * self.block_size)][0]
            raise ValueError(f"slot_mapping holds {bad}, outside the pool's {num_blocks * self.block_size} slots")
        where = self.positions
        owner = np.repeat(np.arange(batch), self.query_lens)
        expected = tables[owner, where // self.block_size] * self.block_size + where % self.block_size
        if (expected != slots).any():
            i = int(np.argmax(expected != slots))
            raise ValueError(f"slot_mapping[{i}] = {slots[i]}, but sequence {owner[i]}'s block table puts its "
                             f"position {where[i]} in slot {expected[i]}")

    def on(self, device):
        """The four arrays as int64 torch tensors on `device`, copied once per step."""
        key = str(device)
        if key not in self._device_copies:
            import torch

            self._device_copies[key] = tuple(torch.as_tensor(x, device=device) for x in (
                self.query_starts, self.context_lens, self.block_tables, self.slot_mapping))
        return self._device_copies[key]


def build(tables: list[list[int]], lengths_before: list[int], new_tokens: list[int],
          block_size: int) -> StepMetadata:
    """Metadata for sequences whose blocks are `tables`, holding `lengths_before` tokens, each
    adding `new_tokens` (the tables must already cover them)."""
    counts = np.asarray(new_tokens, np.int64)
    before = np.asarray(lengths_before, np.int64)
    width = max(max((len(t) for t in tables), default=1), 1)
    block_tables = np.full((len(tables), width), -1, np.int64)
    for row, table in enumerate(tables):
        block_tables[row, : len(table)] = table
    context = before + counts
    where = np.concatenate([np.arange(b, c) for b, c in zip(before, context)]) if len(tables) else np.zeros(0, np.int64)
    owner = np.repeat(np.arange(len(tables)), counts)
    slots = block_tables[owner, where // block_size] * block_size + where % block_size
    return StepMetadata(np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), context, block_tables,
                        slots.astype(np.int64), block_size)
