"""What the gateway knows about the cluster: the live workers (their heartbeats: role, model,
``max_model_len``) and the request backlog (lag + pending of the request streams), polled
in a thread every ``poll_s`` so that 503, 404 and 429 cost no round trip per request."""

from __future__ import annotations

import asyncio
import logging
import time

import redis

from pdqueue.queue.backlog import streams_backlog
from pdqueue.keys import PREFILL_GROUP, Keys
from pdqueue.protocol import Role, ServiceClass
from pdqueue.queue.connection import connect
from pdqueue.queue.registry import list_workers
from pdqueue.queue.streams import request_streams_of

log = logging.getLogger("pdqueue.frontends.gateway")

__all__ = ["ClusterView"]


class ClusterView:
    """Live workers and the request backlog, refreshed by ``run`` every ``poll_s`` in a
    thread (a plain redis-py client: a poll never delays the event loop's requests)."""

    def __init__(self, redis_url: str, keys: Keys, poll_s: float = 0.25):
        self.keys = keys
        self.poll_s = poll_s
        self._r = connect(redis_url, purpose="poll")   # credentials and TLS as every client's
        self.workers: list[dict] = []
        self.backlog = 0
        self.sent_since_poll = 0          # requests this gateway sent after the last poll began
        self.ok = False                   # the last poll reached Redis
        self.polled_at = 0.0

    def poll(self) -> None:
        """One refresh (blocking: call it in a thread)."""
        workers = list_workers(self._r, self.keys)
        # A class that yields (batch) waits for spare capacity by design: its backlog is no
        # reason to refuse an online request (429).
        yielding = {self.keys.request_stream_for(c) for c in ServiceClass if c.yields}
        online = [s for s in request_streams_of(self._r, self.keys) if s not in yielding]
        backlog = streams_backlog(self._r, online, PREFILL_GROUP).total
        self.workers, self.backlog, self.ok, self.polled_at = workers, backlog, True, time.monotonic()

    async def refresh(self) -> None:
        sent = self.sent_since_poll
        try:
            await asyncio.to_thread(self.poll)
            self.sent_since_poll -= sent  # those are in the backlog just read (or already served)
        except (redis.RedisError, OSError) as exc:
            if self.ok:
                log.warning("cannot read the cluster's state from Redis: %s", exc)
            self.ok = False

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await self.refresh()

    def close(self) -> None:
        self._r.close()

    # ---- derived ---------------------------------------------------------------------------
    def roles(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for w in self.workers:
            role = w.get("role", "")
            counts[role] = counts.get(role, 0) + 1
        return counts

    def serving(self) -> bool:
        """Some worker of each needed role lives: prefill and decode, or colocated."""
        roles = self.roles()
        return roles.get(Role.COLOCATED, 0) > 0 or (roles.get(Role.PREFILL, 0) > 0 and roles.get(Role.DECODE, 0) > 0)

    def models(self) -> dict[str, dict]:
        """Served model name -> {"max_model_len", "created"} (from the heartbeats)."""
        out: dict[str, dict] = {}
        for w in self.workers:
            name = w.get("model") or ""
            if not name:
                continue
            entry = out.setdefault(name, {"max_model_len": 0, "created": None})
            if isinstance(w.get("max_model_len"), int) and w["max_model_len"] > 0:
                mml = w["max_model_len"]
                entry["max_model_len"] = mml if not entry["max_model_len"] else min(entry["max_model_len"], mml)
            started = w.get("started_ms")
            if isinstance(started, int) and started > 0:
                created = started // 1000
                entry["created"] = created if entry["created"] is None else min(entry["created"], created)
        return out

    def backlog_now(self) -> int:
        return self.backlog + max(0, self.sent_since_poll)

