"""The Redis side of pdqueue: making clients (``connect``), stream helpers, exactly-once
outcomes (``ack_and_write``), the background publisher, the worker registry, and a private redis-server for
tests and ``pdqueue up``.

Imports redis (never torch).
"""

from pdqueue.queue.connection import connect
from pdqueue.queue.ownership import Write, ack_and_write, touch_owned
from pdqueue.queue.publisher import Publisher
from pdqueue.queue.redis_server import RedisServer, find_redis_server_binary
from pdqueue.queue.registry import Heartbeat, list_workers
from pdqueue.queue.streams import claim_request, dead_record, ensure_group, read_group, read_own_pending

__all__ = [
    "Heartbeat", "Publisher", "RedisServer", "Write", "ack_and_write", "claim_request", "connect", "dead_record",
    "ensure_group", "find_redis_server_binary", "list_workers", "read_group", "read_own_pending", "touch_owned",
]
