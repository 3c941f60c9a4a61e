"""The sender (prefill worker): exports tickets and serves them over a ZeroMQ ROUTER (the
control channel, transfer.zmq) and the sender halves of the transports (transfer.registry:
the TCP data server of transfer.tcp; the NIXL agent of transfer.nixl when named).

Lifecycle of an exported request: ``export`` leases its blocks and returns a Ticket (with
the blocks' epochs when the pool is a shared segment) -> a receiver on this node copies
straight out of the segment and validates the copy against the epochs, with no round trip;
a receiver elsewhere fetches over the TCP data wire (a connection thread of ``DataServer``
writes the blocks straight from the pool; the lease is held until its ``sendmsg`` calls
return) or over ZeroMQ (the ROUTER thread stages the blocks frame by frame under the
lease) -> the receiver ``release``s (fire-and-forget) -> ``poll_freeable`` bumps the blocks'
epochs and hands them back to the engine thread, which frees them. Leases that are never released expire.
With ``shared_blocks`` (the prefill role: its engine caches prefixes) leases may share
blocks and ``poll_freeable`` bumps nothing: the engine bumps a block's epoch when it
rewrites it (``LLMEngine(on_rewrite=)``), since a handed-back block stays cached, intact.

Admission and each request's answer: sender_admission.py; the ZeroMQ wire's ROUTER:
zmq.py (``RouterServer``); the TCP data wire's server: tcp.py (``DataSource``).

Who owns what: the engine owns the pool and writes only blocks it owns; leased blocks are
read-only for everyone until ``poll_freeable`` returns them (see leases.py); a lease lost
while its frames are being staged turns the rest of the reply into an error. Each wire
owns its sockets and threads; ``close()`` stops both and frees them.
Requests are answered for tickets of this incarnation and segment nonce only. The bytes
are not encrypted (docs/security.md): bind to a private interface. Imports torch, zmq,
msgpack, socket (through transfer.tcp).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass

import torch

from pdqueue.engine.kv_cache import KVCacheLayout
from pdqueue.transfer import registry
from pdqueue.transfer.auth import HANDSHAKE_TIMEOUT_S, KVAuth
from pdqueue.transfer.base import TRANSFER_VERSION, Source, SourceContext, Ticket
from pdqueue.transfer.blocks import MAX_FRAME_BYTES, planes
from pdqueue.transfer.leases import LeaseTable
from pdqueue.transfer.sender_admission import Admission
from pdqueue.transfer.shm import SharedKVPool
from pdqueue.transfer.zmq import RouterServer


@dataclass(frozen=True, slots=True)
class SenderConfig:
    """How a ``KVSender`` serves. ``endpoint``: the ZeroMQ bind address; ``advertise``: the
    address put in tickets (default: the bound one, which is wrong for wildcard hosts such
    as 0.0.0.0); a trailing ``:*`` in it stands for the port actually bound. ``data_port``:
    the TCP data server's port on the same host (0: any free one; None: no data server;
    only for a pool in host memory), advertised with the host of the ZeroMQ endpoint.
    ``auth``: the cluster's secret and name; tickets are signed and both wires serve only
    peers that prove the secret (None: no authentication). ``shared_blocks``: the engine
    shares blocks between requests (prefix caching) and bumps a block's epoch itself before
    it rewrites it; leases may then overlap and handing one back bumps nothing (see the
    module docstring). ``transfer``: the worker's ``--transfer``; the sender halves of the
    transports registered ``serve="named"`` run only when it names them (``nixl``: also
    serve the pool to one-sided NIXL reads, ops ``nixl_md`` and ``acquire``), those
    registered ``serve="always"`` whenever they can serve the pool (``tcp``: a pool in host
    memory and a ``data_port``)."""

    endpoint: str = "tcp://127.0.0.1:*"
    advertise: str | None = None
    lease_s: float = 30.0
    max_frame_bytes: int = MAX_FRAME_BYTES
    data_port: int | None = 0
    data_timeout_s: float = 30.0
    auth: KVAuth | None = None
    shared_blocks: bool = False
    transfer: str = registry.AUTO


class KVSender:
    """The lease API (``export``, ``poll_freeable``, ``revoke``) over the wires it starts
    (the ROUTER, and ``sources``: the registered sender halves that serve, by name).
    ``shared_pool``: the segment ``pool_tensor`` lives in, whose block epochs this sender
    keeps (see shm.py). ``config``, or its fields as keywords."""

    def __init__(self, pool_tensor: torch.Tensor, layout: KVCacheLayout, worker_id: str, incarnation: str,
                 node: str, segment_name: str | None = None, nonce: str | None = None,
                 config: SenderConfig | None = None, *, shared_pool: SharedKVPool | None = None, **options):
        config = dataclasses.replace(config or SenderConfig(), **options)
        registry.check_mode(config.transfer)
        layout.check_pool(pool_tensor)
        self.config = config
        self.layout = layout
        self.worker_id = worker_id
        self.incarnation = incarnation
        self.node = node
        self.segment_name = segment_name
        self.nonce = nonce
        self._shared = shared_pool
        self.leases = LeaseTable(config.lease_s, shared_blocks=config.shared_blocks)
        self.shared_blocks = config.shared_blocks
        self.auth = config.auth
        self.admission = Admission(worker_id, incarnation, nonce, config.auth, self.leases, layout)
        pool_planes = planes(pool_tensor)
        self._router = RouterServer(self.admission, pool_planes, layout, worker_id, config.endpoint,
                                    config.advertise, config.max_frame_bytes)
        self.endpoint = self._router.endpoint
        self.sources: dict[str, Source] = self.admission.sources   # the transports' sender halves running
        ctx = SourceContext(pool_tensor, pool_planes, layout, worker_id, incarnation, config, self.endpoint,
                            self.admission, HANDSHAKE_TIMEOUT_S if config.auth is not None else None)
        self._ticket_fields: dict = {}
        try:
            for spec in registry.served(config.transfer):
                source = spec.source_class().start(ctx)
                if source is not None:
                    self.sources[spec.name] = source
                    self._ticket_fields.update(source.ticket_fields())
        except BaseException:
            for source in self.sources.values():
                source.close()
            self._router.close()
            raise
        self.data_endpoint = self._ticket_fields.get("data_endpoint", "")   # the TCP data server's, "" without
        self._stop = threading.Event()
        self._router.start()

    @property
    def auth_failures(self) -> int:
        """Refused messages and connections on either wire (read by the heartbeat and metrics)."""
        return self.admission.auth_failures

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
                        self.endpoint, time.time() + (deadline - self.leases.clock()), epochs,
                        **self._ticket_fields, cluster=self.auth.cluster if self.auth is not None else "",
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
        # Sender halves answered over the control channel (NIXL's agent) close after it: no
        # op reaches them any more; a read still in flight then fails on the receiver. The
        # others (the TCP data server: its connections are shut) close first.
        late = [name for name in self.sources if registry.spec(name).ops]
        for name, source in self.sources.items():
            if name not in late:
                source.close()
        self._router.close()
        for name in late:
            self.sources[name].close()

    def __enter__(self) -> "KVSender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

