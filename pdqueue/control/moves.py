"""The hard rules and how moves are planned within them.

Rules (tested):
- Nobody is left to serve a backlog: some prefill or colocated worker remains (the requests
  need one); if a prefill worker remains, or the handoff streams hold entries, some decode
  worker remains. Several moves in one decision are checked in every order they might
  complete in (every subset applied), since the workers apply them independently.
- ``min_prefill``/``min_decode``/``min_colocated`` are kept.
- Only ``switchable`` workers are moved.
- A worker switched less than ``min_dwell_s`` ago (by this planner, counted from when the
  move was issued and again from when it is seen applied; or by anyone: a changed
  ``role_epoch`` counts) is not moved. A worker seen for the first time is free to move
  unless its heartbeat reports when it took its role (``role_since``).
- A move names the ``role_epoch`` the worker last reported, so a worker whose epoch has
  moved on refuses a stale command. A move not applied within ``move_timeout_s`` is
  forgotten, as is one whose worker disappears or restarts.

``Roster`` keeps what these rules need between observations.
"""

from __future__ import annotations

from itertools import combinations
from typing import Iterable, Mapping

from pdqueue.control.decision import Move, PlannerConfig
from pdqueue.control.observation import COLOCATED, DECODE, PREFILL, ROLES, Observation, WorkerObs, count_roles


def violations(counts: Mapping[str, int], handoff_backlog: int,
               config: PlannerConfig | None = None) -> list[str]:
    """The hard rules ``counts`` would break (empty when it is a valid state)."""
    p, d, c = counts[PREFILL], counts[DECODE], counts[COLOCATED]
    out = []
    if p + d + c == 0:
        return out
    if p + c == 0:
        out.append("no prefill or colocated worker would read the requests")
    if d == 0 and p > 0:
        out.append("prefill workers without a decode worker")
    elif d == 0 and handoff_backlog > 0:
        out.append(f"{handoff_backlog} handoffs without a decode worker")
    if config is not None:
        for role, least in ((PREFILL, config.min_prefill), (DECODE, config.min_decode),
                            (COLOCATED, config.min_colocated)):
            if counts[role] < least:
                out.append(f"fewer than {least} {role} worker(s)")
    return out


def after_moves(counts: Mapping[str, int], moves: Iterable[Move]) -> dict[str, int]:
    """``counts`` once ``moves`` are applied."""
    after = dict(counts)
    for mv in moves:
        after[mv.from_role] -= 1
        after[mv.to_role] += 1
    return after


def unsafe(counts: dict[str, int], moves: list[Move], handoff_backlog: int,
           config: PlannerConfig) -> str | None:
    """What would break if some subset of ``moves`` completed (None: no subset breaks a rule)."""
    for size in range(1, len(moves) + 1):
        for subset in combinations(moves, size):
            broken = violations(after_moves(counts, subset), handoff_backlog, config)
            if broken:
                return "; ".join(broken)
    return None


class Roster:
    """The workers as the planner tracks them between observations: the moves in flight,
    each worker's last switch (the dwell), and when a role change was last seen."""

    def __init__(self, config: PlannerConfig):
        self.config = config
        self.pending: dict[str, tuple[Move, float]] = {}    # id -> (move, issued at)
        self.last_switch: dict[str, float] = {}
        self.last_change: float | None = None
        self._known: dict[str, tuple[str, int, str]] = {}   # id -> (incarnation, epoch, role)

    def track(self, obs: Observation, notes: list[str]) -> bool:
        """Follow the moves in flight and the workers' roles; True if a move was seen applied."""
        resolved = self._follow_pending(obs, notes)
        now = obs.time
        live = {w.worker_id: w for w in obs.workers}
        for wid, w in live.items():
            known = self._known.get(wid)
            if known is not None and known[0] == w.incarnation and (
                    known[1] != w.role_epoch or known[2] != w.role):
                # switched (by us or anyone): the dwell starts now, or when it says it did
                since = w.role_since if w.role_since is not None else now
                self.last_switch[wid] = max(self.last_switch.get(wid, since), since)
                self.last_change = now
            elif (known is None or known[0] != w.incarnation) and w.role_since is not None:
                self.last_switch[wid] = w.role_since
            self._known[wid] = (w.incarnation, w.role_epoch, w.role)
        for wid in [wid for wid in self._known if wid not in live]:
            del self._known[wid]
        for wid in [wid for wid, t in self.last_switch.items()
                    if wid not in live and now - t > self.config.min_dwell_s]:
            del self.last_switch[wid]
        return resolved

    def _follow_pending(self, obs: Observation, notes: list[str]) -> bool:
        now = obs.time
        resolved = False
        for wid, (move, issued) in list(self.pending.items()):
            w = obs.worker(wid)
            known = self._known.get(wid)
            if w is None:
                notes.append(f"{wid} disappeared before its move applied")
                del self.pending[wid]
            elif known is not None and w.incarnation != known[0]:
                notes.append(f"{wid} restarted before its move applied")
                del self.pending[wid]
            elif w.role_epoch != move.expected_epoch or w.role == move.to_role:
                del self.pending[wid]
                resolved = True
                self.last_change = now
            elif now - issued > self.config.move_timeout_s:
                notes.append(f"move {move} not applied in {now - issued:.0f} s: forgotten")
                del self.pending[wid]
        return resolved

    def issued(self, moves: Iterable[Move], now: float) -> None:
        for mv in moves:
            self.pending[mv.worker_id] = (mv, now)
            self.last_switch[mv.worker_id] = now

    def effective_counts(self, obs: Observation) -> dict[str, int]:
        """Workers per role once the moves in flight are done."""
        def role(w: WorkerObs) -> str:
            pending = self.pending.get(w.worker_id)
            return pending[0].to_role if pending else w.role
        return count_roles(role(w) for w in obs.workers)

    def dwelling(self, w: WorkerObs, now: float) -> float | None:
        """Seconds since its last switch if that is under ``min_dwell_s``, else None."""
        t = self.last_switch.get(w.worker_id)
        if t is not None and now - t < self.config.min_dwell_s:
            return max(0.0, now - t)
        return None

    def pick(self, obs: Observation, role: str, exclude: set[str]) -> tuple[WorkerObs | None, str]:
        """The least busy switchable worker of ``role`` free to move, or why there is none."""
        candidates, dwelling = [], []
        for w in obs.workers:
            if w.role != role or w.worker_id in exclude or w.worker_id in self.pending:
                continue
            if not w.switchable:
                continue
            age = self.dwelling(w, obs.time)
            if age is not None:
                dwelling.append(f"{w.worker_id} switched {age:.0f} s ago < "
                                f"{self.config.min_dwell_s:.0f} s dwell")
                continue
            candidates.append(w)
        if candidates:
            return min(candidates, key=lambda w: (w.busy, w.worker_id)), ""
        if dwelling:
            return None, "; ".join(dwelling)
        return None, f"no switchable {role} worker"

    def plan_moves(self, obs: Observation, counts: dict[str, int], target: Mapping[str, int],
                   max_moves: int, handoff_backlog: int) -> tuple[list[Move], list[str]]:
        """Up to ``max_moves`` moves from ``counts`` toward ``target``; and why not more."""
        moves: list[Move] = []
        blocked: list[str] = []
        cur = dict(counts)
        used: set[str] = set()
        while len(moves) < max_moves:
            chosen, blocked = self._next_move(obs, counts, cur, target, moves, used, handoff_backlog)
            if chosen is None:
                break
            moves.append(chosen)
            used.add(chosen.worker_id)
            cur = after_moves(cur, [chosen])
        return moves, blocked

    def _next_move(self, obs, counts, cur, target, moves, used,
                   handoff_backlog) -> tuple[Move | None, list[str]]:
        blocked = []
        for frm in ROLES:
            for to in ROLES:
                if frm == to or cur[frm] <= target[frm] or cur[to] >= target[to]:
                    continue
                w, why = self.pick(obs, frm, used)
                if w is None:
                    blocked.append(f"{frm} -> {to}: {why}")
                    continue
                mv = Move(w.worker_id, frm, to, w.role_epoch)
                broken = unsafe(counts, moves + [mv], handoff_backlog, self.config)
                if broken:
                    blocked.append(f"{w.worker_id} {frm} -> {to} would leave {broken}")
                    continue
                return mv, blocked
        return None, blocked


__all__ = ["Roster", "after_moves", "unsafe", "violations"]
