"""The ``zmq`` transport, both halves: the ZeroMQ wire between a KVSender (ROUTER) and its
receivers (DEALER). The ROUTER is also the control channel of every path (the shm path's
releases, the NIXL path's ops), so every sender runs it.

Every request is one msgpack frame ``{v, op, seq, request_id, incarnation, nonce, mac}`` with
``op`` one of ``fetch`` or ``release`` (``noreply`` for fire-and-forget; ``mac`` is the
ticket's, which the sender compares with the one it issued); the messages are built in
transfer.wire, which the TCP data wire speaks too. With authentication
(transfer.auth) a receiver first sends ``{v, op: hello, seq, cn}`` and gets ``{v, seq, ok,
sn, proof}``; every later request goes inside ``{v, op: sealed, seq, body, tag[, proof]}``
(``body``: the packed request; the client's ``proof`` on the first one). A release is
accepted without a session on the strength of the ticket's MAC alone (it serves nothing and
gets no answer), so the shm path's fire-and-forget release never waits for a handshake. A reply is a msgpack
header frame ``{v, seq, ok, ...}`` (on error: ``code, reason``); a ``fetch`` reply
adds ``request_id, block_ids, shape, dtype, num_frames, max_frame_bytes, frames``
(``"staged"``) and is followed by ``num_frames`` messages
``[data_tag {v, seq, i}, raw bytes]`` cut by ``blocks.plan_frames`` (a fetch that asks for a
KV format, ``kv_format``, gets its reply in it when the sender knows it: the header names it
and the frames cut the codec's units, ``unit_nbytes`` each, engine.kv_codec; the sender
encodes each frame as it stages it, the receiver decodes each as it copies). Separate messages rather
than one multipart message: the sender stages frame i+1 while frame i is on the wire, the
receiver copies frame i meanwhile and frees its buffer (a multipart message keeps all of them alive, so a
big transfer lands in freshly mapped memory). A sender that fails midway sends an error
reply instead of the next data message. The version is ``base.TRANSFER_VERSION`` (change
log there).

``ControlClient`` is the receiver's end (the ``base.ControlChannel`` of the backends): one
DEALER per sender endpoint (and, with authentication, one session each: the handshake runs
before the first fetch on a new socket, and again on a new socket after
``auth.CLIENT_REFRESH_S`` idle), every receive bounded by a timeout, after which the socket
is dropped (linger 0) so a late reply cannot be taken for the next one. It is not
thread-safe: ``KVReceiver`` serialises all calls. It owns its sockets and its zmq context
and frees them on ``close()``.

``ZmqTransport`` (receiver): one ``fetch`` request (sealed, after a handshake on a new
socket, with ``KVAuth``); the reply header is validated (request, blocks, shape, dtype,
frame plan and count) before a byte is copied, then each data frame as it arrives (its
size against the plan) and copied while the next one is on the wire; then a
fire-and-forget release (the sender read every frame under a held lease, or sent an
error in its place, so the copy is good whatever the release says).

``RouterServer`` (sender): the ROUTER socket and the thread that serves it. A fetch's reply
is a header, then the blocks gathered frame by frame into a staging buffer under the lease,
each frame sent as its own message as soon as it is staged, so that staging, the wire and
the receiver's copying overlap. The thread owns the socket, its zmq context and the staging
buffer (zmq may still send from it after ``_send_staged`` returns: a busy buffer is never
reused, one abandoned midway is dropped). What it answers is decided by the sender's
``Admission`` (transfer.sender_admission).
Imports torch, zmq, msgpack (through transfer.wire), transfer.base (the one direction: base
never imports this module).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import warnings
from collections import OrderedDict
from typing import Iterator

import torch
import zmq

from pdqueue.engine.kv_cache import KVCacheLayout
from pdqueue.engine.kv_codec import NATIVE, KVCodec
from pdqueue.transfer.auth import CLIENT_REFRESH_S, MAX_PEERS, SESSION_IDLE_S, ClientHandshake, KVAuth, Peer, Session
from pdqueue.transfer.base import Ticket, Transport
from pdqueue.transfer.blocks import copy_blocks, plan_frames, planes
from pdqueue.transfer.errors import FailureCode, TransferError
from pdqueue.transfer.sender_admission import Admission, Fetch, lease_lost
from pdqueue.transfer.wire import (
    check_reply,
    check_reply_describes,
    data_tag,
    error_reply,
    hello,
    reply_format,
    request,
    seal,
    unpack,
)

_sender_log = logging.getLogger("pdqueue.transfer.sender")

MAX_ACCEPTED_FRAME_BYTES = 64 << 20   # a receiver drops a peer that sends a bigger frame
MAX_REQUEST_BYTES = 64 << 10          # a sender drops a peer that sends a bigger request
MAX_SOCKETS = 64                      # DEALERs kept open (one per sender endpoint), LRU
CLOSE_LINGER_MS = 200                 # how long close() lets queued fire-and-forget releases leave
_POLL_MS = 10   # how often the ROUTER's serving thread checks for close() (a switch waits for it)


class ControlClient:
    """Request/reply to KVSender endpoints (see the module docstring)."""

    def __init__(self, timeout_s: float, auth: KVAuth | None = None):
        self.timeout_s = timeout_s
        self.auth = auth
        self._context = zmq.Context()
        self._sockets: OrderedDict[str, zmq.Socket] = OrderedDict()
        self._sessions: dict[str, Session] = {}
        self._seq = itertools.count(1)

    def release_nowait(self, ticket: Ticket) -> None:
        """Release without waiting: a lost message only lets the lease run to its deadline."""
        try:
            self._socket(ticket.endpoint).send(request("release", 0, ticket, noreply=True), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def open(self, endpoint: str) -> None:
        """Make the socket to ``endpoint`` now, and with authentication its session (a
        handshake): the first fetch then pays neither. TransferError as for a fetch."""
        if self.auth is not None:
            self._session(endpoint)
        else:
            self._socket(endpoint)

    def fetch(self, ticket: Ticket, first_block: int = 0, **extra) -> tuple[dict, Iterator[zmq.Frame]]:
        """Send a fetch (of ``ticket.block_ids[first_block:]``; ``extra``: more request
        fields, e.g. ``kv_format``); return the reply header and an iterator over the
        ``num_frames`` data frames that follow it (zero-copy), each awaited at most
        ``timeout_s``. The iterator raises TransferError on a timeout, an error reply or a
        message out of order, and then drops the socket."""
        if first_block:
            extra["first_block"] = first_block
        header, _, seq = self._call(ticket, "fetch", **extra)
        count = header.get("num_frames")
        if not isinstance(count, int) or count < 0:
            raise TransferError(f"bad num_frames {count!r}", FailureCode.BAD_REPLY)
        return header, self._data_frames(ticket.endpoint, seq, count)

    def _data_frames(self, endpoint: str, seq: int, count: int) -> Iterator[zmq.Frame]:
        sock = self._socket(endpoint)
        for index in range(count):
            try:
                parts = sock.recv_multipart(copy=False)   # bounded by RCVTIMEO (no poll per frame)
            except zmq.Again:
                self.forget(endpoint)
                raise TransferError(f"data frame {index} of {count} from {endpoint} did not come within "
                                    f"{self.timeout_s}s (sender dead or stuck)",
                                    FailureCode.PEER_TIMEOUT) from None
            try:
                tag = unpack(parts[0].bytes)
            except Exception as exc:
                self.forget(endpoint)
                raise TransferError(f"undecodable data tag from {endpoint}: {exc}",
                                    FailureCode.BAD_REPLY) from None
            if len(parts) == 1 and tag.get("seq") == seq:
                self.forget(endpoint)
                check_reply(endpoint, "fetch", tag)   # an error reply: raises
            if len(parts) != 2 or tag.get("seq") != seq or tag.get("i") != index:
                self.forget(endpoint)
                raise TransferError(f"expected data frame {index} of fetch {seq} from {endpoint}, got "
                                    f"{len(parts)} parts tagged {tag}", FailureCode.BAD_REPLY)
            yield parts[1]

    def call(self, ticket: Ticket, op: str, **extra) -> dict:
        """One request about ``ticket`` (``op``, in a session with authentication) and its
        reply header; an error reply raises TransferError (transfer.nixl's ops)."""
        return self._call(ticket, op, **extra)[0]

    def _call(self, ticket: Ticket, op: str, again: bool = True, **extra) -> tuple[dict, list[zmq.Frame], int]:
        endpoint = ticket.endpoint
        session = self._session(endpoint) if self.auth is not None else None
        sock = self._socket(endpoint)
        seq = next(self._seq)
        raw = request(op, seq, ticket, **extra)
        if session is not None:
            raw = seal(session, raw, seq)
        header, frames = self._ask(endpoint, sock, seq, raw, op)
        if session is not None and again and header.get("handshake") and not header.get("ok"):
            # The sender does not know our session (it restarted on this port, or forgot an
            # idle one): a new socket, a new handshake, once.
            self.forget(endpoint)
            return self._call(ticket, op, again=False, **extra)
        check_reply(endpoint, op, header)
        return header, frames, seq

    def _session(self, endpoint: str) -> Session:
        """The authenticated session on ``endpoint``'s socket: kept, or made by a handshake
        (on a new socket when the old session sat idle long enough for the sender to forget it)."""
        session = self._sessions.get(endpoint)
        now = time.monotonic()
        if session is not None and now - session.used > CLIENT_REFRESH_S:
            self.forget(endpoint)
            session = None
        if session is None:
            handshake = ClientHandshake(self.auth)
            seq = next(self._seq)
            header, _ = self._ask(endpoint, self._socket(endpoint), seq, hello(seq, handshake), "hello")
            try:
                check_reply(endpoint, "hello", header)
            except TransferError:
                self.forget(endpoint)
                raise
            session = handshake.finish(header)
            if session is None:
                self.forget(endpoint)
                raise TransferError(f"{endpoint} did not prove this cluster's KV secret (an impostor, or a sender "
                                    "of another cluster or secret)", FailureCode.AUTH_FAILED)
            self._sessions[endpoint] = session
        session.used = now
        return session

    def _ask(self, endpoint: str, sock: zmq.Socket, seq: int, raw: bytes, op: str) -> tuple[dict, list[zmq.Frame]]:
        """Send ``raw`` and wait (at most ``timeout_s``) for the reply with this ``seq``."""
        try:
            sock.send(raw, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self.forget(endpoint)
            raise TransferError(f"cannot send {op} to {endpoint}: {exc}", FailureCode.PEER_TIMEOUT) from None
        deadline = time.monotonic() + self.timeout_s
        while True:
            remaining_ms = (deadline - time.monotonic()) * 1000
            if remaining_ms <= 0 or not sock.poll(remaining_ms, zmq.POLLIN):
                self.forget(endpoint)
                raise TransferError(f"no reply to {op} from {endpoint} within {self.timeout_s}s "
                                    "(sender dead or stuck)", FailureCode.PEER_TIMEOUT)
            frames = sock.recv_multipart(copy=False)
            try:
                header = unpack(frames[0].bytes)
            except Exception as exc:
                self.forget(endpoint)
                raise TransferError(f"undecodable reply from {endpoint}: {exc}", FailureCode.BAD_REPLY) from None
            if header.get("seq") == seq:
                return header, frames[1:]   # anything else is a late reply to an earlier request

    def forget(self, endpoint: str, linger_ms: int = 0) -> None:
        self._sessions.pop(endpoint, None)
        sock = self._sockets.pop(endpoint, None)
        if sock is not None:
            sock.close(linger=linger_ms)

    def close(self) -> None:
        """Close every socket; releases still queued get a moment to leave (else their leases
        run to their deadlines)."""
        for endpoint in list(self._sockets):
            self.forget(endpoint, linger_ms=CLOSE_LINGER_MS)
        self._context.term()

    def _socket(self, endpoint: str) -> zmq.Socket:
        sock = self._sockets.get(endpoint)
        if sock is not None:
            self._sockets.move_to_end(endpoint)
            return sock
        if len(self._sockets) >= MAX_SOCKETS:
            self.forget(next(iter(self._sockets)))
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_ACCEPTED_FRAME_BYTES)
        sock.setsockopt(zmq.RCVTIMEO, max(1, int(self.timeout_s * 1000)))
        sock.connect(endpoint)
        self._sockets[endpoint] = sock
        return sock


# ---- the receiver half: the zmq backend ------------------------------------------------------

class ZmqTransport(Transport):
    name = "zmq"

    def can_fetch(self, ticket: Ticket) -> bool:
        return bool(ticket.endpoint)

    def fetch(self, ticket: Ticket, dst_block_ids: list[int], first_block: int = 0) -> int:
        asked = self.ctx.kv_format
        header, frames = self.ctx.control.fetch(ticket, first_block,
                                                **({"kv_format": asked} if asked != NATIVE else {}))
        layout = self.ctx.layout
        num_planes = 2 * layout.num_layers
        check_reply_describes(ticket, header, layout, first_block)
        codec = KVCodec.for_layout(reply_format(ticket.endpoint, header, asked), layout)
        unit = codec.unit_nbytes
        max_frame_bytes = header.get("max_frame_bytes")
        if not isinstance(max_frame_bytes, int) or max_frame_bytes <= 0:
            raise TransferError(f"bad max_frame_bytes {max_frame_bytes!r}", FailureCode.BAD_REPLY)
        if header.get("frames") != "staged":
            raise TransferError(f"unknown frame plan {header.get('frames')!r}", FailureCode.BAD_REPLY)
        num_blocks = len(ticket.block_ids) - first_block
        plan = plan_frames(num_planes, num_blocks, unit, max_frame_bytes)
        if header.get("num_frames") != len(plan):
            raise TransferError(f"expected {len(plan)} data frames, header says {header.get('num_frames')}",
                                FailureCode.BAD_REPLY)
        dst = planes(self.ctx.pool)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            for (p0, p1, b0, b1), frame in zip(plan, frames):
                if len(frame) != (p1 - p0) * (b1 - b0) * unit:
                    self.ctx.control.forget(ticket.endpoint)   # the rest of the reply is still queued
                    raise TransferError(f"data frame of {len(frame)} bytes, expected "
                                        f"{(p1 - p0) * (b1 - b0) * unit}", FailureCode.BAD_REPLY)
                if codec.native:
                    src = torch.frombuffer(frame.buffer, dtype=layout.torch_dtype).view(p1 - p0, b1 - b0, -1)
                    copy_blocks(src, range(b1 - b0), dst[p0:p1], dst_block_ids[b0:b1])
                else:
                    src = torch.frombuffer(frame.buffer, dtype=torch.uint8).view(p1 - p0, b1 - b0, unit)
                    codec.decode(src, dst, dst_block_ids[b0:b1], plane_start=p0)
        self.ctx.control.release_nowait(ticket)
        return codec.nbytes(num_planes, num_blocks)

    def forget(self, ticket: Ticket) -> None:
        self.ctx.control.forget(ticket.endpoint)


# ---- the sender half: the ROUTER (every sender runs it: the control channel of every path) ----

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
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
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
                _sender_log.exception("KV sender %s: failed to serve a request", self.worker_id)

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
            _sender_log.exception("KV sender %s: %s of %r failed", self.worker_id, msg.get("op"), msg.get("request_id"))
            return [error_reply(msg.get("seq"), FailureCode.BAD_REPLY, f"sender failed: {exc!r}")]

    def _send_staged(self, identity: bytes, fetch: Fetch) -> list:
        """Send the header, then each frame as its own message ``[data_tag, bytes]``, staged
        (gathered from the leased blocks) just before it is sent and sent only if the lease
        still held when staging ended. Returns an error reply, or [] once everything is
        queued on the socket. (Frames sent zero-copy straight from the pool are slower: pyzmq
        wakes its gc thread for every such frame; docs/performance-history.md, "What changed in
        transfer version 4, and why".)"""
        seq, request_id, block_ids = fetch.seq, fetch.request_id, fetch.block_ids
        codec = self.admission.codec(fetch.kv_format)   # native: the blocks as they are
        num_planes, num_blocks, unit = self._planes.shape[0], len(block_ids), codec.unit_nbytes
        plan = plan_frames(num_planes, num_blocks, unit, self.max_frame_bytes)
        staging = self._staging_buffer(num_planes * num_blocks * unit)
        staged_bytes = staging.view(num_planes, num_blocks, unit)
        staged = staging.view(self.layout.torch_dtype).view(num_planes, num_blocks, -1) if codec.native else None
        self._sock.send_multipart([identity, fetch.header(num_frames=len(plan), max_frame_bytes=self.max_frame_bytes,
                                                          frames="staged")])
        last, tracker = len(plan) - 1, None
        leases = self.admission.leases
        try:
            for index, (p0, p1, b0, b1) in enumerate(plan):
                if staged is not None:
                    copy_blocks(self._planes[p0:p1], block_ids[b0:b1], staged[p0:p1], range(b0, b1))
                else:
                    codec.encode(self._planes, block_ids[b0:b1], staged_bytes[p0:p1, b0:b1], plane_start=p0)
                if not leases.is_held(request_id):
                    return [lease_lost(seq, request_id)]
                # Only the last frame is tracked: ZeroMQ frees a peer's messages in order, so
                # once it is done the whole staging buffer is free again.
                frame = zmq.Frame(staged_bytes[p0:p1, b0:b1].reshape(-1).numpy(), track=index == last)
                self._sock.send_multipart([identity, data_tag(seq, index), frame], copy=False)
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
