"""`pdqueue plan`: what split of roles the planner recommends for a cluster, and why; with
``--apply`` it also switches the workers (as ``up --adapt`` does). Never imports torch."""

from __future__ import annotations

import json
import threading
import time

import click

from workers.cli.common import connect, planner_config, planner_options, redis_failure, resolve_target, target_options


@click.command()
@target_options
@planner_options
@click.option("--apply", is_flag=True, help="Send the switch commands (otherwise only recommend).")
@click.option("--watch", is_flag=True, help="Keep deciding every --interval seconds until Ctrl-C.")
@click.option("--interval", type=click.FloatRange(min=0.2), default=1.0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per decision.")
def plan(redis_url, cluster, plan_mode, ttft_slo_ms, tbt_slo_ms, dwell_s, cooldown_s, window_s, elastic, apply,
         watch, interval, as_json):
    """Recommend how many workers of each role the cluster should run, and why (from its
    heartbeats, stream backlogs and recent completions). The desired counts also go to the
    `plan` hash in Redis for external actuators. With --apply, switch the roles of workers
    started with --switchable."""
    import redis

    from pdqueue.control.adapter import Adapter
    from pdqueue.keys import Keys

    target = resolve_target(redis_url, cluster)
    r = connect(target)
    config = planner_config(plan_mode, ttft_slo_ms, tbt_slo_ms, dwell_s, cooldown_s, window_s, elastic)
    adapter = Adapter(r, Keys(target.cluster), config, name="pdqueue-plan", dry_run=not apply)
    stop = threading.Event()
    try:
        while True:
            decision = adapter.tick()
            _show(decision, as_json, apply)
            if not watch:
                return
            stop.wait(interval)
    except KeyboardInterrupt:
        pass
    except redis.RedisError as exc:   # lost, or a command the ACL user may not run (which it names)
        raise redis_failure(exc, target) from None


def _show(decision, as_json: bool, applied: bool) -> None:
    counts = ", ".join(f"{n} {role}" for role, n in decision.counts.items() if n)
    if as_json:
        click.echo(json.dumps({"time": decision.time, "action": decision.action, "counts": decision.counts,
                               "moves": [vars_of(m) for m in decision.moves], "reason": decision.reason,
                               "budgets": [{"worker_id": b.worker_id, "tbt_slo_ms": b.tbt_slo_ms, "why": b.why}
                                           for b in decision.budgets],
                               "migrations": [{"worker_id": m.worker_id, "count": m.count, "why": m.why}
                                              for m in decision.migrations],
                               "signals": decision.signals, "applied": applied}))
        return
    stamp = time.strftime("%H:%M:%S")
    moves = "; ".join(str(m) for m in (*decision.moves, *decision.budgets, *decision.migrations))
    click.echo(f"{stamp} {decision.action}: {counts or 'no workers'}" + (f"  [{moves}]" if moves else ""))
    click.echo(f"  {decision.reason}")


def vars_of(move) -> dict:
    return {"worker_id": move.worker_id, "from": move.from_role, "to": move.to_role,
            "expected_epoch": move.expected_epoch}
