"""The planner's elastic levers (pdqueue/control/elastic.py) on recorded observations: per-worker
TBT budgets and migrations of running decodes, beside the role moves; and the budget and
migrate commands (pdqueue/control/commands.py) parsed and refused as the switch is.

The recorded phases (tests/test_planner.py) are shaped after the serve bench on 2 cores:
COLO_STALLS (2 colocated, TBT p90 >= 282 ms, TTFT fine), DOCS (TTFT p90 5.6 s), CHAT (healthy).
"""

from __future__ import annotations

import pytest

from pdqueue.control import commands
from pdqueue.control.planner import COLOCATED, DECODE, PREFILL, Budget, Migration, Observation, Planner, PlannerConfig
from tests.test_planner import CHAT, COLO_STALLS, DOCS, T0, completions, worker

ELASTIC = PlannerConfig(elastic=True, min_dwell_s=0, cooldown_s=0, budget_every_s=10, migrate_every_s=5)


def colo(wid, budget=None, running=4, waiting=0, budgetable=True, **kw):
    return worker(wid, COLOCATED, tbt_budget_ms=budget, budgetable=budgetable, running=running, waiting=waiting, **kw)


def seen(t, workers, rows=(), by="") -> Observation:
    """An observation whose completions were decoded by ``by`` (colocated: by itself)."""
    return Observation(time=t, workers=tuple(workers),
                       completions=completions(rows, t, local=True, decode_worker=by))


def test_elastic_is_off_by_default_and_decisions_carry_no_levers():
    d = Planner().decide(seen(T0, [colo("c0"), colo("c1", waiting=5)], COLO_STALLS, by="c0"))
    assert d.budgets == () and d.migrations == ()


def test_every_colocated_worker_first_gets_the_tbt_target_as_its_budget_once():
    p = Planner(ELASTIC)
    d = p.decide(seen(T0, [colo("c0"), colo("c1", budget=250.0)]))
    assert d.budgets == (Budget("c0", 250.0, "the TBT target"),)   # c1 already runs with it
    assert "c0 TBT budget 250 ms" in d.reason
    # applied: nothing more to say
    d = p.decide(seen(T0 + 1, [colo("c0", budget=250.0), colo("c1", budget=250.0)]))
    assert d.budgets == ()


def test_workers_that_take_no_budget_get_none_and_still_migrate():
    workers = [colo("c0", budgetable=False, running=3, waiting=2), worker("d0", DECODE)]
    d = Planner(ELASTIC).decide(seen(T0, workers))
    assert d.budgets == () and d.migrations == (Migration("c0", 3, "2 prompts waiting beside 3 running"),)


def test_a_budget_tightens_on_a_tbt_breach_and_not_faster_than_every_budget_every_s():
    p = Planner(ELASTIC)
    p.decide(seen(T0, [colo("c0", budget=250.0)]))
    d = p.decide(seen(T0 + 5, [colo("c0", budget=250.0)], COLO_STALLS, by="c0"))
    assert d.budgets == ()                                   # 5 s < budget_every_s
    d = p.decide(seen(T0 + 10, [colo("c0", budget=250.0)], COLO_STALLS, by="c0"))
    (b,) = d.budgets
    assert b.worker_id == "c0" and b.tbt_slo_ms == pytest.approx(200.0) and "tighter" in b.why
    # again and again: never below budget_min_frac x the target
    budget = 200.0
    for i in range(2, 8):
        d = p.decide(seen(T0 + 10 * i, [colo("c0", budget=budget)], COLO_STALLS, by="c0"))
        budget = d.budgets[0].tbt_slo_ms if d.budgets else budget
    assert budget == pytest.approx(125.0)


def test_a_budget_loosens_when_ttft_breaks_and_tbt_has_headroom_and_only_for_that_worker():
    fast_tbt_slow_ttft = [(o, ttft, 60, 90, pt, ot, pf) for o, ttft, _a, _b, pt, ot, pf in DOCS]
    p = Planner(ELASTIC)
    p.decide(seen(T0, [colo("c0", budget=250.0), colo("c1", budget=250.0)]))
    d = p.decide(seen(T0 + 10, [colo("c0", budget=250.0), colo("c1", budget=250.0)], fast_tbt_slow_ttft, by="c0"))
    assert [b.worker_id for b in d.budgets] == ["c0"]
    assert d.budgets[0].tbt_slo_ms == pytest.approx(312.5) and "looser" in d.budgets[0].why
    # healthy: the budget stays where it is
    d = p.decide(seen(T0 + 20, [colo("c0", budget=312.5), colo("c1", budget=250.0)], CHAT, by="c0"))
    assert d.budgets == ()


def test_running_decodes_migrate_off_a_worker_with_prompts_waiting_to_a_decode_worker_with_room():
    cfg = PlannerConfig(elastic=True, min_dwell_s=0, cooldown_s=0, max_batch=6, migrate_max=8)
    p = Planner(cfg)
    workers = [colo("c0", budget=250.0, running=5, waiting=3), colo("c1", budget=250.0, running=2, waiting=0),
               worker("d0", DECODE, running=2, backlog=1)]
    d = p.decide(seen(T0, workers))
    assert d.migrations == (Migration("c0", 3, "3 prompts waiting beside 5 running"),)   # d0 has room for 3
    assert "migrate 3 from c0" in d.reason
    # not again within migrate_every_s
    assert p.decide(seen(T0 + 1, workers)).migrations == ()
    assert p.decide(seen(T0 + 6, workers)).migrations != ()


@pytest.mark.parametrize("decoder", [
    None,                                                     # no decode worker at all
    dict(draining=True),                                      # it is stopping or switching
    dict(running=64),                                         # full (max_batch 64)
    dict(kv_free=5, kv_total=100),                            # its KV nearly full
])
def test_no_migration_without_a_decode_worker_that_takes_work(decoder):
    workers = [colo("c0", budget=250.0, running=5, waiting=4)]
    if decoder is not None:
        workers.append(worker("d0", DECODE, **decoder))
    assert Planner(ELASTIC).decide(seen(T0, workers)).migrations == ()


def test_no_lever_touches_a_worker_whose_role_move_is_in_flight():
    p = Planner(PlannerConfig(elastic=True, min_dwell_s=0, cooldown_s=0, confirm=1))
    workers = [colo("c0", budget=250.0), colo("c1", budget=250.0)]
    d = p.decide(seen(T0, workers, COLO_STALLS, by="c0"))
    assert d.moves, d.reason                                   # decode short: one colocated -> decode
    (mv,) = d.moves
    assert (mv.from_role, mv.to_role) == (COLOCATED, DECODE)
    assert all(b.worker_id != mv.worker_id for b in d.budgets)
    assert all(m.worker_id != mv.worker_id for m in d.migrations)


def test_elastic_decode_short_keeps_the_other_colocated_workers_colocated():
    """Elastic: 2C with TBT breaking -> 1C+1D (not 1P+1D): the remaining colocated worker
    keeps both kinds of work by budget and its decodes can move to the new decode worker."""
    p = Planner(PlannerConfig(elastic=True, min_dwell_s=0, cooldown_s=0, confirm=1))
    d = p.decide(seen(T0, [colo("c0"), colo("c1")], COLO_STALLS, by="c0"))
    assert d.counts == {PREFILL: 0, DECODE: 1, COLOCATED: 1}, d.reason
    # with a decode worker that has room, decode short is for migrations and budgets first
    p = Planner(PlannerConfig(elastic=True, min_dwell_s=0, cooldown_s=0, confirm=1))
    d = p.decide(seen(T0, [colo("c0", budget=250.0), worker("d0", DECODE)], COLO_STALLS, by="c0"))
    assert d.moves == () and "migrations and budgets act first" in d.reason


@pytest.mark.parametrize("fields, needle", [
    ({"op": "budget", "tbt_slo_ms": "fast"}, "tbt_slo_ms must be"),
    ({"op": "budget", "tbt_slo_ms": "-3"}, "tbt_slo_ms must be > 0"),
    ({"op": "budget", "tbt_slo_ms": "100", "role": "decode"}, "unknown field"),
    ({"op": "migrate", "count": "x"}, "count must be an integer"),
    ({"op": "migrate", "count": "0"}, "count must be >= 1"),
    ({"op": "resize", "count": "1"}, "op must be one of"),
])
def test_malformed_budget_and_migrate_commands_say_why(fields, needle):
    with pytest.raises(commands.CommandError, match=needle):
        commands.parse_command(fields)


def test_budget_and_migrate_commands_parse():
    assert commands.parse_command({"op": "budget", "id": "b1", "tbt_slo_ms": "120.5", "by": "me"}) == \
        commands.BudgetCommand("b1", 120.5, "me")
    assert commands.parse_command({"op": "budget", "id": "b2", "tbt_slo_ms": "off"}).tbt_slo_ms is None
    assert commands.parse_command({b"op": b"migrate", b"id": b"m1", b"count": b"3"}) == \
        commands.MigrateCommand("m1", 3, "")


def test_observe_reads_what_the_levers_need_from_the_heartbeats(r):
    from pdqueue.control.observe import observe
    from pdqueue.keys import Keys
    from pdqueue.queue.registry import Heartbeat

    keys = Keys("elastic")
    Heartbeat(r, keys, "c-1", role=COLOCATED, load={"running": 3, "waiting": 2, "tbt_budget_ms": 180.0}).beat()
    Heartbeat(r, keys, "c-2", role=COLOCATED, load={"running": 1, "tbt_budget_ms": 0}).beat()   # chunked, no budget
    Heartbeat(r, keys, "c-3", role=COLOCATED, load={"running": 1}).beat()                        # prefill-first
    Heartbeat(r, keys, "d-1", role=DECODE, load={"running": 1, "draining": 1}).beat()
    Heartbeat(r, keys, "d-3", role=DECODE, load={"running": 1, "takes_prompts": 1, "prompt_tok_s": 90.0}).beat()
    switching = Heartbeat(r, keys, "d-2", role=DECODE, load={"running": 0})
    switching.update(switching_to=PREFILL)
    switching.beat()
    w = {x.worker_id: x for x in observe(r, keys).workers}
    assert (w["c-1"].tbt_budget_ms, w["c-1"].budgetable) == (180.0, True)
    assert (w["c-2"].tbt_budget_ms, w["c-2"].budgetable) == (None, True)
    assert (w["c-3"].tbt_budget_ms, w["c-3"].budgetable) == (None, False)
    assert w["d-1"].draining and w["d-2"].draining and not w["c-1"].draining
    assert w["d-3"].takes_prompts and not w["d-1"].takes_prompts


def test_the_adapter_sends_the_budgets_and_migrations_as_commands(r):
    from pdqueue.control.adapter import Adapter
    from pdqueue.keys import Keys
    from pdqueue.queue.registry import Heartbeat

    keys = Keys("elastic-act")
    Heartbeat(r, keys, "c-1", role=COLOCATED, load={"running": 4, "waiting": 3, "tbt_budget_ms": 0}).beat()
    Heartbeat(r, keys, "d-1", role=DECODE, load={"running": 0}).beat()
    decision = Adapter(r, keys, PlannerConfig(elastic=True, tbt_slo_ms=90.0), name="t").tick()
    assert decision.budgets and decision.migrations, decision.reason
    sent = [commands.parse_command(f) for _id, f in commands.take_commands(r, keys, "c-1")]
    assert [type(c) for c in sent] == [commands.BudgetCommand, commands.MigrateCommand]
    assert sent[0].tbt_slo_ms == 90.0 and sent[1].count == 4 and sent[0].by == "t"
    assert commands.take_commands(r, keys, "d-1") == []
    dry = Adapter(r, keys, PlannerConfig(elastic=True, tbt_slo_ms=90.0), dry_run=True).tick()
    assert dry.migrations and commands.take_commands(r, keys, "c-1") == []   # recommends, sends nothing
