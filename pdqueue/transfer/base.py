"""The transfer interface: the ticket that joins the two halves, and what each half of a
transport implements (``Transport``: the receiver's, ``Source``: the sender's; the names
and modules of the transports are in transfer.registry).

A prefill worker's ``KVSender.export`` pins blocks under a lease and returns a ``Ticket``;
the ticket travels (via Redis) to a decode worker whose ``KVReceiver.fetch`` copies the
blocks into its own pool with one of the registered ``Transport`` backends, then releases
the lease. Who frees what: the sender's engine owns its blocks again only once
``KVSender.poll_freeable`` returns them; the receiver's caller owns the destination blocks
throughout and must not use them unless ``fetch`` returned normally.

Imports torch (types only), msgpack and engine.kv_cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Protocol

import msgpack

from pdqueue.engine.kv_cache import KVCacheLayout
from pdqueue.transfer.errors import FailureCode, TransferError  # noqa: F401  (part of the interface)

if TYPE_CHECKING:
    import torch

    from pdqueue.transfer.auth import KVAuth

# Version of the ticket and of every transfer wire message (the requests and replies of the
# ZeroMQ and TCP wires, ZeroMQ data tags, shared-memory segment header): the "wire version" of
# the compatibility handshake. Every worker shows it in its heartbeat's ``compat`` record
# (pdqueue/protocol/compat.py), and a handoff carries it (``transfer_version``, and its ticket's
# ``version``): workers of two versions exchange no KV, they route around each other
# (workers/compat.py), so a cluster half-way through an upgrade serves correctly.
# Bump rules: bump it when a peer of the previous version would misread or refuse what this
# one sends (a field renamed, removed or given another meaning or type; an op or reply a peer
# must answer to go on; a new frame layout). A field or op that an older peer ignores, and
# whose absence a newer one reads as before, needs no bump (note it below as "later, without
# a bump"). A bump makes the workers of the two builds two kinds: a rolling upgrade then
# serves each kind with its own decode workers (docs/operations/failures.md, "Mixed versions").
# Change log:
#   1  first version: ticket fields below; ops acquire/release/fetch; header frame + raw
#      frames of whole planes or block ranges (at most max_frame_bytes each).
#   2  a fetch reply is a header message, then one message [data_tag, frame] per frame (not
#      one multipart message), or an error reply in place of a frame; header field
#      ``frames`` names the frame plan ("staged": blocks.plan_frames, as in 1).
#   3  op ``release_copied``: the shm path copies without acquiring first, then asks once
#      whether the lease held throughout (one round trip instead of two).
#   4  ticket field ``block_epochs`` (shm segment version 2 keeps an epoch per block): the shm
#      path validates its copy against them and releases fire-and-forget (no round trip);
#      ops ``acquire`` and ``release_copied`` are gone. Ticket field ``data_endpoint``: the
#      TCP data wire (transfer.tcp), which speaks this version too.
#   5  authenticated KV channels (transfer.auth): ops ``hello`` (challenge-response) and
#      ``sealed`` (a request MACed with the session key); every request carries the
#      ticket's ``mac``; ticket fields ``cluster`` and ``mac`` (HMAC over the other fields);
#      failure code ``auth_failed``.
#   6  prefix caching across the pipeline: ticket fields ``block_hashes`` (the sender's
#      prefix-cache chain hash of each full block, in order) and ``hash_root`` (its chain's
#      start); a ``fetch`` request may carry ``first_block`` (serve ``block_ids[first_block:]``
#      only: the receiver already holds the rest), and the reply describes those blocks.
#      Ops ``nixl_md`` (a sender's NIXL agent metadata, in a session) and ``acquire`` (hold a
#      lease for a one-sided NIXL read): transfer.nixl; an older sender answers "unknown op"
#      and the receiver recomputes.
#      Later, without a bump: error replies no longer carry ``retryable`` (no receiver read
#      it; a version-6 receiver that still parses it reads it as false).
#      Later, without a bump: a ``fetch`` request may carry ``kv_format`` (``fp16``, ``int8``:
#      engine.kv_codec; absent: ``native``), and the sender of the TCP data wire or ZeroMQ may
#      answer in it: its reply header then says ``kv_format`` and the data is the codec's
#      units (``unit_nbytes`` each, in place of ``block_nbytes``), cut as before. A sender
#      that does not know the field (or the format) ignores it and sends native without the
#      header field, which the receiver reads as native: nothing to bump.
TRANSFER_VERSION = 6


@dataclass(frozen=True, slots=True)
class Ticket:
    """Where a request's KV lies and how long it is leased. Immutable; msgpack-friendly."""

    version: int
    request_id: str
    worker_id: str
    incarnation: str
    node: str                    # shared-memory domain of the sender (transfer.node.node_id)
    segment: str | None          # shm segment name holding the pool; None: network paths only (tcp, zmq)
    nonce: str | None            # hex nonce of that segment's header
    block_ids: tuple[int, ...]   # sender-side block ids, in sequence order
    num_tokens: int
    layout: dict                 # KVCacheLayout.to_dict() of the sender's pool
    endpoint: str                # the sender's ZeroMQ ROUTER address
    lease_deadline: float        # wall clock (time.time()); informative, the sender decides
    block_epochs: tuple[int, ...] = ()   # the segment's epochs of block_ids at export; () without one
    data_endpoint: str = ""      # the sender's TCP data server (transfer.tcp); "" without one
    cluster: str = ""            # the sender's cluster ("" without authentication)
    mac: str = ""                # hex HMAC over the other fields (transfer.auth); "" without authentication
    # The sender's prefix-cache hash of each full block of block_ids, in order (a prefix of
    # them; () when its cache is off), and the hash its chain starts from (what besides the
    # tokens decided the KV: model, weights, dtypes). A receiver holding blocks under the same
    # hashes already has that KV and fetches only the rest (``first_block``).
    block_hashes: tuple[bytes, ...] = ()
    hash_root: bytes = b""

    FIELDS: ClassVar[tuple[str, ...]] = (
        "version", "request_id", "worker_id", "incarnation", "node", "segment", "nonce",
        "block_ids", "num_tokens", "layout", "endpoint", "lease_deadline", "block_epochs", "data_endpoint",
        "cluster", "mac", "block_hashes", "hash_root")
    OPTIONAL: ClassVar[dict] = {"cluster": "", "mac": "", "block_hashes": (), "hash_root": b""}

    @property
    def kv_layout(self) -> KVCacheLayout:
        return KVCacheLayout.from_dict(self.layout)

    def to_dict(self) -> dict:
        data = {name: getattr(self, name) for name in self.FIELDS}
        data["block_ids"] = list(self.block_ids)
        data["block_epochs"] = list(self.block_epochs)
        data["layout"] = dict(self.layout)
        data["block_hashes"] = list(self.block_hashes)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "Ticket":
        """Parse a ticket; unknown keys are ignored, missing ones raise ValueError."""
        missing = [name for name in cls.FIELDS if name not in data and name not in cls.OPTIONAL]
        if missing:
            raise ValueError(f"ticket lacks fields {missing}")
        values = {name: data.get(name, cls.OPTIONAL.get(name)) for name in cls.FIELDS}
        values["block_ids"] = tuple(int(b) for b in data["block_ids"])
        values["block_epochs"] = tuple(int(e) for e in data["block_epochs"])
        values["layout"] = dict(data["layout"])
        values["version"] = int(data["version"])
        values["num_tokens"] = int(data["num_tokens"])
        values["lease_deadline"] = float(data["lease_deadline"])
        for name in ("cluster", "mac"):
            if not isinstance(values[name], str):
                raise ValueError(f"ticket field {name} must be a string")
        values["block_hashes"] = tuple(values["block_hashes"])
        if (not all(isinstance(h, bytes) for h in values["block_hashes"]) or not isinstance(values["hash_root"], bytes)
                or len(values["block_hashes"]) > len(values["block_ids"])):
            raise ValueError("ticket block_hashes must be at most one bytes value per block, hash_root bytes")
        return cls(**values)

    def pack(self) -> bytes:
        return msgpack.packb(self.to_dict(), use_bin_type=True)

    @classmethod
    def unpack(cls, raw: bytes) -> "Ticket":
        return cls.from_dict(msgpack.unpackb(raw, raw=False))


@dataclass(frozen=True, slots=True)
class FetchResult:
    nbytes: int
    seconds: float
    path: str           # the transport that moved the bytes: "shm", "tcp", "zmq", ...


class ControlChannel(Protocol):
    """What the backends ask of the receiver's requests to senders (``transfer.zmq.ControlClient``
    is the one there is; it imports this module, never the other way round)."""

    def fetch(self, ticket: Ticket, first_block: int = 0, **extra) -> tuple[dict, Iterator]: ...

    def release_nowait(self, ticket: Ticket) -> None: ...

    def forget(self, endpoint: str, linger_ms: int = 0) -> None: ...

    def close(self) -> None: ...


@dataclass(slots=True)
class ReceiveContext:
    """What every receiver-side backend shares: the local pool and the control channel."""

    pool: "torch.Tensor"         # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
    layout: KVCacheLayout
    node: str
    timeout_s: float
    control: ControlChannel      # fetch and release to the sender's endpoint
    extra: dict = field(default_factory=dict)
    auth: "KVAuth | None" = None   # the cluster secret: channels are authenticated (transfer.auth)
    kv_format: str = "native"    # the format the network wires ask for (engine.kv_codec; shm, nixl: native)


class Transport(ABC):
    """A receiver-side way to move a ticket's blocks into the local pool.

    ``fetch`` copies ``ticket.block_ids`` into ``dst_block_ids`` and returns the bytes moved,
    only if it can tell that the sender's lease held for the whole copy (the sender read
    the blocks under the lease, or the block epochs did not move); a copy it cannot vouch
    for raises LEASE_LOST. It raises ``TransferError`` on any failure. Calls are serialised
    by ``KVReceiver``; a backend needs no locking of its own.
    """

    name: ClassVar[str]

    def __init__(self, ctx: ReceiveContext):
        self.ctx = ctx

    def can_fetch(self, ticket: Ticket) -> bool:
        """Cheap test: does the ticket name what this backend needs (node, segment, ...)?"""
        return True

    def check(self, ticket: Ticket) -> None:
        """Prepare for the ticket (map a segment, connect) before any lease is touched; raise
        TransferError if this backend cannot serve it (mode="auto" then tries the next)."""

    @abstractmethod
    def fetch(self, ticket: Ticket, dst_block_ids: list[int], first_block: int = 0) -> int:
        """Copy ``ticket.block_ids[first_block:]`` into ``dst_block_ids`` (as long); the
        bytes moved."""

    def forget(self, ticket: Ticket) -> None:
        """Drop cached state (mappings, sockets) about the ticket's sender after a failure."""

    def close(self) -> None:
        """Release everything the backend holds."""


@dataclass(slots=True)
class SourceContext:
    """What a transport's sender half (``Source``) is started with by ``KVSender``."""

    pool: "torch.Tensor"         # the sender's pool (a shm segment's tensor, or the engine's)
    planes: "torch.Tensor"       # the same as [2 * num_layers, num_blocks, -1] (blocks.planes)
    layout: KVCacheLayout
    worker_id: str
    incarnation: str
    config: Any                  # the sender's ``SenderConfig``
    endpoint: str                # the advertised ZeroMQ endpoint (the control channel)
    admission: Any               # the sender's ``Admission``: decides every request of any wire
    handshake_timeout_s: float | None = None   # how long a new connection has to authenticate (None: no auth)


class Source(ABC):
    """A transport's sender half, run by a ``KVSender`` beside its ZeroMQ ROUTER (the control
    channel every path uses). ``start`` returns None when it cannot serve this sender's
    pool or configuration. ``ticket_fields``: what it puts in every ticket (e.g. the TCP
    data endpoint). ``answer``: its ops (the registry's ``ops`` of its transport), asked
    by an authenticated peer of this incarnation, on the control channel."""

    @classmethod
    @abstractmethod
    def start(cls, ctx: SourceContext) -> "Source | None":
        """Bind and start serving, or None."""

    def ticket_fields(self) -> dict:
        return {}

    def answer(self, seq, op: str, request_id) -> bytes:
        raise NotImplementedError(op)

    def close(self) -> None:
        """Stop serving and free everything (a read or send in flight then fails)."""
