"""What a ``KVSender`` answers, on either wire: admission (the handshake, sealed requests,
refusals) and the decision on each request (``Admission.answer``); the ops of a
transport's sender half (transfer.registry's ``ops``: NIXL's) go to that ``Source``.

Both wires carry the same requests, and two methods decide every one of them: ``admit``
takes a message's bytes from a peer (a ZeroMQ identity or a TCP connection, each with its
``auth.Peer``) and answers a handshake itself (``hello``: a fresh challenge and this
sender's proof) or opens a ``sealed`` request (the client's proof against the challenge it
was issued, the tag, the growing ``seq``); ``answer`` checks the version, authentication,
incarnation, nonce, the ticket's MAC against the lease's and the op, releases, or acquires
the fetch's lease and describes its reply header (``Fetch``); the wire then only does its
own I/O (staged frames on the ROUTER, ``sendmsg`` on a data connection). A fetch that asks
for a KV format (``kv_format``: engine.kv_codec) is answered in it when this sender knows it
(``Fetch.kv_format``, named in the reply header), else in native; ``codec`` gives the wires
the encoder.

Authentication (``auth``: the cluster's ``KVAuth``; None: off): before a peer has proved
the cluster secret it gets nothing but a challenge, or a refusal; a release needs no
session, only the ticket's MAC (it serves nothing). Every refusal is counted in
``auth_failures`` (read by the worker's heartbeat and metrics) and logged once per peer
address; a bad message never stops the serving threads.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from pdqueue.engine.kv_cache import KVCacheLayout
from pdqueue.engine.kv_codec import FORMATS, NATIVE, KVCodec, effective
from pdqueue.transfer import registry, wire
from pdqueue.transfer.auth import NONCE_BYTES, PENDING_TTL_S, KVAuth, Peer, constant_time_equal
from pdqueue.transfer.base import TRANSFER_VERSION
from pdqueue.transfer.errors import FailureCode
from pdqueue.transfer.leases import LeaseState, LeaseTable

if TYPE_CHECKING:
    from pdqueue.transfer.base import Source

log = logging.getLogger("pdqueue.transfer.sender")   # refusals are the sender's log lines

_MAX_LOGGED_PEERS = 1024   # peer addresses whose first refusal was logged (later ones: counted only)


@dataclass(frozen=True, slots=True)
class Fetch:
    """A fetch to serve (``Admission.answer``): its lease is acquired."""

    seq: Any
    request_id: str
    block_ids: tuple[int, ...]
    shape: list[int]   # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    dtype: str
    kv_format: str = NATIVE   # the data's format (engine.kv_codec): the one asked, if this sender knows it

    def header(self, **wire_fields) -> bytes:
        """The reply header; each wire adds its own fields (the frame plan, or nbytes). A
        format other than native is named (``kv_format``); native stays unnamed, as before
        formats."""
        if self.kv_format != NATIVE:
            wire_fields["kv_format"] = self.kv_format
        return wire.ok_reply(self.seq, request_id=self.request_id, block_ids=list(self.block_ids),
                             shape=self.shape, dtype=self.dtype, **wire_fields)


def version_error(msg: dict) -> bytes:
    return wire.error_reply(msg.get("seq"), FailureCode.VERSION_MISMATCH,
                            f"request version {msg.get('v')}, sender speaks {TRANSFER_VERSION}")


def lease_error(leases: LeaseTable, seq, request_id) -> bytes:
    """The reply to a request whose lease could not be acquired: unknown, expired or released."""
    state = leases.last_state(request_id)
    if state is None:
        return wire.error_reply(seq, FailureCode.UNKNOWN_REQUEST, f"no lease for request {request_id!r}")
    if state == LeaseState.EXPIRED:
        return wire.error_reply(seq, FailureCode.LEASE_EXPIRED, f"lease of {request_id!r} expired")
    return wire.error_reply(seq, FailureCode.UNKNOWN_REQUEST, f"lease of {request_id!r} was already released")


def lease_lost(seq, request_id) -> bytes:
    return wire.error_reply(seq, FailureCode.LEASE_LOST, f"lease of {request_id!r} lost while staging")


class Admission:
    """Admission and the decision on each request, for one sender (see the module docstring).
    Called from the ROUTER thread and the data server's connection threads at once: the
    refusal counter is locked; a peer's state belongs to the thread serving it."""

    def __init__(self, worker_id: str, incarnation: str, nonce: str | None, auth: KVAuth | None,
                 leases: LeaseTable, layout: KVCacheLayout):
        self.worker_id, self.incarnation, self.nonce = worker_id, incarnation, nonce
        self.auth, self.leases, self.layout = auth, leases, layout
        self.sources: dict[str, Source] = {}   # the transports' sender halves this sender runs, by name
        self._leased_ops = frozenset({"fetch", "release"}) | registry.leased_ops()   # checked against the MAC
        self.auth_failures = 0   # refused messages and connections
        self._lock = threading.Lock()
        self._logged_peers: set[str] = set()
        self._codecs: dict[str, KVCodec] = {}

    def codec(self, name: str) -> KVCodec:
        """The codec of this sender's pool in format ``name`` (a ``Fetch``'s)."""
        codec = self._codecs.get(name)
        if codec is None:
            codec = self._codecs[name] = KVCodec.for_layout(name, self.layout)
        return codec

    def admit(self, raw: bytes, peer: Peer) -> tuple[dict | None, bool, bytes | None]:
        """A message's bytes from ``peer``: ``(request, authenticated, None)`` for ``answer``,
        or ``(None, keep, reply)``: a handshake's answer or a refusal to send as it is (None:
        nothing), and whether the peer may go on (a TCP connection is closed otherwise)."""
        try:
            msg = wire.unpack(raw)
        except Exception as exc:
            if self.auth is not None and peer.session is None:
                return None, False, self.refuse(peer, None, f"undecodable message ({exc})")
            return None, True, wire.error_reply(None, FailureCode.BAD_REPLY, f"undecodable request: {exc}")
        seq, op = msg.get("seq"), msg.get("op")
        if msg.get("v") != TRANSFER_VERSION:
            return None, True, version_error(msg)
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
                return None, False, self.refuse(peer, seq, "malformed hello")
            sn = secrets.token_bytes(NONCE_BYTES)
            peer.challenge, peer.session = (sn, cn, now), None
            return None, True, wire.ok_reply(seq, sn=sn, proof=auth.server_proof(sn, cn))
        proof = msg.get("proof")
        if proof is not None:
            challenge, peer.challenge = peer.challenge, None   # one answer per challenge
            if challenge is None or now - challenge[2] > PENDING_TTL_S:
                return None, False, self.refuse(peer, seq, "a proof without a fresh challenge (a replayed handshake?)")
            sn, cn, _ = challenge
            key = auth.verify_proof("c2s", sn, cn, proof)
            if key is None:
                return None, False, self.refuse(peer, seq, "wrong proof (not this cluster's secret)")
            peer.session = auth.session(key, sn, cn)
        session = peer.session
        if session is None:
            return None, False, self.refuse(peer, seq, "a sealed request without a session", handshake=True)
        body = msg.get("body")
        if not session.verify(body, msg.get("tag")):
            return None, False, self.refuse(peer, seq, "a sealed request with a wrong tag")
        try:
            request = wire.unpack(body)
        except Exception as exc:
            return None, True, wire.error_reply(seq, FailureCode.BAD_REPLY, f"undecodable request: {exc}")
        inner_seq = request.get("seq")
        if type(inner_seq) is not int or inner_seq <= session.last_seq or inner_seq != seq:
            return None, False, self.refuse(peer, seq, f"request number {inner_seq!r} not above "
                                                       f"{session.last_seq} (a replayed request?)")
        session.last_seq, session.used = inner_seq, now
        return request, True, None

    def answer(self, msg: dict, *, authenticated: bool, peer: Peer, answer_release: bool,
               hold: Callable[[], bool] | None = None) -> Fetch | bytes | None:
        """Decide a request of either wire: a reply to send as it is (a refusal, an error, a
        release's answer when ``answer_release`` and the request wants one), None (nothing
        to send), or a ``Fetch`` whose lease is acquired (and, given ``hold``, not handed
        back before ``hold()``) and whose data the wire sends. ``authenticated``: it came in
        a session (or authentication is off)."""
        seq, op, request_id = msg.get("seq"), msg.get("op"), msg.get("request_id")
        if msg.get("v") != TRANSFER_VERSION:
            return version_error(msg)
        if self.auth is not None and not authenticated:
            if op == "release" and msg.get("noreply"):
                self._release_by_capability(msg, peer)
                return None
            return self.refuse(peer, seq, f"{op!r} without authentication")
        if msg.get("incarnation") != self.incarnation:
            return wire.error_reply(seq, FailureCode.STALE_INCARNATION,
                                    f"ticket names incarnation {msg.get('incarnation')} of {self.worker_id}, "
                                    f"which now runs incarnation {self.incarnation}")
        if msg.get("nonce") != self.nonce:
            return wire.error_reply(seq, FailureCode.NONCE_MISMATCH, "ticket nonce does not match the segment")
        if self.auth is not None and op in self._leased_ops and not self._mac_matches(request_id, msg):
            return self.refuse(peer, seq, f"the ticket MAC of {request_id!r} is not the one issued (a forged "
                                          "ticket, or another cluster's or secret's)", tell=True)
        if op == "release":
            valid = self.leases.release(request_id)
            return wire.ok_reply(seq, valid=valid) if answer_release and not msg.get("noreply") else None
        owner = registry.op_owner(op) if op not in ("fetch", "release") else None
        if owner is not None:   # an op of a transport's sender half (the NIXL path's nixl_md, acquire)
            source = self.sources.get(owner.name)
            if source is None:
                return wire.error_reply(seq, FailureCode.SEGMENT_UNAVAILABLE, f"{self.worker_id} "
                                        f"{owner.unserved or f'runs no {owner.name} sender half'} "
                                        f"(start it with --transfer {owner.name})")
            return source.answer(seq, op, request_id)
        if op != "fetch":
            return wire.error_reply(seq, FailureCode.BAD_REPLY, f"unknown op {op!r}")
        first = msg.get("first_block", 0)
        lease = self.leases.get(request_id)
        if not isinstance(first, int) or first < 0 or (lease is not None and first >= len(lease.block_ids)):
            return wire.error_reply(seq, FailureCode.BAD_TICKET,
                                    f"first_block {first!r} is outside the ticket's blocks")
        if not self.leases.acquire(request_id):
            return lease_error(self.leases, seq, request_id)
        if hold is not None:
            self.leases.hold_until(request_id, hold)
        lease = self.leases.get(request_id)
        if lease is None:
            return lease_lost(seq, request_id)
        layout, block_ids = self.layout, lease.block_ids[first:]
        num_blocks = len(block_ids)
        asked = msg.get("kv_format", NATIVE)   # a format this sender does not know: native, said so
        kv_format = effective(asked, layout.torch_dtype) if asked in FORMATS else NATIVE
        return Fetch(seq, request_id, block_ids,
                     [layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim],
                     layout.dtype, kv_format)

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
            self.refuse(peer, msg.get("seq"), f"a release of {request_id!r} with a wrong ticket MAC")

    def refuse(self, peer: Peer, seq, reason: str, tell: bool = False, handshake: bool = False) -> bytes:
        """Count a refusal, log it if it is this peer address's first, and return the error
        reply (``reason`` in it only when ``tell``: the peer is authenticated; ``handshake``:
        it says that a handshake would help, e.g. to a receiver whose session this sender
        does not know after a restart on the same port)."""
        with self._lock:
            self.auth_failures += 1
            first = peer.address not in self._logged_peers and len(self._logged_peers) < _MAX_LOGGED_PEERS
            if first:
                self._logged_peers.add(peer.address)
        if first:
            log.warning("KV sender %s: refused a peer at %s: %s (later refusals of this address are counted in "
                        "auth_failures, not logged)", self.worker_id, peer.address, reason)
        extra = {"handshake": True} if handshake else {}
        return wire.error_reply(seq, FailureCode.AUTH_FAILED, reason if tell else "authentication failed", **extra)
