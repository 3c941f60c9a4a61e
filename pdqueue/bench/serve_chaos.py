"""`bench serve --batch-lines N --chaos kill-worker,restart-redis`: faults mid-run (issue 27).

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

KINDS = ("kill-worker", "restart-redis")
# kill-worker without a role: the first of these that runs
ROLES = (Role.DECODE.value, Role.COLOCATED.value, Role.PREFILL.value)
# The bench's Redis server under --chaos: durable across its restart.
DURABLE_REDIS_ARGS = ("--appendfsync", "everysec")


@dataclass(frozen=True, slots=True)
class Event:
    kind: str                   # one of KINDS
    at_s: float | None = None   # seconds after the rate's start; None: half way through the arrivals
    role: str | None = None     # kill-worker: the role of the worker killed (None: ROLES' order)

    @property
    def name(self) -> str:
        return self.kind + (f":{self.role}" if self.role else "")


def parse_chaos(text: str) -> tuple[Event, ...]:
    """``kill-worker,restart-redis``, ``kill-worker:prefill@5,restart-redis@8``, ..."""
    events = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        what, _, at = item.partition("@")
        kind, _, role = what.partition(":")
        if kind not in KINDS:
            raise ValueError(f"{item!r}: expected one of {', '.join(KINDS)} (optionally @SECONDS)")
        if role and (kind != "kill-worker" or role not in ROLES):
            raise ValueError(f"{item!r}: a role goes with kill-worker only, one of {', '.join(ROLES)}")
        try:
            at_s = float(at) if at else None
        except ValueError:
            raise ValueError(f"{item!r}: @SECONDS must be a number") from None
        if at_s is not None and at_s < 0:
            raise ValueError(f"{item!r}: @SECONDS must be >= 0")
        events.append(Event(kind, at_s, role or None))
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
    ``running`` (the launcher's ``Running``, with ``kill_worker(role)`` and
    ``worker_back(worker_id, pid)``), ``owner`` (the thread that restarts the server)."""

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
                else:
                    record.update(await self._restart_redis())
            except Exception as exc:   # noqa: BLE001 (reported: the run goes on)
                record["error"] = f"{type(exc).__name__}: {exc}"
            done.append(record)
        return done

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
