"""The Redis side of pdqueue: stream helpers, the background publisher, the worker
registry, and a private redis-server for tests and ``pdqueue up``.

Imports redis (never torch).
"""

from pdqueue.queue.publisher import Publisher, XAdd
from pdqueue.queue.redis_server import RedisServer, find_redis_server_binary
from pdqueue.queue.registry import Heartbeat, Registry, list_workers
from pdqueue.queue.streams import (
    Claimed,
    ack_into,
    autoclaim,
    claim_request,
    claim_request_id,
    dead_letter,
    ensure_group,
    read_group,
    read_own_pending,
    touch,
    xadd_expiring,
    xadd_into,
)

__all__ = [
    "Claimed", "Heartbeat", "Publisher", "RedisServer", "Registry", "XAdd", "ack_into",
    "autoclaim", "claim_request", "claim_request_id", "dead_letter", "ensure_group",
    "find_redis_server_binary", "list_workers", "read_group", "read_own_pending", "touch",
    "xadd_expiring", "xadd_into",
]
