"""One worker process: a ``WorkerShell`` running a ``Role`` (workers/role.py).

The shell is what lives as long as the process, all made in ``__init__`` before any role
runs: the configuration and the loaded model, the worker id and incarnation, the Redis
client (``pdqueue.queue.connection.connect``), the stop flag (a first SIGTERM/SIGINT asks
for a warm stop, a second for a cold one), the publisher (its thread runs from here on),
the heartbeat, the metrics (``pdqueue.telemetry.metrics.WorkerMetrics``; served over HTTP when
``config.metrics_port`` is set, and advertised as ``metrics`` in the heartbeat),
``Recovery``, the sweep of dead owners' KV segments (a first one here, before the KV pool
takes room), the role epoch; and the KV pool, made when the first role
asks for it (``kv_pool``) and used by every role after it. ``run()``:

    start  role.start(shell) (its engine, on the shell's KV pool); the consumer groups
           exist; the first heartbeat (retried while Redis is down; a stop meanwhile,
           warm or cold, ends the worker: it holds nothing yet); what an earlier
           process under this worker id took and never acknowledged
           (Recovery.own_pending) -> role.accept(resumed=True); the keeper thread
           (Recovery.start_keeper) touches the entries in hand from here on, while the
           loop makes progress (an iteration younger than ``--max-step-s``)
    loop   sweep KV segments (every min(heartbeat TTL, lease) / 3) -> the entries in hand
           another worker took over (Recovery.keep) -> role.drop ->
           role.step() -> ``tick``: switch commands (every 100 ms) and the heartbeat's
           load, until step() says there is nothing left to do or a cold stop. A Redis
           error: capped backoff with jitter and Recovery.on_redis_error(), until Redis has
           been unreachable for ``--redis-gone-exit-s`` (default 300 s; 0: never): then
           ``RedisGone`` ends the worker (exit status 75) through the teardown below, its
           entries left pending in Redis; any other error is logged and counted, and
           twenty in a row end the worker
    end    role.drain() (a prefill role serves its leases out); then, after a switch,
           the old role closes and the new one starts (back to ``start``); else, always:
           the publisher flushed and closed, role.close(), the KV pool freed (its segment
           unlinked), the heartbeat removed

Roles answer through ``shell.unit()`` (workers/answers.py), take input through
``shell.take(limit, block_ms)`` (what Recovery finds first, else one read), and ask
``shell.accepting`` whether to take any.

``switch_role(role)`` replaces the role in place, the model and the KV pool staying: the
current role stops accepting and finishes what it holds (as on a warm stop), drains and
closes; then ``role`` starts as above (start, groups, registration, its group's pending
entries). A worker started with ``--switchable`` does this on a switch command
(pdqueue/control/commands.py): ``control`` reads ``control:<id>``, refuses or accepts each command
(the rules: workers/switching.py) and answers with events (``accepted``, then ``done`` or
``failed``; or ``refused``). The heartbeat carries ``role_epoch`` (the process start time
in ms, +1 per switch), ``switchable``, ``role_since_ms`` and ``switching_to`` (empty unless
a switch is under way) as top-level fields of ``worker:<id>``; decode and colocated roles
add ``step_ms`` to the load. Should the new role fail to start, the worker answers
``failed`` and starts its old role again (same epoch), and stops only if that fails too.
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager

import redis

from pdqueue.control import commands
from pdqueue.engine.llm_engine import kv_layout_for
from pdqueue.keys import DECODE_GROUP, PREFILL_GROUP, Keys
from pdqueue.telemetry.metrics import WorkerMetrics, advertised, serve_metrics, stop_metrics
from pdqueue.protocol import FinishReason, Request
from pdqueue.queue import streams
from pdqueue.queue.connection import connect
from pdqueue.queue.publisher import Publisher
from pdqueue.queue.registry import Heartbeat
from pdqueue.retry import Backoff
from pdqueue.transfer.node import node_id
from pdqueue.transfer.shm import DEFAULT_PREFIX, SharedKVPool, cleanup_segments
from workers.answers import Unit, request_ids
from workers.common import Every, StopFlag, WorkerConfig, new_incarnation, new_worker_id, now_ms
from workers.recovery import REDIS_DOWN, Recovery
from workers.role import Role
from workers.switching import CONTROL_EVERY_S, FIXED_ROLE, Switching, backlog_refusal

log = logging.getLogger("pdqueue.worker")

MAX_CONSECUTIVE_FAILURES = 20
EXIT_REDIS_GONE = 75   # the exit status after --redis-gone-exit-s (EX_TEMPFAIL: a supervisor may start it again)
PUBLISHER_FLUSH_S = 10.0       # what close() waits for unpublished answers
PUBLISHER_FLUSH_GONE_S = 1.0   # ... when Redis is known to be gone


class RedisGone(Exception):
    """Redis stayed unreachable for ``--redis-gone-exit-s``: the worker stops (exit status
    ``EXIT_REDIS_GONE``), freeing its KV pool; what it held stays pending in Redis, for
    whichever worker serves that Redis next."""


class StoppedWaiting(Exception):
    """A stop (warm or cold) came while the worker waited for Redis before serving: it
    holds nothing yet, so it just ends."""


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
        self._outage: tuple[float, int] | None = None   # (monotonic start, heartbeats then) of a Redis outage
        self.redis_gone = False              # RedisGone was raised: close() does not wait on Redis
        self.publisher = Publisher(lambda: connect(config.redis_url), name=f"pdq-publisher-{self.worker_id}",
                                   on_error=self._unit_failed)
        self.metrics = WorkerMetrics(config.engine.model)   # recorded always; served with a metrics_port
        self.recovery = Recovery(self.r, self.keys, self.worker_id, config.reclaim_idle_ms, self.publisher,
                                 metrics=self.metrics, max_step_s=config.max_step_s)
        # The role epoch starts at the process's start time (ms) and grows by one per switch,
        # so a command aimed at an earlier process under this worker id is stale too.
        self.role_epoch = self.role_since_ms = int(now_ms())
        self.switching: Switching | None = None   # an accepted switch command, until done or failed
        self.heartbeat = Heartbeat(self.r, self.keys, self.worker_id, role=role.name, incarnation=self.incarnation,
                                   model=config.engine.model, ttl_s=config.heartbeat_ttl_s)
        self.heartbeat.update(role_epoch=self.role_epoch, switchable=int(config.switchable),
                              role_since_ms=self.role_since_ms, switching_to="",
                              weights=getattr(loaded, "weights", "fp32"),
                              max_model_len=min(config.engine.max_model_len or loaded.config.max_position_embeddings,
                                                loaded.config.max_position_embeddings))
        self.metrics_port: int | None = None
        if config.metrics_port is not None:   # before the first beat, which advertises it
            self.metrics_port = serve_metrics(self.metrics.registry, config.metrics_host, config.metrics_port)
            shown = advertised(config.metrics_host, self.metrics_port, config.metrics_advertise)
            self.heartbeat.update(metrics=shown)
            log.info("metrics: http://%s/metrics", shown)
        self._sweep = Every(min(config.heartbeat_ttl_s, config.lease_s) / 3)
        self._control = Every(CONTROL_EVERY_S)
        self._next_role: Role | None = None
        self._role_open = False              # role.start succeeded and role.close is due
        # The KV pool: one per process, made when the first role asks (``kv_pool``).
        self.kv_layout = kv_layout_for(loaded.config, config.engine)
        self.segment: SharedKVPool | None = None
        self._kv_cache = None
        # Before any role's pool takes room: the segments of crashed predecessors (the
        # loop's sweep gets those still kept for their leases).
        self.sweep_segments(force=True)

    # ---- the process -------------------------------------------------------------------
    def run(self) -> None:
        """Serve until stopped (see the module docstring). Raises ``RedisGone`` after
        ``--redis-gone-exit-s`` of unreachable Redis, once everything is closed."""
        try:
            self._start_role(self.role)
            self._register()
            # Entries in hand are touched from its thread while the loop makes progress, so a
            # step longer than reclaim_idle_ms does not look hung (workers/recovery.py).
            self.recovery.start_keeper(lambda: self.role)
            while True:
                self._resume()
                log.info("%s worker %s ready", self.role.name, self.worker_id)
                self._switched()
                self.loop()
                self.role.drain()
                if self._next_role is None or self.stop.warm.is_set() or self.stop.cold.is_set():
                    return
                self._switch()
        except StoppedWaiting as exc:   # (a role starting: at start, or after a switch)
            log.warning("%s worker %s: %s", self.role.name, self.worker_id, exc)
        finally:
            self.close()

    def loop(self) -> None:
        """Run the role's steps until it has nothing left to do or a cold stop. Redis
        outages are retried with capped backoff; an unexpected error is logged and the loop
        goes on (the entries in hand stay pending, to be retried or reclaimed), unless it
        keeps failing, when the worker exits with the error rather than spin."""
        failures = 0
        while not self.stop.cold.is_set():
            self.recovery.progress()   # the keeper's watchdog: this iteration began now
            try:
                self.sweep_segments()
                lost = self.recovery.keep(self.role)
                if lost:
                    self.role.drop(lost)
                if not self.role.step():
                    return
                self.tick()
                failures = 0
            except REDIS_DOWN as exc:
                self._redis_down(exc)
            except RedisGone:
                raise
            except Exception:
                failures += 1
                log.exception("worker iteration failed (%d in a row)", failures)
                if failures >= MAX_CONSECUTIVE_FAILURES:
                    raise
                self.backoff.sleep(self.stop.cold)

    def tick(self) -> None:
        """After each step (and while a role drains): the switch commands waiting for us
        (every ``CONTROL_EVERY_S``) and the heartbeat's load."""
        self.recovery.progress()
        self.control()
        load = self.load()
        self.heartbeat.update(load=load)
        self.metrics.set_load(load)

    def close(self) -> None:
        if self.switching is not None:   # a stop came before the new role served
            self._switch_event("failed", self.switching, reason="the worker stopped before the switch completed")
            self.switching = None
        self.recovery.stop_keeper()
        self.publisher.close(timeout=PUBLISHER_FLUSH_GONE_S if self.redis_gone else PUBLISHER_FLUSH_S)
        if self._role_open:
            self.role.close()
        if self.segment is not None:
            self.segment.close(unlink=True)
        self.heartbeat.stop()
        if self.metrics_port is not None:
            stop_metrics(self.metrics_port)
        log.info("%s worker %s stopped", self.role.name, self.worker_id)

    def load(self) -> dict:
        return {**self.role.load(), "failed_units": self.failed_units}

    # ---- the KV pool -------------------------------------------------------------------
    def kv_pool(self, shared: bool = False):
        """The process's KV pool tensor, which every role's engine uses: made once, when the
        first role asks, so a switch allocates nothing. On CPU it lives in a named shared
        memory segment (``self.segment``) when the role needs one (prefill: decode workers
        on this node copy out of it) or the worker is switchable (any role may become
        prefill); a plain pool is replaced by a segment only when a prefill role comes to
        a worker that had none (``switch_role`` in a process started without
        ``--switchable``). On an accelerator it is an ordinary device tensor.

        The segment's block epochs stay right across roles: a prefill role bumps a block's
        epoch before its engine writes new content into it (the engine's ``on_rewrite``), its drain
        serves its leases until they are released or expired, and after it closed (its
        senders stopped) every block's epoch is bumped (``_switch``), so no copy validated
        against its tickets can see what a later role writes."""
        config = self.config
        if (shared or config.switchable) and config.engine.device == "cpu" and self.segment is None:
            self.segment = SharedKVPool.create(self.kv_layout, DEFAULT_PREFIX, self.worker_id, self.incarnation)
            self._kv_cache = self.segment.tensor
        elif self._kv_cache is None:
            self._kv_cache = self.kv_layout.allocate(device=config.engine.device)
        return self._kv_cache

    # ---- roles -------------------------------------------------------------------------
    @property
    def accepting(self) -> bool:
        """Whether the role takes new input: not after a warm stop, nor before a switch."""
        return not self.stop.warm.is_set() and self._next_role is None

    def switch_role(self, role: Role) -> None:
        """Replace the running role by ``role`` once it has finished what it holds (it takes
        nothing new meanwhile, as on a warm stop, then drains and closes). From any thread.
        Should ``role`` fail to start, the worker goes back to a new role of its old kind
        (and stops with the error if that fails too)."""
        self._next_role = role

    def _switch(self) -> None:
        new, self._next_role = self._next_role, None
        old_name = self.role.name
        if self.switching is not None:
            self.switching.drained_at = time.monotonic()
        log.info("worker %s: %s -> %s", self.worker_id, old_name, new.name)
        self.role.close()
        self._role_open = False
        if self.segment is not None:
            # Tickets of the old role (a prefill role's leases still held when its drain
            # ran out of time) can no longer validate a copy: the next role may write any block.
            self.segment.bump_epochs(range(self.kv_layout.num_blocks))
        try:
            self._start_role(new, epoch=self.role_epoch + 1)
        except Exception as exc:
            log.exception("worker %s: the %s role failed to start; going back to %s", self.worker_id,
                          new.name, old_name)
            if self._role_open:   # it started, and what came after failed
                self.role.close()
                self._role_open = False
            if self.switching is not None:
                self._switch_event("failed", self.switching, reason=f"{new.name} failed to start: {exc}",
                                   back_to=old_name)
                self.switching = None
            self._start_role(role_for(old_name))   # the epoch stays: nothing changed for a sender

    def _start_role(self, role: Role, epoch: int | None = None) -> None:
        self.metrics.activate(role.name)   # what the role observes carries its name
        role.start(self)   # a role whose start fails releases what it built before raising
        self.role, self._role_open = role, True
        while True:
            try:
                self.ensure_groups()
                break
            except REDIS_DOWN as exc:
                self._stopped_waiting(exc)
                self._redis_down(exc)
        if epoch is not None:
            self.role_epoch, self.role_since_ms = epoch, int(now_ms())
        self.heartbeat.update(**{"role": role.name, "node": "", "endpoints": {}, **role.registration()},
                              role_epoch=self.role_epoch, role_since_ms=self.role_since_ms, switching_to="",
                              load=self.load())
        self._beat_now()

    def _switched(self) -> None:
        """The new role serves (started, its own pending entries taken in): ``done``."""
        sw, self.switching = self.switching, None
        if sw is not None:
            drain_ms = sw.ms_since_read(sw.drained_at) if sw.drained_at is not None else 0.0
            self._switch_event("done", sw, epoch=self.role_epoch, drain_ms=drain_ms, switch_ms=sw.ms_since_read())
            log.info("worker %s: now %s (epoch %d): drained in %.0f ms, serving %.0f ms after the command",
                     self.worker_id, self.role.name, self.role_epoch, drain_ms, sw.ms_since_read())

    def _beat_now(self) -> None:
        """Write the heartbeat now (a role or switch state others must see at once); the
        heartbeat thread writes it again soon anyway, should Redis be down."""
        if self.heartbeat.beats:   # not before the first beat (``_register``)
            try:
                self.heartbeat.beat()
            except REDIS_DOWN as exc:
                log.warning("heartbeat: redis unavailable (%s)", exc)

    # ---- switch commands (pdqueue.control.commands; the rules: workers/switching.py) --------------
    def control(self) -> None:
        """Every ``CONTROL_EVERY_S``: answer the commands waiting on ``control:<id>``."""
        if not self._control.due():
            return
        for entry_id, fields in commands.take_commands(self.r, self.keys, self.worker_id):
            try:
                self._command(entry_id, fields)
            except REDIS_DOWN as exc:   # read and deleted, but not answered: the sender times out
                log.warning("switch command %s not answered: redis unavailable (%s)", entry_id, exc)

    def _command(self, entry_id: str, fields) -> None:
        read_at = time.monotonic()
        raw_id = fields.get(b"id", fields.get("id", b""))
        command_id = (raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id)) or entry_id
        try:
            cmd = commands.parse_command(fields)
        except commands.CommandError as exc:
            self._refuse(command_id, "", str(exc))
            return
        command_id = cmd.id or command_id
        reason = self._refusal(cmd)
        if reason:
            self._refuse(command_id, cmd.role, reason)
            return
        role = self.role
        sw = Switching(command_id, role.name, cmd.role, self.role_epoch, held=len(role.held()),
                       leases=int(role.load().get("leases", 0)), read_at=read_at)
        self.switching = sw
        self.heartbeat.update(switching_to=cmd.role)
        self._beat_now()
        self._switch_event("accepted", sw, by=cmd.by)
        log.info("worker %s: switch %s -> %s accepted (command %s by %s; %d in hand, %d leases)", self.worker_id,
                 role.name, cmd.role, command_id, cmd.by or "?", sw.held, sw.leases)
        self.switch_role(role_for(cmd.role))

    def _refusal(self, cmd: commands.SwitchCommand) -> str | None:
        """Why this worker will not carry ``cmd`` out, or None (workers/switching.py)."""
        if not self.config.switchable:
            return FIXED_ROLE
        if self.stop.warm.is_set() or self.stop.cold.is_set():
            return "the worker is stopping"
        if self.switching is not None or self._next_role is not None:
            to = self.switching.to_role if self.switching else self._next_role.name
            return f"a switch to {to} is in progress"
        if cmd.epoch != self.role_epoch:
            return f"stale epoch: expected {cmd.epoch}, worker is at {self.role_epoch}"
        if cmd.role == self.role.name:
            return f"already {cmd.role}"
        return backlog_refusal(self.r, self.keys, self.worker_id, self.node, self.role.name, cmd.role)

    def _refuse(self, command_id: str, to: str, reason: str) -> None:
        log.warning("worker %s: switch command %s refused: %s", self.worker_id, command_id, reason)
        commands.event(self.r, self.keys, commands.SWITCH, command=command_id, worker=self.worker_id,
                      status="refused", reason=reason, **{"from": self.role.name, "to": to}, epoch=self.role_epoch)

    def _switch_event(self, status: str, sw: Switching, **fields) -> None:
        fields.setdefault("epoch", sw.epoch)
        try:
            commands.event(self.r, self.keys, commands.SWITCH, command=sw.command, worker=self.worker_id,
                          status=status, **{"from": sw.from_role, "to": sw.to_role}, held=sw.held,
                          leases=sw.leases, **fields)
        except REDIS_DOWN as exc:
            log.warning("switch %s: the %s event was not written (%s)", sw.command, status, exc)

    def _resume(self) -> None:
        """Entries of the role's group delivered to this worker id and never acknowledged:
        a restart under the same id picks up what the previous process had taken."""
        try:
            entries = self.recovery.own_pending(self.role.group, self.role.streams())
        except REDIS_DOWN as exc:   # Recovery compares our pending list with what we hold later
            self._redis_down(exc)
            return
        self.role.accept(entries, resumed=True)

    def _register(self) -> None:
        """The first heartbeat, so the worker is visible; retried while Redis is down."""
        while True:
            try:
                self.heartbeat.start()
                return
            except REDIS_DOWN as exc:
                self._stopped_waiting(exc)
                self._redis_down(exc, "redis unavailable at start (%s); retrying")

    # ---- what roles use ------------------------------------------------------------------
    @contextmanager
    def unit(self):
        """A ``Unit`` of answers, submitted to the publisher when the block ends (not when
        it raises: then the entries stay pending and are taken in again)."""
        unit = Unit(self.keys, self.worker_id, self.role.group)
        yield unit
        if unit:
            self.publisher.submit(unit.ops)
            self.metrics.answered(unit.tally)

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
            entries = streams.read_group(self.r, self.role.group, self.worker_id, self.role.read_streams(),
                                         count=limit, block_ms=block_ms or None)
            self.backoff.reset()
            self._outage = None   # Redis answers
            return entries
        except REDIS_DOWN as exc:
            self._redis_down(exc)
            return []
        except redis.ResponseError as exc:
            if "NOGROUP" in str(exc) or "no longer exists" in str(exc):
                # Redis restarted without persistence, or a stream was deleted under a blocked read
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
        # The streams it reads (its own among them), not every stream it scans: another
        # worker's own stream, deleted once empty and owner-less, must not come back.
        groups += [(s, role.group) for s in role.read_streams() if (s, role.group) not in groups]
        for stream, group in groups:
            streams.ensure_group(self.r, stream, group)

    def _redis_down(self, exc: BaseException, message: str = "redis unavailable (%s); retrying") -> None:
        """A Redis call failed for want of Redis: retry after the backoff, unless Redis has
        now been unreachable for ``--redis-gone-exit-s`` (``RedisGone``)."""
        if not self._check_outage(exc):   # (the first failure of an outage has its own line)
            log.warning(message, exc)
        self.recovery.on_redis_error()
        self.backoff.sleep(self.stop.cold)

    def _check_outage(self, exc: BaseException) -> bool:
        """Time the outage ``exc`` belongs to. It began at the first failure since Redis last
        answered: a read (``read``) or a heartbeat (its thread beats every TTL/3, and tries
        again every <= 2 s while Redis is away, whatever the loop is doing). Past
        ``redis_gone_exit_s`` (0: never) raise ``RedisGone``. True when this failure began
        an outage (and said so)."""
        limit = self.config.redis_gone_exit_s
        now, beats = time.monotonic(), self.heartbeat.beats
        if self._outage is None or self._outage[1] != beats:
            self._outage = (now, beats)
            log.warning("redis unavailable (%s); retrying%s", exc,
                        f"; this worker stops if it stays unreachable for {limit:g} s (--redis-gone-exit-s)"
                        if limit else "")
            return True
        down_s = now - self._outage[0]
        if limit and down_s >= limit:
            self.redis_gone = True
            log.error("redis unreachable for %.0f s (%s), past --redis-gone-exit-s %g: stopping this worker and "
                      "freeing its KV pool; what it held stays pending in Redis for the workers that serve it next",
                      down_s, exc, limit)
            raise RedisGone(f"redis unreachable for {down_s:.0f} s (--redis-gone-exit-s {limit:g}): {exc}")
        return False

    def _stopped_waiting(self, exc: BaseException) -> None:
        """While waiting for Redis before serving: a stop ends the wait (nothing is in hand)."""
        if self.stop.cold.is_set() or self.stop.warm.is_set():
            raise StoppedWaiting(f"stopped while waiting for Redis ({exc}); nothing was in hand")

    def _unit_failed(self, exc: BaseException, ops: list) -> None:
        """Publisher thread: a unit was dropped or a command in it failed. Its entries may
        be pending for us with nobody holding them: Recovery takes them in again."""
        self.failed_units += 1
        self.metrics.unit_failed()
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


def role_for(role_name: str) -> Role:
    """A new (not started) role of that name."""
    if role_name == "prefill":
        from workers.prefill import PrefillRole as role_class
    elif role_name == "decode":
        from workers.decode import DecodeRole as role_class
    elif role_name == "colocated":
        from workers.colocated import ColocatedRole as role_class
    else:
        raise ValueError(f"unknown role {role_name!r}")
    return role_class()


def make_worker(role_name: str, config: WorkerConfig, loaded) -> WorkerShell:
    """The worker process for ``pdqueue worker ROLE`` (``--switchable``: ``config.switchable``)."""
    return WorkerShell(config, loaded, role_for(role_name))
