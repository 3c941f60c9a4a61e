"""Actuation: a ``Planner`` run against a live cluster. Each ``tick`` observes the cluster
through Redis (``observe.observe``), asks the planner, publishes the plan (the
``plan`` hash and, when it changes, a ``type=plan`` event) and sends the moves as switch
commands (``pdqueue.control.commands``), and with ``PlannerConfig.elastic`` the budgets and
migrations as budget and migrate commands. A move the worker refuses is reported back to the planner
(``move_refused``) so it is not waited for.

Used by ``pdqueue up --adapt`` (a thread of the supervisor), ``pdqueue plan --apply`` and
``bench serve``'s adaptive mode. ``dry_run`` publishes and reports but sends nothing
(``pdqueue plan`` without ``--apply``). Imports redis (the caller's client) and pdqueue's
planner/control/keys; never torch.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from pdqueue.control import commands
from pdqueue.control.observe import observe
from pdqueue.control.planner import Decision, Move, Planner, PlannerConfig
from pdqueue.keys import Keys

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Sent:
    move: Move
    command_id: str
    status: str = "sent"          # sent -> accepted -> done | refused | failed
    reason: str = ""


@dataclass(slots=True)
class AdapterState:
    """What the live view shows: the last decision, the moves sent and how they ended."""
    decision: Decision | None = None
    sent: list[Sent] = field(default_factory=list)
    errors: int = 0


class Adapter:
    def __init__(self, r, keys: Keys, config: PlannerConfig | None = None, *, name: str = "planner",
                 dry_run: bool = False):
        self.r = r
        self.keys = keys
        self.planner = Planner(config)
        self.name = name
        self.dry_run = dry_run
        self.state = AdapterState()
        self._last_reason = ""

    def tick(self) -> Decision:
        """One observe -> decide -> publish -> act round."""
        self._follow_sent()
        obs = observe(self.r, self.keys, window_s=self.planner.config.window_s)
        decision = self.planner.decide(obs)
        self.state.decision = decision
        commands.write_plan(self.r, self.keys, decision.counts, decision.reason,
                           mode=self.planner.config.mode, action=decision.action)
        if decision.reason != self._last_reason or decision.moves:
            self._last_reason = decision.reason
            commands.event(self.r, self.keys, "plan", action=decision.action, reason=decision.reason,
                          counts=",".join(f"{k}={v}" for k, v in sorted(decision.counts.items())),
                          moves="; ".join(str(m) for m in decision.moves), by=self.name)
        if not self.dry_run:
            for move in decision.moves:
                cid = commands.send_switch(self.r, self.keys, move.worker_id, move.to_role, move.expected_epoch,
                                          by=self.name)
                log.info("planner: %s (%s)", move, decision.reason)
                self.state.sent.append(Sent(move, cid))
                del self.state.sent[:-20]
            for budget in decision.budgets:      # elastic: answered by type=budget events
                commands.send_budget(self.r, self.keys, budget.worker_id, budget.tbt_slo_ms, by=self.name)
                log.info("planner: %s", budget)
            for migration in decision.migrations:
                commands.send_migrate(self.r, self.keys, migration.worker_id, migration.count, by=self.name)
                log.info("planner: %s", migration)
        return decision

    def _follow_sent(self) -> None:
        """Read how the commands sent earlier ended; a refused one is given up at once."""
        for sent in self.state.sent:
            if sent.status in ("done", "refused", "failed"):
                continue
            events = commands.switch_events(self.r, self.keys, sent.command_id)
            if not events:
                continue
            last = events[-1]
            sent.status, sent.reason = last.get("status", sent.status), last.get("reason", "")
            if sent.status in ("refused", "failed"):
                log.warning("planner: %s %s: %s", sent.move, sent.status, sent.reason)
                self.planner.move_refused(sent.move.worker_id)

    def run(self, stop: threading.Event, interval_s: float = 1.0) -> None:
        """``tick`` every ``interval_s`` until ``stop``; Redis errors are logged and retried."""
        import redis

        while not stop.is_set():
            try:
                self.tick()
            except redis.RedisError as exc:
                self.state.errors += 1
                log.warning("planner: redis unavailable (%s)", exc)
            stop.wait(interval_s)
