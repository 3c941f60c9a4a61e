"""Rolling restarts of a running `pdqueue up` (``pdqueue restart``): every process replaced
one at a time, the replacement serving before the old one leaves, so that no request fails.

The command travels through Redis like the workers' commands (pdqueue/control/commands.py):
``pdqueue restart`` XADDs ``op=restart`` to ``control:pdqueue-up`` (``UP_ADDRESSEE``) and
follows the ``events`` stream, where `up`'s supervisor answers with ``type=restart`` events
of the command (``accepted``, ``progress``, then ``done``, ``failed`` or ``refused``, each
with a ``text``). The supervisor thread (``restarts.Restarts``) reads the commands each
round and advances the roll (``Rolling.tick``) a step at a time, never blocking: it is the
thread that forks the replacements, which get PDEATHSIG when the thread that forked them ends.

One process, one step:

    start    a new process: a worker under a new worker id (``replacement_id``: two processes
             never share an id, its consumer name and heartbeat), in the role the old one runs
             now (its heartbeat's), with its options and a fresh interpreter (after a code
             change, the new code); the gateway on `up`'s listening socket (``--fd``)
    ready    a worker: its heartbeat, from its pid (it loaded the model, started its role and
             took its groups); the gateway: ``accepting connections (pid N)`` on its stdout.
             It exits first, or is not ready within ``ready_timeout_s``: the roll stops there,
             the old process serving on (``failed``, with the replacement's log)
    swap     the replacement takes the old one's place in `up` (supervised, in the state
             file); the old one moves to ``retired`` and is told to leave: SIGTERM, a worker's
             warm stop (a prefill worker finishes its prompts and serves their KV until
             fetched; a decode worker moves its running decodes with their KV to a peer that
             takes work: the replacement, ``workers/migration.py``); SIGUSR1, the gateway's
             handover (``pdqueue.frontends.runtime.Handover``: it stops accepting, the new
             one accepts from the same socket, and its open requests and streams run to
             their end)
    leave    the old process exits. Not within ``stop_timeout_s``: SIGTERM again (a cold
             stop: a worker's entries are taken over, as after a crash; the gateway's open
             answers end with an error), SIGKILL ``COLD_S`` later

The order: prefill, colocated and decode workers (their current roles), then the gateway.
Workers not running (restarting after an exit, or given up on) are skipped: they start afresh
anyway. `up`'s stop ends a roll (``abort``): a replacement not ready yet is stopped, and an
old process already leaving is waited for by the stop.

Imports redis (through the cluster's client), pdqueue.keys/protocol/control.commands; never torch.
"""

from __future__ import annotations

import re
import secrets
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Callable

import redis

from pdqueue.control.commands import event as publish_event
from pdqueue.control.commands import take_commands
from pdqueue.frontends.runtime import HANDOVER_SIGNAL
from pdqueue.keys import CONTROL_TTL_S, Keys
from pdqueue.protocol import ROLES, as_str
from workers.cli.supervisor.processes import WorkerProcess, secs
from workers.cli.supervisor.restarts import ROLES_IN_STOP_ORDER
from workers.cli.supervisor.supervised import Supervised

UP_ADDRESSEE = "pdqueue-up"   # control:<this> holds the commands to a cluster's `pdqueue up`
RESTART = "restart"           # the command's op and its events' type
FINAL = ("done", "failed", "refused")
ACCEPT_WITHIN_S = 30.0        # a command not taken by then is stale (`up` gone, or still loading)
READY_TIMEOUT_S = 600.0       # a replacement loads the model in this long, or the roll stops
STOP_TIMEOUT_S = 60.0         # an old process leaves in this long, or it is stopped cold
COLD_S = 5.0                  # between the cold stop and SIGKILL


@dataclass(frozen=True, slots=True)
class RestartCommand:
    id: str
    roles: tuple[str, ...]    # the workers of these (current) roles; with gateway False and no roles: all
    gateway: bool             # the gateway (alone, or beside roles)
    ready_timeout_s: float = READY_TIMEOUT_S
    stop_timeout_s: float = STOP_TIMEOUT_S
    expires_ms: int = 0       # not taken by then: refused as stale
    by: str = ""

    @property
    def everything(self) -> bool:
        return not self.roles and not self.gateway


def parse_restart(fields: dict) -> RestartCommand:
    """A command from its flat fields (ValueError: malformed)."""
    f = {as_str(k): as_str(v) for k, v in fields.items()}
    if f.get("op") != RESTART or not f.get("id"):
        raise ValueError(f"not a restart command: op={f.get('op')!r}")
    roles = tuple(r for r in f.get("roles", "").split(",") if r)
    unknown = [r for r in roles if r not in ROLES]
    if unknown:
        raise ValueError(f"unknown role {unknown[0]!r} (expected {', '.join(ROLES)})")
    return RestartCommand(id=f["id"], roles=roles, gateway=f.get("gateway") == "1",
                          ready_timeout_s=float(f.get("ready_timeout_s") or READY_TIMEOUT_S),
                          stop_timeout_s=float(f.get("stop_timeout_s") or STOP_TIMEOUT_S),
                          expires_ms=int(f.get("expires_ms") or 0), by=f.get("by", ""))


# ---- the sender's side (`pdqueue restart`) ----------------------------------------------------

def send_restart(r, keys: Keys, roles: tuple[str, ...] = (), gateway: bool = False,
                 ready_timeout_s: float = READY_TIMEOUT_S, stop_timeout_s: float = STOP_TIMEOUT_S,
                 by: str = "") -> tuple[str, str]:
    """Ask the `up` of ``keys``' cluster for a rolling restart; returns (the command's id, the
    ``events`` id to follow its answers from: ``follow``)."""
    last = r.xrevrange(keys.events, count=1)
    since = as_str(last[0][0]) if last else "0-0"
    command_id = secrets.token_hex(6)
    fields = {"op": RESTART, "id": command_id, "roles": ",".join(roles), "gateway": "1" if gateway else "0",
              "ready_timeout_s": f"{ready_timeout_s:g}", "stop_timeout_s": f"{stop_timeout_s:g}",
              "expires_ms": str(int((time.time() + ACCEPT_WITHIN_S) * 1000)), "by": by}
    with r.pipeline(transaction=True) as pipe:
        pipe.xadd(keys.control(UP_ADDRESSEE), fields)
        pipe.expire(keys.control(UP_ADDRESSEE), CONTROL_TTL_S)
        pipe.execute()
    return command_id, since


def follow(r, keys: Keys, command_id: str, since: str, block_ms: int = 1000) -> tuple[list[dict], str]:
    """The events of ``command_id`` after ``since`` (waiting up to ``block_ms`` for one), and
    the id to go on from."""
    got = r.xread({keys.events: since}, block=block_ms, count=100)
    out = []
    for _stream, entries in got or ():
        for eid, fields in entries:
            since = as_str(eid)
            f = {as_str(k): as_str(v) for k, v in fields.items()}
            if f.get("type") == RESTART and f.get("command") == command_id:
                out.append(f)
    return out, since


# ---- the supervisor's side --------------------------------------------------------------------

def replacement_id(worker_id: str, taken: set[str]) -> str:
    """A new worker id for ``worker_id``'s replacement: its run suffix drawn again
    (``decode-0-ab12`` -> ``decode-0-7f3c``)."""
    base = re.sub(r"-[0-9a-f]{4}$", "", worker_id)
    while True:
        new = f"{base}-{secrets.token_hex(2)}"
        if new != worker_id and new not in taken:
            return new


@dataclass(slots=True)
class _Step:
    """One process being replaced."""
    old: WorkerProcess
    new: WorkerProcess | None = None
    leaving: bool = False      # swapped: the old one was told to leave
    since: float = 0.0         # when this phase began (monotonic)
    signals: int = 0           # escalations sent to the leaving process


class Rolling:
    """The rolling restarts of one `up` (one at a time), advanced by its supervisor thread
    (``tick`` is one of ``Restarts.each_round``). ``event(text, level, tail)`` is the
    supervisor's own event line (`up`'s console and up.log)."""

    def __init__(self, cluster: Supervised, event: Callable[[str, str, str], None]):
        self.cluster = cluster
        self._event = event
        self.command: RestartCommand | None = None
        self.queue: list[str] = []          # worker ids (and "gateway") still to replace
        self.step: _Step | None = None
        self.started = 0.0
        self.replaced: list[str] = []

    # ---- commands ---------------------------------------------------------------------------
    def tick(self, now: float | None = None) -> None:
        """One round: take new commands, advance the roll under way."""
        now = time.monotonic() if now is None else now
        try:
            commands = take_commands(self.cluster.redis, self.cluster.keys, UP_ADDRESSEE)
        except (redis.RedisError, OSError):
            commands = []
        for _eid, fields in commands:
            self._take(fields, now)
        if self.command is not None:
            self._advance(now)

    def _take(self, fields: dict, now: float) -> None:
        try:
            command = parse_restart(fields)
        except ValueError as exc:
            command_id = as_str(fields.get(b"id", fields.get("id", b""))) if isinstance(fields, dict) else ""
            self._answer(command_id, "refused", f"pdqueue restart refused: {exc}")
            return
        why = self._refusal(command)
        if why:
            self._answer(command.id, "refused", f"pdqueue restart refused: {why}")
            return
        self.command, self.started, self.replaced = command, now, []
        self.queue = self._targets(command)
        names = ", ".join(self.queue)
        self.say(f"rolling restart {command.id}: {len(self.queue)} process{'es' * (len(self.queue) > 1)} one at "
                 f"a time, each replaced once its replacement serves: {names}", "accepted")

    def _refusal(self, c: RestartCommand) -> str | None:
        if c.expires_ms and time.time() * 1000 > c.expires_ms:
            return f"the command is stale (sent more than {ACCEPT_WITHIN_S:g} s before `up` read it)"
        if self.command is not None:
            return f"a rolling restart ({self.command.id}) is under way"
        if c.gateway and self.cluster.gateway is None:
            return "this `up` runs no gateway (--no-gateway)"
        running = {w.role for w in self.cluster.workers if w.alive and not w.gave_up}
        missing = [role for role in c.roles if role not in running]
        if missing:
            return f"no {missing[0]} worker runs here (running: {', '.join(sorted(running)) or 'none'})"
        if not self._targets(c):
            return "nothing to restart"
        return None

    def _targets(self, c: RestartCommand) -> list[str]:
        roles = ROLES_IN_STOP_ORDER if c.everything else tuple(r for r in ROLES_IN_STOP_ORDER if r in c.roles)
        ids = [w.worker_id for role in roles for w in self.cluster.workers
               if w.role == role and w.alive and not w.gave_up]
        if (c.everything or c.gateway) and self.cluster.gateway is not None:
            ids.append("gateway")
        return ids

    # ---- the roll ---------------------------------------------------------------------------
    def _advance(self, now: float) -> None:
        if self.step is None:
            self._next(now)
        elif not self.step.leaving:
            self._starting(self.step, now)
        else:
            self._leaving(self.step, now)

    def _next(self, now: float) -> None:
        while self.queue:
            target = self.queue.pop(0)
            old = self.cluster.gateway if target == "gateway" else \
                next((w for w in self.cluster.workers if w.worker_id == target), None)
            if old is None or not old.alive or old.gave_up:
                self.say(f"{target} is not running (exited; `up` starts it afresh): skipped")
                continue
            self._start(old, now)
            return
        took = secs(now - self.started)
        self.say(f"rolling restart {self.command.id} done: {len(self.replaced)} process"
                 f"{'es' * (len(self.replaced) != 1)} replaced in {took} ({', '.join(self.replaced) or 'none'})",
                 "done")
        self.command = None

    def _start(self, old: WorkerProcess, now: float) -> None:
        c = self.cluster
        try:
            if old is c.gateway:
                new = WorkerProcess("gateway", "gateway", c.start_gateway_process(), old.log_path)
            else:
                taken = {w.worker_id for w in c.workers + c.retired}
                new_id = replacement_id(old.worker_id, taken)
                log_path = c.log_dir / f"{new_id}.log"
                new = WorkerProcess(old.role, new_id, c.start_worker_process(old.role, new_id, log_path), log_path)
        except OSError as exc:
            self._fail(f"the replacement of {old.worker_id} could not be started: {exc}; {old.worker_id} keeps serving")
            return
        self.step = _Step(old, new, since=now)
        what = "a new gateway" if old is c.gateway else f"{new.worker_id} ({new.role})"
        self.say(f"{old.worker_id}: starting {what}, pid {new.proc.pid}")

    def _ready(self, new: WorkerProcess) -> bool:
        if new.role == "gateway":
            return self.cluster.gateway_accepting(new.proc.pid)
        try:
            pid = self.cluster.redis.hget(self.cluster.keys.worker(new.worker_id), "pid")
        except (redis.RedisError, OSError):
            return False
        return pid is not None and int(pid) == new.proc.pid

    def _starting(self, step: _Step, now: float) -> None:
        new, old = step.new, step.old
        name = "the new gateway" if new.role == "gateway" else new.worker_id
        if new.proc.poll() is not None:
            self._fail(f"{name} (replacing {old.worker_id}) exited with status {new.proc.returncode} before it "
                       f"was ready; {old.worker_id} keeps serving; its log: {new.log_path}", tail=new.log_tail())
            return
        if not self._ready(new):
            if now - step.since > self.command.ready_timeout_s:
                self._stop_replacement(new)
                self._fail(f"{name} (replacing {old.worker_id}) was not ready within "
                           f"{self.command.ready_timeout_s:g} s: stopped; {old.worker_id} keeps serving; "
                           f"its log: {new.log_path}", tail=new.log_tail())
            return
        self._swap(step, now)

    def _swap(self, step: _Step, now: float) -> None:
        c, old, new = self.cluster, step.old, step.new
        ready_s = now - step.since
        if old is c.gateway:
            c.gateway = new
            how = "stops accepting (the new one accepts from the same socket); its open requests run to their end"
        else:
            c.workers[next(i for i, w in enumerate(c.workers) if w is old)] = new
            how = ("warm: its running decodes move to a peer with their KV" if old.role in ("decode", "colocated")
                   else "warm: its prompts in hand finish and their KV is served until fetched")
        c.retired.append(old)
        old.restart_at = None   # (dead meanwhile and due for a restart: it is replaced instead)
        old.handled_pid = old.proc.pid
        if old.alive:
            old.signal(HANDOVER_SIGNAL if old.role == "gateway" else signal.SIGTERM)
        step.leaving, step.since = True, now
        if c.state_file is not None:
            try:
                c.write_state(c.state_file)
            except OSError:
                pass
        name = f"a new gateway (pid {new.proc.pid})" if new.role == "gateway" else new.worker_id
        self.say(f"{name} serves ({secs(ready_s)} after its start); {old.worker_id} (pid {old.proc.pid}) "
                 f"leaves ({how})")

    def _leaving(self, step: _Step, now: float) -> None:
        old = step.old
        if old.proc.poll() is not None:
            if old.role != "gateway":
                self.cluster.forget_heartbeat(old)   # (its warm stop removed it; a killed one's goes now)
            self.replaced.append(old.worker_id if old.role != "gateway" else "gateway")
            self.say(f"{old.worker_id} (pid {old.proc.pid}) left (status {old.proc.returncode}) "
                     f"after {secs(now - step.since)}")
            self.step = None
            self._next(now)
            return
        late = now - step.since - self.command.stop_timeout_s
        if late >= 0 and step.signals == 0:
            step.signals = 1
            old.signal(signal.SIGTERM)
            self.say(f"{old.worker_id} still runs {self.command.stop_timeout_s:g} s after it was told to leave: "
                     f"SIGTERM (cold: what it holds is taken over)", level="warning")
        elif late >= COLD_S and step.signals == 1:
            step.signals = 2
            old.signal(signal.SIGTERM)   # the gateway's second: its open answers end with an error
        elif late >= 2 * COLD_S and step.signals == 2:
            step.signals = 3
            old.signal(signal.SIGKILL)
            self.say(f"{old.worker_id} did not leave: SIGKILL", level="warning")

    def _stop_replacement(self, new: WorkerProcess) -> None:
        """A replacement that is not used: SIGTERM (it holds nothing yet), SIGKILL after COLD_S."""
        new.signal(signal.SIGTERM)
        try:
            new.proc.wait(COLD_S)
        except subprocess.TimeoutExpired:
            new.signal(signal.SIGKILL)
            new.proc.wait()

    def _fail(self, text: str, tail: str = "") -> None:
        left = list(self.queue)
        if left:
            text += f"; the roll stops ({', '.join(left)} not restarted)"
        self.say(f"rolling restart {self.command.id} failed: {text}", "failed", tail=tail)
        self.command, self.step, self.queue = None, None, []

    def abort(self) -> None:
        """`up` stops: a replacement not ready yet is stopped; an old process already leaving
        is in ``retired``, for the stop to wait for."""
        if self.command is None:
            return
        step = self.step
        if step is not None and not step.leaving and step.new is not None and step.new.alive:
            self._stop_replacement(step.new)
        self._fail("`up` is stopping")

    # ---- answers ----------------------------------------------------------------------------
    def say(self, text: str, status: str = "progress", level: str | None = None, tail: str = "") -> None:
        """A line for `pdqueue restart` (an event of the command) and `up`'s console."""
        level = level or {"failed": "error", "refused": "warning"}.get(status, "info")
        self._event(text, level, tail)
        if self.command is not None:
            self._answer(self.command.id, status, text, tail)

    def _answer(self, command_id: str, status: str, text: str, tail: str = "") -> None:
        if status == "refused":
            self._event(text, "warning", "")
        try:
            publish_event(self.cluster.redis, self.cluster.keys, RESTART, command=command_id, status=status,
                          text=text, tail=tail)
        except (redis.RedisError, OSError):
            pass
