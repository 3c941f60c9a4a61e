"""The colocated worker: prefill and decode in one engine (the baseline pdqueue is
measured against, and a complete server on its own).

Lifecycle of a request: ``requests`` (group ``prefill``) -> intake -> engine (waiting ->
running) -> every token streamed to ``out:<id>`` through the publisher -> on finish the
``done`` entry, the ``done`` notification and the XACK of the request entry go out in one
MULTI/EXEC.
"""

from __future__ import annotations

import logging
import time

from pdqueue import keys as K
from pdqueue.engine.llm_engine import LLMEngine
from pdqueue.protocol import Completion, FinishReason
from workers.base import Intake, RequestWorker, tbt_stats
from workers.common import WorkerConfig, now_ms

log = logging.getLogger("pdqueue.colocated")


class ColocatedWorker(RequestWorker):
    role = "colocated"

    def __init__(self, config: WorkerConfig, loaded):
        super().__init__(config, loaded)
        self.engine = LLMEngine(loaded, config.engine)
        self.inflight: dict[str, Intake] = {}
        self._last_check = 0.0

    def run(self) -> None:
        self.ensure_groups()
        self.start_heartbeat(load=self.load())
        self.publisher = self.make_publisher()
        # A restart under the same worker id picks up what the previous process had taken.
        self.admit(self.engine, self.own_pending(K.PREFILL_GROUP, self.keys.request_streams), self.inflight)
        log.info("colocated worker %s ready", self.worker_id)
        try:
            self.loop(self.iteration)
        finally:
            self.teardown()

    def housekeeping(self) -> None:
        """Every ~100 ms: end cancelled and expired requests (blocks freed, done published);
        every few seconds: keep our request entries from looking idle to other workers."""
        now = time.monotonic()
        if now - self._last_check < 0.1:
            return
        self._last_check = now
        t = now_ms()
        ids = list(self.inflight)
        stopped = {rid: FinishReason.CANCELLED for rid in self.cancelled(ids)}
        stopped.update({rid: FinishReason.EXPIRED for rid in ids
                        if rid not in stopped and self.inflight[rid].request.expired(t)})
        ops: list = []
        for rid, reason in stopped.items():
            it = self.inflight.pop(rid)
            output = self.engine.abort(rid, reason.value).output_ids
            c = Completion(rid, self.tokenizer.decode(output), tuple(output), reason,
                           num_prompt_tokens=len(it.prompt_ids), e2e_ms=t - it.request.enqueued_ms,
                           prefill_worker=self.worker_id, decode_worker=self.worker_id, transfer_path="local")
            self.add_outcome(ops, it.stream, it.entry_id, K.PREFILL_GROUP, self.done_writes(c))
        if ops:
            self.publisher.submit(ops)
        for rid in self.keep_ownership({rid: (it.stream, it.entry_id) for rid, it in self.inflight.items()},
                                       K.PREFILL_GROUP):
            self.engine.abort(rid)
            del self.inflight[rid]

    def load(self) -> dict:
        return {"running": self.engine.num_running, "waiting": self.engine.num_waiting,
                "kv_free": self.engine.block_manager.num_free_blocks,
                "kv_total": self.engine.layout.num_blocks}

    def read_limit(self) -> int:
        """No more than the free batch slots: the rest stays in Redis for other workers."""
        return min(self.config.engine.max_num_seqs - self.engine.num_running, self.config.max_batch_requests)

    def publish(self, outputs) -> None:
        ops: list = []
        t = now_ms()
        for out in outputs:
            it = self.inflight[out.request_id]
            it.token_times_ms.append(t)
            self.add_token(ops, out.request_id, out.index, out.token_id, out.text)
            if out.finished:
                del self.inflight[out.request_id]
                req = it.request
                p50, pmax = tbt_stats(it.token_times_ms)
                first = it.token_times_ms[0]
                self.add_outcome(ops, it.stream, it.entry_id, K.PREFILL_GROUP, self.done_writes(Completion(
                    req.id, out.full_text or "", tuple(out.seq.output_ids), out.finish_reason,
                    num_prompt_tokens=len(it.prompt_ids), ttft_ms=first - req.enqueued_ms,
                    queue_ms=it.read_ms - req.enqueued_ms, prefill_ms=first - it.read_ms,
                    decode_ms=t - first, tbt_p50_ms=p50, tbt_max_ms=pmax, e2e_ms=t - req.enqueued_ms,
                    prefill_worker=self.worker_id, decode_worker=self.worker_id, transfer_path="local")))
        if ops:
            self.publisher.submit(ops)

    def teardown(self) -> None:
        if getattr(self, "publisher", None):
            self.publisher.close(timeout=10)
        if self.heartbeat:
            self.heartbeat.stop()
        log.info("colocated worker %s stopped", self.worker_id)
