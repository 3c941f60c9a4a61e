"""Role switching through Redis: commands to a worker, the events that answer them, and
the planner's published plan. Any Redis client can send a command; the wire is flat
string fields like the rest of pdqueue.

Switch protocol:

1. A sender reads the worker's heartbeat (``worker:<id>``: ``role``, ``role_epoch``,
   ``switchable``) and XADDs to ``control:<id>``::

       op=switch  id=<command id>  role=<prefill|decode|colocated>  epoch=<role_epoch read>
       by=<who sent it>

   ``send_switch`` does this and gives the stream a TTL, so commands to a worker that is
   gone do not stay.
2. The worker reads its ``control:<id>`` at its housekeeping cadence (~100 ms) and deletes
   each command it read. It refuses (an event ``status=refused`` with the reason) a
   malformed command, an unknown role, an epoch other than its current one (a stale
   command: another planner or an operator switched it meanwhile), a worker started with
   a fixed role (without ``--switchable``), or a switch that would leave a backlog with
   nobody to serve it. Otherwise it answers ``status=accepted``, stops taking new work of
   its old role, settles what it holds (a prefill worker keeps serving its exported KV
   until every lease is released or expired; a decode or colocated worker finishes its
   running requests), starts the new role on the same model and KV pool, bumps its epoch
   and answers ``status=done`` with ``drain_ms`` and ``switch_ms``.
3. Events go to the ``events`` stream (trimmed to ~10 000): ``type=switch``, ``command``
   (the id), ``worker``, ``status``, ``reason``, ``from``, ``to``, ``epoch`` and timings.
   ``wait_switch`` follows them for one command.

Two more commands, for the elastic planner (``PlannerConfig.elastic``), answered with
``type=budget`` / ``type=migrate`` events the same way (``refused`` with the reason, else
``done``):

- ``op=budget id=<cmd> tbt_slo_ms=<ms|off> by=<who>``: a colocated or decode worker on the
  chunked policy sets its engine's TBT budget (the share of each step prompt chunks get
  beside the running decodes; ``engine/scheduler.py``); the heartbeat's load reports it as
  ``tbt_budget_ms``.
- ``op=migrate id=<cmd> count=<n> by=<who>``: a colocated worker moves up to ``n`` of its
  running decodes with their KV to a decode worker (``workers/migration.py``), keeping its
  role and taking new work; ``accepted``, then ``done`` with ``moved``. Refused while no
  decode worker takes work.

A role epoch is an integer that only grows: a worker starts at its start time in ms, and
each switch adds one, so a command aimed at an earlier process of the same worker id is
stale as well.

The plan: a planner writes its desired counts per role to the ``plan`` hash (``prefill``,
``decode``, ``colocated``, ``reason``, ``mode``, ``action``, ``time_ms``), so an external
actuator (compose ``--scale``, a Kubernetes autoscaler) can follow them.

Imports redis (by the caller's client), pdqueue.keys and pdqueue.protocol only; never torch.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any, Mapping

from pdqueue.keys import CONTROL_TTL_S, EVENTS_MAXLEN, Keys
from pdqueue.protocol import ROLES, as_str

SWITCH = "switch"
BUDGET = "budget"      # a worker's TBT budget (the chunked policy's tbt_slo_ms)
MIGRATE = "migrate"    # move some running decodes to a decode worker, with their KV
OPS = (SWITCH, BUDGET, MIGRATE)
_FIELDS = {SWITCH: {"op", "id", "role", "epoch", "by"}, BUDGET: {"op", "id", "tbt_slo_ms", "by"},
           MIGRATE: {"op", "id", "count", "by"}}


class CommandError(ValueError):
    """A command that cannot be carried out as written (malformed, unknown role)."""


@dataclass(frozen=True, slots=True)
class SwitchCommand:
    id: str
    role: str
    epoch: int        # the role epoch the sender saw: the worker refuses any other
    by: str = ""


@dataclass(frozen=True, slots=True)
class BudgetCommand:
    id: str
    tbt_slo_ms: float | None   # the new target; None: no budget (chunks fill the token budget)
    by: str = ""


@dataclass(frozen=True, slots=True)
class MigrateCommand:
    id: str
    count: int                 # at most this many running decodes move
    by: str = ""


def parse_command(fields: Mapping) -> SwitchCommand | BudgetCommand | MigrateCommand:
    """The command in a ``control:<id>`` entry; ``CommandError`` with the reason if it is
    not well-formed."""
    f = {as_str(k): as_str(v) for k, v in fields.items()}
    op = f.get("op")
    if op not in OPS:
        raise CommandError(f"op must be one of {list(OPS)}, got {op!r}")
    unknown = sorted(set(f) - _FIELDS[op])
    if unknown:
        raise CommandError(f"unknown field(s) {unknown}")
    if op == BUDGET:
        return BudgetCommand(id=f.get("id") or "", tbt_slo_ms=_budget(f.get("tbt_slo_ms", "")), by=f.get("by", ""))
    if op == MIGRATE:
        try:
            count = int(f.get("count", ""))
        except ValueError:
            raise CommandError(f"count must be an integer, got {f.get('count')!r}") from None
        if count < 1:
            raise CommandError(f"count must be >= 1, got {count}")
        return MigrateCommand(id=f.get("id") or "", count=count, by=f.get("by", ""))
    if f.get("role") not in ROLES:
        raise CommandError(f"role must be one of {list(ROLES)}, got {f.get('role')!r}")
    try:
        epoch = int(f.get("epoch", ""))
    except ValueError:
        raise CommandError(f"epoch must be an integer, got {f.get('epoch')!r}") from None
    return SwitchCommand(id=f.get("id") or "", role=f["role"], epoch=epoch, by=f.get("by", ""))


def _budget(text: str) -> float | None:
    if text == "off":
        return None
    try:
        value = float(text)
    except ValueError:
        raise CommandError(f"tbt_slo_ms must be a number of ms or 'off', got {text!r}") from None
    if not value > 0:
        raise CommandError(f"tbt_slo_ms must be > 0, got {text!r}")
    return value


def switch_fields(role: str, epoch: int, by: str = "", id: str | None = None) -> dict[str, str]:
    return {"op": SWITCH, "id": id or secrets.token_hex(6), "role": role, "epoch": str(int(epoch)), "by": by}


def send_switch(r, keys: Keys, worker_id: str, role: str, epoch: int, by: str = "",
                id: str | None = None) -> str:
    """Ask ``worker_id`` to switch to ``role`` if its role epoch is still ``epoch``;
    returns the command id (follow it with ``wait_switch``)."""
    return _send(r, keys, worker_id, switch_fields(role, epoch, by, id))


def send_budget(r, keys: Keys, worker_id: str, tbt_slo_ms: float | None, by: str = "") -> str:
    """Set ``worker_id``'s TBT budget (None: none); returns the command id. The worker
    answers with a ``type=budget`` event (``done`` or ``refused``)."""
    value = "off" if tbt_slo_ms is None else f"{float(tbt_slo_ms):g}"
    return _send(r, keys, worker_id, {"op": BUDGET, "id": secrets.token_hex(6), "tbt_slo_ms": value, "by": by})


def send_migrate(r, keys: Keys, worker_id: str, count: int, by: str = "") -> str:
    """Ask ``worker_id`` to move up to ``count`` running decodes to a decode worker; returns
    the command id. Answered with ``type=migrate`` events: ``accepted``, then ``done`` with
    ``moved`` (or ``refused``)."""
    return _send(r, keys, worker_id, {"op": MIGRATE, "id": secrets.token_hex(6), "count": str(int(count)), "by": by})


def _send(r, keys: Keys, worker_id: str, fields: dict[str, str]) -> str:
    with r.pipeline(transaction=True) as pipe:
        pipe.xadd(keys.control(worker_id), fields)
        pipe.expire(keys.control(worker_id), CONTROL_TTL_S)
        pipe.execute()
    return fields["id"]


def take_commands(r, keys: Keys, worker_id: str, count: int = 16) -> list[tuple[str, dict]]:
    """The commands waiting for ``worker_id``, oldest first, deleted as they are read (a
    command is carried out once, by whoever reads it: one process per worker id)."""
    stream = keys.control(worker_id)
    entries = r.xrange(stream, count=count)
    if not entries:
        return []
    r.xdel(stream, *[eid for eid, _ in entries])
    return [(as_str(eid), fields) for eid, fields in entries]


def event(r_or_pipe, keys: Keys, kind: str, **fields: Any) -> None:
    """XADD one event (``type=kind``) to ``events``, trimmed to about ``EVENTS_MAXLEN``."""
    flat = {"type": kind, "time_ms": str(int(time.time() * 1000))}
    flat.update({k: "" if v is None else str(v) for k, v in fields.items()})
    r_or_pipe.xadd(keys.events, flat, maxlen=EVENTS_MAXLEN, approximate=True)


def switch_events(r, keys: Keys, command_id: str, since: str = "-") -> list[dict[str, str]]:
    """Every event of one command (switch, budget or migrate), oldest first."""
    out = []
    for _eid, fields in r.xrange(keys.events, min=since):
        f = {as_str(k): as_str(v) for k, v in fields.items()}
        if f.get("type") in OPS and f.get("command") == command_id:
            out.append(f)
    return out


def wait_switch(r, keys: Keys, command_id: str, timeout_s: float = 60.0,
                final: tuple[str, ...] = ("done", "refused", "failed")) -> dict[str, str] | None:
    """The final event of a command (done, refused or failed), or None when none came within
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        for f in switch_events(r, keys, command_id):
            if f.get("status") in final:
                return f
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def write_plan(r, keys: Keys, counts: Mapping[str, int], reason: str, mode: str = "", action: str = "") -> None:
    """Publish the desired counts per role (for external actuators) with the reason."""
    mapping = {role: str(int(counts.get(role, 0))) for role in ROLES}
    mapping.update(reason=reason, mode=mode, action=action, time_ms=str(int(time.time() * 1000)))
    r.hset(keys.plan, mapping=mapping)


def read_plan(r, keys: Keys) -> dict[str, Any] | None:
    raw = r.hgetall(keys.plan)
    if not raw:
        return None
    f = {as_str(k): as_str(v) for k, v in raw.items()}
    plan: dict[str, Any] = {role: int(f.get(role, 0) or 0) for role in ROLES}
    plan.update({k: f.get(k, "") for k in ("reason", "mode", "action")})
    plan["time_ms"] = int(f.get("time_ms", 0) or 0)
    return plan
