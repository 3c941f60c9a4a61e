"""A KV sender in a spawned child process, for the transfer tests (tests/test_transfer.py,
tests/test_kv_auth.py): it creates its pool in a shm segment under a per-run name prefix,
fills it with seeded values, and exports tickets on command (over a Pipe); the test process
is the receiver. ``AUTH`` is the cluster secret of these senders and receivers (``Receiver``:
a ``KVReceiver`` that has it), as workers have one by default.
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing as mp
import os
import signal
import time
import uuid

import pytest
import torch

from pdqueue.engine.kv_cache import KVCacheLayout
from pdqueue.transfer import KVAuth, KVReceiver, KVSender, SharedKVPool, Ticket, generate_secret

SHM_DIR = "/dev/shm"
# Outside the "pdq-kv-" names that workers sweep: other pdqueue workers on this host (other
# test runs) leave these tests' segments alone; the tests clean up themselves.
PREFIX = f"pdqtest-kv-{uuid.uuid4().hex[:8]}"
NODE = "test-node"
SMALL = KVCacheLayout(num_layers=2, num_blocks=64, block_size=4, num_kv_heads=2, head_dim=8)   # 64 KiB
AUTH = KVAuth(generate_secret(), "test-cluster")   # the cluster secret of the senders and receivers
Receiver = functools.partial(KVReceiver, auth=AUTH)


def resign(ticket: Ticket, **changes) -> Ticket:
    """The ticket with ``changes``, signed again with the cluster secret (what only a holder of
    the secret can do): the receiver's MAC check passes, so the checks behind it are reached."""
    changed = dataclasses.replace(ticket, **changes)
    return dataclasses.replace(changed, mac=AUTH.ticket_mac(changed))


def pool_values(layout: KVCacheLayout, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layout.shape, generator=gen).to(layout.torch_dtype)


def _sender_main(conn, cfg: dict) -> None:
    torch.set_num_threads(1)
    layout = KVCacheLayout.from_dict(cfg["layout"])
    pool = SharedKVPool.create(layout, cfg["prefix"], cfg["worker_id"], cfg["incarnation"], shm_dir=SHM_DIR)
    pool.tensor.copy_(pool_values(layout, cfg["seed"]))
    auth = KVAuth([bytes.fromhex(k) for k in cfg["secrets"]], cfg["cluster"]) if cfg["secrets"] else None
    sender = KVSender.for_shared_pool(pool, cfg["node"], lease_s=cfg["lease_s"],
                                      max_frame_bytes=cfg["max_frame_bytes"], data_port=cfg["data_port"], auth=auth,
                                      transfer="nixl" if cfg.get("nixl") else "auto")
    conn.send({"endpoint": sender.endpoint, "segment": pool.name, "nonce": pool.nonce, "pid": os.getpid(),
               "data_endpoint": sender.data_endpoint})
    freed = []   # handed back while waiting for blocks to export, reported by the next poll
    while True:
        cmd, *args = conn.recv()
        if cmd == "export":
            # Like an engine, export a block only once its last lease came back (a release
            # is fire-and-forget, so it may still be on its way).
            deadline = time.monotonic() + 5
            while set(args[1]) & sender.leases.held_blocks():
                freed += sender.poll_freeable()
                if time.monotonic() > deadline:
                    break   # export raises: the test leaked a lease
                time.sleep(0.005)
            try:
                ticket = sender.export(*args[:4])
                if len(args) > 4 and args[4]:
                    # As if this sender had issued a variant (e.g. without a data endpoint): the
                    # lease keeps the variant's MAC, so only the variant is served.
                    ticket = dataclasses.replace(ticket, **args[4])
                    if auth is not None:
                        ticket = dataclasses.replace(ticket, mac=auth.ticket_mac(ticket))
                        sender.leases.set_mac(ticket.request_id, ticket.mac)
                conn.send(ticket.to_dict())
            except ValueError as exc:
                conn.send(exc)
        elif cmd == "poll":
            conn.send(freed + sender.poll_freeable())
            freed = []
        elif cmd == "auth_failures":
            conn.send(sender.auth_failures)
        elif cmd == "close":
            sender.close()
            pool.close()
            conn.send("closed")
            return


class SenderProcess:
    """A prefill-side sender in a spawned child process."""

    def __init__(self, layout: KVCacheLayout = SMALL, *, seed: int = 1, lease_s: float = 10.0,
                 max_frame_bytes: int = 1024, incarnation: str | None = None, data_port: int | None = 0,
                 auth: KVAuth | None = AUTH, nixl: bool = False):
        self.layout = layout
        self.seed = seed
        self.worker_id = f"w{uuid.uuid4().hex[:6]}"
        self.incarnation = incarnation or uuid.uuid4().hex[:12]
        cfg = {"layout": layout.to_dict(), "prefix": PREFIX, "worker_id": self.worker_id,
               "incarnation": self.incarnation, "node": NODE, "seed": seed, "lease_s": lease_s,
               "max_frame_bytes": max_frame_bytes, "data_port": data_port,
               "secrets": [k.hex() for k in auth.keys] if auth else [], "cluster": auth.cluster if auth else "",
               "nixl": nixl}   # nixl: the sender also serves NIXL reads (tests/test_nixl.py)
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_sender_main, args=(child, cfg), daemon=True)
        self.proc.start()
        self.info = self._recv(60)

    def _recv(self, timeout: float):
        if not self.conn.poll(timeout):
            raise TimeoutError("sender child did not answer")
        return self.conn.recv()

    def call(self, *cmd):
        self.conn.send(cmd)
        return self._recv(30)

    def export(self, request_id: str, block_ids, lease_s: float | None = None, **issued_as) -> Ticket:
        """A ticket for ``block_ids``; ``issued_as``: fields of a variant the sender issues instead."""
        num_tokens = len(block_ids) * self.layout.block_size - 1
        reply = self.call("export", request_id, list(block_ids), num_tokens, lease_s, issued_as)
        if isinstance(reply, Exception):
            raise reply
        return Ticket.from_dict(reply)

    def poll(self) -> list:
        return self.call("poll")

    def auth_failures(self) -> int:
        return self.call("auth_failures")

    def expected(self) -> torch.Tensor:
        return pool_values(self.layout, self.seed)

    def close(self) -> None:
        if self.proc.is_alive():
            assert self.call("close") == "closed"
        self.proc.join(10)

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)


def own_segments() -> list[str]:
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(PREFIX))


@pytest.fixture(scope="module", autouse=True)
def no_segment_left_behind():
    """(Autouse in the modules that import it.) After the module: none of this run's KV segments
    is left (those found are removed, and the module fails)."""
    yield
    left = own_segments()
    for name in left:
        os.unlink(os.path.join(SHM_DIR, name))
    assert not left, f"segments left behind: {left}"


def rid() -> str:
    return f"req-{uuid.uuid4().hex[:8]}"
