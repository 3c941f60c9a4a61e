"""Continuous batching: which sequences run in the next step, and how many tokens each.

A step is a list of ``(sequence, num_new_tokens)``. Two policies:

- ``prefill_first``: admit waiting prompts whole (up to the token budget) and run them as a
  prefill step; only when none can be admitted run one decode token for every running
  sequence. This is the classic colocated server, whose decodes stall behind each prefill.
- ``chunked``: every step decodes all running sequences first, then spends what is left of
  the token budget on prompt chunks (Sarathi-style), so a long prompt never stalls decodes
  by more than one budget's worth of compute.

When the pool runs out of blocks the newest running sequence is preempted by recompute: its
blocks are freed and it goes back to the front of the waiting queue with its generated
tokens, to be prefilled again (from its own blocks, if the prefix cache still has them).

Admission asks the block manager how much of a waiting sequence's prefix is cached: only
the rest counts against the token budget and is computed.

Imports config, sequence, block_manager.
"""

from __future__ import annotations

from collections import deque

from pdqueue.engine.block_manager import BlockManager
from pdqueue.engine.config import EngineConfig, PrefillPolicy
from pdqueue.engine.sequence import Sequence, SequenceStatus

ScheduledBatch = list[tuple[Sequence, int]]


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.policy = config.policy
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose blocks are allocated and whose KV is already in place (imported)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Forget ``seq`` (finished, aborted or handed off); its blocks are the caller's."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def schedule(self) -> ScheduledBatch:
        if self.policy == PrefillPolicy.PREFILL_FIRST:
            return self._admit(self.max_num_batched_tokens, whole_prompts=True) or self._decode_all()
        batch = self._decode_all()
        budget = self.max_num_batched_tokens - len(batch)
        for seq in self.running:  # continue prompts already being prefilled in chunks
            if budget <= 0:
                break
            if seq.num_uncomputed_tokens > 1:
                num_new = min(seq.num_uncomputed_tokens, budget)
                batch.append((seq, num_new))
                budget -= num_new
        return batch + self._admit(budget, whole_prompts=False)

    def _admit(self, budget: int, whole_prompts: bool) -> ScheduledBatch:
        batch: ScheduledBatch = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # A waiting sequence holds no blocks; a prefix cache hit is not computed again.
            num_new = seq.num_uncomputed_tokens - self.block_manager.num_hit_tokens(seq)
            if whole_prompts and batch and num_new > budget:
                break  # the first prompt may exceed the budget; later ones wait
            if not self.block_manager.can_allocate(seq):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            assert seq.num_uncomputed_tokens == num_new
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if not whole_prompts:
                num_new = min(num_new, budget)
            batch.append((seq, num_new))
            budget -= num_new
        return batch

    def _decode_all(self) -> ScheduledBatch:
        batch: ScheduledBatch = []
        for seq in list(self.running):
            if seq.status != SequenceStatus.RUNNING or seq.num_uncomputed_tokens != 1:
                continue  # preempted below, or still prefilling in chunks
            while not self.block_manager.can_append(seq):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.block_manager.append(seq)
                batch.append((seq, 1))
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
