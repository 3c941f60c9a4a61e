"""The worker side of role switching (the protocol is ``pdqueue/control/commands.py``): the record of
a switch in progress, and the rule that a switch must not leave a backlog with nobody to
serve it.

A worker started with ``--switchable`` reads ``control:<id>`` every ``CONTROL_EVERY_S``
(``WorkerShell.control``) and answers each command with events on ``events``
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

Imports redis and pdqueue only (no torch).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdqueue.keys import DECODE_GROUP, PREFILL_GROUP, Keys
from pdqueue.protocol import REQUEST_ROLES
from pdqueue.queue.backlog import streams_backlog
from pdqueue.queue.registry import list_workers
from pdqueue.queue.streams import request_streams_of

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
    prefill = sorted(wid for wid, role in after.items() if role == "prefill")
    has_decode = any(role == "decode" for role in after.values())
    has_request_role = any(role in REQUEST_ROLES for role in after.values())
    if from_role in REQUEST_ROLES and not has_request_role:
        n = streams_backlog(r, request_streams_of(r, keys), PREFILL_GROUP, not_held_by=worker_id).total
        if n:
            return f"nobody left to serve it: last prefill-capable worker, {n} request(s) queued"
    if not has_decode and prefill and (from_role == "decode" or to_role == "prefill"):
        who = "last decode worker" if from_role == "decode" else "no decode worker"
        return f"nobody left to serve it: {who}, prefill worker(s) {', '.join(prefill)} would hand off to nobody"
    if from_role == "decode" and not has_decode:
        nodes = {w.get("node") for w in others if w.get("node")} | {node}
        streams = [keys.handoff, *(keys.handoff_node(n) for n in sorted(nodes))]
        n = streams_backlog(r, streams, DECODE_GROUP, not_held_by=worker_id).total
        if n:
            return f"nobody left to serve it: last decode worker, {n} handoff(s) queued"
    return None
