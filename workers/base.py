"""What the three worker roles share: connecting, registering, request intake, answering.

Intake turns a ``requests`` stream entry into an engine request or into an answer:
parse (protocol) -> idempotency (``seen:<id>``) -> deadline and cancel -> tokenize ->
limits that need the model (context, KV pool, vocabulary). Anything that cannot run is
answered with an ``error`` entry on ``out:<id>`` (when the id is usable), copied to
``dead`` with its reason, and acknowledged, all in one MULTI/EXEC. The worker goes on.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, field

import redis

from pdqueue import keys as K
from pdqueue.engine.sampling import SamplingParams
from pdqueue.keys import Keys
from pdqueue.protocol import (Completion, ErrorCode, FinishReason, Request, RequestError,
                              done_entry, error_entry, parse_request, token_entry)
from pdqueue.queue import streams
from pdqueue.queue.ownership import Write, ack_and_write, touch_owned
from pdqueue.queue.publisher import Publisher
from pdqueue.queue.registry import Heartbeat
from pdqueue.retry import Backoff
from pdqueue.transfer.shm import cleanup_segments
from workers.common import StopFlag, WorkerConfig, new_incarnation, new_worker_id, now_ms

log = logging.getLogger("pdqueue.worker")


@dataclass(slots=True)
class Intake:
    """A request taken from ``requests`` and admitted into the engine."""
    stream: str
    entry_id: str
    request: Request
    prompt_ids: list[int]
    params: SamplingParams
    read_ms: float
    token_times_ms: list[float] = field(default_factory=list)


def connect(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=30, socket_connect_timeout=5,
                                health_check_interval=30)


class WorkerBase:
    role = "worker"

    def __init__(self, config: WorkerConfig, loaded):
        self.config = config
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.worker_id = config.worker_id or new_worker_id(self.role)
        self.incarnation = new_incarnation()
        self.keys = Keys(config.cluster)
        self.r = connect(config.redis_url)
        self.stop = StopFlag()
        self.backoff = Backoff(jitter=True)  # jitter: workers cut off together come back spread out
        self.heartbeat = None
        self._last_reclaim = 0.0
        self._last_touch = 0.0
        self._last_sweep = 0.0
        # A Redis error may have cut off a reply that delivered entries to us (XREADGROUP,
        # XCLAIM): they sit in our pending list, unknown to us; ``redelivered`` finds them.
        self._resync = False

    # ---- intake --------------------------------------------------------------------------
    def intake(self, engine, stream: str, entry_id: str, fields: dict, ops: list) -> Intake | None:
        """Admit one request entry into ``engine``, or append its answer (error, cancel,
        expiry) and acknowledgement to ``ops`` (callables ``fn(pipe)`` that the caller runs
        in one MULTI/EXEC). Returns the Intake when admitted."""

        read_ms = now_ms()
        try:
            if fields is None:  # deleted while pending
                ops.append(lambda p: streams.ack_into(p, stream, K.PREFILL_GROUP, entry_id))
                return None
            req = parse_request(entry_id, fields)
            may_run, cancelled = streams.claim_request(self.r, self.keys, req.id, entry_id)   # one round trip
            if not may_run:
                self.reject(ops, stream, entry_id, fields, None,
                            f"request id {req.id!r} was already taken by another entry", ErrorCode.DUPLICATE)
                return None
            if req.expired(read_ms):
                self.finish_early(ops, stream, entry_id, req, FinishReason.EXPIRED)
                return None
            if cancelled:
                self.finish_early(ops, stream, entry_id, req, FinishReason.CANCELLED)
                return None
            prompt_ids = self.tokenize(req)
            reason = engine.check_prompt(len(prompt_ids))
            if reason:
                raise RequestError(reason, req.id, ErrorCode.TOO_LONG)
            seed = req.seed if req.seed is not None else secrets.randbits(63)
            params = SamplingParams(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                                    top_k=req.top_k, seed=seed, stop=tuple(req.stop),
                                    ignore_eos=req.ignore_eos)
            engine.add_request(req.id, prompt_ids, params)
            return Intake(stream, entry_id, req, prompt_ids, params, read_ms)
        except RequestError as exc:
            rid = exc.request_id
            self.reject(ops, stream, entry_id, fields, rid, exc.reason, exc.code)
        except (redis.ConnectionError, redis.TimeoutError):
            raise  # not the request's fault: it stays pending and is taken in again (redelivered)
        except Exception as exc:  # a bug must not kill the worker or lose the entry's answer
            log.exception("intake of %s failed", entry_id)
            self.reject(ops, stream, entry_id, fields or {}, None, f"internal error: {exc}", ErrorCode.INTERNAL)
        return None

    def tokenize(self, req: Request) -> list[int]:
        if req.prompt_ids is not None:
            ids = list(req.prompt_ids)
            vocab = self.loaded.config.vocab_size
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise RequestError(f"prompt_ids has token id {bad[0]}; the vocabulary has {vocab} ids", req.id)
        else:
            text = req.prompt
            if req.chat:
                text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}])
            ids = self.tokenizer.encode(text)
        if not ids:
            raise RequestError("the prompt is empty (no tokens)", req.id)
        return ids

    def reject(self, ops, stream, entry_id, fields, request_id, reason, code,
               group: str = K.PREFILL_GROUP) -> None:
        """Answer an entry that cannot run: error on out:<id>, a copy on dead, ack."""
        code = getattr(code, "value", code)
        log.info("rejected %s (%s): %s", request_id or entry_id, code, reason)
        if request_id and code != ErrorCode.DUPLICATE.value:
            self.add_error(ops, request_id, reason, code)
        fields = dict(fields or {})
        ops.append(lambda p: streams.dead_letter(p, self.keys, fields, reason, stream, entry_id,
                                                 code=code, worker=self.worker_id))
        self.add_ack(ops, stream, entry_id, group)

    def finish_early(self, ops, stream, entry_id, req: Request, reason: FinishReason) -> None:
        c = Completion(req.id, "", (), reason, e2e_ms=max(0.0, now_ms() - req.enqueued_ms),
                       prefill_worker=self.worker_id)
        self.add_done(ops, c)
        self.add_ack(ops, stream, entry_id, K.PREFILL_GROUP)

    def add_error(self, ops, request_id: str, reason: str, code, index: int | None = None) -> None:
        fields = error_entry(reason, code, index)
        ops.append(lambda p: streams.xadd_expiring(p, self.keys.out(request_id), fields, K.OUT_TTL_S))

    def add_done(self, ops, c: Completion) -> None:
        fields = done_entry(c)
        ops.append(lambda p: streams.xadd_expiring(p, self.keys.out(c.request_id), fields, K.OUT_TTL_S))
        ops.append(lambda p: streams.xadd_into(p, self.keys.done, fields, maxlen=K.DONE_MAXLEN))

    def add_token(self, ops, request_id: str, index: int, token_id: int, text: str) -> None:
        fields = token_entry(index, [token_id], text)
        ops.append(lambda p: streams.xadd_expiring(p, self.keys.out(request_id), fields, K.OUT_TTL_S))

    def add_ack(self, ops, stream: str, entry_id: str, group: str) -> None:
        ops.append(lambda p: streams.ack_into(p, stream, group, entry_id))

    def add_outcome(self, ops, stream: str, entry_id: str, group: str, writes: list[Write]) -> None:
        """Acknowledge the input entry and write its outcome, only if this worker still owns
        it (see pdqueue/queue/ownership.py): one outcome per entry, whoever finishes first."""
        ops.append(lambda p: ack_and_write(p, stream, group, entry_id, writes))

    def done_writes(self, c: Completion) -> list[Write]:
        fields = done_entry(c)
        return [Write(self.keys.out(c.request_id), fields, ttl_ms=K.OUT_TTL_S * 1000),
                Write(self.keys.done, fields, maxlen=K.DONE_MAXLEN)]

    def error_writes(self, request_id: str, reason: str, code, index: int | None = None) -> list[Write]:
        return [Write(self.keys.out(request_id), error_entry(reason, code, index), ttl_ms=K.OUT_TTL_S * 1000)]

    # ---- dead workers and hung ones ------------------------------------------------------
    def reclaim(self, group: str, stream_names, limit: int) -> list:
        """Take over entries of other consumers of ``group``: at once when the consumer's
        heartbeat is gone (it died), after ``reclaim_idle_ms`` otherwise (it hangs).
        Returns (stream, entry_id, fields) like a read."""
        now = time.monotonic()
        if limit <= 0 or now - self._last_reclaim < 0.5:
            return []
        self._last_reclaim = now
        claimed: list = []
        try:
            for stream in stream_names:
                if len(claimed) >= limit:
                    break
                try:
                    pending = self.r.xpending_range(stream, group, min="-", max="+", count=100)
                except redis.ResponseError:
                    continue  # no such stream or group yet
                alive: dict[str, bool] = {}
                dead_ids, hung_ids = [], []
                for p in pending:
                    consumer = p["consumer"].decode()
                    if consumer == self.worker_id:
                        continue
                    if consumer not in alive:
                        alive[consumer] = bool(self.r.exists(self.keys.worker(consumer)))
                    if not alive[consumer]:
                        dead_ids.append(p["message_id"])
                    elif p["time_since_delivered"] >= self.config.reclaim_idle_ms:
                        hung_ids.append(p["message_id"])
                for ids, min_idle in ((dead_ids, 200), (hung_ids, self.config.reclaim_idle_ms)):
                    ids = ids[: limit - len(claimed)]
                    if not ids:
                        continue
                    for entry_id, fields in self.r.xclaim(stream, group, self.worker_id, min_idle, ids):
                        if entry_id is not None:
                            claimed.append((stream, entry_id.decode(), fields))
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("reclaim: redis unavailable (%s)", exc)
            self._resync = True
        if claimed:
            log.warning("reclaimed %d entries of dead or hung workers: %s", len(claimed),
                        [e[1] for e in claimed])
        return claimed

    def own_pending(self, group: str, stream_names) -> list:
        """Entries delivered to this consumer name before a restart and never acknowledged."""
        try:
            return streams.read_own_pending(self.r, group, self.worker_id, stream_names)
        except redis.ResponseError:
            return []

    def redelivered(self, group: str, stream_names, held_entry_ids: set[str]) -> list:
        """After a Redis error: the entries of our pending list that we do not hold (their
        delivery's reply was lost with the connection), to be taken in again. Checked only
        once the publisher has nothing queued, so no entry is between being dropped from
        hand and being acknowledged; call it from the loop's thread, before taking more."""
        if not self._resync or self.publisher.pending:
            return []
        try:
            entries = self.own_pending(group, stream_names)
        except (redis.ConnectionError, redis.TimeoutError):
            return []
        self._resync = False
        lost = [e for e in entries if e[1] not in held_entry_ids]
        if lost:
            log.warning("taking in again %d entries delivered to us while Redis failed: %s",
                        len(lost), [e[1] for e in lost])
        return lost

    def admit(self, engine, entries, inflight: dict) -> None:
        """Intake request entries into ``engine`` (admitted ones into ``inflight`` by request
        id); the answers of those that cannot run go out in one unit."""
        ops: list = []
        for stream, entry_id, fields in entries:
            intake = self.intake(engine, stream, entry_id, fields, ops)
            if intake:
                inflight[intake.request.id] = intake
        if ops:
            self.publisher.submit(ops)

    def keep_ownership(self, held: dict[str, tuple[str, str]], group: str) -> list[str]:
        """Every ``reclaim_idle_ms / 3``: keep the entries in hand (request id -> (stream,
        entry id)) from looking idle to other workers. Returns the request ids another
        worker took over meanwhile: the caller drops them without answering."""
        now = time.monotonic()
        if now - self._last_touch < self.config.reclaim_idle_ms / 3000:
            return []
        self._last_touch = now
        by_stream: dict[str, list[str]] = {}
        for stream, entry_id in held.values():
            by_stream.setdefault(stream, []).append(entry_id)
        lost = self.touch(by_stream, group)
        gone = [rid for rid, (_, entry_id) in held.items() if entry_id in lost]
        for rid in gone:
            log.warning("%s was taken over by another worker; dropping it here", rid)
        return gone

    def touch(self, stream_entries: dict[str, list[str]], group: str) -> set[str]:
        """Keep owned entries from looking idle; returns entry ids this worker lost."""
        lost: set[str] = set()
        try:
            for stream, ids in stream_entries.items():
                lost.update(touch_owned(self.r, stream, group, self.worker_id, ids))
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError) as exc:
            log.warning("touch failed (%s)", exc)
        return lost

    def cancelled(self, request_ids: list[str]) -> set[str]:
        """Which of ``request_ids`` a producer cancelled (``cancel:<id>`` set)."""
        if not request_ids:
            return set()
        try:
            with self.r.pipeline(transaction=False) as pipe:
                for rid in request_ids:
                    pipe.exists(self.keys.cancel(rid))
                flags = pipe.execute()
        except (redis.ConnectionError, redis.TimeoutError):
            return set()
        return {rid for rid, flag in zip(request_ids, flags) if flag}

    def make_publisher(self) -> Publisher:
        return Publisher(lambda: connect(self.config.redis_url), name=f"pdq-publisher-{self.worker_id}")

    def read(self, group: str, stream_names, count: int, block_ms: int):
        """XREADGROUP with reconnects: [] while Redis is unavailable."""
        try:
            entries = streams.read_group(self.r, group, self.worker_id, stream_names, count=count,
                                         block_ms=block_ms or None)
            self.backoff.reset()
            return entries
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("redis unavailable (%s); retrying", exc)
            self._resync = True
            self.backoff.sleep(self.stop.cold)
            return []
        except redis.ResponseError as exc:
            if "NOGROUP" in str(exc):  # Redis restarted without persistence
                self.ensure_groups()
                return []
            raise

    def start_heartbeat(self, **info) -> None:
        while True:
            try:
                self.heartbeat = Heartbeat(self.r, self.keys, self.worker_id, role=self.role,
                                           incarnation=self.incarnation, model=self.config.engine.model,
                                           ttl_s=self.config.heartbeat_ttl_s, **info).start()
                return
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if self.stop.cold.is_set():
                    raise
                log.warning("redis unavailable at start (%s); retrying", exc)
                self.backoff.sleep(self.stop.cold)

    # ---- KV segments of dead prefill workers on this node -------------------------------
    def sweep_segments(self, force: bool = False) -> list[str]:
        """Every third of min(heartbeat TTL, lease), whatever the role: unlink this node's KV
        segments whose owner died (``cleanup_segments``), so a crashed prefill worker's pool
        goes whether it is restarted at once, later or never. Returns the names removed."""
        now = time.monotonic()
        if not force and now - self._last_sweep < min(self.config.heartbeat_ttl_s, self.config.lease_s) / 3:
            return []
        self._last_sweep = now
        try:
            return cleanup_segments(self._segment_owner_alive)
        except OSError as exc:
            log.warning("KV segment sweep failed (%s)", exc)
            return []

    def _segment_owner_alive(self, worker_id: str, incarnation: str) -> bool:
        """For segments of earlier pdqueue versions only (no owner lock): is the owner
        registered in this cluster with that incarnation."""
        try:
            info = self.r.hgetall(self.keys.worker(worker_id))
        except Exception:
            return True  # cannot tell: keep it
        inc = info.get(b"incarnation") if info else None
        return inc is not None and inc.decode() == incarnation

    # ---- the loop ----------------------------------------------------------------------
    MAX_CONSECUTIVE_FAILURES = 20

    def loop(self, iteration) -> None:
        """Run ``iteration()`` until it returns False or a cold stop. Redis outages are
        retried with capped backoff; an unexpected error is logged and the loop goes on
        (the entries in hand stay pending, to be retried or reclaimed), unless it keeps
        failing, when the worker exits with the error rather than spin."""
        failures = 0
        while not self.stop.cold.is_set():
            try:
                self.sweep_segments()
                if not iteration():
                    return
                failures = 0
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("redis unavailable (%s); retrying", exc)
                self._resync = True
                self.backoff.sleep(self.stop.cold)
            except Exception:
                failures += 1
                log.exception("worker iteration failed (%d in a row)", failures)
                if failures >= self.MAX_CONSECUTIVE_FAILURES:
                    raise
                self.backoff.sleep(self.stop.cold)

    def ensure_groups(self) -> None:
        for stream in self.keys.request_streams:
            streams.ensure_group(self.r, stream, K.PREFILL_GROUP)
        for stream in self.handoff_streams():
            streams.ensure_group(self.r, stream, K.DECODE_GROUP)

    def handoff_streams(self) -> list[str]:
        return [self.keys.handoff]


class RequestWorker(WorkerBase):
    """A worker that reads the request streams (prefill and colocated): the loop they
    share. Subclasses set ``engine`` and ``inflight`` (request id -> Intake) and provide
    ``housekeeping``, ``publish`` and ``load``."""

    def iteration(self) -> bool:
        self.housekeeping()
        busy = self.engine.has_unfinished
        if not self.stop.warm.is_set() and self.engine.num_waiting == 0:
            self.take_requests(block_ms=0 if busy else 100)
        elif not busy:
            return False
        if self.engine.has_unfinished:
            self.publish(self.engine.step())
        elif self.config.burst and not self.inflight:
            return False
        self.heartbeat.update(**self.load())
        return True

    def read_limit(self) -> int:
        """How many request entries to take at once."""
        return self.config.max_batch_requests

    def take_requests(self, block_ms: int) -> None:
        limit = self.read_limit()
        entries = self.redelivered(K.PREFILL_GROUP, self.keys.request_streams,
                                   {it.entry_id for it in self.inflight.values()})
        if entries:
            self.admit(self.engine, entries, self.inflight)
            return
        entries = self.reclaim(K.PREFILL_GROUP, self.keys.request_streams, limit)
        if not entries:
            entries = self.read(K.PREFILL_GROUP, self.keys.request_streams, limit, block_ms)
        self.admit(self.engine, entries, self.inflight)


def tbt_stats(times_ms: list[float]) -> tuple[float, float]:
    gaps = sorted(b - a for a, b in zip(times_ms, times_ms[1:]))
    if not gaps:
        return 0.0, 0.0
    return gaps[len(gaps) // 2], gaps[-1]

