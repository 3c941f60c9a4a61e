"""Contiguous copies of the running sequences' K/V, so that a decode step does not gather.

Why: the KV pool is paged (blocks of 16 tokens anywhere in the pool), and torch has no
attention kernel that reads a block table, so every layer of every step used to gather each
sequence's blocks into a contiguous tensor (``index_select``) before SDPA read them again:
twice the bytes of attention, copied once more. At batch 32 with ~240-token contexts that
gather was ~40 % of the attention time; at batch 1 ~1.5 ms a step. Here each sequence in a
decode step keeps its K/V in a tensor of its own, ``[layers, 2, Hkv, capacity, D]``, built
once from the pool (one gather for all layers) and then appended one token per layer per
step beside the pool write. SDPA reads the same numbers from it as from a gather, so the
results are identical bit for bit (strides do not change SDPA's arithmetic: checked for
1..3000 tokens by ``tests/test_engine.py``); the pool stays the truth (transfers, the prefix
cache, preemption).

A copy is used only while it follows its sequence step by step: it is built for a sequence
whose copy is missing or does not hold exactly the tokens before this step's, and dropped
when the sequence finishes or is aborted (``release``, from the engine), or is in a step
that is not a pure decode step (a prefill, a recompute after preemption, a chunk beside
prefills) or in no step at all (preempted), unless the engine names it ``paused``: a
background decode that sits steps out (policies.ClassShare) keeps its copy, which still holds
exactly its context, since nothing wrote its KV meanwhile.
Copies take at most ``budget_bytes`` (the pool's size by default: they never hold more
tokens than the pool does, plus growth room); a step whose copies would not fit gathers.

Imports torch only. Owns no blocks and no sequences (keys are the sequences the runner
passes; a reference is kept, so an object id cannot be reused while its copy lives).
"""

from __future__ import annotations

import torch

GROWTH = 1.5        # capacity for a context of n tokens: n * GROWTH + ROUND tokens, rounded up
ROUND = 64


class DecodeKV:
    def __init__(self, kv_cache: torch.Tensor, block_size: int, budget_bytes: int | None = None):
        self.kv_cache = kv_cache                      # [layers, 2, num_blocks, block_size, Hkv, D]
        self.block_size = block_size
        layers, _, _, _, self.num_kv_heads, self.head_dim = kv_cache.shape
        self.num_layers = layers
        self.bytes_per_token = layers * 2 * self.num_kv_heads * self.head_dim * kv_cache.element_size()
        self.budget_bytes = kv_cache.numel() * kv_cache.element_size() if budget_bytes is None else budget_bytes
        # id(seq) -> (seq, copy [layers, 2, Hkv, capacity, D], tokens it holds); holding seq
        # keeps its id from being reused by another sequence while the entry lives.
        self._copies: dict[int, tuple[object, torch.Tensor, int]] = {}
        self.builds = 0   # copies built from the pool (tests, debugging)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t, _ in self._copies.values())

    def prepare(self, seqs: list, context_lens: list[int], block_tables: list[torch.Tensor],
                is_decode: bool, paused: tuple = ()) -> list[torch.Tensor] | None:
        """Before a step's forward: each sequence's copy, holding its ``context_len - 1``
        tokens before this step's one, or None (gather) when this is not a pure decode step
        or the copies would not fit the budget. ``paused``: running sequences not in this
        step whose copies stay."""
        keep = {id(s) for s in seqs} if is_decode else set()
        keep.update(id(s) for s in paused)
        for key in [k for k in self._copies if k not in keep]:
            del self._copies[key]
        if not is_decode:
            return None
        missing, need = [], self.nbytes
        for i, (seq, ctx) in enumerate(zip(seqs, context_lens)):
            entry = self._copies.get(id(seq))
            if entry is None or entry[2] != ctx - 1 or entry[1].shape[3] < ctx:
                if entry is not None:
                    need -= entry[1].numel() * entry[1].element_size()
                    del self._copies[id(seq)]
                missing.append(i)
                need += self._capacity(ctx) * self.bytes_per_token
        if need > self.budget_bytes:   # paused sequences' copies go first (rebuilt when they run)
            stepping = {id(s) for s in seqs}
            for key in [k for k in self._copies if k not in stepping]:
                need -= self._copies[key][1].numel() * self._copies[key][1].element_size()
                del self._copies[key]
                if need <= self.budget_bytes:
                    break
        if need > self.budget_bytes:
            self._copies.clear()
            return None
        for i in missing:
            self._build(seqs[i], context_lens[i], block_tables[i])
        return [self._copies[id(s)][1] for s in seqs]

    def advance(self, seqs: list, context_lens: list[int]) -> None:
        """After a decode step's forward: each copy holds its sequence's context."""
        for seq, ctx in zip(seqs, context_lens):
            _, copy, _ = self._copies[id(seq)]
            self._copies[id(seq)] = (seq, copy, ctx)

    def release(self, seq) -> None:
        """``seq`` is finished or gone: its copy too."""
        self._copies.pop(id(seq), None)

    def _capacity(self, ctx: int) -> int:
        return -(-int(ctx * GROWTH + ROUND) // ROUND) * ROUND

    def _build(self, seq, ctx: int, block_table: torch.Tensor) -> None:
        held = ctx - 1
        copy = self.kv_cache.new_empty((self.num_layers, 2, self.num_kv_heads, self._capacity(ctx), self.head_dim))
        if held:
            blocks = block_table[: -(-held // self.block_size)]
            # One gather for all layers: [L, 2, n, block, Hkv, D] -> [L, 2, Hkv, n * block, D]
            gathered = self.kv_cache.index_select(2, blocks).flatten(2, 3)[:, :, :held]
            copy[:, :, :, :held].copy_(gathered.transpose(2, 3))
        self._copies[id(seq)] = (seq, copy, held)
        self.builds += 1
