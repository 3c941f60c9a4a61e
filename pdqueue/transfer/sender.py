"""The sender half (prefill worker): exports tickets and serves them over a ZeroMQ ROUTER.

Lifecycle of an exported request: ``export`` leases its blocks and returns a Ticket ->
a receiver ``acquire``s (shm path: it then copies straight out of the shared segment) or
``fetch``es (zmq path: this thread sends a header, then gathers the blocks frame by frame
into a staging buffer under the lease and sends each frame as its own message as soon as it
is staged, so that staging, the wire and the receiver's copying overlap) -> the receiver
``release``s -> ``poll_freeable`` hands the blocks back to the engine thread, which frees
them. Leases that are never released expire.

Who owns what: the engine owns the pool and writes only blocks it owns; leased blocks are
read-only for everyone until ``poll_freeable`` returns them (see leases.py); a lease lost
while its frames are being staged turns the rest of the reply into an error. The serving
thread owns the ROUTER socket, its zmq context and the staging buffer (zmq may still send
from it after ``_fetch`` returns: a busy buffer is never reused); ``close()`` stops the
thread and frees them. Requests are answered for tickets of this incarnation and segment
nonce only. CURVE encryption is not done yet (TODO: server keys here, the public key in
the ticket, client keys in ControlClient); bind to a private interface meanwhile.
Imports torch, zmq, msgpack.
"""

from __future__ import annotations

import logging
import threading
import time

import torch
import zmq

from pdqueue.engine.kv_cache import KVCacheLayout
from pdqueue.transfer import zmq as wire
from pdqueue.transfer.base import TRANSFER_VERSION, Ticket
from pdqueue.transfer.blocks import MAX_FRAME_BYTES, copy_blocks, plan_frames, planes
from pdqueue.transfer.errors import FailureCode
from pdqueue.transfer.leases import LeaseState, LeaseTable
from pdqueue.transfer.shm import SharedKVPool

log = logging.getLogger(__name__)

_POLL_MS = 50   # how often the serving thread checks for close()


class KVSender:
    def __init__(self, pool_tensor: torch.Tensor, layout: KVCacheLayout, worker_id: str, incarnation: str,
                 node: str, segment_name: str | None = None, nonce: str | None = None,
                 endpoint: str = "tcp://127.0.0.1:*", lease_s: float = 30.0, *,
                 advertise: str | None = None, max_frame_bytes: int = MAX_FRAME_BYTES):
        """``endpoint``: bind address; ``advertise``: the address put in tickets (default: the
        bound one, which is wrong for wildcard hosts such as 0.0.0.0); a trailing ``:*`` in
        it stands for the port actually bound (``tcp://10.0.0.5:*``)."""
        layout.check_pool(pool_tensor)
        self.layout = layout
        self.worker_id = worker_id
        self.incarnation = incarnation
        self.node = node
        self.segment_name = segment_name
        self.nonce = nonce
        self.max_frame_bytes = max_frame_bytes
        self.leases = LeaseTable(lease_s)
        self._planes = planes(pool_tensor)
        self._staging: torch.Tensor | None = None     # flat uint8, pre-faulted, reused
        self._staging_tracker: zmq.MessageTracker | None = None
        self._context = zmq.Context()
        self._sock = self._context.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_REQUEST_BYTES)
        self._sock.setsockopt(zmq.SNDHWM, 0)   # a ROUTER drops at its high-water mark: never
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError:
            self._sock.close(linger=0)
            self._context.term()
            raise
        bound = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if advertise and advertise.endswith(":*"):
            advertise = advertise[:-1] + bound.rpartition(":")[2]
        self.endpoint = advertise or bound
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"kv-sender-{worker_id}", daemon=True)
        self._thread.start()

    @classmethod
    def for_shared_pool(cls, pool: SharedKVPool, node: str, **kwargs) -> "KVSender":
        """A sender for a pool created with SharedKVPool.create (which the caller still owns)."""
        return cls(pool.tensor, pool.layout, pool.info.worker_id, pool.info.incarnation, node,
                   segment_name=pool.name, nonce=pool.nonce, **kwargs)

    def export(self, request_id: str, block_ids, num_tokens: int, lease_s: float | None = None) -> Ticket:
        """Lease ``block_ids`` (the engine must not free or write them until poll_freeable
        returns them) and return the ticket that lets a receiver fetch them."""
        if self._stop.is_set():
            raise RuntimeError("KVSender is closed")
        block_ids = tuple(int(b) for b in block_ids)
        if any(not 0 <= b < self.layout.num_blocks for b in block_ids) or len(set(block_ids)) != len(block_ids):
            raise ValueError(f"block ids {block_ids} are not distinct ids of a {self.layout.num_blocks}-block pool")
        if not 0 < num_tokens <= len(block_ids) * self.layout.block_size:
            raise ValueError(f"{num_tokens} tokens do not fit {len(block_ids)} blocks")
        deadline = self.leases.add(request_id, block_ids, num_tokens, lease_s)
        return Ticket(TRANSFER_VERSION, request_id, self.worker_id, self.incarnation, self.node,
                      self.segment_name, self.nonce, block_ids, num_tokens, self.layout.to_dict(),
                      self.endpoint, time.time() + (deadline - self.leases.clock()))

    def poll_freeable(self) -> list[tuple[str, tuple[int, ...]]]:
        """(request_id, block_ids) of leases released or expired since the last call: the
        engine owns (and should free) these blocks now. Call from the engine thread."""
        return self.leases.poll_freeable()

    def revoke(self, request_id: str) -> bool:
        """Take a lease back early (e.g. the ticket could not be published)."""
        return self.leases.revoke(request_id)

    def close(self) -> None:
        """Stop serving; pending replies are dropped. The pool is not touched."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self._sock.close(linger=0)
        self._context.term()
        self._staging = None

    def __enter__(self) -> "KVSender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the serving thread -------------------------------------------------------------

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                if not self._sock.poll(_POLL_MS, zmq.POLLIN):
                    continue
                frames = self._sock.recv_multipart()
                reply = self._handle(frames[0], frames[-1])
                if reply:
                    self._sock.send_multipart([frames[0], *reply])
            except Exception:   # never let one bad request stop the server
                log.exception("KV sender %s: failed to serve a request", self.worker_id)

    def _handle(self, identity: bytes, raw: bytes) -> list:
        try:
            msg = wire.unpack(raw)
        except Exception as exc:
            return [wire.error_reply(None, FailureCode.BAD_REPLY, f"undecodable request: {exc}")]
        try:
            return self._dispatch(identity, msg)
        except Exception as exc:   # answer rather than let the receiver time out
            log.exception("KV sender %s: %s of %r failed", self.worker_id, msg.get("op"), msg.get("request_id"))
            return [wire.error_reply(msg.get("seq"), FailureCode.BAD_REPLY, f"sender failed: {exc!r}")]

    def _dispatch(self, identity: bytes, msg: dict) -> list:
        seq, op, request_id = msg.get("seq"), msg.get("op"), msg.get("request_id")
        if msg.get("v") != TRANSFER_VERSION:
            return [wire.error_reply(seq, FailureCode.VERSION_MISMATCH,
                                     f"request version {msg.get('v')}, sender speaks {TRANSFER_VERSION}")]
        if msg.get("incarnation") != self.incarnation:
            return [wire.error_reply(seq, FailureCode.STALE_INCARNATION,
                                     f"ticket names incarnation {msg.get('incarnation')} of {self.worker_id}, "
                                     f"which now runs incarnation {self.incarnation}")]
        if msg.get("nonce") != self.nonce:
            return [wire.error_reply(seq, FailureCode.NONCE_MISMATCH, "ticket nonce does not match the segment")]
        if op == "acquire":
            if not self.leases.acquire(request_id):
                return [self._lease_error(seq, request_id)]
            return [wire.ok_reply(seq)]
        if op == "release":
            valid = self.leases.release(request_id)
            return [] if msg.get("noreply") else [wire.ok_reply(seq, valid=valid)]
        if op == "release_copied":
            if not self.leases.release_copied(request_id):
                return [self._lease_error(seq, request_id)]
            return [wire.ok_reply(seq)]
        if op == "fetch":
            return self._fetch(identity, seq, request_id)
        return [wire.error_reply(seq, FailureCode.BAD_REPLY, f"unknown op {op!r}")]

    def _lease_error(self, seq, request_id) -> bytes:
        state = self.leases.last_state(request_id)
        if state is None:
            return wire.error_reply(seq, FailureCode.UNKNOWN_REQUEST, f"no lease for request {request_id!r}")
        if state == LeaseState.EXPIRED:
            return wire.error_reply(seq, FailureCode.LEASE_EXPIRED, f"lease of {request_id!r} expired")
        return wire.error_reply(seq, FailureCode.UNKNOWN_REQUEST, f"lease of {request_id!r} was already released")

    def _fetch(self, identity: bytes, seq, request_id) -> list:
        """Send the header, then each frame as its own message ``[data_tag, bytes]``, staged
        (gathered from the leased blocks) just before it is sent. Returns an error reply,
        or [] once everything is queued on the socket."""
        if not self.leases.acquire(request_id):
            return [self._lease_error(seq, request_id)]
        lease = self.leases.get(request_id)
        if lease is None:
            return [self._lease_lost(seq, request_id)]
        block_ids, layout = lease.block_ids, self.layout
        num_planes, num_blocks, block_nbytes = self._planes.shape[0], len(block_ids), layout.block_nbytes
        plan = plan_frames(num_planes, num_blocks, block_nbytes, self.max_frame_bytes)
        staging = self._staging_buffer(num_planes * num_blocks * block_nbytes)
        staged_bytes = staging.view(num_planes, num_blocks, block_nbytes)
        staged = staging.view(layout.torch_dtype).view(num_planes, num_blocks, -1)
        header = wire.ok_reply(seq, request_id=request_id, block_ids=list(block_ids),
                               shape=[layout.num_layers, 2, num_blocks, layout.block_size,
                                      layout.num_kv_heads, layout.head_dim],
                               dtype=layout.dtype, num_frames=len(plan), max_frame_bytes=self.max_frame_bytes,
                               frames="staged")
        self._sock.send_multipart([identity, header])
        sent = []
        try:
            for index, (p0, p1, b0, b1) in enumerate(plan):
                copy_blocks(self._planes[p0:p1], block_ids[b0:b1], staged[p0:p1], range(b0, b1))
                if not self.leases.is_held(request_id):
                    return [self._lease_lost(seq, request_id)]
                frame = zmq.Frame(staged_bytes[p0:p1, b0:b1].reshape(-1).numpy(), track=True)
                self._sock.send_multipart([identity, wire.data_tag(seq, index), frame], copy=False)
                sent.append(frame)
        finally:
            self._staging_tracker = zmq.MessageTracker(*sent) if sent else None
        return []

    def _lease_lost(self, seq, request_id) -> bytes:
        return wire.error_reply(seq, FailureCode.LEASE_LOST, f"lease of {request_id!r} lost while staging")

    def _staging_buffer(self, nbytes: int) -> torch.Tensor:
        """A pre-faulted byte buffer of ``nbytes``; a new one while zmq still sends the old."""
        busy = self._staging_tracker is not None and not self._staging_tracker.done
        if self._staging is None or busy or self._staging.numel() < nbytes:
            self._staging = torch.zeros(max(nbytes, 1 << 20), dtype=torch.uint8)
            self._staging_tracker = None
        return self._staging[:nbytes]
