"""A prefill worker's view of the decode workers, from their heartbeats.

One registry read (SCAN + pipelined HGETALL) at most every ``EVERY_S`` serves the three
things a prefill worker decides by the decode side: which handoff stream to write (this
node's when a decode worker lives here: ``stream``), which decode worker may prefill a prompt
(workers/placement.py), and whether any decode worker has room for one more request at all
(else the prefill worker keeps decoding it here: ``room``).

Given this worker's compatibility record (``mine``, workers/compat.py), the view holds only
the decode workers it may exchange KV with (``workers``): room, placement and the handoff
stream never count a decode worker of another KV format, model or wire version
(``incompatible``). Each of those is said once in the log, and when none of the live decode
workers is compatible, that is said once too and shows in the heartbeat (``load``:
``no_compatible_decode``); the handoffs then wait in the stream of this worker's key.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from pdqueue.protocol import Role
from pdqueue.protocol.compat import Compat
from pdqueue.queue.registry import list_workers
from workers.compat import Once, handoff_stream, say_incompatible, separate, split

log = logging.getLogger("pdqueue.compat")

EVERY_S = 0.5   # how often the decode workers' heartbeats are read
IDLE_EVERY_S = 2.0   # ... at least, with a record, when nothing else asks (the heartbeat's load)
SENT_KEEP_S = 30.0   # handoffs older than this are in every beat since


def takes_work(w: dict) -> bool:
    """Serving, not stopping, not switching."""
    load = w.get("load") or {}
    return bool(load.get("accepting", True)) and not load.get("draining") and not w.get("switching_to")


class DecodePeers:
    def __init__(self, r, keys, every_s: float = EVERY_S, mine: Compat | None = None, metrics=None):
        """``mine``: this worker's compatibility record (None: every decode worker counts)."""
        self.r, self.keys, self.every_s, self.mine, self.metrics = r, keys, every_s, mine, metrics
        self.workers: list[dict] = []        # the live decode workers this worker may hand to
        self.incompatible: list[dict] = []   # those of another kind, routed around
        self._once = Once()
        self._none_said = False   # "no compatible decode worker" said for the episode now
        self.read_at = float("-inf")        # monotonic time of the last successful read
        self._asked_at = float("-inf")
        self.sent_ms: deque[float] = deque()   # wall-clock ms of the handoffs this worker wrote

    def refresh(self, now: float | None = None, every_s: float | None = None) -> None:
        """Read the heartbeats when the last read is older than ``every_s`` (default: the
        view's). A failed read keeps the last view (the next ask tries again)."""
        now = time.monotonic() if now is None else now
        if now - self._asked_at < (self.every_s if every_s is None else every_s):
            return
        self._asked_at = now
        try:
            workers = list_workers(self.r, self.keys, role=Role.DECODE.value)
        except Exception:
            return
        self.read_at = now
        if self.mine is None:
            self.workers = workers
            return
        self.workers, self.incompatible = split(workers, self.mine)
        say_incompatible(self._once, self.mine, self.incompatible, "no KV goes to it", self.metrics)
        none = self.no_compatible
        if none and not self._none_said:
            log.warning("no live decode worker is compatible with this worker: its handoffs wait in %s until "
                        "one starts", self.keys.handoff_compat(self.mine.key))
        elif self._none_said and not none:
            log.info("a compatible decode worker lives again")
        self._none_said = none

    @property
    def no_compatible(self) -> bool:
        """Decode workers live, none of them compatible with this worker."""
        return bool(self.incompatible) and not self.workers

    def stream(self, node: str, transfer: str) -> str:
        """The handoff stream for this worker's next handoff (workers/compat.py ``handoff_stream``)."""
        self.refresh()
        return handoff_stream(self.keys, self.mine, node, transfer, self.workers, self.incompatible)

    def compat_stream(self) -> str | None:
        """The stream of this worker's key when its handoffs go there (a decode worker of
        another kind lives), else None: the shared streams, as before."""
        if self.mine is None or not separate(self.workers, self.incompatible):
            return None
        return self.keys.handoff_compat(self.mine.key)

    def load(self) -> dict:
        """What the heartbeat shows of it (with a record): how many live decode workers are
        of another kind, and whether none is compatible."""
        if self.mine is None:
            return {}
        # (an idle prefill worker asks nothing else: what it would meet is said all the same)
        self.refresh(every_s=max(self.every_s, IDLE_EVERY_S))
        return {"incompatible_decode": len(self.incompatible), "no_compatible_decode": int(self.no_compatible)}

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
