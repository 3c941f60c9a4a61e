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

A role epoch is an integer that only grows: a worker starts at its start time in ms, and
each switch adds one, so a command aimed at an earlier process of the same worker id is
stale as well.

The plan: a planner writes its desired counts per role to the ``plan`` hash (``prefill``,
``decode``, ``colocated``, ``reason``, ``mode``, ``action``, ``time_ms``), so an external
actuator (compose ``--scale``, a Kubernetes autoscaler) can follow them.

Imports redis (by the caller's client) and pdqueue.keys only; never torch.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any, Mapping

from pdqueue.keys import CONTROL_TTL_S, EVENTS_MAXLEN, Keys
from pdqueue.protocol import ROLES, as_str
SWITCH = "switch"
_FIELDS = {"op", "id", "role", "epoch", "by"}


class CommandError(ValueError):
    """A command that cannot be carried out as written (malformed, unknown role)."""


@dataclass(frozen=True, slots=True)
class SwitchCommand:
    id: str
    role: str
    epoch: int        # the role epoch the sender saw: the worker refuses any other
    by: str = ""


def parse_command(fields: Mapping) -> SwitchCommand:
    """The command in a ``control:<id>`` entry; ``CommandError`` with the reason if it is
    not a well-formed switch."""
    f = {as_str(k): as_str(v) for k, v in fields.items()}
    unknown = sorted(set(f) - _FIELDS)
    if unknown:
        raise CommandError(f"unknown field(s) {unknown}")
    if f.get("op") != SWITCH:
        raise CommandError(f"op must be {SWITCH!r}, got {f.get('op')!r}")
    if f.get("role") not in ROLES:
        raise CommandError(f"role must be one of {list(ROLES)}, got {f.get('role')!r}")
    try:
        epoch = int(f.get("epoch", ""))
    except ValueError:
        raise CommandError(f"epoch must be an integer, got {f.get('epoch')!r}") from None
    return SwitchCommand(id=f.get("id") or "", role=f["role"], epoch=epoch, by=f.get("by", ""))


def switch_fields(role: str, epoch: int, by: str = "", id: str | None = None) -> dict[str, str]:
    return {"op": SWITCH, "id": id or secrets.token_hex(6), "role": role, "epoch": str(int(epoch)), "by": by}


def send_switch(r, keys: Keys, worker_id: str, role: str, epoch: int, by: str = "",
                id: str | None = None) -> str:
    """Ask ``worker_id`` to switch to ``role`` if its role epoch is still ``epoch``;
    returns the command id (follow it with ``wait_switch``)."""
    fields = switch_fields(role, epoch, by, id)
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
    """Every event of one switch command, oldest first."""
    out = []
    for _eid, fields in r.xrange(keys.events, min=since):
        f = {as_str(k): as_str(v) for k, v in fields.items()}
        if f.get("type") == SWITCH and f.get("command") == command_id:
            out.append(f)
    return out


def wait_switch(r, keys: Keys, command_id: str, timeout_s: float = 60.0,
                final: tuple[str, ...] = ("done", "refused", "failed")) -> dict[str, str] | None:
    """The final event of a switch command (done, refused or failed), or None when none
    came within ``timeout_s``."""
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
