"""KV blocks encoded for where they rest (the host and disk tiers, engine/kv_tiers.py) and
travel (the TCP and ZeroMQ wires, transfer/tcp.py, transfer/zmq.py): ``native``, ``fp16``
or ``int8``, chosen by the operator (``--kv-tier-format``, ``--kv-wire-format``).

The unit is one block of one plane (a (layer, K-or-V) pair of the pool
``[L, 2, num_blocks, block_size, kv_heads, head_dim]``, seen as planes
``[2L, num_blocks, block_elems]``, transfer.blocks.planes): it encodes into ``unit_nbytes``
bytes, the same for every unit, so a run of blocks encodes into a contiguous buffer
``[planes, blocks, unit_nbytes]`` (uint8) that any range of planes and blocks can be cut out
of, exactly as a native block set is cut into frames (transfer.blocks.plan_frames with
``unit_nbytes`` for the block size). Each unit decodes on its own.

- ``native``: the pool's dtype, bit for bit (what every path moved before formats).
- ``fp16``: 16-bit floats. For a float32 pool, IEEE float16 (10 mantissa bits: a relative
  error of at most 2**-11, eight times below bfloat16's; values beyond float16's range,
  +-65504, are clamped there rather than turned into infinities, which would poison
  attention). For a 16-bit pool (float16 or bfloat16) it is the pool's own dtype: bfloat16
  into float16 would save nothing and lose range, so ``fp16`` of a 16-bit pool is
  ``native`` (``effective``), and the CLI refuses to be asked for it.
- ``int8``: symmetric 8-bit integers, ``q = round(x / scale)`` with ``scale = max|x| / 127``
  over a group, the groups finer than a block: for K (even planes) one per (block, head,
  channel), over the block's tokens; for V (odd planes) one per (token, head), over the
  head's dimensions. Keys have outlier channels (a few dimensions far larger than the
  rest, the same in every token) and values vary by token, so these groups keep the step
  small where a scale per (block, head) lets one channel or token set it for all; on
  SmolLM2 ``bench quality --kv-formats`` put these groups well ahead of a scale per
  (block, head) and of one per (token, head) for both, in KL to native and in greedy
  agreement (the figures: docs/architecture/transfer.md). A unit is the scales, float16
  (rounded up so that no value exceeds 127 steps; at least float16's smallest normal), in an area of
  ``2 * max(kv_heads * head_dim, block_size * kv_heads)`` bytes (K's and V's units are one
  size), then ``[block_size, kv_heads, head_dim] int8``, padded to a multiple of 4 bytes:
  3456 bytes against float32's 12288 for a SmolLM2 block plane (0.28). The error of a value
  is at most half its group's step, ``max|x| / 254`` (times 1 + 2**-10 for the scale's
  rounding; at least half float16's smallest normal step for groups of tiny values).

Decoding writes the pool's dtype. The codec computes on the pool's device; encoded bytes
and the pool may be on different devices (a buffer is moved to the pool's before decoding).
Imports torch only. Owns nothing: buffers are the caller's.
"""

from __future__ import annotations

from typing import Sequence

import torch

NATIVE, FP16, INT8 = "native", "fp16", "int8"
FORMATS = (NATIVE, FP16, INT8)
FP16_MAX = 65504.0
FP16_TINY = 2.0 ** -14    # float16's smallest normal: the least int8 scale
_ROUND_UP = 1 + 2.0 ** -10   # an int8 scale is rounded to float16 at or above max|x| / 127
SIXTEEN_BIT = (torch.float16, torch.bfloat16)
_PLANES_PER_PASS = 8   # planes encoded or decoded at a time: bounds the float temporaries


def check_format(name: str) -> str:
    if name not in FORMATS:
        raise ValueError(f"unknown KV format {name!r}; expected one of {', '.join(FORMATS)}")
    return name


def effective(name: str, dtype: torch.dtype) -> str:
    """The format a pool of ``dtype`` really uses when ``name`` is asked for: ``fp16`` of a
    16-bit pool is ``native``."""
    check_format(name)
    return NATIVE if name == FP16 and dtype in SIXTEEN_BIT else name


class KVCodec:
    """Encode and decode units of a pool of ``dtype`` whose blocks hold ``block_elems``
    values as ``kv_heads`` heads (see the module docstring). ``format``: the effective one."""

    def __init__(self, name: str, dtype: torch.dtype, block_size: int, num_kv_heads: int, head_dim: int):
        self.format = effective(name, dtype)
        self.dtype = dtype
        self.block_size, self.num_kv_heads, self.head_dim = block_size, num_kv_heads, head_dim
        self.block_elems = block_size * num_kv_heads * head_dim
        itemsize = torch.empty((), dtype=dtype).element_size()
        if self.format == NATIVE:
            self.unit_nbytes = self.block_elems * itemsize
        elif self.format == FP16:
            self.unit_nbytes = self.block_elems * 2
        else:
            self._scale_nbytes = -(-2 * max(num_kv_heads * head_dim, block_size * num_kv_heads) // 4) * 4
            self.unit_nbytes = self._scale_nbytes + -(-self.block_elems // 4) * 4

    @classmethod
    def for_layout(cls, name: str, layout) -> "KVCodec":
        """The codec of a pool of ``layout`` (engine.kv_cache.KVCacheLayout)."""
        return cls(name, layout.torch_dtype, layout.block_size, layout.num_kv_heads, layout.head_dim)

    @property
    def native(self) -> bool:
        return self.format == NATIVE

    def nbytes(self, num_planes: int, num_blocks: int) -> int:
        return num_planes * num_blocks * self.unit_nbytes

    def encode(self, planes: torch.Tensor, block_ids: Sequence[int], out: torch.Tensor,
               plane_start: int = 0) -> None:
        """Encode ``planes[plane_start:plane_start + P][:, block_ids]`` into ``out``
        ([P, len(block_ids), unit_nbytes] uint8, any device; written in place)."""
        num_planes = out.shape[0]
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=planes.device)
        for p0 in range(0, num_planes, _PLANES_PER_PASS):
            p1 = min(p0 + _PLANES_PER_PASS, num_planes)
            x = planes[plane_start + p0:plane_start + p1].index_select(1, idx)   # [pp, n, elems], a copy
            out[p0:p1].copy_(self._encode(x, plane_start + p0).to(out.device), non_blocking=False)

    def decode(self, src: torch.Tensor, planes: torch.Tensor, block_ids: Sequence[int],
               plane_start: int = 0) -> None:
        """Decode ``src`` ([P, len(block_ids), unit_nbytes] uint8) into
        ``planes[plane_start:plane_start + P][:, block_ids]``."""
        num_planes = src.shape[0]
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=planes.device)
        for p0 in range(0, num_planes, _PLANES_PER_PASS):
            p1 = min(p0 + _PLANES_PER_PASS, num_planes)
            y = self._decode(src[p0:p1].to(planes.device), plane_start + p0)
            planes[plane_start + p0:plane_start + p1].index_copy_(1, idx, y)

    def encode_block(self, pool: torch.Tensor, block_id: int) -> torch.Tensor:
        """One block of ``pool`` (every plane) as a host tensor: for ``native`` the block
        itself ``[L, 2, block_size, kv_heads, head_dim]`` in the pool's dtype (what the
        tiers kept before formats), for ``fp16`` the same shape in float16, for ``int8``
        ``[2L, unit_nbytes]`` uint8. ``decode_block`` tells them apart by dtype."""
        if self.format == NATIVE:
            return pool[:, :, block_id].to("cpu", copy=True)
        if self.format == FP16:
            return pool[:, :, block_id].clamp(-FP16_MAX, FP16_MAX).to("cpu", torch.float16)
        flat = pool.view(pool.shape[0] * pool.shape[1], pool.shape[2], -1)
        out = torch.empty(flat.shape[0], 1, self.unit_nbytes, dtype=torch.uint8)
        self.encode(flat, [block_id], out)
        return out.view(flat.shape[0], self.unit_nbytes)

    def decode_block(self, payload: torch.Tensor, pool: torch.Tensor, block_id: int) -> None:
        """Write a payload of ``encode_block`` (of any format this codec's pool can have)
        into ``pool``'s block ``block_id``; ValueError for a payload of no such format."""
        block_shape = (pool.shape[0], pool.shape[1], *pool.shape[3:])
        if payload.dtype == pool.dtype or payload.dtype == torch.float16:
            if tuple(payload.shape) != block_shape:
                raise ValueError(f"payload {tuple(payload.shape)} is not a block {block_shape}")
            pool[:, :, block_id].copy_(payload)
            return
        if payload.dtype != torch.uint8:
            raise ValueError(f"payload of dtype {payload.dtype} for a {pool.dtype} pool")
        codec = self if self.format == INT8 else KVCodec(INT8, pool.dtype, *pool.shape[3:])
        num_planes = pool.shape[0] * pool.shape[1]
        if tuple(payload.shape) != (num_planes, codec.unit_nbytes):
            raise ValueError(f"int8 payload {tuple(payload.shape)}, expected {(num_planes, codec.unit_nbytes)}")
        flat = pool.view(num_planes, pool.shape[2], -1)
        codec.decode(payload.view(num_planes, 1, codec.unit_nbytes), flat, [block_id])

    # ---- one chunk of units -------------------------------------------------------------

    def _encode(self, x: torch.Tensor, first_plane: int) -> torch.Tensor:
        """[pp, n, elems] in the pool's dtype (planes ``first_plane..``) -> [pp, n, unit_nbytes] uint8."""
        pp, n = x.shape[0], x.shape[1]
        if self.format == NATIVE:
            return x.contiguous().view(torch.uint8).view(pp, n, self.unit_nbytes)
        if self.format == FP16:
            return x.clamp(-FP16_MAX, FP16_MAX).to(torch.float16).view(torch.uint8).view(pp, n, self.unit_nbytes)
        out = torch.zeros(pp, n, self.unit_nbytes, dtype=torch.uint8, device=x.device)
        for sel, keys in self._kinds(pp, first_plane, x.device):
            h = x.index_select(0, sel).float().view(len(sel), n, self.block_size, self.num_kv_heads, self.head_dim)
            amax = h.abs().amax(dim=2 if keys else 4)   # K: [s, n, heads, dim]; V: [s, n, tokens, heads]
            scale = (amax * (_ROUND_UP / 127.0)).clamp_(FP16_TINY, FP16_MAX).to(torch.float16)
            q = torch.round(h / self._spread(scale.float(), keys)).clamp_(-127, 127).to(torch.int8)
            unit = torch.zeros(len(sel), n, self.unit_nbytes, dtype=torch.uint8, device=x.device)
            raw = scale.view(len(sel), n, -1).view(torch.uint8)
            unit[:, :, :raw.shape[2]] = raw
            unit[:, :, self._scale_nbytes:self._scale_nbytes + self.block_elems] = \
                q.view(len(sel), n, self.block_elems).view(torch.uint8)
            out.index_copy_(0, sel, unit)
        return out

    def _decode(self, src: torch.Tensor, first_plane: int) -> torch.Tensor:
        """[pp, n, unit_nbytes] uint8 (planes ``first_plane..``) -> [pp, n, elems] in the pool's dtype."""
        pp, n = src.shape[0], src.shape[1]
        if self.format == NATIVE:
            return src.contiguous().view(self.dtype).view(pp, n, self.block_elems)
        if self.format == FP16:
            return src.contiguous().view(torch.float16).view(pp, n, self.block_elems).to(self.dtype)
        out = torch.empty(pp, n, self.block_elems, dtype=self.dtype, device=src.device)
        for sel, keys in self._kinds(pp, first_plane, src.device):
            part = src.index_select(0, sel)
            count = self.num_kv_heads * (self.head_dim if keys else self.block_size)
            scale = part[:, :, :2 * count].contiguous().view(torch.float16).float()
            scale = scale.view(len(sel), n, *((self.num_kv_heads, self.head_dim) if keys
                                              else (self.block_size, self.num_kv_heads)))
            q = part[:, :, self._scale_nbytes:self._scale_nbytes + self.block_elems].contiguous().view(torch.int8)
            h = q.view(len(sel), n, self.block_size, self.num_kv_heads, self.head_dim).float()
            h = h * self._spread(scale, keys)
            out.index_copy_(0, sel, h.view(len(sel), n, self.block_elems).to(self.dtype))
        return out

    @staticmethod
    def _kinds(num_planes: int, first_plane: int, device) -> list[tuple[torch.Tensor, bool]]:
        """The K planes and the V planes of a chunk (plane ``2 * layer`` is K, ``2 * layer + 1`` V):
        (their indices in the chunk, whether they are K), the empty kinds left out."""
        first_k = first_plane % 2   # the chunk's first K plane: 0 when it starts on one
        kinds = [(torch.arange(first_k, num_planes, 2, device=device), True),
                 (torch.arange(1 - first_k, num_planes, 2, device=device), False)]
        return [(sel, keys) for sel, keys in kinds if len(sel)]

    @staticmethod
    def _spread(scale: torch.Tensor, keys: bool) -> torch.Tensor:
        """A kind's scales shaped to broadcast over [s, n, tokens, heads, dim]."""
        return scale[:, :, None, :, :] if keys else scale[:, :, :, :, None]
