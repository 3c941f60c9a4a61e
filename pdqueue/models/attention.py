"""Paged attention over the KV pool, and the plain causal attention used as its reference.

Owns: ``AttentionBatch`` (how a flat token batch maps to sequences), ``AttnSpec`` (a layer's
scale, sliding window and soft cap) and ``paged_attention`` (write the new K/V into their cache
slots, then attend per sequence through its block table). A sliding layer's query at position
``i`` sees positions ``i - window + 1 .. i`` (transformers' sliding-window mask); a soft-capped
layer's scores go through ``cap * tanh(scores / cap)`` before the softmax (Gemma 2), which
SDPA cannot do, so those layers run the same math in plain ops.

Imports torch only. Layout of one layer's cache: ``[2, num_blocks, block_size, num_kv_heads,
head_dim]`` (``kv_cache[layer]``; plane 0 holds K, plane 1 V).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch
import torch.nn.functional as F


class AttnSpec(NamedTuple):
    scale: float
    window: int | None = None    # None: the whole context
    softcap: float | None = None

    @property
    def plain(self) -> bool:
        return self.window is None and self.softcap is None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec, mask: torch.Tensor | None = None,
           is_causal: bool = False, enable_gqa: bool = False) -> torch.Tensor:
    """SDPA over 4-D ``[.., heads, tokens, D]`` inputs, or its math with ``spec.softcap``
    (scores scaled, capped, masked, softmax in float32 as transformers' eager attention)."""
    if spec.softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=spec.scale,
                                              enable_gqa=enable_gqa)
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * spec.scale
    scores = torch.tanh(scores / spec.softcap) * spec.softcap
    if is_causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


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

    # A decode step's contiguous K/V copies, one per sequence ([layers, 2, Hkv, capacity, D],
    # holding the tokens before this step's: pdqueue.engine.decode_kv); None: gather from the pool.
    decode_kv: list[torch.Tensor] | None = None

    _gather: tuple[torch.Tensor, list[int]] | None = None
    _spans: list[tuple[int, int]] | None = None
    _copy_views: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    _copy_meta: torch.Tensor | None = None

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

    @cached_property
    def is_decode(self) -> bool:
        """One new token per sequence (with ``query_starts`` 0, 1, 2, ...)."""
        return len(self.query_lens) == self.num_tokens and all(n == 1 for n in self.query_lens)

    def decode_spans(self, offsets: list[int], block_size: int) -> list[tuple[int, int]]:
        """Each sequence's (start, end) along the gathered tokens (``gather_plan``'s order);
        computed once a step and used by every layer."""
        if self._spans is None:
            self._spans = [(first * block_size, first * block_size + ctx)
                           for first, ctx in zip(offsets, self.context_lens)]
        return self._spans

    def copy_views(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per sequence, views of its ``decode_kv`` copy: (keys ``[L, 1, Hkv, context, D]``,
        values the same, the new token's slot ``[L, 2, Hkv, D]``); once a step, for every layer."""
        if self._copy_views is None:
            self._copy_views = [(c[:, 0, None, :, :n], c[:, 1, None, :, :n], c[:, :, :, n - 1])
                                for c, n in zip(self.decode_kv, self.context_lens)]
        return self._copy_views

    def copy_meta(self) -> torch.Tensor:
        """``decode_kv`` as ``models.fused.decode_attention`` reads it: [layers, B, META] int64 (per
        layer and sequence: where its K and V copies start, their strides, the tokens, store the
        new one); once a step, for every layer."""
        if self._copy_meta is None:
            rows, layer_bytes = [], []
            for c, n in zip(self.decode_kv, self.context_lens):
                _, _, num_kv_heads, capacity, head_dim = c.shape
                plane = num_kv_heads * capacity * head_dim * c.element_size()
                rows.append((c.data_ptr(), c.data_ptr() + plane, capacity * head_dim, head_dim, n, 1))
                layer_bytes.append(2 * plane)
            meta = torch.tensor(rows, dtype=torch.int64).repeat(self.decode_kv[0].shape[0], 1, 1)
            offsets = torch.arange(meta.shape[0])[:, None] * torch.tensor(layer_bytes)
            meta[:, :, 0] += offsets
            meta[:, :, 1] += offsets
            self._copy_meta = meta
        return self._copy_meta

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V ([T, Hkv, D]) at their flat slots."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec) -> torch.Tensor:
    """One sequence's queries [Q, H, D] attending causally to its context k/v [C, Hkv, D].

    The queries are the last Q positions of the C-token context. Returns [Q, H, D].
    """
    num_queries, num_heads, head_dim = q.shape
    num_ctx, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    if spec.window is not None and num_ctx > spec.window:
        if num_queries == 1:   # decode: the last `window` keys are all it sees
            k, v, num_ctx = k[-spec.window:], v[-spec.window:], spec.window
        else:
            return _windowed_attention(q, k, v, spec)
    # 4-D inputs: on CPU, SDPA then runs its fused flash kernel, ~2.5x faster than the
    # composite math path it takes for 3-D inputs.
    if num_queries == 1:
        # Decode: the one query sees the whole context, so no mask; fold the query heads
        # that share a kv head into the query axis instead of repeating K/V.
        out = attend(q.reshape(1, num_kv_heads, group, head_dim), k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                     spec)
        return out.reshape(1, num_heads, head_dim)
    q_t, k_t, v_t = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if num_queries == num_ctx:
        out = attend(q_t, k_t, v_t, spec, is_causal=True, enable_gqa=group > 1)
    else:
        # is_causal aligns the mask top-left; our queries are the context's tail.
        query_pos = torch.arange(num_ctx - num_queries, num_ctx, device=q.device)
        mask = torch.arange(num_ctx, device=q.device)[None, :] <= query_pos[:, None]
        out = attend(q_t, k_t, v_t, spec, mask=mask, enable_gqa=group > 1)
    return out[0].transpose(0, 1)


def _windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec) -> torch.Tensor:
    """``causal_attention`` of a sliding layer whose context is longer than its window: each
    query sees the ``window`` positions ending at its own."""
    num_queries, num_ctx = q.shape[0], k.shape[0]
    query_pos = torch.arange(num_ctx - num_queries, num_ctx, device=q.device)[:, None]
    key_pos = torch.arange(num_ctx, device=q.device)[None, :]
    mask = (key_pos <= query_pos) & (key_pos > query_pos - spec.window)
    group = q.shape[1] // k.shape[1]
    out = attend(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], spec, mask=mask,
                 enable_gqa=group > 1)
    return out[0].transpose(0, 1)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor,
                    batch: AttentionBatch, spec: AttnSpec, layer: int = 0, ops=None) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] for the batch's new tokens -> attention output [T, H, D].
    ``layer_cache``: the layer's K and V planes, ``[2, num_blocks, block_size, Hkv, D]``;
    ``layer``: its index (for ``batch.decode_kv``); ``ops``: ``models.fused.FusedOps`` (q, k
    and v then the parts of one row each), which every one-query attention goes through, in
    any step, so that a sequence's numbers do not depend on what shares its step (the kernels
    implement plain attention only: ``models.fused.ops`` gives none to other models)."""
    scale = spec.scale
    if ops is not None and batch.decode_kv is not None:
        pool = (layer_cache[0], layer_cache[1], batch.slot_mapping)   # stored by the same call
        out = ops.decode_attention(q, q.shape[1], k.shape[1], q.shape[2], batch.copy_meta()[layer], scale, pool)
        return out.view(q.shape)
    write_kv(k, v, layer_cache[0], layer_cache[1], batch.slot_mapping)
    if batch.decode_kv is not None:
        return _copied_decode_attention(q, k, v, batch, layer, spec)
    block_size, num_kv_heads, head_dim = layer_cache.shape[2:]
    blocks, offsets = batch.gather_plan(block_size)
    # K and V in one gather (a decode step is many small ops: each one saved counts).
    gathered = layer_cache.index_select(1, blocks)
    if batch.is_decode and ops is None:
        return _decode_attention(q, gathered, batch, offsets, block_size, spec)
    out = torch.empty_like(q)
    all_k, all_v = gathered
    # One sequence at a time, so a sequence's numbers never depend on its batch mates
    # (its K/V slices hold the same bytes whatever else was gathered beside them).
    for start, num_queries, num_ctx, first in zip(
            batch.query_starts, batch.query_lens, batch.context_lens, offsets):
        num_blocks = (num_ctx + block_size - 1) // block_size
        seq_k = all_k[first:first + num_blocks].view(-1, num_kv_heads, head_dim)[:num_ctx]
        seq_v = all_v[first:first + num_blocks].view(-1, num_kv_heads, head_dim)[:num_ctx]
        if ops is not None and num_queries == 1:
            meta = torch.tensor([[seq_k.data_ptr(), seq_v.data_ptr(), head_dim, num_kv_heads * head_dim, num_ctx, 0]])
            out[start] = ops.decode_attention(q[start:start + 1], q.shape[1], num_kv_heads, head_dim, meta,
                                              scale).view(q.shape[1:])
        else:
            out[start:start + num_queries] = causal_attention(q[start:start + num_queries], seq_k, seq_v, spec)
    return out


def _decode_attention(q: torch.Tensor, gathered: torch.Tensor, batch: AttentionBatch, offsets: list[int],
                      block_size: int, spec: AttnSpec) -> torch.Tensor:
    """``paged_attention`` for a batch of one query per sequence (a decode step), with as
    few tensor ops as it takes: at batch 1 a layer's attention is ~10 small ops, and their
    fixed costs, not the bytes, are what a step pays. The same numbers as
    ``causal_attention`` (the same SDPA call on the same K/V slices)."""
    _, _, _, num_kv_heads, head_dim = gathered.shape
    num_heads = q.shape[1]
    # [2, Hkv, gathered tokens, D]: each sequence's K/V is a slice along the token axis.
    planes = gathered.view(2, -1, num_kv_heads, head_dim).transpose(1, 2)
    queries = q.view(q.shape[0], 1, num_kv_heads, num_heads // num_kv_heads, head_dim)
    keys, values = planes[0, None], planes[1, None]   # [1, Hkv, tokens, D]
    window = spec.window or 1 << 62   # a sliding layer: the last `window` keys
    outs = [attend(queries[i], keys[:, :, max(start, end - window):end], values[:, :, max(start, end - window):end],
                   spec) for i, (start, end) in enumerate(batch.decode_spans(offsets, block_size))]
    return _joined(outs, q.shape)


def _joined(outs: list[torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """Per-sequence decode outputs [1, Hkv, group, D] -> [B, H, D] (no copy for one)."""
    return (outs[0] if len(outs) == 1 else torch.cat(outs)).reshape(shape)   # CUDA SDPA may give a strided output


def _copied_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch,
                             layer: int, spec: AttnSpec) -> torch.Tensor:
    """A decode step over each sequence's contiguous copy (``batch.decode_kv``): the new
    token's K/V goes into the copy too, and SDPA reads the copy. No gather; the same numbers
    as ``_decode_attention``."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    queries = q.view(num_seqs, 1, num_kv_heads, num_heads // num_kv_heads, head_dim)
    new = torch.stack((k, v), dim=1)   # [B, 2, Hkv, D]
    outs = []
    first = -spec.window if spec.window else None   # a sliding layer: the last `window` keys
    for i, (keys, values, slot) in enumerate(batch.copy_views()):
        slot[layer].copy_(new[i])
        outs.append(attend(queries[i], keys[layer][..., first:, :], values[layer][..., first:, :], spec))
    return _joined(outs, q.shape)


@dataclass
class PaddedDecode:
    """A decode step in fixed shapes, so that it can be captured once and replayed (CUDA
    graphs: pdqueue.engine.cuda_graphs). Rows past the real sequences repeat a real row.

    ``slot_mapping`` [B]; ``block_tables`` [B, nb] (unused entries name any block: masked);
    ``context_lens`` [B]; ``write_rows`` [B]: the row whose new K/V each row stores (a padded
    row stores its source row's bytes into its source row's slot, so the duplicate write
    cannot change what is there)."""

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    write_rows: torch.Tensor


def padded_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor,
                            batch: PaddedDecode, spec: AttnSpec) -> torch.Tensor:
    """``paged_attention`` for a decode step without data-dependent shapes or host syncs:
    every sequence gathers ``nb`` blocks and a mask hides the positions past its context.
    The same attention as ``_decode_attention`` up to float rounding (one SDPA over the
    padded batch instead of one per sequence)."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    rows = batch.write_rows
    write_kv(k.index_select(0, rows), v.index_select(0, rows), layer_cache[0], layer_cache[1], batch.slot_mapping)
    # [2, B, nb, block, Hkv, D] -> [2, B, Hkv, nb * block, D]
    kv = layer_cache[:, batch.block_tables].flatten(2, 3).transpose(2, 3)
    positions = torch.arange(kv.shape[3], device=q.device)[None, :]
    visible = positions < batch.context_lens[:, None]   # [B, C]
    if spec.window is not None:
        visible &= positions >= batch.context_lens[:, None] - spec.window
    queries = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = attend(queries, kv[0], kv[1], spec, mask=visible[:, None, None, :])
    return out.reshape(num_seqs, num_heads, head_dim)
