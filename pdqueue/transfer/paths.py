"""The receiver-side backends: ``shm`` (same shared-memory domain) and ``zmq`` (any host).

Both copy the ticket's blocks into the destination blocks of the receiver's pool, which the
caller owns throughout and must treat as garbage if ``fetch`` raises.
- shm: maps the sender's segment read-only once per (segment, nonce) and keeps the mapping
  (at most MAX_MAPPINGS, least recently used dropped; mappings whose segment was unlinked
  are dropped too, so a departed sender's memory is returned). copy -> ``release_copied``
  (one round trip): the sender confirms the lease held throughout, else the copy is
  discarded (LEASE_EXPIRED, or UNKNOWN_REQUEST once the lease is gone).
- zmq: one ``fetch`` request; the reply header is validated (request, blocks, shape, dtype,
  frame plan and count) before a byte is copied, then each data frame as it arrives (its
  size against the plan) and copied while the next one is on the wire; then a
  fire-and-forget release (the sender staged every frame under a held lease, or sent an
  error in its place, so the copy is good whatever the release says).
Imports torch, zmq (through transfer.zmq).
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import OrderedDict

import torch

from pdqueue.transfer.base import ReceiveContext, Ticket, Transport, register_transport
from pdqueue.transfer.blocks import copy_blocks, plan_frames, planes
from pdqueue.transfer.errors import FailureCode, TransferError
from pdqueue.transfer.node import DEFAULT_SHM_DIR
from pdqueue.transfer.shm import SharedKVPool

log = logging.getLogger(__name__)

MAX_MAPPINGS = 8
_SWEEP_EVERY_S = 1.0


class ShmTransport(Transport):
    name = "shm"

    def __init__(self, ctx: ReceiveContext):
        super().__init__(ctx)
        self.shm_dir = ctx.extra.get("shm_dir", DEFAULT_SHM_DIR)
        self._mappings: OrderedDict[tuple[str, str], SharedKVPool] = OrderedDict()
        self._last_sweep = 0.0

    def can_fetch(self, ticket: Ticket) -> bool:
        return ticket.node == self.ctx.node and bool(ticket.segment) and bool(ticket.nonce)

    def check(self, ticket: Ticket) -> None:
        segment = self._mapping(ticket)
        info = segment.info
        if (info.worker_id, info.incarnation) != (ticket.worker_id, ticket.incarnation):
            raise TransferError(f"segment {info.name} belongs to {info.worker_id}/{info.incarnation}, the ticket "
                                f"to {ticket.worker_id}/{ticket.incarnation}", False, FailureCode.STALE_INCARNATION)
        if not info.layout.compatible_with(self.ctx.layout) or max(ticket.block_ids) >= info.layout.num_blocks:
            raise TransferError(f"segment {info.name} layout {info.layout} cannot serve the ticket",
                                False, FailureCode.LAYOUT_MISMATCH)

    def fetch(self, ticket: Ticket, dst_block_ids: list[int]) -> int:
        segment = self._mapping(ticket)
        # Copy first, then one round trip confirms the lease held throughout (its blocks were
        # never handed back, so never rewritten); otherwise the copy is discarded (raises).
        copy_blocks(planes(segment.tensor), ticket.block_ids, planes(self.ctx.pool), dst_block_ids)
        self.ctx.control.release_copied(ticket)
        return len(ticket.block_ids) * 2 * self.ctx.layout.num_layers * self.ctx.layout.block_nbytes

    def forget(self, ticket: Ticket) -> None:
        for key in [k for k in self._mappings if k[0] == ticket.segment]:
            self._mappings.pop(key).close()

    def close(self) -> None:
        while self._mappings:
            self._mappings.popitem()[1].close()

    def _mapping(self, ticket: Ticket) -> SharedKVPool:
        now = time.monotonic()
        if now - self._last_sweep > _SWEEP_EVERY_S:
            self._last_sweep = now
            for key in [k for k, seg in self._mappings.items() if seg.is_unlinked()]:
                self._mappings.pop(key).close()
        key = (ticket.segment, ticket.nonce)
        segment = self._mappings.get(key)
        if segment is not None:
            self._mappings.move_to_end(key)
            return segment
        segment = SharedKVPool.attach(ticket.segment, ticket.nonce, shm_dir=self.shm_dir)
        if len(self._mappings) >= MAX_MAPPINGS:
            self._mappings.popitem(last=False)[1].close()
        self._mappings[key] = segment
        log.info("mapped KV segment %s of %s", ticket.segment, ticket.worker_id)
        return segment


class ZmqTransport(Transport):
    name = "zmq"

    def can_fetch(self, ticket: Ticket) -> bool:
        return bool(ticket.endpoint)

    def fetch(self, ticket: Ticket, dst_block_ids: list[int]) -> int:
        header, frames = self.ctx.control.fetch(ticket)
        layout = self.ctx.layout
        num_blocks, num_planes = len(ticket.block_ids), 2 * layout.num_layers
        expected_shape = [layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim]
        if (header.get("request_id") != ticket.request_id or header.get("block_ids") != list(ticket.block_ids)
                or header.get("shape") != expected_shape or header.get("dtype") != layout.dtype):
            raise TransferError(f"fetch reply for {ticket.request_id!r} describes other data: {header}",
                                False, FailureCode.BAD_REPLY)
        max_frame_bytes = header.get("max_frame_bytes")
        if not isinstance(max_frame_bytes, int) or max_frame_bytes <= 0:
            raise TransferError(f"bad max_frame_bytes {max_frame_bytes!r}", False, FailureCode.BAD_REPLY)
        if header.get("frames") != "staged":
            raise TransferError(f"unknown frame plan {header.get('frames')!r}", False, FailureCode.BAD_REPLY)
        plan = plan_frames(num_planes, num_blocks, layout.block_nbytes, max_frame_bytes)
        if header.get("num_frames") != len(plan):
            raise TransferError(f"expected {len(plan)} data frames, header says {header.get('num_frames')}",
                                False, FailureCode.BAD_REPLY)
        dst = planes(self.ctx.pool)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            for (p0, p1, b0, b1), frame in zip(plan, frames):
                if len(frame) != (p1 - p0) * (b1 - b0) * layout.block_nbytes:
                    self.ctx.control.forget(ticket.endpoint)   # the rest of the reply is still queued
                    raise TransferError(f"data frame of {len(frame)} bytes, expected "
                                        f"{(p1 - p0) * (b1 - b0) * layout.block_nbytes}", False, FailureCode.BAD_REPLY)
                src = torch.frombuffer(frame.buffer, dtype=layout.torch_dtype).view(p1 - p0, b1 - b0, -1)
                copy_blocks(src, range(b1 - b0), dst[p0:p1], dst_block_ids[b0:b1])
        self.ctx.control.release_nowait(ticket)
        return num_planes * num_blocks * layout.block_nbytes

    def forget(self, ticket: Ticket) -> None:
        self.ctx.control.forget(ticket.endpoint)


register_transport(ShmTransport, auto_rank=0)
register_transport(ZmqTransport, auto_rank=1)
