"""`pdqueue metrics-sd`: where Prometheus finds a cluster's workers, and the cluster's streams.

Workers serve their metrics on ports they pick (``--metrics-port 0``) and advertise
``host:port`` as ``metrics`` in their heartbeats. This command serves, on one fixed port:

- ``/targets``: Prometheus HTTP service discovery (``http_sd_configs``), one target per live
  worker (``pdqueue.telemetry.metrics.sd_targets``), read from the heartbeats at each request;
- ``/metrics``: the request and handoff streams' backlog, lag and pending per consumer
  group, stream lengths and live workers by role (``pdqueue.telemetry.metrics.StreamCollector``),
  read when scraped.

Imports redis and prometheus_client (never torch).
"""

from __future__ import annotations

import signal
import threading

import click

from workers.cli.common import UserError, connect, print_line, resolve_target, rich_console, target_options


@click.command("metrics-sd")
@target_options
@click.option("--host", envvar="PDQ_METRICS_SD_HOST", show_envvar=True, default="127.0.0.1", show_default=True,
              help="Listen on this address (0.0.0.0: every interface).")
@click.option("--port", envvar="PDQ_METRICS_SD_PORT", show_envvar=True, type=click.IntRange(min=0, max=65535),
              default=9464, show_default=True, help="Listen on this port (0: any free port).")
def metrics_sd(redis_url, cluster, host, port):
    """Serve Prometheus service discovery of the workers (/targets) and the stream backlog
    (/metrics) of one cluster, until Ctrl-C or SIGTERM."""
    from pdqueue.keys import Keys
    from pdqueue.telemetry.metrics import cluster_app, serve_metrics, stop_metrics

    target = resolve_target(redis_url, cluster)
    r = connect(target)
    keys = Keys(target.cluster)
    try:
        bound = serve_metrics(None, host, port, app=cluster_app(r, keys))
    except OSError as exc:
        raise UserError(f"cannot listen on {host}:{port} ({exc.strerror or exc})") from None
    shown = f"[{host}]" if ":" in host else host
    print_line(rich_console(stderr=True),
               f"[cyan]pdqueue metrics-sd: cluster {target.cluster!r} at {target.shown_url}: "
               f"http://{shown}:{bound}/targets (http_sd), http://{shown}:{bound}/metrics (streams)[/]")
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    try:
        while not stopped.wait(3600):
            pass
    except KeyboardInterrupt:
        pass
    stop_metrics(bound)
