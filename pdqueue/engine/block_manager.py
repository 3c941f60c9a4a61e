"""Owner of the KV pool's blocks: which are free, which belong to which sequence.

Check/act pairs, as in nano-vllm: the caller asks ``can_allocate``/``can_append`` and only
then calls ``allocate``/``append``, so running out of blocks is a scheduling decision, not
an exception. A sequence's blocks are freed by ``free(seq)``; blocks detached from a
sequence (exported to a decode worker under a lease) come back through ``free_blocks``.

Imports nothing but sequence.
"""

from __future__ import annotations

from collections import deque

from pdqueue.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def can_allocate(self, seq: Sequence) -> bool:
        return self.blocks_for(seq.num_tokens) - len(seq.block_table) <= len(self._free)

    def allocate(self, seq: Sequence) -> None:
        """Give ``seq`` blocks for all of its current tokens."""
        needed = self.blocks_for(seq.num_tokens) - len(seq.block_table)
        if needed > len(self._free):
            raise RuntimeError(f"allocate without can_allocate: need {needed}, free {len(self._free)}")
        for _ in range(needed):
            seq.block_table.append(self._take())

    def can_append(self, seq: Sequence) -> bool:
        """Room to compute the sequence's next token (its last one) without a new block, or a free block."""
        return len(seq.block_table) * self.block_size >= seq.num_tokens or len(self._free) >= 1

    def append(self, seq: Sequence) -> None:
        if len(seq.block_table) * self.block_size < seq.num_tokens:
            if not self._free:
                raise RuntimeError("append without can_append")
            seq.block_table.append(self._take())

    def free(self, seq: Sequence) -> None:
        self.free_blocks(seq.block_table)
        seq.block_table = []
        seq.num_cached_tokens = 0

    def detach(self, seq: Sequence) -> list[int]:
        """Take the blocks away from ``seq`` without freeing them; the caller returns them
        with ``free_blocks`` (after the lease on them ends)."""
        block_ids, seq.block_table = seq.block_table, []
        return block_ids

    def free_blocks(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if block_id not in self._used:
                raise RuntimeError(f"block {block_id} freed twice or never allocated")
            self._used.remove(block_id)
            self._free.append(block_id)

    def _take(self) -> int:
        block_id = self._free.popleft()
        self._used.add(block_id)
        return block_id
