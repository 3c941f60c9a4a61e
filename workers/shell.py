"""One worker process: a ``WorkerShell`` running a ``Role`` (workers/role.py).

The shell is what lives as long as the process, all made in ``__init__`` before any role
runs: the configuration and the loaded model, the worker id and incarnation, the Redis
client (``pdqueue.queue.connection.connect``), the stop flag (a first SIGTERM/SIGINT asks
for a warm stop, a second for a cold one), the publisher (its thread runs from here on),
the heartbeat, ``Recovery`` and the sweep of dead owners' KV segments (a first one here,
before any role's KV pool takes room). ``run()``:

    start  role.start(shell) (its engine, its KV pool); the consumer groups exist; the
           first heartbeat (retried while Redis is down); what an earlier process under
           this worker id took and never acknowledged (Recovery.own_pending) ->
           role.accept(resumed=True)
    loop   sweep KV segments (every min(heartbeat TTL, lease) / 3) -> keep the entries in
           hand (Recovery.keep; those another worker took over -> role.drop) ->
           role.step() -> heartbeat load, until step() says there is nothing left to do or
           a cold stop. A Redis error: capped backoff with jitter and
           Recovery.on_redis_error(); any other error is logged and counted, and twenty
           in a row end the worker
    end    role.drain() (a prefill role serves its leases out); then, always: the
           publisher flushed and closed, role.close(), the heartbeat removed

Roles answer through ``shell.unit()`` (workers/answers.py), take input through
``shell.take(limit, block_ms)`` (what Recovery finds first, else one read), and ask
``shell.accepting`` whether to take any.

``switch_role(role)`` replaces the role in place, the model staying loaded: the current
role stops accepting and finishes what it holds (as on a warm stop), drains and closes;
then ``role`` starts as above (start, groups, registration, its group's pending entries).
Roles build their own engine and KV pool in ``start`` for now.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager

import redis

from pdqueue.keys import DECODE_GROUP, PREFILL_GROUP, Keys
from pdqueue.protocol import FinishReason, Request
from pdqueue.queue import streams
from pdqueue.queue.connection import connect
from pdqueue.queue.publisher import Publisher
from pdqueue.queue.registry import Heartbeat
from pdqueue.retry import Backoff
from pdqueue.transfer.node import node_id
from pdqueue.transfer.shm import cleanup_segments
from workers.answers import Unit, request_ids
from workers.common import Every, StopFlag, WorkerConfig, new_incarnation, new_worker_id, now_ms
from workers.recovery import REDIS_DOWN, Recovery
from workers.role import Role

log = logging.getLogger("pdqueue.worker")

MAX_CONSECUTIVE_FAILURES = 20


class WorkerShell:
    def __init__(self, config: WorkerConfig, loaded, role: Role):
        self.config = config
        self.loaded = loaded
        self.role = role
        self.worker_id = config.worker_id or new_worker_id(role.name)
        self.incarnation = new_incarnation()
        self.keys = Keys(config.cluster)
        self.node = node_id()
        self.r = connect(config.redis_url)
        self.stop = StopFlag()
        self.backoff = Backoff(jitter=True)  # jitter: workers cut off together come back spread out
        self.failed_units = 0                # units the publisher dropped (see _unit_failed)
        self.publisher = Publisher(lambda: connect(config.redis_url), name=f"pdq-publisher-{self.worker_id}",
                                   on_error=self._unit_failed)
        self.recovery = Recovery(self.r, self.keys, self.worker_id, config.reclaim_idle_ms, self.publisher)
        self.heartbeat = Heartbeat(self.r, self.keys, self.worker_id, role=role.name, incarnation=self.incarnation,
                                   model=config.engine.model, ttl_s=config.heartbeat_ttl_s)
        self._sweep = Every(min(config.heartbeat_ttl_s, config.lease_s) / 3)
        self._next_role: Role | None = None
        self._role_open = False              # role.start succeeded and role.close is due
        # Before any role's pool takes room: the segments of crashed predecessors (the
        # loop's sweep gets those still kept for their leases).
        self.sweep_segments(force=True)

    # ---- the process -------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._start_role(self.role)
            self._register()
            while True:
                self._resume()
                log.info("%s worker %s ready", self.role.name, self.worker_id)
                self.loop()
                self.role.drain()
                if self._next_role is None or self.stop.warm.is_set() or self.stop.cold.is_set():
                    return
                self._switch()
        finally:
            self.close()

    def loop(self) -> None:
        """Run the role's steps until it has nothing left to do or a cold stop. Redis
        outages are retried with capped backoff; an unexpected error is logged and the loop
        goes on (the entries in hand stay pending, to be retried or reclaimed), unless it
        keeps failing, when the worker exits with the error rather than spin."""
        failures = 0
        while not self.stop.cold.is_set():
            try:
                self.sweep_segments()
                lost = self.recovery.keep(self.role)
                if lost:
                    self.role.drop(lost)
                if not self.role.step():
                    return
                self.heartbeat.update(**self.load())
                failures = 0
            except REDIS_DOWN as exc:
                self._redis_down(exc)
            except Exception:
                failures += 1
                log.exception("worker iteration failed (%d in a row)", failures)
                if failures >= MAX_CONSECUTIVE_FAILURES:
                    raise
                self.backoff.sleep(self.stop.cold)

    def close(self) -> None:
        self.publisher.close(timeout=10)
        if self._role_open:
            self.role.close()
        self.heartbeat.stop()
        log.info("%s worker %s stopped", self.role.name, self.worker_id)

    def load(self) -> dict:
        return {**self.role.load(), "failed_units": self.failed_units}

    # ---- roles -------------------------------------------------------------------------
    @property
    def accepting(self) -> bool:
        """Whether the role takes new input: not after a warm stop, nor before a switch."""
        return not self.stop.warm.is_set() and self._next_role is None

    def switch_role(self, role: Role) -> None:
        """Replace the running role by ``role`` once it has finished what it holds (it takes
        nothing new meanwhile, as on a warm stop, then drains and closes). From any thread.
        Should ``role`` fail to start, the worker stops with that error."""
        self._next_role = role

    def _switch(self) -> None:
        new, self._next_role = self._next_role, None
        log.info("worker %s: %s -> %s", self.worker_id, self.role.name, new.name)
        self.role.close()
        self._role_open = False
        self._start_role(new)

    def _start_role(self, role: Role) -> None:
        role.start(self)   # a role whose start fails releases what it built before raising
        self.role, self._role_open = role, True
        self.ensure_groups()
        self.heartbeat.update(**{"role": role.name, "node": "", "endpoints": {}, **role.registration()},
                              load=self.load())

    def _resume(self) -> None:
        """Entries of the role's group delivered to this worker id and never acknowledged:
        a restart under the same id picks up what the previous process had taken."""
        self.role.accept(self.recovery.own_pending(self.role.group, self.role.streams()), resumed=True)

    def _register(self) -> None:
        """The first heartbeat, so the worker is visible; retried while Redis is down."""
        while True:
            try:
                self.heartbeat.start()
                return
            except REDIS_DOWN as exc:
                if self.stop.cold.is_set():
                    raise
                log.warning("redis unavailable at start (%s); retrying", exc)
                self.backoff.sleep(self.stop.cold)

    # ---- what roles use ------------------------------------------------------------------
    @contextmanager
    def unit(self):
        """A ``Unit`` of answers, submitted to the publisher when the block ends (not when
        it raises: then the entries stay pending and are taken in again)."""
        unit = Unit(self.keys, self.worker_id, self.role.group)
        yield unit
        if unit:
            self.publisher.submit(unit.ops)

    def take(self, limit: int, block_ms: int) -> None:
        """Input for the role: what Recovery finds (resumed), else up to ``limit`` new
        entries (one read, blocking ``block_ms`` when nothing is there)."""
        entries = self.recovery.recover(self.role, limit)
        if entries:
            self.role.accept(entries, resumed=True)
        else:
            self.role.accept(self.read(limit, block_ms), resumed=False)

    def read(self, limit: int, block_ms: int) -> list:
        """XREADGROUP of the role's streams, highest priority first; [] while Redis is down."""
        try:
            entries = streams.read_group(self.r, self.role.group, self.worker_id, self.role.streams(),
                                         count=limit, block_ms=block_ms or None)
            self.backoff.reset()
            return entries
        except REDIS_DOWN as exc:
            self._redis_down(exc)
            return []
        except redis.ResponseError as exc:
            if "NOGROUP" in str(exc):  # Redis restarted without persistence
                self.ensure_groups()
                return []
            raise

    def cancelled(self, request_ids_: list[str]) -> set[str]:
        """Which of ``request_ids_`` a producer cancelled (``cancel:<id>`` set): one round trip."""
        if not request_ids_:
            return set()
        try:
            with self.r.pipeline(transaction=False) as pipe:
                for rid in request_ids_:
                    pipe.exists(self.keys.cancel(rid))
                flags = pipe.execute()
        except REDIS_DOWN:
            return set()
        return {rid for rid, flag in zip(request_ids_, flags) if flag}

    def to_stop(self, requests: dict[str, Request]) -> dict[str, FinishReason]:
        """Which of ``requests`` (by id) must stop now: cancelled, else past their deadline."""
        stopped = {rid: FinishReason.CANCELLED for rid in self.cancelled(list(requests))}
        t = now_ms()
        stopped.update({rid: FinishReason.EXPIRED for rid, req in requests.items()
                        if rid not in stopped and req.expired(t)})
        return stopped

    # ---- Redis ---------------------------------------------------------------------------
    def ensure_groups(self) -> None:
        """Every group exists (created at "0": entries added before any worker are served)."""
        role = self.role
        groups = [(s, PREFILL_GROUP) for s in self.keys.request_streams] + [(self.keys.handoff, DECODE_GROUP)]
        groups += [(s, role.group) for s in role.streams() if (s, role.group) not in groups]
        for stream, group in groups:
            streams.ensure_group(self.r, stream, group)

    def _redis_down(self, exc: BaseException) -> None:
        log.warning("redis unavailable (%s); retrying", exc)
        self.recovery.on_redis_error()
        self.backoff.sleep(self.stop.cold)

    def _unit_failed(self, exc: BaseException, ops: list) -> None:
        """Publisher thread: a unit was dropped or a command in it failed. Its entries may
        be pending for us with nobody holding them: Recovery takes them in again."""
        self.failed_units += 1
        log.error("a unit of answers failed (%s); entries of %s are taken in again if still pending",
                  exc, request_ids(ops) or "tokens only")
        self.recovery.on_unit_failed()

    # ---- KV segments of dead prefill workers on this node --------------------------------
    def sweep_segments(self, force: bool = False) -> list[str]:
        """Every third of min(heartbeat TTL, lease), whatever the role: unlink this node's KV
        segments whose owner died (``cleanup_segments``), so a crashed prefill worker's pool
        goes whether it is restarted at once, later or never. Returns the names removed."""
        if not self._sweep.due(force):
            return []
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


def make_worker(role_name: str, config: WorkerConfig, loaded) -> WorkerShell:
    """The worker process for ``pdqueue worker ROLE``."""
    if role_name == "prefill":
        from workers.prefill import PrefillRole as role_class
    elif role_name == "decode":
        from workers.decode import DecodeRole as role_class
    elif role_name == "colocated":
        from workers.colocated import ColocatedRole as role_class
    else:
        raise ValueError(f"unknown role {role_name!r}")
    return WorkerShell(config, loaded, role_class())
