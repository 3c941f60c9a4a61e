"""The process's KV pool, which every role of a worker uses in turn, its KV tiers
(pdqueue/engine/kv_tiers.py: --kv-host-tier-mb, --kv-disk-dir, --kv-disk-gb), and the sweep
of this node's KV segments whose owner died."""

from __future__ import annotations

import logging

from pdqueue.engine.kv_tiers import KVTiers, attach
from pdqueue.protocol import Role
from pdqueue.transfer.shm import DEFAULT_PREFIX, SharedKVPool, cleanup_segments
from workers.common import Every

log = logging.getLogger("pdqueue.worker")


class ProcessKV:
    """The KV pool tensor, made once, when the first role asks (``pool``), so a switch
    allocates nothing. On CPU it lives in a named shared memory segment (``segment``) when
    the role needs one (prefill: decode workers on this node copy out of it) or the worker is
    switchable (any role may become prefill); a plain pool is replaced by a segment only when
    a prefill role comes to a worker that had none (a switch in a process started without
    ``--switchable``). On an accelerator it is an ordinary device tensor.

    The segment's block epochs stay right across roles: a prefill role bumps a block's epoch
    before its engine writes new content into it (the engine's ``on_rewrite``), its drain
    serves its leases until they are released or expired, and after it closed (its senders
    stopped) every block's epoch is bumped (``retire_tickets``), so no copy validated against
    its tickets can see what a later role writes.

    The tiers (``tiers``, one per process like the pool) go under each role's engine in turn
    (``attach``): a named block evicted from that engine's pool is kept there, and the next
    turn of a conversation finds it. When a role gives way to another, its engine's named
    blocks are copied into the tiers first (the next engine starts with an empty index over
    the same pool); at the worker's stop (``close``) they and the host tier's entries are
    written to the disk tier, which a worker restarted on the same ``--kv-disk-dir`` reads.
    A decode role's engine writes each finished request's answer blocks there at once, for
    the next turn's prefill worker sharing the directory."""

    def __init__(self, layout, device: str, switchable: bool, worker_id: str, incarnation: str,
                 tiers: KVTiers | None = None):
        self.layout = layout
        self.device = device
        self.switchable = switchable
        self.worker_id = worker_id
        self.incarnation = incarnation
        self.segment: SharedKVPool | None = None
        self._tensor = None
        self.tiers = tiers if tiers is not None and tiers.enabled else None
        self._engine = None   # the engine the tiers are under

    def attach(self, role) -> None:
        """Put the tiers under ``role``'s engine (if it has one, with prefix caching on)."""
        engine = getattr(role, "engine", None)
        if self.tiers is None or engine is None or engine is self._engine:
            return
        self._keep()
        attach(self.tiers, engine)
        self.tiers.write_finished = getattr(role, "name", "") == Role.DECODE.value   # for the next turn's prefill
        self._engine = engine if engine.block_manager.tier is self.tiers else None

    def _keep(self) -> None:
        """The attached engine's named blocks into the tiers (its pool is about to be reused)."""
        if self._engine is not None:
            try:
                for h, block_id in self._engine.block_manager.named_blocks():
                    self.tiers.spill(h, block_id)
            except Exception as exc:   # a tier's failure is a miss, never a failed switch
                log.warning("KV tiers: keeping the pool's blocks failed (%s)", exc)

    def pool(self, shared: bool = False):
        if (shared or self.switchable) and self.device == "cpu" and self.segment is None:
            self.segment = SharedKVPool.create(self.layout, DEFAULT_PREFIX, self.worker_id, self.incarnation)
            self._tensor = self.segment.tensor
        elif self._tensor is None:
            self._tensor = self.layout.allocate(device=self.device)
        return self._tensor

    def stats(self) -> dict:
        """The tiers' counters for the heartbeat's load (none without tiers)."""
        return self.tiers.stats() if self.tiers is not None else {}

    def retire_tickets(self) -> None:
        """The old role's tickets (leases still held when its drain ran out of time) can no
        longer validate a copy: the next role may write any block."""
        if self.segment is not None:
            self.segment.bump_epochs(range(self.layout.num_blocks))

    def close(self) -> None:
        if self._engine is not None and self.tiers.disk is not None:
            try:
                n = self.tiers.flush(self._engine.block_manager.named_blocks())
                log.info("KV disk tier: %d blocks written to %s", n, self.tiers.disk.dir)
            except Exception as exc:
                log.warning("KV disk tier: writing the pool's blocks failed (%s)", exc)
        self._engine = None
        if self.segment is not None:
            self.segment.close(unlink=True)


class SegmentSweep:
    """``sweep()`` every ``every_s`` (or at once with ``force``): unlink this node's KV
    segments whose owner died (``cleanup_segments``), so a crashed prefill worker's pool goes
    whether it is restarted at once, later or never. Returns the names removed."""

    def __init__(self, r, keys, every_s: float):
        self.r = r
        self.keys = keys
        self._every = Every(every_s)

    def __call__(self, force: bool = False) -> list[str]:
        if not self._every.due(force):
            return []
        try:
            return cleanup_segments(self._owner_alive)
        except OSError as exc:
            log.warning("KV segment sweep failed (%s)", exc)
            return []

    def _owner_alive(self, worker_id: str, incarnation: str) -> bool:
        """For segments of earlier pdqueue versions only (no owner lock): is the owner
        registered in this cluster with that incarnation."""
        try:
            info = self.r.hgetall(self.keys.worker(worker_id))
        except Exception:
            return True  # cannot tell: keep it
        inc = info.get(b"incarnation") if info else None
        return inc is not None and inc.decode() == incarnation


def tiers_for(config) -> KVTiers | None:
    """The KV tiers a WorkerConfig asks for (None: none)."""
    host = config.kv_host_tier_mb * 2**20
    disk = int(config.kv_disk_gb * 2**30) if config.kv_disk_dir else 0
    return (KVTiers(host_bytes=host, disk_dir=config.kv_disk_dir, disk_bytes=disk, kv_format=config.kv_tier_format)
            if host or disk else None)
