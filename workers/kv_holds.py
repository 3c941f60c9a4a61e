"""A finished request's KV kept exported for the next turn to pull (issue 41, item 2): the
holder's half of the pull (workers/kv_pull.py is the puller's).

The worker that decoded turn N (a decode or colocated worker) holds its KV, prompt and
answer, in its pool. The next turn's prompt repeats all of it; the worker that takes that turn
may be on another node, or share no disk tier with this one. So when a request ends here:

- *Hold.* The sequence's full blocks still named in the prefix cache get a reference each
  (``BlockManager.hold_cached``: never evicted, never rewritten) and are exported under a
  lease by this role's own ``KVSender`` (``workers/kv_export.make_sender``; the same ticket
  machinery as a handoff, signed with the cluster's secret) for ``HOLD_TTL_S``. Served from
  the pool the worker has: a shared segment (a ``--switchable`` worker's on CPU) is copied
  by pullers of its node, a plain pool in host memory goes over its TCP data server, a
  device pool over ZeroMQ. (The pool is not made a segment for holds: that would put every
  decode worker's pool in ``/dev/shm``, sized for prefill workers, and move a plain decode
  worker's migrations onto shm.)
- *Advertise.* In the unit that publishes the request's ``done``: ``kvticket:<hold id>`` =
  the packed ticket, and ``kvhold:<hash>`` = the hold id for each of its blocks' chain hashes,
  all with the hold's TTL (pdqueue/keys.py). A puller finds the deepest block of its prompt's
  chain that a hold covers, beyond what it holds itself. A hint: a hold revoked meanwhile
  costs a failed pull, which is a recompute.
- *Bounds.* At most ``HOLD_SHARE`` of the pool is held (the oldest holds are revoked first
  when a new one would pass it), and holds never keep the engine from blocks it needs:
  before each step (``relieve``) the oldest are revoked while fewer than ``KEEP_FREE_SHARE``
  of the pool plus what waits for blocks are free. A revoked or pulled hold's blocks go back
  to the engine (``free_released``) and stay cached there, as any finished request's.
  The heartbeat counts held blocks as free (``kv_free``: given back on demand; those no
  running request shares) and
  shows them as ``kv_held``, with ``kv_holds_pulled`` (holds a peer pulled) and
  ``kv_holds_revoked``.
- *Epochs.* With a shared segment the engine bumps a block's epoch before it rewrites it
  (``on_rewrite``), so an shm copy of a hold that was revoked and whose blocks were reused
  cannot validate; a TCP pull of a revoked hold is refused by the sender. Either way the
  puller recomputes.

Only blocks named by this engine's own chain are held (a sequence whose KV a sender of
another root named, ``max_hashed_blocks``, is not): a ticket's ``hash_root`` is this
engine's, and a puller of another root never uses it.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from typing import TYPE_CHECKING

from pdqueue.transfer.leases import LeaseState
from workers.kv_export import close_sender, make_sender

if TYPE_CHECKING:
    from workers.role import RoleHost

log = logging.getLogger("pdqueue.worker")

HOLD_TTL_S = 60.0        # a hold not pulled is given back after this long (its Redis keys expire with it)
HOLD_SHARE = 0.25        # at most this share of the pool's blocks is held
KEEP_FREE_SHARE = 0.25   # holds are revoked, oldest first, while fewer blocks than this share are free
MIN_HOLD_BLOCKS = 2      # a finished request with fewer full named blocks is not held


def wanted(config) -> bool:
    """Whether a worker of this WorkerConfig keeps holds."""
    return config.kv_pull != "never" and config.engine.prefix_caching


class HoldAdvert:
    """A unit op: the hold's ticket and, for each of its blocks' hashes, the hold's id, with a TTL."""

    __slots__ = ("keys", "hold_id", "packed", "hashes", "ttl_s")

    def __init__(self, keys, hold_id: str, packed: bytes, hashes: list[bytes], ttl_s: float):
        self.keys, self.hold_id, self.packed, self.hashes, self.ttl_s = keys, hold_id, packed, hashes, ttl_s

    def __call__(self, pipe) -> None:
        ttl = max(1, int(self.ttl_s))
        pipe.set(self.keys.kv_ticket(self.hold_id), self.packed, ex=ttl)
        for h in self.hashes:
            pipe.set(self.keys.kv_hold(h.hex()), self.hold_id, ex=ttl)

    def __repr__(self) -> str:
        return f"HoldAdvert({self.hold_id}, {len(self.hashes)} blocks)"


class KVHolds:
    """One role's holds (see the module docstring). ``enabled`` False (``--kv-pull never``,
    no prefix caching, or the sender could not start): every method does nothing."""

    def __init__(self, shell: RoleHost, engine):
        self.shell, self.engine = shell, engine
        bm = engine.block_manager
        self.enabled = wanted(shell.config) and bm.enable_caching
        self.sender = None
        self._holds: OrderedDict[str, tuple[int, ...]] = OrderedDict()   # hold id -> its blocks, oldest first
        self.held_blocks = 0
        self.made = self.pulled = self.revoked = 0
        self._seq = 0

    def _sender(self):
        if self.sender is None and self.enabled:
            shell = self.shell
            try:
                self.sender = make_sender(shell, self.engine.kv_cache, self.engine.layout,
                                          transfer=shell.config.transfer)
            except Exception as exc:   # (a fixed --data-port another sender of this process has)
                log.warning("KV holds are off: their sender did not start (%s)", exc)
                self.enabled = False
                return None
            if shell.segment is not None:
                # A block handed out for new content gets a new epoch first: an shm copy of a
                # hold given back and reused meanwhile cannot validate.
                self.engine.block_manager.on_rewrite = shell.segment.bump_epochs
        return self.sender

    def hold(self, unit, seq) -> None:
        """Keep ``seq``'s (finished: its blocks just went back to the cache) full named
        blocks exported, and advertise them in ``unit``."""
        if not self.enabled or seq.max_hashed_blocks is not None:
            return
        bm = self.engine.block_manager
        full = (seq.num_tokens - 1) // bm.block_size   # its last token's KV was never computed
        hashes = list(seq.block_hashes[:full])
        if len(hashes) < MIN_HOLD_BLOCKS or len(hashes) > HOLD_SHARE * bm.num_blocks:
            return
        sender = self._sender()
        if sender is None:
            return
        blocks = bm.hold_cached(hashes)
        if len(blocks) < MIN_HOLD_BLOCKS:
            bm.free_blocks(blocks)
            return
        self._seq += 1
        hold_id = f"{self.shell.worker_id}:{self._seq}"
        try:
            ticket = sender.export(hold_id, blocks, len(blocks) * bm.block_size, lease_s=HOLD_TTL_S,
                                   block_hashes=hashes[:len(blocks)], hash_root=bm.root)
        except Exception as exc:
            bm.free_blocks(blocks)
            log.warning("KV hold of %s not exported (%s)", seq.request_id, exc)
            return
        self._holds[hold_id] = tuple(blocks)
        self.held_blocks += len(blocks)
        self.made += 1
        unit.ops.append(HoldAdvert(self.shell.keys, hold_id, ticket.pack(), hashes[:len(blocks)], HOLD_TTL_S))
        while self.held_blocks > HOLD_SHARE * bm.num_blocks and self._revoke_oldest():
            pass

    def relieve(self, need_blocks: int = 0) -> None:
        """Before a step: give back what peers pulled or what expired, then revoke the
        oldest holds while fewer than ``KEEP_FREE_SHARE`` of the pool plus ``need_blocks``
        plus what waits in the engine are free."""
        if self.sender is None:
            return
        self.free_released()
        bm = self.engine.block_manager
        waiting = sum(bm.blocks_for(s.num_tokens) for s in self.engine.scheduler.waiting)
        want = KEEP_FREE_SHARE * bm.num_blocks + need_blocks + waiting
        while self._holds and bm.num_free_blocks < want:
            if not self._revoke_oldest():
                break

    def _revoke_oldest(self) -> bool:
        hold_id = next(iter(self._holds), None)
        if hold_id is None:
            return False
        self.sender.revoke(hold_id)
        self.revoked += 1
        before = len(self._holds)
        self.free_released()
        if len(self._holds) == before:   # a TCP send still reads its blocks: back at a later poll
            self._holds.move_to_end(hold_id)
            return False
        return True

    def free_released(self) -> None:
        """Blocks of pulled, expired or revoked holds go back to the engine (cached)."""
        if self.sender is None:
            return
        for hold_id, block_ids in self.sender.poll_freeable():
            self.engine.free_blocks(list(block_ids))
            self.held_blocks -= len(self._holds.pop(hold_id, ()))
            if self.sender.leases.last_state(hold_id) is LeaseState.RELEASED:
                self.pulled += 1

    def reclaimable(self) -> int:
        """Held blocks that revoking every hold would free (held by no sequence): what the
        heartbeat adds to ``kv_free``."""
        held = Counter(b for blocks in self._holds.values() for b in blocks)   # a block may be in several holds
        ref = self.engine.block_manager.ref_count
        return sum(1 for b, n in held.items() if ref(b) == n)

    def load(self) -> dict:
        """The heartbeat's fields (none while off)."""
        if not self.enabled:
            return {}
        return {"kv_held": self.held_blocks, "kv_holds": len(self._holds), "kv_holds_made": self.made,
                "kv_holds_pulled": self.pulled, "kv_holds_revoked": self.revoked}

    def close(self) -> None:
        """Every hold given back (its blocks freed in the engine), the sender stopped."""
        if self.sender is None:
            return
        for hold_id in list(self._holds):
            self.sender.revoke(hold_id)
        self.free_released()
        close_sender(self.sender)
        self.free_released()
        self.sender = None
