"""Authentication of the KV channels and of tickets (``TRANSFER_VERSION`` 5; docs/security.md).

Everything derives from a **cluster secret** (32 random bytes; at least 16) and the cluster
name. ``KVAuth`` holds them: the first secret signs, every secret it holds verifies (so a
secret can be rotated without a flag day: add the new one second, then first, then drop
the old one).

**Handshake** (both wires: the ZeroMQ ROUTER per DEALER identity, the TCP data wire per
connection). The client speaks first, so an authenticated receiver meeting a sender without
authentication gets a clear refusal rather than silence:

    C -> S  hello   {cn}                     cn: 16 fresh random bytes
    S -> C  ok      {sn, proof_s}            sn: 16 fresh random bytes
                    proof_s = HMAC(secret, ["pdqueue-kv-v1", sn, cn, cluster, "s2c"])
    C               checks proof_s (a sender without the secret is refused: mutual)
    C -> S  sealed  {proof_c, body, tag}     proof_c = HMAC(secret, [..., sn, cn, cluster, "c2s"])
    S               checks proof_c against the one challenge it issued to this peer (a
                    recorded handshake replayed meets a fresh sn and fails), then the tag

The client's proof rides on its first request (no extra round trip). From then on each
request is ``sealed``: ``body`` is the packed request, ``tag`` = HMAC(session key, body)
truncated to 16 bytes, the session key = HMAC(secret, [..., sn, cn, cluster, "session"]),
and the request's ``seq`` must grow. So a peer that takes over a DEALER identity after the
legitimate one left (ZeroMQ routing ids are guessable), or an on-path host injecting into
a TCP connection, cannot have a request served: it lacks the session key. The KV bytes
themselves are neither encrypted nor MACed (per-byte cost; see docs/security.md).

**Tickets are capabilities.** ``ticket_mac`` is an HMAC over every ticket field and the
cluster name. The receiver checks it before any I/O (a forged ticket in Redis cannot make a
decode worker copy another request's KV); the sender keeps the MAC it issued with the lease
and serves a fetch only when the request presents it (compared in constant time).

Imports the standard library and msgpack.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import msgpack

LABEL = "pdqueue-kv-v1"
SECRET_BYTES = 32          # what ``generate_secret`` makes
MIN_SECRET_BYTES = 16      # shorter secrets are refused
NONCE_BYTES = 16
TAG_BYTES = 16             # a sealed request's tag (HMAC-SHA256 truncated)
PROOF_BYTES = 32

HANDSHAKE_TIMEOUT_S = 10.0   # a TCP connection must be authenticated within this (sender side)
PENDING_TTL_S = 30.0         # a challenge must be answered within this (ZeroMQ, sender side)
SESSION_IDLE_S = 600.0       # the sender forgets a ZeroMQ session idle this long
CLIENT_REFRESH_S = 300.0     # a receiver makes a new session after this long idle (< SESSION_IDLE_S)
MAX_PEERS = 4096             # ZeroMQ peers (challenges and sessions) a sender remembers, LRU


def generate_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def parse_secrets(data: str | bytes, source: str = "secret") -> list[bytes]:
    """Secrets from text: hex strings separated by whitespace or commas (``#`` starts a
    comment line), the first one signing; or, for a file of raw bytes that is not such
    text, the whole content as one secret. ValueError naming ``source`` when none is usable."""
    if isinstance(data, bytes):
        try:
            text = data.decode("ascii")
        except UnicodeDecodeError:
            text = None
        if text is None or not _looks_like_hex_list(text):
            if len(data) < MIN_SECRET_BYTES:
                raise ValueError(f"{source}: {len(data)} bytes; a secret needs at least {MIN_SECRET_BYTES}")
            return [bytes(data)]
        data = text
    tokens = [t for line in data.splitlines() if not line.lstrip().startswith("#")
              for t in line.replace(",", " ").split()]
    if not tokens:
        raise ValueError(f"{source}: no secret in it (expected hex, e.g. from `openssl rand -hex 32`)")
    keys = []
    for token in tokens:
        try:
            key = bytes.fromhex(token)
        except ValueError:
            raise ValueError(f"{source}: not hex (expected e.g. the output of `openssl rand -hex 32`)") from None
        if len(key) < MIN_SECRET_BYTES:
            raise ValueError(f"{source}: a secret of {len(key)} bytes; at least {MIN_SECRET_BYTES} are needed")
        keys.append(key)
    return keys


def _looks_like_hex_list(text: str) -> bool:
    allowed = set("0123456789abcdefABCDEF, \t\r\n")
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    return all(set(line) <= allowed for line in lines) and any(line.strip() for line in lines)


def read_secret_file(path: str) -> list[bytes]:
    """The secrets in ``path`` (see ``parse_secrets``); OSError or ValueError."""
    with open(path, "rb") as f:
        data = f.read()
    return parse_secrets(data, source=f"KV secret file {path}")


def secret_file_too_open(path: str) -> bool:
    """Whether others than the owner may read ``path`` (worth a warning)."""
    try:
        return bool(os.stat(path).st_mode & 0o077)
    except OSError:
        return False


class KVAuth:
    """The cluster secret(s) and name; computes and checks proofs, session keys and ticket MACs."""

    def __init__(self, secrets_: bytes | Sequence[bytes], cluster: str):
        keys = [secrets_] if isinstance(secrets_, (bytes, bytearray)) else list(secrets_)
        if not keys:
            raise ValueError("KVAuth needs at least one secret")
        for key in keys:
            if not isinstance(key, (bytes, bytearray)) or len(key) < MIN_SECRET_BYTES:
                raise ValueError(f"a KV secret must be at least {MIN_SECRET_BYTES} bytes")
        if not isinstance(cluster, str) or not cluster:
            raise ValueError("KVAuth needs the cluster name")
        self.keys: tuple[bytes, ...] = tuple(bytes(k) for k in keys)
        self.cluster = cluster

    def __repr__(self) -> str:   # never the secret
        return f"KVAuth(cluster={self.cluster!r}, secrets={len(self.keys)})"

    @property
    def key(self) -> bytes:
        """The signing secret."""
        return self.keys[0]

    def _mac(self, key: bytes, *parts) -> bytes:
        return hmac.new(key, msgpack.packb([LABEL, *parts], use_bin_type=True), hashlib.sha256).digest()

    # -- the handshake -------------------------------------------------------------------------

    def proof(self, key: bytes, direction: str, sn: bytes, cn: bytes) -> bytes:
        return self._mac(key, sn, cn, self.cluster, direction)

    def server_proof(self, sn: bytes, cn: bytes) -> bytes:
        return self.proof(self.key, "s2c", sn, cn)

    def client_proof(self, sn: bytes, cn: bytes) -> bytes:
        return self.proof(self.key, "c2s", sn, cn)

    def verify_proof(self, direction: str, sn: bytes, cn: bytes, proof) -> bytes | None:
        """The secret that made ``proof``, or None."""
        if not isinstance(proof, bytes) or len(proof) != PROOF_BYTES:
            return None
        for key in self.keys:
            if hmac.compare_digest(self.proof(key, direction, sn, cn), proof):
                return key
        return None

    def session(self, key: bytes, sn: bytes, cn: bytes) -> "Session":
        return Session(self._mac(key, sn, cn, self.cluster, "session"))

    # -- tickets -------------------------------------------------------------------------------

    def ticket_mac(self, ticket, key: bytes | None = None) -> str:
        """Hex HMAC over every field of ``ticket`` (a ``base.Ticket``) but ``mac``, and the cluster."""
        return self._mac(key or self.key, "ticket", self.cluster, *ticket_fields(ticket)).hex()

    def verify_ticket(self, ticket) -> bool:
        mac = getattr(ticket, "mac", "")
        if not isinstance(mac, str) or not mac or ticket.cluster != self.cluster:
            return False
        return any(hmac.compare_digest(self.ticket_mac(ticket, key), mac) for key in self.keys)


def ticket_fields(ticket) -> list:
    """The signed content of a ticket, in a fixed order and canonical types."""
    return [int(ticket.version), ticket.request_id, ticket.worker_id, ticket.incarnation, ticket.node,
            ticket.segment, ticket.nonce, [int(b) for b in ticket.block_ids], int(ticket.num_tokens),
            sorted([str(k), v] for k, v in dict(ticket.layout).items()), ticket.endpoint,
            float(ticket.lease_deadline), [int(e) for e in ticket.block_epochs], ticket.data_endpoint,
            ticket.cluster, [bytes(h) for h in getattr(ticket, "block_hashes", ())],
            bytes(getattr(ticket, "hash_root", b""))]


@dataclass(slots=True)
class Session:
    """An authenticated channel's key; ``last_seq`` is the highest request number taken (the
    sender side), ``proof`` the client's proof still to send (the receiver side)."""

    key: bytes
    last_seq: int = 0
    used: float = field(default_factory=time.monotonic)
    proof: bytes | None = None

    def tag(self, body: bytes) -> bytes:
        return hmac.new(self.key, body, hashlib.sha256).digest()[:TAG_BYTES]

    def verify(self, body, tag) -> bool:
        return isinstance(body, bytes) and isinstance(tag, bytes) and hmac.compare_digest(self.tag(body), tag)


class ClientHandshake:
    """The receiver's half: ``hello_fields`` to send, then ``finish(reply)`` -> Session."""

    def __init__(self, auth: KVAuth):
        self.auth = auth
        self.cn = secrets.token_bytes(NONCE_BYTES)

    def hello_fields(self) -> dict:
        return {"op": "hello", "cn": self.cn}

    def finish(self, reply: dict) -> Session | None:
        """The session, with the client's proof to send on the first request; None if the
        reply does not prove the secret (an impostor, or another cluster's sender)."""
        sn = reply.get("sn")
        if not isinstance(sn, bytes) or len(sn) != NONCE_BYTES:
            return None
        key = self.auth.verify_proof("s2c", sn, self.cn, reply.get("proof"))
        if key is None:
            return None
        session = self.auth.session(self.auth.key, sn, self.cn)
        session.proof = self.auth.client_proof(sn, self.cn)
        return session


@dataclass(slots=True)
class Peer:
    """What a sender knows of one ZeroMQ identity or one TCP connection."""

    address: str = "?"
    challenge: tuple[bytes, bytes, float] | None = None   # (sn, cn, issued at), until answered once
    session: Session | None = None
    opened: float = field(default_factory=time.monotonic)


def constant_time_equal(a, b) -> bool:
    return isinstance(a, str) and isinstance(b, str) and hmac.compare_digest(a.encode(), b.encode())


def secrets_hex(keys: Iterable[bytes]) -> str:
    return ",".join(k.hex() for k in keys)
