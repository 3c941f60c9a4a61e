"""The one place Redis clients are made, with their timeouts, credentials and TLS.

``connect(url, purpose=...)`` picks the timeouts by what the client is for:

- ``worker``: a worker's own client and its publisher's (reads block at most 100 ms, so a
  30 s socket timeout only ever fires on a dead connection; health checks every 30 s
  reconnect a connection that went stale while idle). The same values as
  ``pdqueue.config.RedisConfig``'s defaults, which the client library uses.
- ``check``: one quick round trip to tell whether Redis is there at all (the CLI's check
  before starting a worker).
- ``admin``: commands run by an operator's tool (``status``, ``submit``): fail within
  seconds rather than hang.
- ``supervisor``: ``pdqueue up`` watching its own workers and server.
- ``poll``: a background poll of the cluster's state (the gateway's ``ClusterView``).

Credentials and TLS come from ``pdqueue.config.redis_security``: the URL's user and
password, else ``PDQ_REDIS_USERNAME`` / ``PDQ_REDIS_PASSWORD_FILE`` / ``PDQ_REDIS_PASSWORD``;
for ``rediss://`` URLs ``PDQ_REDIS_CA``, ``PDQ_REDIS_CERT``, ``PDQ_REDIS_KEY`` (the CLI's
``--redis-*`` options set these). ``RedisConfig.redis_kwargs`` (the Client) applies the
same function, so every connection pdqueue makes is secured the same way.
``connect_async`` is the ``redis.asyncio`` twin.

Imports redis only.
"""

from __future__ import annotations

from typing import NamedTuple

import redis
import redis.asyncio

from pdqueue.config import redis_security


class Timeouts(NamedTuple):
    socket_s: float | None          # any command (None: wait for ever)
    connect_s: float                # opening the connection
    health_check_s: int = 0         # PING a connection idle this long before using it (0: never)


TIMEOUTS: dict[str, Timeouts] = {
    "worker": Timeouts(socket_s=30.0, connect_s=5.0, health_check_s=30),
    "check": Timeouts(socket_s=3.0, connect_s=3.0),
    "admin": Timeouts(socket_s=10.0, connect_s=3.0),
    "supervisor": Timeouts(socket_s=5.0, connect_s=3.0),
    "poll": Timeouts(socket_s=5.0, connect_s=5.0),
}


def _kwargs(url: str, purpose: str) -> dict:
    t = TIMEOUTS[purpose]
    return {"socket_timeout": t.socket_s, "socket_connect_timeout": t.connect_s,
            "health_check_interval": t.health_check_s, **redis_security(url)}


def connect(url: str, *, purpose: str = "worker") -> redis.Redis:
    """A ``redis.Redis`` for ``url`` (bytes replies) with the timeouts of ``purpose`` and
    the credentials and TLS settings in force (ValueError if those cannot be used)."""
    return redis.Redis.from_url(url, **_kwargs(url, purpose))


def connect_async(url: str, *, purpose: str = "worker") -> redis.asyncio.Redis:
    """``connect`` for asyncio: a ``redis.asyncio.Redis`` (bytes replies)."""
    return redis.asyncio.Redis.from_url(url, **_kwargs(url, purpose))
