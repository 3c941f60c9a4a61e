"""Moving blocks between pools, and cutting a block set into wire frames.

A pool ``[L, 2, num_blocks, block_size, kv_heads, head_dim]`` is handled as ``planes``:
``[L*2, num_blocks, block_elems]``. Blocks are copied one run of consecutive (source,
destination) ids at a time across all planes at once: several times faster than advanced
indexing (``dst[:, :, ids] = src[:, :, ids]``, which makes a temporary) or a copy per layer,
and close to a plain contiguous copy.
Imports torch only. Owns nothing.
"""

from __future__ import annotations

from typing import Sequence

import torch

# Large zmq frames are received well below socket speed; 4 MiB frames let staging, the wire and
# the receiver's copy overlap (docs/performance-history.md, "What changed in transfer version 4").
MAX_FRAME_BYTES = 4 << 20


def planes(pool: torch.Tensor) -> torch.Tensor:
    """View a contiguous pool as [L*2, num_blocks, block_elems]."""
    if not pool.is_contiguous():
        raise ValueError("KV pool tensor must be contiguous")
    return pool.view(pool.shape[0] * pool.shape[1], pool.shape[2], -1)


def block_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Coalesce id pairs into runs (src_start, dst_start, length) of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def copy_blocks(src: torch.Tensor, src_ids: Sequence[int], dst: torch.Tensor, dst_ids: Sequence[int]) -> None:
    """dst[:, dst_ids[i]] = src[:, src_ids[i]] for plane tensors [P, blocks, elems]."""
    for s, d, n in block_runs(src_ids, dst_ids):
        dst[:, d:d + n].copy_(src[:, s:s + n])


def position_runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """[b0, b1) ranges of positions whose block ids are consecutive."""
    runs: list[tuple[int, int]] = []
    for i, b in enumerate(block_ids):
        if runs and block_ids[i - 1] + 1 == b:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def plan_frames(num_planes: int, num_blocks: int, block_nbytes: int,
                max_frame_bytes: int = MAX_FRAME_BYTES) -> list[tuple[int, int, int, int]]:
    """Cut a staged [num_planes, num_blocks] block set into contiguous frames of at most
    ``max_frame_bytes`` (one block at least): (plane_start, plane_end, block_start, block_end),
    whole planes when one fits, else block ranges of a single plane. Both ends compute the
    plan, so the receiver checks every frame's size against it."""
    plane_nbytes = num_blocks * block_nbytes
    if num_blocks == 0:
        return []
    if plane_nbytes <= max_frame_bytes:
        step = max(1, max_frame_bytes // plane_nbytes)
        return [(p, min(p + step, num_planes), 0, num_blocks) for p in range(0, num_planes, step)]
    step = max(1, max_frame_bytes // block_nbytes)
    return [(p, p + 1, b, min(b + step, num_blocks))
            for p in range(num_planes) for b in range(0, num_blocks, step)]
