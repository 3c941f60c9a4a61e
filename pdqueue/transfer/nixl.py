"""The ``nixl`` path: one-sided RDMA-capable reads of leased KV blocks with NIXL (UCX).

NIXL (``pip install pdqueue[rdma]``: the ``nixl-cu12`` wheel, import name ``nixl_cu12``, with
UCX bundled; on a CUDA 13 machine the ``nixl-cu13`` wheel, ``nixl_cu13``) moves registered
memory between agents; UCX picks the transports it finds
(RDMA verbs where there is an InfiniBand/RoCE device, else TCP, and for two processes of
one host also ``cma``/shared memory), with no change here. Only this module imports it,
and only when a sender or receiver is asked for the ``nixl`` path.

- Sender (``NixlSource``, the transport's ``Source``, started by a ``KVSender`` made with
  ``transfer="nixl"``: the prefill worker with ``--transfer nixl``): one agent per sender incarnation, named
  ``pdq-<worker>-<incarnation>-<random>``; the whole pool is registered once (memory type
  ``VRAM`` with the device index for a CUDA pool, ``DRAM`` otherwise), so a decode worker
  reads device memory straight into its own pool, with no staging copy in Python.
- Metadata: fetched once per sender incarnation over the existing ZeroMQ control channel
  (op ``nixl_md``; a sealed request in an authenticated session when the cluster has a KV
  secret, so only holders of the secret learn an agent's address and memory keys) and
  cached by the receiver under (endpoint, worker, incarnation). Not in the ticket (it would
  ride in every handoff through Redis, and is not needed by the other paths) nor in the
  heartbeat (anyone who reads the registry would learn it, without the KV secret).
- Lease: before each read the receiver sends ``acquire`` (sealed, with the ticket's MAC, like
  a fetch); the sender acquires the lease (refused once released or expired: LEASE_EXPIRED,
  or with another incarnation: STALE_INCARNATION), which extends it to ``lease_s`` from
  now, and answers ``hold_s``, the seconds it has left, and its agent's name (another name
  than the cached one: the metadata is fetched again). The receiver reads only if the read
  can finish inside that window (it measures from before it sent ``acquire``, and keeps a
  margin), and discards the copy (LEASE_LOST) if it finished later: the sender hands the
  blocks back to its engine only after the release or the deadline, so a read that ends
  before the deadline read intact blocks. Then the usual fire-and-forget ``release``.
- Read: one NIXL ``READ`` with a descriptor per (plane, run of consecutive source and
  destination blocks) of ``ticket.block_ids[first_block:]``, straight into the destination
  blocks of the receiver's registered pool, polled until done or until the fetch timeout
  (or the hold window) passes; on a timeout or an error the sender's agent is unloaded
  (its connection closed, the transfer cancelled) before the blocks are given back to the
  caller, and forgotten, so the next ticket fetches the metadata afresh.

Imports torch and numpy; nixl_cu12 (or nixl_cu13) lazily (transfer.registry names this
module; it is imported only when the ``nixl`` path is used or checked).
"""

from __future__ import annotations

import importlib
import logging
import os
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from pdqueue.transfer.base import ReceiveContext, Source, SourceContext, Ticket, Transport
from pdqueue.transfer.blocks import block_runs
from pdqueue.transfer.errors import FailureCode, TransferError
from pdqueue.transfer.leases import LeaseTable
from pdqueue.transfer.sender_admission import lease_error, lease_lost
from pdqueue.transfer.wire import ok_reply

log = logging.getLogger(__name__)

BACKEND = "UCX"
MAX_REMOTES = 64          # sender agents kept loaded per receiver (least recently used dropped)
HOLD_MARGIN = 0.8         # a read must end within this share of the lease window the sender granted
_SPIN_POLLS = 200         # polls of a transfer's state before sleeping between polls


def _nixl_module():
    """NIXL's Python package: the wheel built for torch's CUDA major version first (a CUDA 13
    torch with nixl_cu12's UCX plugins cannot register device memory), else whichever is
    installed. ImportError when none is."""
    cuda = (torch.version.cuda or "").split(".")[0]
    names = ("nixl_cu13", "nixl_cu12") if cuda == "13" else ("nixl_cu12", "nixl_cu13")
    for name in names:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
    raise ImportError(f"no module named {' or '.join(names)}")


def nixl_missing() -> str | None:
    """None when NIXL can be used here, else why not (for errors and test skips)."""
    try:
        _nixl_module()
    except Exception as exc:   # ImportError, or a shared library that fails to load
        return (f"NIXL is not importable ({exc.__class__.__name__}: {exc}); install it with "
                "`pip install 'pdqueue[rdma]'` (the nixl-cu12 wheel; nixl-cu13 for CUDA 13)")
    return None


def memory_of(tensor: torch.Tensor) -> tuple[str, int]:
    """NIXL's memory type and device id of a tensor: ("VRAM", cuda index) for an accelerator's
    memory, ("DRAM", 0) for host memory."""
    if tensor.device.type == "cuda":
        return "VRAM", tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    if tensor.device.type != "cpu":
        raise ValueError(f"NIXL registers host or CUDA memory, not {tensor.device}")
    return "DRAM", 0


def make_agent(name: str):
    """A NIXL agent with the UCX backend, a progress thread, and no listener (metadata goes
    over pdqueue's own, authenticated, control channel)."""
    missing = nixl_missing()
    if missing:
        raise RuntimeError(missing)
    api = importlib.import_module(f"{_nixl_module().__name__}._api")
    nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config

    if not os.environ.get("NIXL_LOG_LEVEL"):
        # NIXL's Python logger prints INFO lines to stdout (where `bench --json` writes its
        # result); its warnings and errors still show, NIXL_LOG_LEVEL=INFO brings back the rest.
        logging.getLogger("nixl").setLevel(logging.WARNING)
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=True, enable_listen_thread=False,
                                               backends=[BACKEND]))
    if BACKEND not in agent.backends:
        raise RuntimeError(f"NIXL has no {BACKEND} backend here (plugins: {agent.plugin_list})")
    return agent


class Registration:
    """A tensor registered with an agent, whole, once; deregistered by ``close``."""

    def __init__(self, agent, tensor: torch.Tensor):
        if not tensor.is_contiguous():
            raise ValueError("a KV pool registered with NIXL must be contiguous")
        self.agent = agent
        self.tensor = tensor   # kept alive while registered
        self.mem, self.dev = memory_of(tensor)
        self.addr = tensor.data_ptr()
        self.nbytes = tensor.numel() * tensor.element_size()
        self._descs = agent.register_memory([(self.addr, self.nbytes, self.dev, "")], self.mem)

    def close(self) -> None:
        if self._descs is not None:
            descs, self._descs = self._descs, None
            self.agent.deregister_memory(descs)


class NixlSource(Source):
    """The sender's agent and registered pool (see the module docstring), started by a
    ``KVSender`` of a worker with ``--transfer nixl``. Its ops, for an authenticated peer of
    this incarnation: ``nixl_md``, this sender's agent metadata and registered pool;
    ``acquire``, the lease acquired (extended to ``lease_s``) for a one-sided read, with the
    seconds it has left."""

    def __init__(self, pool_tensor: torch.Tensor, worker_id: str, incarnation: str, leases: LeaseTable | None = None):
        self.name = f"pdq-{worker_id}-{incarnation}-{secrets.token_hex(4)}"
        self.leases = leases
        self.agent = make_agent(self.name)
        self.registration = Registration(self.agent, pool_tensor)
        self.metadata = self.agent.get_agent_metadata()
        log.info("NIXL agent %s: %s pool of %.1f MiB registered (%s, device %d), metadata %d bytes", self.name,
                 BACKEND, self.registration.nbytes / 2**20, self.registration.mem, self.registration.dev,
                 len(self.metadata))

    @classmethod
    def start(cls, ctx: SourceContext) -> "NixlSource":
        return cls(ctx.pool, ctx.worker_id, ctx.incarnation, ctx.admission.leases)

    def describe(self) -> dict:
        """The ``nixl_md`` reply's fields."""
        reg = self.registration
        return {"agent": self.name, "md": self.metadata, "addr": reg.addr, "nbytes": reg.nbytes,
                "mem": reg.mem, "dev": reg.dev}

    def answer(self, seq, op: str, request_id) -> bytes:
        if op == "nixl_md":
            return ok_reply(seq, **self.describe())
        if not self.leases.acquire(request_id):
            return lease_error(self.leases, seq, request_id)
        lease = self.leases.get(request_id)
        if lease is None:
            return lease_lost(seq, request_id)
        return ok_reply(seq, request_id=request_id, block_ids=list(lease.block_ids), agent=self.name,
                        hold_s=max(0.0, lease.deadline - self.leases.clock()))

    def close(self) -> None:
        self.registration.close()
        self.agent = None


@dataclass(slots=True)
class _Remote:
    name: str          # the sender's agent, as loaded
    addr: int          # its pool's address, as registered
    nbytes: int
    mem: str
    dev: int


class NixlTransport(Transport):
    """The receiver's ``nixl`` backend (see the module docstring). Not in the auto order: a
    ticket does not say whether its sender runs an agent; decode workers choose it with
    ``--transfer nixl`` (and prefill workers then start an agent)."""

    name = "nixl"

    def __init__(self, ctx: ReceiveContext):
        super().__init__(ctx)
        self.agent = make_agent(f"pdq-recv-{secrets.token_hex(6)}")
        self.registration = Registration(self.agent, ctx.pool)
        self._remotes: OrderedDict[tuple[str, str, str], _Remote] = OrderedDict()

    def can_fetch(self, ticket: Ticket) -> bool:
        return bool(ticket.endpoint)

    def check(self, ticket: Ticket) -> None:
        self._remote(ticket)

    def fetch(self, ticket: Ticket, dst_block_ids: list[int], first_block: int = 0) -> int:
        remote = self._remote(ticket)
        src_ids = list(ticket.block_ids[first_block:])
        if not 0 <= first_block < len(ticket.block_ids) or len(src_ids) != len(dst_block_ids):
            raise TransferError(f"{len(src_ids)} ticket blocks from block {first_block} for {len(dst_block_ids)} "
                                "destination blocks", FailureCode.BAD_TICKET)
        started = time.monotonic()
        header = self._call(ticket, "acquire")
        hold_s = header.get("hold_s")
        if not isinstance(hold_s, (int, float)) or hold_s != hold_s or header.get("request_id") != ticket.request_id:
            raise TransferError(f"bad acquire reply for {ticket.request_id!r}: {header}", FailureCode.BAD_REPLY)
        hold_until = started + hold_s * HOLD_MARGIN
        if header.get("agent") != remote.name:
            # Same worker and incarnation, another agent (a role switch on a fixed port
            # restarted its sender): load the new one's metadata; the lease is held meanwhile.
            self.forget(ticket)
            remote = self._remote(ticket)
        local, remote_descs = self._descs(ticket, remote, src_ids, dst_block_ids)
        nbytes = int(local[:, 1].sum())
        self._read(ticket, remote, local, remote_descs, min(started + self.ctx.timeout_s, hold_until))
        if time.monotonic() > hold_until:
            self.ctx.control.release_nowait(ticket)
            raise TransferError(f"the read of {ticket.request_id!r} ended after the lease window of {hold_s:.2f}s "
                                "that the sender granted: the copy is discarded", FailureCode.LEASE_LOST)
        self.ctx.control.release_nowait(ticket)
        return nbytes

    def forget(self, ticket: Ticket) -> None:
        for key in [k for k in self._remotes if k[0] == ticket.endpoint]:
            self._unload(self._remotes.pop(key))

    def close(self) -> None:
        while self._remotes:
            self._unload(self._remotes.popitem()[1])
        self.registration.close()
        self.agent = None

    # -- internals ----------------------------------------------------------------------------

    def _call(self, ticket: Ticket, op: str) -> dict:
        """One request over the control channel (sealed with authentication); its reply
        header, or TransferError (an error reply, a timeout)."""
        header = self.ctx.control.call(ticket, op)
        return header

    def _remote(self, ticket: Ticket) -> _Remote:
        """The sender's agent, loaded (metadata fetched once per sender incarnation)."""
        key = (ticket.endpoint, ticket.worker_id, ticket.incarnation)
        remote = self._remotes.get(key)
        if remote is not None:
            self._remotes.move_to_end(key)
            return remote
        header = self._call(ticket, "nixl_md")
        name, md = header.get("agent"), header.get("md")
        fields_ok = (isinstance(name, str) and isinstance(md, bytes) and isinstance(header.get("addr"), int)
                     and isinstance(header.get("dev"), int) and header.get("mem") in ("DRAM", "VRAM"))
        if not fields_ok or not name.startswith(f"pdq-{ticket.worker_id}-{ticket.incarnation}-"):
            raise TransferError(f"bad nixl_md reply from {ticket.endpoint} for {ticket.worker_id}/"
                                f"{ticket.incarnation}: agent {name!r}", FailureCode.BAD_REPLY)
        if header.get("nbytes") != ticket.kv_layout.nbytes:
            raise TransferError(f"{name} registered {header.get('nbytes')} bytes, the ticket's pool has "
                                f"{ticket.kv_layout.nbytes}", FailureCode.LAYOUT_MISMATCH)
        try:
            loaded = self.agent.add_remote_agent(md)
            loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if loaded != name:
                self.agent.remove_remote_agent(loaded)
                raise TransferError(f"metadata of {name} names agent {loaded}", FailureCode.BAD_REPLY)
            self.agent.make_connection(name)   # the first read then pays no connection set-up
        except TransferError:
            raise
        except Exception as exc:   # NIXL's errors (a malformed or unloadable metadata blob)
            raise TransferError(f"cannot load NIXL agent {name} of {ticket.endpoint}: {exc!r}",
                                FailureCode.BAD_REPLY) from None
        remote = _Remote(name, header["addr"], header["nbytes"], header["mem"], header["dev"])
        if len(self._remotes) >= MAX_REMOTES:
            self._unload(self._remotes.popitem(last=False)[1])
        self._remotes[key] = remote
        log.info("loaded NIXL agent %s of %s (%s pool of %.1f MiB)", name, ticket.worker_id, remote.mem,
                 remote.nbytes / 2**20)
        return remote

    def _descs(self, ticket: Ticket, remote: _Remote, src_ids: list[int], dst_ids: list[int]):
        """Nx3 (address, bytes, device) arrays, local and remote: one row per plane per run of
        consecutive (source, destination) blocks."""
        layout, src_layout = self.ctx.layout, ticket.kv_layout
        block_nbytes, num_planes = layout.block_nbytes, 2 * layout.num_layers
        runs = np.array(block_runs(src_ids, dst_ids), dtype=np.uint64).reshape(-1, 3)
        plane = np.arange(num_planes, dtype=np.uint64)[:, None]
        lengths = np.broadcast_to(runs[:, 2] * block_nbytes, (num_planes, len(runs)))

        def rows(base: int, plane_nbytes: int, starts: np.ndarray, dev: int) -> np.ndarray:
            out = np.empty((num_planes * len(runs), 3), dtype=np.uint64)
            out[:, 0] = (base + plane * plane_nbytes + starts * block_nbytes).reshape(-1)
            out[:, 1] = lengths.reshape(-1)
            out[:, 2] = dev
            return out

        local = rows(self.registration.addr, layout.num_blocks * block_nbytes, runs[:, 1], self.registration.dev)
        remote_rows = rows(remote.addr, src_layout.num_blocks * block_nbytes, runs[:, 0], remote.dev)
        return local, remote_rows

    def _read(self, ticket: Ticket, remote: _Remote, local: np.ndarray, remote_rows: np.ndarray,
              deadline: float) -> None:
        agent, handle = self.agent, None
        try:
            handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local, self.registration.mem),
                                           agent.get_xfer_descs(remote_rows, remote.mem), remote.name)
            state, polls = agent.transfer(handle), 0
            while state == "PROC":
                if time.monotonic() > deadline:
                    break
                polls += 1
                if polls > _SPIN_POLLS:
                    time.sleep(min(0.001, 1e-5 * (polls - _SPIN_POLLS)))
                state = agent.check_xfer_state(handle)
        except Exception as exc:   # NIXL's errors: a peer that disconnected, a bad descriptor
            self._abandon(ticket, handle)
            raise TransferError(f"NIXL read of {ticket.request_id!r} from {remote.name} failed: {exc!r}",
                                FailureCode.PEER_TIMEOUT) from None
        if state != "DONE":
            self._abandon(ticket, handle)
            why = ("did not finish in time (sender dead or stuck, or the lease window too short)"
                   if state == "PROC" else "failed")
            raise TransferError(f"NIXL read of {ticket.request_id!r} from {remote.name} {why}",
                                FailureCode.PEER_TIMEOUT)
        handle.release()

    def _abandon(self, ticket: Ticket, handle) -> None:
        """Cancel a read that failed or ran late: unload the sender's agent first (closes the
        connection, so nothing more lands in the destination blocks), then free the request."""
        self.forget(ticket)
        if handle is not None:
            try:
                handle.release()
            except Exception as exc:
                log.warning("NIXL: could not free an abandoned transfer request: %r", exc)

    def _unload(self, remote: _Remote) -> None:
        try:
            self.agent.remove_remote_agent(remote.name)
        except Exception as exc:
            log.info("NIXL: unloading agent %s: %r", remote.name, exc)

