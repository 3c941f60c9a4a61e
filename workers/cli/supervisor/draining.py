"""What the embedded server still holds when `up` stops (its queue dies with it): the
backlog of this cluster's streams, ``drain`` (the workers answer it first), ``fail_unanswered``
(an ``error`` entry, code ``unavailable``, for each request left, so no client waits on a
server that is gone), ``still_running`` (who is left and what each holds) and, once the
workers are gone, ``wait_read`` (the server stays until every answer it holds was read: a
client of `up`'s server writes ``read:<id>`` when it has read an answer to its end, or
cancelled it). An answered
entry is deleted (acknowledged and XDELed), so what a stream holds is what is still to be
answered. Never imports torch.
"""

from __future__ import annotations

import threading
import time

import redis

from pdqueue.keys import DECODE_GROUP, PREFILL_GROUP
from pdqueue.protocol import REQUEST_ROLES, UP_FIELD, ErrorCode, Role, entry_request_id, error_entry
from pdqueue.queue.backlog import streams_backlog
from pdqueue.queue.registry import list_workers
from pdqueue.queue.streams import handoff_streams_found, request_streams_of
from workers.cli.supervisor.processes import Progress, WorkerProcess, count_of
from workers.cli.supervisor.supervised import Supervised

# The workers first answer what the server holds, until nothing is left or nothing
# progressed for DRAIN_STALL_S; what is left then gets an error entry
# (ErrorCode.UNAVAILABLE) that its client reads within UNANSWERED_READ_S, before the server goes.
DRAIN_STALL_S = 30.0
UNANSWERED_READ_S = 1.0
UNANSWERED_TTL_MS = 60_000
STOP_REPORT_INTERVAL_S = 2.0
ANSWER_GRACE_S = 60.0
"""How long the embedded server waits at the stop for answers no client has read yet
(``up --answer-grace-s``): a client reading late (the results of a batch it submitted,
read after a Ctrl-C) still gets them, one that went away does not hold the stop up for long."""


class WorkLeft:
    """The requests and handoffs left in one ``LocalCluster``'s streams."""

    def __init__(self, cluster: Supervised):
        self.cluster = cluster

    # -- what the embedded server holds when `up` stops ------------------------------------
    def _work_streams(self) -> list[tuple[str, str]]:
        """(stream, group) of every stream holding requests or handoffs of this cluster. An
        answered entry is deleted (acknowledged and XDELed), so what a stream holds is what is
        still to be answered: waiting to be read, or in a worker's hands."""
        streams = [(s, PREFILL_GROUP) for s in request_streams_of(self.cluster.redis, self.cluster.keys)]
        handoffs = handoff_streams_found(self.cluster.redis, self.cluster.keys)
        return streams + [(s, DECODE_GROUP) for s in handoffs]

    def backlog(self) -> tuple[int, int]:
        """(requests waiting to be read, requests in a worker's hands) in this cluster's
        streams; a request counts once where it is (its prompt, then its handoff)."""
        by_group = self.backlog_by_group()
        return sum(w for w, _ in by_group.values()), sum(h for _, h in by_group.values())

    def backlog_by_group(self) -> dict[str, tuple[int, int]]:
        """``backlog`` per consumer group: ``prefill`` (the request streams) and ``decode``
        (the handoff streams)."""
        streams = self._work_streams()
        return {group: tuple(streams_backlog(self.cluster.redis, [s for s, g in streams if g == group], group))
                for group in (PREFILL_GROUP, DECODE_GROUP)}

    def _nobody_for(self, by_group: dict[str, tuple[int, int]]) -> str | None:
        """Work left in a group that no running worker reads (its workers died): e.g. ``2
        requests for a decode worker, and none is running``; None if every group with work
        has a reader."""
        roles = self.cluster.current_roles()
        running = {roles.get(w.worker_id, w.role) for w in self.cluster.workers if w.alive}
        readers = {PREFILL_GROUP: REQUEST_ROLES, DECODE_GROUP: (Role.DECODE.value,)}
        for group, (waiting, held) in by_group.items():
            if waiting + held and not running & set(readers[group]):
                return (f"{count_of(waiting + held, 'request', 'requests')} for a {group} worker, "
                        f"and none is running")
        return None

    def drain(self, hurry: threading.Event, say: Progress, waiting: Progress | None = None,
              stall_s: float = DRAIN_STALL_S) -> bool:
        """Let the workers answer everything the embedded server holds before they are
        stopped: the queue dies with the server. Ends when nothing is left (True), on
        ``hurry`` (a second Ctrl-C), when no running worker reads what is left (its role's
        workers died: a dead worker does not hold the stop up), or after ``stall_s``
        without progress (neither the backlog nor any worker's KV use changed: a worker
        stuck)."""
        try:
            queued, held = self.backlog()
        except redis.RedisError:
            return False
        if not queued + held:
            return True
        say(f"answering what is left first: {queued} queued, {held} in hand (Ctrl-C again: stop now, "
            f"what is not answered then gets an error)")
        last, since = None, time.monotonic()
        next_report = time.monotonic() + STOP_REPORT_INTERVAL_S
        while not hurry.is_set():
            if not any(w.alive for w in self.cluster.workers):
                say("no worker is running: the rest cannot be answered")
                return False
            try:
                by_group = self.backlog_by_group()
                queued = sum(w for w, _ in by_group.values())
                held = sum(h for _, h in by_group.values())
                progress = (queued, held, self._work_signature())
                nobody = self._nobody_for(by_group)
            except redis.RedisError:
                return False
            left = queued + held
            if not left:
                say("everything queued was answered")
                return True
            if nobody:
                say(f"{nobody}: stopping with {left} left")
                return False
            if progress != last:
                last, since = progress, time.monotonic()
            elif time.monotonic() - since > stall_s:
                say(f"no progress for {stall_s:g} s: stopping with {left} left")
                return False
            if waiting is not None and time.monotonic() >= next_report:
                next_report = time.monotonic() + STOP_REPORT_INTERVAL_S
                waiting(f"answering what is left: {queued} queued, {held} in hand (Ctrl-C again: stop now)")
            hurry.wait(0.2)
        return False

    def unread(self) -> int:
        """Answers on the server that no client has read to their end: an ``out:<id>`` stream
        without its ``read:<id>`` receipt (nor a ``cancel:<id>``: its client gave up on it)."""
        keys = self.cluster.keys
        outs = [k.decode() if isinstance(k, bytes) else k
                for k in self.cluster.redis.scan_iter(match=keys.out_pattern, count=500)]
        if not outs:
            return 0
        prefix = keys.out("")
        with self.cluster.redis.pipeline(transaction=False) as pipe:
            for key in outs:   # read, or cancelled (nobody waits for it)
                pipe.exists(keys.read(key[len(prefix):]), keys.cancel(key[len(prefix):]))
            return sum(1 for seen in pipe.execute() if not seen)

    def wait_read(self, grace_s: float, hurry: threading.Event, say: Progress,
                  waiting: Progress | None = None) -> bool:
        """Before the embedded server stops (the workers and the gateway are gone): wait
        until every answer it holds has been read (True), for at most ``grace_s``, or until
        ``hurry`` (a second Ctrl-C)."""
        try:
            left = self.unread()
        except redis.RedisError:
            return False
        if not left:
            return True
        if grace_s <= 0:
            say(f"{count_of(left, 'answer was', 'answers were')} not read (--answer-grace-s 0)")
            return False
        say(f"keeping the Redis server until {count_of(left, 'answer is', 'answers are')} read, at most "
            f"{grace_s:g} s (--answer-grace-s; Ctrl-C again: stop it now)")
        deadline = time.monotonic() + grace_s
        next_report = time.monotonic() + STOP_REPORT_INTERVAL_S
        while not hurry.wait(0.2):
            try:
                left = self.unread()
            except redis.RedisError:
                return False
            if not left:
                say("every answer was read")
                return True
            now = time.monotonic()
            if now >= deadline:
                say(f"{count_of(left, 'answer was', 'answers were')} not read within {grace_s:g} s: "
                    f"their clients will find the server gone")
                return False
            if waiting is not None and now >= next_report:
                next_report = now + STOP_REPORT_INTERVAL_S
                waiting(f"waiting for {count_of(left, 'answer', 'answers')} to be read ({deadline - now:.0f} s left; "
                        f"Ctrl-C again: stop now)")
        say(f"stopping the Redis server now: {count_of(left, 'answer was', 'answers were')} not read")
        return False

    def _work_signature(self) -> tuple:
        """What changes while the workers make progress on long requests that do not finish
        yet: each one's free KV blocks (a decode sequence takes a block every 16 tokens) and
        running count, from the heartbeats."""
        workers = list_workers(self.cluster.redis, self.cluster.keys)
        return tuple(sorted((w.get("worker_id", ""), (w.get("load") or {}).get("kv_free"),
                             (w.get("load") or {}).get("running")) for w in workers))

    def fail_unanswered(self, reason: str = "the local cluster (pdqueue up) stopped before answering") -> int:
        """Once the workers are gone, before the embedded server is: an ``error`` entry on
        ``out:<id>`` of every request still in the streams, so that its client learns at
        once (``RequestFailed``, code ``unavailable``) instead of losing its Redis. Returns
        how many."""
        try:
            ids: set[str] = set()
            for stream, _ in self._work_streams():
                for entry_id, fields in self.cluster.redis.xrange(stream):
                    rid = entry_request_id(entry_id, fields)
                    if rid:
                        ids.add(rid)
            with self.cluster.redis.pipeline(transaction=False) as pipe:
                for rid in sorted(ids):
                    pipe.xadd(self.cluster.keys.out(rid), {**error_entry(reason, ErrorCode.UNAVAILABLE),
                                                           UP_FIELD: self.cluster.up_server})
                    pipe.pexpire(self.cluster.keys.out(rid), UNANSWERED_TTL_MS)
                pipe.execute()
        except redis.RedisError:
            return 0
        return len(ids)

    def still_running(self, group: list[WorkerProcess] | None = None) -> str:
        """``decode-0-ab12 (3 requests in hand), prefill-0-ab12 (1 KV lease)``: the workers
        of ``group`` (default: all alive) and what they hold: the entries each has taken and
        not yet acknowledged (XPENDING: exact, now) and its KV leases (from its last
        heartbeat, up to a third of the heartbeat TTL old). Without Redis: the ids."""
        group = [w for w in self.cluster.workers if w.alive] if group is None else group
        try:
            registered = {w["worker_id"]: w for w in list_workers(self.cluster.redis, self.cluster.keys)}
            in_hand = self._pending_by_consumer()
        except (redis.RedisError, AssertionError):
            registered, in_hand = {}, {}
        parts = []
        for w in group:
            leases = (registered.get(w.worker_id, {}).get("load") or {}).get("leases")
            held = [count_of(in_hand.get(w.worker_id, 0), "request in hand", "requests in hand"),
                    count_of(leases if isinstance(leases, int) else 0, "KV lease", "KV leases")]
            held = [h for h in held if h]
            parts.append(w.worker_id + (f" ({', '.join(held)})" if held else ""))
        return ", ".join(parts)

    def _pending_by_consumer(self) -> dict[str, int]:
        """Entries taken and not yet acknowledged, by consumer (worker id), in the request
        streams (prefill group) and the handoff streams (decode group)."""
        with self.cluster.redis.pipeline(transaction=False) as pipe:
            for stream, group in self._work_streams():
                pipe.xpending(stream, group)
            replies = pipe.execute(raise_on_error=False)
        counts: dict[str, int] = {}
        for reply in replies:
            if isinstance(reply, dict):  # else: no such stream or group yet
                for consumer in reply.get("consumers") or []:
                    name = consumer["name"]
                    name = name.decode() if isinstance(name, bytes) else name
                    counts[name] = counts.get(name, 0) + int(consumer["pending"])
        return counts
