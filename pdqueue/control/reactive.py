"""The reactive policy (Dynamo's "SLO breaches and backlog, one step at a time").

A side counts as short (``signals.shortages``) only after ``confirm`` consecutive
observations say so (the streaks restart after each move or settled move). Then:
- prefill short -> one decode -> prefill, if decode can spare one: at least two decode
  workers, fewer handoffs queued than decode workers, KV under ``kv_high``, and the TBT p90
  projected with one decode worker fewer (the step-time model: each remaining worker takes
  its share of the running sequences) at most ``donor_headroom`` x SLO;
- decode short -> one prefill -> decode, if prefill can spare one: at least two
  prefill-capable workers, fewer requests queued than those, and the TTFT p90 scaled by
  k/(k-1) at most ``donor_headroom`` x SLO;
- both short -> hold ("overloaded: add workers"); neither -> hold.
The asymmetry is the hysteresis: a side gets a worker at the SLO but gives one only when its
projected p90 stays at 70 % of it, so borderline observations cannot flip a worker back and
forth, and ``confirm`` filters single noisy windows.

Colocated. A single prefill worker can saturate on long prompts while the only decode worker
idles; a small cluster then does better all-colocated (docs/performance-history.md, "The
planner's colocated rules"). So when prefill is short, the last decode worker cannot be spared,
decode is within its SLO with nothing queued, and the cluster has at most
``colocated_max_workers`` workers, the planner goes all-colocated, unless a decode worker takes
placed prompts (``--take-prompts``): its spare time already prefills, and going all-colocated
there loses goodput against the fixed split (docs/performance-history.md, "prompt placement,
the elastic split against the fixed ones"). When colocated workers break TBT (a prefill-first
engine stalls its decodes for whole prompts) it goes back: with no decode worker, and if TTFT
holds with one prefill-capable worker fewer, one colocated worker -> decode and the others ->
prefill; with a decode worker that has nothing queued, the colocated workers -> prefill; with
busy decode workers, one colocated worker -> decode. Transitions of several moves are made one
move per decision, in the only order that keeps the hard rules (1P+1D -> 1C+1D -> 2C; 2C ->
1C+1D -> 1P+1D); a transition pauses while the opposite side is short and is abandoned once
that is confirmed.
"""

from __future__ import annotations

from pdqueue.control.decision import Decision, PlannerConfig
from pdqueue.control.observation import COLOCATED, DECODE, PREFILL, ROLES
from pdqueue.control.signals import Signals, fmt_counts, fmt_ms
from pdqueue.control.turn import Turn


class Reactive:
    def __init__(self, config: PlannerConfig):
        self.config = config
        self.route: tuple[dict, str, str] | None = None    # (target counts, direction, why)

    def decide(self, turn: Turn, short_p: list[str], short_d: list[str]) -> Decision:
        hot_p, hot_d = turn.confirmed(PREFILL), turn.confirmed(DECODE)
        if self.route is not None:
            decision = self._follow_route(turn, short_p, short_d, hot_p, hot_d)
            if decision is not None:
                return decision
        if hot_p and hot_d:
            return turn.hold(f"overloaded: prefill short ({'; '.join(short_p)}) and decode short "
                             f"({'; '.join(short_d)}); no split helps, add workers")
        if hot_p:
            return self._prefill_short(turn, "; ".join(short_p))
        if hot_d:
            return self._decode_short(turn, "; ".join(short_d))
        return self._healthy(turn, short_p, short_d)

    # ---- a transition of several moves -------------------------------------------------
    def _follow_route(self, turn: Turn, short_p, short_d, hot_p, hot_d) -> Decision | None:
        """The next step of the transition in progress, or None once it is over."""
        target, direction, why = self.route
        counts = turn.counts
        against_hot = hot_d if direction == PREFILL else hot_p
        against = short_d if direction == PREFILL else short_p
        if counts == target:
            self.route = None
            return None
        if against_hot:
            turn.note(f"abandoned the transition to {fmt_counts(target)}: {'; '.join(against)}")
            self.route = None
            return None
        head = f"{fmt_counts(counts)} -> {fmt_counts(target)} ({why})"
        if against:
            return turn.hold(f"pausing {head}: {'; '.join(against)}; {turn.summary}")
        head = f"continuing {head}; {turn.summary}"
        return turn.step(target, head, f"{head}; blocked: ")

    def _start_route(self, turn: Turn, target: dict, direction: str, why: str) -> Decision:
        moves, blocked = turn.plan(target, 1)
        head = f"{why}; {fmt_counts(turn.counts)} -> {fmt_counts(target)}"
        if not moves:
            return turn.hold(f"{head} blocked: {'; '.join(blocked)}")
        if sum(abs(target[r] - turn.counts[r]) for r in ROLES) > 2:   # more than this one move
            self.route = (dict(target), direction, why.split(";")[0])
        return turn.issue(moves, "move", head)

    # ---- prefill short -------------------------------------------------------------------
    def _prefill_short(self, turn: Turn, why: str) -> Decision:
        p, d, c = (turn.counts[r] for r in ROLES)
        ok, spare = self._decode_spare(turn)
        if ok:
            return turn.step({PREFILL: p + 1, DECODE: d - 1, COLOCATED: c},
                             f"prefill short: {why}; decode can spare one: {spare}",
                             f"prefill short: {why}; but ")
        route = self._colocated_route(turn, d)
        if route is not None:
            target, detail = route
            return self._start_route(turn, target, PREFILL, f"prefill short: {why}; {spare}, {detail}")
        return turn.hold(f"prefill short: {why}; but decode cannot spare one: {spare}")

    def _decode_spare(self, turn: Turn) -> tuple[bool, str]:
        """Can decode give a worker to prefill? (ok, the numbers)"""
        cfg, m = self.config, turn.m
        d = m.counts[DECODE]
        if d - 1 < max(1, cfg.min_decode):
            return False, f"only {d} decode worker(s)"
        if m.queued_handoffs >= d:
            return False, f"{m.queued_handoffs} handoffs queued for {d} decode workers"
        if m.decode_kv_used is not None and m.decode_kv_used >= cfg.kv_high:
            return False, f"decode KV {m.decode_kv_used:.0%} used"
        cap = turn.capacity
        if m.tbt_samples >= cfg.min_completions and m.tbt_p90_ms is not None:
            now_tbt, label = m.tbt_p90_ms, "TBT p90"
        else:
            now_tbt, label = cap.step_ms(m.decode_running / d), "predicted step"
        projected = now_tbt + cap.decode_per_seq_ms * m.decode_running * (1 / (d - 1) - 1 / d)
        limit = cfg.donor_headroom * cfg.tbt_slo_ms
        text = (f"decode {label} {now_tbt:.0f} ms -> {projected:.0f} ms projected with "
                f"{d - 1} decode worker(s), {m.decode_running} running (limit {limit:.0f} ms)")
        return projected <= limit, text

    def _colocated_route(self, turn: Turn, d: int) -> tuple[dict, str] | None:
        """All-colocated target when the last decode worker cannot be spared, decode has
        headroom and the cluster is small enough; else None."""
        cfg, m, counts = self.config, turn.m, turn.counts
        total = sum(counts.values())
        if not cfg.allow_colocated or total > cfg.colocated_max_workers or counts[COLOCATED] == total:
            return None
        if d - 1 >= max(1, cfg.min_decode):      # decode could spare one but its SLO forbids
            return None
        if cfg.min_prefill or cfg.min_decode:
            return None
        if any(not w.switchable for w in turn.obs.workers if w.role in (PREFILL, DECODE)):
            return None
        if any(w.takes_prompts for w in turn.obs.workers if w.role == DECODE):
            return None      # placement gives the decode worker's spare time to prompts already
        if m.queued_handoffs >= max(1, d) or turn.streak(DECODE) or m.tbt_breach(cfg):
            return None
        tbt = fmt_ms(m.tbt_p90_ms if m.tbt_samples else None)
        return ({PREFILL: 0, DECODE: 0, COLOCATED: total},
                f"decode within its SLO (TBT p90 {tbt} <= {cfg.tbt_slo_ms:.0f} ms, "
                f"{m.queued_handoffs} handoffs queued), {total} workers: all colocated")

    # ---- decode short --------------------------------------------------------------------
    def _decode_short(self, turn: Turn, why: str) -> Decision:
        p, d, c = (turn.counts[r] for r in ROLES)
        switch = [w for w in turn.obs.workers if w.role == COLOCATED and w.switchable]
        if switch:
            decision = self._colocated_to_decode(turn, why, len(switch))
            if decision is not None:
                return decision
        ok, spare = self._prefill_spare(turn.m, PREFILL)
        if ok and p >= 1:
            return turn.step({PREFILL: p - 1, DECODE: d + 1, COLOCATED: c},
                             f"decode short: {why}; prefill can spare one: {spare}",
                             f"decode short: {why}; but ")
        return turn.hold(f"decode short: {why}; but prefill cannot spare one: {spare}")

    def _colocated_to_decode(self, turn: Turn, why: str, s: int) -> Decision | None:
        """Decode short with ``s`` switchable colocated workers: back toward disaggregated;
        None when no colocated worker can give (the plain prefill rule decides)."""
        cfg, m = self.config, turn.m
        p, d, c = (turn.counts[r] for r in ROLES)
        kv_ok = m.decode_kv_used is None or m.decode_kv_used < cfg.kv_high
        if cfg.elastic:
            return self._elastic_to_decode(turn, why)
        if d >= 1 and m.queued_handoffs < d and kv_ok:
            # colocated workers stall their own decodes: they turn prefill and the decode
            # workers (nothing queued for them) take their sequences; the prefill-capable
            # count stays
            return self._start_route(turn, {PREFILL: p + s, DECODE: d, COLOCATED: c - s}, DECODE,
                                     f"decode short: {why}; back to disaggregated, "
                                     f"{m.queued_handoffs} handoffs queued for {d} decode worker(s)")
        if d >= 1:
            # the decode workers are busy too: one colocated worker joins them
            return self._start_route(turn, {PREFILL: p, DECODE: d + 1, COLOCATED: c - 1}, DECODE,
                                     f"decode short: {why}; {m.queued_handoffs} handoffs "
                                     f"queued for {d} decode worker(s)")
        if p + c < 2:
            return None
        ok, spare = self._prefill_spare(m, COLOCATED)
        if not ok:
            return turn.hold(f"decode short: {why}; but prefill cannot spare one: {spare}")
        return self._start_route(turn, {PREFILL: p + s - 1, DECODE: d + 1, COLOCATED: c - s}, DECODE,
                                 f"decode short: {why}; back to disaggregated, "
                                 f"prefill can spare one: {spare}")

    def _elastic_to_decode(self, turn: Turn, why: str) -> Decision | None:
        """Elastic: colocated workers keep both kinds of work by budget, and their running
        decodes move to decode workers; so decode short means one more decode worker when
        there is none or those there are busy, else a hold while migrations act."""
        cfg, m = self.config, turn.m
        p, d, c = (turn.counts[r] for r in ROLES)
        if d >= 1 and m.queued_handoffs < d and (m.decode_kv_used is None or m.decode_kv_used < cfg.kv_high):
            return turn.hold(f"decode short: {why}; {d} decode worker(s) with room: migrations and "
                             f"budgets act first")
        if p + c < 2:
            return None
        ok, spare = self._prefill_spare(m, COLOCATED)
        if not ok:
            return turn.hold(f"decode short: {why}; but prefill cannot spare one: {spare}")
        return self._start_route(turn, {PREFILL: p, DECODE: d + 1, COLOCATED: c - 1}, DECODE,
                                 f"decode short: {why}; one colocated worker decodes, "
                                 f"prefill can spare one: {spare}")

    def _prefill_spare(self, m: Signals, giver: str) -> tuple[bool, str]:
        """Can the prefill-capable side (prefill + colocated) lose one ``giver`` worker?"""
        cfg = self.config
        k = m.counts[PREFILL] + m.counts[COLOCATED]
        least = cfg.min_prefill if giver == PREFILL else cfg.min_colocated
        if k < 2 or m.counts[giver] - 1 < least:
            return False, f"only {k} prefill-capable worker(s)"
        if m.queued_requests >= k:
            return False, f"{m.queued_requests} requests queued for {k} prefill-capable workers"
        limit = cfg.donor_headroom * cfg.ttft_slo_ms
        if m.measured < cfg.min_completions or m.ttft_p90_ms is None:
            return True, f"TTFT not measured, {m.queued_requests} requests queued"
        projected = m.ttft_p90_ms * k / (k - 1)
        return projected <= limit, (f"TTFT p90 {m.ttft_p90_ms:.0f} ms -> {projected:.0f} ms "
                                    f"projected with {k - 1} prefill-capable worker(s) "
                                    f"(limit {limit:.0f} ms)")

    # ---- nothing confirmed ---------------------------------------------------------------
    def _healthy(self, turn: Turn, short_p: list[str], short_d: list[str]) -> Decision:
        cfg, m = self.config, turn.m
        pending = []
        if short_p:
            pending.append(f"prefill short {turn.streak(PREFILL)}/{cfg.confirm} ({'; '.join(short_p)})")
        if short_d:
            pending.append(f"decode short {turn.streak(DECODE)}/{cfg.confirm} ({'; '.join(short_d)})")
        state = "not yet confirmed: " + ", ".join(pending) if pending else "healthy"
        if m.measured < cfg.min_completions and m.completions:
            state += (f" (percentiles not judged: {m.measured} < {cfg.min_completions} "
                      f"completions since the last role change)")
        return turn.hold(f"hold {fmt_counts(turn.counts)}, {state}: {turn.summary}")


__all__ = ["Reactive"]
