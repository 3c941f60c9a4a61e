"""The one place Redis clients are made, with their timeouts, credentials and TLS.

``connect(url, purpose=...)`` picks the timeouts by what the client is for (``TIMEOUTS``:
``worker``, ``check``, ``admin``, ``supervisor``, ``poll``). Credentials and TLS come from
``pdqueue.config.redis_security``, which ``RedisConfig.redis_kwargs`` (the Client) applies
too, so every connection pdqueue makes is secured the same way. ``connect_async`` is the
``redis.asyncio`` twin.

A ``redis+cluster://`` (``rediss+cluster://``) URL names a Redis Cluster by one or more of
its nodes: the client is then redis-py's RedisCluster (``LazyRedisCluster``,
``AsyncRedisCluster``), whose transient errors (CLUSTERDOWN during a failover, no
reachable node, a slot on the move) are raised as ``ClusterUnavailable``, a
``redis.ConnectionError``: callers retry them as they retry a Redis restart. The scheme
decides, not a probe: the kind of client is known before any I/O, a URL says the same in
every process and in ``ps``, and a plain URL of a cluster node is caught by ``check_mode``.

``classify_error(exc)`` says what a Redis error means for the one who met it
(``ErrorKind``), so that messages do not say "cannot reach" for a server that answered.

The RESP parser: hiredis when importable, else redis-py's Python parser;
``PDQ_REDIS_PARSER=python|hiredis|auto`` forces one for the plain clients made from then
on (``pdqueue bench gateway --variants`` compares them); ``redis_parser()`` says which.

``raise_dropped_cancellation()`` works around redis.asyncio on Python 3.11 dropping a
task's cancellation inside a command; loops that read until an answer ends call it.

Imports redis only.
"""

from __future__ import annotations

import asyncio
import enum
import os
import re
import threading
from contextlib import contextmanager
from typing import NamedTuple

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster
import redis.utils
from redis.commands.helpers import list_or_args

from pdqueue.config import redact_url, redis_security


class Timeouts(NamedTuple):
    socket_s: float | None          # any command (None: wait for ever)
    connect_s: float                # opening the connection
    health_check_s: int = 0         # PING a connection idle this long before using it (0: never)


TIMEOUTS: dict[str, Timeouts] = {
    # A worker's reads block at most 100 ms, so 30 s fires only on a dead connection; the
    # health check reconnects one that went stale while idle (RedisConfig's defaults too).
    "worker": Timeouts(socket_s=30.0, connect_s=5.0, health_check_s=30),
    "check": Timeouts(socket_s=3.0, connect_s=3.0),        # is Redis there at all (the CLI)
    "admin": Timeouts(socket_s=10.0, connect_s=3.0),       # status, submit: fail, not hang
    "supervisor": Timeouts(socket_s=5.0, connect_s=3.0),   # pdqueue up watching its workers
    "poll": Timeouts(socket_s=5.0, connect_s=5.0),         # the gateway's ClusterView
}


def _kwargs(url: str, purpose: str) -> dict:
    t = TIMEOUTS[purpose]
    return {"socket_timeout": t.socket_s, "socket_connect_timeout": t.connect_s,
            "health_check_interval": t.health_check_s, **redis_security(url)}


def connect(url: str, *, purpose: str = "worker") -> redis.Redis:
    """A ``redis.Redis`` for ``url`` (bytes replies) with the timeouts of ``purpose`` and
    the credentials and TLS settings in force (ValueError if those cannot be used); for a
    ``redis+cluster://`` URL a ``LazyRedisCluster``."""
    return client_from_url(url, **_kwargs(url, purpose))


def connect_async(url: str, *, purpose: str = "worker") -> redis.asyncio.Redis:
    """``connect`` for asyncio: a ``redis.asyncio.Redis`` (bytes replies), or an
    ``AsyncRedisCluster``."""
    return async_client_from_url(url, **_kwargs(url, purpose))


# ---- what an error means -------------------------------------------------------------------

class ErrorKind(enum.Enum):
    NEEDS_PASSWORD = "needs_password"    # NOAUTH: the server wants credentials and none were sent
    BAD_CREDENTIALS = "bad_credentials"  # WRONGPASS, a wrong password, or one for a server that has none
    NO_PERMISSION = "no_permission"      # NOPERM: the ACL user may not run that command or touch that key
    UNREACHABLE = "unreachable"          # no answer: refused, timed out, closed, no cluster node
    OTHER = "other"                      # the server answered with another error


def classify_error(exc: BaseException) -> ErrorKind:
    """What ``exc`` (raised by redis-py, or an OSError) means. redis-py raises an
    ``AuthenticationError``, a ``ConnectionError``, for NOAUTH, WRONGPASS and AUTH without a
    server password alike: the reply's code (``status_code``, redis-py >= 5.1) or its text
    tells them apart."""
    code = getattr(exc, "status_code", None)
    text = str(exc)
    if isinstance(exc, redis.exceptions.NoPermissionError) or code == "NOPERM" or text.startswith("NOPERM"):
        return ErrorKind.NO_PERMISSION
    if isinstance(exc, (redis.exceptions.AuthenticationError, redis.exceptions.AuthenticationWrongNumberOfArgsError)):
        if code == "NOAUTH" or text.startswith(("Authentication required", "HELLO must be called", "NOAUTH")):
            return ErrorKind.NEEDS_PASSWORD
        return ErrorKind.BAD_CREDENTIALS
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError, OSError)):
        return ErrorKind.UNREACHABLE
    if isinstance(exc, redis.ResponseError) and "no permissions" in text.lower():   # e.g. inside a script
        return ErrorKind.NO_PERMISSION
    return ErrorKind.OTHER


def error_text(exc: BaseException) -> str:
    """The error's own words on one line, without a final period."""
    return " ".join(str(exc).split()).rstrip(".") or type(exc).__name__


def describe_error(exc: BaseException) -> str:
    """``error_text``, led by what it means where the words alone mislead (a NOAUTH reply
    reads "HELLO must be called ..." on Redis >= 7.2)."""
    kind = classify_error(exc)
    lead = {ErrorKind.NEEDS_PASSWORD: "the server wants a password", ErrorKind.BAD_CREDENTIALS:
            "wrong credentials", ErrorKind.NO_PERMISSION: "no permission"}.get(kind)
    return f"{lead} ({error_text(exc)})" if lead else error_text(exc)


# ---- Redis Cluster ------------------------------------------------------------------------
#
# A URL whose scheme is ``redis+cluster://`` (``rediss+cluster://`` with TLS) names a Redis
# Cluster: one or more of its nodes, comma-separated (``redis+cluster://h1:7000,h2:7001``),
# which are only where the client starts: it learns the slot map from them (CLUSTER SLOTS)
# and follows MOVED/ASK from then on (redis-py's RedisCluster). Every key of a pdqueue
# cluster is ``pdq:{NAME}:...``, so every multi-key command, MULTI/EXEC and Lua script of
# one pdqueue cluster goes to the one master that serves that slot.

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


class ClusterUnavailable(redis.ConnectionError):
    """The Redis Cluster cannot serve the slot now: no reachable node, the slot's master is
    down and not yet replaced (CLUSTERDOWN), a slot on the move (MOVED/ASK/TRYAGAIN after
    the client's own retries). A ``redis.ConnectionError``, so every caller that survives a
    Redis restart (workers, publisher, heartbeat, clients) retries it the same way."""


_TRANSIENT_CLUSTER_ERRORS = (redis.exceptions.ClusterError, redis.exceptions.TryAgainError,
                             redis.exceptions.AskError, redis.exceptions.SlotNotCoveredError)
# RedisClusterException is also raised for a programming error (keys in two slots in one
# transaction): only these messages mean "the cluster cannot be reached or agree right now".
# Its subclasses too: redis-py >= 8.2 raises RedisClusterUnreachableError ("cannot be connected").
_TRANSIENT_MESSAGES = ("cannot be connected", "could not agree", "not covered", "No targets were found")


def _transient(exc: BaseException) -> bool:
    if "Cluster mode is not enabled" in str(exc):   # a plain server, or CLUSTER SLOTS refused by ACL
        return False
    if isinstance(exc, _TRANSIENT_CLUSTER_ERRORS):
        return True
    return (isinstance(exc, redis.exceptions.RedisClusterException)
            and any(m in str(exc) for m in _TRANSIENT_MESSAGES))


def _unavailable(exc: BaseException) -> ClusterUnavailable:
    return ClusterUnavailable(f"Redis Cluster unavailable: {exc}")


@contextmanager
def translated_errors():
    """Transient cluster errors raised inside become ``ClusterUnavailable`` (a
    ConnectionError: every retry path handles them); the others pass unchanged. Serves
    sync and async calls alike (the ``await`` runs inside the block)."""
    try:
        yield
    except Exception as exc:
        if _transient(exc):
            raise _unavailable(exc) from exc
        raise


def is_cluster_url(url: str) -> bool:
    """True for ``redis+cluster://`` and ``rediss+cluster://`` URLs."""
    return url.split("://", 1)[0].lower() in CLUSTER_SCHEMES


def cluster_nodes(url: str) -> tuple[str, list[tuple[str, int]]]:
    """(the plain ``redis://``/``rediss://`` URL of the first node, with the credentials and
    query of ``url``; every (host, port) listed). ValueError for a malformed URL or a
    database other than 0 (a cluster has only database 0)."""
    scheme, sep, rest = url.partition("://")
    plain = CLUSTER_SCHEMES.get(scheme.lower())
    if not sep or plain is None:
        raise ValueError(f"not a Redis Cluster URL (redis+cluster:// or rediss+cluster://): {redact_url(url)}")
    netloc, tail = re.match(r"^([^/?#]*)(.*)$", rest).groups()   # tail: "/0?a=b", "?a=b" or ""
    path, _, query = tail.partition("?")
    userinfo, at, hostlist = netloc.rpartition("@")
    nodes = []
    for item in hostlist.split(","):
        item = item.strip()
        if item.startswith("["):
            host, _, port = item[1:].partition("]")
            port = port.lstrip(":")
        else:
            host, _, port = item.partition(":")
        if not host:
            raise ValueError(f"a Redis Cluster URL needs host[:port] for each node: {redact_url(url)}")
        try:
            nodes.append((host, int(port) if port else 6379))
        except ValueError:
            raise ValueError(f"bad port {port!r} in {redact_url(url)}") from None
    path = path.strip("/")
    if path not in ("", "0"):
        raise ValueError(f"a Redis Cluster has only database 0, not {path!r}: {redact_url(url)}")
    host, port = nodes[0]
    first = f"[{host}]" if ":" in host else host
    return f"{plain}://{userinfo}{at}{first}:{port}" + (f"?{query}" if query else ""), nodes


def _stream_read_keys(command, args) -> list | None:
    """The stream keys of an XREAD/XREADGROUP (``args`` after the command name), else None.
    redis-py asks the server (COMMAND GETKEYS, one more round trip, twice per call) for
    commands with "movable keys", which these two are; their keys are simply the first half
    of what follows STREAMS (after GROUP's two names for XREADGROUP)."""
    name = command.decode() if isinstance(command, bytes) else str(command)
    name = name.upper()
    if name not in ("XREAD", "XREADGROUP"):
        return None
    start = 3 if name == "XREADGROUP" else 0
    for i in range(start, len(args)):
        word = args[i]
        if (word.decode() if isinstance(word, bytes) else str(word)).upper() == "STREAMS":
            rest = args[i + 1:]
            return list(rest[:len(rest) // 2]) or None
    return None


def _one_slot(client, command, keys) -> int:
    slots = {client.keyslot(key) for key in keys}
    if len(slots) != 1:
        raise redis.exceptions.RedisClusterException(f"{command} - all keys must map to the same key slot")
    return slots.pop()


class _SlotOfStreams:
    """``determine_slot`` without a round trip for XREAD/XREADGROUP (sync clients and pipelines)."""

    def determine_slot(self, *args):
        keys = _stream_read_keys(args[0], args[1:]) if args else None
        if keys:
            return _one_slot(self, args[0], keys)
        return super().determine_slot(*args)


class ClusterPipeline(_SlotOfStreams, redis.cluster.ClusterPipeline):
    """redis-py's cluster pipeline with what pdqueue's callers use of a plain pipeline:
    ``eval(script, numkeys, *keys_and_args)`` and ``mget`` (redis-py blocks both in cluster
    pipelines; they are routed by their keys like any keyed command), ``command_stack`` (the
    queued commands, as ``Pipeline.command_stack``: the publisher undoes a unit's commands
    with it) and transient cluster errors as ``ClusterUnavailable``."""

    @property
    def command_stack(self) -> list:
        strategy = getattr(self, "_execution_strategy", None)
        return strategy.command_queue if strategy is not None else []

    @command_stack.setter
    def command_stack(self, value: list) -> None:   # ClusterPipeline.__init__ sets [] first
        strategy = getattr(self, "_execution_strategy", None)
        if strategy is not None:
            strategy.command_queue = value

    def eval(self, script, numkeys, *keys_and_args):  # noqa: A003 - redis-py's name
        return self.execute_command("EVAL", script, numkeys, *keys_and_args)

    def mget(self, keys, *args):
        """MGET of keys in one slot (redis-py blocks MGET in cluster pipelines)."""
        return self.execute_command("MGET", *list_or_args(keys, args))

    def execute(self, raise_on_error: bool = True):
        with translated_errors():
            return super().execute(raise_on_error)


class RedisCluster(_SlotOfStreams, redis.cluster.RedisCluster):
    """redis-py's RedisCluster whose transient cluster errors are ``ClusterUnavailable``
    and whose pipelines are ``ClusterPipeline`` (transactions in one slot, EVAL)."""

    def execute_command(self, *args, **kwargs):
        with translated_errors():
            return super().execute_command(*args, **kwargs)

    def pipeline(self, transaction=None, shard_hint=None):
        if shard_hint:
            raise redis.exceptions.RedisClusterException("shard_hint is deprecated in cluster mode")
        return ClusterPipeline(
            nodes_manager=self.nodes_manager, commands_parser=self.commands_parser,
            startup_nodes=self.nodes_manager.startup_nodes, result_callbacks=self.result_callbacks,
            cluster_response_callbacks=self.cluster_response_callbacks,
            read_from_replicas=self.read_from_replicas, load_balancing_strategy=self.load_balancing_strategy,
            reinitialize_steps=self.reinitialize_steps, retry=self.retry, lock=self._lock,
            transaction=transaction, event_dispatcher=self._event_dispatcher)


class LazyRedisCluster:
    """A ``RedisCluster`` made on first use, like a plain ``redis.Redis`` (which connects on
    its first command): redis-py's sync cluster client reads the slot map in its
    constructor, so a worker or a gateway made while no node answers would fail at once.
    Here the first use raises ``ClusterUnavailable`` and the next one tries again. Every
    attribute is the real client's."""

    def __init__(self, url: str, nodes: list[tuple[str, int]], kwargs: dict):
        self._url, self._nodes, self._kwargs = url, nodes, kwargs
        self._client: RedisCluster | None = None
        self._lock = threading.Lock()

    @property
    def client(self) -> RedisCluster:
        client = self._client
        if client is None:
            with self._lock:
                if self._client is None:
                    others = [redis.cluster.ClusterNode(h, p) for h, p in self._nodes[1:]]
                    try:
                        with translated_errors():
                            self._client = RedisCluster.from_url(self._url, startup_nodes=others, **self._kwargs)
                    except Exception as exc:
                        if "Cluster mode is not enabled" in str(exc):
                            raise ValueError(f"{redact_url(self._url)} is not a Redis Cluster node, or its "
                                             "user may not run CLUSTER SLOTS (pdqueue acl grants it): "
                                             "for a plain server use a redis:// URL") from None
                        raise
                client = self._client
        return client

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.client, name)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LazyRedisCluster({redact_url(self._url)}, {len(self._nodes)} startup nodes)"


class AsyncClusterPipeline(redis.asyncio.cluster.ClusterPipeline):
    """``ClusterPipeline`` for asyncio (``eval``, ``ClusterUnavailable``)."""

    def eval(self, script, numkeys, *keys_and_args):  # noqa: A003
        return self.execute_command("EVAL", script, numkeys, *keys_and_args)

    def mget(self, keys, *args):
        return self.execute_command("MGET", *list_or_args(keys, args))

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True):
        with translated_errors():
            return await super().execute(raise_on_error, allow_redirections)


class AsyncRedisCluster(redis.asyncio.cluster.RedisCluster):
    """redis.asyncio's RedisCluster (it reads the slot map on first use) with
    ``ClusterUnavailable`` and ``AsyncClusterPipeline``."""

    async def _determine_slot(self, command, *args):
        keys = _stream_read_keys(command, args)
        if keys:
            return _one_slot(self, command, keys)
        return await super()._determine_slot(command, *args)

    async def execute_command(self, *args, **kwargs):
        with translated_errors():
            return await super().execute_command(*args, **kwargs)

    def pipeline(self, transaction=None, shard_hint=None):
        if shard_hint:
            raise redis.exceptions.RedisClusterException("shard_hint is deprecated in cluster mode")
        return AsyncClusterPipeline(self, transaction)


# ---- the RESP parser ----------------------------------------------------------------------

REDIS_PARSERS = ("auto", "hiredis", "python")
PARSER_ENV = "PDQ_REDIS_PARSER"


def redis_parser() -> str:
    """The parser of the clients made now: "hiredis" or "python" (``PDQ_REDIS_PARSER``,
    else redis-py's own choice). ValueError for an unknown name, or "hiredis" without it."""
    wanted = (os.environ.get(PARSER_ENV) or "auto").strip().lower()
    if wanted not in REDIS_PARSERS:
        raise ValueError(f"{PARSER_ENV}={wanted!r}: expected one of {', '.join(REDIS_PARSERS)}")
    available = bool(getattr(redis.utils, "HIREDIS_AVAILABLE", False))
    if wanted == "hiredis" and not available:
        raise ValueError(f"{PARSER_ENV}=hiredis, but hiredis (>= 3.2) is not installed: "
                         "pip install 'pdqueue[fast]', or use auto")
    return "python" if wanted == "python" or not available else "hiredis"


def _parser_kwargs(asynchronous: bool) -> dict:
    """``parser_class`` for a plain client when the Python parser is asked for while hiredis
    is installed (else nothing: redis-py's default is the one wanted). The RESP2 classes:
    redis-py moves them to RESP3 when the connection speaks protocol 3."""
    if redis_parser() != "python" or not getattr(redis.utils, "HIREDIS_AVAILABLE", False):
        return {}
    from redis._parsers import _AsyncRESP2Parser, _RESP2Parser

    return {"parser_class": _AsyncRESP2Parser if asynchronous else _RESP2Parser}


def client_from_url(url: str, **kwargs):
    """A client for ``url`` with redis-py keyword arguments ``kwargs``: ``redis.Redis``, or
    for ``redis+cluster://`` a cluster client (``LazyRedisCluster``; the per-node pool
    size ``max_connections`` and the timeouts apply to each node)."""
    if not is_cluster_url(url):
        return redis.Redis.from_url(url, **{**_parser_kwargs(False), **kwargs})
    first, nodes = cluster_nodes(url)
    kwargs.pop("db", None)
    return LazyRedisCluster(first, nodes, kwargs)


def async_client_from_url(url: str, **kwargs):
    """``client_from_url`` for asyncio: ``redis.asyncio.Redis`` or ``AsyncRedisCluster``."""
    if not is_cluster_url(url):
        return redis.asyncio.Redis.from_url(url, **{**_parser_kwargs(True), **kwargs})
    first, nodes = cluster_nodes(url)
    kwargs.pop("db", None)
    others = [redis.asyncio.cluster.ClusterNode(h, p) for h, p in nodes[1:]]
    return AsyncRedisCluster.from_url(first, startup_nodes=others or None, **kwargs)


def is_cluster_client(r) -> bool:
    return isinstance(r, (LazyRedisCluster, redis.cluster.RedisCluster, redis.asyncio.cluster.RedisCluster))


def check_mode(r, url: str) -> None:
    """One round trip: ValueError when ``url``'s scheme and the server disagree (a plain
    ``redis://`` URL of a Redis Cluster node would get MOVED for most keys; a
    ``redis+cluster://`` URL of a plain server cannot read a slot map)."""
    if is_cluster_url(url):
        return   # the client read CLUSTER SLOTS already: a plain server fails that itself
    try:
        # CLUSTER SLOTS, not INFO: every ACL role of `pdqueue acl` may run it (cluster clients
        # need it), so the check never shows up as a denial. A plain server answers an error.
        r.execute_command("CLUSTER", "SLOTS")
    except redis.ResponseError:
        return   # cluster support disabled (a plain server), or not allowed: nothing to tell
    else:
        shown = redact_url(url)
        raise ValueError(f"{shown} is a Redis Cluster node: use redis+cluster://{shown.split('://', 1)[1]}")


def raise_dropped_cancellation() -> None:
    """Raise the cancellation of this task that a Redis call dropped. On Python 3.11 redis-py
    times out a command's write with ``asyncio.wait_for``, which returns normally when the
    cancellation lands just as the write completes (fixed in 3.12): the request stays counted
    in ``Task.cancelling()`` but nothing is raised, and a stream would read on to its answer's
    end. Code that suppresses a cancellation on purpose calls ``uncancel()``, so a count left
    here is one that was lost. (Python 3.10 has the same ``wait_for`` but no count to read:
    there a dropped cancellation stays dropped.) Seen again with redis-py 8.2 on 3.11 (at
    least 5 of ~100 cancels during HMGET/XLEN went unseen), so every asyncio loop that reads
    Redis until it ends calls this: the client's streams and submit retry, the gateway's batch
    runner, the serve bench's timeline sampler."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)   # Python 3.11+
    if cancelling is not None and cancelling():
        raise asyncio.CancelledError()
