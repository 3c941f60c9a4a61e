"""The prefill worker: prompts in, first tokens and KV tickets out.

Lifecycle of a request here: ``requests:high`` then ``requests`` (group ``prefill``) ->
intake -> engine (waiting -> prefill step) -> first token sampled -> the sequence's blocks
are detached from the engine and exported under a lease (``KVSender``) -> one MULTI/EXEC
publishes the first token on ``out:<id>``, adds the handoff (ticket inside) to the handoff
stream of a decode worker's node (its own node when a decode worker lives there, else the
global one) and acknowledges the request entry. The blocks come back to the engine when
the decode side releases the lease or the lease expires (``poll_freeable``).

The KV pool lives in a named shared-memory segment (created once, pre-faulted), so a
decode worker on this node copies blocks straight out of it; the ZeroMQ server of the
sender serves the others.
"""

from __future__ import annotations

import logging
import time

from pdqueue import keys as K
from pdqueue.engine.llm_engine import LLMEngine, kv_layout_for
from pdqueue.protocol import Completion, Handoff, encode_handoff
from pdqueue.queue.ownership import Write
from pdqueue.queue.registry import list_workers
from pdqueue.transfer.node import node_id
from pdqueue.transfer.sender import KVSender
from pdqueue.transfer.shm import DEFAULT_PREFIX, SharedKVPool
from workers.base import Intake, RequestWorker
from workers.common import WorkerConfig, now_ms

log = logging.getLogger("pdqueue.prefill")


class PrefillWorker(RequestWorker):
    role = "prefill"

    def __init__(self, config: WorkerConfig, loaded):
        super().__init__(config, loaded)
        self.node = node_id()
        # Before our own pool takes room: crashed predecessors' segments (the loop's
        # periodic sweep, WorkerBase.sweep_segments, gets those still kept for their leases).
        self.removed_segments = self.sweep_segments(force=True)
        layout = kv_layout_for(loaded.config, config.engine)
        if config.engine.device == "cpu":
            # The pool lives in shared memory: decode workers on this node copy from it.
            self.pool = SharedKVPool.create(layout, DEFAULT_PREFIX, self.worker_id, self.incarnation)
            self.engine = LLMEngine(loaded, config.engine, kv_cache=self.pool.tensor, prefill_only=True)
            self.sender = KVSender.for_shared_pool(self.pool, self.node, endpoint=config.bind,
                                                   advertise=config.advertise, lease_s=config.lease_s,
                                                   data_port=config.data_port)
        else:
            # An accelerator's pool cannot be mapped by another process: KV goes over ZeroMQ.
            self.pool = None
            self.engine = LLMEngine(loaded, config.engine, prefill_only=True)
            self.sender = KVSender(self.engine.kv_cache, self.engine.layout, self.worker_id, self.incarnation,
                                   self.node, endpoint=config.bind, advertise=config.advertise,
                                   lease_s=config.lease_s)
        self.inflight: dict[str, Intake] = {}
        self._decode_nodes: set[str] = set()
        self._decode_nodes_at = 0.0

    def run(self) -> None:
        self.ensure_groups()
        endpoints = {"kv": self.sender.endpoint, "kv_data": self.sender.data_endpoint}
        self.start_heartbeat(node=self.node, endpoints={k: v for k, v in endpoints.items() if v}, load=self.load())
        self.publisher = self.make_publisher()
        # A restart under the same worker id picks up what the previous process had taken.
        self.admit(self.engine, self.own_pending(K.PREFILL_GROUP, self.keys.request_streams), self.inflight)
        log.info("prefill worker %s ready (node %s, kv %s, data %s, segment %s)", self.worker_id, self.node,
                 self.sender.endpoint, self.sender.data_endpoint or "-", self.pool.name if self.pool else None)
        try:
            self.loop(self.iteration)
            self.drain_leases()
        finally:
            self.teardown()

    def housekeeping(self) -> None:
        """Blocks of ended leases back to the engine; requests waiting in a busy engine kept
        from looking abandoned (those another worker took over anyway are dropped)."""
        self.free_released()
        for rid in self.keep_ownership({rid: (it.stream, it.entry_id) for rid, it in self.inflight.items()},
                                       K.PREFILL_GROUP):
            self.engine.abort(rid)
            del self.inflight[rid]

    def load(self) -> dict:
        return {"running": self.engine.num_running, "waiting": self.engine.num_waiting,
                "kv_free": self.engine.block_manager.num_free_blocks,
                "kv_total": self.engine.layout.num_blocks, "leases": len(self.sender.leases)}

    def free_released(self) -> None:
        for _request_id, block_ids in self.sender.poll_freeable():
            self.engine.free_blocks(list(block_ids))

    def drain_leases(self) -> None:
        """Warm stop: keep serving exported KV until every lease is released or expired."""
        deadline = time.monotonic() + self.config.lease_s + 1
        while len(self.sender.leases) and time.monotonic() < deadline and not self.stop.cold.is_set():
            self.free_released()
            time.sleep(0.02)
        self.free_released()

    def handoff_stream(self) -> str:
        """This node's handoff stream when a decode worker lives on this node, else the global one."""
        if time.monotonic() - self._decode_nodes_at > 1.0:
            try:
                self._decode_nodes = {w.get("node") for w in list_workers(self.r, self.keys, role="decode")}
                self._decode_nodes_at = time.monotonic()
            except Exception:
                pass
        if self.config.transfer in ("auto", "shm") and self.node in self._decode_nodes:
            return self.keys.handoff_node(self.node)
        return self.keys.handoff

    def publish(self, outputs) -> None:
        ops: list = []
        t = now_ms()
        exported = False
        for out in outputs:
            it = self.inflight.pop(out.request_id)
            req = it.request
            self.add_token(ops, req.id, out.index, out.token_id, out.text)
            if out.finished:  # max_tokens 1, EOS or a stop string at once: no decode needed
                writes = self.done_writes(Completion(
                    req.id, out.full_text or "", (out.token_id,), out.finish_reason,
                    num_prompt_tokens=len(it.prompt_ids), ttft_ms=t - req.enqueued_ms,
                    queue_ms=it.read_ms - req.enqueued_ms, prefill_ms=t - it.read_ms,
                    e2e_ms=t - req.enqueued_ms, prefill_worker=self.worker_id, transfer_path="none"))
            else:
                ticket = self.sender.export(req.id, out.detached_blocks, len(it.prompt_ids))
                exported = True
                handoff = Handoff(request=req, prompt_ids=it.prompt_ids, output_ids=[out.token_id],
                                  seed=it.params.seed, ticket=ticket.to_dict(), prefill_worker=self.worker_id,
                                  enqueued_ms=req.enqueued_ms, prefill_start_ms=it.read_ms,
                                  prefill_end_ms=t, first_token_ms=t)
                writes = [Write(self.handoff_stream(), encode_handoff(handoff))]
            self.add_outcome(ops, it.stream, it.entry_id, K.PREFILL_GROUP, writes)
        if exported and self.pool:
            # Before any of these tickets is out: should we die, the segment stays while
            # their leases could still be live, for decode workers to copy from.
            self.pool.keep_until(time.time() + self.config.lease_s)
        if ops:
            self.publisher.submit(ops)

    def teardown(self) -> None:
        if getattr(self, "publisher", None):
            self.publisher.close(timeout=10)
        self.sender.close()
        if self.pool:
            self.pool.close(unlink=True)
        if self.heartbeat:
            self.heartbeat.stop()
        log.info("prefill worker %s stopped", self.worker_id)
