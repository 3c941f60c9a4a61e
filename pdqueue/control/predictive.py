"""The predictive policy (Dynamo's "demand over measured capacity").

Demand: prompt and output tokens/s over the window, plus the queued requests and handoffs
(times the mean prompt/output length) spread over ``backlog_drain_s``. Capacity: the learned
``Capacity`` of one worker; decode at the largest batch whose predicted step stays under
``tbt_step_frac`` x TBT SLO (capped at ``max_batch``); a colocated worker does
``colocated_efficiency`` of a dedicated one's work. For each candidate split of the
switchable workers (every prefill/decode split, and all-colocated) the utilization u is the
busiest side's demand/capacity, requests shared between prefill and colocated workers as
evenly as possible. Rules, in order (hysteresis band ``target_utilization`` <= u <=
``keep_utilization``):
1. a disaggregated current split with u <= keep_utilization is kept;
2. with colocated workers, go back to a disaggregated split that fits (u <=
   target_utilization), since disaggregation gives the shorter TBT tail when it fits;
3. a current split with colocated workers and u <= keep_utilization is kept;
4. otherwise a disaggregated split that fits, else all-colocated if it fits (among several:
   the fewest moves, then the lowest u); if none fits, the lowest u if it beats the current
   one by ``min_gain``, else hold ("overloaded: add workers").
Non-switchable workers keep their roles in every candidate. The model does not predict
colocated TBT (prefill stalls); ``colocated_efficiency`` and the preference for
disaggregation stand in for it. Up to ``max_moves`` moves per decision.
"""

from __future__ import annotations

import math
from typing import Mapping

from pdqueue.control.decision import Decision, PlannerConfig
from pdqueue.control.moves import violations
from pdqueue.control.observation import COLOCATED, DECODE, PREFILL, ROLES, count_roles
from pdqueue.control.signals import fmt_counts, fmt_u
from pdqueue.control.turn import Turn


def utilization(counts: Mapping[str, int], need_p: float, need_d: float,
                colocated_efficiency: float) -> float:
    """The busiest side's load (1.0 = saturated) for ``counts``; ``need_*`` are the demand in
    workers' worth at 100 % (demand / one worker's capacity)."""
    p, d, c = counts[PREFILL], counts[DECODE], counts[COLOCATED]
    ce = c * colocated_efficiency

    def at(x: float) -> float:      # x: the share of the requests the colocated workers take
        worst = 0.0
        for load, n in (((1 - x) * need_p, p), ((1 - x) * need_d, d), (x * (need_p + need_d), ce)):
            if load <= 1e-12:
                continue
            if n <= 0:
                return math.inf
            worst = max(worst, load / n)
        return worst

    if c == 0:
        return at(0.0)
    if p == 0:
        return at(1.0)
    return min(at(i / 100) for i in range(101))


class Predictive:
    def __init__(self, config: PlannerConfig):
        self.config = config

    def decide(self, turn: Turn) -> Decision:
        cfg, m, counts = self.config, turn.m, turn.counts
        cap = turn.capacity
        if m.completions == 0 and m.queued_requests == 0 and m.queued_handoffs == 0:
            return turn.hold(f"hold {fmt_counts(counts)}: idle (no completions in "
                             f"{cfg.window_s:.0f} s, nothing queued)")
        mean_p = m.mean_prompt_tokens if m.mean_prompt_tokens is not None else cfg.default_prompt_tokens
        mean_o = m.mean_output_tokens if m.mean_output_tokens is not None else cfg.default_output_tokens
        prompt_demand = m.prompt_tok_s + m.queued_requests * mean_p / cfg.backlog_drain_s
        output_demand = m.output_tok_s + m.queued_handoffs * mean_o / cfg.backlog_drain_s
        step_limit = cfg.tbt_step_frac * cfg.tbt_slo_ms
        batch = cap.decode_batch(step_limit, cfg.max_batch)
        decode_tok_s = cap.decode_tok_s(step_limit, cfg.max_batch)
        need_p = prompt_demand / cap.prefill_tok_s
        need_d = output_demand / decode_tok_s
        u_cur = utilization(counts, need_p, need_d, cfg.colocated_efficiency)

        head = (f"demand {prompt_demand:.0f} prompt tok/s + {output_demand:.1f} output tok/s "
                f"({m.completions} completions in {m.span_s:.0f} s, {m.queued_requests} requests / "
                f"{m.queued_handoffs} handoffs queued) over capacity {cap.prefill_tok_s:.0f} prefill "
                f"tok/s and {decode_tok_s:.0f} decode tok/s per worker (batch {max(1, batch)} at "
                f"{cap.step_ms(max(1, batch)):.0f} ms): needs {need_p / cfg.target_utilization:.2f} "
                f"prefill + {need_d / cfg.target_utilization:.2f} decode workers at "
                f"{cfg.target_utilization:.0%}; current {fmt_counts(counts)} at {fmt_u(u_cur)}")
        turn.signals |= {"prompt_demand_tok_s": round(prompt_demand, 3),
                         "output_demand_tok_s": round(output_demand, 3),
                         "prefill_tok_s": round(cap.prefill_tok_s, 3),
                         "decode_tok_s": round(decode_tok_s, 3),
                         "utilization": None if math.isinf(u_cur) else round(u_cur, 4)}
        fixed = count_roles(w.role for w in turn.obs.workers if not w.switchable)  # nothing in flight here
        movable = sum(counts.values()) - sum(fixed.values())
        if not movable:
            return turn.hold(f"{head}; no switchable worker")
        target, why = self._target(counts, fixed, movable, need_p, need_d, u_cur)
        if target is None or target == counts:
            return turn.hold(f"{head}; {why or 'hold'}")
        moves, blocked = turn.plan(target, cfg.max_moves)
        if not moves:
            return turn.hold(f"{head}; {why}, blocked: {'; '.join(blocked)}")
        return turn.issue(moves, "move", f"{head}; {why}")

    def _target(self, counts, fixed, movable, need_p, need_d, u_cur) -> tuple[dict | None, str]:
        """The split to move toward (None: keep the current one), and why."""
        cfg = self.config
        candidates = [{PREFILL: fixed[PREFILL] + ps, DECODE: fixed[DECODE] + movable - ps,
                       COLOCATED: fixed[COLOCATED]} for ps in range(movable + 1)]
        if cfg.allow_colocated:
            candidates.append({PREFILL: fixed[PREFILL], DECODE: fixed[DECODE],
                               COLOCATED: fixed[COLOCATED] + movable})
        candidates = [cand for cand in candidates if not violations(cand, 0, cfg)]

        def colocated(cand):
            return cand[COLOCATED] > fixed[COLOCATED]

        def best(options):
            return min(options, key=lambda cu: (sum(max(0, counts[r] - cu[0][r]) for r in ROLES),
                                                colocated(cu[0]), cu[1], -cu[0][PREFILL]))

        scored = [(cand, utilization(cand, need_p, need_d, cfg.colocated_efficiency))
                  for cand in candidates]
        fits = [(cand, u) for cand, u in scored if u <= cfg.target_utilization]
        disagg_fits = [(cand, u) for cand, u in fits if not colocated(cand)]
        cur_colocated = counts[COLOCATED] > fixed[COLOCATED]
        if not cur_colocated and u_cur <= cfg.keep_utilization:
            return None, f"keep: {fmt_u(u_cur)} <= {cfg.keep_utilization:.0%}"
        if cur_colocated and disagg_fits:
            target, u = best(disagg_fits)
            return target, f"back to disaggregated: {fmt_counts(target)} fits at {fmt_u(u)}"
        if cur_colocated and u_cur <= cfg.keep_utilization:
            return None, f"keep: {fmt_u(u_cur)} <= {cfg.keep_utilization:.0%}, no disaggregated split fits"
        if fits:
            target, u = best(disagg_fits or fits)
            return target, f"{fmt_counts(target)} fits at {fmt_u(u)}"
        if not scored:
            return None, ""
        lowest = min(u for _c, u in scored)
        if lowest < u_cur * (1 - cfg.min_gain):
            target, u = best([(cand, u) for cand, u in scored if u <= lowest * 1.0001])
            return target, f"nothing fits, overloaded: {fmt_counts(target)} is the least busy at {fmt_u(u)}"
        return None, f"overloaded: no split does better than {fmt_u(lowest)}; add workers"


__all__ = ["Predictive", "utilization"]
