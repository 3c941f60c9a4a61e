"""The decode role's fetch thread: KV copied into reserved blocks off the step loop.

The loop hands a fetch over (``submit``: a key, the ticket, the destination blocks) and
later collects ``(key, FetchOutcome)`` pairs (``collect``); a ticket whose KV is no longer
wanted goes back through the same thread (``release``: the receiver's sockets are the
thread's). The thread touches nothing of
the loop's: it reads what it was given and returns an immutable outcome.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

from pdqueue.transfer.errors import TransferError
from pdqueue.transfer.receiver import KVReceiver
from workers.common import now_ms

log = logging.getLogger("pdqueue.decode")


@dataclass(frozen=True, slots=True)
class FetchOutcome:
    """How a request's KV got here: ``path`` shm | tcp | zmq (``cache``: all of it was in
    this engine's prefix cache; ``recompute``: computed here instead), ``seconds`` and
    ``nbytes`` of the copy, ``error`` when it failed, and ``started_ms``/``done_ms`` (wall
    clock) when the copy began (the fetch thread free) and when the KV was in place."""

    path: str = ""
    seconds: float = 0.0
    nbytes: int = 0
    error: str | None = None
    done_ms: float = 0.0
    started_ms: float = 0.0
    reused_blocks: int = 0   # leading blocks found in this engine's prefix cache (not copied)


_RELEASE = object()   # the key of a release in the thread's queue


class Fetcher:
    def __init__(self, receiver: KVReceiver, metrics=None):
        self.receiver = receiver
        self.metrics = metrics        # pdqueue.telemetry.metrics.WorkerMetrics: bytes and seconds by path, failures
        self.in_flight = 0            # submitted, not yet collected (loop thread only)
        self._todo: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kv-fetch", daemon=True)
        self._thread.start()

    def submit(self, key: Any, ticket: dict, block_ids: list[int], first_block: int = 0,
               reused_blocks: int | None = None) -> None:
        """Copy ``ticket``'s blocks from ``first_block`` on into ``block_ids``; of those
        before it, ``reused_blocks`` (default: all) were in this engine's prefix cache (the
        others are older than a sliding window: not needed)."""
        self.in_flight += 1
        self._todo.put((key, ticket, block_ids, (first_block, first_block if reused_blocks is None else reused_blocks)))

    def release(self, ticket: dict) -> None:
        """Release the ticket's lease on the sender (no outcome to collect)."""
        self._todo.put((_RELEASE, ticket, None, (0, 0)))

    def collect(self, wait_s: float = 0.0) -> Iterator[tuple[Any, FetchOutcome]]:
        """The finished fetches, each as soon as it is there; with ``wait_s``, waiting up
        to that long for those still running."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                remaining = deadline - time.monotonic()
                if self.in_flight and remaining > 0:
                    item = self._done.get(timeout=remaining)
                else:
                    item = self._done.get_nowait()
            except queue.Empty:
                return
            self.in_flight -= 1
            yield item

    def close(self) -> None:
        self._todo.put(None)

    def _run(self) -> None:
        while True:
            item = self._todo.get()
            if item is None:
                return
            key, ticket, block_ids, (first_block, reused) = item
            if key is _RELEASE:
                try:
                    self.receiver.release(ticket)
                except Exception:   # fire-and-forget: the lease expires anyway
                    log.exception("release of %s failed", ticket.get("request_id"))
                continue
            started_ms = now_ms()
            try:
                result = self.receiver.fetch(ticket, block_ids, first_block)
                outcome = FetchOutcome(result.path, result.seconds, result.nbytes, done_ms=now_ms(),
                                       started_ms=started_ms, reused_blocks=reused)
                if self.metrics is not None:
                    self.metrics.transferred(result.path, result.nbytes, result.seconds)
            except TransferError as exc:
                outcome = FetchOutcome(error=str(exc))
                if self.metrics is not None:
                    self.metrics.fetch_failed(exc.code.value)
            except Exception as exc:  # never let the fetch thread die
                log.exception("fetch of %s failed", ticket.get("request_id"))
                outcome = FetchOutcome(error=f"internal: {exc}")
                if self.metrics is not None:
                    self.metrics.fetch_failed("internal")
            self._done.put((key, outcome))
