"""Publishing to Redis off the caller's thread (the decode step never waits on I/O).

A ``Publisher`` owns one background thread and one Redis client (made by
``redis_factory`` inside that thread). ``submit(ops)`` queues a unit of work and returns
at once; the thread drains everything queued at each wake-up and runs it as ONE
pipelined MULTI/EXEC (up to ``max_batch`` units), so many requests' token entries cost
one round trip, and each unit's ops are applied atomically (the whole batch is).

Ordering: units are applied in submission order, so entries of one request arrive in
order. Failures:
- ConnectionError/TimeoutError: the batch is retried with capped exponential backoff
  until it goes through (or ``close`` gives up). A reply lost after EXEC ran can make a
  retried batch apply twice: ops must be idempotent or de-duplicated downstream (token
  entries carry their index; clients drop repeats).
- A unit whose op raises while being built is dropped and counted; the rest go on.
- EXECABORT (a command rejected while queuing, nothing applied): the batch is re-run
  unit by unit so only the bad unit is dropped.
- A command failing inside EXEC (e.g. WRONGTYPE) is counted; the others were applied.
Every drop calls ``on_error(exc, ops)`` if given (on the publisher thread, before the unit
counts as finished: ``pending`` still includes it). The workers pass their own, so a unit
that failed reaches the worker and not only the log.

Imports redis and pdqueue.retry only. An op is any ``fn(pipe)``, e.g. an
``ownership.Write``.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any, Callable, Iterable

import redis

from pdqueue.retry import backoff_delay

log = logging.getLogger(__name__)

Op = Callable[[Any], None]
"""fn(pipe): adds commands to a redis-py pipeline."""


def _as_op(op: Op) -> Op:
    if callable(op):
        return op
    raise TypeError(f"an op is a callable fn(pipe), got {op!r}")


class Publisher:
    def __init__(self, redis_factory: Callable[[], redis.Redis], *, max_batch: int = 1024,
                 backoff_initial_s: float = 0.05, backoff_max_s: float = 2.0,
                 on_error: Callable[[BaseException, list[Op]], None] | None = None,
                 name: str = "pdq-publisher"):
        self._factory = redis_factory
        self._max_batch = max_batch
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._on_error = on_error
        self._cond = threading.Condition()
        self._pending: deque[tuple[int, list[Op]]] = deque()
        self._next_seq = 0      # sequence number of the next submit
        self._done_seq = 0      # every submit numbered below this is finished
        self._closing = False   # no more submits; the thread exits once drained
        self._abandon = False   # close timed out: drop what is left instead of retrying
        self.published = 0      # ops applied
        self.batches = 0        # MULTI/EXEC round trips that went through
        self.errors = 0         # ops/units dropped or failed inside EXEC
        self.retries = 0        # batches retried after a connection error
        self.dropped = 0        # units never applied (close gave up, or build/abort errors)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- caller side -------------------------------------------------------------------
    def submit(self, ops: Iterable[Op]) -> None:
        """Queue ``ops`` to run together in one MULTI/EXEC. Never blocks on Redis."""
        unit = [_as_op(op) for op in ops]
        with self._cond:
            if self._closing:
                raise RuntimeError("publisher is closed")
            self._pending.append((self._next_seq, unit))
            self._next_seq += 1
            self._cond.notify_all()

    @property
    def pending(self) -> int:
        """Units queued and not yet finished (a backpressure signal for the caller)."""
        with self._cond:
            return self._next_seq - self._done_seq

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted before this call is finished; False on timeout."""
        with self._cond:
            target = self._next_seq
            return self._cond.wait_for(lambda: self._done_seq >= target, timeout)

    def close(self, timeout: float | None = 5.0) -> bool:
        """Flush (up to ``timeout``), then stop the thread. Anything still unpublished after
        the timeout is dropped and counted. True if everything was published."""
        flushed = self.flush(timeout)
        with self._cond:
            self._closing = True
            if not flushed:
                self._abandon = True
            self._cond.notify_all()
        self._thread.join(timeout=max(1.0, self._backoff_max_s + 1.0))
        return flushed

    def stats(self) -> dict[str, int]:
        return {"published": self.published, "batches": self.batches, "errors": self.errors,
                "retries": self.retries, "dropped": self.dropped, "pending": self.pending}

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- publisher thread --------------------------------------------------------------
    def _run(self) -> None:
        client = None
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._pending or self._closing)
                    if not self._pending:
                        return
                    batch = [self._pending.popleft()
                             for _ in range(min(self._max_batch, len(self._pending)))]
                if client is None:
                    client = self._factory()
                self._publish(client, batch)
                with self._cond:
                    self._done_seq = batch[-1][0] + 1
                    self._cond.notify_all()
        except BaseException:  # pragma: no cover - a bug here must not hang flush() forever
            log.exception("publisher thread died")
            with self._cond:
                self._closing = True
                self.dropped += len(self._pending)
                self._pending.clear()
                self._done_seq = self._next_seq
                self._cond.notify_all()
        finally:
            if client is not None:
                client.close()

    def _report(self, exc: BaseException, ops: list[Op]) -> None:
        self.errors += 1
        if self._on_error is not None:
            try:
                self._on_error(exc, ops)
            except Exception:
                log.exception("publisher on_error callback failed")

    def _publish(self, client: redis.Redis, batch: list[tuple[int, list[Op]]]) -> None:
        batch = list(batch)  # _execute removes units whose ops raise, for good
        attempt = 0
        while True:
            try:
                self._execute(client, batch)
                return
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                with self._cond:
                    if self._abandon:
                        self.dropped += len(batch)
                        log.error("publisher closing: dropped %d unpublished units (%s)", len(batch), exc)
                        return
                    delay = backoff_delay(attempt, self._backoff_initial_s, self._backoff_max_s)
                    attempt += 1
                    self.retries += 1
                    if attempt == 1:
                        log.warning("publisher: redis unavailable (%s); retrying", exc)
                    self._cond.wait_for(lambda: self._abandon, delay)
            except redis.ResponseError as exc:
                # Nothing was applied (EXECABORT); find the bad unit by running them one by one.
                if len(batch) == 1:
                    self.dropped += 1
                    log.error("publisher: dropped a unit redis rejected: %s", exc)
                    self._report(exc, batch[0][1])
                    return
                for unit in batch:
                    self._publish(client, [unit])
                return

    def _execute(self, client: redis.Redis, batch: list[tuple[int, list[Op]]]) -> None:
        """Run ``batch`` as one MULTI/EXEC. A unit whose ops raise while being built is
        removed from ``batch`` (so a retry does not report it twice)."""
        pipe = client.pipeline(transaction=True)
        num_ops = 0
        spans = []  # (first command, end, ops) of each unit, to blame failures on
        for unit in list(batch):
            mark = len(pipe.command_stack)
            try:
                for op in unit[1]:
                    op(pipe)
            except Exception as exc:
                del pipe.command_stack[mark:]  # undo this unit's half-added commands
                batch.remove(unit)
                self.dropped += 1
                log.error("publisher: an op raised while building its commands: %r", exc)
                self._report(exc, unit[1])
                continue
            num_ops += len(unit[1])
            spans.append((mark, len(pipe.command_stack), unit[1]))
        if not pipe.command_stack:
            return
        try:
            results = pipe.execute(raise_on_error=False)
        finally:
            pipe.reset()
        self.batches += 1
        self.published += num_ops
        for start, end, ops in spans:
            for res in results[start:end]:
                if isinstance(res, Exception):
                    log.error("publisher: a command failed inside EXEC: %s", res)
                    self._report(res, ops)
