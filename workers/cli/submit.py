"""`pdqueue submit`: one request, its answer streamed as it arrives (finding the cluster,
connecting and printing are in ``workers.cli.common``, shared with `status` and `up`).

Where the cluster is: ``pdqueue.discovery.resolve``.
The URL: ``--redis-url``/``PDQ_REDIS_URL``, else the state file of the running ``pdqueue
up`` of the cluster, else redis://127.0.0.1:6379/0. The cluster: ``--cluster``/``PDQ_CLUSTER``,
else the local cluster's (several up: ``default``, else an error listing them), else
``default``. None of these commands imports torch.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys

import click

from pdqueue.protocol import Priority, ServiceClass
from workers.cli.common import (
    UserError,
    check_sampling,
    connect,
    redis_failure,
    resolve_target,
    sampling_options,
    summary,
    target_options,
)


@click.command()
@click.argument("prompt")
@target_options
@sampling_options
@click.option("--seed", type=int, default=None, callback=check_sampling, help="Sampling seed [default: random].")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--chat", is_flag=True, help="Apply the model's chat template to PROMPT.")
@click.option("--priority", type=click.Choice([p.value for p in Priority]), default=Priority.NORMAL.value,
              show_default=True)
@click.option("--class", "service_class", type=click.Choice(ServiceClass.names()), default=None,
              help="Service class: the order workers admit requests in (batch only into spare capacity) "
                   "[default: from --priority: high is interactive, normal standard].")
@click.option("--deadline-ms", type=click.IntRange(min=1), default=None,
              help="Give up if not done this long after submission (finish_reason expired; with --class, an "
                   "error deadline_exceeded when it passes before the request starts).")
@click.option("--id", "request_id", default=None, help="Request id (idempotent: a repeated id is not run twice).")
@click.option("--json", "as_json", is_flag=True, help="Print the completion with its timings as one JSON object.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=300.0, show_default=True,
              help="Seconds to wait for the answer.")
def submit(prompt, redis_url, cluster, max_tokens, temperature, top_p, top_k, seed, stop, chat, priority,
           service_class, deadline_ms, request_id, as_json, timeout):
    """Submit PROMPT ('-' reads stdin) and stream the answer as it arrives."""
    import redis

    from pdqueue.client import Client, RequestError, RequestFailed
    from pdqueue.queue.registry import list_workers

    if prompt == "-":
        prompt = sys.stdin.read()
    target = resolve_target(redis_url, cluster)
    r = connect(target)
    client = Client(target.url, target.cluster, redis_client=r)
    out = _Stdout()
    _warnings_to_stderr(out)
    handle = None

    def lost(exc: Exception):
        out.end_line()
        return redis_failure(exc, target, role="producer")

    try:
        try:
            roles = {w.get("role") for w in list_workers(r, client.keys)}
        except redis.exceptions.NoPermissionError:  # a producer's ACL user may not look (docs/security.md)
            roles = None
        if roles is not None and "colocated" not in roles and not {"prefill", "decode"} <= roles:
            click.secho(f"warning: cluster {target.cluster!r} at {target.shown_url} has no "
                        f"{'prefill' if 'prefill' not in roles else 'decode'} worker; the request waits in the queue",
                        fg="yellow", err=True)
        handle = client.submit(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                               seed=seed, stop=stop, deadline_ms=deadline_ms, priority=priority, chat=chat,
                               id=request_id, service_class=service_class)
        if as_json:
            completion = handle.result(timeout=timeout)
        else:
            for delta in handle.text_stream(timeout=timeout):
                out.write(delta)
            completion = handle.completion
    except RequestError as exc:
        raise UserError(str(exc)) from None
    except RequestFailed as exc:
        out.end_line()
        raise UserError(f"request {handle.request_id} failed ({exc.code}): {exc.reason}") from None
    except redis.RedisError as exc:  # client.RedisUnavailable too: Redis gone for longer than a restart
        if handle is not None and not isinstance(exc, redis.exceptions.NoPermissionError):
            _cancel(client, handle.request_id)
        raise lost(exc) from None   # what the error means: refused to this ACL user, lost, ...
    except TimeoutError:
        out.end_line()
        try:
            client.cancel(handle.request_id)
        except redis.RedisError as exc:  # timed out while Redis was away: that is the news
            raise lost(exc) from None
        raise UserError(f"no answer to request {handle.request_id} within {timeout:g}s (cancelled); "
                         f"see `pdqueue status`") from None
    except KeyboardInterrupt:
        out.end_line()
        if handle is not None:
            done = _cancel(client, handle.request_id)
            click.secho(f"{'cancelled' if done else 'could not cancel'} request {handle.request_id}",
                        fg="yellow", err=True)
        sys.exit(130)
    if as_json:
        click.echo(json.dumps(completion_dict(completion)))
        return
    click.echo()
    click.secho(summary(completion), fg="cyan", err=True)


class _Stdout:
    """The streamed answer on stdout, and whether its last line is still open (a warning
    on stderr first ends that line, so it never lands inside the answer's text)."""

    def __init__(self):
        self.open_line = False

    def write(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()
        if text:
            self.open_line = not text.endswith("\n")

    def end_line(self) -> None:
        if self.open_line:
            sys.stdout.write("\n")
            sys.stdout.flush()
            self.open_line = False


class _WarningLine(logging.Handler):
    def __init__(self, out: _Stdout):
        super().__init__(logging.WARNING)
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.out.end_line()
            click.secho(f"warning: {record.getMessage()}", fg="yellow", err=True)
        except Exception:
            self.handleError(record)


def _warnings_to_stderr(out: _Stdout) -> None:
    """The client's warnings (a lost connection being retried) as yellow lines on stderr."""
    logger = logging.getLogger("pdqueue")
    logger.handlers[:] = [_WarningLine(out)]
    logger.propagate = False


def _cancel(client, request_id: str) -> bool:
    """Best effort: with Redis gone the cancel cannot be sent, which is no reason for a traceback."""
    import redis

    try:
        client.cancel(request_id)
        return True
    except redis.RedisError:
        return False


def completion_dict(c) -> dict:
    """The completion as ``submit --json`` prints it: ``id`` (the protocol's name for the
    request id), the fields of ``Completion`` and ``num_tokens``."""
    d = dataclasses.asdict(c)
    d = {"id": d.pop("request_id"), **d}
    d["token_ids"] = list(c.token_ids)
    d["finish_reason"] = getattr(c.finish_reason, "value", c.finish_reason)
    d["num_tokens"] = c.num_tokens
    return d
