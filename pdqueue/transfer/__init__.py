"""KV-cache transport between prefill (sender) and decode (receiver) workers.

- ``KVSender`` (prefill, configured by a ``SenderConfig``): ``export`` leases blocks and
  returns a ``Ticket``; a ZeroMQ ROUTER thread (the control channel) and the sender halves
  of the transports (a TCP data server; a NIXL agent with ``--transfer nixl``) serve
  fetch and release; ``poll_freeable`` hands blocks back to the engine.
- ``KVReceiver`` (decode): ``fetch(ticket, dst_block_ids)`` copies over shared memory (same
  ``node_id()``), else over the TCP data wire (the ticket names a data endpoint), else over
  ZeroMQ; or over the one transport its mode names.
- transfer.registry: the transports, one registration each (name, module, the classes of
  both halves, their properties); each transport's module holds both its halves.
- ``SharedKVPool``: the prefill pool in a named shm segment; ``cleanup_segments`` removes
  those of dead owners.
- ``KVAuth`` (transfer.auth): the cluster secret; signs tickets and authenticates the tcp and
  zmq channels both ways when given to the sender and the receiver.
Importing this package imports nothing else; each name below is imported when first used
(so ``transfer.registry`` is read without torch, zmq or NIXL). The modules import torch,
zmq, msgpack, socket; never redis.
"""

import importlib

_WHERE = {
    "TRANSFER_VERSION": "base", "FetchResult": "base", "ReceiveContext": "base", "Ticket": "base",
    "Transport": "base", "Source": "base", "SourceContext": "base",
    "KVAuth": "auth", "generate_secret": "auth",
    "FailureCode": "errors", "TransferError": "errors",
    "LeaseState": "leases", "LeaseTable": "leases",
    "node_id": "node",
    "KVReceiver": "receiver",
    "KVSender": "sender", "SenderConfig": "sender",
    "SharedKVPool": "shm", "cleanup_segments": "shm", "segment_name": "shm",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
