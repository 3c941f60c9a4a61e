"""The planner: how many workers of each role a cluster of switchable workers should run, so
that the prefill:decode split follows the load. ``Planner.decide(Observation) -> Decision``:
observations in, decisions and their reasons out; no I/O and no clock (time comes from the
observation), standard library only, so it is tested on recorded observations.
``pdqueue.control.observe`` builds the observation from Redis, ``pdqueue.control.adapter``
acts on the decision.

The parts, one job each: ``observation`` (what is seen), ``signals`` (percentiles, rates,
which side is short), ``capacity`` (what a worker can do, learned), ``moves`` (the hard rules
and move planning), ``reactive`` and ``predictive`` (the two policies, ``PlannerConfig.mode``).

A decision, in order: follow the moves in flight (while one is in flight nothing else is
decided); no moves within ``cooldown_s`` of the last decision that moved something (holds do
not restart it); a state that already breaks a hard rule (the prefill worker died, ...) is
repaired first, with one move, within the same dwell/cooldown limits; else the policy
decides, one move per decision in reactive mode, ``max_moves`` in predictive mode.

``Decision``: ``counts`` (role -> workers once the moves are done), ``moves``, ``action``
(``move``, ``repair``, ``hold``, ``wait``, ``cooldown``), ``reason`` (one sentence with the
numbers that decided) and ``signals`` (the same numbers as a dict).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from pdqueue.control.capacity import Capacity, CapacityModel
from pdqueue.control.decision import Decision, Move, PlannerConfig
from pdqueue.control.elastic import Budget, Elastic, Migration
from pdqueue.control.moves import Roster, after_moves, violations
from pdqueue.control.observation import COLOCATED, DECODE, PREFILL, ROLES, CompletionObs, Observation, WorkerObs
from pdqueue.control.predictive import Predictive
from pdqueue.control.reactive import Reactive
from pdqueue.control.signals import Signals, measure, percentile, shortages


class Turn:
    """One decision in the making: what was observed, and the ways to answer it (what the
    policies see of it: ``pdqueue.control.turn.Turn``)."""

    def __init__(self, planner: "Planner", obs: Observation, counts: dict[str, int], m: Signals,
                 signals: dict):
        self.planner = planner
        self.obs = obs
        self.counts = counts
        self.m = m
        self.signals = signals

    @property
    def capacity(self) -> Capacity:
        return self.planner.capacity

    @property
    def summary(self) -> str:
        return self.m.summary(self.planner.config)

    def streak(self, side: str) -> int:
        return self.planner._streak[side]

    def confirmed(self, side: str) -> bool:
        """The side has been short ``confirm`` observations in a row."""
        return self.streak(side) >= self.planner.config.confirm

    def note(self, text: str) -> None:
        self.planner._notes.append(text)

    def plan(self, target: dict[str, int], max_moves: int) -> tuple[list[Move], list[str]]:
        return self.planner.roster.plan_moves(self.obs, self.counts, target, max_moves,
                                              self.m.handoff_backlog)

    def hold(self, reason: str, action: str = "hold") -> Decision:
        return self.planner._decision(self.obs, self.counts, (), action, reason, self.signals)

    def issue(self, moves: Sequence[Move], action: str, reason: str) -> Decision:
        self.planner._issued(moves, self.obs.time)
        text = f"{reason}: " + ", ".join(str(mv) for mv in moves)
        return self.planner._decision(self.obs, after_moves(self.counts, moves), tuple(moves),
                                      action, text, self.signals)

    def step(self, target: dict[str, int], reason: str, blocked: str) -> Decision:
        """One move toward ``target``; if none can be made, a hold saying ``blocked`` and why."""
        moves, why = self.plan(target, 1)
        if moves:
            return self.issue(moves, "move", reason)
        return self.hold(f"{blocked}{'; '.join(why)}")


class Planner:
    """Decides role counts and moves from observations (see the module docstring).

    State kept between calls (all driven by observation time): the last time it moved
    something, the roster (moves in flight, each worker's last switch), the "short" streaks,
    the last queue sizes, a reactive transition in progress, and the capacity estimates.
    """

    def __init__(self, config: PlannerConfig | None = None):
        self.config = config or PlannerConfig()
        self.roster = Roster(self.config)
        self.model = CapacityModel(self.config)
        self.reactive = Reactive(self.config)
        self.predictive = Predictive(self.config)
        self.elastic = Elastic(self.config) if self.config.elastic else None
        self._last_move_time: float | None = None
        self._streak = {PREFILL: 0, DECODE: 0}
        self._prev_queues: tuple[int, int] | None = None
        self._notes: list[str] = []

    # ---- public --------------------------------------------------------------------------
    @property
    def pending(self) -> dict[str, Move]:
        """Moves issued and not yet seen applied, by worker id."""
        return {wid: move for wid, (move, _t) in self.roster.pending.items()}

    @property
    def capacity(self) -> Capacity:
        return self.model.capacity

    def last_switch(self, worker_id: str) -> float | None:
        return self.roster.last_switch.get(worker_id)

    def move_refused(self, worker_id: str) -> None:
        """The actuator learned that the move in flight for ``worker_id`` failed or was
        refused: forget it now instead of waiting for ``move_timeout_s``. The dwell it
        started stays."""
        self.roster.pending.pop(worker_id, None)

    def decide(self, obs: Observation) -> Decision:
        """The role decision, and with ``elastic`` the budgets and migrations beside it."""
        decision = self._decide_roles(obs)
        if self.elastic is None:
            return decision
        completions = tuple(c for c in obs.completions if c.finish_time >= obs.time - self.config.window_s)
        moving = {mv.worker_id for mv in decision.moves} | set(self.roster.pending)
        budgets, migrations = self.elastic.decide(obs, completions, moving)
        if not budgets and not migrations:
            return decision
        levers = "; ".join(str(x) for x in (*budgets, *migrations))
        return replace(decision, budgets=budgets, migrations=migrations, reason=f"{decision.reason}; {levers}")

    def _decide_roles(self, obs: Observation) -> Decision:
        cfg = self.config
        self._notes = []
        if self.roster.track(obs, self._notes):
            self._streak = {PREFILL: 0, DECODE: 0}
        completions = tuple(c for c in obs.completions if c.finish_time >= obs.time - cfg.window_s)
        counts = self.roster.effective_counts(obs)
        self.model.learn(obs, completions, counts)
        m = measure(obs, completions, counts, cfg.window_s, self.roster.last_change)
        short_p, short_d = shortages(m, cfg, self._prev_queues)
        self._streak[PREFILL] = self._streak[PREFILL] + 1 if short_p else 0
        self._streak[DECODE] = self._streak[DECODE] + 1 if short_d else 0
        self._prev_queues = (m.queued_requests, m.queued_handoffs)
        signals = m.as_dict() | {"prefill_streak": self._streak[PREFILL],
                                 "decode_streak": self._streak[DECODE]}
        turn = Turn(self, obs, counts, m, signals)

        if self.roster.pending:
            flight = ", ".join(str(mv) for mv, _t in self.roster.pending.values())
            return turn.hold(f"waiting for {flight} to be applied; {turn.summary}", "wait")
        if self._last_move_time is not None and obs.time - self._last_move_time < cfg.cooldown_s:
            return turn.hold(f"cooldown: last move {obs.time - self._last_move_time:.0f} s ago < "
                             f"{cfg.cooldown_s:.0f} s; {turn.summary}", "cooldown")
        broken = violations(counts, m.handoff_backlog, cfg)
        if broken:
            return self._repair(turn, broken)
        if cfg.mode == "predictive":
            return self.predictive.decide(turn)
        return self.reactive.decide(turn, short_p, short_d)

    # ---- internals -----------------------------------------------------------------------
    def _repair(self, turn: Turn, broken: list[str]) -> Decision:
        """One move that turns an invalid state into a valid one, if any."""
        counts, tried = turn.counts, []
        order = (PREFILL, DECODE, COLOCATED) if self.config.allow_colocated else (PREFILL, DECODE)
        for to in order:
            for frm in ROLES:
                if frm == to or counts[frm] == 0:
                    continue
                w, why = self.roster.pick(turn.obs, frm, set())
                if w is None:
                    tried.append(f"{frm} -> {to}: {why}")
                    continue
                move = Move(w.worker_id, frm, to, w.role_epoch)
                still = violations(after_moves(counts, [move]), turn.m.handoff_backlog, self.config)
                if still:
                    tried.append(f"{w.worker_id} {frm} -> {to} would leave {'; '.join(still)}")
                    continue
                self.reactive.route = None
                return turn.issue([move], "repair", f"repair: {'; '.join(broken)} ({turn.summary})")
        return turn.hold(f"cannot repair: {'; '.join(broken)}; {'; '.join(tried) or 'no worker to move'}")

    def _issued(self, moves: Sequence[Move], now: float) -> None:
        self.roster.issued(moves, now)
        self._last_move_time = now
        self._streak = {PREFILL: 0, DECODE: 0}

    def _decision(self, obs: Observation, counts: dict[str, int], moves: tuple[Move, ...],
                  action: str, reason: str, signals: dict) -> Decision:
        if self._notes:
            reason = f"{reason} [{'; '.join(self._notes)}]"
        return Decision(obs.time, dict(counts), moves, reason, action, dict(signals))


__all__ = ["COLOCATED", "DECODE", "PREFILL", "ROLES", "Budget", "Capacity", "Migration", "CompletionObs", "Decision",
           "Move", "Observation", "Planner", "PlannerConfig", "WorkerObs", "percentile",
           "violations"]
