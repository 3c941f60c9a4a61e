"""The planner (pdqueue/control/planner.py) on recorded observations, and its Redis reader
(pdqueue/control/observe.py) against a real server.

The recorded phases are literal data shaped after the serve bench on 2 cores with SmolLM2
(docs/performance.md): chat-heavy (healthy), document-heavy (the single prefill worker
saturates: TTFT p90 above a 4 s SLO, decode well within 250 ms), colocated with decode
stalls (TBT p90 282 ms, TTFT p90 1357 ms), idle, and a burst (the request queue jumps
before any completion shows it).
"""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys

import pytest

from pdqueue.control.observe import observe
from pdqueue.control.planner import (
    COLOCATED,
    DECODE,
    PREFILL,
    Capacity,
    CompletionObs,
    Decision,
    Move,
    Observation,
    Planner,
    PlannerConfig,
    WorkerObs,
    percentile,
    violations,
)
from pdqueue.keys import DECODE_GROUP, PREFILL_GROUP, Keys
from pdqueue.protocol import Completion, FinishReason, ServiceClass, done_entry
from pdqueue.queue.registry import Heartbeat

T0 = 10_000.0
# The settings the recorded phases below were shaped for: their completions span 60 s
# (PlannerConfig's own defaults, those of `up --adapt` and `plan`, look back 30 s).
RECORDED = dict(window_s=60.0, min_dwell_s=60.0, cooldown_s=20.0, move_timeout_s=60.0)


def recorded(**kw) -> PlannerConfig:
    return PlannerConfig(**{**RECORDED, **kw})


# ---- recorded phases ---------------------------------------------------------------------
# (finish offset s, ttft_ms, tbt_p50_ms, tbt_max_ms, prompt tokens, output tokens, prefill_ms)

CHAT = [  # 25 % documents at 0.5 req/s: everything within the SLOs
    (-56, 310, 92, 140, 40, 32, 150),
    (-50, 290, 95, 150, 24, 18, 95),
    (-44, 520, 110, 180, 380, 12, 1500),
    (-38, 305, 100, 160, 55, 44, 210),
    (-31, 270, 90, 130, 18, 20, 70),
    (-25, 330, 98, 170, 62, 40, 240),
    (-19, 2100, 120, 210, 470, 9, 1900),
    (-12, 300, 105, 150, 33, 28, 130),
    (-6, 280, 96, 140, 41, 36, 160),
    (-2, 310, 101, 160, 29, 25, 115),
]  # TTFT p90 520 ms, TBT p90 110 ms

DOCS = [  # 50 % documents at 1 req/s, 1 prefill + decode: prefill saturated
    (-57, 2600, 150, 190, 420, 12, 2000),
    (-52, 3100, 160, 230, 36, 30, 180),
    (-47, 4900, 155, 200, 500, 10, 2300),
    (-41, 5144, 165, 200, 470, 14, 2200),
    (-36, 2137, 150, 240, 48, 40, 220),
    (-30, 6551, 170, 201, 390, 9, 1800),
    (-24, 4400, 160, 270, 30, 22, 140),
    (-18, 5200, 158, 250, 450, 16, 2100),
    (-11, 3900, 162, 280, 60, 35, 270),
    (-4, 5600, 168, 300, 510, 11, 2400),
]  # TTFT p90 5600 ms, TBT p90 ~200 ms

DOCS_FAST_DECODE = [(o, ttft, p50 * 0.7, mx * 0.5, pt, ot, pf) for o, ttft, p50, mx, pt, ot, pf in DOCS]

COLO_STALLS = [  # 2 colocated, 25 % documents at 2 req/s: TBT p90 breaks, TTFT fine
    (-50, 330, 140, 2000, 40, 30, 200),
    (-45, 1357, 282, 1900, 420, 12, 1300),
    (-40, 360, 150, 2100, 35, 28, 180),
    (-35, 1200, 290, 1700, 380, 10, 1150),
    (-30, 340, 145, 300, 50, 36, 210),
    (-25, 900, 300, 2200, 460, 14, 1400),
    (-20, 350, 282, 2600, 38, 25, 190),
    (-15, 1100, 285, 1800, 400, 11, 1250),
    (-10, 330, 290, 2300, 45, 40, 200),
    (-5, 358, 282, 1500, 30, 20, 170),
]  # TTFT p90 1200 ms, TBT p90 >= 282 ms

BORDER_TTFT = [(o, ttft * 4100 / 5600, 150, 190, pt, ot, pf) for o, ttft, _a, _b, pt, ot, pf in DOCS]
BORDER_TBT = [(o, min(ttft, 2900), 262, 262, pt, max(ot, 12), pf) for o, ttft, _a, _b, pt, ot, pf in DOCS]


def completions(rows, t, *, local=False, decode_worker="") -> tuple[CompletionObs, ...]:
    out = []
    for i, (off, ttft, p50, mx, pt, ot, pf) in enumerate(rows):
        e2e = ttft + p50 * max(0, ot - 1)
        out.append(CompletionObs(
            finish_time=t + off, ttft_ms=ttft, tbt_p50_ms=p50, tbt_max_ms=mx,
            num_prompt_tokens=pt, num_output_tokens=ot, prefill_ms=pf, e2e_ms=e2e,
            decode_ms=e2e - ttft, transfer_path="local" if local else "shm",
            decode_worker=decode_worker, finish_reason="length", request_id=f"r{int(t)}-{i}"))
    return tuple(out)


def worker(wid, role, epoch=0, switchable=True, **load) -> WorkerObs:
    return WorkerObs(worker_id=wid, role=role, role_epoch=epoch, switchable=switchable,
                     incarnation=f"inc-{wid}", **load)


def obs(t, workers, rows=(), *, request_lag=0, request_pending=0, handoff_lag=0,
        handoff_pending=0, local=False, fresh=False) -> Observation:
    """``fresh``: the same completions squeezed into the last 0.6 s (finished after a role
    change one observation ago; the planner's percentiles only use those)."""
    if fresh:
        rows = [(off / 100, *rest) for off, *rest in rows]
    return Observation(time=t, workers=tuple(workers), request_lag=request_lag,
                       request_pending=request_pending, handoff_lag=handoff_lag,
                       handoff_pending=handoff_pending, completions=completions(rows, t, local=local))


def four(roles=(PREFILL, DECODE, DECODE, DECODE), epochs=(0, 0, 0, 0), running=(1, 1, 1, 1)):
    return [worker(f"w{i}", r, e, running=n) for i, (r, e, n) in enumerate(zip(roles, epochs, running))]


def apply(workers, moves):
    """The workers after the moves took effect (the epoch bumps, as a worker would)."""
    by = {m.worker_id: m for m in moves}
    out = []
    for w in workers:
        m = by.get(w.worker_id)
        if m is None:
            out.append(w)
        else:
            assert w.role == m.from_role and w.role_epoch == m.expected_epoch
            out.append(WorkerObs(w.worker_id, m.to_role, w.role_epoch + 1, w.switchable,
                                 incarnation=w.incarnation, node=w.node))
    return out


# ---- the recorded data says what it should ------------------------------------------------

def test_recorded_phases_have_the_intended_percentiles():
    def p90s(rows):
        cs = completions(rows, T0)
        return percentile([c.ttft_ms for c in cs], 90), percentile([c.tbt_ms for c in cs], 90)
    assert p90s(CHAT) == (520, 110)
    ttft, tbt = p90s(DOCS)
    assert ttft == 5600 and 190 <= tbt <= 250
    ttft, tbt = p90s(COLO_STALLS)
    assert ttft <= 1400 and tbt > 250
    assert p90s(BORDER_TTFT)[0] == pytest.approx(4100)


@pytest.mark.processes
def test_planner_imports_only_the_standard_library():
    code = ("import sys, pdqueue.control.planner; bad = [m for m in ('redis', 'torch', 'numpy', 'msgpack') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_config_is_validated():
    with pytest.raises(ValueError):
        PlannerConfig(mode="psychic")
    with pytest.raises(ValueError):
        PlannerConfig(target_utilization=0.9, keep_utilization=0.8)
    with pytest.raises(ValueError):
        PlannerConfig(confirm=0)


# ---- reactive ------------------------------------------------------------------------------

def test_chat_phase_holds_and_says_why():
    planner = Planner(recorded())
    ws = four((PREFILL, PREFILL, DECODE, DECODE))
    for i in range(5):
        d = planner.decide(obs(T0 + 10 * i, ws, CHAT))
        assert d.moves == () and d.action == "hold"
        assert d.counts == {PREFILL: 2, DECODE: 2, COLOCATED: 0}
    assert "healthy" in d.reason and "TTFT p90 520 ms" in d.reason and "TBT p90 110 ms" in d.reason
    assert d.signals["ttft_p90_ms"] == 520 and d.signals["tbt_p90_ms"] == 110


def test_document_phase_moves_one_decode_worker_to_prefill_after_confirmation():
    planner = Planner(recorded())
    ws = four(epochs=(0, 3, 5, 7), running=(1, 2, 0, 1))
    first = planner.decide(obs(T0, ws, DOCS_FAST_DECODE, request_lag=6))
    assert first.moves == () and "not yet confirmed" in first.reason and "1/2" in first.reason
    d = planner.decide(obs(T0 + 5, ws, DOCS_FAST_DECODE, request_lag=7))
    assert d.action == "move" and len(d.moves) == 1
    # the least busy decode worker, with the epoch it reported
    assert d.moves[0] == Move("w2", DECODE, PREFILL, 5)
    assert d.counts == {PREFILL: 2, DECODE: 2, COLOCATED: 0}
    # the reason names the numbers that decided
    assert "TTFT p90 5600 ms > 4000 ms SLO" in d.reason
    assert "7 requests queued" in d.reason
    assert "projected with 2 decode worker(s)" in d.reason and "limit 175 ms" in d.reason
    assert "w2 decode -> prefill (epoch 5)" in d.reason


def test_prefill_short_but_decode_cannot_spare_holds_with_reason():
    planner = Planner(recorded())
    ws = four((PREFILL, DECODE, DECODE, PREFILL), running=(1, 12, 12, 1))
    for i in range(3):
        d = planner.decide(obs(T0 + 5 * i, ws, DOCS, request_lag=8))
    assert d.moves == ()
    assert "decode cannot spare one" in d.reason and "limit 175 ms" in d.reason


def test_decode_short_moves_prefill_to_decode_when_prefill_has_headroom():
    planner = Planner(recorded())
    ws = four((PREFILL, PREFILL, PREFILL, DECODE))
    rows = [(o, 500, 300, 300, pt, ot, pf) for o, _t, _a, _b, pt, ot, pf in CHAT]
    planner.decide(obs(T0, ws, rows, handoff_lag=2))
    d = planner.decide(obs(T0 + 5, ws, rows, handoff_lag=2))
    assert [(m.from_role, m.to_role) for m in d.moves] == [(PREFILL, DECODE)]
    assert "TBT p90 300 ms > 250 ms SLO" in d.reason
    assert "TTFT p90 500 ms -> 750 ms projected with 2 prefill-capable worker(s)" in d.reason


def test_both_sides_short_is_overload_not_a_move():
    planner = Planner(recorded())
    ws = four((PREFILL, PREFILL, DECODE, DECODE))
    rows = [(o, ttft, 300, 300, pt, ot, pf) for o, ttft, _a, _b, pt, ot, pf in DOCS]
    for i in range(4):
        d = planner.decide(obs(T0 + 5 * i, ws, rows, request_lag=10, handoff_lag=9))
        assert d.moves == ()
    assert d.reason.startswith("overloaded") and "add workers" in d.reason


def test_burst_is_seen_in_the_queue_before_any_completion():
    planner = Planner(recorded())
    ws = four((PREFILL, DECODE, DECODE, DECODE), running=(2, 0, 0, 0))
    d1 = planner.decide(obs(T0, ws, (), request_lag=12))
    assert d1.moves == ()
    d2 = planner.decide(obs(T0 + 3, ws, (), request_lag=30))
    assert [(m.from_role, m.to_role) for m in d2.moves] == [(DECODE, PREFILL)]
    assert "30 requests queued" in d2.reason and "was 12" in d2.reason
    assert "predicted step" in d2.reason  # no TBT measured yet: the step model decides


def test_shrinking_queue_is_not_pressure():
    planner = Planner(recorded())
    ws = four((PREFILL, DECODE, DECODE, DECODE))
    for i, lag in enumerate((30, 20, 12, 8)):
        d = planner.decide(obs(T0 + 3 * i, ws, (), request_lag=lag))
        assert d.moves == (), d.reason


def test_idle_holds_in_both_modes():
    for mode in ("reactive", "predictive"):
        planner = Planner(PlannerConfig(mode=mode))
        ws = four((PREFILL, DECODE, DECODE, DECODE), running=(0, 0, 0, 0))
        for i in range(4):
            d = planner.decide(obs(T0 + 10 * i, ws, ()))
            assert d.moves == () and d.action == "hold"
        assert ("idle" if mode == "predictive" else "healthy") in d.reason


def test_hysteresis_alternating_borderline_observations_do_not_flip_roles():
    """TTFT just over its SLO, then TBT just over its SLO, alternating: a streak never
    reaches ``confirm``; and even with confirm=1, giving a worker back needs the giver's
    projected p90 at 70 % of its SLO, which a borderline side does not have."""
    for confirm in (2, 1):
        planner = Planner(PlannerConfig(confirm=confirm, cooldown_s=0, min_dwell_s=0))
        ws = four((PREFILL, PREFILL, DECODE, DECODE), running=(1, 1, 4, 4))
        moves = []
        for i in range(20):
            rows = BORDER_TTFT if i % 2 == 0 else BORDER_TBT
            d = planner.decide(obs(T0 + 5 * i, ws, rows))
            moves += d.moves
            ws = apply(ws, d.moves)
        assert moves == [], [str(m) for m in moves]


def test_hysteresis_prefill_short_then_healthy_alternating_never_moves():
    planner = Planner(recorded())
    ws = four()
    for i in range(12):
        rows, lag = (DOCS_FAST_DECODE, 8) if i % 2 == 0 else (CHAT, 0)
        d = planner.decide(obs(T0 + 5 * i, ws, rows, request_lag=lag))
        assert d.moves == ()


def test_a_move_is_not_undone_by_the_next_borderline_window():
    """After decode -> prefill, decode's TBT creeps over the SLO while TTFT sits near its
    SLO: prefill cannot give the worker back (projection over the headroom)."""
    planner = Planner(PlannerConfig(cooldown_s=0, min_dwell_s=0))
    ws = four(running=(1, 1, 1, 1))
    planner.decide(obs(T0, ws, DOCS_FAST_DECODE, request_lag=8))
    d = planner.decide(obs(T0 + 5, ws, DOCS_FAST_DECODE, request_lag=8))
    assert len(d.moves) == 1
    ws = apply(ws, d.moves)
    for i in range(2, 10):
        d = planner.decide(obs(T0 + 5 * i, ws, BORDER_TBT))
        assert d.moves == (), d.reason
    assert "prefill cannot spare one" in d.reason


def test_a_window_full_of_the_old_splits_ttfts_does_not_move_again():
    planner = Planner(PlannerConfig(cooldown_s=10, min_dwell_s=0))
    ws = four()
    planner.decide(obs(T0, ws, DOCS_FAST_DECODE, request_lag=8))
    d = planner.decide(obs(T0 + 5, ws, DOCS_FAST_DECODE, request_lag=8))
    assert len(d.moves) == 1
    ws = apply(ws, d.moves)
    for i in range(6):        # the same slow TTFTs, all finished before the change
        d = planner.decide(obs(T0 + 20 + 5 * i, ws, DOCS_FAST_DECODE))
        assert d.moves == () and d.signals["measured"] < 5
    assert "percentiles not judged" in d.reason
    # new completions under the new split that still break the SLO do count
    planner.decide(obs(T0 + 60, ws, DOCS_FAST_DECODE, fresh=True))
    d = planner.decide(obs(T0 + 61, ws, DOCS_FAST_DECODE, fresh=True))
    assert len(d.moves) == 1 and "TTFT p90 5600 ms > 4000 ms SLO" in d.reason


# ---- dwell, cooldown, moves in flight, epochs ---------------------------------------------

def test_cooldown_blocks_the_next_move_and_holds_do_not_restart_it():
    planner = Planner(PlannerConfig(cooldown_s=30, min_dwell_s=0))
    ws = [worker(f"d{i}", DECODE, running=0) for i in range(4)] + [worker("p0", PREFILL)]
    planner.decide(obs(T0, ws, DOCS_FAST_DECODE, request_lag=8))
    d = planner.decide(obs(T0 + 1, ws, DOCS_FAST_DECODE, request_lag=8))
    assert len(d.moves) == 1
    ws = apply(ws, d.moves)
    for t in (T0 + 5, T0 + 15, T0 + 30):
        d = planner.decide(obs(t, ws, DOCS_FAST_DECODE, request_lag=9))
        assert d.moves == () and d.action == "cooldown"
        assert "cooldown" in d.reason and "< 30 s" in d.reason
    d = planner.decide(obs(T0 + 31.5, ws, DOCS_FAST_DECODE, request_lag=9))
    assert len(d.moves) == 1 and d.moves[0].from_role == DECODE


def test_dwell_protects_a_recently_switched_worker():
    planner = Planner(PlannerConfig(cooldown_s=0, min_dwell_s=60))
    # w1 is the only switchable decode worker besides w3, which is not switchable
    ws = [worker("w0", PREFILL), worker("w1", DECODE, epoch=2), worker("w2", DECODE, epoch=0),
          worker("w3", DECODE, switchable=False)]
    planner.decide(obs(T0, ws, CHAT))
    # someone else switched w2 (prefill -> decode): its epoch moved, the dwell starts now
    ws[2] = WorkerObs("w2", DECODE, 1, True, incarnation="inc-w2")
    planner.decide(obs(T0 + 1, ws, DOCS_FAST_DECODE, request_lag=8))
    assert planner.last_switch("w2") == T0 + 1
    d = planner.decide(obs(T0 + 2, ws, DOCS_FAST_DECODE, request_lag=8))
    assert [m.worker_id for m in d.moves] == ["w1"]          # not w2 (dwell), not w3
    ws = apply(ws, d.moves)
    # w1 is now prefill and dwelling; decode short: prefill has w0 (free) and w1 (dwell)
    rows = [(o, 400, 300, 300, pt, ot, pf) for o, _t, _a, _b, pt, ot, pf in CHAT]
    planner.decide(obs(T0 + 3, ws, rows, handoff_lag=1))      # the switch is seen here
    d = planner.decide(obs(T0 + 3.5, ws, rows, handoff_lag=1))
    assert d.moves == () and d.signals["measured"] == 0       # all finished before it
    planner.decide(obs(T0 + 4, ws, rows, handoff_lag=1, fresh=True))
    d = planner.decide(obs(T0 + 4.5, ws, rows, handoff_lag=1, fresh=True))
    assert [m.worker_id for m in d.moves] == ["w0"]
    ws = apply(ws, d.moves)
    # now every switchable worker is dwelling: nothing moves, and the reason says so
    rows2 = [(o, 400, 95, 95, pt, ot, pf) for o, _t, _a, _b, pt, ot, pf in CHAT]
    planner.decide(obs(T0 + 5, ws, (), request_lag=20))
    d = planner.decide(obs(T0 + 6, ws, rows2, request_lag=30))
    assert d.moves == () and "dwell" in d.reason
    # the dwell of w2 (switched at T0 + 1) ends after min_dwell_s; prefill is still short
    d = planner.decide(obs(T0 + 61.5, ws, rows2, request_lag=31))
    assert d.moves == (Move("w2", DECODE, PREFILL, 1),)


def test_dwell_from_a_reported_role_since():
    planner = Planner(PlannerConfig(cooldown_s=0, min_dwell_s=60))
    ws = [worker("w0", PREFILL), worker("w1", DECODE), WorkerObs(
        "w2", DECODE, 4, True, incarnation="x", role_since=T0 - 10)]
    planner.decide(obs(T0, ws, (), request_lag=20))
    d = planner.decide(obs(T0 + 1, ws, (), request_lag=30))
    assert [m.worker_id for m in d.moves] == ["w1"]


def test_move_in_flight_stale_epoch_and_timeout():
    cfg = PlannerConfig(cooldown_s=0, min_dwell_s=0, move_timeout_s=20)
    planner = Planner(cfg)
    ws = [worker("p", PREFILL, 0), worker("a", DECODE, 7, running=0), worker("b", DECODE, 9, running=3)]
    planner.decide(obs(T0, ws, (), request_lag=20))
    d = planner.decide(obs(T0 + 1, ws, (), request_lag=25))
    assert d.moves == (Move("a", DECODE, PREFILL, 7),)
    assert planner.pending == {"a": d.moves[0]}
    # not applied yet: the planner waits, counting the move as done
    d = planner.decide(obs(T0 + 5, ws, (), request_lag=30))
    assert d.action == "wait" and d.counts == {PREFILL: 2, DECODE: 1, COLOCATED: 0}
    assert "a decode -> prefill (epoch 7)" in d.reason
    # the worker refused it (say its epoch had moved on) and never applies it: forgotten
    d = planner.decide(obs(T0 + 22, ws, (), request_lag=0))
    assert planner.pending == {} and "not applied in 21 s: forgotten" in d.reason
    assert d.moves == () and d.counts == {PREFILL: 1, DECODE: 2, COLOCATED: 0}
    # meanwhile someone else switched b and back: a new move names the epoch b reports now
    ws = [ws[0], ws[1], WorkerObs("b", DECODE, 11, True, running=0, incarnation="inc-b")]
    ws[1] = WorkerObs("a", DECODE, 7, True, running=5, incarnation="inc-a")
    planner.decide(obs(T0 + 23, ws, (), request_lag=31))
    d = planner.decide(obs(T0 + 24, ws, (), request_lag=32))
    assert d.moves == (Move("b", DECODE, PREFILL, 11),)
    # applied: the worker reports the next epoch; the planner is free again
    ws = apply(ws, d.moves)
    d = planner.decide(obs(T0 + 25, ws, (), request_lag=0))
    assert planner.pending == {} and d.action == "hold"
    assert d.counts == {PREFILL: 2, DECODE: 1, COLOCATED: 0}


def test_move_refused_forgets_at_once_and_restart_drops_the_move():
    planner = Planner(PlannerConfig(cooldown_s=0, min_dwell_s=0))
    ws = [worker("p", PREFILL), worker("a", DECODE), worker("b", DECODE, running=2)]
    planner.decide(obs(T0, ws, (), request_lag=20))
    d = planner.decide(obs(T0 + 1, ws, (), request_lag=25))
    planner.move_refused(d.moves[0].worker_id)
    assert planner.pending == {}
    planner.decide(obs(T0 + 2, ws, (), request_lag=30))
    d = planner.decide(obs(T0 + 3, ws, (), request_lag=35))
    assert len(d.moves) == 1
    ws = [w if w.worker_id != d.moves[0].worker_id else
          WorkerObs(w.worker_id, DECODE, 0, True, incarnation="new") for w in ws]
    d = planner.decide(obs(T0 + 4, ws, (), request_lag=35))
    assert planner.pending == {} and "restarted" in d.reason


def test_only_switchable_workers_move():
    planner = Planner(PlannerConfig(cooldown_s=0))
    ws = [worker("p", PREFILL, switchable=False)] + [
        worker(f"d{i}", DECODE, switchable=False, running=0) for i in range(3)]
    for i in range(4):
        d = planner.decide(obs(T0 + i, ws, DOCS_FAST_DECODE, request_lag=10 + i))
        assert d.moves == ()
    assert "no switchable decode worker" in d.reason
    planner = Planner(PlannerConfig(mode="predictive"))
    d = planner.decide(obs(T0, ws, DOCS_FAST_DECODE, request_lag=10))
    assert d.moves == () and "no switchable worker" in d.reason


# ---- hard rules: repair, and a long randomized run -----------------------------------------

def test_repair_when_the_prefill_worker_died():
    planner = Planner(recorded())
    ws = [worker("d0", DECODE, 3, running=4), worker("d1", DECODE, 1, running=0)]
    d = planner.decide(obs(T0, ws, (), request_lag=5))
    assert d.action == "repair" and d.moves == (Move("d1", DECODE, PREFILL, 1),)
    assert "no prefill or colocated worker would read the requests" in d.reason


def test_repair_a_lone_decode_worker_waits_for_its_handoffs():
    planner = Planner(recorded())
    ws = [worker("d0", DECODE, running=2)]
    d = planner.decide(obs(T0, ws, (), request_lag=5, handoff_pending=2))
    assert d.moves == () and "cannot repair" in d.reason
    d = planner.decide(obs(T0 + 1, ws, (), request_lag=5))
    assert d.moves == (Move("d0", DECODE, COLOCATED, 0),)


def test_repair_prefill_without_decode():
    planner = Planner(PlannerConfig(min_decode=1))
    ws = [worker("p0", PREFILL, running=0), worker("p1", PREFILL, running=3)]
    d = planner.decide(obs(T0, ws, (), handoff_lag=3))
    assert d.moves == (Move("p0", PREFILL, DECODE, 0),)
    assert "prefill workers without a decode worker" in d.reason


def test_violations():
    assert violations({PREFILL: 1, DECODE: 1, COLOCATED: 0}, 0) == []
    assert violations({PREFILL: 0, DECODE: 0, COLOCATED: 2}, 0) == []
    assert violations({PREFILL: 0, DECODE: 1, COLOCATED: 1}, 5) == []
    assert violations({PREFILL: 0, DECODE: 0, COLOCATED: 2}, 1)  # handoffs, nobody to decode
    assert violations({PREFILL: 1, DECODE: 0, COLOCATED: 1}, 0)
    assert violations({PREFILL: 0, DECODE: 2, COLOCATED: 0}, 0)
    assert violations({PREFILL: 2, DECODE: 1, COLOCATED: 0}, 0,
                      PlannerConfig(min_decode=2)) == ["fewer than 2 decode worker(s)"]


LONG_ANSWERS = [(o, 250, 240, 400, pt // 4 + 8, 200, pf // 4 + 10) for o, _t, _a, _b, pt, _ot, pf in CHAT]

PHASES = {"long_answers": LONG_ANSWERS, "chat": CHAT, "docs": DOCS, "docs_fast": DOCS_FAST_DECODE,
          "stalls": COLO_STALLS, "border_ttft": BORDER_TTFT, "border_tbt": BORDER_TBT, "idle": (), "burst": ()}


@pytest.mark.parametrize("mode,n,seed", [(m, n, s) for m in ("reactive", "predictive")
                                         for n in (2, 3, 5) for s in (1, 2)])
def test_hard_rules_hold_over_a_long_random_run(mode, n, seed):
    """A simulated cluster applies moves late, refuses some, and flips between recorded
    phases; every decision is checked against the hard rules."""
    rng = random.Random(seed * 100 + n)
    cfg = PlannerConfig(mode=mode, cooldown_s=10, min_dwell_s=25, move_timeout_s=15)
    planner = Planner(cfg)
    roles = [PREFILL] + [DECODE] * (n - 1)
    cluster = {f"w{i}": {"role": r, "epoch": 0, "switchable": i != n - 1 or n == 2}
               for i, r in enumerate(roles)}
    held: dict[str, Move] = {}          # issued, not yet applied by the simulated worker
    issued_at: dict[str, float] = {}
    actions: dict[str, int] = {}
    switched_at: dict[str, float] = {}
    last_move = None
    phase, scale = "chat", 1
    moves_seen = 0
    for step in range(300):
        t = T0 + 2.5 * step
        if rng.random() < 0.08:
            phase = rng.choice(sorted(PHASES))
            scale = rng.choice((1, 3, 10, 30))       # the same mix at up to 30x the rate
        # the simulated workers apply (or refuse) what they were told
        for wid, mv in list(held.items()):
            # applied late, but before the planner's move_timeout_s (refusals are not held)
            if rng.random() < 0.5 or t - issued_at[wid] >= 10:
                w = cluster[wid]
                assert w["epoch"] == mv.expected_epoch
                w["role"], w["epoch"] = mv.to_role, w["epoch"] + 1
                switched_at[wid] = t
                del held[wid]
        counts = {r: sum(w["role"] == r for w in cluster.values()) for r in (PREFILL, DECODE, COLOCATED)}
        d_count = counts[DECODE]
        handoff = rng.choice((0, 0, 1, 5)) if counts[PREFILL] or (d_count and rng.random() < 0.3) else 0
        lag = {"burst": rng.randint(10, 60), "docs": rng.randint(3, 12), "idle": 0}.get(phase, rng.randint(0, 2))
        workers = [WorkerObs(wid, w["role"], w["epoch"], w["switchable"], running=rng.randint(0, 6),
                             waiting=rng.randint(0, 1), kv_free=rng.randint(0, 100), kv_total=100,
                             incarnation=f"inc-{wid}") for wid, w in cluster.items()]
        rows = [(off + k * 0.37, *rest) for k in range(scale) for off, *rest in PHASES[phase]]
        o = obs(t, workers, rows, request_lag=lag, handoff_lag=handoff, local=counts[COLOCATED] > 0)
        before_ok = not violations(counts, o.handoff_backlog, cfg)
        d = planner.decide(o)
        assert isinstance(d, Decision) and d.reason
        actions[d.action] = actions.get(d.action, 0) + 1
        if d.moves:
            moves_seen += 1
            assert last_move is None or t - last_move >= cfg.cooldown_s
            last_move = t
            assert not held, "a move while another is in flight"
            if mode == "reactive":
                assert len(d.moves) <= 1
            for mv in d.moves:
                w = cluster[mv.worker_id]
                assert w["switchable"], mv
                assert (w["role"], w["epoch"]) == (mv.from_role, mv.expected_epoch), mv
                assert t - switched_at.get(mv.worker_id, -1e9) >= cfg.min_dwell_s, mv
                switched_at[mv.worker_id] = t
            # every order in which the moves may complete keeps the hard rules
            for size in range(1, len(d.moves) + 1):
                for subset in itertools.combinations(d.moves, size):
                    after = dict(counts)
                    for mv in subset:
                        after[mv.from_role] -= 1
                        after[mv.to_role] += 1
                    if before_ok or size == len(d.moves):
                        assert not violations(after, o.handoff_backlog, cfg), (counts, d)
            for mv in d.moves:
                if rng.random() < 0.1:
                    continue    # refused (or lost): never applied; the planner forgets it
                held[mv.worker_id] = mv
                issued_at[mv.worker_id] = t
        assert sum(counts.values()) == n
    assert moves_seen >= 2 and actions.get("wait") and actions.get("cooldown"), actions


# ---- the colocated route (2 workers), as the measurements suggest ---------------------------

def test_two_workers_document_phase_goes_colocated_in_a_safe_order_and_comes_back():
    planner = Planner(PlannerConfig(cooldown_s=10, min_dwell_s=30))
    ws = [worker("p", PREFILL, 2, running=1), worker("d", DECODE, 4, running=2)]
    planner.decide(obs(T0, ws, DOCS, request_lag=6))
    d = planner.decide(obs(T0 + 5, ws, DOCS, request_lag=7))
    # decode cannot spare its only worker; TBT p90 within 250 ms: all colocated, and the
    # prefill worker goes first (the decode worker must stay while handoffs exist)
    assert d.moves == (Move("p", PREFILL, COLOCATED, 2),)
    assert "only 1 decode worker(s)" in d.reason and "all colocated" in d.reason
    assert d.counts == {PREFILL: 0, DECODE: 1, COLOCATED: 1}
    ws = apply(ws, d.moves)
    # handoffs still held by the decode worker: the transition waits
    d = planner.decide(obs(T0 + 16, ws, DOCS, request_lag=5, handoff_pending=2))
    assert d.moves == () and "continuing 0P+1D+1C -> 0P+0D+2C" in d.reason
    assert "2 handoffs without a decode worker" in d.reason
    d = planner.decide(obs(T0 + 17, ws, DOCS, request_lag=5))
    assert d.moves == (Move("d", DECODE, COLOCATED, 4),)
    ws = apply(ws, d.moves)
    # colocated, measured phase 2: TTFT fine, TBT p90 over 250 ms -> back to 1P+1D,
    # decode first (a prefill worker needs a decode worker)
    for i in range(10):
        d = planner.decide(obs(T0 + 30 + i, ws, CHAT, local=True))
        assert d.moves == ()
    planner.decide(obs(T0 + 60, ws, COLO_STALLS, local=True))
    d = planner.decide(obs(T0 + 61, ws, COLO_STALLS, local=True))
    assert len(d.moves) == 1 and d.moves[0].to_role == DECODE
    assert "TBT p90" in d.reason and "prefill can spare one" in d.reason
    ws = apply(ws, d.moves)
    d = planner.decide(obs(T0 + 75, ws, COLO_STALLS, local=True))
    assert len(d.moves) == 1 and (d.moves[0].from_role, d.moves[0].to_role) == (COLOCATED, PREFILL)
    ws = apply(ws, d.moves)
    assert sorted(w.role for w in ws) == [DECODE, PREFILL]


def test_two_workers_moderate_documents_stay_disaggregated():
    """25 % documents at 2 req/s measured TTFT p90 2.9 s within the 4 s SLO: stay 1P+1D."""
    planner = Planner(recorded())
    ws = [worker("p", PREFILL), worker("d", DECODE)]
    rows = [(o, min(ttft, 2900), p50, mx, pt, ot, pf) for o, ttft, p50, mx, pt, ot, pf in DOCS]
    for i in range(6):
        d = planner.decide(obs(T0 + 5 * i, ws, rows, request_lag=1))
        assert d.moves == ()


def test_colocated_route_is_abandoned_when_decode_becomes_short():
    planner = Planner(PlannerConfig(cooldown_s=0, min_dwell_s=0))
    ws = [worker("p", PREFILL), worker("d", DECODE)]
    planner.decide(obs(T0, ws, DOCS, request_lag=6))
    d = planner.decide(obs(T0 + 1, ws, DOCS, request_lag=7))
    ws = apply(ws, d.moves)
    assert sorted(w.role for w in ws) == [COLOCATED, DECODE]
    stalls = [(o, 1000, 320, 320, pt, ot, pf) for o, _t, _a, _b, pt, ot, pf in CHAT]
    d = planner.decide(obs(T0 + 2, ws, (), handoff_pending=1))   # decode still draining
    assert d.moves == () and "blocked" in d.reason
    d = planner.decide(obs(T0 + 3, ws, stalls, handoff_pending=1, fresh=True))
    assert d.moves == () and d.reason.startswith("pausing 0P+1D+1C -> 0P+0D+2C")
    d = planner.decide(obs(T0 + 4, ws, stalls, fresh=True))
    assert "abandoned the transition to 0P+0D+2C" in d.reason
    assert [(m.from_role, m.to_role) for m in d.moves] == [(COLOCATED, PREFILL)]


def test_no_colocated_route_in_bigger_clusters_or_when_disabled():
    for cfg, ws in ((PlannerConfig(), [worker("p0", PREFILL), worker("p1", PREFILL), worker("d", DECODE)]),
                    (PlannerConfig(allow_colocated=False), [worker("p", PREFILL), worker("d", DECODE)])):
        planner = Planner(cfg)
        for i in range(4):
            d = planner.decide(obs(T0 + i, ws, DOCS, request_lag=8))
            assert d.moves == ()
        assert "decode cannot spare one: only 1 decode worker(s)" in d.reason


def test_no_colocated_route_while_the_decode_worker_takes_placed_prompts():
    """Placement already gives the decode worker's spare time to prompts; the all-colocated
    route beside it lost goodput (docs/performance-history.md, "prompt placement, the elastic
    split against the fixed ones")."""
    planner = Planner(PlannerConfig(cooldown_s=10, min_dwell_s=30))
    ws = [worker("p", PREFILL, 2, running=1), worker("d", DECODE, 4, running=2, takes_prompts=True)]
    for i in range(4):
        d = planner.decide(obs(T0 + 5 * i, ws, DOCS, request_lag=8))
        assert d.moves == ()
    assert "decode cannot spare one: only 1 decode worker(s)" in d.reason
    # the same cluster whose decode worker takes none does go colocated (the rule above)
    planner = Planner(PlannerConfig(cooldown_s=10, min_dwell_s=30))
    ws = [worker("p", PREFILL, 2, running=1), worker("d", DECODE, 4, running=2)]
    planner.decide(obs(T0, ws, DOCS, request_lag=6))
    assert planner.decide(obs(T0 + 5, ws, DOCS, request_lag=7)).moves == (Move("p", PREFILL, COLOCATED, 2),)


# ---- predictive ----------------------------------------------------------------------------

def steady(t, prompt_tokens, output_tokens, prefill_ms=None, n=60, ttft=300, local=False):
    """n completions, one per second, over exactly the last 60 s: prompt and output tok/s
    are prompt_tokens * n / 60 and output_tokens * n / 60."""
    rows = []
    for i in range(n):
        off = -59 + i * 59 / max(1, n - 1)
        rows.append((off, ttft, 50, 50, prompt_tokens, output_tokens,
                     prompt_tokens if prefill_ms is None else prefill_ms))
    out = []
    for c in completions(rows, t, local=local):
        out.append(CompletionObs(**{**{f: getattr(c, f) for f in CompletionObs.__slots__},
                                    "e2e_ms": 1000.0 if c.finish_time == t - 59 else 500.0}))
    return tuple(out)


def pobs(t, workers, comps, **kw):
    return Observation(time=t, workers=tuple(workers), completions=comps, **kw)


PRED = dict(mode="predictive", prefill_tok_s_prior=1000, decode_base_ms_prior=20,
            decode_per_seq_ms_prior=5, tbt_slo_ms=100, cooldown_s=0, min_dwell_s=0, window_s=60.0)


def test_capacity_model():
    cap = Capacity(prefill_tok_s=1000, decode_base_ms=20, decode_per_seq_ms=5)
    assert cap.step_ms(12) == 80
    assert cap.decode_batch(80, 64) == 12 and cap.decode_batch(80, 8) == 8
    assert cap.decode_tok_s(80, 64) == pytest.approx(150)
    assert cap.decode_batch(10, 64) == 0 and cap.decode_tok_s(10, 64) == pytest.approx(40)


def test_predictive_counts_on_known_demand_and_capacity():
    """1200 prompt tok/s over 1000 tok/s per prefill worker, 105 output tok/s over 150 tok/s
    per decode worker (batch 12 at 80 ms = 0.8 x 100 ms): 1.2 + 0.7 workers at 100 %;
    1P+5D has u=1.2, 2P+4D fits (u=0.6) with one move."""
    planner = Planner(PlannerConfig(**PRED))
    ws = [worker("p0", PREFILL)] + [worker(f"d{i}", DECODE, running=i) for i in range(5)]
    d = planner.decide(pobs(T0, ws, steady(T0, 1200, 105)))
    assert planner.capacity.prefill_tok_s == pytest.approx(1000)
    assert d.signals["prompt_demand_tok_s"] == pytest.approx(1200)
    assert d.signals["output_demand_tok_s"] == pytest.approx(105)
    assert d.signals["decode_tok_s"] == pytest.approx(150)
    assert d.moves == (Move("d0", DECODE, PREFILL, 0),)
    assert d.counts == {PREFILL: 2, DECODE: 4, COLOCATED: 0}
    assert "1200 prompt tok/s + 105.0 output tok/s" in d.reason
    assert "1000 prefill tok/s and 150 decode tok/s per worker (batch 12 at 80 ms)" in d.reason
    assert "needs 1.71 prefill + 1.00 decode workers at 70%" in d.reason
    assert "current 1P+5D at u=1.20" in d.reason and "2P+4D fits at u=0.60" in d.reason


def test_predictive_keeps_a_split_inside_the_band_and_adds_queued_work():
    planner = Planner(PlannerConfig(**PRED))
    ws = [worker("p0", PREFILL), worker("p1", PREFILL)] + [worker(f"d{i}", DECODE) for i in range(2)]
    d = planner.decide(pobs(T0, ws, steady(T0, 1600, 105)))       # u = 0.8: inside the band
    assert d.moves == () and "keep: u=0.80 <= 85%" in d.reason
    # 15 requests queued x 1600 tokens / 30 s = +800 tok/s: u = 1.2 -> 3P+1D fits at 0.8? no:
    # it is 2400/3000 = 0.8 > 0.7, so nothing fits; 3P+1D is the least busy (u 0.8 < 1.2*0.9)
    d = planner.decide(pobs(T0 + 1, ws, steady(T0 + 1, 1600, 105), request_lag=15))
    assert d.signals["prompt_demand_tok_s"] == pytest.approx(2400)
    assert [(m.from_role, m.to_role) for m in d.moves] == [(DECODE, PREFILL)]
    assert "nothing fits, overloaded: 3P+1D" in d.reason


def test_predictive_two_workers_documents_go_colocated_two_decisions():
    """Prefill needs more than one worker but decode much less than one: disaggregation
    cannot fit 2 workers, colocated can. The decode worker may only follow once no
    prefill worker is left (the subset check), so it takes two decisions."""
    cfg = PlannerConfig(**PRED)
    planner = Planner(cfg)
    ws = [worker("p", PREFILL, 1), worker("d", DECODE, 1)]
    comps = steady(T0, 900, 10)          # need_p 0.9, need_d 10/150: 1P+1D u=0.9 > 0.85
    d = planner.decide(pobs(T0, ws, comps))
    assert d.moves == (Move("p", PREFILL, COLOCATED, 1),)
    assert "0P+0D+2C fits" in d.reason
    ws = apply(ws, d.moves)
    d = planner.decide(pobs(T0 + 1, ws, steady(T0 + 1, 900, 10, local=True)))
    assert d.moves == (Move("d", DECODE, COLOCATED, 1),)
    ws = apply(ws, d.moves)
    # load falls: a disaggregated split fits again (u <= 0.7), back to it, decode first
    d = planner.decide(pobs(T0 + 2, ws, steady(T0 + 2, 500, 10, local=True)))
    assert "back to disaggregated" in d.reason
    assert [(m.from_role, m.to_role) for m in d.moves] == [(COLOCATED, DECODE)]
    ws = apply(ws, d.moves)
    d = planner.decide(pobs(T0 + 3, ws, steady(T0 + 3, 500, 10, local=True)))
    assert [(m.from_role, m.to_role) for m in d.moves] == [(COLOCATED, PREFILL)]


def test_predictive_band_stops_colocated_flapping():
    cfg = PlannerConfig(**PRED)
    planner = Planner(cfg)
    ws = [worker("p", PREFILL), worker("d", DECODE)]
    # 1P+1D u = 0.8: kept (<= 0.85); 0.78 in colocated: kept (disagg would be 0.8 > 0.7)
    for i, tokens in enumerate((800, 780, 800, 790, 820, 800)):
        d = planner.decide(pobs(T0 + i, ws, steady(T0 + i, tokens, 10)))
        assert d.moves == ()


def test_predictive_uses_several_moves_per_decision_when_safe():
    planner = Planner(PlannerConfig(**PRED))
    ws = [worker("p0", PREFILL)] + [worker(f"d{i}", DECODE) for i in range(5)]
    d = planner.decide(pobs(T0, ws, steady(T0, 2500, 60)))   # need_p 2.5: 4P+2D
    assert len(d.moves) == 2 and all(m.to_role == PREFILL for m in d.moves)
    assert d.counts == {PREFILL: 3, DECODE: 3, COLOCATED: 0}


def test_capacity_is_learned_from_completions_and_heartbeats():
    planner = Planner(recorded(cooldown_s=1e9))
    # prefill: p90 of new completions' rates, the first sample replaces the prior
    ws = [worker("p", PREFILL), worker("d", DECODE)]
    planner.decide(obs(T0, ws, CHAT))
    rates = sorted(pt * 1000 / pf for _o, _t, _a, _b, pt, _ot, pf in CHAT if pt >= 16)
    assert planner.capacity.prefill_tok_s == pytest.approx(percentile(rates, 90))
    assert planner.capacity.prefill_samples == 1
    before = planner.capacity.prefill_tok_s
    planner.decide(obs(T0, ws, CHAT))               # the same completions: not counted twice
    assert planner.capacity.prefill_tok_s == before and planner.capacity.prefill_samples == 1
    # decode: step_ms at several batch sizes: base and per-sequence cost are fitted
    for i, b in enumerate((1, 4, 8, 16, 2, 12, 6, 10) * 3):
        ws = [worker("p", PREFILL), WorkerObs("d", DECODE, 0, True, running=b, step_ms=30 + 4 * b,
                                              incarnation="inc-d")]
        planner.decide(obs(T0 + 1 + i, ws))
    cap = planner.capacity
    assert cap.decode_base_ms == pytest.approx(30, abs=0.01)
    assert cap.decode_per_seq_ms == pytest.approx(4, abs=0.01)
    # one batch size only: the prior's shape, scaled to the data
    planner = Planner(PlannerConfig(decode_base_ms_prior=60, decode_per_seq_ms_prior=9))
    for i in range(5):
        ws = [worker("p", PREFILL), WorkerObs("d", DECODE, 0, True, running=4, step_ms=48,
                                              incarnation="inc-d")]
        planner.decide(obs(T0 + i, ws))
    assert planner.capacity.step_ms(4) == pytest.approx(48)
    assert planner.capacity.decode_base_ms / planner.capacity.decode_per_seq_ms == pytest.approx(60 / 9)


# ---- observe(): against a real Redis server -------------------------------------------------

def _done(r, keys, ms, rid, **kw):
    c = Completion(request_id=rid, text="x", token_ids=tuple(range(kw.pop("n", 5))),
                   finish_reason=FinishReason.LENGTH, **kw)
    r.xadd(keys.done, done_entry(c), id=f"{ms}-0")


def test_observe_reads_a_real_cluster(r):
    keys = Keys("plan")
    now_ms = 1_700_000_100_000
    hb = Heartbeat(r, keys, "pre-1", role=PREFILL, node="nodeA",
                   load={"running": 2, "waiting": 3, "kv_free": 30, "kv_total": 120})
    hb.update(role_epoch=4, switchable=True, role_since_ms=now_ms - 90_000)
    hb.beat()
    dec = Heartbeat(r, keys, "dec-1", role=DECODE, node="nodeA",
                    load={"running": 5, "waiting": 1, "backlog": 2, "fetching": 1,
                          "kv_free": 10, "kv_total": 100, "step_ms": 42.5})
    dec.beat()
    # a worker written by plain HSET, with the epoch as a top-level field, on another node
    r.hset(keys.worker("dec-2"), mapping={
        "role": DECODE, "node": "nodeB", "incarnation": "abc", "endpoints": "{}",
        "load": json.dumps({"running": 0}), "model": "m", "pid": "1", "host": "h",
        "started_ms": str(now_ms), "beat_ms": str(now_ms - 1500), "role_epoch": "7",
        "switchable": "true"})
    # requests: 5 in the normal stream, 2 read (pending), 3 undelivered; 2 high, no group yet
    for i in range(5):
        r.xadd(keys.requests, {"id": f"q{i}"})
    r.xgroup_create(keys.requests, PREFILL_GROUP, id="0")
    r.xreadgroup(PREFILL_GROUP, "pre-1", {keys.requests: ">"}, count=2)
    for i in range(2):
        r.xadd(keys.request_stream_for(ServiceClass.INTERACTIVE), {"id": f"h{i}"})
    # handoffs: 1 pending + 1 lag on nodeA's stream, 2 lag on the global one, none on nodeB
    for i in range(2):
        r.xadd(keys.handoff_node("nodeA"), {"h": str(i)})
    r.xgroup_create(keys.handoff_node("nodeA"), DECODE_GROUP, id="0")
    r.xreadgroup(DECODE_GROUP, "dec-1", {keys.handoff_node("nodeA"): ">"}, count=1)
    r.xgroup_create(keys.handoff, DECODE_GROUP, id="0", mkstream=True)
    for i in range(2):
        r.xadd(keys.handoff, {"h": str(i)})
    # done: two in the window, one too old, one malformed, one after "now"
    _done(r, keys, now_ms - 120_000, "old", ttft_ms=1, n=3)
    _done(r, keys, now_ms - 20_000, "a", num_prompt_tokens=300, ttft_ms=950.5, prefill_ms=800,
          tbt_p50_ms=40, tbt_max_ms=90, e2e_ms=1400, decode_ms=400, queue_ms=12,
          decode_worker="dec-1", prefill_worker="pre-1", transfer_path="shm", n=12)
    r.xadd(keys.done, {"type": "done", "finish_reason": "nonsense"}, id=f"{now_ms - 15_000}-0")
    _done(r, keys, now_ms - 5_000, "b", num_prompt_tokens=20, ttft_ms=120, n=3,
          transfer_path="local")
    _done(r, keys, now_ms + 5_000, "future", ttft_ms=1)

    o = observe(r, keys, now=now_ms / 1000, window_s=60)

    assert o.time == now_ms / 1000 and o.window_s == 60
    by = {w.worker_id: w for w in o.workers}
    assert sorted(by) == ["dec-1", "dec-2", "pre-1"]
    p = by["pre-1"]
    assert (p.role, p.role_epoch, p.switchable, p.running, p.waiting) == (PREFILL, 4, True, 2, 3)
    assert p.kv_used_frac == pytest.approx(0.75) and p.node == "nodeA"
    assert p.role_since == pytest.approx(now_ms / 1000 - 90) and p.incarnation == hb.incarnation
    d1 = by["dec-1"]
    assert (d1.role_epoch, d1.switchable) == (0, False)      # missing: epoch 0, not switchable
    assert (d1.running, d1.waiting, d1.backlog, d1.fetching, d1.step_ms) == (5, 1, 2, 1, 42.5)
    d2 = by["dec-2"]
    assert (d2.role_epoch, d2.switchable, d2.node) == (7, True, "nodeB")
    assert d2.beat_age_s == pytest.approx(1.5) and d2.kv_used_frac is None
    assert (o.request_lag, o.request_pending) == (3 + 2, 2)
    assert (o.handoff_lag, o.handoff_pending) == (1 + 2, 1)
    assert o.queued_requests == 5 + 3                          # lag + prefill engine waiting
    assert o.queued_handoffs == 3 + 2 + 1                      # lag + decode backlog + waiting
    assert [c.request_id for c in o.completions] == ["a", "b"]
    a = o.completions[0]
    assert a.finish_time == pytest.approx(now_ms / 1000 - 20)
    assert (a.ttft_ms, a.tbt_p50_ms, a.tbt_max_ms, a.num_prompt_tokens, a.num_output_tokens) == \
        (950.5, 40, 90, 300, 12)
    assert (a.prefill_ms, a.e2e_ms, a.decode_ms, a.queue_ms) == (800, 1400, 400, 12)
    assert (a.decode_worker, a.prefill_worker, a.transfer_path, a.finish_reason) == \
        ("dec-1", "pre-1", "shm", "length")
    assert o.completions[1].transfer_path == "local"

    # without ``now``: the server's clock; the planner takes the observation as it is
    o2 = observe(r, keys)
    assert abs(o2.time - __import__("time").time()) < 60
    decision = Planner(recorded()).decide(o)
    assert decision.counts == {PREFILL: 1, DECODE: 2, COLOCATED: 0}


def test_observe_an_empty_cluster(r):
    o = observe(r, Keys("nothing"), now=1_700_000_000.0)
    assert o.workers == () and o.completions == ()
    assert (o.request_lag, o.request_pending, o.handoff_lag, o.handoff_pending) == (0, 0, 0, 0)
    d = Planner(recorded()).decide(o)
    assert d.moves == () and d.counts == {PREFILL: 0, DECODE: 0, COLOCATED: 0}


def test_the_cli_takes_the_planners_defaults_from_planner_config():
    """`up --adapt` and `plan` show and use PlannerConfig's defaults (the one place they are
    written): the options' defaults are its fields, and a config built from them is its own."""
    import click

    from workers.cli.common import planner_config, planner_options

    command = planner_options(click.Command("x", callback=lambda **kw: kw))
    defaults = {p.name: p.default for p in command.params if p.name != "elastic"}
    d = PlannerConfig()
    assert (d.window_s, d.min_dwell_s, d.cooldown_s, d.move_timeout_s) == (30.0, 30.0, 10.0, 90.0)
    assert defaults == {"plan_mode": d.mode, "ttft_slo_ms": d.ttft_slo_ms, "tbt_slo_ms": d.tbt_slo_ms,
                        "dwell_s": d.min_dwell_s, "cooldown_s": d.cooldown_s, "window_s": d.window_s}
    assert planner_config(**defaults) == d
    assert planner_config(**{**defaults, "dwell_s": 5.0}).move_timeout_s == 60.0   # at least MOVE_TIMEOUT_MIN_S
