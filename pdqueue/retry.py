"""Capped exponential backoff, the one retry delay every Redis caller uses.

``backoff_delay(attempt, initial_s, cap_s)`` is ``initial_s * 2**attempt``, capped at
``cap_s``, optionally with jitter (a factor in [0.5, 1)). Callers that wait on their own
terms (the client clips to its deadline, the publisher waits on its condition) use it
directly. ``Backoff`` counts the attempts and sleeps, waking early when a stop Event is set.

Imports the standard library only (a producer loads it through ``pdqueue.client``).
"""

from __future__ import annotations

import secrets
import threading
import time

# 2**64 times any sane initial delay is past any cap; an unbounded exponent overflows a
# float after ~1000 failures (a Redis outage of half an hour at a 2 s cap).
_MAX_DOUBLINGS = 64


def backoff_delay(attempt: int, initial_s: float, cap_s: float, *, jitter: bool = False) -> float:
    """Seconds to wait before retry number ``attempt`` (0 for the first retry)."""
    delay = min(cap_s, initial_s * 2 ** min(attempt, _MAX_DOUBLINGS))
    if jitter:
        # secrets, not random: workers started together (or seeded alike) still spread out
        delay *= 0.5 + secrets.randbelow(1000) / 2000
    return delay


class Backoff:
    """Attempt counter plus sleep: ``sleep`` waits the next delay, ``reset`` after a
    success starts again from ``initial_s``."""

    def __init__(self, initial_s: float = 0.05, cap_s: float = 2.0, *, jitter: bool = False):
        self.initial_s = initial_s
        self.cap_s = cap_s
        self.jitter = jitter
        self.attempt = 0

    def reset(self) -> None:
        self.attempt = 0

    def next_delay(self) -> float:
        delay = backoff_delay(self.attempt, self.initial_s, self.cap_s, jitter=self.jitter)
        self.attempt += 1
        return delay

    def sleep(self, stop: threading.Event | None = None) -> None:
        """Wait the next delay; returns at once when ``stop`` is (or becomes) set."""
        delay = self.next_delay()
        if stop is not None:
            stop.wait(delay)
        else:
            time.sleep(delay)
