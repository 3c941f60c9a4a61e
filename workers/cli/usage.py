"""`pdqueue usage`: a cluster's usage ledger (pdqueue/queue/ledger.py), one record per request,
summed per tenant, model and class over a time window (``--since``, ``--until``), or listed
record by record (``--requests``); a table, or one JSON object (``--json``). The cluster is
found as for `status` (``pdqueue.discovery.resolve``: ``--redis-url``, then a running `up`).
It only reads the ``usage`` stream: the ``usage`` role of `pdqueue acl` may run it. Never
imports torch.
"""

from __future__ import annotations

import json
import re
import time
from datetime import datetime

import click

from workers.cli.common import UserError, connect, redis_failure, resolve_target, rich_console, target_options

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
WHEN_HELP = ("a duration before now (90s, 30m, 1h, 7d, 2w), a local date or time (2025-01-31, "
             "2025-01-31T12:00), unix seconds, or now")


def parse_when(text: str, now_s: float, option: str) -> int:
    """Unix ms of a ``--since``/``--until`` value (``WHEN_HELP``); UserError otherwise."""
    value = text.strip()
    if value == "now":
        return int(now_s * 1000)
    m = _DURATION.match(value)
    if m:
        return int((now_s - float(m.group(1)) * _UNIT_S[m.group(2)]) * 1000)
    try:
        return int(float(value) * 1000)
    except ValueError:
        pass
    try:
        return int(datetime.fromisoformat(value).timestamp() * 1000)
    except ValueError:
        raise UserError(f"{option}: cannot read {text!r} as {WHEN_HELP}") from None


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000).isoformat(timespec="seconds")


@click.command()
@target_options
@click.option("--since", default="24h", show_default=True, help=f"Start of the window: {WHEN_HELP}.")
@click.option("--until", default="now", show_default=True, help="End of the window, as --since.")
@click.option("--by", type=click.Choice(("tenant", "model", "class")), multiple=True,
              help="Sum per these (repeatable) [default: tenant, model and class].")
@click.option("--tenant", "tenants", multiple=True, help="Only the records of this tenant (repeatable).")
@click.option("--requests", "per_request", is_flag=True, help="List the records, one per request, too.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def usage(redis_url, cluster, since, until, by, tenants, per_request, as_json):
    """Tokens used per tenant, model and class (the usage ledger: one record per request,
    written with its answer): prompt (cached, pulled, computed), recomputed, output."""
    import redis

    from pdqueue.keys import Keys
    from pdqueue.queue import ledger

    now_s = time.time()
    since_ms, until_ms = parse_when(since, now_s, "--since"), parse_when(until, now_s, "--until")
    if since_ms > until_ms:
        raise UserError(f"--since ({_iso(since_ms)}) is after --until ({_iso(until_ms)})")
    target = resolve_target(redis_url, cluster)
    r = connect(target)
    keys = Keys(target.cluster)
    try:
        records = [rec for rec in ledger.read(r, keys, since_ms, until_ms) if not tenants or rec.tenant in tenants]
    except redis.RedisError as exc:   # lost, or a command the ACL user may not run (which it names)
        raise redis_failure(exc, target, role="usage") from None
    by = list(by) or list(ledger.GROUPINGS)
    report = {"cluster": target.cluster, "redis_url": target.shown_url, "since_ms": since_ms, "until_ms": until_ms,
              "by": by, "groups": ledger.totals(records, by), "total": ledger.totals(records, ())[0]}
    if per_request:
        report["requests"] = [rec.as_json() for rec in records]
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    rich_console().print(render(report, f"usage of pdqueue cluster {target.cluster!r} at {target.shown_url}, "
                                        f"{_iso(since_ms)} .. {_iso(until_ms)}"))


def render(report: dict, title: str):
    """The totals as a table (and the records, when listed)."""
    from rich.console import Group
    from rich.table import Table

    counts = ("requests", "prompt_tokens", "cached_tokens", "pulled_tokens", "computed_tokens",
              "recomputed_tokens", "output_tokens")
    heads = {"prompt_tokens": "prompt", "cached_tokens": "cached", "pulled_tokens": "pulled",
             "computed_tokens": "computed", "recomputed_tokens": "recomputed", "output_tokens": "output"}
    table = Table(title=title, title_justify="left")
    for name in report["by"]:
        table.add_column(name)
    for name in counts:
        table.add_column(heads.get(name, name), justify="right")
    for row in report["groups"]:
        table.add_row(*(row[b] or "-" for b in report["by"]), *(str(row[c]) for c in counts))
    total = report["total"]
    table.add_row(*(["total"] + [""] * (len(report["by"]) - 1)), *(str(total[c]) for c in counts), style="bold")
    parts = [table]
    if "requests" in report:
        listing = Table(title="requests", title_justify="left")
        for name in ("time", "request", "tenant", "ref", "model", "class", "outcome", *heads.values()):
            listing.add_column(name, justify="right" if name in heads.values() else "left")
        for rec in report["requests"]:
            listing.add_row(_iso(rec["at_ms"]), rec["request_id"], rec["tenant"] or "-", rec["ref"] or "-",
                            rec["model"] or "-", rec["class"] or "-", rec["outcome"],
                            *(str(rec[name]) for name in heads))
        parts.append(listing)
    return Group(*parts)
