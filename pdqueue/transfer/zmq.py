"""The ZeroMQ wire between a KVSender (ROUTER) and its receivers (DEALER), and the request
and reply messages that the TCP data wire (tcp.py) speaks too.

Every request is one msgpack frame ``{v, op, seq, request_id, incarnation, nonce, mac}`` with
``op`` one of ``fetch`` or ``release`` (``noreply`` for fire-and-forget; ``mac`` is the
ticket's, which the sender compares with the one it issued). With authentication
(transfer.auth) a receiver first sends ``{v, op: hello, seq, cn}`` and gets ``{v, seq, ok,
sn, proof}``; every later request goes inside ``{v, op: sealed, seq, body, tag[, proof]}``
(``body``: the packed request; the client's ``proof`` on the first one). A release is
accepted without a session on the strength of the ticket's MAC alone (it serves nothing and
gets no answer), so the shm path's fire-and-forget release never waits for a handshake. A reply is a msgpack
header frame ``{v, seq, ok, ...}`` (on error: ``code, reason``); a ``fetch`` reply
adds ``request_id, block_ids, shape, dtype, num_frames, max_frame_bytes, frames``
(``"staged"``) and is followed by ``num_frames`` messages
``[data_tag {v, seq, i}, raw bytes]`` cut by ``blocks.plan_frames``. Separate messages rather
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
Imports zmq, msgpack, transfer.base (the one direction: base never imports this module).
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from typing import Iterator

import msgpack
import zmq

from pdqueue.transfer.auth import CLIENT_REFRESH_S, ClientHandshake, KVAuth, Session
from pdqueue.transfer.base import TRANSFER_VERSION, Ticket
from pdqueue.transfer.errors import FailureCode, TransferError

MAX_ACCEPTED_FRAME_BYTES = 64 << 20   # a receiver drops a peer that sends a bigger frame
MAX_REQUEST_BYTES = 64 << 10          # a sender drops a peer that sends a bigger request
MAX_SOCKETS = 64                      # DEALERs kept open (one per sender endpoint), LRU
CLOSE_LINGER_MS = 200                 # how long close() lets queued fire-and-forget releases leave


def pack(message: dict) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(raw: bytes) -> dict:
    message = msgpack.unpackb(raw, raw=False)
    if not isinstance(message, dict):
        raise ValueError("message is not a map")
    return message


def request(op: str, seq: int, ticket: Ticket, **extra) -> bytes:
    return pack({"v": TRANSFER_VERSION, "op": op, "seq": seq, "request_id": ticket.request_id,
                 "incarnation": ticket.incarnation, "nonce": ticket.nonce, "mac": ticket.mac, **extra})


def hello(seq: int, handshake: ClientHandshake) -> bytes:
    return pack({"v": TRANSFER_VERSION, "seq": seq, **handshake.hello_fields()})


def seal(session: Session, body: bytes, seq: int) -> bytes:
    """A request (``body``, packed, with this ``seq``) inside a sealed message; the first one
    of a session carries the client's proof."""
    message = {"v": TRANSFER_VERSION, "op": "sealed", "seq": seq, "body": body, "tag": session.tag(body)}
    if session.proof is not None:
        message["proof"], session.proof = session.proof, None
    return pack(message)


def data_tag(seq: int, index: int) -> bytes:
    return pack({"v": TRANSFER_VERSION, "seq": seq, "i": index})


def error_reply(seq, code: FailureCode, reason: str, **extra) -> bytes:
    return pack({"v": TRANSFER_VERSION, "seq": seq, "ok": False, "code": code.value,
                 "reason": reason, **extra})


def ok_reply(seq, **fields) -> bytes:
    return pack({"v": TRANSFER_VERSION, "seq": seq, "ok": True, **fields})


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

    def fetch(self, ticket: Ticket, first_block: int = 0) -> tuple[dict, Iterator[zmq.Frame]]:
        """Send a fetch (of ``ticket.block_ids[first_block:]``); return the reply header and
        an iterator over the ``num_frames`` data frames that follow it (zero-copy), each
        awaited at most ``timeout_s``. The iterator raises TransferError on a timeout, an
        error reply or a message out of order, and then drops the socket."""
        header, _, seq = self._call(ticket, "fetch", **({"first_block": first_block} if first_block else {}))
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
                self.check_reply(endpoint, "fetch", tag)   # an error reply: raises
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
        self.check_reply(endpoint, op, header)
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
                self.check_reply(endpoint, "hello", header)
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

    @staticmethod
    def check_reply(endpoint: str, op: str, header: dict) -> None:
        """Raise TransferError unless ``header`` is a successful reply of our version."""
        if header.get("v") != TRANSFER_VERSION:
            raise TransferError(f"{endpoint} speaks transfer version {header.get('v')}, "
                                f"expected {TRANSFER_VERSION}", FailureCode.VERSION_MISMATCH)
        if not header.get("ok"):
            try:
                code = FailureCode(header.get("code"))
            except ValueError:
                code = FailureCode.BAD_REPLY
            raise TransferError(f"{endpoint}: {header.get('reason')}", code)

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
