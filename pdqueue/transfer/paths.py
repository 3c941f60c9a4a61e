"""The receiver-side backends: ``shm`` (same shared-memory domain), ``tcp`` and ``zmq`` (any host).

Each copies the ticket's blocks into the destination blocks of the receiver's pool, which
the caller owns throughout and must treat as garbage if ``fetch`` raises.
- shm: maps the sender's segment read-only once per (segment, nonce) and keeps the mapping
  (at most MAX_MAPPINGS, least recently used dropped; mappings whose segment was unlinked
  are dropped too, so a departed sender's memory is returned). Check the ticket's block
  epochs (LEASE_EXPIRED if the blocks went back to the sender's engine already) -> copy ->
  check them again (LEASE_LOST: they went back while we copied; the copy is discarded) ->
  a fire-and-forget release. No round trip: the epochs say what the sender would.
- tcp: one connection per sender data endpoint (tcp.py), authenticated when it is made
  if the receiver has the cluster's ``KVAuth``; a ``fetch`` request (sealed), the reply
  header validated like zmq's, then ``recvmsg_into`` straight into the destination blocks,
  one buffer per run of consecutive (source, destination) blocks per plane; then a
  fire-and-forget release. Any failure closes the connection. Chosen before zmq in auto
  mode when the ticket names a data endpoint; a data endpoint that refuses connections
  lets auto mode fall back to zmq.
- zmq: one ``fetch`` request (sealed, after a handshake on a new socket, with ``KVAuth``);
  the reply header is validated (request, blocks, shape, dtype,
  frame plan and count) before a byte is copied, then each data frame as it arrives (its
  size against the plan) and copied while the next one is on the wire; then a
  fire-and-forget release (the sender read every frame under a held lease, or sent an
  error in its place, so the copy is good whatever the release says).
Imports torch, zmq (through transfer.zmq), socket (through transfer.tcp).
"""

from __future__ import annotations

import itertools
import logging
import time
import warnings
from collections import OrderedDict

import torch

from pdqueue.transfer import zmq as wire
from pdqueue.transfer.base import ReceiveContext, Ticket, Transport, register_transport
from pdqueue.transfer.blocks import copy_blocks, plan_frames, planes
from pdqueue.transfer.errors import FailureCode, TransferError
from pdqueue.transfer.node import DEFAULT_SHM_DIR
from pdqueue.transfer.shm import SharedKVPool
from pdqueue.transfer.tcp import DataClient, recv_control, recv_views, send_control, stream_pieces
from pdqueue.transfer.zmq import ControlClient

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
                                f"to {ticket.worker_id}/{ticket.incarnation}", FailureCode.STALE_INCARNATION)
        if not info.layout.compatible_with(self.ctx.layout) or max(ticket.block_ids) >= info.layout.num_blocks:
            raise TransferError(f"segment {info.name} layout {info.layout} cannot serve the ticket",
                                FailureCode.LAYOUT_MISMATCH)

    def fetch(self, ticket: Ticket, dst_block_ids: list[int], first_block: int = 0) -> int:
        segment = self._mapping(ticket)
        if len(ticket.block_epochs) != len(ticket.block_ids):
            raise TransferError(f"ticket has {len(ticket.block_epochs)} block epochs for {len(ticket.block_ids)} "
                                "blocks", FailureCode.BAD_TICKET)
        src_ids, expected = ticket.block_ids[first_block:], list(ticket.block_epochs[first_block:])
        if segment.epochs_of(src_ids) != expected:
            raise TransferError(f"the blocks of {ticket.request_id!r} went back to {ticket.worker_id}'s engine "
                                "(lease released or expired)", FailureCode.LEASE_EXPIRED)
        copy_blocks(planes(segment.tensor), src_ids, planes(self.ctx.pool), dst_block_ids)
        if segment.epochs_of(src_ids) != expected:
            raise TransferError(f"the blocks of {ticket.request_id!r} went back to {ticket.worker_id}'s engine "
                                "while they were copied", FailureCode.LEASE_LOST)
        self.ctx.control.release_nowait(ticket)
        return len(src_ids) * 2 * self.ctx.layout.num_layers * self.ctx.layout.block_nbytes

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

    def fetch(self, ticket: Ticket, dst_block_ids: list[int], first_block: int = 0) -> int:
        header, frames = self.ctx.control.fetch(ticket, first_block)
        layout = self.ctx.layout
        num_planes = 2 * layout.num_layers
        check_reply_describes(ticket, header, layout, first_block)
        max_frame_bytes = header.get("max_frame_bytes")
        if not isinstance(max_frame_bytes, int) or max_frame_bytes <= 0:
            raise TransferError(f"bad max_frame_bytes {max_frame_bytes!r}", FailureCode.BAD_REPLY)
        if header.get("frames") != "staged":
            raise TransferError(f"unknown frame plan {header.get('frames')!r}", FailureCode.BAD_REPLY)
        num_blocks = len(ticket.block_ids) - first_block
        plan = plan_frames(num_planes, num_blocks, layout.block_nbytes, max_frame_bytes)
        if header.get("num_frames") != len(plan):
            raise TransferError(f"expected {len(plan)} data frames, header says {header.get('num_frames')}",
                                FailureCode.BAD_REPLY)
        dst = planes(self.ctx.pool)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            for (p0, p1, b0, b1), frame in zip(plan, frames):
                if len(frame) != (p1 - p0) * (b1 - b0) * layout.block_nbytes:
                    self.ctx.control.forget(ticket.endpoint)   # the rest of the reply is still queued
                    raise TransferError(f"data frame of {len(frame)} bytes, expected "
                                        f"{(p1 - p0) * (b1 - b0) * layout.block_nbytes}", FailureCode.BAD_REPLY)
                src = torch.frombuffer(frame.buffer, dtype=layout.torch_dtype).view(p1 - p0, b1 - b0, -1)
                copy_blocks(src, range(b1 - b0), dst[p0:p1], dst_block_ids[b0:b1])
        self.ctx.control.release_nowait(ticket)
        return num_planes * num_blocks * layout.block_nbytes

    def forget(self, ticket: Ticket) -> None:
        self.ctx.control.forget(ticket.endpoint)


class TcpTransport(Transport):
    """The TCP data wire (tcp.py): bytes land straight in the destination blocks."""

    name = "tcp"

    def __init__(self, ctx: ReceiveContext):
        super().__init__(ctx)
        self.client = DataClient(ctx.timeout_s, ctx.auth)
        self._seq = itertools.count(1)
        on_host = ctx.pool.device.type == "cpu"
        self._pool_bytes = memoryview(ctx.pool.view(-1).view(torch.uint8).numpy()) if on_host else None

    def can_fetch(self, ticket: Ticket) -> bool:
        return bool(ticket.data_endpoint) and self._pool_bytes is not None

    def check(self, ticket: Ticket) -> None:
        self.client.connect(ticket.data_endpoint)

    def fetch(self, ticket: Ticket, dst_block_ids: list[int], first_block: int = 0) -> int:
        endpoint, layout = ticket.data_endpoint, self.ctx.layout
        num_planes, block_nbytes = 2 * layout.num_layers, layout.block_nbytes
        plane_nbytes = layout.num_blocks * block_nbytes
        src_ids = ticket.block_ids[first_block:]
        expected = num_planes * len(src_ids) * block_nbytes
        try:
            conn, header = self._ask(endpoint, ticket, first_block)
            ControlClient.check_reply(endpoint, "fetch", header)   # an error reply raises here
            check_reply_describes(ticket, header, layout, first_block)
            if header.get("nbytes") != expected:
                raise TransferError(f"fetch reply announces {header.get('nbytes')} bytes, expected {expected}",
                                    FailureCode.BAD_REPLY)
            recv_views(conn, [self._pool_bytes[start:start + n * block_nbytes]
                              for p, _s, d, n in stream_pieces(num_planes, src_ids, dst_block_ids)
                              for start in (p * plane_nbytes + d * block_nbytes,)])
        except TransferError:
            self.client.forget(endpoint)   # data may still be on its way: start afresh
            raise
        except (OSError, ValueError) as exc:   # socket.timeout is an OSError
            self.client.forget(endpoint)
            timed_out = isinstance(exc, TimeoutError)
            raise TransferError(f"fetch from {endpoint} failed: {exc!r}" + (
                f" (nothing for {self.ctx.timeout_s}s: sender dead or stuck)" if timed_out else ""),
                FailureCode.PEER_TIMEOUT if timed_out or isinstance(exc, ConnectionError)
                else FailureCode.BAD_REPLY) from None
        try:
            send_control(conn, wire.request("release", 0, ticket, noreply=True))
        except OSError:
            self.client.forget(endpoint)   # the lease runs to its deadline instead
        return expected

    def _ask(self, endpoint: str, ticket: Ticket, first_block: int = 0):
        """Send the fetch request and read the reply header: (connection, header). A kept
        connection that turns out dead before any reply (the sender restarted on a pinned
        port, a middlebox dropped it) is replaced once by a new one."""
        for attempt in range(2):
            conn, reused = self.client.connect(endpoint)
            try:
                seq = next(self._seq)
                raw = wire.request("fetch", seq, ticket, **({"first_block": first_block} if first_block else {}))
                session = self.client.sessions.get(endpoint)
                if session is not None:
                    raw = wire.seal(session, raw, seq)
                send_control(conn, raw)
                header = recv_control(conn)
                if header is None:
                    raise ConnectionError("the sender closed the connection")
                return conn, header
            except ConnectionError:
                self.client.forget(endpoint)
                if not reused or attempt:
                    raise
                log.info("kept connection to %s was dead; reconnecting once", endpoint)
        raise AssertionError("unreachable")

    def forget(self, ticket: Ticket) -> None:
        self.client.forget(ticket.data_endpoint)

    def close(self) -> None:
        self.client.close()


def check_reply_describes(ticket: Ticket, header: dict, layout, first_block: int = 0) -> None:
    """A fetch reply must describe exactly the blocks asked for (``ticket.block_ids[first_block:]``)
    in the receiver's layout."""
    src_ids = list(ticket.block_ids[first_block:])
    expected_shape = [layout.num_layers, 2, len(src_ids), layout.block_size, layout.num_kv_heads,
                      layout.head_dim]
    if (header.get("request_id") != ticket.request_id or header.get("block_ids") != src_ids
            or header.get("shape") != expected_shape or header.get("dtype") != layout.dtype):
        raise TransferError(f"fetch reply for {ticket.request_id!r} describes other data: {header}",
                            FailureCode.BAD_REPLY)


register_transport(ShmTransport, auto_rank=0)
register_transport(TcpTransport, auto_rank=1)
register_transport(ZmqTransport, auto_rank=2)
