"""The ``tcp`` transport, both halves: the TCP data wire, KV bytes from the sender's pool
straight into the receiver's pool.

Why beside ZeroMQ: a ZeroMQ fetch costs two copies a plain socket does not make (the
sender gathers blocks into frames; libzmq receives into its own buffers, which the receiver
then copies into its pool), and sending frames straight from the pool instead costs a
wakeup of pyzmq's garbage-collector thread per frame, slower still (docs/performance-history.md,
"What changed in transfer version 4, and why"). Over this
wire the sender writes its pool's block runs with gathering ``sendmsg`` and the receiver
reads them with scattering ``recvmsg_into`` straight into its destination blocks: the same
work as a raw socket, so a fetch runs at raw-socket speed, scattered blocks included.
ZeroMQ stays the fallback path (``mode="zmq"``, tickets without a data endpoint).

Messages on one connection (one request at a time, the receiver asks, the sender answers):
- a control message: 4-byte little-endian length + msgpack map. A request is
  ``{v, op, seq, request_id, incarnation, nonce, mac}`` (op ``fetch``, or ``release`` which gets
  no answer); a reply is the ZeroMQ wire's reply header (``ok``; on error ``code, reason``;
  a fetch reply adds ``request_id, block_ids, shape, dtype, nbytes``). With
  authentication (transfer.auth) the receiver's first message is ``hello`` (answered with the
  sender's challenge and proof, before any other request) and every fetch is ``sealed``, the
  first one carrying the receiver's proof, as on the ZeroMQ wire; a connection that fails
  authentication, or is not authenticated within ``auth.HANDSHAKE_TIMEOUT_S``, is closed;
- after a successful fetch reply, exactly ``nbytes`` raw bytes: for each plane of the pool,
  the ticket's blocks in sequence order (``stream_pieces``). A fetch may ask for a KV format
  (``kv_format``: fp16, int8; engine.kv_codec): the reply then names it and the bytes are
  the codec's units in the same order (``[planes, blocks, unit_nbytes]``), encoded by the
  sender from its pool into a staging buffer of the connection's thread and decoded by the
  receiver from one into its pool, a group of planes (~MAX_FRAME_BYTES) at a time so that
  encoding, the wire and decoding overlap. Native replies stay zero-copy, as described here.
A sender that fails after its reply closes the connection: the receiver sees the stream end
early and fails the fetch. Anything unexpected closes the connection on either side.

``DataServer`` (sender side) accepts connections on its own thread and serves each on a
thread of its own (at most MAX_CONNECTIONS), so a slow receiver stalls only itself; every
socket has a timeout, after which it is closed; each connection has its ``auth.Peer`` (its
address, challenge and session), which the handler reads and writes. ``DataClient`` (receiver side) keeps one
connection per sender endpoint (LRU, at most MAX_CONNECTIONS), authenticated when it is
given the cluster's ``KVAuth`` (the handshake runs when it connects), and is not thread-safe
(``KVReceiver`` serialises calls). Each owns its sockets and threads and frees them on
``close()``.

``TcpTransport`` (receiver): one connection per sender data endpoint, authenticated when it
is made if the receiver has the cluster's ``KVAuth``; a ``fetch`` request (sealed), the
reply header validated like zmq's, then ``recvmsg_into`` straight into the destination
blocks, one buffer per run of consecutive (source, destination) blocks per plane; then a
fire-and-forget release. Any failure closes the connection. Chosen before zmq in auto mode
when the ticket names a data endpoint; a data endpoint that refuses connections lets auto
mode fall back to zmq. ``DataSource`` (sender): the ``DataServer`` and its request handler
(what to answer is decided by the sender's ``Admission``).
Imports the standard library, torch, and msgpack through transfer.wire; never zmq.
"""

from __future__ import annotations

import itertools
import logging
import socket
import struct
import threading
import time
from collections import OrderedDict
from typing import Callable, Iterator, Sequence

import torch

from pdqueue.engine.kv_cache import KVCacheLayout
from pdqueue.engine.kv_codec import NATIVE, KVCodec
from pdqueue.transfer.auth import ClientHandshake, KVAuth, Peer, Session
from pdqueue.transfer.base import ReceiveContext, Source, SourceContext, Ticket, Transport
from pdqueue.transfer.blocks import MAX_FRAME_BYTES, block_runs, planes, position_runs
from pdqueue.transfer.errors import FailureCode, TransferError
from pdqueue.transfer.sender_admission import Admission, Fetch
from pdqueue.transfer.wire import (
    check_reply,
    check_reply_describes,
    hello,
    pack,
    reply_format,
    request,
    seal,
    unpack,
)

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 64
MAX_CONTROL_BYTES = 64 << 10
_LENGTH = struct.Struct("<I")


def stream_pieces(num_planes: int, src_ids: Sequence[int],
                  dst_ids: Sequence[int]) -> Iterator[tuple[int, int, int, int]]:
    """The data stream's order, cut where either side's blocks stop being consecutive:
    (plane, src_start, dst_start, num_blocks). The sender may write coarser pieces (its own
    runs); the bytes are the same."""
    runs = block_runs(src_ids, dst_ids)
    for p in range(num_planes):
        for s, d, n in runs:
            yield p, s, d, n


def plane_groups(num_planes: int, plane_nbytes: int) -> Iterator[tuple[int, int]]:
    """[p0, p1) groups of planes of about MAX_FRAME_BYTES (one plane at least): the pieces
    an encoded reply is staged, sent and decoded in, so that the three overlap."""
    step = max(1, MAX_FRAME_BYTES // max(1, plane_nbytes))
    for p0 in range(0, num_planes, step):
        yield p0, min(p0 + step, num_planes)


def source_pieces(num_planes: int, src_ids: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """The sender's pieces of the stream: (plane, first source block, num_blocks)."""
    runs = [(src_ids[b0], b1 - b0) for b0, b1 in position_runs(src_ids)]
    for p in range(num_planes):
        for first, n in runs:
            yield p, first, n


def send_control(sock: socket.socket, message: dict | bytes) -> None:
    raw = message if isinstance(message, bytes) else pack(message)
    sock.sendall(_LENGTH.pack(len(raw)) + raw)


def recv_control(sock: socket.socket) -> dict | None:
    """One control message; None if the peer closed cleanly before it. Raises ValueError on
    a malformed one, OSError (socket.timeout included) on the socket's failures."""
    raw = recv_frame(sock)
    return None if raw is None else unpack(raw)


def recv_frame(sock: socket.socket) -> bytes | None:
    """One control message's bytes, undecoded; None if the peer closed cleanly before it.
    ValueError when its length is over MAX_CONTROL_BYTES."""
    head = _recv_exactly(sock, _LENGTH.size, eof_ok=True)
    if head is None:
        return None
    (length,) = _LENGTH.unpack(head)
    if length > MAX_CONTROL_BYTES:
        raise ValueError(f"control message of {length} bytes (at most {MAX_CONTROL_BYTES})")
    return _recv_exactly(sock, length)


_IOV_MAX = 1024   # buffers per sendmsg / recvmsg_into call (Linux's IOV_MAX)


def send_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Write the buffers in order with gathering ``sendmsg`` calls (scattered blocks cost one
    system call per ~1024 pieces, not one each)."""
    pending = [v for v in views if len(v)]
    while pending:
        sent = sock.sendmsg(pending[:_IOV_MAX])
        pending = _advance(pending, sent)


def recv_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill the buffers in order with scattering ``recvmsg_into`` calls; ConnectionError if
    the stream ends first."""
    pending = [v for v in views if len(v)]
    total, got = sum(len(v) for v in pending), 0
    while pending:
        n = sock.recvmsg_into(pending[:_IOV_MAX])[0]
        if not n:
            raise ConnectionError(f"stream ended after {got} of {total} bytes")
        got += n
        pending = _advance(pending, n)


def _advance(views: list[memoryview], nbytes: int) -> list[memoryview]:
    """Drop the first ``nbytes`` bytes from a list of buffers."""
    i = 0
    while nbytes and nbytes >= len(views[i]):
        nbytes -= len(views[i])
        i += 1
    views = views[i:]
    if nbytes:
        views[0] = views[0][nbytes:]
    return views


def _recv_exactly(sock: socket.socket, size: int, eof_ok: bool = False) -> bytes | None:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:])
        if not n:
            if eof_ok and got == 0:
                return None
            raise ConnectionError(f"stream ended after {got} of {size} bytes")
        got += n
    return bytes(buf)


def _tune(sock: socket.socket, timeout_s: float) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(timeout_s)


class DataServer:
    """The sender's listening socket and connection threads (see the module docstring).

    ``handle(conn, raw, peer)`` serves one control message's bytes on ``conn`` (control reply
    and data) and returns whether to keep the connection; an exception from it closes the
    connection too. With ``handshake_timeout_s``, a connection whose ``peer.session`` is
    still None that long after it opened is closed, and so is one that sends a message over
    MAX_CONTROL_BYTES before it has a session: ``on_refused(peer, reason)`` is told."""

    def __init__(self, host: str, port: int, handle: Callable[[socket.socket, bytes, Peer], bool],
                 timeout_s: float = 30.0, name: str = "kv-data", *, handshake_timeout_s: float | None = None,
                 on_refused: Callable[[Peer, str], None] | None = None):
        self._handle = handle
        self.timeout_s = timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self._on_refused = on_refused or (lambda peer, reason: None)
        self._listener = socket.create_server((host, port), backlog=MAX_CONNECTIONS)
        self._listener.settimeout(0.2)   # how often the accept loop checks for close()
        self.address = self._listener.getsockname()[:2]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._name = name
        self._thread = threading.Thread(target=self._accept, name=f"{name}-accept", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                log.exception("%s: accept failed", self._name)
                continue
            with self._lock:
                if len(self._conns) >= MAX_CONNECTIONS or self._stop.is_set():
                    log.warning("%s: refusing %s: %d connections open", self._name, peer, len(self._conns))
                    conn.close()
                    continue
                self._conns.add(conn)
            _tune(conn, self.timeout_s if self.handshake_timeout_s is None else self.handshake_timeout_s)
            threading.Thread(target=self._serve, args=(conn, Peer(address=str(peer[0]))), name=f"{self._name}-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket, peer: Peer) -> None:
        pending = self.handshake_timeout_s is not None   # no session yet: the short timeout applies
        try:
            while not self._stop.is_set():
                if pending and peer.session is not None:
                    pending = False
                    conn.settimeout(self.timeout_s)
                try:
                    raw = recv_frame(conn)
                except socket.timeout:
                    if pending and time.monotonic() - peer.opened >= self.handshake_timeout_s:
                        self._on_refused(peer, f"not authenticated within {self.handshake_timeout_s:g}s")
                        return
                    continue   # an idle receiver: keep its connection
                except ValueError as exc:
                    if pending:
                        self._on_refused(peer, str(exc))
                        return
                    raise
                if raw is None or not self._handle(conn, raw, peer):
                    return
        except (OSError, ValueError) as exc:
            if not self._stop.is_set():
                log.info("%s: dropping a connection: %r", self._name, exc)
        except Exception:
            log.exception("%s: failed to serve a connection", self._name)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        """Stop accepting and close every connection (their threads end on their own)."""
        self._stop.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)   # wakes a blocked accept() at once (Linux)
        except OSError:
            pass
        self._thread.join()
        self._listener.close()
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()


class DataClient:
    """The receiver's connections, one per sender data endpoint ``tcp://host:port``; with
    ``auth``, each authenticated (``sessions``: the session of each connection)."""

    def __init__(self, timeout_s: float, auth: KVAuth | None = None):
        self.timeout_s = timeout_s
        self.auth = auth
        self._conns: OrderedDict[str, socket.socket] = OrderedDict()
        self.sessions: dict[str, Session] = {}

    def connect(self, endpoint: str) -> tuple[socket.socket, bool]:
        """(the open connection to ``endpoint``, whether it was kept from before), made if
        needed; TransferError (``peer_timeout``: another path may work) if it cannot be made."""
        conn = self._conns.get(endpoint)
        if conn is not None:
            self._conns.move_to_end(endpoint)
            return conn, True
        host, port = parse_endpoint(endpoint)
        try:
            conn = socket.create_connection((host, port), timeout=self.timeout_s)
        except OSError as exc:
            # Mode "auto" then tries ZeroMQ (e.g. a firewall that lets only it through).
            raise TransferError(f"cannot connect to KV data endpoint {endpoint}: {exc}",
                                FailureCode.PEER_TIMEOUT) from None
        _tune(conn, self.timeout_s)
        if self.auth is not None:
            try:
                session = self._handshake(conn, endpoint)
            except BaseException:
                conn.close()
                raise
        if len(self._conns) >= MAX_CONNECTIONS:
            self.forget(next(iter(self._conns)))
        self._conns[endpoint] = conn
        if self.auth is not None:
            self.sessions[endpoint] = session
        return conn, False

    def _handshake(self, conn: socket.socket, endpoint: str) -> Session:
        """hello -> the sender's challenge and proof, checked; TransferError otherwise."""
        handshake = ClientHandshake(self.auth)
        try:
            send_control(conn, hello(0, handshake))
            reply = recv_control(conn)
        except (OSError, ValueError) as exc:
            # Mode "auto" then tries ZeroMQ (e.g. the sender is at its connection limit).
            raise TransferError(f"KV data endpoint {endpoint} failed the handshake: {exc!r}",
                                FailureCode.PEER_TIMEOUT) from None
        if reply is None:
            raise TransferError(f"KV data endpoint {endpoint} closed the connection at the handshake",
                                FailureCode.PEER_TIMEOUT)
        check_reply(endpoint, "hello", reply)   # e.g. a sender without authentication
        session = handshake.finish(reply)
        if session is None:
            raise TransferError(f"{endpoint} did not prove this cluster's KV secret (an impostor, or a sender of "
                                "another cluster or secret)", FailureCode.AUTH_FAILED)
        return session

    def forget(self, endpoint: str) -> None:
        self.sessions.pop(endpoint, None)
        conn = self._conns.pop(endpoint, None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        for endpoint in list(self._conns):
            self.forget(endpoint)


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    scheme, _, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme != "tcp" or not host or not port.isdigit():
        raise TransferError(f"bad KV data endpoint {endpoint!r} (expected tcp://host:port)",
                            FailureCode.BAD_TICKET)
    return host.strip("[]"), int(port)


def bind_host(endpoint: str) -> str:
    """The host of ``tcp://host:port`` (``*`` meaning every interface)."""
    host = endpoint.partition("://")[2].rpartition(":")[0]
    return "0.0.0.0" if host in ("*", "") else host.strip("[]")


# ---- the receiver half: the tcp backend -------------------------------------------------------

class TcpTransport(Transport):
    """The TCP data wire (tcp.py): bytes land straight in the destination blocks."""

    name = "tcp"

    def __init__(self, ctx: ReceiveContext):
        super().__init__(ctx)
        self.client = DataClient(ctx.timeout_s, ctx.auth)
        self._seq = itertools.count(1)
        on_host = ctx.pool.device.type == "cpu"
        self._pool_bytes = memoryview(ctx.pool.view(-1).view(torch.uint8).numpy()) if on_host else None
        self._codecs: dict[str, KVCodec] = {}
        self._staging: torch.Tensor | None = None   # encoded replies land here (flat uint8, reused)

    def can_fetch(self, ticket: Ticket) -> bool:
        return bool(ticket.data_endpoint) and self._pool_bytes is not None

    def check(self, ticket: Ticket) -> None:
        self.client.connect(ticket.data_endpoint)

    def fetch(self, ticket: Ticket, dst_block_ids: list[int], first_block: int = 0) -> int:
        endpoint, layout = ticket.data_endpoint, self.ctx.layout
        num_planes, block_nbytes = 2 * layout.num_layers, layout.block_nbytes
        plane_nbytes = layout.num_blocks * block_nbytes
        src_ids = ticket.block_ids[first_block:]
        try:
            conn, header = self._ask(endpoint, ticket, first_block)
            check_reply(endpoint, "fetch", header)   # an error reply raises here
            check_reply_describes(ticket, header, layout, first_block)
            codec = self._codec(reply_format(endpoint, header, self.ctx.kv_format))
            expected = codec.nbytes(num_planes, len(src_ids))
            if header.get("nbytes") != expected:
                raise TransferError(f"fetch reply announces {header.get('nbytes')} bytes, expected {expected}",
                                    FailureCode.BAD_REPLY)
            if codec.native:
                recv_views(conn, [self._pool_bytes[start:start + n * block_nbytes]
                                  for p, _s, d, n in stream_pieces(num_planes, src_ids, dst_block_ids)
                                  for start in (p * plane_nbytes + d * block_nbytes,)])
            else:
                self._recv_encoded(conn, codec, num_planes, dst_block_ids)
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
            send_control(conn, request("release", 0, ticket, noreply=True))
        except OSError:
            self.client.forget(endpoint)   # the lease runs to its deadline instead
        return expected

    def _codec(self, name: str) -> KVCodec:
        codec = self._codecs.get(name)
        if codec is None:
            codec = self._codecs[name] = KVCodec.for_layout(name, self.ctx.layout)
        return codec

    def _recv_encoded(self, conn: socket.socket, codec: KVCodec, num_planes: int, dst_block_ids: list[int]) -> None:
        """Receive a reply's encoded units into a staging buffer, a group of planes at a time,
        each group decoded into the destination blocks while the next is on the wire."""
        n, unit = len(dst_block_ids), codec.unit_nbytes
        if self._staging is None or self._staging.numel() < codec.nbytes(num_planes, n):
            self._staging = torch.empty(codec.nbytes(num_planes, n), dtype=torch.uint8)
        dst = planes(self.ctx.pool)
        for p0, p1 in plane_groups(num_planes, n * unit):
            chunk = self._staging[:(p1 - p0) * n * unit]
            recv_views(conn, [memoryview(chunk.numpy())])
            codec.decode(chunk.view(p1 - p0, n, unit), dst, dst_block_ids, plane_start=p0)

    def _ask(self, endpoint: str, ticket: Ticket, first_block: int = 0):
        """Send the fetch request and read the reply header: (connection, header). A kept
        connection that turns out dead before any reply (the sender restarted on a pinned
        port, a middlebox dropped it) is replaced once by a new one."""
        for attempt in range(2):
            conn, reused = self.client.connect(endpoint)
            try:
                seq = next(self._seq)
                extra = {"first_block": first_block} if first_block else {}
                if self.ctx.kv_format != NATIVE:
                    extra["kv_format"] = self.ctx.kv_format
                raw = request("fetch", seq, ticket, **extra)
                session = self.client.sessions.get(endpoint)
                if session is not None:
                    raw = seal(session, raw, seq)
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


# ---- the sender half: the data server's request handler ---------------------------------------

class DataSource(Source):
    """The sender half: owns the ``DataServer`` (its listener, connections and their
    threads) from construction (bound at once) to ``close``; its connection threads write a
    fetch's blocks straight from a pool in host memory, and the lease is held until the
    ``sendmsg`` calls have returned. Started for a pool in host memory when the sender has
    a ``data_port``; its endpoint (the ZeroMQ endpoint's host, the bound port) goes in
    every ticket as ``data_endpoint``."""

    def __init__(self, admission: Admission, pool_tensor: torch.Tensor, pool_planes: torch.Tensor,
                 layout: KVCacheLayout, host: str, port: int, timeout_s: float, *, name: str,
                 handshake_timeout_s: float | None, advertise_host: str):
        self.admission, self.layout = admission, layout
        self._planes = pool_planes
        self._pool_bytes = memoryview(pool_tensor.view(-1).view(torch.uint8).numpy())
        self._local = threading.local()   # each connection thread's staging buffer (encoded replies)
        self.server = DataServer(host, port, self.serve, timeout_s, name=name,
                                 handshake_timeout_s=handshake_timeout_s,
                                 on_refused=lambda peer, reason: admission.refuse(peer, None, reason))
        self.address = self.server.address
        self.endpoint = f"tcp://{advertise_host}:{self.address[1]}"

    @classmethod
    def start(cls, ctx: SourceContext) -> "DataSource | None":
        config = ctx.config
        if config.data_port is None or ctx.pool.device.type != "cpu":
            return None
        return cls(ctx.admission, ctx.pool, ctx.planes, ctx.layout, bind_host(config.endpoint), config.data_port,
                   config.data_timeout_s, name=f"kv-data-{ctx.worker_id}",
                   handshake_timeout_s=ctx.handshake_timeout_s, advertise_host=bind_host(ctx.endpoint))

    def ticket_fields(self) -> dict:
        return {"data_endpoint": self.endpoint}

    def close(self) -> None:
        self.server.close()

    def serve(self, conn, raw: bytes, peer: Peer) -> bool:
        """Serve one message; False (or an exception) closes the connection. A peer without
        a session that gets any reply is refused: it is closed."""
        msg, authenticated, reply = self.admission.admit(raw, peer)
        if msg is None:
            if reply is not None:
                send_control(conn, reply)
            return authenticated   # here: whether the peer may go on
        sending = threading.Event()
        sending.set()
        try:
            answer = self.admission.answer(msg, authenticated=authenticated, peer=peer, answer_release=False,
                                           hold=lambda: not sending.is_set())
            if not isinstance(answer, Fetch):
                if answer is not None:
                    send_control(conn, answer)
                return authenticated or answer is None
            num_planes, block_nbytes = self._planes.shape[0], self.layout.block_nbytes
            if answer.kv_format != NATIVE:
                self._send_encoded(conn, answer, self.admission.codec(answer.kv_format))
                return True
            plane_nbytes = self._planes.shape[1] * block_nbytes
            send_control(conn, answer.header(nbytes=num_planes * len(answer.block_ids) * block_nbytes))
            send_views(conn, [self._pool_bytes[start:start + n * block_nbytes]   # from the pool, no copy
                              for p, first, n in source_pieces(num_planes, answer.block_ids)
                              for start in (p * plane_nbytes + first * block_nbytes,)])
            return True
        finally:
            sending.clear()   # sent: the kernel holds copies, the blocks may go back

    def _send_encoded(self, conn, answer: Fetch, codec: KVCodec) -> None:
        """The reply in ``codec``'s format: encoded under the lease into this connection
        thread's staging buffer, a group of planes at a time, each group sent while the
        next is encoded (the pool is read, never written)."""
        num_planes, n, unit = self._planes.shape[0], len(answer.block_ids), codec.unit_nbytes
        total = codec.nbytes(num_planes, n)
        send_control(conn, answer.header(nbytes=total))
        staging = getattr(self._local, "staging", None)
        if staging is None or staging.numel() < total:
            staging = self._local.staging = torch.empty(total, dtype=torch.uint8)
        for p0, p1 in plane_groups(num_planes, n * unit):
            chunk = staging[:(p1 - p0) * n * unit]
            codec.encode(self._planes, answer.block_ids, chunk.view(p1 - p0, n, unit), plane_start=p0)
            send_views(conn, [memoryview(chunk.numpy())])
