"""`pdqueue restart`: a rolling restart of a running `pdqueue up`, which fails no request.

Finds the `up` of the cluster through its state file (``pdqueue.discovery``, as `pdqueue up
--print-url` does), sends it the command through Redis and prints the roll's progress as its
supervisor reports it (``workers.cli.supervisor.rolling``: one process at a time, the
replacement serving before the old one leaves; decodes move with their KV, the gateway hands
its socket over). Exit 0 once the roll is done; 1 with the reason otherwise: no such `up`, a
command it refused (a roll under way, no worker of that role), a replacement that never became
ready (the old process stays and the roll stops there), `up` gone meanwhile. Ctrl-C stops
following, not the roll. Never imports torch.
"""

from __future__ import annotations

import time

import click

from workers.cli.common import Target, UserError, connect, redis_failure


@click.command()
@click.option("--cluster", envvar="PDQ_CLUSTER", show_envvar=True, default=None,
              help="The cluster of the `pdqueue up` to restart [default: the running `up` (several: default)].")
@click.option("--role", "roles", type=click.Choice(["prefill", "decode", "colocated"]), multiple=True,
              help="Only the workers that run this role now (repeatable) [default: every worker and the gateway].")
@click.option("--gateway", is_flag=True, help="The gateway (alone, or beside --role).")
@click.option("--ready-timeout", "ready_timeout_s", type=click.FloatRange(min=1), default=600.0, show_default=True,
              help="Seconds a replacement may take to serve (load the model and register; the gateway: accept); "
                   "past them it is stopped, the old process stays and the roll stops.")
@click.option("--stop-timeout", "stop_timeout_s", type=click.FloatRange(min=1), default=60.0, show_default=True,
              help="Seconds an old process may take to leave (finish or move what it holds) before it is stopped "
                   "cold.")
def restart(cluster, roles, gateway, ready_timeout_s, stop_timeout_s):
    """Restart the processes of a running `pdqueue up` one at a time, under load, failing no
    request: each replacement (a fresh process: after a code change, the new code) serves
    before the one it replaces leaves; running decodes move with their KV; the gateway hands
    its port over without refusing a connection. Prints the progress; exit 0 when done.

    \b
    Compose and Kubernetes: docs/operations/rolling-restarts.md.
    """
    import redis

    from pdqueue.discovery import read_state, running_clusters, state_path, state_url
    from pdqueue.keys import Keys
    from pdqueue.procs import pid_alive
    from workers.cli.supervisor.rolling import ACCEPT_WITHIN_S, FINAL, follow, send_restart

    if cluster is None:
        up = running_clusters()
        names = [s["cluster"] for s in up]
        cluster = names[0] if len(names) == 1 else "default"
        if len(names) > 1 and "default" not in names:
            raise UserError(f"several local clusters are up ({', '.join(names)}): name one with --cluster NAME")
    try:
        keys = Keys(cluster)
    except ValueError as exc:
        raise UserError(f"--cluster: {exc}") from None
    state = read_state(cluster=cluster)
    if state is None:
        others = [s["cluster"] for s in running_clusters()]
        hint = f"; up: {', '.join(others)} (--cluster NAME)" if others else ""
        raise UserError(f"no local cluster {cluster!r} is up (no live {state_path(cluster)}){hint}: pdqueue restart "
                        f"rolls a `pdqueue up`; for compose and Kubernetes see docs/operations/rolling-restarts.md")
    target = Target(state_url(state), cluster, f"the state file of `pdqueue up` (pid {state['pid']})")
    r = connect(target)
    what = " and ".join([f"the {'/'.join(roles)} workers"] * bool(roles) + ["the gateway"] * gateway) \
        or "every worker and the gateway"
    click.echo(f"pdqueue restart: {what} of `pdqueue up` (pid {state['pid']}, cluster {cluster!r}), one at a time")
    try:
        command_id, since = send_restart(r, keys, tuple(roles), gateway, ready_timeout_s, stop_timeout_s,
                                         by="pdqueue restart")
        accepted, quiet_since = False, time.monotonic()
        # Each step is bounded by `up` (ready, then stop timeouts, then SIGKILL): this is a last guard.
        quiet_limit = ready_timeout_s + stop_timeout_s + 60.0
        while True:
            events, since = follow(r, keys, command_id, since)
            for e in events:
                quiet_since = time.monotonic()
                accepted = True
                if e.get("status") in FINAL:
                    if e["status"] == "done":
                        click.echo(e.get("text", "done"))
                        return
                    if e.get("tail"):
                        click.secho(e["tail"], dim=True, err=True)
                    raise UserError(e.get("text") or e["status"])
                click.echo(e.get("text", ""))
            if events:
                continue
            if not pid_alive(int(state["pid"])):
                raise UserError(f"`pdqueue up` (pid {state['pid']}) is gone" + (" during the roll" if accepted else ""))
            waited = time.monotonic() - quiet_since
            if not accepted and waited > ACCEPT_WITHIN_S + 2:
                raise UserError(f"`pdqueue up` (pid {state['pid']}) did not take the command within "
                                f"{ACCEPT_WITHIN_S:g} s (it takes commands once its workers are ready)")
            if waited > quiet_limit:
                raise UserError(f"no word from `pdqueue up` (pid {state['pid']}) for {waited:.0f} s")
    except redis.RedisError as exc:
        raise redis_failure(exc, target) from None
    except KeyboardInterrupt:
        click.echo("stopped following; the roll goes on in `pdqueue up` (its console and up.log say how it ends)",
                   err=True)
        raise SystemExit(130) from None
