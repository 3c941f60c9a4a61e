"""`bench serve --batch-lines N --chaos kill-worker,restart-redis,rolling-restart,zero-capacity`:
faults mid-run (issue 27; the roll and the outage: issue 42).

Each event happens once per rate, at its time after the rate's start (the first online
arrival): ``EVENT@SECONDS``, or without ``@`` half way through the online load's arrivals.
Events due at the same second happen in the order given.

- ``kill-worker[:ROLE]``: SIGKILL one worker process (its process group) of the mode: a
  decode worker, else a colocated one, else a prefill one; ``:ROLE`` picks the role. The
  bench's cluster runs under the local cluster's supervisor when ``--chaos`` is given
  (``LocalCluster.supervise``, as ``pdqueue up`` does): the worker is started again under
  its worker id after the restart backoff (1 s) and takes back the entries it held.
- ``restart-redis``: stop the bench's Redis server (SIGTERM: it writes its AOF out and
  exits) and start it again on the same port and directory. With ``--chaos`` the bench's
  server runs with ``appendonly yes`` and ``appendfsync everysec`` (without ``--chaos`` it
  keeps no persistence, as before), so the streams, consumer groups and pending lists come
  back; a graceful stop loses nothing at any fsync policy.
- ``rolling-restart``: every worker of the mode's cluster replaced one at a time by the
  supervisor's own rolling restart (``workers/cli/supervisor/rolling.py``: the command
  ``pdqueue restart`` sends, taken by the bench's ``LocalCluster`` supervisor): each
  replacement under a new worker id, ready by heartbeat, then the old one leaves warm (its
  decodes move with their KV). The bench's modes run no gateway, so workers only (the record
  says so: ``gateway``). Recorded: when it began and ended, each process replaced (old and new
  ids), the roll's own lines, and a failure (a replacement that did not start: the old one
  serves on and the roll stops).
- ``zero-capacity[:SECONDS]``: every prefill-capable worker (prefill and colocated) stopped
  warm at once (they take nothing new and finish what they hold), SECONDS later (default
  ``ZERO_CAPACITY_S``) as many started again in their roles under new worker ids (the ids a
  rolling restart's replacements get: the old processes leave the supervisor's care as
  retired ones, so it never restarts them meanwhile). The online requests meanwhile wait in the
  queue (the Python client does not give up). New ids rather than the same ones: a restart under
  the same id is the supervisor's crash path (an exit counted against its crash loop, its
  backoff), and a new id never shares a consumer name or heartbeat with a process still
  finishing its warm stop. Recorded: the outage's start and end, when
  capacity was back (the first new worker registered), the ids stopped and started.

Events run one after another in time order: one due while an earlier one (a roll, an outage)
is still under way starts when it ends. A roll or an outage has a window (``at_s`` to
``until_s``, seconds after the rate's start; an outage's ends when capacity is back): the rate's
figures add the TTFT of the requests that arrived in a window against the others
(``serve_report.window_figures``).

With ``--chaos-alternate N`` each rate runs 2N times on the same workers: N times without the
events (the baseline: the same request list) and N times with them, alternately, the baseline
first; each run's figures are kept (``runs``) and the report sets the medians side by side
(``serve_report.alternated``).

What each event did (when, which worker, its pid, when the supervisor had it back; how long
Redis was away) goes into the rate's figures under ``chaos``. Imports the standard library.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from pdqueue.protocol import Role

KINDS = ("kill-worker", "restart-redis", "rolling-restart", "zero-capacity")
WINDOWED = ("rolling-restart", "zero-capacity")   # events with a window (at_s .. until_s)
ZERO_CAPACITY_S = 20.0   # zero-capacity's outage without :SECONDS
ROLL_TIMEOUT_S = 900.0   # a roll not done by then is reported as such (the supervisor's limits end it sooner)
CAPACITY_BACK_TIMEOUT_S = 300.0   # zero-capacity: a worker started again registers within this, or "not back"
# kill-worker without a role: the first of these that runs
ROLES = (Role.DECODE.value, Role.COLOCATED.value, Role.PREFILL.value)
# The bench's Redis server under --chaos: durable across its restart.
DURABLE_REDIS_ARGS = ("--appendfsync", "everysec")


@dataclass(frozen=True, slots=True)
class Event:
    kind: str                   # one of KINDS
    at_s: float | None = None   # seconds after the rate's start; None: half way through the arrivals
    role: str | None = None     # kill-worker: the role of the worker killed (None: ROLES' order)
    hold_s: float | None = None   # zero-capacity: the outage's length (None: ZERO_CAPACITY_S)

    @property
    def name(self) -> str:
        hold = f":{self.hold_s:g}" if self.hold_s is not None else ""
        return self.kind + (f":{self.role}" if self.role else "") + hold


def parse_chaos(text: str) -> tuple[Event, ...]:
    """``kill-worker,restart-redis``, ``kill-worker:prefill@5,restart-redis@8``,
    ``rolling-restart@10``, ``zero-capacity:20@10``, ..."""
    events = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        what, _, at = item.partition("@")
        kind, _, role = what.partition(":")
        if kind not in KINDS:
            raise ValueError(f"{item!r}: expected one of {', '.join(KINDS)} (optionally @SECONDS)")
        hold_s = None
        if kind == "zero-capacity" and role:
            try:
                hold_s, role = float(role), ""
            except ValueError:
                raise ValueError(f"{item!r}: zero-capacity:SECONDS must be a number") from None
            if hold_s < 0:
                raise ValueError(f"{item!r}: zero-capacity:SECONDS must be >= 0")
        if role and (kind != "kill-worker" or role not in ROLES):
            raise ValueError(f"{item!r}: a role goes with kill-worker only, one of {', '.join(ROLES)}")
        try:
            at_s = float(at) if at else None
        except ValueError:
            raise ValueError(f"{item!r}: @SECONDS must be a number") from None
        if at_s is not None and at_s < 0:
            raise ValueError(f"{item!r}: @SECONDS must be >= 0")
        events.append(Event(kind, at_s, role or None, hold_s))
    if not events:
        raise ValueError("no event given")
    return tuple(events)


def chaos_text(events: tuple[Event, ...]) -> str:
    return ",".join(e.name + (f"@{e.at_s:g}" if e.at_s is not None else "") for e in events)


class Owner:
    """A thread that runs what it is given and lives until ``close``: the Redis server it
    starts again gets PDEATHSIG tied to the thread that started it (``pdqueue.procs``), so
    that thread must outlive the server (a pool's thread would end and take it down)."""

    def __init__(self):
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="pdq-bench-chaos", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, future, loop = job
            try:
                result = fn()
            except BaseException as exc:   # noqa: BLE001 (handed to the caller)
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

    async def call(self, fn: Callable):
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._jobs.put((fn, future, loop))
        return await future

    def close(self) -> None:
        """After the server it started has stopped."""
        self._jobs.put(None)


def _settle(future: asyncio.Future, result, exc) -> None:
    if future.cancelled():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


class Chaos:
    """The events of ``--chaos`` against one mode's cluster: ``server`` (a ``RedisServer``),
    ``running`` (the launcher's ``Running``, with ``kill_worker(role)``,
    ``worker_back(worker_id, pid)``, ``rolling_restart(timeout_s)``, ``stop_prefill_capable()``,
    ``start_again(stopped)`` and ``registered(worker_ids)``), ``owner`` (the thread that restarts
    the server and starts workers again: what it starts must outlive the event loop)."""

    def __init__(self, events: tuple[Event, ...], server, running, owner: Owner):
        self.events, self.server, self.running, self.owner = events, server, running, owner

    async def run(self, started: float, default_at_s: float) -> list[dict]:
        """Each event at its time after ``started`` (unix s); what each did."""
        done = []
        order = sorted(range(len(self.events)),
                       key=lambda i: (self.events[i].at_s if self.events[i].at_s is not None else default_at_s, i))
        for i in order:
            event = self.events[i]
            at_s = event.at_s if event.at_s is not None else default_at_s
            await asyncio.sleep(max(0.0, started + at_s - time.time()))
            record = {"event": event.name, "at_s": round(time.time() - started, 3)}
            try:
                if event.kind == "kill-worker":
                    record.update(self.running.kill_worker(event.role))
                elif event.kind == "rolling-restart":
                    record.update(await asyncio.to_thread(self.running.rolling_restart, ROLL_TIMEOUT_S))
                    record["until_s"] = round(time.time() - started, 3)
                elif event.kind == "zero-capacity":
                    record.update(await self._zero_capacity(event, started))
                else:
                    record.update(await self._restart_redis())
            except Exception as exc:   # noqa: BLE001 (reported: the run goes on)
                record["error"] = f"{type(exc).__name__}: {exc}"
            done.append(record)
        return done

    async def _zero_capacity(self, event: Event, started: float) -> dict:
        """Every prefill-capable worker stopped warm; ``hold_s`` later as many started again;
        then wait for the first to register (capacity back)."""
        hold_s = ZERO_CAPACITY_S if event.hold_s is None else event.hold_s
        t0 = time.time()
        stopped = self.running.stop_prefill_capable()
        if not stopped:
            raise RuntimeError("no running prefill or colocated worker to stop")
        record = {"stopped": [w["worker_id"] for w in stopped], "roles": sorted({w["role"] for w in stopped}),
                  "hold_s": hold_s}
        await asyncio.sleep(max(0.0, t0 + hold_s - time.time()))
        started_again = await self.owner.call(lambda: self.running.start_again(stopped))
        record["outage_end_s"] = round(time.time() - started, 3)
        record["started"] = started_again
        deadline = time.monotonic() + CAPACITY_BACK_TIMEOUT_S
        back = None
        while time.monotonic() < deadline:
            if self.running.registered(started_again):
                back = time.time()
                break
            await asyncio.sleep(0.1)
        record["capacity_back_s"] = None if back is None else round(back - started, 3)
        record["capacity_back_after_s"] = None if back is None else round(back - t0, 3)
        record["until_s"] = record["capacity_back_s"] if back is not None else round(time.time() - started, 3)
        return record

    async def _restart_redis(self) -> dict:
        def restart() -> dict:
            t0 = time.monotonic()
            old = self.server.pid
            self.server.restart()   # SIGTERM (the AOF is written out), then the same port and dir
            return {"port": self.server.port, "old_pid": old, "pid": self.server.pid,
                    "away_s": round(time.monotonic() - t0, 3)}
        return await self.owner.call(restart)

    async def settle(self, kills: list[dict], timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until every killed worker is back (registered
        again); note when in each record (``back_after_s``: from the kill)."""
        deadline = time.monotonic() + timeout_s
        for record in kills:
            if "worker_id" not in record:
                continue
            while time.monotonic() < deadline:
                back = self.running.worker_back(record["worker_id"], record["pid"])
                if back is not None:
                    record["back_after_s"] = round(back - record["killed_at"], 3)
                    record["restarts"] = self.running.restarts_of(record["worker_id"])
                    break
                await asyncio.sleep(0.2)
            else:
                record["back_after_s"] = None


def chaos_schedule(chaos: bool, alternate: int) -> list[bool]:
    """Which runs of a rate have the events: one run (with them when there are any), or
    ``--chaos-alternate N``'s 2N runs, without and with them by turns, the baseline first."""
    if not chaos:
        return [False]
    if alternate <= 0:
        return [True]
    return [False, True] * alternate
