"""`pdqueue status`: workers, queues and recent throughput and latency of a cluster, once or
refreshed (``--watch``); ``workers.cli.status_view`` collects and draws the snapshot. The
cluster is found as for `submit` (``pdqueue.discovery.resolve``). Never imports torch.
"""

from __future__ import annotations

import json
import sys
import time

import click

from workers.cli.common import connect, redis_failure, resolve_target, rich_console, target_options


@click.command()
@target_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (with --watch: one per line).")
@click.option("--watch", is_flag=True, help="Refresh until Ctrl-C.")
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True,
              help="Seconds between refreshes with --watch.")
@click.option("--window", type=click.FloatRange(min=1), default=60.0, show_default=True,
              help="Seconds of completions (the done stream) behind the throughput and latency numbers.")
def status(redis_url, cluster, as_json, watch, interval, window):
    """Workers, queues (lengths, pending, lag) and recent throughput and latency."""
    import redis

    from pdqueue.keys import Keys
    from workers.cli import status_view

    target = resolve_target(redis_url, cluster)
    r = connect(target)
    keys = Keys(target.cluster)

    def snapshot() -> dict:
        try:
            snap = status_view.collect(r, keys, window_s=window)
        except redis.RedisError as exc:   # lost, or a command the ACL user may not run (which it names)
            raise redis_failure(exc, target) from None
        return {"redis_url": target.shown_url, "source": target.source, **snap}

    title = f"pdqueue cluster {target.cluster!r} at {target.shown_url}"
    if not watch:
        snap = snapshot()
        if as_json:
            click.echo(json.dumps(snap, indent=2))
        else:
            rich_console().print(status_view.render(snap, title))
        return
    try:
        if as_json or not sys.stdout.isatty():
            while True:
                snap = snapshot()
                if as_json:
                    click.echo(json.dumps(snap))
                else:
                    rich_console().print(status_view.render(snap, title))
                sys.stdout.flush()
                time.sleep(interval)
        from rich.live import Live

        with Live(status_view.render(snapshot(), title), console=rich_console(), auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                live.update(status_view.render(snapshot(), title), refresh=True)
    except KeyboardInterrupt:
        pass
