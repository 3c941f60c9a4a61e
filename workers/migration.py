"""Running requests that move with their KV: a worker that stops taking work (a warm stop, a
role switch) hands its running decodes to a peer instead of finishing them itself.

A move, for one running sequence at a step boundary (every token it sampled is published,
the KV of all but the last is in its blocks):

    detach     the engine gives the sequence's blocks up (``LLMEngine.detach_running``)
    export     a lease on those blocks and a ticket (``KVSender``, made at the first move:
               over the shared segment when the pool is one, else TCP/ZeroMQ only)
    handoff    one unit finishes the entry in hand (``ack_and_write``) with a new handoff:
               the prompt, *every token so far*, the seed, the ticket
    resume     a decode worker takes it like any handoff: it copies the KV, and sampling
               goes on at the next index with the same seed, so the tokens are those the
               request would have had unmoved (``add_prefilled``; OutputText replays the
               earlier tokens for stop strings)
    free       the blocks come back to the engine when the receiver releases the lease or
               it expires (``poll_freeable``); the drain waits for that, at most lease + 1 s

Failure rules (each the existing rule of a handoff, so nothing new can be lost or doubled):
the source dies before its unit lands: the old entry is pending under it and is taken over,
the taker catches up with ``out:<id>`` and recomputes; it dies after: the new handoff is in
Redis and its segment outlives it for the lease (``keep_until``), else the fetch fails and the
receiver recomputes from prompt + tokens; the receiver dies: its entry is taken over as any
handoff. The tokens on ``out:<id>`` are the source's, then the receiver's from the next index.

A planner may also ask a colocated worker that goes on serving to move some of its running
decodes (``op=migrate``, pdqueue/control/commands.py): the same move, to the same peers
(``peer_stream``), with no drain announced.

Where to: only while a peer decode worker lives that is not itself stopping or switching
(``draining`` in its heartbeat's load) and is compatible with this one (the same KV format,
model and wire versions: workers/compat.py; one of another kind is said once in the log and
never chosen). Stopping workers announce it at once and look for peers ``SETTLE_S`` later, so
two workers stopped together (``up``'s Ctrl-C) do not hand their requests to each other: they
finish them, as without migration. The stream is the one a prefill worker would write
(``compat.handoff_stream``): this node's or the shared one, or while a decode worker of another
kind lives, the stream of this worker's kind. A moved request's handoff names this worker's
KV identity and wire (``resume``): its KV is this worker's now.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from pdqueue.protocol import Handoff, Role
from pdqueue.protocol.compat import Compat
from pdqueue.queue.registry import list_workers
from pdqueue.transfer.sender import KVSender
from workers.compat import Once, engine_compat, handoff_stream, say_incompatible, sender_fields, split
from workers.kv_export import close_sender, make_sender, serve_leases

if TYPE_CHECKING:
    from workers.role import RoleHost

log = logging.getLogger("pdqueue.migration")

SETTLE_S = 0.25       # after announcing a drain, before reading which peers still take work
PEERS_EVERY_S = 0.2   # while requests remain that could not move yet, peers are read this often


class Migrator:
    """A role's side of moving its running requests away (decode role)."""

    def __init__(self, shell: RoleHost, engine):
        self.shell, self.engine = shell, engine
        self.sender: KVSender | None = None
        self.announced_at: float | None = None
        self.moved = 0
        self.started_at: float | None = None
        self.last_export_at: float | None = None
        self._target: str | None = None
        self._target_at = 0.0
        self.compat = engine_compat(engine)
        self._once = Once()

    # ---- when ------------------------------------------------------------------------------
    def announce(self) -> None:
        """Once, when the role stops accepting: tell peers now (a beat), not at the next beat."""
        if self.announced_at is not None:
            return
        self.announced_at = time.monotonic()
        try:
            self.shell.advertise(draining=1)
        except Exception as exc:   # the next regular beat says it; peers may then hand work here
            log.warning("could not announce the drain: %s", exc)

    def target(self) -> str | None:
        """The handoff stream to move to, or None: no peer takes work (finish here)."""
        now = time.monotonic()
        if self.announced_at is None or now - self.announced_at < SETTLE_S:
            return None
        if now - self._target_at < PEERS_EVERY_S:
            return self._target
        self._target_at = now
        self._target = self._find_target()
        return self._target

    def peer_stream(self) -> str | None:
        """Like ``target`` but without a drain (a planner's ``migrate`` command: the role
        keeps taking work): the handoff stream to move to now, or None (no peer takes work)."""
        now = time.monotonic()
        if now - self._target_at >= PEERS_EVERY_S:
            self._target_at = now
            self._target = self._find_target()
        return self._target

    def _find_target(self) -> str | None:
        shell = self.shell
        try:
            workers = list_workers(shell.r, shell.keys, role=Role.DECODE.value)
        except Exception:
            return None
        stream, incompatible = target_stream(shell.keys, self.compat, shell.worker_id, shell.node,
                                             shell.config.transfer, workers)
        say_incompatible(self._once, self.compat, incompatible, "no running request moves to it", shell.metrics)
        return stream

    # ---- how -------------------------------------------------------------------------------
    def _sender(self) -> KVSender:
        if self.sender is None:
            shell = self.shell
            if shell.segment is not None:
                # From now on, a block this engine hands out for new content gets a new epoch
                # first, so a late shm copy of an exported block cannot validate.
                self.engine.block_manager.on_rewrite = shell.segment.bump_epochs
            self.sender = make_sender(shell, self.engine.kv_cache, self.engine.layout)
            log.info("migration: KV served at %s, data %s, segment %s", self.sender.endpoint,
                     self.sender.data_endpoint or "-", shell.segment.name if shell.segment else None)
        return self.sender

    def export(self, request_id: str):
        """Detach the running sequence of ``request_id`` and lease its KV: (the sequence, the
        ticket as a dict), or None when it is not at a point it can move from (prefilling)."""
        rid = request_id
        detached = self.engine.detach_running(rid)
        if detached is None:
            return None
        seq, block_ids = detached
        if self.started_at is None:
            self.started_at = time.monotonic()
        engine = self.engine
        ticket = self._sender().export(
            rid, block_ids, seq.num_cached_tokens,
            block_hashes=seq.block_hashes if engine.prefix_caching else (),
            hash_root=engine.prefix_root if engine.prefix_caching else b"")
        if self.shell.segment is not None:
            # Should we die now, the segment stays while the lease could be live.
            self.shell.segment.keep_until(time.time() + self.shell.config.lease_s)
        self.moved += 1
        self.last_export_at = time.monotonic()
        return seq, ticket.to_dict()

    def resume(self, handoff: Handoff) -> Handoff | None:
        """The handoff that resumes a running request of the decode role elsewhere (its
        times and attempts kept), or None (see ``export``)."""
        exported = self.export(handoff.request.id)
        if exported is None:
            return None
        seq, ticket = exported
        return replace(handoff, prompt_ids=list(seq.prompt_ids), output_ids=list(seq.output_ids), ticket=ticket,
                       **sender_fields(self.engine))

    def free_released(self) -> None:
        if self.sender is not None:
            for _rid, block_ids in self.sender.poll_freeable():
                self.engine.free_blocks(list(block_ids))

    # ---- the end -----------------------------------------------------------------------------
    def drain(self) -> None:
        """Serve the exported KV until every lease is released or expired."""
        if self.sender is None:
            return
        serve_leases(self.shell, self.sender, self.free_released)
        if self.started_at is not None:
            # (no drain announced before the first move: a planner's migrate command, made
            # while the role served; then the stop, if any, came later)
            settle_s = self.started_at - self.announced_at if self.announced_at is not None else 0.0
            self.report = {"moved": self.moved, "settle_ms": max(0.0, settle_s) * 1e3,
                           "export_ms": (self.last_export_at - self.started_at) * 1e3,
                           "fetched_ms": (time.monotonic() - self.last_export_at) * 1e3,
                           "left_leased": len(self.sender.leases)}
            log.info("migration: %(moved)d running requests moved: %(settle_ms).0f ms from the stop to the first "
                     "move (announce, settle, peers), %(export_ms).0f ms detaching and exporting, then "
                     "%(fetched_ms).0f ms until the peers had fetched their KV (%(left_leased)d leases left)",
                     self.report)

    def close(self) -> None:
        if self.sender is None:
            return
        close_sender(self.sender)


def target_stream(keys, mine: Compat, worker_id: str, node: str, transfer: str,
                  workers: list[dict]) -> tuple[str | None, list[dict]]:
    """Where worker ``worker_id`` (record ``mine``, on ``node``) moves running requests, given
    the live decode workers (``workers``): the handoff stream, or None (no compatible peer
    takes work: finish here); and the decode workers of another kind it routed around."""
    others = [w for w in workers if w["worker_id"] != worker_id]
    compatible, incompatible = split(others, mine)
    peers = [w for w in compatible if not w.get("switching_to") and not (w.get("load") or {}).get("draining")]
    if not peers:
        return None, incompatible
    return handoff_stream(keys, mine, node, transfer, peers, incompatible), incompatible
