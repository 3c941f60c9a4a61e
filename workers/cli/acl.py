"""`pdqueue acl`: least-privilege Redis ACL users for the roles of one cluster, printed as
``ACL SETUSER`` commands (pipe them into ``redis-cli``) or as ACL-file lines.

Roles (docs/security.md has the table and why):

- ``producer``: XADD to the service classes' request streams (``requests:high``, ``requests``,
  ``requests:batch``: ``queue.streams.request_streams``), XREAD of ``out:*``, SET of
  ``cancel:*``; nothing else (no SCAN, no other key, not even read of the request streams).
- ``gateway``: a producer, plus what ``pdqueue serve`` reads to route and report: the
  heartbeats (SCAN, HGETALL ``worker:*``) and the backlog (XINFO GROUPS, XLEN, XRANGE of the
  request and handoff streams, XLEN of ``done``/``dead``), and GET/SET of ``gw:*`` (the
  records of resumable requests: ``Idempotency-Key``, ``GET /v1/requests/{id}``), the
  Batch API's keys (``batch_api_rules``) and the Responses API's (``responses_api_rules``).
- ``worker``: the commands prefill, decode and colocated workers run (streams, consumer
  groups, heartbeats, idempotency and cancel keys, the Lua scripts, MULTI/EXEC), on the
  cluster's keys only.
- ``usage``: what ``pdqueue usage`` reads, and nothing else: XRANGE, XREVRANGE, XLEN and
  XINFO STREAM of the ``usage`` stream (the usage ledger), read-only; for billing.
- ``admin``: every non-dangerous command on the cluster's keys: ``status``, ``plan
  --apply``, ``metrics-sd``, ``batch``, ``up --redis-url``; a superset of the others.

Each user's commands are bound to key patterns with Redis 7 selectors (``(+set
~pdq:{NAME}:cancel:*)``), so a producer cannot SET a stream key nor XREAD a request
stream. The patterns come from ``pdqueue.keys.Keys``, so they follow the key layout.
Passwords never appear: each user's is a file in ``--password-dir`` (made, 0600, with 32
random bytes when absent) and the lines carry its SHA-256 (``#<hex>``). Needs Redis >= 7.0.

``CLIENT SETINFO`` (Redis >= 7.2, every Valkey): redis-py (>= 5), and most other clients, send
it on every connection; a user without it gets it refused, which the client ignores but the
server records in ``ACL LOG`` (128 entries by default, so that noise pushes out the refusals
that matter). So every role allows it, also for the users' own clients, which is why the
roles allow it rather than pdqueue's clients not sending it. Redis 7.0 does not know it and
refuses a rule that names it, so the rules are made for the server: ``--redis-url`` asks it
(``COMMAND INFO client|setinfo``), ``--redis-version`` says which; without either they are
for Redis >= 7.2 and Valkey (a note on stderr says so). A category (``+client -@admin
-@dangerous``) would fit every version with one output, but it also grants whatever
non-admin CLIENT subcommand a later server adds (Valkey 9 has CLIENT CAPA and IMPORT-SOURCE):
the rules name each subcommand.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shlex
from pathlib import Path

import click

from pdqueue.keys import Keys
from pdqueue.queue.streams import request_streams
from workers.cli.common import UserError, redis_security_options

ROLES = ("producer", "gateway", "worker", "usage", "admin")

CONNECTION = ("+ping", "+hello", "+select", "+echo", "+client|setname", "+client|getname", "+client|id",
              "+cluster|slots", "+cluster|shards", "+command")
"""What every client may do to its own connection (redis-py's health checks PING), and
what a Redis Cluster client reads before its first command (the slot map, the command
table; ``redis+cluster://`` URLs). Apply the users on every node of a Redis Cluster: ACLs
are per node. Plus ``SETINFO`` where the server knows it."""

SETINFO = "+client|setinfo"
"""What clients send on connect (library name and version) on Redis >= 7.2 and Valkey; a rule
naming it is an error on Redis 7.0 (see the module docstring)."""

SETINFO_SINCE = (7, 2)   # the first Redis version with CLIENT SETINFO (Valkey forked from 7.2.4)

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


def connection_rules(setinfo: bool = True) -> tuple[str, ...]:
    """``CONNECTION``, with ``SETINFO`` for a server that knows it."""
    return (*CONNECTION, SETINFO) if setinfo else CONNECTION


def role_rules(keys: Keys, role: str, setinfo: bool = True) -> list[str]:
    """The ACL rules of ``role`` (after ``reset on #<hash>``), key patterns from ``keys``;
    ``setinfo``: the server knows CLIENT SETINFO (Redis >= 7.2, Valkey)."""
    connection = connection_rules(setinfo)
    requests = [f"~{stream}" for stream in request_streams(keys)]
    producer = [*connection, "+xadd", *requests,
                _selector("+xread", f"~{keys.out('*')}"),
                # cancels; and read receipts (the answer of an `up`'s embedded server was read: its stop waits for them)
                _selector("+set", f"~{keys.cancel('*')}", f"~{keys.read('*')}"),
                # whether Redis still has a request not answered yet (pdqueue.client_outage.LostCheck):
                # queue lengths, the group's position and whether an entry is pending, never its fields
                _selector("+xlen", "+xinfo|groups", "+xpending", *requests),
                _selector("+exists", f"~{keys.seen('*')}", f"~{keys.out('*')}")]
    if role == "producer":
        return producer
    if role == "gateway":
        return [*producer, "+scan",
                _selector("+hgetall", "+hget", "+hmget", f"~{keys.worker('*')}"),
                _selector("+xinfo|groups", "+xlen", "+xrange", *requests, f"~{keys.handoff}",
                          f"~{keys.handoff_node('*')}", f"~{keys.requests_for('*')}"),
                _selector("+smembers", f"~{keys.routed_streams}"),   # every worker's own stream (backlog)
                _selector("+xlen", f"~{keys.done}", f"~{keys.dead}"),
                _selector("+get", "+set", f"~{keys.gateway_record('*')}"),   # resumable requests' records
                _selector("+get", "+set", f"~{keys.prefix}gwmodels"),   # the models last served (cluster_view.py)
                *batch_api_rules(keys, requests), *responses_api_rules(keys)]
    if role == "worker":   # the usage ledger (usage, usage:*) among the cluster's keys
        return [*connection, f"~{keys.prefix}*", *WORKER_COMMANDS]
    if role == "usage":   # `pdqueue usage`: the ledger, read-only
        return [*connection, _selector("+xrange", "+xrevrange", "+xlen", "+xinfo|stream", f"~{keys.usage}")]
    if role == "admin":
        return [f"~{keys.prefix}*", *ADMIN_COMMANDS, *connection]
    raise ValueError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")


def batch_api_rules(keys: Keys, requests: list[str]) -> list[str]:
    """What the gateway's Batch API runs (pdqueue/frontends/batch_store.py has the keys): its
    files, batch records, output lists and runner leases (the lease and output writes are Lua
    scripts, a batch's status a MULTI/EXEC); and placing a batch's requests as `pdqueue batch`
    does (one script: XADD and SET ``seen:<id>``; GET ``seen:*`` and EXISTS ``out:*`` to
    re-attach)."""
    from pdqueue.frontends.batch_store import BatchKeys

    bkeys = BatchKeys(keys)
    stored = [f"~{bkeys.file('*')}", f"~{bkeys.batch('*')}", f"~{bkeys.batches}", f"~{bkeys.active}"]
    return ["+multi", "+exec", "+discard",
            _selector("+get", "+set", "+getrange", "+hset", "+hget", "+hgetall", "+expire", "+pexpire", "+del",
                      "+llen", "+lrange", "+rpush", "+sadd", "+srem", "+smembers", "+zadd", "+zrevrange",
                      "+eval", "+evalsha", *stored),
            _selector("+eval", "+evalsha", *requests, f"~{keys.seen('*')}"),
            _selector("+get", "+set", f"~{keys.seen('*')}"),
            _selector("+exists", f"~{keys.out('*')}")]


def responses_api_rules(keys: Keys) -> list[str]:
    """What the gateway's Responses API runs (pdqueue/frontends/responses_store.py has the keys):
    its records (a hash each, finished by a Lua script) and the set of those not ended; and the
    last entry of an answer (XREVRANGE ``out:*``: has it ended?)."""
    from pdqueue.frontends.responses_store import ResponseKeys

    rkeys = ResponseKeys(keys)
    return [_selector("+hset", "+hget", "+hgetall", "+exists", "+expire", "+del", "+zadd", "+zrem", "+zrange",
                      "+eval", "+evalsha", f"~{rkeys.record('*')}", f"~{rkeys.active}"),
            _selector("+xrevrange", f"~{keys.out('*')}")]


def password_hash(password: str) -> str:
    return hashlib.sha256(password.encode()).hexdigest()


def setuser_args(keys: Keys, role: str, password: str, setinfo: bool = True) -> list[str]:
    """The arguments of ``ACL SETUSER`` for ``role`` (idempotent: ``reset`` first)."""
    return [user_name(keys.cluster, role), "reset", "on", f"#{password_hash(password)}",
            *role_rules(keys, role, setinfo)]


def version_knows_setinfo(version: str) -> bool:
    """Whether a server of this version (``7.0.15``, ``7.2``, ``8``; a Valkey reports 7.2.4 as
    its ``redis_version``, and any Valkey version, 7.2 and up, is >= 7.2 too) knows CLIENT
    SETINFO. ValueError for what is not a version."""
    parts = version.strip().split(".")
    try:
        numbers = tuple(int(p) for p in parts[:2])
    except ValueError:
        raise ValueError(f"not a version: {version!r} (e.g. 7.0.15 or 8.2)") from None
    if not numbers or any(n < 0 for n in numbers):
        raise ValueError(f"not a version: {version!r} (e.g. 7.0.15 or 8.2)")
    if numbers < (7, 0):
        raise ValueError(f"Redis {version} has no ACL selectors: the roles need Redis >= 7.0")
    return numbers >= SETINFO_SINCE


def server_knows_setinfo(r) -> bool:
    """Ask the server: ``COMMAND INFO client|setinfo`` is nil for a command it does not know.
    Sent as ``"COMMAND INFO"`` (redis-py splits the name), so that the reply comes back raw:
    redis-py's parser for ``COMMAND`` fails on the nil."""
    reply = r.execute_command("COMMAND INFO", "client|setinfo")
    return bool(reply) and reply[0] is not None


def _setinfo_for(redis_url: str | None, redis_version: str | None) -> tuple[bool, str]:
    """Whether the rules name CLIENT SETINFO, and the note that says for which server."""
    if redis_url and redis_version:
        raise UserError("give --redis-url (ask the server) or --redis-version, not both")
    if redis_version:
        try:
            known = version_knows_setinfo(redis_version)
        except ValueError as exc:
            raise UserError(f"--redis-version: {exc}") from None
        return known, f"rules for Redis {redis_version.strip()}"
    if redis_url:
        import redis

        from pdqueue.config import redact_url
        from pdqueue.discovery import DiscoveryError, resolve
        from pdqueue.queue.connection import connect, describe_error

        try:
            # The URL of a running `pdqueue up`'s server, with no password of the caller's: that
            # `up`'s (its state file), as every other command finds it.
            r = connect(resolve(redis_url).url, purpose="check")
            try:
                known = server_knows_setinfo(r)
                version = r.info("server").get("redis_version", "?")
            finally:
                r.close()
        except (redis.RedisError, ValueError, OSError, DiscoveryError) as exc:
            raise UserError(f"--redis-url: cannot ask Redis at {redact_url(redis_url)}: "
                            f"{describe_error(exc)}") from None
        version = version.decode() if isinstance(version, bytes) else version
        return known, f"rules for the server at {redact_url(redis_url)} (redis_version {version})"
    return True, ("rules for Redis >= 7.2 and Valkey (they allow CLIENT SETINFO, which clients send on "
                  "connect); for Redis 7.0 give --redis-version 7.0, or --redis-url to ask the server")


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
@click.option("--redis-url", default=None,
              help="Ask this server which commands it knows (CLIENT SETINFO: Redis >= 7.2, Valkey) and make the "
                   "rules for it; credentials as for other commands (--redis-password-file, PDQ_REDIS_PASSWORD).")
@click.option("--redis-version", default=None,
              help="Make the rules for this server version instead (e.g. 7.0.15; a Valkey: 7.2 or later) "
                   "[default: Redis >= 7.2 and Valkey].")
@redis_security_options
def acl(cluster, roles, password_dir, fmt, redis_url, redis_version):
    """Print least-privilege Redis ACL users for a cluster's roles (producer, gateway,
    worker, usage, admin; see docs/security.md). Needs Redis >= 7.0; the rules allow CLIENT
    SETINFO, which Redis 7.0 does not know: give --redis-url (or --redis-version).

    \b
    Example (apply as a user allowed to run ACL SETUSER):
      pdqueue acl --cluster default --password-dir ~/.config/pdqueue/redis-users \\
        --redis-url redis://127.0.0.1:6379/0 | redis-cli
      pdqueue submit --redis-url redis://pdq-default-producer@127.0.0.1:6379/0 \\
        --redis-password-file ~/.config/pdqueue/redis-users/pdq-default-producer "Hello"
    """
    try:
        keys = Keys(cluster)
    except ValueError as exc:
        raise UserError(f"--cluster: {exc}") from None
    setinfo, for_server = _setinfo_for(redis_url, redis_version)
    directory = Path(password_dir).expanduser()
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        made = []
        for role in roles or ROLES:
            user = user_name(cluster, role)
            password, new = user_password(directory, user)
            if new:
                made.append(user)
            click.echo(format_user(setuser_args(keys, role, password, setinfo), fmt))
    except (OSError, ValueError) as exc:
        raise UserError(f"--password-dir {password_dir}: {getattr(exc, 'strerror', None) or exc}") from None
    note = f"new passwords: {', '.join(made)}; " if made else ""
    click.secho(f"{note}password files in {shlex.quote(str(directory))} (one per user; the lines carry only "
                f"their SHA-256); {for_server}", fg="cyan", err=True)
