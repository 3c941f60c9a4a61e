"""KV-cache transport between prefill (sender) and decode (receiver) workers.

- ``KVSender`` (prefill, configured by a ``SenderConfig``): ``export`` leases blocks and
  returns a ``Ticket``; a TCP data server and a ZeroMQ ROUTER thread serve fetch and
  release; ``poll_freeable`` hands blocks back to the engine.
- ``KVReceiver`` (decode): ``fetch(ticket, dst_block_ids)`` copies over shared memory (same
  ``node_id()``), else over the TCP data wire (the ticket names a data endpoint), else over
  ZeroMQ; backends are pluggable through ``register_transport``.
- ``SharedKVPool``: the prefill pool in a named shm segment; ``cleanup_segments`` removes
  those of dead owners.
- ``KVAuth`` (transfer.auth): the cluster secret; signs tickets and authenticates the tcp and
  zmq channels both ways when given to the sender and the receiver.
Imports torch, zmq, msgpack, socket; never redis.
"""

from pdqueue.transfer.base import (AUTO_ORDER, TRANSFER_VERSION, TRANSPORTS, FetchResult, ReceiveContext, Ticket,
                                   Transport, register_transport)
from pdqueue.transfer.auth import KVAuth, generate_secret
from pdqueue.transfer.errors import FailureCode, TransferError
from pdqueue.transfer.leases import LeaseState, LeaseTable
from pdqueue.transfer.node import node_id
from pdqueue.transfer.receiver import KVReceiver
from pdqueue.transfer.sender import KVSender, SenderConfig
from pdqueue.transfer.shm import SharedKVPool, cleanup_segments, segment_name

__all__ = [
    "AUTO_ORDER", "TRANSFER_VERSION", "TRANSPORTS", "FailureCode", "FetchResult", "KVAuth", "KVReceiver", "KVSender",
    "LeaseState", "LeaseTable", "ReceiveContext", "SenderConfig", "SharedKVPool", "Ticket", "TransferError", "Transport",
    "cleanup_segments", "generate_secret", "node_id", "register_transport", "segment_name",
]
