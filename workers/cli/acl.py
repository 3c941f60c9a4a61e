"""`pdqueue acl`: least-privilege Redis ACL users for the roles of one cluster, printed as
``ACL SETUSER`` commands (pipe them into ``redis-cli``) or as ACL-file lines.

Roles (docs/security.md has the table and why):

- ``producer``: XADD to ``requests`` and ``requests:high``, XREAD of ``out:*``, SET of
  ``cancel:*``; nothing else (no SCAN, no other key, not even read of the request streams).
- ``gateway``: a producer, plus what ``pdqueue serve`` reads to route and report: the
  heartbeats (SCAN, HGETALL ``worker:*``) and the backlog (XINFO GROUPS, XLEN, XRANGE of the
  request and handoff streams, XLEN of ``done``/``dead``).
- ``worker``: the commands prefill, decode and colocated workers run (streams, consumer
  groups, heartbeats, idempotency and cancel keys, the Lua scripts, MULTI/EXEC), on the
  cluster's keys only.
- ``admin``: every non-dangerous command on the cluster's keys: ``status``, ``plan
  --apply``, ``metrics-sd``, ``batch``, ``up --redis-url``; a superset of the others.

Each user's commands are bound to key patterns with Redis 7 selectors (``(+set
~pdq:{NAME}:cancel:*)``), so a producer cannot SET a stream key nor XREAD a request
stream. The patterns come from ``pdqueue.keys.Keys``, so they follow the key layout.
Passwords never appear: each user's is a file in ``--password-dir`` (made, 0600, with 32
random bytes when absent) and the lines carry its SHA-256 (``#<hex>``). Needs Redis >= 7.0.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shlex
from pathlib import Path

import click

from pdqueue.keys import Keys
from workers.cli.common import UserError

ROLES = ("producer", "gateway", "worker", "admin")

CONNECTION = ("+ping", "+hello", "+select", "+echo", "+client|setname", "+client|getname", "+client|id",
              "+cluster|slots", "+cluster|shards", "+command")
"""What every client may do to its own connection (redis-py's health checks PING), and
what a Redis Cluster client reads before its first command (the slot map, the command
table; ``redis+cluster://`` URLs). Apply the users on every node of a Redis Cluster: ACLs
are per node."""

WORKER_COMMANDS = (
    # streams and consumer groups: requests, handoffs, answers, done, dead, control, events
    "+xadd", "+xreadgroup", "+xread", "+xack", "+xdel", "+xgroup|create", "+xpending", "+xclaim", "+xautoclaim",
    "+xrange", "+xrevrange", "+xlen", "+xinfo|groups", "+xinfo|stream",
    # heartbeats (worker:*), idempotency (seen:*), cancels, the KV secret, TTLs
    "+hset", "+hget", "+hmget", "+hgetall", "+get", "+set", "+exists", "+del", "+expire", "+pexpire", "+scan",
    # ack_and_write / touch_owned / forward (pdqueue/queue/ownership.py), the publisher's MULTI/EXEC, the
    # planner's clock
    "+eval", "+evalsha", "+multi", "+exec", "+discard", "+time",
    # cache-aware routing (workers/routing.py): advertisements (prefix:*), the set of own streams
    "+mget", "+sadd", "+smembers", "+srem",
)

ADMIN_COMMANDS = ("+@all", "-@dangerous", "-@admin", "-function", "-script|flush", "-script|kill")
"""Everything but what could hurt the server or other applications (FLUSHALL, CONFIG,
KEYS, DEBUG, SHUTDOWN, server-wide functions and the script cache)."""


def user_name(cluster: str, role: str) -> str:
    return f"pdq-{cluster}-{role}"


def _selector(*rules: str) -> str:
    return "(" + " ".join(rules) + ")"


def role_rules(keys: Keys, role: str) -> list[str]:
    """The ACL rules of ``role`` (after ``reset on #<hash>``), key patterns from ``keys``."""
    requests = [f"~{keys.requests}", f"~{keys.requests_high}"]
    producer = [*CONNECTION, "+xadd", *requests,
                _selector("+xread", f"~{keys.out('*')}"),
                _selector("+set", f"~{keys.cancel('*')}")]
    if role == "producer":
        return producer
    if role == "gateway":
        return [*producer, "+scan",
                _selector("+hgetall", "+hget", "+hmget", f"~{keys.worker('*')}"),
                _selector("+xinfo|groups", "+xlen", "+xrange", *requests, f"~{keys.handoff}",
                          f"~{keys.handoff_node('*')}", f"~{keys.requests_for('*')}"),
                _selector("+smembers", f"~{keys.routed_streams}"),   # every worker's own stream (backlog)
                _selector("+xlen", f"~{keys.done}", f"~{keys.dead}")]
    if role == "worker":
        return [*CONNECTION, f"~{keys.prefix}*", *WORKER_COMMANDS]
    if role == "admin":
        return [f"~{keys.prefix}*", *ADMIN_COMMANDS, *CONNECTION]
    raise ValueError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")


def password_hash(password: str) -> str:
    return hashlib.sha256(password.encode()).hexdigest()


def setuser_args(keys: Keys, role: str, password: str) -> list[str]:
    """The arguments of ``ACL SETUSER`` for ``role`` (idempotent: ``reset`` first)."""
    return [user_name(keys.cluster, role), "reset", "on", f"#{password_hash(password)}", *role_rules(keys, role)]


def format_user(args: list[str], fmt: str) -> str:
    """One ``ACL SETUSER`` command, a selector double-quoted as redis-cli splits arguments;
    or one ACL-file line, which Redis splits at spaces (selectors are re-joined there)."""
    if fmt == "aclfile":
        return " ".join(["user", *args])
    return " ".join(["ACL SETUSER", *(f'"{a}"' if " " in a else a for a in args)])


def user_password(directory: Path, user: str) -> tuple[str, bool]:
    """The password in ``directory/user`` (first line), made (0600, 64 hex digits) when absent;
    and whether it was made now."""
    path = directory / user
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        from pdqueue.config import read_password_file

        return read_password_file(str(path), "--password-dir"), False
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return (path.read_text().splitlines() or [""])[0], True


@click.command()
@click.option("--cluster", envvar="PDQ_CLUSTER", show_envvar=True, default="default", show_default=True,
              help="pdqueue cluster name: the users' key patterns are its keys (pdq:{NAME}:*).")
@click.option("--role", "roles", type=click.Choice(ROLES), multiple=True,
              help="A role to print (repeatable) [default: all].")
@click.option("--password-dir", type=click.Path(file_okay=False), required=True,
              help="Directory of the users' password files, one per user, named after it (e.g. "
                   "pdq-default-producer): read when present, else made with a random password (mode 0600).")
@click.option("--format", "fmt", type=click.Choice(["setuser", "aclfile"]), default="setuser", show_default=True,
              help="setuser: ACL SETUSER commands (pipe into redis-cli); aclfile: lines for an ACL file (aclfile).")
def acl(cluster, roles, password_dir, fmt):
    """Print least-privilege Redis ACL users for a cluster's roles (producer, gateway,
    worker, admin; see docs/security.md). Needs Redis >= 7.0.

    \b
    Example (apply as a user allowed to run ACL SETUSER):
      pdqueue acl --cluster default --password-dir ~/.config/pdqueue/redis-users | redis-cli
      pdqueue submit --redis-url redis://pdq-default-producer@127.0.0.1:6379/0 \\
        --redis-password-file ~/.config/pdqueue/redis-users/pdq-default-producer "Hello"
    """
    try:
        keys = Keys(cluster)
    except ValueError as exc:
        raise UserError(f"--cluster: {exc}") from None
    directory = Path(password_dir).expanduser()
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        made = []
        for role in roles or ROLES:
            user = user_name(cluster, role)
            password, new = user_password(directory, user)
            if new:
                made.append(user)
            click.echo(format_user(setuser_args(keys, role, password), fmt))
    except (OSError, ValueError) as exc:
        raise UserError(f"--password-dir {password_dir}: {getattr(exc, 'strerror', None) or exc}") from None
    note = f"new passwords: {', '.join(made)}; " if made else ""
    click.secho(f"{note}password files in {shlex.quote(str(directory))} (one per user; the lines carry only "
                f"their SHA-256)", fg="cyan", err=True)
