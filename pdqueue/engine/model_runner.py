"""Turns a scheduled batch into one model call and returns the logits to sample from.

The batch is flattened: every sequence contributes tokens
``[num_cached_tokens, num_cached_tokens + num_new)``; their KV goes to the slots its block
table names. Logits are computed only for sequences whose step reaches their last token.

Imports torch and models; owns no blocks (the block manager does) and no sequences.
"""

from __future__ import annotations

import torch

from pdqueue.engine.cuda_graphs import GraphedDecode
from pdqueue.engine.decode_kv import DecodeKV
from pdqueue.engine.sequence import Sequence
from pdqueue.models.attention import AttentionBatch


class ModelRunner:
    def __init__(self, model, kv_cache: torch.Tensor, block_size: int, device: str | torch.device = "cpu",
                 decode_kv: bool | None = None, graphs: GraphedDecode | None = None):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = torch.device(device)
        # Decode steps read contiguous per-sequence copies of the K/V instead of gathering
        # the blocks every layer (engine/decode_kv.py); None: always gather. By default on
        # CPU only: there memory is plentiful and the gather is slow; an accelerator's
        # memory is better spent on the pool.
        if decode_kv is None:
            decode_kv = self.device.type == "cpu"
        self.decode_kv = DecodeKV(kv_cache, block_size) if decode_kv else None
        # Decode steps replayed from CUDA graphs (engine/cuda_graphs.py); None: always eager.
        self.graphs = graphs

    @torch.inference_mode()
    def run(self, batch: list[tuple[Sequence, int]],
            paused: tuple = ()) -> tuple[torch.Tensor | None, list[Sequence]]:
        """Run one step; returns (float32 logits [R, vocab] on CPU, the R sequences they belong to).
        ``paused``: decodes that sit this step out and keep their K/V copies (decode_kv.py)."""
        if self.graphs is not None and self.graphs.fits(batch):
            return self.graphs.run(batch), [seq for seq, _ in batch]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_starts, query_lens, context_lens, block_tables = [], [], [], []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        bs = self.block_size
        for seq, num_new in batch:
            start = seq.num_cached_tokens
            end = start + num_new
            query_starts.append(len(input_ids))
            query_lens.append(num_new)
            context_lens.append(end)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            block_tables.append(torch.tensor(table[: (end + bs - 1) // bs], dtype=torch.long))
            if end == seq.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                sample_seqs.append(seq)
        dev = self.device
        attn = AttentionBatch(
            query_starts=query_starts,
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=[t.to(dev) for t in block_tables],
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
        )
        seqs = [seq for seq, _ in batch]
        if self.decode_kv is not None:
            attn.decode_kv = self.decode_kv.prepare(seqs, context_lens, attn.block_tables, attn.is_decode, paused)
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            attn,
            self.kv_cache,
        )
        if attn.decode_kv is not None:
            self.decode_kv.advance(seqs, context_lens)
        if not sample_rows:
            return None, []
        rows = torch.tensor(sample_rows, dtype=torch.long, device=dev)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        return logits.float().cpu(), sample_seqs
