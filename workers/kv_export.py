"""Serving a role's exported KV: the ``KVSender`` over the process's pool, the drain that
serves its leases out, and its close. What the prefill role and a migrating decode or
colocated role (workers/migration.py) share."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from pdqueue.transfer.sender import KVSender, SenderConfig
from workers.common import kv_auth_for
from workers.recovery import REDIS_DOWN

if TYPE_CHECKING:
    from workers.role import RoleHost


def make_sender(shell: RoleHost, kv_cache, layout, *, transfer: str = "auto") -> KVSender:
    """A sender of the shell's pool with ``shared_blocks`` (requests sharing cached prefix
    blocks lease them together): over its shared segment when it has one, else over the
    tensor (ZeroMQ; and the TCP data wire when the pool is in host memory). ``transfer``:
    the worker's --transfer, which starts the sender halves run only when named (nixl)."""
    config = shell.config
    sender_config = SenderConfig(endpoint=config.bind, advertise=config.advertise, lease_s=config.lease_s,
                                 data_port=config.data_port, shared_blocks=True, transfer=transfer,
                                 # signs tickets; peers must prove the secret
                                 auth=kv_auth_for(config, shell.r, shell.keys))
    if shell.segment is not None:
        return KVSender.for_shared_pool(shell.segment, shell.node, config=sender_config)
    # (An accelerator's pool cannot be mapped by another process: KV goes over ZeroMQ, or
    # with --transfer nixl straight out of device memory, registered as VRAM; the sender
    # starts a TCP data server only for a pool in host memory.)
    return KVSender(kv_cache, layout, shell.worker_id, shell.incarnation, shell.node, config=sender_config)


def serve_leases(shell: RoleHost, sender: KVSender, free_released: Callable[[], None]) -> None:
    """Warm stop or switch: keep serving exported KV until every lease is released or
    expired, at most ``lease_s + 1`` s (switch commands are still answered: ``shell.tick``)."""
    deadline = time.monotonic() + shell.config.lease_s + 1
    while len(sender.leases) and time.monotonic() < deadline and not shell.cold_stop:
        free_released()
        try:
            shell.tick()
        except REDIS_DOWN:
            pass   # the leases are served all the same
        time.sleep(0.02)
    free_released()


def close_sender(sender: KVSender) -> None:
    """Stop serving. A TCP send may still read blocks of the pool, which outlives the role:
    it ends at once (the data server's connections are shut), and the next role may write
    the pool only after it has (the shell also bumps every block's epoch then)."""
    sender.close()
    deadline = time.monotonic() + 2.0
    while sender.leases.holding() and time.monotonic() < deadline:
        time.sleep(0.005)
