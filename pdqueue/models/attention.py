"""Paged attention over the KV pool, and the plain causal attention used as its reference.

Owns: ``AttentionBatch`` (how a flat token batch maps to sequences) and ``paged_attention``
(write the new K/V into their cache slots, then attend per sequence through its block table).

Imports torch only. Layout of one layer's cache plane: ``[num_blocks, block_size,
num_kv_heads, head_dim]`` (a view of ``kv_cache[layer, 0]`` for K or ``[layer, 1]`` for V).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionBatch:
    """Where each sequence's new tokens sit in the flat batch and in the cache.

    ``context_lens`` counts the tokens in the cache after this step, new ones included;
    query ``i`` of a sequence sits at position ``context_len - query_len + i``.
    """

    query_starts: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[torch.Tensor]  # LongTensor per sequence, on the cache's device
    slot_mapping: torch.Tensor  # LongTensor[T]: block_id * block_size + offset per new token

    _gather: tuple[torch.Tensor, list[int]] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def gather_plan(self, block_size: int) -> tuple[torch.Tensor, list[int]]:
        """(every sequence's context blocks, concatenated; each sequence's first index in
        it). Built once per step and used by every layer: one gather per layer instead of
        one per sequence."""
        if self._gather is None:
            tables, offsets, total = [], [], 0
            for table, num_ctx in zip(self.block_tables, self.context_lens):
                num_blocks = (num_ctx + block_size - 1) // block_size
                tables.append(table[:num_blocks])
                offsets.append(total)
                total += num_blocks
            self._gather = (torch.cat(tables), offsets)
        return self._gather

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V ([T, Hkv, D]) at their flat slots."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence's queries [Q, H, D] attending causally to its context k/v [C, Hkv, D].

    The queries are the last Q positions of the C-token context. Returns [Q, H, D].
    """
    num_queries, num_heads, head_dim = q.shape
    num_ctx, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    # 4-D inputs: on CPU, SDPA then runs its fused flash kernel, ~2.5x faster than the
    # composite math path it takes for 3-D inputs.
    if num_queries == 1:
        # Decode: the one query sees the whole context, so no mask; fold the query heads
        # that share a kv head into the query axis instead of repeating K/V.
        out = F.scaled_dot_product_attention(
            q.reshape(1, num_kv_heads, group, head_dim), k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            scale=scale)
        return out.reshape(1, num_heads, head_dim)
    q_t, k_t, v_t = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if num_queries == num_ctx:
        out = F.scaled_dot_product_attention(q_t, k_t, v_t, is_causal=True, scale=scale, enable_gqa=group > 1)
    else:
        # is_causal aligns the mask top-left; our queries are the context's tail.
        query_pos = torch.arange(num_ctx - num_queries, num_ctx, device=q.device)
        mask = torch.arange(num_ctx, device=q.device)[None, :] <= query_pos[:, None]
        out = F.scaled_dot_product_attention(q_t, k_t, v_t, attn_mask=mask, scale=scale, enable_gqa=group > 1)
    return out[0].transpose(0, 1)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, batch: AttentionBatch, scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] for the batch's new tokens -> attention output [T, H, D]."""
    write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    out = torch.empty_like(q)
    blocks, offsets = batch.gather_plan(block_size)
    all_k = k_cache.index_select(0, blocks)
    all_v = v_cache.index_select(0, blocks)
    # One sequence at a time, so a sequence's numbers never depend on its batch mates
    # (its K/V slices hold the same bytes whatever else was gathered beside them).
    for start, num_queries, num_ctx, first in zip(
            batch.query_starts, batch.query_lens, batch.context_lens, offsets):
        num_blocks = (num_ctx + block_size - 1) // block_size
        seq_k = all_k[first:first + num_blocks].view(-1, num_kv_heads, head_dim)[:num_ctx]
        seq_v = all_v[first:first + num_blocks].view(-1, num_kv_heads, head_dim)[:num_ctx]
        out[start:start + num_queries] = causal_attention(q[start:start + num_queries], seq_k, seq_v, scale)
    return out
