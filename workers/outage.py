"""A worker's view of a Redis outage: the capped backoff with jitter between retries, and
the limit after which the worker gives up (``--redis-gone-exit-s``, default 300 s; 0: never)
and exits with ``EXIT_REDIS_GONE``, freeing its KV pool while what it held stays pending in
Redis for whichever worker serves that Redis next."""

from __future__ import annotations

import logging
import time
from typing import Callable

from pdqueue.retry import Backoff

log = logging.getLogger("pdqueue.worker")

EXIT_REDIS_GONE = 75   # the exit status after --redis-gone-exit-s (EX_TEMPFAIL: a supervisor may start it again)


class RedisGone(Exception):
    """Redis stayed unreachable for ``--redis-gone-exit-s``: the worker stops (exit status
    ``EXIT_REDIS_GONE``), freeing its KV pool; what it held stays pending in Redis, for
    whichever worker serves that Redis next."""


class StoppedWaiting(Exception):
    """A stop (warm or cold) came while the worker waited for Redis before serving: it
    holds nothing yet, so it just ends."""


class Outage:
    """``down(exc)`` after each Redis call that failed for want of Redis, ``answered()``
    after one that worked. ``beats()`` is the heartbeat's count of successful beats (its
    thread keeps trying while Redis is away, whatever the loop is doing), ``on_error`` what
    Recovery does on a Redis error."""

    def __init__(self, gone_exit_s: float, stop, beats: Callable[[], int], on_error: Callable[[], None]):
        self.gone_exit_s = gone_exit_s
        self.stop = stop
        self.beats = beats
        self.on_error = on_error
        self.backoff = Backoff(jitter=True)  # jitter: workers cut off together come back spread out
        self.gone = False                    # RedisGone was raised: closing does not wait on Redis
        self._outage: tuple[float, int] | None = None   # (monotonic start, beats then)

    def answered(self) -> None:
        self.backoff.reset()
        self._outage = None

    def down(self, exc: BaseException, message: str = "redis unavailable (%s); retrying") -> None:
        """Retry after the backoff, unless Redis has now been unreachable for
        ``gone_exit_s`` (``RedisGone``)."""
        if not self._check(exc):   # (the first failure of an outage has its own line)
            log.warning(message, exc)
        self.on_error()
        self.backoff.sleep(self.stop.cold)

    def _check(self, exc: BaseException) -> bool:
        """Time the outage ``exc`` belongs to. It began at the first failure since Redis last
        answered: a read (``answered``) or a heartbeat (a beat changes ``beats()``). Past
        ``gone_exit_s`` (0: never) raise ``RedisGone``. True when this failure began an
        outage (and said so)."""
        limit = self.gone_exit_s
        now, beats = time.monotonic(), self.beats()
        if self._outage is None or self._outage[1] != beats:
            self._outage = (now, beats)
            log.warning("redis unavailable (%s); retrying%s", exc,
                        f"; this worker stops if it stays unreachable for {limit:g} s (--redis-gone-exit-s)"
                        if limit else "")
            return True
        down_s = now - self._outage[0]
        if limit and down_s >= limit:
            self.gone = True
            log.error("redis unreachable for %.0f s (%s), past --redis-gone-exit-s %g: stopping this worker and "
                      "freeing its KV pool; what it held stays pending in Redis for the workers that serve it next",
                      down_s, exc, limit)
            raise RedisGone(f"redis unreachable for {down_s:.0f} s (--redis-gone-exit-s {limit:g}): {exc}")
        return False

    def stopped_waiting(self, exc: BaseException) -> None:
        """While waiting for Redis before serving: a stop ends the wait (nothing is in hand)."""
        if self.stop.cold.is_set() or self.stop.warm.is_set():
            raise StoppedWaiting(f"stopped while waiting for Redis ({exc}); nothing was in hand")
