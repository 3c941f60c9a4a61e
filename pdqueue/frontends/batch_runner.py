"""Runs the gateway's batches: each through ``pdqueue batch``'s ``BatchRun`` (request ids from
(batch id, ``custom_id``), lines the output holds skipped, requests in Redis re-attached to),
its input and output in Redis (``batch_store``), its requests in the batch service class and
labelled with the batch's tenant (their usage records: pdqueue/queue/ledger.py).

A batch is run by one gateway at a time: the one holding its lease
(``gwbatch:<id>:lock``, renewed every third of ``lease_s``). A gateway that stops lets go
of its batches at once (a drain) or when the lease expires (a kill); any gateway then
takes them over, and the rerun answers every line exactly once. Cancelling (status
``cancelling``, set by the API) stops the run, cancels its requests in flight and ends the
batch ``cancelled`` with the lines answered so far.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid

import redis

from pdqueue.frontends.batch import BatchError, BatchRun
from pdqueue.frontends.batch_store import RETENTION_S, BatchKeys, LeaseLost, RedisInput, RedisOutput, file_ids_of
from pdqueue.frontends.service_classes import BATCH, class_fields
from pdqueue.keys import Keys
from pdqueue.protocol.requests import MAX_TENANT_CHARS
from pdqueue.queue.connection import connect, raise_dropped_cancellation

log = logging.getLogger("pdqueue.frontends.gateway")

__all__ = ["BatchRunner", "ENDED"]

ENDED = ("completed", "failed", "cancelled", "expired")
TICK_S = 0.2     # how often a run checks for a cancel or the gateway's stop

# KEYS: the lease; ARGV: owner, ms. Renew (or, ms 0, release) only a lease this runner holds.
_LEASE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if tonumber(ARGV[2]) == 0 then return redis.call('DEL', KEYS[1]) end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
"""


class BatchRunner:
    """The batches this gateway runs. ``r``: the gateway's async Redis client; ``cancel``:
    its ``async cancel(request_id)``."""

    def __init__(self, redis_url: str, keys: Keys, r, cancel, *, lease_s: float = 10.0, poll_s: float = 1.0,
                 concurrency: int = 64):
        self.redis_url, self.keys, self.bkeys = redis_url, keys, BatchKeys(keys)
        self.r, self.cancel = r, cancel
        self.lease_ms = max(1, int(lease_s * 1000))
        self.poll_s, self.concurrency = poll_s, concurrency
        self.owner = uuid.uuid4().hex
        self.running: dict[str, asyncio.Task] = {}
        self.stopping = False
        self._wake = asyncio.Event()

    def kick(self) -> None:
        """Look for batches to run now (one was created)."""
        self._wake.set()

    def busy(self) -> bool:
        return bool(self.running)

    async def run(self) -> None:
        failed = False
        while not self.stopping:
            try:
                await self._scan()
                failed = False
            except (redis.RedisError, OSError) as exc:
                if not failed:
                    log.warning("batches: cannot read them from Redis (%s); retrying", exc)
                failed = True
            raise_dropped_cancellation()   # (one redis.asyncio dropped would keep this loop going)
            try:
                await asyncio.wait_for(self._wake.wait(), self.poll_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()

    def let_go(self) -> None:
        """Take no batch more and stop the runs (within ``TICK_S``; they release their leases)."""
        self.stopping = True
        self._wake.set()

    async def stop(self) -> None:
        self.let_go()
        if self.running:
            await asyncio.gather(*self.running.values(), return_exceptions=True)

    async def _scan(self) -> None:
        for raw in await self.r.smembers(self.bkeys.active):
            batch_id = raw.decode() if isinstance(raw, bytes) else raw
            if batch_id in self.running or self.stopping:
                continue
            if await self.r.set(self.bkeys.lock(batch_id), self.owner, nx=True, px=self.lease_ms):
                self.running[batch_id] = asyncio.ensure_future(self._run(batch_id))

    async def _lease(self, batch_id: str, ms: int) -> bool:
        return bool(await self.r.eval(_LEASE, 1, self.bkeys.lock(batch_id), self.owner, ms))

    async def _set(self, batch_id: str, fields: dict, end: bool = False) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self.bkeys.batch(batch_id), mapping=fields)
        pipe.expire(self.bkeys.batch(batch_id), RETENTION_S)
        if end:
            pipe.srem(self.bkeys.active, batch_id)
        await pipe.execute()

    async def _run(self, batch_id: str) -> None:
        sync_r = None
        try:
            record = {k.decode(): v.decode() for k, v in (await self.r.hgetall(self.bkeys.batch(batch_id))).items()}
            status = record.get("status")
            if status is None or status in ENDED:
                await self.r.srem(self.bkeys.active, batch_id)
                return
            if status == "validating":
                await self._set(batch_id, {"status": "in_progress", "in_progress_at": int(time.time())})
            log.info("batch %s: running it (%s)", batch_id, "resumed" if status != "validating" else "new")
            sync_r = connect(self.redis_url, purpose="worker")
            stop = threading.Event()
            fields = {**class_fields(BATCH), "tenant": record.get("tenant", "")[:MAX_TENANT_CHARS]}
            run = BatchRun(sync_r, self.keys, RedisInput(sync_r, self.bkeys, record["input_file_id"]),
                           RedisOutput(sync_r, self.bkeys, batch_id, self.owner), batch_id=batch_id,
                           concurrency=self.concurrency, stop=stop, request_fields=fields,
                           unavailable_after_s=float("inf"))   # a Redis outage stops it (_drive), never fails it
            await self._drive(batch_id, run, stop)
        except (redis.RedisError, OSError) as exc:
            log.warning("batch %s: lost Redis (%s); it is resumed later", batch_id, exc)
        finally:
            self.running.pop(batch_id, None)
            if sync_r is not None:
                sync_r.close()
            try:
                await self._lease(batch_id, 0)
            except (redis.RedisError, OSError):
                pass   # it expires

    async def _drive(self, batch_id: str, run: BatchRun, stop: threading.Event) -> None:
        """Run ``run`` in a thread, renewing the lease, until it ends, is cancelled, or the
        gateway stops; then record the outcome."""
        def work():
            run.prepare()
            return run.run()

        task = asyncio.ensure_future(asyncio.to_thread(work))
        renewed_at, cancelled = time.monotonic(), False
        while not task.done():
            await asyncio.wait({task}, timeout=TICK_S)
            if task.done():
                break
            try:
                cancelled = await self.r.hget(self.bkeys.batch(batch_id), "status") == b"cancelling"
                if time.monotonic() - renewed_at >= self.lease_ms / 3000:
                    if not await self._lease(batch_id, self.lease_ms):
                        log.warning("batch %s: lost its lease; another gateway goes on with it", batch_id)
                        stop.set()
                    renewed_at = time.monotonic()
            except (redis.RedisError, OSError) as exc:   # stop; the batch is resumed when Redis is back
                if not stop.is_set():
                    log.warning("batch %s: lost Redis (%s); stopping it until Redis is back", batch_id, exc)
                stop.set()
            if cancelled or self.stopping:
                stop.set()
            raise_dropped_cancellation()
        try:
            await task
        except LeaseLost:
            log.warning("batch %s: lost its lease while writing; another gateway goes on with it", batch_id)
            return
        except BatchError as exc:
            log.warning("batch %s: failed: %s", batch_id, exc)
            errors = {"object": "list", "data": [{"code": "batch_failed", "message": str(exc), "param": None,
                                                  "line": None}]}
            await self._set(batch_id, {"status": "failed", "failed_at": int(time.time()),
                                       "errors": json.dumps(errors)}, end=True)
            return
        status = await self.r.hget(self.bkeys.batch(batch_id), "status")
        if status == b"cancelling":
            for job in list(run.inflight.values()):
                await self.cancel(job.request.id)
            await self._end(batch_id, "cancelled")
        elif not run.interrupted:
            await self._end(batch_id, "completed")
        else:
            log.info("batch %s: left with %d requests in flight (resumed by the next runner)", batch_id,
                     len(run.inflight))

    async def _end(self, batch_id: str, status: str) -> None:
        output, errors = file_ids_of(batch_id)
        now = int(time.time())
        fields = {"status": status, f"{status}_at": now, "output_file_id": output}
        if status == "completed":
            fields["finalizing_at"] = now
        if await self.r.llen(self.bkeys.err(batch_id)):
            fields["error_file_id"] = errors
        await self._set(batch_id, fields, end=True)
        log.info("batch %s: %s", batch_id, status)
