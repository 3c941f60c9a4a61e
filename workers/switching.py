"""The worker side of role switching (the protocol is ``pdqueue/control/commands.py``): the record of
a switch in progress, and the rule that a switch must not leave a backlog with nobody to
serve it.

A worker started with ``--switchable`` reads ``control:<id>`` every ``CONTROL_EVERY_S``
(``SwitchControl.poll``, from the shell's ``tick``) and answers each command with events on ``events``
(``type=switch``): ``refused`` (with the reason), or ``accepted`` and later ``done`` (or
``failed``). It refuses, in this order:

1. a malformed command (``control.CommandError``'s reason);
2. any command, when started without ``--switchable`` (``FIXED_ROLE``);
3. a command while the worker stops, or while another switch is in progress;
4. a stale command: its epoch is not the worker's current role epoch;
5. a switch to the role it already has (refused rather than a no-op: a sender waiting for
   the epoch to move learns at once that nothing will happen);
6. a switch that would leave a backlog with nobody to serve it (``backlog_refusal``),
   judged from the live heartbeats: each other worker counts in the role it is switching
   to (``switching_to``) if it is switching, else in its role; this worker counts in the
   new role. Refused when afterwards

   - no prefill or colocated worker remains while the request streams hold entries this
     worker does not hold (it finishes those it holds before it switches);
   - a prefill worker remains (this one included) but no decode worker, and the switch
     made it so (the last decode worker leaves, or a worker becomes prefill with no
     decode worker anywhere): the handoffs would wait for ever;
   - no decode worker remains while the handoff streams hold entries it does not hold.

   The planner guarantees the same; the worker checks again because anyone may send a
   command. Two commands accepted at the same moment by two workers can both pass (each
   reads the other's heartbeat before the other marks ``switching_to``, a few ms):
   senders issue one move at a time (the planner does).

``SwitchControl`` is this protocol in a worker (``WorkerShell.switches``): it reads the
commands, refuses or accepts them, asks the shell to switch (``WorkerShell.switch_role``)
and writes the events; the shell tells it when the old role has drained (``drained``), when
the new one serves (``done``) and when a switch failed (``failed``). What it uses of the
shell is ``SwitchHost``, typed, and nothing else (tests/test_role_contract.py). The elastic planner's
budget and migrate commands (no epoch, no backlog rule: the role keeps serving) go to the
role (``set_tbt_budget``, ``migrate_some``: levers every role has, refusing by default),
refused while the worker stops or switches, or by a role that has no such lever, and are
answered with ``type=budget`` / ``type=migrate`` events (``answer``).

Imports redis and pdqueue only (no torch).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

from pdqueue.control import commands
from pdqueue.keys import DECODE_GROUP, PREFILL_GROUP, Keys
from pdqueue.protocol import REQUEST_ROLES, Role
from pdqueue.queue.backlog import streams_backlog
from pdqueue.queue.registry import list_workers
from pdqueue.queue.streams import handoff_streams_of, request_streams_of
from workers.common import Every
from workers.recovery import REDIS_DOWN

if TYPE_CHECKING:
    import redis

    from workers.common import WorkerConfig
    from workers.role import Role as WorkerRole

log = logging.getLogger("pdqueue.worker")

CONTROL_EVERY_S = 0.1     # control:<id> is read at most this often
FIXED_ROLE = "fixed role: started without --switchable"


@dataclass(slots=True)
class Switching:
    """An accepted switch command, until it is done or failed."""

    command: str               # the command id
    from_role: str
    to_role: str
    epoch: int                 # the role epoch it was accepted at
    held: int                  # entries in hand when it was accepted
    leases: int                # exported KV leases when it was accepted (prefill)
    read_at: float = field(default_factory=time.monotonic)   # when the worker read the command
    drained_at: float | None = None                          # when the old role had settled

    def ms_since_read(self, t: float | None = None) -> float:
        return round(((time.monotonic() if t is None else t) - self.read_at) * 1000, 1)


def backlog_refusal(r, keys: Keys, worker_id: str, node: str, from_role: str, to_role: str) -> str | None:
    """Why switching ``worker_id`` from ``from_role`` to ``to_role`` would leave a backlog
    with nobody to serve it (see the module docstring), or None."""
    others = [w for w in list_workers(r, keys) if w["worker_id"] != worker_id]
    after = {w["worker_id"]: (w.get("switching_to") or w.get("role") or "") for w in others}
    after[worker_id] = to_role
    prefill = sorted(wid for wid, role in after.items() if role == Role.PREFILL)
    has_decode = any(role == Role.DECODE for role in after.values())
    has_request_role = any(role in REQUEST_ROLES for role in after.values())
    if from_role in REQUEST_ROLES and not has_request_role:
        n = streams_backlog(r, request_streams_of(r, keys), PREFILL_GROUP, not_held_by=worker_id).total
        if n:
            return f"nobody left to serve it: last prefill-capable worker, {n} request(s) queued"
    if not has_decode and prefill and (from_role == Role.DECODE or to_role == Role.PREFILL):
        who = "last decode worker" if from_role == Role.DECODE else "no decode worker"
        return f"nobody left to serve it: {who}, prefill worker(s) {', '.join(prefill)} would hand off to nobody"
    if from_role == Role.DECODE and not has_decode:
        streams = handoff_streams_of(keys, [*others, {"node": node}])
        n = streams_backlog(r, streams, DECODE_GROUP, not_held_by=worker_id).total
        if n:
            return f"nobody left to serve it: last decode worker, {n} handoff(s) queued"
    return None


class SwitchHost(Protocol):
    """What the switch control uses of its worker's shell (``WorkerShell``), all of it."""

    config: WorkerConfig          # ``switchable``
    worker_id: str
    node: str
    keys: Keys
    r: redis.Redis
    role: WorkerRole              # the role now: its name, what it holds, its levers
    role_epoch: int
    next_role: WorkerRole | None  # the role a switch under way goes to

    @property
    def stopping(self) -> bool:
        """A stop was asked, warm or cold."""

    def switch_role(self, role: WorkerRole) -> None:
        """Replace the running role by ``role`` once it has finished what it holds."""

    def advertise(self, **fields) -> None:
        """Show these fields in the worker's heartbeat, written now."""


class SwitchControl:
    """The switch commands of one worker (see the module docstring). ``shell``: its
    ``WorkerShell``, as a ``SwitchHost``; ``make_role(name)`` builds the role a command asks
    for (workers/role.py ``role_for``)."""

    def __init__(self, shell: SwitchHost, make_role: Callable[[str], WorkerRole]):
        self.shell = shell
        self.make_role = make_role
        self.switching: Switching | None = None   # an accepted switch command, until done or failed
        self._every = Every(CONTROL_EVERY_S)

    def poll(self) -> None:
        """Every ``CONTROL_EVERY_S``: answer the commands waiting on ``control:<id>``."""
        if not self._every.due():
            return
        shell = self.shell
        for entry_id, fields in commands.take_commands(shell.r, shell.keys, shell.worker_id):
            try:
                self._command(entry_id, fields)
            except REDIS_DOWN as exc:   # read and deleted, but not answered: the sender times out
                log.warning("switch command %s not answered: redis unavailable (%s)", entry_id, exc)

    def _command(self, entry_id: str, fields) -> None:
        shell = self.shell
        read_at = time.monotonic()
        raw_id = fields.get(b"id", fields.get("id", b""))
        command_id = (raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id)) or entry_id
        try:
            cmd = commands.parse_command(fields)
        except commands.CommandError as exc:
            self._refuse(command_id, "", str(exc))
            return
        command_id = cmd.id or command_id
        if isinstance(cmd, (commands.BudgetCommand, commands.MigrateCommand)):
            self._lever(command_id, cmd)
            return
        reason = self.refusal(cmd)
        if reason:
            self._refuse(command_id, cmd.role, reason)
            return
        role = shell.role
        sw = Switching(command_id, role.name, cmd.role, shell.role_epoch, held=len(role.held()),
                       leases=int(role.load().get("leases", 0)), read_at=read_at)
        self.switching = sw
        shell.advertise(switching_to=cmd.role)
        self.event("accepted", sw, by=cmd.by)
        log.info("worker %s: switch %s -> %s accepted (command %s by %s; %d in hand, %d leases)", shell.worker_id,
                 role.name, cmd.role, command_id, cmd.by or "?", sw.held, sw.leases)
        shell.switch_role(self.make_role(cmd.role))

    def refusal(self, cmd: commands.SwitchCommand) -> str | None:
        """Why this worker will not carry ``cmd`` out, or None (the module docstring's order)."""
        shell = self.shell
        if not shell.config.switchable:
            return FIXED_ROLE
        if shell.stopping:
            return "the worker is stopping"
        if self.switching is not None or shell.next_role is not None:
            to = self.switching.to_role if self.switching else shell.next_role.name
            return f"a switch to {to} is in progress"
        if cmd.epoch != shell.role_epoch:
            return f"stale epoch: expected {cmd.epoch}, worker is at {shell.role_epoch}"
        if cmd.role == shell.role.name:
            return f"already {cmd.role}"
        return backlog_refusal(shell.r, shell.keys, shell.worker_id, shell.node, shell.role.name, cmd.role)

    def _lever(self, command_id: str, cmd) -> None:
        """A budget or migrate command: the role carries it out (``set_tbt_budget``,
        ``migrate_some``) or says why not; a migration answers ``done`` once it ran."""
        shell = self.shell
        budget = isinstance(cmd, commands.BudgetCommand)
        kind = commands.BUDGET if budget else commands.MIGRATE
        if shell.stopping:
            reason = "the worker is stopping"
        elif self.switching is not None or shell.next_role is not None:
            reason = "a switch is in progress"
        elif budget:   # (a role without the lever refuses: workers/role.py)
            reason = shell.role.set_tbt_budget(cmd.tbt_slo_ms)
        else:
            reason = shell.role.migrate_some(cmd.count, command_id)
        if reason:
            log.warning("worker %s: %s command %s refused: %s", shell.worker_id, kind, command_id, reason)
            self.answer(kind, command_id, "refused", reason=reason)
        elif budget:
            log.info("worker %s: TBT budget %s (command %s by %s)", shell.worker_id,
                     "off" if cmd.tbt_slo_ms is None else f"{cmd.tbt_slo_ms:g} ms", command_id, cmd.by or "?")
            self.answer(kind, command_id, "done", tbt_slo_ms="off" if cmd.tbt_slo_ms is None else cmd.tbt_slo_ms)
        else:
            self.answer(kind, command_id, "accepted", count=cmd.count, by=cmd.by)

    def answer(self, kind: str, command_id: str, status: str, **fields) -> None:
        """An event answering a budget or migrate command."""
        shell = self.shell
        try:
            commands.event(shell.r, shell.keys, kind, command=command_id, worker=shell.worker_id, status=status,
                           role=shell.role.name, **fields)
        except REDIS_DOWN as exc:
            log.warning("%s %s: the %s event was not written (%s)", kind, command_id, status, exc)

    def _refuse(self, command_id: str, to: str, reason: str) -> None:
        shell = self.shell
        log.warning("worker %s: switch command %s refused: %s", shell.worker_id, command_id, reason)
        commands.event(shell.r, shell.keys, commands.SWITCH, command=command_id, worker=shell.worker_id,
                       status="refused", reason=reason, **{"from": shell.role.name, "to": to},
                       epoch=shell.role_epoch)

    def event(self, status: str, sw: Switching, **fields) -> None:
        fields.setdefault("epoch", sw.epoch)
        try:
            commands.event(self.shell.r, self.shell.keys, commands.SWITCH, command=sw.command,
                           worker=self.shell.worker_id, status=status, **{"from": sw.from_role, "to": sw.to_role},
                           held=sw.held, leases=sw.leases, **fields)
        except REDIS_DOWN as exc:
            log.warning("switch %s: the %s event was not written (%s)", sw.command, status, exc)

    # ---- what the shell reports --------------------------------------------------------
    def drained(self) -> None:
        """The old role has settled what it held."""
        if self.switching is not None:
            self.switching.drained_at = time.monotonic()

    def done(self) -> None:
        """The new role serves (started, its own pending entries taken in): ``done``."""
        sw, self.switching = self.switching, None
        if sw is None:
            return
        shell = self.shell
        drain_ms = sw.ms_since_read(sw.drained_at) if sw.drained_at is not None else 0.0
        self.event("done", sw, epoch=shell.role_epoch, drain_ms=drain_ms, switch_ms=sw.ms_since_read())
        log.info("worker %s: now %s (epoch %d): drained in %.0f ms, serving %.0f ms after the command",
                 shell.worker_id, shell.role.name, shell.role_epoch, drain_ms, sw.ms_since_read())

    def failed(self, reason: str, **fields) -> None:
        """The switch in progress (if any) did not complete: ``failed``."""
        sw, self.switching = self.switching, None
        if sw is not None:
            self.event("failed", sw, reason=reason, **fields)
