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
and never acknowledged. While the role works, the entries in hand have their idle time
reset every ``reclaim_idle_ms / 3`` (``touch_owned``), so a long generation does not look
hung; ``keep`` (the loop's thread, between steps) returns those another worker took over
meanwhile (the role drops them without answering: the other worker answers).

The touching is done by the **keeper thread** (``start_keeper``), not between steps: one
engine step may take longer than ``reclaim_idle_ms`` (a prefill batch of long prompts on a
loaded CPU), and entries must not look hung for that. The keeper is a watchdog on the
loop, not a second heartbeat: it touches only while the loop makes progress, that is while
the loop's current iteration began (``progress()``, also called by ``tick`` while a role
drains) less than ``max_step_s`` ago. So:

- a process that is stopped (SIGSTOP, frozen) touches nothing (all its threads stop): its
  entries are reclaimed after ``reclaim_idle_ms``, as before;
- a loop stuck in one iteration (a deadlock, an endless loop, a step that never ends) stops
  being kept after ``max_step_s``: its entries are reclaimed ``reclaim_idle_ms`` later;
- a step shorter than ``max_step_s`` keeps its entries however long it is.

The keeper reads the entries in hand (``role.held()``, a fresh dict) while the loop may
change them: a read that collides with a change is retried, and what it reports lost is
checked again by ``keep`` on the loop's thread against what is held then (an entry answered
meanwhile is not "taken over"). Without ``start_keeper`` (tests of this module), ``keep``
touches from the loop's thread as before.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Callable

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
MAX_STEP_S = 120.0          # a loop iteration running longer is stuck: its entries are no longer kept (the keeper)
HELD_READ_TRIES = 5         # the keeper's read of the entries in hand, retried when it collides with a change

REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)


class Recovery:
    def __init__(self, r: redis.Redis, keys: Keys, worker_id: str, reclaim_idle_ms: int, publisher: Publisher,
                 metrics=None, max_step_s: float = MAX_STEP_S):
        self.r, self.keys, self.worker_id = r, keys, worker_id
        self.metrics = metrics        # pdqueue.telemetry.metrics.WorkerMetrics: entries reclaimed, by cause
        self.reclaim_idle_ms = reclaim_idle_ms
        self.max_step_s = max_step_s
        self.publisher = publisher
        self._reclaim = Every(RECLAIM_EVERY_S)
        self._keep = Every(reclaim_idle_ms / 1000 / KEEP_FRACTION)
        self._resync = False          # compare our pending list with what we hold, when the publisher is idle
        self._retaken: Counter = Counter()
        # The keeper thread (start_keeper) and what it shares with the loop's thread
        self._keeper: threading.Thread | None = None
        self._keeper_stop = threading.Event()
        self._lost_lock = threading.Lock()
        self._lost: list[tuple[str, str, str]] = []   # (request id, stream, entry id) the keeper found lost
        self._loop_since: float | None = None         # monotonic start of the loop's current iteration
        self._stuck_since: float | None = None        # the iteration the keeper last found stuck (logged once)
        self.kept_rounds = 0                           # the keeper's touches (tests, debugging)
        self.stuck_rounds = 0                          # rounds it touched nothing: the loop was stuck

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
        """The loop's thread, before each step: the request ids of ``role`` another worker
        took over meanwhile (to drop). With the keeper thread running, what it found;
        else (no keeper) every ``reclaim_idle_ms / 3`` the entries in hand are touched here."""
        if self._keeper is None:
            if not self._keep.due():
                return []
            lost = self.touch(role.group, role.held())
        else:
            with self._lost_lock:
                lost, self._lost = self._lost, []
        if not lost:
            return []
        held = role.held()
        # Only what is still held as that very entry: one answered (or taken in again under
        # another entry id) since the keeper read it was not taken over.
        gone = sorted({rid for rid, stream, entry_id in lost if held.get(rid) == (stream, entry_id)})
        for rid in gone:
            log.warning("%s was taken over by another worker; dropping it here", rid)
        return gone

    def touch(self, group: str, held: dict[str, tuple[str, str]]) -> list[tuple[str, str, str]]:
        """Reset the idle time of the entries in ``held`` (request id -> (stream, entry id))
        still ours; returns the (request id, stream, entry id) no longer ours."""
        by_stream: dict[str, list[str]] = {}
        for stream, entry_id in held.values():
            by_stream.setdefault(stream, []).append(entry_id)
        lost: set[tuple[str, str]] = set()
        try:
            for stream, ids in by_stream.items():
                lost.update((stream, entry_id) for entry_id in touch_owned(self.r, stream, group, self.worker_id, ids))
        except (*REDIS_DOWN, redis.ResponseError) as exc:
            log.warning("keeping entries in hand failed (%s)", exc)
        return [(rid, stream, entry_id) for rid, (stream, entry_id) in held.items() if (stream, entry_id) in lost]

    # -- the keeper thread: entries in hand kept while the loop makes progress -------------
    def progress(self) -> None:
        """The loop's thread: a new iteration begins (or a draining role ticks)."""
        self._loop_since = time.monotonic()

    def start_keeper(self, role_of: Callable[[], object]) -> None:
        """Touch the entries in hand from a daemon thread every ``reclaim_idle_ms / 3``
        while the loop makes progress (the module docstring). ``role_of()``: the role now."""
        if self._keeper is not None:
            return
        self._keeper_stop.clear()
        self._keeper = threading.Thread(target=self._keeper_run, args=(role_of,), daemon=True,
                                        name=f"pdq-keeper-{self.worker_id}")
        self._keeper.start()

    def stop_keeper(self) -> None:
        thread, self._keeper = self._keeper, None
        if thread is not None:
            self._keeper_stop.set()
            thread.join(timeout=5)

    def _keeper_run(self, role_of) -> None:
        interval = self.reclaim_idle_ms / 1000 / KEEP_FRACTION
        while not self._keeper_stop.wait(interval):
            try:
                self.keep_round(role_of())
            except Exception:
                log.exception("keeper: a round failed")

    def keep_round(self, role) -> bool:
        """One round of the keeper: touch what ``role`` holds if the loop's current
        iteration began less than ``max_step_s`` ago. True when it touched (or held nothing)."""
        since = self._loop_since
        if since is None:
            return False   # the loop has not begun
        running_s = time.monotonic() - since
        if running_s >= self.max_step_s:
            self.stuck_rounds += 1
            if self._stuck_since != since:
                self._stuck_since = since
                log.error("worker loop stuck in one iteration for %.0f s (more than --max-step-s %g): the entries "
                          "in hand are no longer kept, other workers take them over after --reclaim-idle-ms",
                          running_s, self.max_step_s)
            return False
        held = self._held(role)
        if held is None:
            return False
        if held:
            lost = self.touch(role.group, held)
            if lost:
                with self._lost_lock:
                    self._lost.extend(lost)
        self.kept_rounds += 1
        return True

    @staticmethod
    def _held(role) -> dict[str, tuple[str, str]] | None:
        """``role.held()`` from the keeper's thread: the loop may change the dict it is made
        from meanwhile (RuntimeError: retried); a role not yet started has none (None)."""
        for _ in range(HELD_READ_TRIES):
            try:
                return dict(role.held())
            except RuntimeError:   # "dictionary changed size during iteration"
                time.sleep(0.001)
            except AttributeError:   # between roles: not started yet, or closed
                return None
        return None
