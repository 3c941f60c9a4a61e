"""How the client rides out a Redis outage: which errors a command may be sent again after
(``transient``), a submit's window of retries (``Submitting``), a stream read's outage limit
(``ReadOutage``), and ``RedisUnavailable``, raised past them. ``pdqueue.client``'s docstring
says what the client promises; this holds the mechanics.

Imports redis and pdqueue's config and retry only.
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


class ReadOutage:
    """How long reads have been failing; ``RedisUnavailable`` past the limit."""

    def __init__(self, request_id: str, limit_s: float | None):
        self.request_id = request_id
        self.limit_s = limit_s
        self.since: float | None = None

    def ok(self) -> None:
        self.since = None

    def failed(self, exc: Exception) -> None:
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
