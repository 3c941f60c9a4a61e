"""`up`'s restarts, like compose's ``restart: on-failure`` for every process: one that exits
while `up` is not stopping starts again under the same worker id (so it takes back the
entries it held, ``workers/recovery.py`` ``own_pending``) and in the role it ran (its
heartbeat's, so ``--adapt``'s switches hold), after ``backoff_s`` (the config's
``restart_backoff_s``, ``up --restart-backoff-s``, default RESTART_BACKOFF_S), doubling per
restart up to RESTART_BACKOFF_MAX_S; a process that ran HEALTHY_RUN_S starts the doubling over.
One that exits again after CRASH_LOOP_RESTARTS restarts within CRASH_LOOP_WINDOW_S is in a crash
loop: `up` gives up on it, and ``failure`` is set when that leaves a role (or the gateway)
with nobody. ``events`` records what happened (also in ``up.log``). Never imports torch.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import redis

from pdqueue.protocol import Role
from pdqueue.queue.registry import list_workers
from workers.cli.supervisor.processes import WorkerProcess, secs
from workers.cli.supervisor.supervised import Supervised

RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0
HEALTHY_RUN_S = 60.0
CRASH_LOOP_RESTARTS = 5
CRASH_LOOP_WINDOW_S = 60.0
SUPERVISE_EVERY_S = 0.2
ROLES_EVERY_S = 1.0   # how often the supervisor notes each worker's current role (``--adapt``)
# Prefill first (it keeps serving exported KV until the decode side has copied it), decode
# last (it finishes what prefill handed off). With ``--adapt`` roles change: the current
# role is read from each worker's heartbeat.
ROLES_IN_STOP_ORDER = (Role.PREFILL.value, Role.COLOCATED.value, Role.DECODE.value)


class Restarts:
    """The supervisor thread of one ``LocalCluster`` and what it reports."""

    def __init__(self, cluster: Supervised, backoff_s: float = RESTART_BACKOFF_S):
        self.cluster = cluster
        self.backoff_s = backoff_s   # the first restart's delay, doubled per restart
        self.stopping = threading.Event()
        self.stopped = threading.Event()    # every process is stopped: the supervisor thread may end
        self.round = threading.Lock()       # held for each round of the supervisor
        self._thread: threading.Thread | None = None
        self._on_event: Callable[[dict], None] | None = None
        self._on_failure: Callable[[str], None] | None = None
        self._next_roles = 0.0
        self._events_lock = threading.Lock()
        self.events: list[dict] = []      # {"time": epoch s, "level", "text", "worker_id", "tail"}
        # More work of the supervisor thread, each called once a round with the time (the
        # rolling restarts, ``rolling.Rolling.tick``): it forks processes that must outlive it.
        self.each_round: list[Callable[[float], None]] = []
        self.failure: str | None = None   # set when a crash loop left a role (or the gateway) with nobody

    def start(self, on_event: Callable[[dict], None] | None = None,
              on_failure: Callable[[str], None] | None = None) -> None:
        """From now until ``stop``: start again every worker (and the gateway) that exits,
        under its worker id and in the role it ran (see ``backoff_s``), in a thread.
        ``on_event`` gets each event (``events``: exits, restarts, returns, a crash loop) as
        it happens, from that thread; ``on_failure`` the reason when `up` should stop: a
        crash loop left no worker to take a role's work, or no gateway (``failure``)."""
        self._on_event, self._on_failure = on_event, on_failure
        self._thread = threading.Thread(target=self._run, name="pdq-supervisor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self.stopping.wait(SUPERVISE_EVERY_S):
            with self.round:
                if self.stopping.is_set():
                    break
                try:
                    self.once()
                except Exception as exc:  # noqa: BLE001 (the supervisor must go on)
                    self.event(f"supervisor error: {type(exc).__name__}: {exc}", "error")
        # The processes this thread started get PDEATHSIG when it ends (the signal follows
        # the thread that forked, not the process): it lives until ``stop`` has stopped them.
        self.stopped.wait()

    def once(self, now: float | None = None) -> None:
        """One round: note each worker's current role and whether restarted ones are back;
        handle new exits (a restart due later, or a crash loop); start the restarts due."""
        now = time.monotonic() if now is None else now
        if now >= self._next_roles:
            self._next_roles = now + ROLES_EVERY_S
            self._note_heartbeats()
        if self.cluster.gateway is not None and not self.cluster.gateway.back and self.cluster.gateway.alive \
                and self.cluster.gateway_printed_url():
            self._came_back(self.cluster.gateway)
        for w in self.cluster.processes():
            if self.stopping.is_set():
                return
            if w.alive or w.gave_up:
                continue
            if w.handled_pid != w.proc.pid:
                self._exited(w, now)
            elif w.restart_at is not None and now >= w.restart_at:
                self._restart(w, now)
        for work in self.each_round:
            if self.stopping.is_set():
                return
            work(now)

    def _note_heartbeats(self) -> None:
        try:
            beats = {b["worker_id"]: b for b in list_workers(self.cluster.redis, self.cluster.keys)}
        except (redis.RedisError, OSError):
            return
        switched = False
        for w in self.cluster.workers:
            beat = beats.get(w.worker_id)
            if beat is None or not w.alive or beat.get("pid") != w.proc.pid:
                continue  # (an earlier process's heartbeat is removed when it exits)
            if beat.get("role") in ROLES_IN_STOP_ORDER and beat["role"] != w.role:
                w.role, switched = beat["role"], True   # --adapt: a restart comes back in the role it ran
            if not w.back:
                self._came_back(w)
        if switched and self.cluster.state_file is not None:
            try:
                self.cluster.write_state(self.cluster.state_file)   # the roles it lists are the current ones
            except OSError:
                pass

    def _came_back(self, w: WorkerProcess) -> None:
        w.back = True
        role = "" if w is self.cluster.gateway else ", " + w.role
        self.event(f"{w.worker_id} is back (restart {w.restarts}, pid {w.proc.pid}{role}; "
                   f"serving {secs(time.monotonic() - w.started)} after its start)", "info", w)

    def _exited(self, w: WorkerProcess, now: float) -> None:
        w.handled_pid = w.proc.pid
        code, ran = w.proc.returncode, now - w.started
        w.exits.append((code, ran))
        if w is not self.cluster.gateway:
            self.cluster.forget_heartbeat(w)
        if ran >= HEALTHY_RUN_S:
            w.backoff = 0
        recent = [t for t in w.restart_times if now - t < CRASH_LOOP_WINDOW_S]
        what = f"{w.worker_id} exited ({code}) after {secs(ran)}"
        if len(recent) >= CRASH_LOOP_RESTARTS:
            w.gave_up = True
            self.event(f"{what}: a crash loop ({len(recent)} restarts within {CRASH_LOOP_WINDOW_S:g} s), "
                        f"not restarted again; its log: {w.log_path}", "error", w, tail=w.log_tail())
            why = self.cannot_serve()
            if why:
                self.failure = (f"{w.worker_id} is in a crash loop ({len(recent)} restarts within "
                                f"{CRASH_LOOP_WINDOW_S:g} s) and {why}: stopping (its log: {w.log_path})")
                if self._on_failure is not None:
                    self._on_failure(self.failure)
            else:
                self.event(f"up goes on without {w.worker_id}: {self.serving()} left", "warning", w)
            return
        delay = min(RESTART_BACKOFF_MAX_S, self.backoff_s * 2 ** w.backoff)
        w.backoff += 1
        w.restart_at = now + delay
        self.event(f"{what}; restarting in {delay:g} s (restart {w.restarts + 1})", "warning", w)

    def _restart(self, w: WorkerProcess, now: float) -> None:
        w.restart_at = None
        try:
            with open(w.log_path, "ab") as log:
                log.write(f"\n---- pdqueue up: restart {w.restarts + 1} of {w.worker_id} "
                          f"({time.strftime('%H:%M:%S')}; the last process exited with status "
                          f"{w.proc.returncode}) ----\n".encode())
            if w is self.cluster.gateway:
                proc = self.cluster.start_gateway_process()   # on `up`'s socket: the URL `up` printed stays right
            else:
                proc = self.cluster.start_worker_process(w.role, w.worker_id, w.log_path)
        except OSError as exc:
            w.gave_up = True
            self.event(f"{w.worker_id} could not be started again: {exc}", "error", w)
            return
        w.proc, w.started, w.back = proc, time.monotonic(), False
        w.restarts += 1
        w.restart_times.append(now)
        self.event(f"{w.worker_id} restarted (restart {w.restarts}, pid {proc.pid}"
                    f"{'' if w is self.cluster.gateway else ', as ' + w.role})", "info", w)
        if self.cluster.state_file is not None:
            try:
                self.cluster.write_state(self.cluster.state_file)   # its new pid
            except OSError:
                pass

    def cannot_serve(self) -> str | None:
        """Why the workers not given up on cannot answer every request (None: they can)."""
        if self.cluster.gateway is not None and self.cluster.gateway.gave_up:
            return "there is no gateway left"
        roles = {w.role for w in self.cluster.workers if not w.gave_up}
        if Role.COLOCATED.value in roles or {Role.PREFILL.value, Role.DECODE.value} <= roles:
            return None
        missing = [r for r in (Role.PREFILL.value, Role.DECODE.value) if r not in roles]
        return f"no {' or '.join(missing)} worker is left"

    def serving(self) -> str:
        counts: dict[str, int] = {}
        for w in self.cluster.workers:
            if not w.gave_up:
                counts[w.role] = counts.get(w.role, 0) + 1
        return " + ".join(f"{n} {role}" for role, n in counts.items()) + \
            (" workers" if sum(counts.values()) > 1 else " worker")

    def event(self, text: str, level: str, w: WorkerProcess | None = None, tail: str = "") -> None:
        event = {"time": time.time(), "level": level, "text": text,
                 "worker_id": w.worker_id if w is not None else "", "tail": tail}
        with self._events_lock:
            self.events.append(event)
            self.log(text, level, tail)
        if self._on_event is not None:
            self._on_event(event)

    def log(self, text: str, level: str = "info", tail: str = "") -> None:
        """A line in ``up.log`` in the log directory (the events, and the stop's steps)."""
        try:
            with open(self.cluster.log_dir / "up.log", "a") as log:
                log.write(f"{time.strftime('%H:%M:%S')} {level}: {text}\n")
                if tail:
                    log.write("".join(f"    {line}\n" for line in tail.splitlines()))
        except OSError:
            pass

    def halt(self) -> None:
        """No restart from now on: a round in progress ends first."""
        self.stopping.set()
        with self.round:
            pass

    def release(self) -> None:
        """Every process is stopped: the supervisor thread may end (the processes it started
        get PDEATHSIG when it does)."""
        self.stopped.set()
