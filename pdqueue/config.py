"""The client's Redis settings (``RedisConfig``), a frozen dataclass. The engine's config is
``pdqueue.engine.config.EngineConfig``, the workers' ``workers.common.WorkerConfig``; the
timeouts of the workers' and the CLI's connections are in ``pdqueue.queue.connection``.
Imports nothing heavy: a producer builds this without torch or redis being imported.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    max_connections: int = 10_000
    """The connection pool's cap. Every stream being read holds one connection while its
    XREAD blocks, so an ``AsyncClient`` (or a gateway) with N requests in flight needs N;
    redis-py's default of 100 made the 101st concurrent submit fail with "Too many
    connections"."""

    def redis_kwargs(self) -> dict:
        """Keyword arguments for ``redis.Redis.from_url(self.url, **kwargs)``."""
        return {
            "socket_timeout": self.socket_timeout_s,
            "socket_connect_timeout": self.socket_connect_timeout_s,
            "health_check_interval": self.health_check_interval_s,
            "max_connections": self.max_connections,
        }
