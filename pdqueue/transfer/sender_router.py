"""A ``KVSender``'s ZeroMQ wire: the ROUTER socket and the thread that serves it.

A fetch's reply is a header, then the blocks gathered frame by frame into a staging buffer
under the lease, each frame sent as its own message as soon as it is staged, so that
staging, the wire and the receiver's copying overlap. The thread owns the socket, its zmq
context and the staging buffer (zmq may still send from it after ``_send_staged`` returns:
a busy buffer is never reused, one abandoned midway is dropped).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import torch
import zmq

from pdqueue.engine.kv_cache import KVCacheLayout
from pdqueue.transfer import zmq as wire
from pdqueue.transfer.auth import MAX_PEERS, SESSION_IDLE_S, Peer
from pdqueue.transfer.blocks import copy_blocks, plan_frames
from pdqueue.transfer.errors import FailureCode
from pdqueue.transfer.sender_admission import Admission, Fetch, lease_lost

log = logging.getLogger("pdqueue.transfer.sender")

_POLL_MS = 10   # how often the serving thread checks for close() (a switch waits for it)


class RouterServer:
    """Binds ``endpoint`` at construction; ``start`` runs the serving thread, ``close``
    stops it and frees the socket. ``endpoint`` here: the address put in tickets
    (``advertise``, a trailing ``:*`` standing for the port bound, else the bound one)."""

    def __init__(self, admission: Admission, pool_planes: torch.Tensor, layout: KVCacheLayout, worker_id: str,
                 endpoint: str, advertise: str | None, max_frame_bytes: int):
        self.admission, self.layout, self.worker_id = admission, layout, worker_id
        self.max_frame_bytes = max_frame_bytes
        self._planes = pool_planes
        self._peers: OrderedDict[bytes, Peer] = OrderedDict()   # ZeroMQ identities (serving thread only)
        self._open_peer = Peer(address="any")   # without authentication every peer is this one
        self._staging: torch.Tensor | None = None     # flat uint8, pre-faulted, reused
        self._staging_tracker: zmq.MessageTracker | None = None   # its last frame in flight, if any
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

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop the thread (if started) and free the socket; pending replies are dropped."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._sock.close(linger=0)
        self._context.term()
        self._staging = None

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                if not self._sock.poll(_POLL_MS, zmq.POLLIN):
                    continue
                frames = self._sock.recv_multipart(copy=False)
                identity = frames[0].bytes
                reply = self._handle(identity, frames[-1].bytes, frames[-1])
                if reply:
                    self._sock.send_multipart([identity, *reply])
            except Exception:   # never let one bad request stop the server
                log.exception("KV sender %s: failed to serve a request", self.worker_id)

    def _peer(self, identity: bytes, frame: zmq.Frame) -> Peer:
        """The state of a ZeroMQ identity (LRU, at most MAX_PEERS; an idle session expires)."""
        if self.admission.auth is None:
            return self._open_peer
        peer = self._peers.get(identity)
        if peer is None:
            try:
                address = frame.get("Peer-Address")
            except Exception:
                address = "?"
            peer = self._peers[identity] = Peer(address=f"zmq:{address}")
            while len(self._peers) > MAX_PEERS:
                self._peers.popitem(last=False)
        else:
            self._peers.move_to_end(identity)
            if peer.session is not None and time.monotonic() - peer.session.used > SESSION_IDLE_S:
                peer.session = None
        return peer

    def _handle(self, identity: bytes, raw: bytes, frame: zmq.Frame) -> list:
        peer = self._peer(identity, frame)
        msg, authenticated, reply = self.admission.admit(raw, peer)
        if msg is None:
            return [reply] if reply else []
        try:
            answer = self.admission.answer(msg, authenticated=authenticated, peer=peer, answer_release=True)
            if isinstance(answer, Fetch):
                return self._send_staged(identity, answer)
            return [] if answer is None else [answer]
        except Exception as exc:   # answer rather than let the receiver time out
            log.exception("KV sender %s: %s of %r failed", self.worker_id, msg.get("op"), msg.get("request_id"))
            return [wire.error_reply(msg.get("seq"), FailureCode.BAD_REPLY, f"sender failed: {exc!r}")]

    def _send_staged(self, identity: bytes, fetch: Fetch) -> list:
        """Send the header, then each frame as its own message ``[data_tag, bytes]``, staged
        (gathered from the leased blocks) just before it is sent and sent only if the lease
        still held when staging ended. Returns an error reply, or [] once everything is
        queued on the socket. (Frames sent zero-copy straight from the pool measured 15-20%
        slower: pyzmq wakes its gc thread for every such frame.)"""
        seq, request_id, block_ids = fetch.seq, fetch.request_id, fetch.block_ids
        num_planes, num_blocks, block_nbytes = self._planes.shape[0], len(block_ids), self.layout.block_nbytes
        plan = plan_frames(num_planes, num_blocks, block_nbytes, self.max_frame_bytes)
        staging = self._staging_buffer(num_planes * num_blocks * block_nbytes)
        staged_bytes = staging.view(num_planes, num_blocks, block_nbytes)
        staged = staging.view(self.layout.torch_dtype).view(num_planes, num_blocks, -1)
        self._sock.send_multipart([identity, fetch.header(num_frames=len(plan), max_frame_bytes=self.max_frame_bytes,
                                                          frames="staged")])
        last, tracker = len(plan) - 1, None
        leases = self.admission.leases
        try:
            for index, (p0, p1, b0, b1) in enumerate(plan):
                copy_blocks(self._planes[p0:p1], block_ids[b0:b1], staged[p0:p1], range(b0, b1))
                if not leases.is_held(request_id):
                    return [lease_lost(seq, request_id)]
                # Only the last frame is tracked: ZeroMQ frees a peer's messages in order, so
                # once it is done the whole staging buffer is free again.
                frame = zmq.Frame(staged_bytes[p0:p1, b0:b1].reshape(-1).numpy(), track=index == last)
                self._sock.send_multipart([identity, wire.data_tag(seq, index), frame], copy=False)
                if index == last:
                    tracker = frame.tracker
                del frame   # a live Frame object would keep its message (and the tracker) busy
        finally:
            self._staging_tracker = tracker
            if tracker is None:
                # Failed midway: earlier frames may still be queued (they keep the buffer
                # alive until sent), so this buffer is never reused.
                self._staging = None
        return []

    def _staging_buffer(self, nbytes: int) -> torch.Tensor:
        """A pre-faulted byte buffer of ``nbytes``; a new one while zmq still sends the old."""
        busy = self._staging_tracker is not None and not self._staging_tracker.done
        if self._staging is None or busy or self._staging.numel() < nbytes:
            self._staging = torch.zeros(max(nbytes, 1 << 20), dtype=torch.uint8)
            self._staging_tracker = None
        return self._staging[:nbytes]
