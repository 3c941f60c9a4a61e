"""`pdqueue serve`: the OpenAI-compatible HTTP gateway (``pdqueue.frontends.gateway``) in front of a
cluster. Finds the cluster as `submit` does (``--redis-url``/``--cluster``, the running
`up`, the default), binds the port (0: a free one), prints the URL on its first line, then
serves until SIGINT/SIGTERM: the first drains (open answers run to their end, new requests
get 503), a second ends the open answers with an error (``pdqueue.frontends.gateway.serve``). Its
second line (stderr) says what it runs on: ``--loop``/``--http``/``--redis-parser``, each
``auto`` by default (uvloop, httptools and hiredis when installed: ``pdqueue[fast]``).

``--fd N`` serves on a listening socket its supervisor passed instead of binding one
(``pdqueue up`` does, so that a gateway's replacement takes over the same socket:
``pdqueue.frontends.runtime``); such a gateway prints ``accepting connections (pid N)``
on stdout once it accepts, and SIGUSR1 makes it hand the socket over (stop accepting, answer
what its open connections bring, exit). Never imports torch.
"""

from __future__ import annotations

import logging
import os

import click

from workers.cli.common import UserError, connect, resolve_target, target_options

DEFAULT_PORT = 8000


@click.command()
@target_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: all).")
@click.option("--port", type=click.IntRange(0, 65535), default=DEFAULT_PORT, show_default=True,
              help="Port to listen on (0: a free one; the first line prints the URL).")
@click.option("--fd", "listen_fd", type=click.IntRange(min=0), default=None,
              help="Serve on this inherited listening socket (a supervisor's, e.g. `pdqueue up`'s) instead of "
                   "binding --host/--port; prints 'accepting connections' once it accepts, and hands the socket "
                   "over on SIGUSR1 (docs/operations/rolling-restarts.md).")
@click.option("--api-key", envvar="PDQ_API_KEY", show_envvar=True, default=None,
              help="Require 'Authorization: Bearer KEY' on /v1/* [default: no key].")
@click.option("--tenants", "tenants_path", envvar="PDQ_TENANTS", show_envvar=True, default=None,
              type=click.Path(dir_okay=False),
              help="A TOML file of tenants: API keys, share, requests_per_s, tokens_per_s, service_class "
                   "(docs/api/gateway.md, Tenants) [default: one tenant, --api-key's].")
@click.option("--max-backlog", type=click.IntRange(min=0), default=None,
              help="Answer 429 while the cluster's request backlog (lag + pending of the request streams) is "
                   "over this [default: no limit].")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), default=600.0,
              show_default=True, help="Seconds a request may take (504 after; the workers drop it too).")
@click.option("--capacity-wait-s", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="A request that arrives while no worker can take it (all stopped or restarting, scaling from "
                   "zero) waits in the queue this long for one, then gets 503 with Retry-After (0: at once).")
@click.option("--sse-keepalive-s", "keepalive_s", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Write an SSE comment (': keep-alive') after this many seconds without a token [default: never; "
                   "some benchmark clients drop every event after a comment, and a client that leaves is seen "
                   "without one].")
@click.option("--batch-concurrency", type=click.IntRange(1, 4096), default=64, show_default=True,
              help="Requests in flight per batch of the Batch API (/v1/batches).")
@click.option("--batch-lease-s", type=click.FloatRange(min=0.5), default=10.0, show_default=True,
              help="A batch is run by one gateway at a time, under a lease renewed every third of this; a killed "
                   "gateway's batches are taken over by another (or by it, restarted) after it.")
@click.option("--responses-ttl-s", type=click.IntRange(min=1), default=30 * 86400, show_default=True,
              help="A stored response of /v1/responses (its conversation and output, in Redis) is kept this long "
                   "after its last write: 30 days, as OpenAI keeps them.")
@click.option("--loop", type=click.Choice(["auto", "asyncio", "uvloop"]), default="auto", show_default=True,
              help="The event loop (auto: uvloop when installed, else asyncio's).")
@click.option("--http", type=click.Choice(["auto", "h11", "httptools"]), default="auto", show_default=True,
              help="The HTTP parser (auto: httptools when installed, else h11).")
@click.option("--redis-parser", envvar="PDQ_REDIS_PARSER", show_envvar=True,
              type=click.Choice(["auto", "hiredis", "python"]), default="auto", show_default=True,
              help="Parser of Redis replies (auto: hiredis when installed, else redis-py's Python one).")
@click.option("--log-level", default="WARNING", show_default=True, help="Log level of the gateway.")
def serve(redis_url, cluster, host, port, listen_fd, api_key, tenants_path, max_backlog, timeout_s, capacity_wait_s,
          keepalive_s, batch_concurrency, batch_lease_s, responses_ttl_s, loop, http, redis_parser, log_level):
    """Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models) for a cluster.

    \b
    The Batch API: POST /v1/files (purpose=batch), GET /v1/files/ID[/content], POST /v1/batches,
    GET /v1/batches[/ID], POST /v1/batches/ID/cancel; batches live in Redis and survive restarts.

    \b
    The Responses API: POST /v1/responses, GET /v1/responses/ID (?stream=true&starting_after=N
    resumes its events), POST /v1/responses/ID/cancel, DELETE /v1/responses/ID,
    GET /v1/responses/ID/input_items; responses and their conversations live in Redis.

    \b
    Also GET /health (200 while prefill and decode, or colocated, workers live; else 503),
    GET /v1/requests/ID (a request sent with an Idempotency-Key, read again or resumed) and
    GET /metrics (Prometheus). Stateless: run as many as you like.

    \b
    SIGTERM or Ctrl-C: open answers run to their end, new requests get 503; a second one
    ends the open answers now (an error event, then [DONE]).
    """
    from pdqueue.frontends.gateway import GatewayConfig, bind, runtime
    from pdqueue.frontends.gateway import serve as run
    from pdqueue.frontends.runtime import inherited
    from pdqueue.frontends.tenants import TenantError, load_tenants
    from pdqueue.queue.connection import PARSER_ENV

    os.environ[PARSER_ENV] = redis_parser   # every client this process makes (the gateway's)
    try:
        rt = runtime(loop, http)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    try:
        tenants = load_tenants(tenants_path, api_key or None)
    except TenantError as exc:
        raise UserError(str(exc)) from None
    target = resolve_target(redis_url, cluster)
    connect(target).close()
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        sock = bind(host, port) if listen_fd is None else inherited(listen_fd)
    except OSError as exc:
        if listen_fd is not None:
            raise UserError(f"--fd {listen_fd}: {exc.strerror or exc}") from None
        raise UserError(f"--port {port}: cannot listen on {host}:{port} ({exc.strerror})") from None
    if listen_fd is not None:
        host = sock.getsockname()[0]
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    click.echo(f"pdqueue serve: http://{shown}:{bound}/v1 (cluster {target.cluster!r}, {target.shown_url}, "
               f"{target.source}){_keys_note(tenants)}", nl=True)
    click.get_text_stream("stdout").flush()
    click.echo(f"pdqueue serve: {rt.describe()}", err=True)
    run(GatewayConfig(redis_url=target.url, cluster=target.cluster, api_key=api_key or None,
                      max_backlog=max_backlog, timeout_s=timeout_s, capacity_wait_s=capacity_wait_s,
                      keepalive_s=keepalive_s,
                      tenants=tuple(tenants), batch_lease_s=batch_lease_s,
                      batch_concurrency=batch_concurrency, responses_ttl_s=responses_ttl_s), sock,
        log_level=log_level, loop=rt.loop, http=rt.http, on_ready=None if listen_fd is None else _accepting)


def _accepting() -> None:
    """With --fd: the line that tells the supervisor this gateway accepts (its replacement is ready)."""
    click.echo(f"pdqueue serve: accepting connections (pid {os.getpid()})")
    click.get_text_stream("stdout").flush()


def _keys_note(tenants) -> str:
    if not tenants:
        return ""
    if len(tenants) == 1 and tenants[0].name == "default":
        return "; API key required"
    return f"; API keys of {len(tenants)} tenants ({', '.join(t.name for t in tenants)})"
