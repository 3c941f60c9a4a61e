"""Decode steps replayed from CUDA graphs.

On an accelerator a decode step of a small model is bound by kernel launches, not by the
GPU: SmolLM2's step is hundreds of small kernels, each launched from Python. A CUDA graph
records the step's kernels once and replays them with one launch. A graph replays fixed
shapes at fixed addresses, so the step runs in the padded form
(``models.attention.PaddedDecode``): the batch rounded up to a bucket (1, 2, 4, ... up to
``max_num_seqs``), every sequence's block table padded to a context bucket (powers of two
blocks, up to the model's context), inputs copied into one static buffer per step. One graph
per (batch bucket, context bucket), captured when first needed, all in one memory pool.

Prefill steps, mixed steps and quantized (CPU) models run eagerly as before.

Imports torch and models.
"""

from __future__ import annotations

import torch

from pdqueue.engine.sequence import Sequence
from pdqueue.models.attention import PaddedDecode

# The static buffer's columns before the block table: input id, position, slot, context
# length, write row.
_IDS, _POS, _SLOT, _LEN, _ROW, _TABLE = range(6)


def _buckets(limit: int, first: int) -> list[int]:
    sizes, size = [], first
    while size < limit:
        sizes.append(size)
        size *= 2
    return [*sizes, limit]


def padded_inputs(batch: list[tuple[Sequence, int]], rows: int, blocks: int, block_size: int) -> list[list[int]]:
    """A decode step's inputs as ``rows`` rows of ``_TABLE + blocks`` integers: per sequence
    its new token, position, slot, context length, write row and block table (unused entries
    block 0, which the mask hides); rows past the batch repeat row 0, its write row included."""
    bs = block_size
    host = []
    for i, (seq, _) in enumerate(batch):
        pos = seq.num_tokens - 1
        table = seq.block_table[: -(-seq.num_tokens // bs)]
        row = [seq.token_ids[pos], pos, table[pos // bs] * bs + pos % bs, seq.num_tokens, i, *table]
        host.append(row + [0] * (_TABLE + blocks - len(row)))
    return host + [host[0]] * (rows - len(batch))


def padded_decode(static: torch.Tensor, blocks: int) -> tuple[torch.Tensor, torch.Tensor, PaddedDecode]:
    """(input ids, positions, the PaddedDecode) as views of ``static`` (``padded_inputs``' rows)."""
    batch = PaddedDecode(slot_mapping=static[:, _SLOT], block_tables=static[:, _TABLE:_TABLE + blocks],
                         context_lens=static[:, _LEN], write_rows=static[:, _ROW])
    return static[:, _IDS], static[:, _POS], batch


class GraphedDecode:
    def __init__(self, model, kv_cache: torch.Tensor, block_size: int, max_num_seqs: int, max_model_len: int):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = kv_cache.device
        max_blocks = -(-max_model_len // block_size)
        self.batch_buckets = _buckets(max_num_seqs, 1)
        self.block_buckets = _buckets(max_blocks, min(4, max_blocks))
        self.static = torch.zeros(max_num_seqs, _TABLE + max_blocks, dtype=torch.long, device=self.device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.replays = 0

    @staticmethod
    def usable(model, device: torch.device) -> bool:
        """CUDA graphs need a CUDA device and torch's ops (not the CPU-only fused kernels)."""
        return device.type == "cuda" and getattr(model, "fused", None) is None

    def fits(self, batch: list[tuple[Sequence, int]]) -> bool:
        """A decode step (one new token per sequence, each sampled) within the largest buckets."""
        return (len(batch) <= self.batch_buckets[-1]
                and all(n == 1 and seq.num_cached_tokens + 1 == seq.num_tokens for seq, n in batch))

    def run(self, batch: list[tuple[Sequence, int]]) -> torch.Tensor:
        """The step's float32 logits [len(batch), vocab] on CPU (the new K/V are in the pool)."""
        n = len(batch)
        bs = self.block_size
        rows = next(b for b in self.batch_buckets if b >= n)
        needed = max(-(-seq.num_tokens // bs) for seq, _ in batch)
        blocks = next(b for b in self.block_buckets if b >= needed)
        host = padded_inputs(batch, rows, blocks, bs)
        self.static[:rows, :_TABLE + blocks].copy_(torch.tensor(host, dtype=torch.long))
        key = (rows, blocks)
        if key not in self.graphs:
            self.graphs[key] = self._capture(rows, blocks)
        graph, logits = self.graphs[key]
        graph.replay()
        self.replays += 1
        return logits[:n].float().cpu()

    def _step(self, rows: int, blocks: int) -> torch.Tensor:
        ids, positions, batch = padded_decode(self.static[:rows], blocks)
        return self.model.padded_decode_logits(ids, positions, batch, self.kv_cache)

    def _capture(self, rows: int, blocks: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm up on a side stream first (lazy initialisations, cuBLAS workspaces), as torch
        # asks; the warm-up computes this very step, so its K/V writes are the replay's.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._step(rows, blocks)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._step(rows, blocks)
        return graph, logits
