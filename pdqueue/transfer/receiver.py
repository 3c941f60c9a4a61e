"""The receiver half (decode worker): fetch a ticket's KV blocks into the local pool.

``fetch(ticket, dst_block_ids)`` validates the ticket (version, its MAC when the receiver
has the cluster's ``KVAuth``, layout, block ids, and the sender's incarnation when an
``is_current`` check is given), picks a backend (mode "auto":
the first transport of ``registry.auto_order()`` that can serve the ticket and whose
``check`` passes, i.e. shm on the same node when the segment maps, else tcp when the ticket
names a data endpoint and a connection can be made, else zmq; or the one named by
``mode``) and copies. On a sender-side failure (timeout, stale incarnation, nonce) the
cached mapping, connection or socket of that sender is dropped. With ``auth`` the tcp and
zmq channels are authenticated both ways (transfer.auth); ``auth_failures`` counts the
fetches refused for authentication (a ticket's MAC, a sender's proof or refusal). With a
``kv_format`` (fp16, int8: engine.kv_codec) the tcp and zmq paths ask the sender for it and
decode what comes (a sender that does not know formats sends native, which is read as
such); ``FetchResult.nbytes`` is then the encoded bytes that moved. The shm path stays a
copy (on one node encoding costs more than the bytes it saves), nixl reads native.

Ownership: the caller allocates ``dst_block_ids`` and owns them throughout; it must not let
the engine read or write them before ``fetch`` returns, and must free them (and recompute)
if ``fetch`` raises. Thread safety: ``fetch`` and ``close`` may be called from any threads
(a background fetch thread is the intended user); calls are serialised by one lock.
Imports torch and zmq (the control channel); each transport's module when it is first used.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from pdqueue.engine.kv_cache import KVCacheLayout
from pdqueue.engine.kv_codec import NATIVE, effective
from pdqueue.transfer import registry
from pdqueue.transfer.auth import KVAuth
from pdqueue.transfer.base import TRANSFER_VERSION, FetchResult, ReceiveContext, Ticket, Transport
from pdqueue.transfer.errors import FailureCode, TransferError
from pdqueue.transfer.node import DEFAULT_SHM_DIR
from pdqueue.transfer.zmq import ControlClient

log = logging.getLogger(__name__)

_FORGET_ON = {FailureCode.PEER_TIMEOUT, FailureCode.STALE_INCARNATION, FailureCode.NONCE_MISMATCH,
              FailureCode.BAD_REPLY, FailureCode.VERSION_MISMATCH, FailureCode.AUTH_FAILED}


class KVReceiver:
    def __init__(self, pool_tensor: torch.Tensor, layout: KVCacheLayout, node: str, mode: str = "auto",
                 timeout_s: float = 5.0, *, shm_dir: str = DEFAULT_SHM_DIR, is_current=None,
                 auth: KVAuth | None = None, kv_format: str = NATIVE):
        """``is_current(worker_id, incarnation) -> bool``, if given (e.g. a registry lookup),
        rejects tickets of replaced senders without any I/O. ``auth``: the cluster's secret
        and name; tickets must carry its MAC and senders must prove it (None: no checks).
        ``kv_format``: what the tcp and zmq paths ask senders to send (engine.kv_codec:
        native, fp16, int8; shm and nixl copy native); ValueError for another."""
        for name in registry.candidates(mode):   # ValueError naming the transports for an unknown mode
            registry.spec(name).receiver_class()   # imported now rather than during a first fetch
        layout.check_pool(pool_tensor)
        self.kv_format = effective(kv_format, layout.torch_dtype)
        self.layout = layout
        self.node = node
        self.mode = mode
        self.is_current = is_current
        self.auth = auth
        self.auth_failures = 0
        self._ctx = ReceiveContext(pool_tensor, layout, node, timeout_s, ControlClient(timeout_s, auth),
                                   extra={"shm_dir": shm_dir}, auth=auth, kv_format=self.kv_format)
        self._transports: dict[str, Transport] = {}
        self._lock = threading.Lock()
        self._closed = False

    def fetch(self, ticket: Ticket | dict, dst_block_ids, first_block: int = 0) -> FetchResult:
        """Copy the ticket's blocks from ``first_block`` on (the receiver holds the KV of
        those before it: prefix caching) into ``dst_block_ids``; raises TransferError. With
        nothing left to copy (``first_block`` = all of them) the lease is only released."""
        if isinstance(ticket, dict):
            try:
                ticket = Ticket.from_dict(ticket)
            except (ValueError, TypeError, KeyError) as exc:
                raise TransferError(f"malformed ticket: {exc}", FailureCode.BAD_TICKET) from None
        dst_block_ids = [int(b) for b in dst_block_ids]
        with self._lock:
            if self._closed:
                raise TransferError("receiver is closed", FailureCode.CLOSED)
            start = time.perf_counter()
            try:
                self._validate(ticket, dst_block_ids, first_block)
                if first_block == len(ticket.block_ids):
                    self._ctx.control.release_nowait(ticket)
                    return FetchResult(0, time.perf_counter() - start, "cache")
                transport = self._choose(ticket)
                try:
                    nbytes = transport.fetch(ticket, dst_block_ids, first_block)
                except TransferError as exc:
                    if exc.code in _FORGET_ON:
                        transport.forget(ticket)
                    raise
            except TransferError as exc:
                if exc.code == FailureCode.AUTH_FAILED:
                    self.auth_failures += 1
                raise
            return FetchResult(nbytes, time.perf_counter() - start, transport.name)

    def release(self, ticket: Ticket | dict) -> None:
        """Give a ticket's lease back without fetching (its request ended before its KV was
        needed): fire-and-forget, like the release after a fetch; otherwise the sender
        keeps those blocks until the lease expires. A malformed ticket is ignored."""
        if isinstance(ticket, dict):
            try:
                ticket = Ticket.from_dict(ticket)
            except (ValueError, TypeError, KeyError):
                return
        with self._lock:
            if not self._closed:
                self._ctx.control.release_nowait(ticket)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for transport in self._transports.values():
                transport.close()
            self._ctx.control.close()

    def __enter__(self) -> "KVReceiver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _validate(self, ticket: Ticket, dst_block_ids: list[int], first_block: int = 0) -> None:
        if ticket.version != TRANSFER_VERSION:
            raise TransferError(f"ticket version {ticket.version}, receiver speaks {TRANSFER_VERSION}",
                                FailureCode.VERSION_MISMATCH)
        if self.auth is not None and not self.auth.verify_ticket(ticket):
            why = ("it is unsigned (its sender runs without KV authentication?)" if not ticket.mac else
                   f"it names cluster {ticket.cluster!r}" if ticket.cluster != self.auth.cluster else
                   "its MAC does not verify (forged or altered, or signed with another secret)")
            raise TransferError(f"ticket of {ticket.request_id!r} refused: {why}", FailureCode.AUTH_FAILED)
        try:
            src_layout = ticket.kv_layout
        except (KeyError, TypeError, ValueError) as exc:
            raise TransferError(f"ticket layout unreadable: {exc}", FailureCode.BAD_TICKET) from None
        if not src_layout.compatible_with(self.layout):
            raise TransferError(f"sender layout {src_layout} is incompatible with {self.layout}",
                                FailureCode.LAYOUT_MISMATCH)
        src_ids = ticket.block_ids
        if (not src_ids or not isinstance(first_block, int) or not 0 <= first_block <= len(src_ids)
                or len(src_ids) - first_block != len(dst_block_ids)):
            raise TransferError(f"{len(src_ids)} ticket blocks from block {first_block} for {len(dst_block_ids)} "
                                "destination blocks", FailureCode.BAD_TICKET)
        if any(not 0 <= b < src_layout.num_blocks for b in src_ids):
            raise TransferError(f"ticket block ids out of range: {src_ids}", FailureCode.BAD_TICKET)
        if (any(not 0 <= b < self.layout.num_blocks for b in dst_block_ids)
                or len(set(dst_block_ids)) != len(dst_block_ids)):
            raise TransferError(f"destination block ids are not distinct ids of the local pool: {dst_block_ids}",
                                FailureCode.BAD_TICKET)
        if not 0 < ticket.num_tokens <= len(src_ids) * self.layout.block_size:
            raise TransferError(f"{ticket.num_tokens} tokens do not fit {len(src_ids)} blocks",
                                FailureCode.BAD_TICKET)
        if self.is_current is not None and not self.is_current(ticket.worker_id, ticket.incarnation):
            raise TransferError(f"{ticket.worker_id} incarnation {ticket.incarnation} is no longer current",
                                FailureCode.STALE_INCARNATION)

    def _choose(self, ticket: Ticket) -> Transport:
        names = registry.candidates(self.mode)
        error: TransferError | None = None
        for name in names:
            transport = self._transport(name)
            if not transport.can_fetch(ticket):
                continue
            try:
                transport.check(ticket)
                return transport
            except TransferError as exc:
                if self.mode != "auto":
                    raise
                log.info("transfer path %s cannot serve %s (%s); trying the next", name, ticket.request_id, exc)
                error = exc
        if error is not None:
            raise error
        raise TransferError(f"no transfer path ({self.mode}) can serve the ticket from node {ticket.node} "
                            f"(this node {self.node}, segment {ticket.segment})",
                            FailureCode.SEGMENT_UNAVAILABLE)

    def _transport(self, name: str) -> Transport:
        transport = self._transports.get(name)
        if transport is None:
            transport = self._transports[name] = registry.spec(name).receiver_class()(self._ctx)
        return transport
