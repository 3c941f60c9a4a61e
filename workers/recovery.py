"""Recovery, in one place: the input entries a worker must answer but does not hold.

Three kinds, looked for in this order each time the role wants more work (``recover``),
before the role reads new entries itself:

1. **Redelivered**: our own pending entries we do not hold. After a Redis error (or a unit
   that failed on the publisher thread), an XREADGROUP or XCLAIM whose reply died with the
   connection may have left entries in our pending list that we never saw, and nobody
   reclaims a live worker's own entries. Compared once the publisher has nothing queued,
   so no entry is between being dropped from hand and being acknowledged.
2. **Reclaimed**: entries of other consumers of the group, at most every
   ``RECLAIM_EVERY_S``: at once when the consumer's ``worker:<id>`` heartbeat is gone (it
   died), after ``reclaim_idle_ms`` otherwise (it hangs). One XPENDING per stream and one
   pipelined EXISTS for all their consumers, then XCLAIM.
3. (the role reads new entries.)

At start, ``own_pending`` gives the entries an earlier process under this worker id took
and never acknowledged. While the role works, ``keep`` resets the idle time of the entries
in hand every ``reclaim_idle_ms / 3`` (``touch_owned``), so a long generation does not look
hung, and returns those another worker took over meanwhile (the role drops them without
answering: the other worker answers).
"""

from __future__ import annotations

import logging
from collections import Counter

import redis

from pdqueue.keys import Keys
from pdqueue.queue import streams
from pdqueue.queue.ownership import touch_owned
from pdqueue.queue.publisher import Publisher
from workers.common import Every

log = logging.getLogger("pdqueue.worker")

RECLAIM_EVERY_S = 0.5       # the XPENDING scan of other consumers' entries, at most this often
DEAD_CLAIM_MIN_IDLE_MS = 200  # a dead consumer's entries are claimed with this minimum idle time,
                              # so two workers claiming at once cannot both win
SCAN_COUNT = 100            # pending entries looked at per stream and scan (and re-read at start)
KEEP_FRACTION = 3           # entries in hand are touched every reclaim_idle_ms / KEEP_FRACTION
MAX_RETAKES = 3             # an entry taken in again this often is left alone (logged): its answer keeps failing

REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)


class Recovery:
    def __init__(self, r: redis.Redis, keys: Keys, worker_id: str, reclaim_idle_ms: int, publisher: Publisher,
                 metrics=None):
        self.r, self.keys, self.worker_id = r, keys, worker_id
        self.metrics = metrics        # pdqueue.metrics.WorkerMetrics: entries reclaimed, by cause
        self.reclaim_idle_ms = reclaim_idle_ms
        self.publisher = publisher
        self._reclaim = Every(RECLAIM_EVERY_S)
        self._keep = Every(reclaim_idle_ms / 1000 / KEEP_FRACTION)
        self._resync = False          # compare our pending list with what we hold, when the publisher is idle
        self._retaken: Counter = Counter()

    # -- what makes us look --------------------------------------------------------------
    def on_redis_error(self) -> None:
        """A Redis call failed: a reply that delivered entries to us may be lost with it."""
        self._resync = True

    def on_unit_failed(self) -> None:
        """A unit was dropped by the publisher: entries it should have finished are still
        pending for us, and nobody holds them any more."""
        self._resync = True

    # -- at start ------------------------------------------------------------------------
    def own_pending(self, group: str, stream_names) -> list:
        """Entries delivered to this consumer name before a restart and never acknowledged."""
        entries: list = []
        for stream in stream_names:
            try:
                entries += streams.read_own_pending(self.r, group, self.worker_id, [stream], count=SCAN_COUNT)
            except redis.ResponseError:
                pass   # no such group yet
        return entries

    # -- when the role wants work ----------------------------------------------------------
    def recover(self, role, limit: int) -> list:
        """Entries for ``role`` to take in again, or to take over (both ``resumed``):
        redelivered ones first, else reclaimed ones (up to ``limit``); [] when the role
        should read new entries itself."""
        return self.redelivered(role) or self.reclaim(role.group, role.streams(), limit)

    def redelivered(self, role) -> list:
        if not self._resync or self.publisher.pending:
            return []
        try:
            entries = self.own_pending(role.group, role.streams())
        except REDIS_DOWN:
            return []
        self._resync = False
        held = {entry_id for _, entry_id in role.held().values()}
        pending = {entry_id for _, entry_id, _ in entries}
        self._retaken = Counter({e: n for e, n in self._retaken.items() if e in pending})
        lost = []
        for entry in entries:
            if entry[1] in held:
                continue
            self._retaken[entry[1]] += 1
            if self._retaken[entry[1]] > MAX_RETAKES:
                if self._retaken[entry[1]] == MAX_RETAKES + 1:
                    log.error("entry %s of %s taken in again %d times, its answer failing each time; "
                              "leaving it pending", entry[1], entry[0], MAX_RETAKES)
                continue
            lost.append(entry)
        if lost:
            log.warning("taking in again %d entries delivered to us while Redis failed: %s",
                        len(lost), [e[1] for e in lost])
            if self.metrics is not None:
                self.metrics.reclaim(role.group, "redelivered", len(lost))
        return lost

    def reclaim(self, group: str, stream_names, limit: int) -> list:
        """Take over entries of other consumers of ``group`` (see the module docstring).
        Returns (stream, entry_id, fields) like a read."""
        if limit <= 0 or not self._reclaim.due():
            return []
        claimed: list = []
        try:
            pending = self._pending_of_others(group, list(stream_names))
            alive = self._alive({p["consumer"] for entries in pending.values() for p in entries})
            for stream, entries in pending.items():
                dead_ids = [p["message_id"] for p in entries if not alive[p["consumer"]]]
                hung_ids = [p["message_id"] for p in entries
                            if alive[p["consumer"]] and p["time_since_delivered"] >= self.reclaim_idle_ms]
                for cause, ids, min_idle in (("dead", dead_ids, DEAD_CLAIM_MIN_IDLE_MS),
                                             ("hung", hung_ids, self.reclaim_idle_ms)):
                    ids = ids[: limit - len(claimed)]
                    if not ids:
                        continue
                    before = len(claimed)
                    for entry_id, fields in self.r.xclaim(stream, group, self.worker_id, min_idle, ids):
                        if entry_id is not None:
                            claimed.append((stream, entry_id.decode(), fields))
                    if self.metrics is not None:
                        self.metrics.reclaim(group, cause, len(claimed) - before)
        except REDIS_DOWN as exc:
            log.warning("reclaim: redis unavailable (%s)", exc)
            self.on_redis_error()
        if claimed:
            log.warning("reclaimed %d entries of dead or hung workers: %s", len(claimed), [e[1] for e in claimed])
        return claimed

    def _pending_of_others(self, group: str, stream_names: list[str]) -> dict[str, list[dict]]:
        """The pending entries of other consumers, by stream (one pipelined round trip)."""
        with self.r.pipeline(transaction=False) as pipe:
            for stream in stream_names:
                pipe.xpending_range(stream, group, min="-", max="+", count=SCAN_COUNT)
            replies = pipe.execute(raise_on_error=False)
        pending: dict[str, list[dict]] = {}
        for stream, reply in zip(stream_names, replies):
            if isinstance(reply, Exception):
                continue   # no such stream or group yet
            for p in reply:
                p["consumer"] = p["consumer"].decode()
            others = [p for p in reply if p["consumer"] != self.worker_id]
            if others:
                pending[stream] = others
        return pending

    def _alive(self, consumers: set[str]) -> dict[str, bool]:
        """Whose ``worker:<id>`` heartbeat key exists (one pipelined round trip)."""
        names = sorted(consumers)
        if not names:
            return {}
        with self.r.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.exists(self.keys.worker(name))
            return {name: bool(flag) for name, flag in zip(names, pipe.execute())}

    # -- while the role works ----------------------------------------------------------
    def keep(self, role) -> list[str]:
        """Every ``reclaim_idle_ms / 3``: keep the entries ``role`` holds from looking idle
        to other workers. Returns the request ids another worker took over meanwhile."""
        if not self._keep.due():
            return []
        held = role.held()
        by_stream: dict[str, list[str]] = {}
        for stream, entry_id in held.values():
            by_stream.setdefault(stream, []).append(entry_id)
        lost: set[str] = set()
        try:
            for stream, ids in by_stream.items():
                lost.update(touch_owned(self.r, stream, role.group, self.worker_id, ids))
        except (*REDIS_DOWN, redis.ResponseError) as exc:
            log.warning("keeping entries in hand failed (%s)", exc)
        gone = [rid for rid, (_, entry_id) in held.items() if entry_id in lost]
        for rid in gone:
            log.warning("%s was taken over by another worker; dropping it here", rid)
        return gone
