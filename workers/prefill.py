"""The prefill role: prompts in, first tokens and KV tickets out.

A request here, from XADD to handoff:

    requests:high, then requests (group prefill)
      -> accept:   Intake (workers/intake.py) admits it into the engine (``inflight``), or
                   answers it at once (expired, cancelled, duplicate, invalid)
      -> step:     the engine prefills it and samples its first token; the sequence leaves
                   the engine, its blocks *detached* (not freed: now the worker's)
      -> publish:  one unit: the token at index 0 on out:<id>, then the request entry is
                   finished (once: ack_and_write) with
                   - done, when the first token already ends it (EOS, stop string,
                     max_tokens 1): no decode needed; or
                   - the handoff (ticket inside: ``KVSender.export`` put the blocks under a
                     lease) on the handoff stream of this node when a decode worker lives
                     here, else on the global one; while a decode worker of another kind
                     (KV format, model, wire version) lives, on the stream of this worker's
                     kind, ``handoff:kv:<key>`` (workers/compat.py): only the decode workers
                     compatible with it count, here and for what follows
      -> the blocks come back to the engine when the decode side releases the lease or it
         expires (``free_released``, before each step)

Kept here (``--decode-here auto``): when every live decode worker is full (no free slot or
no free KV, counting the handoffs sent since their beats: ``DecodePeers.room``), the online
prompts prefilled in the next step stay in the engine after their first token and decode
here, answered as a colocated worker answers (``publish_local``: done with ``transfer_path``
local), cancelled or expired ones ended every ~100 ms. A handoff would only wait in the
stream for a slot; the price is this worker's steps (its later prompts wait behind these
decodes). Once room comes back, new requests are handed over again; the kept ones finish
here (also on a warm stop or a switch, before the leases are served).

Dropped (another worker took the entry over): aborted in the engine, no answer. A warm stop
(or a switch to another role) takes nothing new, finishes the prefills in hand, then serves
exported KV until every lease is gone (``drain``, at most lease + 1 s). The pool outlives
the role: before the next role gets it, the shell bumps every block's epoch.

The KV pool is the process's (``RoleHost.kv_pool``), in a named shared-memory segment
(created once, pre-faulted), so a decode worker on this node copies blocks straight out of
it; the sender's TCP data server and ZeroMQ socket serve the others.
"""

from __future__ import annotations

import logging
import time

from pdqueue.engine.llm_engine import LLMEngine
from pdqueue.protocol import Completion, Handoff, encode_handoff
from pdqueue.protocol import Role as RoleName
from pdqueue.transfer.leases import LeaseState
from workers.common import Every, now_ms
from workers.compat import own_compat, sender_fields
from workers.decode_peers import DecodePeers
from workers.kv_export import close_sender, make_sender, serve_leases
from workers.placement import Placement
from workers.role import RequestRole, RoleHost

log = logging.getLogger("pdqueue.prefill")

CHECK_EVERY_S = 0.1   # cancel keys and deadlines of the requests decoding here
# Batch prompts prefilled here and not yet fetched by a decode worker, at most (their handoffs
# wait in the handoff stream, their KV under lease here). Without a bound the prefill side ran
# ~100 batch handoffs ahead of the decode side: an online handoff then waited in the stream
# behind them (token 0 -> 1 p99 14-45 s in `bench serve --batch-lines 500 --chaos`), and the
# leases expired into recomputes. Below the decode worker's READ_LIMIT (16), so batch jobs it
# holds never stop it reading online handoffs.
BATCH_AHEAD = 8


class PrefillRole(RequestRole):
    name = RoleName.PREFILL.value

    def start(self, shell: RoleHost) -> None:
        super().start(shell)
        config = shell.config
        # One read of the decode workers' heartbeats serves the handoff stream, the placement
        # and decoding here; it holds only the decode workers compatible with this one
        # (workers/compat.py).
        self.peers = DecodePeers(shell.r, shell.keys, mine=own_compat(shell.loaded, config.engine),
                                 metrics=shell.metrics)
        # Short prompts go to a decode worker taking prompts when it would answer sooner.
        if config.placement != "off":
            self.intake.placer = Placement(shell.r, shell.keys, shell.worker_id, config.placement, peers=self.peers)
        # The process's pool (the shell's: a switch allocates nothing), in shared memory on
        # CPU, so decode workers on this node copy from it.
        kv_cache = shell.kv_pool(shared=True)
        self.pool = shell.segment
        # Prefix caching: a block handed back by a lease stays cached, intact; its epoch is
        # bumped only when the engine rewrites it (on_rewrite), and leases may share blocks.
        self.engine = LLMEngine(shell.loaded, config.engine, kv_cache=kv_cache, prefill_only=True,
                                on_rewrite=self.pool.bump_epochs if self.pool is not None else None)
        self.sender = make_sender(shell, kv_cache, self.engine.layout, transfer=config.transfer)
        self._check = Every(CHECK_EVERY_S)
        self.kept = 0   # requests decoded here because no decode worker had room (heartbeat ``decoded_here``)
        self.batch_leased: set[str] = set()   # batch requests handed off whose KV is still leased here
        log.info("prefill: node %s, kv %s, data %s, segment %s", shell.node, self.sender.endpoint,
                 self.sender.data_endpoint or "-", self.pool.name if self.pool else None)

    def registration(self) -> dict:
        endpoints = {"kv": self.sender.endpoint, "kv_data": self.sender.data_endpoint}
        return {"node": self.shell.node, "endpoints": {k: v for k, v in endpoints.items() if v}}

    def load(self) -> dict:
        return {**super().load(), "leases": len(self.sender.leases), "auth_failures": self.sender.auth_failures,
                "placed_out": self.intake.placer.placed if self.intake.placer is not None else 0,
                "decoded_here": self.kept, **self.peers.load(),
                "prefix_cache_queries": self.engine.prefix_cache_queries,
                "prefix_cache_hits": self.engine.prefix_cache_hits}

    def housekeeping(self) -> None:
        self.free_released()
        if self._check.due():
            self.end_stopped({rid: it for rid, it in self.inflight.items() if it.token_times_ms})

    def before_step(self) -> None:
        """The online prompts this step may finish stay here when no decode worker has room."""
        if self.shell.config.decode_here == "auto":   # off: nothing is ever marked
            self.engine.keep_decoding(self.shell.accepting and self.peers.room() is False)

    def reads_ahead(self) -> bool:
        """With placement, while a decode worker has room for prompts: the placement decides
        at intake, so a short prompt queued in Redis behind the prompts waiting here would
        otherwise wait for them before it could be placed (under overload, the chats after a
        burst of documents would wait in Redis while the decode worker idles)."""
        placer = self.intake.placer
        return (placer is not None and self.engine.scheduler.num_waiting_foreground < self.read_limit()
                and placer.has_room(time.monotonic()))

    def batch_room(self) -> int:
        """Batch entries only while the decode side is close to taking the ones already
        prefilled (``BATCH_AHEAD``): the rest waits in the durable request stream."""
        prefilling = sum(it.request.background for it in self.inflight.values())
        return max(0, BATCH_AHEAD - len(self.batch_leased) - prefilling)

    def free_released(self) -> None:
        """Blocks of released or expired leases go back to the engine."""
        for request_id, block_ids in self.sender.poll_freeable():
            self.batch_leased.discard(request_id)
            self.engine.free_blocks(list(block_ids))
            if self.sender.leases.last_state(request_id) is LeaseState.EXPIRED:   # never released
                self.shell.metrics.lease_expired()

    # ---- the first token out -------------------------------------------------------------
    def publish(self, outputs) -> None:
        t = now_ms()
        exported = False
        with self.shell.unit() as unit:
            for out in outputs:
                if out.seq.decode_here:   # no decode worker had room: it decodes here
                    self.kept += out.index == 0
                    self.publish_local(unit, out, t)
                    continue
                it = self.inflight.pop(out.request_id)
                req = it.request
                unit.token(req.id, out.index, out.token_id, out.text)
                self.shell.metrics.first_token(t - req.enqueued_ms, len(it.prompt_ids))
                self.router.advertise(unit, out.seq)
                if out.finished:  # max_tokens 1, EOS or a stop string at once: no decode needed
                    unit.done(it.stream, it.entry_id, Completion(
                        req.id, out.full_text or "", (out.token_id,), out.finish_reason,
                        num_prompt_tokens=len(it.prompt_ids), ttft_ms=t - req.enqueued_ms,
                        queue_ms=it.read_ms - req.enqueued_ms, prefill_ms=t - it.read_ms,
                        e2e_ms=t - req.enqueued_ms, prefill_worker=self.shell.worker_id, transfer_path="none",
                        cached_tokens=out.cached_tokens), req)
                    continue
                ticket = self.sender.export(req.id, out.detached_blocks, len(it.prompt_ids),
                                            block_hashes=out.seq.block_hashes if self.engine.prefix_caching else (),
                                            hash_root=self.engine.prefix_root if self.engine.prefix_caching else b"")
                exported = True
                if req.background:
                    self.batch_leased.add(req.id)
                handoff = Handoff(request=req, prompt_ids=it.prompt_ids, output_ids=[out.token_id],
                                  seed=it.params.seed, ticket=ticket.to_dict(), prefill_worker=self.shell.worker_id,
                                  enqueued_ms=req.enqueued_ms, prefill_start_ms=it.read_ms,
                                  prefill_end_ms=t, first_token_ms=t, cached_tokens=out.cached_tokens,
                                  **sender_fields(self.engine))
                unit.handoff(it.stream, it.entry_id, req.id, self.handoff_stream(), encode_handoff(handoff))
                self.peers.handed_off()
            if exported and self.pool:
                # Before any of these tickets is out: should we die, the segment stays while
                # their leases could still be live, for decode workers to copy from.
                self.pool.keep_until(time.time() + self.shell.config.lease_s)

    def handoff_stream(self) -> str:
        """This node's handoff stream when a compatible decode worker lives on this node, else the
        global one; while a decode worker of another kind lives, the stream of this worker's
        compatibility key (workers/compat.py)."""
        return self.peers.stream(self.shell.node, self.shell.config.transfer)

    # ---- stopping ------------------------------------------------------------------------
    def drain(self) -> None:
        """Warm stop or switch: keep serving exported KV until every lease is released or
        expired (switch commands are still answered meanwhile: ``shell.tick``)."""
        super().drain()
        serve_leases(self.shell, self.sender, self.free_released)

    def close(self) -> None:
        if self.intake.placer is not None and self.intake.placer.placed:
            log.info("placement: %d prompts placed on decode workers", self.intake.placer.placed)
        close_sender(self.sender)
        super().close()
