"""What the gateway knows about the cluster: the live workers (their heartbeats: role, model,
``max_model_len``) and the request backlog (lag + pending of the request streams), polled
in a thread every ``poll_s`` so that 503, 404 and 429 cost no round trip per request.

The models last seen served are remembered (``served``), in this process and in Redis
(``gwmodels``, a JSON string the gateways share): while no worker lives (a restart's gap, scaling from
zero) a request still gets its 404 or its context check at once, and waits for capacity
(``capacity.py``) instead of a 503; a gateway started during the gap reads them back."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import redis

from pdqueue.keys import PREFILL_GROUP, Keys
from pdqueue.protocol import Role, ServiceClass
from pdqueue.queue.backlog import streams_backlog
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
        self.served_key = keys.prefix + "gwmodels"
        self.served: dict[str, dict] | None = None   # the models last seen served (None: not read yet)
        self.capacity_seen_at = time.monotonic()      # the last poll that saw capacity (capacity.py)

    def poll(self) -> None:
        """One refresh (blocking: call it in a thread)."""
        workers = list_workers(self._r, self.keys)
        # A class that yields (batch) waits for spare capacity by design: its backlog is no
        # reason to refuse an online request (429).
        yielding = {self.keys.request_stream_for(c) for c in ServiceClass if c.yields}
        online = [s for s in request_streams_of(self._r, self.keys) if s not in yielding]
        backlog = streams_backlog(self._r, online, PREFILL_GROUP).total
        self._remember(workers)
        self.workers, self.backlog, self.ok, self.polled_at = workers, backlog, True, time.monotonic()
        if self.serving():
            self.capacity_seen_at = self.polled_at

    def _remember(self, workers: list[dict]) -> None:
        """Keep ``served`` up to date: written (to Redis too) when the live workers' models
        change, read back from Redis on the first poll."""
        if self.served is None:
            raw = self._r.get(self.served_key)
            self.served = json.loads(raw) if raw else {}
        live = _models_of(workers)
        if live and live != self.served:
            self._r.set(self.served_key, json.dumps(live))
            self.served = live

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

    def live_roles(self) -> str:
        """The live workers by role, for a message: ``"1 decode, 1 prefill"`` (``"none"``)."""
        return ", ".join(f"{n} {r}" for r, n in sorted(self.roles().items())) or "none"

    def serving(self) -> bool:
        """Some worker of each needed role lives: prefill and decode, or colocated."""
        roles = self.roles()
        return roles.get(Role.COLOCATED, 0) > 0 or (roles.get(Role.PREFILL, 0) > 0 and roles.get(Role.DECODE, 0) > 0)

    def models(self) -> dict[str, dict]:
        """Served model name -> {"max_model_len", "created"} (from the heartbeats)."""
        return _models_of(self.workers)

    def models_known(self) -> dict[str, dict]:
        """The models served now, else those last seen served (no worker lives)."""
        return self.models() or dict(self.served or {})

    def backlog_now(self) -> int:
        return self.backlog + max(0, self.sent_since_poll)


def _models_of(workers: list[dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for w in workers:
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

