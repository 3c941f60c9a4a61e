"""The elastic levers below the worker level (``PlannerConfig.elastic``): each colocated
worker's TBT budget, and migrations of running decodes off a colocated worker whose prefill
load threatens their TBT. Role moves (the policies) stay as they are; these act between them,
in seconds rather than the tens of seconds a role switch costs.

Budgets (TaiChi-style per-instance chunk budgets), for the colocated workers that report one
(``budgetable``: the chunked policy). Such a worker gives prompt chunks only what fits beside
its decodes within its TBT budget (``engine/scheduler.py``). Per worker, from the completions it decoded in the window:
- its TBT p90 over the target: the budget tightens (x ``budget_step``, not below
  ``budget_min_frac`` x target): decodes get more of each step;
- else its TTFT p90 over the target while its TBT p90 is at most ``donor_headroom`` x target:
  the budget loosens (/ ``budget_step``, up to ``budget_max_frac`` x target): prompts get more;
- else it stays. The first budget is the TBT target. A budget changes at most every
  ``budget_every_s`` per worker (its effect must show in the window first), and is sent
  again while the worker reports another one.

Migrations. A colocated worker with running decodes and at least ``migrate_waiting`` prompts
waiting in its engine (each will take chunks of the coming steps) moves up to
``migrate_max`` of them to the decode workers that take work (not draining or switching,
KV under ``kv_high``), as many as those have room for (``max_batch`` minus what they run and
hold). At most one migration per worker every ``migrate_every_s``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdqueue.control.decision import PlannerConfig
from pdqueue.control.observation import COLOCATED, DECODE, CompletionObs, Observation, WorkerObs
from pdqueue.control.signals import percentile


@dataclass(frozen=True, slots=True)
class Budget:
    """Set ``worker_id``'s TBT budget to ``tbt_slo_ms`` (None: no budget)."""
    worker_id: str
    tbt_slo_ms: float | None
    why: str = ""

    def __str__(self) -> str:
        value = "off" if self.tbt_slo_ms is None else f"{self.tbt_slo_ms:.0f} ms"
        return f"{self.worker_id} TBT budget {value}" + (f" ({self.why})" if self.why else "")


@dataclass(frozen=True, slots=True)
class Migration:
    """Move up to ``count`` running decodes of ``worker_id`` to a decode worker."""
    worker_id: str
    count: int
    why: str = ""

    def __str__(self) -> str:
        return f"migrate {self.count} from {self.worker_id}" + (f" ({self.why})" if self.why else "")


class Elastic:
    """Budgets and migrations from observations; state: the budget each worker should have,
    when it was last changed or sent, and each worker's last migration."""

    def __init__(self, config: PlannerConfig):
        self.config = config
        self.target: dict[str, float] = {}
        self._changed_at: dict[str, float] = {}
        self._sent_at: dict[str, float] = {}
        self._migrated_at: dict[str, float] = {}

    def decide(self, obs: Observation, completions: tuple[CompletionObs, ...],
               moving: set[str]) -> tuple[tuple[Budget, ...], tuple[Migration, ...]]:
        """``moving``: workers with a role move in flight (left alone)."""
        live = {w.worker_id for w in obs.workers}
        for table in (self.target, self._changed_at, self._sent_at, self._migrated_at):
            for wid in [wid for wid in table if wid not in live]:
                del table[wid]
        colocated = [w for w in obs.workers if w.role == COLOCATED and w.worker_id not in moving
                     and not w.draining]
        budgets = tuple(b for b in (self._budget(obs, w, completions) for w in colocated if w.budgetable)
                        if b is not None)
        return budgets, self._migrations(obs, colocated)

    # ---- budgets ---------------------------------------------------------------------------
    def _budget(self, obs: Observation, w: WorkerObs, completions) -> Budget | None:
        cfg, now, wid = self.config, obs.time, w.worker_id
        base = cfg.tbt_slo_ms
        current = self.target.get(wid, base)
        why = "the TBT target" if wid not in self.target else ""
        if now - self._changed_at.get(wid, -1e18) >= cfg.budget_every_s:
            new, why = self._step(w, completions, current) if wid in self.target else (current, why)
            if new != current or wid not in self.target:
                self._changed_at[wid] = now
            self.target[wid] = current = new
        reported = w.tbt_budget_ms
        if reported is not None and abs(reported - current) < 0.5:
            return None
        if now - self._sent_at.get(wid, -1e18) < cfg.budget_every_s / 2 and not why:
            return None
        self._sent_at[wid] = now
        return Budget(wid, round(current, 1), why or f"reports {reported or 'none'}")

    def _step(self, w: WorkerObs, completions, current: float) -> tuple[float, str]:
        cfg = self.config
        mine = [c for c in completions if c.decode_worker == w.worker_id]
        tbt = [t for t in (c.tbt_ms for c in mine) if t is not None]
        ttft = [c.ttft_ms for c in mine if c.num_output_tokens > 0]
        if len(tbt) < cfg.min_completions:
            return current, ""
        tbt_p90, ttft_p90 = percentile(tbt, 90), percentile(ttft, 90)
        low, high = cfg.budget_min_frac * cfg.tbt_slo_ms, cfg.budget_max_frac * cfg.tbt_slo_ms
        if tbt_p90 > cfg.tbt_slo_ms:
            return (max(low, current * cfg.budget_step),
                    f"TBT p90 {tbt_p90:.0f} ms > {cfg.tbt_slo_ms:.0f} ms: tighter")
        if ttft_p90 is not None and ttft_p90 > cfg.ttft_slo_ms and tbt_p90 <= cfg.donor_headroom * cfg.tbt_slo_ms:
            return (min(high, current / cfg.budget_step),
                    f"TTFT p90 {ttft_p90:.0f} ms > {cfg.ttft_slo_ms:.0f} ms, TBT p90 {tbt_p90:.0f} ms: looser")
        return current, ""

    # ---- migrations ------------------------------------------------------------------------
    def _migrations(self, obs: Observation, colocated: list[WorkerObs]) -> tuple[Migration, ...]:
        cfg = self.config
        room = sum(max(0, cfg.max_batch - d.running - d.backlog - d.waiting - d.fetching)
                   for d in obs.workers if d.role == DECODE and not d.draining
                   and (d.kv_used_frac is None or d.kv_used_frac < cfg.kv_high))
        out = []
        for w in sorted(colocated, key=lambda w: (-w.waiting, w.worker_id)):
            if room <= 0:
                break
            if w.running < 1 or w.waiting < cfg.migrate_waiting:
                continue
            if obs.time - self._migrated_at.get(w.worker_id, -1e18) < cfg.migrate_every_s:
                continue
            count = min(w.running, cfg.migrate_max, room)
            room -= count
            self._migrated_at[w.worker_id] = obs.time
            out.append(Migration(w.worker_id, count, f"{w.waiting} prompts waiting beside {w.running} running"))
        return tuple(out)


__all__ = ["Budget", "Elastic", "Migration"]
