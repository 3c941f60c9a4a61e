"""A prefill worker's view of the decode workers, from their heartbeats.

One registry read (SCAN + pipelined HGETALL) at most every ``EVERY_S`` serves the three
things a prefill worker decides by the decode side: which handoff stream to write (this
node's when a decode worker lives here), which decode worker may prefill a prompt
(workers/placement.py), and whether any decode worker has room for one more request at all
(else the prefill worker keeps decoding it here: ``room``).
"""

from __future__ import annotations

import time
from collections import deque

from pdqueue.protocol import Role
from pdqueue.queue.registry import list_workers

EVERY_S = 0.5   # how often the decode workers' heartbeats are read
SENT_KEEP_S = 30.0   # handoffs older than this are in every beat since


def takes_work(w: dict) -> bool:
    """Serving, not stopping, not switching."""
    load = w.get("load") or {}
    return bool(load.get("accepting", True)) and not load.get("draining") and not w.get("switching_to")


class DecodePeers:
    def __init__(self, r, keys, every_s: float = EVERY_S):
        self.r, self.keys, self.every_s = r, keys, every_s
        self.workers: list[dict] = []
        self.read_at = float("-inf")        # monotonic time of the last successful read
        self._asked_at = float("-inf")
        self.sent_ms: deque[float] = deque()   # wall-clock ms of the handoffs this worker wrote

    def refresh(self, now: float | None = None) -> None:
        """Read the heartbeats when the last read is older than ``every_s``. A failed read
        keeps the last view (the next ask tries again)."""
        now = time.monotonic() if now is None else now
        if now - self._asked_at < self.every_s:
            return
        self._asked_at = now
        try:
            self.workers = list_workers(self.r, self.keys, role=Role.DECODE.value)
        except Exception:
            return
        self.read_at = now

    @property
    def nodes(self) -> set[str]:
        return {w.get("node") for w in self.workers}

    def handed_off(self, now_ms: float | None = None) -> None:
        """One more handoff went out (it takes a free slot before the next beats say so)."""
        now_ms = time.time() * 1000 if now_ms is None else now_ms
        self.sent_ms.append(now_ms)
        while self.sent_ms and self.sent_ms[0] < now_ms - SENT_KEEP_S * 1000:
            self.sent_ms.popleft()

    def room(self) -> bool | None:
        """Whether a decode worker that takes work has a free slot and free KV for one more
        request, less the handoffs sent since the oldest beat of those with room (which
        cannot show them yet); None when no decode worker is live (a handoff then waits for
        one, as it always has)."""
        self.refresh()
        if not self.workers:
            return None
        free, oldest = 0, float("inf")
        for w in self.workers:
            load = w.get("load") or {}
            slots = int(load.get("free_slots", 1) or 0)   # an older worker says nothing: room
            if takes_work(w) and int(load.get("kv_free") or 0) > 0 and slots > 0:
                free += slots
                oldest = min(oldest, float(w.get("beat_ms") or 0))
        return free > sum(t >= oldest for t in self.sent_ms)
