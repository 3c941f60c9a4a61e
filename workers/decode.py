"""The decode worker: handoffs in, tokens and completions out, continuous batching.

Lifecycle of a request here: ``handoff:<own node>`` then ``handoff`` (group ``decode``) ->
taken only when there is room (batch slot and blocks for the whole sequence) -> blocks
reserved -> KV fetched by the fetch thread (shm when the ticket's node is ours, else the
sender's TCP data wire, else ZeroMQ), off the step loop -> admitted into the running batch
at the next step boundary (or this one, when the fetch lands within a short grace) -> every
token streamed to ``out:<id>`` through the publisher (never blocks the step) -> on finish
one MULTI/EXEC writes the ``done`` entry, the ``done`` notification and acknowledges the
handoff.

A handoff whose KV cannot be fetched (prefill worker dead, lease expired, stale
incarnation) or that carries no ticket is recomputed here from its prompt and the tokens
generated so far; the stream continues at the next index.
"""

from __future__ import annotations

import json
import logging
import queue
import time
import threading
from dataclasses import dataclass, field

from pdqueue import keys as K
from pdqueue.engine.llm_engine import LLMEngine
from pdqueue.engine.sampling import SamplingParams
from pdqueue.engine.sequence import Sequence
from pdqueue.protocol import Completion, ErrorCode, FinishReason, Handoff, HandoffError, decode_handoff
from pdqueue.transfer.errors import TransferError
from pdqueue.transfer.node import node_id
from pdqueue.transfer.receiver import KVReceiver
from workers.base import WorkerBase, tbt_stats
from workers.common import WorkerConfig, now_ms

log = logging.getLogger("pdqueue.decode")

READ_LIMIT = 16  # handoffs taken per step boundary at most (each still needs room to start)


@dataclass(slots=True)
class Job:
    stream: str
    entry_id: str
    handoff: Handoff
    params: SamplingParams
    read_ms: float
    seq: Sequence | None = None
    transfer_ms: float = 0.0
    transfer_bytes: int = 0
    transfer_path: str = ""
    error: str | None = None
    admitted_ms: float = 0.0
    fetched_ms: float = 0.0     # KV in place (fetch finished, or recompute admitted)
    token_times_ms: list[float] = field(default_factory=list)


class DecodeWorker(WorkerBase):
    role = "decode"

    def __init__(self, config: WorkerConfig, loaded):
        super().__init__(config, loaded)
        self.node = node_id()
        self.engine = LLMEngine(loaded, config.engine)
        self.receiver = KVReceiver(self.engine.kv_cache, self.engine.layout, self.node,
                                   mode=config.transfer, timeout_s=config.fetch_timeout_s)
        self.jobs: dict[str, Job] = {}
        self.backlog: list[Job] = []         # taken from Redis, waiting for room
        self._to_fetch: queue.Queue = queue.Queue()
        self._fetched: queue.Queue = queue.Queue()
        self._fetcher = threading.Thread(target=self._fetch_loop, name="kv-fetch", daemon=True)
        self._fetching = 0                   # jobs handed to the fetch thread, not yet admitted
        self._step_s = 0.05                  # moving average of an engine step
        self._last_check = 0.0

    def handoff_streams(self) -> list[str]:
        return [self.keys.handoff_node(self.node), self.keys.handoff]

    def run(self) -> None:
        self.ensure_groups()
        self.start_heartbeat(node=self.node, load=self.load())
        self.publisher = self.make_publisher()
        self._fetcher.start()
        self.accept(self.own_pending(K.DECODE_GROUP, self.handoff_streams()), resumed=True)
        log.info("decode worker %s ready (node %s, transfer %s)", self.worker_id, self.node, self.config.transfer)
        try:
            self.loop(self.iteration)
        finally:
            self.teardown()

    def iteration(self) -> bool:
        """One step boundary. Admission runs here, between two engine steps: take every
        handoff there is room for, reserve its blocks and start its fetch, then give the
        fetches just started a short grace (``admit_grace_s``) so that fast ones (shm: a few
        ms) join this very step; slower ones join at the next boundary while the step runs."""
        self.admit_fetched()
        idle = not self.engine.has_unfinished and not self.jobs
        if not self.stop.warm.is_set():
            if not self.backlog and self.has_room():
                self.take_handoffs(block_ms=100 if idle else 0)
        elif idle and not self.backlog:
            return False
        started = self.start_backlog()
        if started and self.engine.has_unfinished:
            self.admit_fetched(wait_s=self.admit_grace_s())
        self.housekeeping()
        if self.engine.has_unfinished:
            t0 = time.perf_counter()
            outputs = self.engine.step()
            self._step_s = 0.8 * self._step_s + 0.2 * (time.perf_counter() - t0)
            self.publish(outputs)
        elif self.config.burst and not self.jobs and not self.backlog:
            return False
        elif self._fetching:
            self.admit_fetched(wait_s=0.05)  # nothing to step: wait for a fetch to land
        self.heartbeat.update(**self.load())
        return True

    def admit_grace_s(self) -> float:
        """How long the running batch may wait at a step boundary for fetches just started:
        a quarter of a recent step, between 2 and 25 ms (a new sequence that misses this
        step waits a whole step more, while the batch pays this once)."""
        return min(0.025, max(0.002, 0.25 * self._step_s))

    def load(self) -> dict:
        return {"running": self.engine.num_running, "waiting": self.engine.num_waiting,
                "fetching": self._fetching, "backlog": len(self.backlog),
                "kv_free": self.engine.block_manager.num_free_blocks,
                "kv_total": self.engine.layout.num_blocks}

    def has_room(self) -> bool:
        return (len(self.jobs) < self.config.engine.max_num_seqs
                and self.engine.block_manager.num_free_blocks > 0)

    # ---- taking handoffs -------------------------------------------------------------
    def take_handoffs(self, block_ms: int) -> None:
        held = {job.entry_id for job in self.jobs.values()} | {job.entry_id for job in self.backlog}
        lost = self.redelivered(K.DECODE_GROUP, self.handoff_streams(), held)
        if lost:
            self.accept(lost, resumed=True)
            return
        room = min(READ_LIMIT, self.config.engine.max_num_seqs - len(self.jobs))
        entries = self.reclaim(K.DECODE_GROUP, self.handoff_streams(), room)
        resumed = bool(entries)
        if not entries:
            entries = self.read(K.DECODE_GROUP, self.handoff_streams(), room, block_ms)
        self.accept(entries, resumed)

    def accept(self, entries, resumed: bool) -> None:
        """Queue handoff entries; ``resumed``: taken over from a dead or hung decode worker
        (or our own previous process), so the answer stream may already hold more tokens."""
        for stream, entry_id, fields in entries:
            ops: list = []
            try:
                if fields is None:
                    raise HandoffError("entry was deleted")
                h = decode_handoff(fields)
            except HandoffError as exc:
                self.reject(ops, stream, entry_id, fields, None, f"bad handoff: {exc}", ErrorCode.BAD_REQUEST,
                            group=K.DECODE_GROUP)
                self.publisher.submit(ops)
                continue
            req = h.request
            problem = self.check_handoff(h)
            if problem:
                ops = []
                self.reject(ops, stream, entry_id, fields, req.id, f"bad handoff: {problem}", ErrorCode.BAD_REQUEST,
                            group=K.DECODE_GROUP)
                self.publisher.submit(ops)
                continue
            if resumed and not self.catch_up(h, stream, entry_id):
                continue
            params = SamplingParams(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                                    top_k=req.top_k, seed=h.seed, stop=tuple(req.stop),
                                    ignore_eos=req.ignore_eos)
            self.backlog.append(Job(stream, entry_id, h, params, now_ms()))

    def check_handoff(self, h: Handoff) -> str | None:
        """What makes a (well-formed) handoff impossible to run here, or None."""
        vocab = self.loaded.config.vocab_size
        if any(t >= vocab for t in h.prompt_ids) or any(t >= vocab for t in h.output_ids):
            return f"token ids beyond the vocabulary ({vocab})"
        if len(h.output_ids) > h.request.max_tokens:
            return "more output tokens than max_tokens"
        return self.engine.check_prompt(len(h.prompt_ids) + len(h.output_ids))

    def catch_up(self, h: Handoff, stream: str, entry_id: str) -> bool:
        """Resume from what ``out:<id>`` already shows: tokens published by the previous
        owner are kept (recompute from prompt + those), so the stream continues at the next
        index with no gap, no duplicate and no divergence. False if already answered."""
        tokens: dict[int, list[int]] = {}
        for _eid, fields in self.r.xrange(self.keys.out(h.request.id)):
            kind = fields.get(b"type")
            if kind in (b"done", b"error"):
                ops: list = []
                self.add_ack(ops, stream, entry_id, K.DECODE_GROUP)
                self.publisher.submit(ops)
                return False
            if kind == b"token":
                tokens[int(fields[b"index"])] = json.loads(fields[b"token_ids"])
        output: list[int] = []
        while len(output) in tokens:
            output += tokens[len(output)]
        if len(output) > len(h.output_ids):
            log.info("resuming %s after %d published tokens", h.request.id, len(output))
            h.output_ids = output
            h.ticket = None  # the exported KV covers fewer tokens: recompute
        return True

    def start_backlog(self) -> int:
        """Reserve blocks for taken handoffs and queue their fetch, while there is room;
        returns how many fetches it started."""
        started = 0
        while self.backlog:
            job = self.backlog[0]
            h = job.handoff
            if h.request.id in self.jobs:  # a duplicate delivery of a request we run
                self.backlog.pop(0)
                ops: list = []
                self.add_ack(ops, job.stream, job.entry_id, K.DECODE_GROUP)
                self.publisher.submit(ops)
                continue
            num_tokens = len(h.prompt_ids) + len(h.output_ids)
            if not self.engine.can_reserve(num_tokens + 1):
                return started
            self.backlog.pop(0)
            self.jobs[h.request.id] = job
            if h.request.expired(now_ms()):
                self.finish_early(job, Sequence(h.request.id, h.prompt_ids, job.params, h.output_ids),
                                  FinishReason.EXPIRED)
                continue
            if self.cancelled([h.request.id]):
                self.finish_early(job, Sequence(h.request.id, h.prompt_ids, job.params, h.output_ids),
                                  FinishReason.CANCELLED)
                continue
            if h.ticket is None:
                self.recompute(job, "no KV ticket")
                continue
            job.seq = self.engine.reserve(h.request.id, h.prompt_ids, job.params, h.output_ids)
            self._fetching += 1
            started += 1
            self._to_fetch.put(job)
        return started

    def _fetch_loop(self) -> None:
        while True:
            job = self._to_fetch.get()
            if job is None:
                return
            try:
                num_blocks = len(job.handoff.ticket["block_ids"])
                result = self.receiver.fetch(job.handoff.ticket, job.seq.block_table[:num_blocks])
                job.transfer_ms = result.seconds * 1e3
                job.transfer_bytes = result.nbytes
                job.transfer_path = result.path
                job.fetched_ms = now_ms()
            except TransferError as exc:
                job.error = str(exc)
            except Exception as exc:  # never let the fetch thread die
                log.exception("fetch of %s failed", job.handoff.request.id)
                job.error = f"internal: {exc}"
            self._fetched.put(job)

    def admit_fetched(self, wait_s: float = 0.0) -> None:
        """Add every finished fetch to the engine (recompute the failed ones); with
        ``wait_s``, wait up to that long for the fetches still running."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                remaining = deadline - time.monotonic()
                if self._fetching and remaining > 0:
                    job = self._fetched.get(timeout=remaining)
                else:
                    job = self._fetched.get_nowait()
            except queue.Empty:
                return
            self._fetching -= 1
            if job.error:
                log.warning("KV fetch for %s failed (%s): recomputing", job.handoff.request.id, job.error)
                self.engine.unreserve(job.seq)
                job.seq = None
                self.recompute(job, job.error)
                continue
            job.admitted_ms = now_ms()
            self.engine.add_prefilled(job.seq)

    def recompute(self, job: Job, why: str) -> None:
        h = job.handoff
        if h.attempt >= self.config.max_attempts:
            del self.jobs[h.request.id]
            ops: list = []
            reason = f"gave up after {h.attempt} attempts: {why}"
            self.add_outcome(ops, job.stream, job.entry_id, K.DECODE_GROUP,
                             self.error_writes(h.request.id, reason, ErrorCode.INTERNAL, len(h.output_ids)))
            self.publisher.submit(ops)
            return
        h.attempt += 1
        job.transfer_path = "recompute"
        job.admitted_ms = job.fetched_ms = now_ms()
        self.engine.add_request(h.request.id, h.prompt_ids, job.params, output_ids=h.output_ids)

    # ---- cancel, deadlines, ownership ------------------------------------------------
    def housekeeping(self) -> None:
        """Every ~100 ms: stop cancelled and expired requests; every few seconds: keep our
        handoff entries from looking idle, and drop those another worker took over."""
        now = time.monotonic()
        if now - self._last_check < 0.1:
            return
        self._last_check = now
        in_engine = set(self.engine.request_ids())
        running = [rid for rid in self.jobs if rid in in_engine]
        t = now_ms()
        stopped = {rid: FinishReason.CANCELLED for rid in self.cancelled(running)}
        for rid in running:
            if rid not in stopped and self.jobs[rid].handoff.request.expired(t):
                stopped[rid] = FinishReason.EXPIRED
        for rid, reason in stopped.items():
            self.finish_now(rid, reason)
        held = {rid: (job.stream, job.entry_id) for rid, job in self.jobs.items()}
        for rid in self.keep_ownership(held, K.DECODE_GROUP):
            self.engine.abort(rid)
            del self.jobs[rid]

    def finish_now(self, request_id: str, reason: FinishReason) -> None:
        """End a request early (cancelled, expired): blocks freed, a done entry published."""
        if request_id not in self.engine.request_ids():
            return  # still fetching: handled when the fetch completes
        self.finish_early(self.jobs[request_id], self.engine.abort(request_id, reason.value), reason)

    def finish_early(self, job: Job, seq: Sequence, reason: FinishReason) -> None:
        """Publish the done entry of a request stopped before its end (the handoff acked)."""
        del self.jobs[job.handoff.request.id]
        c = self.completion(job, seq, now_ms(), text=self.tokenizer.decode(seq.output_ids), reason=reason)
        ops: list = []
        self.add_outcome(ops, job.stream, job.entry_id, K.DECODE_GROUP, self.done_writes(c))
        self.publisher.submit(ops)

    # ---- publishing ------------------------------------------------------------------
    def publish(self, outputs) -> None:
        ops: list = []
        t = now_ms()
        for out in outputs:
            job = self.jobs[out.request_id]
            job.token_times_ms.append(t)
            self.add_token(ops, out.request_id, out.index, out.token_id, out.text)
            if out.finished:
                del self.jobs[out.request_id]
                c = self.completion(job, out.seq, t, text=out.full_text or "", reason=out.finish_reason)
                self.add_outcome(ops, job.stream, job.entry_id, K.DECODE_GROUP, self.done_writes(c))
        if ops:
            self.publisher.submit(ops)

    def completion(self, job: Job, seq, t: float, text: str, reason) -> Completion:
        h = job.handoff
        req = h.request
        times = [h.first_token_ms] + job.token_times_ms
        p50, pmax = tbt_stats(times)
        second = job.token_times_ms[0] if job.token_times_ms else 0.0
        return Completion(
            req.id, text, tuple(seq.output_ids), reason,
            num_prompt_tokens=len(h.prompt_ids), ttft_ms=h.first_token_ms - req.enqueued_ms,
            queue_ms=h.prefill_start_ms - req.enqueued_ms, prefill_ms=h.prefill_end_ms - h.prefill_start_ms,
            transfer_ms=job.transfer_ms, transfer_bytes=job.transfer_bytes,
            decode_ms=t - job.admitted_ms, tbt_p50_ms=p50, tbt_max_ms=pmax, e2e_ms=t - req.enqueued_ms,
            prefill_worker=h.prefill_worker, decode_worker=self.worker_id, transfer_path=job.transfer_path,
            handoff_ms=job.read_ms - h.first_token_ms,
            first_step_ms=second - job.fetched_ms if second else 0.0,
            ttst_ms=second - req.enqueued_ms if second else 0.0)

    def teardown(self) -> None:
        self._to_fetch.put(None)
        if getattr(self, "publisher", None):
            self.publisher.close(timeout=10)
        self.receiver.close()
        if self.heartbeat:
            self.heartbeat.stop()
        log.info("decode worker %s stopped", self.worker_id)
