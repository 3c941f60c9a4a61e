"""Configuration: frozen dataclasses built once at the edge (the CLI) and passed down.

Components copy the scalars they need in ``__init__``. Imports nothing heavy: a producer
builds these without torch or redis being imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdqueue import keys as _keys

# =======================================================================================
# Redis side (owned by pdqueue/queue and pdqueue/client.py)
# =======================================================================================


@dataclass(frozen=True, slots=True)
class RedisConfig:
    """How to reach Redis. Blocking reads (XREAD/XREADGROUP BLOCK) must block for less
    than ``socket_timeout_s``; the queue helpers keep them at ``max_block_ms``."""

    url: str = "redis://127.0.0.1:6379/0"
    socket_timeout_s: float | None = 30.0
    socket_connect_timeout_s: float = 5.0
    health_check_interval_s: int = 30
    max_block_ms: int = 2000
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 2.0
    unavailable_after_s: float | None = 30.0
    """The client's streams retry a lost connection (a Redis restart is survived) and raise
    ``pdqueue.client.RedisUnavailable`` once it has failed for this long (None: retry until
    the caller's timeout)."""

    def redis_kwargs(self) -> dict:
        """Keyword arguments for ``redis.Redis.from_url(self.url, **kwargs)``."""
        return {
            "socket_timeout": self.socket_timeout_s,
            "socket_connect_timeout": self.socket_connect_timeout_s,
            "health_check_interval": self.health_check_interval_s,
        }

    def connect(self, **overrides):
        """A ``redis.Redis`` client (redis is imported here, not at module import)."""
        import redis

        return redis.Redis.from_url(self.url, **{**self.redis_kwargs(), **overrides})


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """One pdqueue cluster: its key namespace and the Redis-side timings."""

    name: str = "default"
    out_ttl_s: int = _keys.OUT_TTL_S
    heartbeat_ttl_s: float = _keys.HEARTBEAT_TTL_S
    cancel_ttl_s: int = _keys.CANCEL_TTL_S
    seen_ttl_s: int = _keys.SEEN_TTL_S
    done_maxlen: int = _keys.DONE_MAXLEN
    dead_maxlen: int = _keys.DEAD_MAXLEN
    claim_min_idle_ms: int = 10_000
    """A pending entry idle this long belongs to a dead consumer and is reclaimed
    (XAUTOCLAIM). A live worker holding an entry longer refreshes it (streams.touch)."""
    redis: RedisConfig = field(default_factory=RedisConfig)

    @property
    def keys(self) -> _keys.Keys:
        return _keys.Keys(self.name)


# =======================================================================================
# Engine and worker configs (extended by the engine/worker side; keep the Redis side above)
# =======================================================================================
