"""The sender half (prefill worker): exports tickets and serves them over a TCP data server
and a ZeroMQ ROUTER.

Lifecycle of an exported request: ``export`` leases its blocks and returns a Ticket (with
the blocks' epochs when the pool is a shared segment) -> a receiver on this node copies
straight out of the segment and validates the copy against the epochs, with no round trip;
a receiver elsewhere fetches over the TCP data wire (a connection thread of ``DataServer``
writes the blocks straight from the pool; the lease is held until its ``sendmsg`` calls
return) or over ZeroMQ (this thread sends a header, then gathers the blocks frame by frame
into a staging buffer under the lease and sends each frame as its own message as soon as
it is staged, so that staging, the wire and the receiver's copying overlap) -> the receiver
``release``s (fire-and-forget) -> ``poll_freeable`` bumps the blocks' epochs and hands them
back to the engine thread, which frees them. Leases that are never released expire.
With ``shared_blocks`` (the prefill role: its engine caches prefixes) leases may share
blocks and ``poll_freeable`` bumps nothing: the engine bumps a block's epoch when it
rewrites it (``LLMEngine(on_rewrite=)``), since a handed-back block stays cached, intact.

Both wires carry the same requests, and two methods decide every one of them: ``_admit``
takes a message's bytes from a peer (a ZeroMQ identity or a TCP connection, each with its
``auth.Peer``) and answers a handshake itself (``hello``: a fresh challenge and this
sender's proof) or opens a ``sealed`` request (the client's proof against the challenge it
was issued, the tag, the growing ``seq``); ``_answer`` checks the version, authentication,
incarnation, nonce, the ticket's MAC against the lease's and the op, releases, or acquires
the fetch's lease and describes its reply header (``_Fetch``); the wire then only does its
own I/O (staged frames on the ROUTER, ``sendmsg`` on a data connection).

Authentication (``auth``: the cluster's ``KVAuth``; None: off): before a peer has proved
the cluster secret it gets nothing but a challenge, or a refusal; a release needs no
session, only the ticket's MAC (it serves nothing). Every refusal is counted in
``auth_failures`` (read by the worker's heartbeat and metrics) and logged once per peer
address; a bad message never stops the serving threads.

Who owns what: the engine owns the pool and writes only blocks it owns; leased blocks are
read-only for everyone until ``poll_freeable`` returns them (see leases.py); a lease lost
while its frames are being staged turns the rest of the reply into an error. The serving
thread owns the ROUTER socket, its zmq context and the staging buffer (zmq may still send
from it after ``_send_staged`` returns: a busy buffer is never reused, one abandoned midway
is dropped); the ``DataServer`` owns its listener, connections and their threads;
``close()`` stops both and frees them.
Requests are answered for tickets of this incarnation and segment nonce only. The bytes
are not encrypted (docs/security.md): bind to a private interface. Imports torch, zmq,
msgpack, socket (through transfer.tcp).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch
import zmq

from pdqueue.engine.kv_cache import KVCacheLayout
from pdqueue.transfer import zmq as wire
from pdqueue.transfer.auth import (HANDSHAKE_TIMEOUT_S, MAX_PEERS, NONCE_BYTES, PENDING_TTL_S, SESSION_IDLE_S,
                                   KVAuth, Peer, constant_time_equal)
from pdqueue.transfer.base import TRANSFER_VERSION, Ticket
from pdqueue.transfer.blocks import MAX_FRAME_BYTES, copy_blocks, plan_frames, planes
from pdqueue.transfer.errors import FailureCode
from pdqueue.transfer.leases import LeaseState, LeaseTable
from pdqueue.transfer.nixl import NixlSource
from pdqueue.transfer.shm import SharedKVPool
from pdqueue.transfer.tcp import DataServer, send_control, send_views, source_pieces

log = logging.getLogger(__name__)

_POLL_MS = 10   # how often the serving thread checks for close() (a switch waits for it)
_MAX_LOGGED_PEERS = 1024   # peer addresses whose first refusal was logged (later ones: counted only)


@dataclass(frozen=True, slots=True)
class _Fetch:
    """A fetch to serve (``KVSender._answer``): its lease is acquired."""

    seq: Any
    request_id: str
    block_ids: tuple[int, ...]
    shape: list[int]   # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    dtype: str

    def header(self, **wire_fields) -> bytes:
        """The reply header; each wire adds its own fields (the frame plan, or nbytes)."""
        return wire.ok_reply(self.seq, request_id=self.request_id, block_ids=list(self.block_ids),
                             shape=self.shape, dtype=self.dtype, **wire_fields)


class KVSender:
    def __init__(self, pool_tensor: torch.Tensor, layout: KVCacheLayout, worker_id: str, incarnation: str,
                 node: str, segment_name: str | None = None, nonce: str | None = None,
                 endpoint: str = "tcp://127.0.0.1:*", lease_s: float = 30.0, *,
                 advertise: str | None = None, max_frame_bytes: int = MAX_FRAME_BYTES,
                 shared_pool: SharedKVPool | None = None,
                 data_port: int | None = 0, data_timeout_s: float = 30.0, auth: KVAuth | None = None,
                 shared_blocks: bool = False, nixl: bool = False):
        """``endpoint``: bind address; ``advertise``: the address put in tickets (default: the
        bound one, which is wrong for wildcard hosts such as 0.0.0.0); a trailing ``:*`` in
        it stands for the port actually bound (``tcp://10.0.0.5:*``). ``shared_pool``: the
        segment ``pool_tensor`` lives in, whose block epochs this sender keeps (see shm.py).
        ``data_port``: the TCP data server's port on the same host (0: any free one; None: no
        data server; only for a pool in host memory), advertised with the host of the
        ZeroMQ endpoint. ``auth``: the cluster's secret and name; tickets are signed and
        both wires serve only peers that prove the secret (None: no authentication).
        ``shared_blocks``: the engine shares blocks between requests (prefix caching) and
        bumps a block's epoch itself before it rewrites it; leases may then overlap and
        handing one back bumps nothing (see the module docstring). ``nixl``: also serve the
        pool to one-sided NIXL reads (transfer.nixl: ops ``nixl_md`` and ``acquire``)."""
        layout.check_pool(pool_tensor)
        self.nixl = NixlSource(pool_tensor, worker_id, incarnation) if nixl else None
        self.layout = layout
        self.worker_id = worker_id
        self.incarnation = incarnation
        self.node = node
        self.segment_name = segment_name
        self.nonce = nonce
        self.max_frame_bytes = max_frame_bytes
        on_host = pool_tensor.device.type == "cpu"
        self._shared = shared_pool
        self.leases = LeaseTable(lease_s, shared_blocks=shared_blocks)
        self.shared_blocks = shared_blocks
        self.auth = auth
        self.auth_failures = 0   # refused messages and connections (see the module docstring)
        self._auth_lock = threading.Lock()
        self._logged_peers: set[str] = set()
        self._peers: OrderedDict[bytes, Peer] = OrderedDict()   # ZeroMQ identities (serving thread only)
        self._open_peer = Peer(address="any")   # without authentication every peer is this one
        self._planes = planes(pool_tensor)
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
        self._pool_bytes = memoryview(pool_tensor.view(-1).view(torch.uint8).numpy()) if on_host else None
        self._data: DataServer | None = None
        self.data_endpoint = ""
        if data_port is not None and on_host:
            try:
                self._data = DataServer(_bind_host(endpoint), data_port, self._serve_data, data_timeout_s,
                                        name=f"kv-data-{worker_id}",
                                        handshake_timeout_s=HANDSHAKE_TIMEOUT_S if auth is not None else None,
                                        on_refused=lambda peer, reason: self._refuse(peer, None, reason))
            except BaseException:
                self._sock.close(linger=0)
                self._context.term()
                raise
            self.data_endpoint = f"tcp://{_bind_host(self.endpoint)}:{self._data.address[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"kv-sender-{worker_id}", daemon=True)
        self._thread.start()

    @classmethod
    def for_shared_pool(cls, pool: SharedKVPool, node: str, **kwargs) -> "KVSender":
        """A sender for a pool created with SharedKVPool.create (which the caller still owns)."""
        return cls(pool.tensor, pool.layout, pool.info.worker_id, pool.info.incarnation, node,
                   segment_name=pool.name, nonce=pool.nonce, shared_pool=pool, **kwargs)

    def export(self, request_id: str, block_ids, num_tokens: int, lease_s: float | None = None, *,
               block_hashes=(), hash_root: bytes = b"") -> Ticket:
        """Lease ``block_ids`` (the engine must not free or write them until poll_freeable
        returns them) and return the ticket that lets a receiver fetch them. ``block_hashes``
        and ``hash_root``: the engine's prefix-cache names of the full blocks among them
        (a receiver that holds some of them fetches only the rest)."""
        if self._stop.is_set():
            raise RuntimeError("KVSender is closed")
        block_ids = tuple(int(b) for b in block_ids)
        if any(not 0 <= b < self.layout.num_blocks for b in block_ids) or len(set(block_ids)) != len(block_ids):
            raise ValueError(f"block ids {block_ids} are not distinct ids of a {self.layout.num_blocks}-block pool")
        if not 0 < num_tokens <= len(block_ids) * self.layout.block_size:
            raise ValueError(f"{num_tokens} tokens do not fit {len(block_ids)} blocks")
        epochs = tuple(self._shared.epochs_of(block_ids)) if self._shared is not None else ()
        deadline = self.leases.add(request_id, block_ids, num_tokens, lease_s)
        ticket = Ticket(TRANSFER_VERSION, request_id, self.worker_id, self.incarnation, self.node,
                        self.segment_name, self.nonce, block_ids, num_tokens, self.layout.to_dict(),
                        self.endpoint, time.time() + (deadline - self.leases.clock()), epochs, self.data_endpoint,
                        cluster=self.auth.cluster if self.auth is not None else "",
                        block_hashes=tuple(bytes(h) for h in block_hashes[:len(block_ids)]), hash_root=bytes(hash_root))
        if self.auth is not None:
            ticket = dataclasses.replace(ticket, mac=self.auth.ticket_mac(ticket))
            self.leases.set_mac(request_id, ticket.mac)   # until then no request can match it
        return ticket

    def poll_freeable(self) -> list[tuple[str, tuple[int, ...]]]:
        """(request_id, block_ids) of leases released or expired since the last call: the
        engine owns (and should free) these blocks now. Call from the engine thread. Their
        epochs are bumped first, so shm copies of them can no longer validate; not with
        ``shared_blocks``, where the engine bumps them when it rewrites them."""
        handed = self.leases.poll_freeable()
        if self._shared is not None and handed and not self.shared_blocks:
            self._shared.bump_epochs([b for _rid, block_ids in handed for b in block_ids])
        return handed

    def revoke(self, request_id: str) -> bool:
        """Take a lease back early (e.g. the ticket could not be published)."""
        return self.leases.revoke(request_id)

    def close(self) -> None:
        """Stop serving; pending replies are dropped. The pool is not touched."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._data is not None:
            self._data.close()
        self._thread.join()
        self._sock.close(linger=0)
        self._context.term()
        self._staging = None
        if self.nixl is not None:
            self.nixl.close()   # deregistered: a read still in flight fails on the receiver

    def __enter__(self) -> "KVSender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- one request, either wire ----------------------------------------------------------

    def _admit(self, raw: bytes, peer: Peer) -> tuple[dict | None, bool, bytes | None]:
        """A message's bytes from ``peer``: ``(request, authenticated, None)`` for ``_answer``,
        or ``(None, keep, reply)``: a handshake's answer or a refusal to send as it is (None:
        nothing), and whether the peer may go on (a TCP connection is closed otherwise)."""
        try:
            msg = wire.unpack(raw)
        except Exception as exc:
            if self.auth is not None and peer.session is None:
                return None, False, self._refuse(peer, None, f"undecodable message ({exc})")
            return None, True, wire.error_reply(None, FailureCode.BAD_REPLY, f"undecodable request: {exc}")
        seq, op = msg.get("seq"), msg.get("op")
        if msg.get("v") != TRANSFER_VERSION:
            return None, True, self._version_error(msg)
        if op not in ("hello", "sealed"):
            return msg, self.auth is None, None
        auth = self.auth
        if auth is None:
            return None, True, wire.error_reply(seq, FailureCode.AUTH_FAILED,
                                                f"{self.worker_id} runs without KV authentication (--kv-auth off)")
        now = time.monotonic()
        if op == "hello":
            cn = msg.get("cn")
            if not isinstance(cn, bytes) or len(cn) != NONCE_BYTES:
                return None, False, self._refuse(peer, seq, "malformed hello")
            sn = secrets.token_bytes(NONCE_BYTES)
            peer.challenge, peer.session = (sn, cn, now), None
            return None, True, wire.ok_reply(seq, sn=sn, proof=auth.server_proof(sn, cn))
        proof = msg.get("proof")
        if proof is not None:
            challenge, peer.challenge = peer.challenge, None   # one answer per challenge
            if challenge is None or now - challenge[2] > PENDING_TTL_S:
                return None, False, self._refuse(peer, seq, "a proof without a fresh challenge (a replayed handshake?)")
            sn, cn, _ = challenge
            key = auth.verify_proof("c2s", sn, cn, proof)
            if key is None:
                return None, False, self._refuse(peer, seq, "wrong proof (not this cluster's secret)")
            peer.session = auth.session(key, sn, cn)
        session = peer.session
        if session is None:
            return None, False, self._refuse(peer, seq, "a sealed request without a session", handshake=True)
        body = msg.get("body")
        if not session.verify(body, msg.get("tag")):
            return None, False, self._refuse(peer, seq, "a sealed request with a wrong tag")
        try:
            request = wire.unpack(body)
        except Exception as exc:
            return None, True, wire.error_reply(seq, FailureCode.BAD_REPLY, f"undecodable request: {exc}")
        inner_seq = request.get("seq")
        if type(inner_seq) is not int or inner_seq <= session.last_seq or inner_seq != seq:
            return None, False, self._refuse(peer, seq, f"request number {inner_seq!r} not above "
                                                        f"{session.last_seq} (a replayed request?)")
        session.last_seq, session.used = inner_seq, now
        return request, True, None

    def _answer(self, msg: dict, *, authenticated: bool, peer: Peer, answer_release: bool,
                hold: Callable[[], bool] | None = None) -> _Fetch | bytes | None:
        """Decide a request of either wire: a reply to send as it is (a refusal, an error, a
        release's answer when ``answer_release`` and the request wants one), None (nothing
        to send), or a ``_Fetch`` whose lease is acquired (and, given ``hold``, not handed
        back before ``hold()``) and whose data the wire sends. ``authenticated``: it came in
        a session (or authentication is off)."""
        seq, op, request_id = msg.get("seq"), msg.get("op"), msg.get("request_id")
        if msg.get("v") != TRANSFER_VERSION:
            return self._version_error(msg)
        if self.auth is not None and not authenticated:
            if op == "release" and msg.get("noreply"):
                self._release_by_capability(msg, peer)
                return None
            return self._refuse(peer, seq, f"{op!r} without authentication")
        if msg.get("incarnation") != self.incarnation:
            return wire.error_reply(seq, FailureCode.STALE_INCARNATION,
                                    f"ticket names incarnation {msg.get('incarnation')} of {self.worker_id}, "
                                    f"which now runs incarnation {self.incarnation}")
        if msg.get("nonce") != self.nonce:
            return wire.error_reply(seq, FailureCode.NONCE_MISMATCH, "ticket nonce does not match the segment")
        if self.auth is not None and op in ("fetch", "release", "acquire") and not self._mac_matches(request_id, msg):
            return self._refuse(peer, seq, f"the ticket MAC of {request_id!r} is not the one issued (a forged "
                                           "ticket, or another cluster's or secret's)", tell=True)
        if op == "release":
            valid = self.leases.release(request_id)
            return wire.ok_reply(seq, valid=valid) if answer_release and not msg.get("noreply") else None
        if op in ("nixl_md", "acquire"):
            return self._answer_nixl(seq, op, request_id)
        if op != "fetch":
            return wire.error_reply(seq, FailureCode.BAD_REPLY, f"unknown op {op!r}")
        first = msg.get("first_block", 0)
        lease = self.leases.get(request_id)
        if not isinstance(first, int) or first < 0 or (lease is not None and first >= len(lease.block_ids)):
            return wire.error_reply(seq, FailureCode.BAD_TICKET, f"first_block {first!r} is outside the ticket's blocks")
        if not self.leases.acquire(request_id):
            return self._lease_error(seq, request_id)
        if hold is not None:
            self.leases.hold_until(request_id, hold)
        lease = self.leases.get(request_id)
        if lease is None:
            return self._lease_lost(seq, request_id)
        layout, block_ids = self.layout, lease.block_ids[first:]
        num_blocks = len(block_ids)
        return _Fetch(seq, request_id, block_ids,
                      [layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim],
                      layout.dtype)

    def _answer_nixl(self, seq, op: str, request_id) -> bytes:
        """The NIXL path (transfer.nixl), for an authenticated peer of this incarnation:
        ``nixl_md``, this sender's agent metadata and registered pool; ``acquire``, the lease
        acquired (extended to ``lease_s``) for a one-sided read, with the seconds it has left."""
        if self.nixl is None:
            return wire.error_reply(seq, FailureCode.SEGMENT_UNAVAILABLE,
                                    f"{self.worker_id} runs no NIXL agent (start it with --transfer nixl)")
        if op == "nixl_md":
            return wire.ok_reply(seq, **self.nixl.describe())
        if not self.leases.acquire(request_id):
            return self._lease_error(seq, request_id)
        lease = self.leases.get(request_id)
        if lease is None:
            return self._lease_lost(seq, request_id)
        return wire.ok_reply(seq, request_id=request_id, block_ids=list(lease.block_ids), agent=self.nixl.name,
                             hold_s=max(0.0, lease.deadline - self.leases.clock()))

    def _mac_matches(self, request_id, msg: dict) -> bool:
        """The request presents the MAC of the ticket issued for its lease (a request for
        no lease passes: it gets the lease error)."""
        lease = self.leases.get(request_id) if isinstance(request_id, str) else None
        return lease is None or (bool(lease.mac) and constant_time_equal(lease.mac, msg.get("mac")))

    def _release_by_capability(self, msg: dict, peer: Peer) -> None:
        """A fire-and-forget release outside a session: done only when it shows the ticket's
        MAC (the shm path releases so, without a handshake); nothing is answered."""
        request_id = msg.get("request_id")
        if msg.get("incarnation") != self.incarnation or msg.get("nonce") != self.nonce:
            return   # a stale ticket: its lease is not here
        if not isinstance(request_id, str) or self.leases.get(request_id) is None:
            return
        if self._mac_matches(request_id, msg):
            self.leases.release(request_id)
        else:
            self._refuse(peer, msg.get("seq"), f"a release of {request_id!r} with a wrong ticket MAC")

    def _refuse(self, peer: Peer, seq, reason: str, tell: bool = False, handshake: bool = False) -> bytes:
        """Count a refusal, log it if it is this peer address's first, and return the error
        reply (``reason`` in it only when ``tell``: the peer is authenticated; ``handshake``:
        it says that a handshake would help, e.g. to a receiver whose session this sender
        does not know after a restart on the same port)."""
        with self._auth_lock:
            self.auth_failures += 1
            first = peer.address not in self._logged_peers and len(self._logged_peers) < _MAX_LOGGED_PEERS
            if first:
                self._logged_peers.add(peer.address)
        if first:
            log.warning("KV sender %s: refused a peer at %s: %s (later refusals of this address are counted in "
                        "auth_failures, not logged)", self.worker_id, peer.address, reason)
        extra = {"handshake": True} if handshake else {}
        return wire.error_reply(seq, FailureCode.AUTH_FAILED, reason if tell else "authentication failed", **extra)

    def _version_error(self, msg: dict) -> bytes:
        return wire.error_reply(msg.get("seq"), FailureCode.VERSION_MISMATCH,
                                f"request version {msg.get('v')}, sender speaks {TRANSFER_VERSION}")

    def _lease_error(self, seq, request_id) -> bytes:
        state = self.leases.last_state(request_id)
        if state is None:
            return wire.error_reply(seq, FailureCode.UNKNOWN_REQUEST, f"no lease for request {request_id!r}")
        if state == LeaseState.EXPIRED:
            return wire.error_reply(seq, FailureCode.LEASE_EXPIRED, f"lease of {request_id!r} expired")
        return wire.error_reply(seq, FailureCode.UNKNOWN_REQUEST, f"lease of {request_id!r} was already released")

    def _lease_lost(self, seq, request_id) -> bytes:
        return wire.error_reply(seq, FailureCode.LEASE_LOST, f"lease of {request_id!r} lost while staging")

    # -- the ZeroMQ wire: the serving thread ------------------------------------------------

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
        if self.auth is None:
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
        msg, authenticated, reply = self._admit(raw, peer)
        if msg is None:
            return [reply] if reply else []
        try:
            answer = self._answer(msg, authenticated=authenticated, peer=peer, answer_release=True)
            if isinstance(answer, _Fetch):
                return self._send_staged(identity, answer)
            return [] if answer is None else [answer]
        except Exception as exc:   # answer rather than let the receiver time out
            log.exception("KV sender %s: %s of %r failed", self.worker_id, msg.get("op"), msg.get("request_id"))
            return [wire.error_reply(msg.get("seq"), FailureCode.BAD_REPLY, f"sender failed: {exc!r}")]

    def _send_staged(self, identity: bytes, fetch: _Fetch) -> list:
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
        try:
            for index, (p0, p1, b0, b1) in enumerate(plan):
                copy_blocks(self._planes[p0:p1], block_ids[b0:b1], staged[p0:p1], range(b0, b1))
                if not self.leases.is_held(request_id):
                    return [self._lease_lost(seq, request_id)]
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

    # -- the TCP data wire: the DataServer's connection threads -----------------------------

    def _serve_data(self, conn, raw: bytes, peer: Peer) -> bool:
        """Serve one message of the TCP data wire (see tcp.py); False (or an exception)
        closes the connection. A fetch's lease is held until its ``sendmsg`` calls have
        returned. A peer without a session that gets any reply is refused: it is closed."""
        msg, authenticated, reply = self._admit(raw, peer)
        if msg is None:
            if reply is not None:
                send_control(conn, reply)
            return authenticated   # here: whether the peer may go on
        sending = threading.Event()
        sending.set()
        try:
            answer = self._answer(msg, authenticated=authenticated, peer=peer, answer_release=False,
                                  hold=lambda: not sending.is_set())
            if not isinstance(answer, _Fetch):
                if answer is not None:
                    send_control(conn, answer)
                return authenticated or answer is None
            num_planes, block_nbytes = self._planes.shape[0], self.layout.block_nbytes
            plane_nbytes = self._planes.shape[1] * block_nbytes
            send_control(conn, answer.header(nbytes=num_planes * len(answer.block_ids) * block_nbytes))
            send_views(conn, [self._pool_bytes[start:start + n * block_nbytes]   # from the pool, no copy
                              for p, first, n in source_pieces(num_planes, answer.block_ids)
                              for start in (p * plane_nbytes + first * block_nbytes,)])
            return True
        finally:
            sending.clear()   # sent: the kernel holds copies, the blocks may go back

    def _staging_buffer(self, nbytes: int) -> torch.Tensor:
        """A pre-faulted byte buffer of ``nbytes``; a new one while zmq still sends the old."""
        busy = self._staging_tracker is not None and not self._staging_tracker.done
        if self._staging is None or busy or self._staging.numel() < nbytes:
            self._staging = torch.zeros(max(nbytes, 1 << 20), dtype=torch.uint8)
            self._staging_tracker = None
        return self._staging[:nbytes]


def _bind_host(endpoint: str) -> str:
    """The host of ``tcp://host:port`` (``*`` meaning every interface)."""
    host = endpoint.partition("://")[2].rpartition(":")[0]
    return "0.0.0.0" if host in ("*", "") else host.strip("[]")
