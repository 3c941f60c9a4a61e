"""How the client rides out a Redis outage: which errors a command may be sent again after
(``transient``), a submit's window of retries (``Submitting``), a stream read's outage limit
(``ReadOutage``), and ``RedisUnavailable``, raised past them, or at once when the server is
gone for good (``EmbeddedServer``: a stopped ``pdqueue up``'s); and a request that Redis itself
lost (``LostCheck``: a failover to a replica that had not received it yet, a restart without
persistence), sent again. ``pdqueue.client``'s docstring
says what the client promises; this holds the mechanics.

Imports redis and pdqueue's config, keys, procs, protocol (``as_str``) and retry only.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Sequence

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pdqueue.config import redact_url
from pdqueue.keys import PREFILL_GROUP, Keys
from pdqueue.procs import pid_alive
from pdqueue.protocol import as_str
from pdqueue.retry import backoff_delay

log = logging.getLogger("pdqueue.client")


class RedisUnavailable(RedisConnectionError):
    """Redis stayed unreachable for ``RedisConfig.unavailable_after_s`` while a stream was
    being read, or for ``submit_retry_s`` while a submit was sent (shorter outages, like a
    restart, are retried and never raise this). ``request_ids``: the submit's requests
    (empty for a read)."""

    def __init__(self, message: str, outage_s: float, request_ids: Sequence[str] = ()):
        super().__init__(message)
        self.outage_s = outage_s
        self.request_ids = tuple(request_ids)


class EmbeddedServer:
    """The server of a ``pdqueue up`` (``pdqueue.discovery.Target``'s pids): it is not restarted,
    so once its process is gone a lost connection will not come back, and retrying for
    ``unavailable_after_s`` per handle would only hide that. ``up`` keeps it at its stop until
    the answers it holds are read (``Keys.read``: the receipts its clients write), or a grace
    runs out."""

    def __init__(self, cluster: str, up_pid: int, server_pid: int):
        self.cluster, self.up_pid, self.server_pid = cluster, up_pid, server_pid

    def gone(self, exc: Exception, request_ids: Sequence[str] = ()) -> "RedisUnavailable | None":
        """The error to raise now for a failure ``exc`` if the server process is gone, else None."""
        if pid_alive(self.server_pid):
            return None
        return RedisUnavailable(
            f"the Redis server of the local cluster {self.cluster!r} (pdqueue up, pid {self.up_pid}) has stopped "
            f"(its process {self.server_pid} is gone): what it held went with it; start `pdqueue up` again and "
            f"resubmit ({type(exc).__name__}: {exc})", 0.0, request_ids)


class ReadOutage:
    """How long reads have been failing; ``RedisUnavailable`` past the limit, or at once
    when the server is gone for good (``embedded``)."""

    def __init__(self, request_id: str, limit_s: float | None, embedded: EmbeddedServer | None = None):
        self.request_id = request_id
        self.limit_s = limit_s
        self.embedded = embedded
        self.since: float | None = None

    def ok(self) -> None:
        self.since = None

    def failed(self, exc: Exception) -> None:
        gone = self.embedded.gone(exc) if self.embedded is not None else None
        if gone is not None:
            raise gone from exc
        now = time.monotonic()
        if self.since is None:
            self.since = now
            log.warning("request %s: redis unavailable (%s); retrying", self.request_id, exc)
        elif self.limit_s is not None and now - self.since >= self.limit_s:
            raise RedisUnavailable(f"unreachable for {now - self.since:.0f}s: {exc}", now - self.since) from exc


# Errors of one command sent as a Redis server restarts, loads its data (LOADING, which
# redis-py raises as BusyLoadingError, a ConnectionError) or runs a slow script (BUSY), or
# of a replica without its master: the command may be sent again. Credentials refused and
# redis-py's own pool limit are ConnectionErrors too, but no wait mends them.
_NOT_TRANSIENT = tuple(getattr(redis.exceptions, name) for name in (
    "AuthenticationError", "AuthorizationError", "MaxConnectionsError", "ExternalAuthProviderError")
    if hasattr(redis.exceptions, name))
_TRANSIENT_REPLIES = (redis.exceptions.TryAgainError, redis.exceptions.ClusterDownError)


def transient(exc: BaseException) -> bool:
    if isinstance(exc, _NOT_TRANSIENT):
        return False
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError, *_TRANSIENT_REPLIES)):
        return True
    return isinstance(exc, redis.exceptions.ResponseError) and str(exc).startswith("BUSY ")


class Submitting:
    """One submit's retries, shared by the sync and asyncio loops (which differ only in how
    they wait): the window of ``submit_retry_s`` from the submit's start, the backoff (with
    jitter: producers cut off by one restart do not all come back at once)."""

    def __init__(self, client, request_ids: Sequence[str]):
        self.client = client
        self.request_ids = list(request_ids)
        self.limit_s = client.submit_retry_s
        self.started = time.monotonic()
        self.failures = 0
        self.errors: collections.Counter[str] = collections.Counter()   # by type: ConnectionError, BusyLoadingError...

    def what(self) -> str:
        ids = self.request_ids
        if len(ids) == 1:
            return f"request {ids[0]}"
        shown = ", ".join(ids[:3]) + (", ..." if len(ids) > 3 else "")
        return f"{len(ids)} requests ({shown})"

    def tally(self) -> str:
        return ", ".join(f"{name} x{n}" for name, n in self.errors.most_common())

    def failed(self, exc: Exception) -> float:
        """A transient failure: how long to wait before sending again; ``RedisUnavailable``
        once the window is spent (no attempt starts after it)."""
        embedded = getattr(self.client, "embedded", None)
        gone = embedded.gone(exc, self.request_ids) if embedded is not None else None
        if gone is not None:
            raise gone from exc
        self.failures += 1
        self.errors[type(exc).__name__] += 1
        elapsed = time.monotonic() - self.started
        remaining = self.limit_s - elapsed
        if remaining <= 0:
            where = f" at {redact_url(self.client.url)}" if self.client.url else ""
            raise RedisUnavailable(
                f"could not submit {self.what()} to Redis{where}: tried for {elapsed:.1f}s "
                f"(submit_retry_s={self.limit_s:g}; {self.failures} attempt{'s' if self.failures != 1 else ''} "
                f"failed: {self.tally()}); last error: {str(exc).rstrip('.')}",
                elapsed, self.request_ids) from exc
        if self.failures == 1:
            log.warning("%s: submit failed (%s: %s); sending it again for up to %.0fs",
                        self.what(), type(exc).__name__, exc, remaining)
        delay = backoff_delay(self.failures - 1, self.client.backoff_initial_s, self.client.backoff_max_s,
                              jitter=True)
        return min(delay, remaining)

    def sent(self) -> None:
        if self.failures:
            log.warning("%s: submitted after %d failed attempts (%.1fs; %s); should an earlier one "
                        "have reached Redis too, the workers run the id once", self.what(), self.failures,
                        time.monotonic() - self.started, self.tally())


class LostCheck:
    """Whether Redis still knows a request that has had no answer yet, asked after every
    ``interval_s`` of silence; a request it lost is sent again, same id and fields. Without
    that, a request Redis lost (an asynchronous replica promoted before the write reached it,
    a restart without persistence) leaves its reader waiting for its whole timeout, or for
    ever.

    A live request is always somewhere. Before any worker reads it, its entry waits in the
    stream it was sent to, past the prefill group's last delivered id; from the read that
    delivers it to its acknowledgement, it is in the group's pending list; ``seen:<id>`` is
    set as a worker takes it, before the acknowledgement (24 h; a request moved to another
    worker's stream keeps it); ``out:<id>`` exists once anything is answered. A producer may
    not read the stream (other tenants' prompts), so the check reads what says nothing of
    them, in one pipeline: ``EXISTS`` of the two keys, ``XPENDING`` of this entry, and
    ``XLEN`` and ``XINFO GROUPS`` of the stream. Lost: neither key, not pending, and the
    stream gone, empty, or read past this entry. A stream that still holds entries the group
    has not reached may hold this one: the next check decides, once the workers have read
    that far. The pending list matters during a failover: a worker's read reaches the
    replica while the ``seen:<id>`` it sets a moment later fails (it is set again once the
    worker reconnects, and a copy sent meanwhile is turned away as a duplicate: a needless
    resend, seen in 3 failover runs of 4 before the check asked XPENDING) or is acknowledged
    and lost (a copy then finds no ``seen:<id>`` and runs twice).
    Only before the first answer entry: a request whose answer had begun is not run again
    (an unseeded sample would change under the tokens already read)."""

    def __init__(self, keys: Keys, request_id: str, stream: str, fields: dict, entry_id: str,
                 interval_s: float, group: str = PREFILL_GROUP):
        self.keys, self.request_id, self.stream, self.fields = keys, request_id, stream, fields
        self.entry_id, self.interval_s, self.group = entry_id, interval_s, group
        self.quiet_since = time.monotonic()
        self.resent = 0

    def heard(self) -> None:
        self.quiet_since = time.monotonic()

    def due(self, answered: bool) -> bool:
        return not answered and time.monotonic() - self.quiet_since >= self.interval_s

    def queue(self, pipe) -> None:
        """Add the check's reads to ``pipe`` (executed with ``raise_on_error=False``)."""
        pipe.exists(self.keys.seen(self.request_id), self.keys.out(self.request_id))
        pipe.xpending_range(self.stream, self.group, self.entry_id, self.entry_id, 1)
        pipe.xlen(self.stream)
        pipe.xinfo_groups(self.stream)

    def lost(self, replies) -> bool:
        """From the pipeline's replies; the clock restarts either way. An error reply other
        than a missing stream or group (a refused command) is raised."""
        self.heard()
        known, pending, length, groups = replies[-4:]
        for reply in (known, pending, length, groups):
            if isinstance(reply, Exception) and not _no_such_key(reply):
                raise reply
        if known or (pending and not isinstance(pending, Exception)):
            return False
        if isinstance(groups, Exception) or not length:
            return self._say_lost("its stream is gone or empty")
        delivered = next((as_str(g.get("last-delivered-id", "0-0")) for g in groups
                          if as_str(g.get("name")) == self.group), None)
        if delivered is None or _stream_id(delivered) < _stream_id(self.entry_id):
            return False   # not read that far yet: maybe still queued
        return self._say_lost("its stream was read past it, yet no worker took it")

    def _say_lost(self, why: str) -> bool:
        log.warning("request %s: Redis no longer has it (%s, and no answer: a failover or a restart "
                    "without persistence lost it); sending it again", self.request_id, why)
        return True

    def sent_again(self, entry_id) -> None:
        self.entry_id = as_str(entry_id)
        self.resent += 1


def _stream_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _no_such_key(exc: Exception) -> bool:
    """A missing stream (XINFO, XPENDING) or group (XPENDING's NOGROUP)."""
    text = str(exc).lower()
    return isinstance(exc, redis.ResponseError) and ("no such key" in text or text.startswith("nogroup"))
