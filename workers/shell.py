"""One worker process: a ``WorkerShell`` running a ``Role`` (workers/role.py).

The shell is what lives as long as the process, all made in ``__init__`` before any role
runs: the configuration and the loaded model, the worker id and incarnation, the Redis
client (``pdqueue.queue.connection.connect``), the stop flag (a first SIGTERM/SIGINT asks
for a warm stop, a second for a cold one), the publisher (its thread runs from here on),
the heartbeat, the metrics (``pdqueue.telemetry.metrics.WorkerMetrics``; served over HTTP when
``config.metrics_port`` is set, and advertised as ``metrics`` in the heartbeat; the heartbeat
also shows the worker's compatibility record, ``compat``: workers/compat.py),
``Recovery``, the sweep of dead owners' KV segments (a first one here, before the KV pool
takes room), the role epoch; and the KV pool, made when the first role
asks for it (``kv_pool``) and used by every role after it. ``run()``:

    start  role.start(view) (its engine, on the shell's KV pool); the consumer groups
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

A role sees the shell through a ``ShellView``, the shell's side of the contract in
workers/role.py (``RoleHost``: its members and no other): it answers through
``unit()`` (workers/answers.py), pulls its input with ``take(limit, block_ms)`` (what
Recovery finds first, else one read; returned, never pushed back into the role), asks
``accepting`` whether to take any, shows fields in the heartbeat with ``advertise`` and
answers a planner's command late with ``answer_command``. The roles a worker can run are
``ROLE_CLASSES`` (workers/role.py; ``role_for``).

``switch_role(role)`` replaces the role in place, the model and the KV pool staying: the
current role stops accepting and finishes what it holds (as on a warm stop), drains and
closes; then ``role`` starts as above (start, groups, registration, its group's pending
entries). A worker started with ``--switchable`` does this on a switch command
(pdqueue/control/commands.py): ``switches`` (``SwitchControl``, workers/switching.py, beside
its rules) reads ``control:<id>``, refuses or accepts each command and answers with events
(``accepted``, then ``done`` or ``failed``; or ``refused``). The heartbeat carries
``role_epoch`` (the process start time in ms, +1 per switch), ``switchable``,
``role_since_ms`` and ``switching_to`` (empty unless a switch is under way) as top-level
fields of ``worker:<id>``; decode and colocated roles add ``step_ms`` to the load. Should the
new role fail to start, the worker answers ``failed`` and starts its old role again (same
epoch), and stops only if that fails too.
The switch control sees the shell as a ``SwitchHost`` (workers/switching.py).
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator

import redis

from pdqueue.engine.llm_engine import kv_layout_for
from pdqueue.keys import DECODE_GROUP, PREFILL_GROUP, Keys
from pdqueue.protocol import FinishReason, Request
from pdqueue.queue import streams
from pdqueue.queue.connection import connect
from pdqueue.queue.publisher import Publisher
from pdqueue.queue.registry import Heartbeat
from pdqueue.telemetry.metrics import WorkerMetrics, advertised, serve_metrics, stop_metrics
from pdqueue.transfer.node import node_id
from workers.answers import Unit, request_ids
from workers.common import StopFlag, WorkerConfig, new_incarnation, new_worker_id, now_ms
from workers.compat import own_compat
from workers.kv_pool import ProcessKV, SegmentSweep, tiers_for
from workers.outage import EXIT_REDIS_GONE, Outage, RedisGone, StoppedWaiting  # noqa: F401 (re-exported)
from workers.recovery import REDIS_DOWN, Recovery
from workers.role import Input, Role, role_for
from workers.switching import SwitchControl

log = logging.getLogger("pdqueue.worker")

MAX_CONSECUTIVE_FAILURES = 20
PUBLISHER_FLUSH_S = 10.0       # what close() waits for unpublished answers
PUBLISHER_FLUSH_GONE_S = 1.0   # ... when Redis is known to be gone
PLACEMENT_BEAT_S = 0.5         # a decode worker taking placed prompts beats this often (its load is read)


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
        self.failed_units = 0                # units the publisher dropped (see _unit_failed)
        self.publisher = Publisher(lambda: connect(config.redis_url), name=f"pdq-publisher-{self.worker_id}",
                                   on_error=self._unit_failed)
        self.metrics = WorkerMetrics(config.engine.model)   # recorded always; served with a metrics_port
        self.recovery = Recovery(self.r, self.keys, self.worker_id, config.reclaim_idle_ms, self.publisher,
                                 metrics=self.metrics, max_step_s=config.max_step_s)
        # The role epoch starts at the process's start time (ms) and grows by one per switch,
        # so a command aimed at an earlier process under this worker id is stale too.
        self.role_epoch = self.role_since_ms = int(now_ms())
        # A decode worker taking placed prompts beats every PLACEMENT_BEAT_S: prefill workers
        # place by its load (workers/placement.py), which a beat every ttl/3 (3.3 s) left stale
        # across a change of load.
        self.heartbeat = Heartbeat(self.r, self.keys, self.worker_id, role=role.name, incarnation=self.incarnation,
                                   model=config.engine.model, ttl_s=config.heartbeat_ttl_s,
                                   interval_s=PLACEMENT_BEAT_S if config.take_prompts else None)
        self.heartbeat.update(role_epoch=self.role_epoch, switchable=int(config.switchable),
                              role_since_ms=self.role_since_ms, switching_to="",
                              weights=getattr(loaded, "weights", "fp32"),
                              # what KV it computes and which wires it speaks: peers of another
                              # kind exchange no KV with it (workers/compat.py)
                              compat=own_compat(loaded, config.engine).record(),
                              max_model_len=min(config.engine.max_model_len or loaded.config.max_position_embeddings,
                                                loaded.config.max_position_embeddings))
        self.outage = Outage(config.redis_gone_exit_s, self.stop, lambda: self.heartbeat.beats,
                             self.recovery.on_redis_error)
        self.metrics_port: int | None = None
        if config.metrics_port is not None:   # before the first beat, which advertises it
            self.metrics_port = serve_metrics(self.metrics.registry, config.metrics_host, config.metrics_port)
            shown = advertised(config.metrics_host, self.metrics_port, config.metrics_advertise)
            self.heartbeat.update(metrics=shown)
            log.info("metrics: http://%s/metrics", shown)
        self.sweep_segments = SegmentSweep(self.r, self.keys, min(config.heartbeat_ttl_s, config.lease_s) / 3)
        self.switches = SwitchControl(self, role_for)   # the switch commands (workers/switching.py)
        self.view = ShellView(self)          # what a role sees of this shell (workers/role.py RoleHost)
        self.next_role: Role | None = None
        self._role_open = False              # role.start succeeded and role.close is due
        # The KV pool: one per process, made when the first role asks (``kv_pool``).
        self.kv = ProcessKV(kv_layout_for(loaded.config, config.engine), config.engine.device,
                            config.switchable, self.worker_id, self.incarnation, tiers=tiers_for(config))
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
                self.switches.done()
                self.loop()
                self.role.drain()
                if self.next_role is None or self.stop.warm.is_set() or self.stop.cold.is_set():
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
                self.outage.down(exc)
            except RedisGone:
                raise
            except Exception:
                failures += 1
                log.exception("worker iteration failed (%d in a row)", failures)
                if failures >= MAX_CONSECUTIVE_FAILURES:
                    raise
                self.outage.backoff.sleep(self.stop.cold)

    def tick(self) -> None:
        """After each step (and while a role drains): the switch commands waiting for us
        (every ``CONTROL_EVERY_S``) and the heartbeat's load."""
        self.recovery.progress()
        self.switches.poll()
        load = self.load()
        self.heartbeat.update(load=load)
        self.metrics.set_load(load)

    def close(self) -> None:
        self.switches.failed("the worker stopped before the switch completed")   # if one was under way
        self.recovery.stop_keeper()
        self.publisher.close(timeout=PUBLISHER_FLUSH_GONE_S if self.outage.gone else PUBLISHER_FLUSH_S)
        if self._role_open:
            self.role.close()
        self.kv.close()
        self.heartbeat.stop()
        if self.metrics_port is not None:
            stop_metrics(self.metrics_port)
        log.info("%s worker %s stopped", self.role.name, self.worker_id)

    def load(self) -> dict:
        return {**self.role.load(), "failed_units": self.failed_units, **self.kv.stats()}

    @property
    def segment(self):
        """The KV pool's shared memory segment, if it has one (workers/kv_pool.py)."""
        return self.kv.segment

    # ---- roles -------------------------------------------------------------------------
    @property
    def stopping(self) -> bool:
        """A stop was asked, warm or cold."""
        return self.stop.warm.is_set() or self.stop.cold.is_set()

    def switch_role(self, role: Role) -> None:
        """Replace the running role by ``role`` once it has finished what it holds (it takes
        nothing new meanwhile, as on a warm stop, then drains and closes). From any thread.
        Should ``role`` fail to start, the worker goes back to a new role of its old kind
        (and stops with the error if that fails too)."""
        self.next_role = role

    def _switch(self) -> None:
        new, self.next_role = self.next_role, None
        old_name = self.role.name
        self.switches.drained()
        log.info("worker %s: %s -> %s", self.worker_id, old_name, new.name)
        self.role.close()
        self._role_open = False
        self.kv.retire_tickets()
        try:
            self._start_role(new, epoch=self.role_epoch + 1)
        except Exception as exc:
            log.exception("worker %s: the %s role failed to start; going back to %s", self.worker_id,
                          new.name, old_name)
            if self._role_open:   # it started, and what came after failed
                self.role.close()
                self._role_open = False
            reason = f"{new.name} failed to start: {exc}"
            try:   # the old role first, so that whoever reads ``failed`` finds it serving again
                self._start_role(role_for(old_name))   # the epoch stays: nothing changed for a sender
            except Exception:
                self.switches.failed(reason)
                raise
            self.switches.failed(reason, back_to=old_name)

    def _start_role(self, role: Role, epoch: int | None = None) -> None:
        self.metrics.activate(role.name)   # what the role observes carries its name
        role.start(self.view)   # a role whose start fails releases what it built before raising
        self.role, self._role_open = role, True
        self.kv.attach(role)    # the KV tiers under its engine (workers/kv_pool.py)
        while True:
            try:
                self.ensure_groups()
                break
            except REDIS_DOWN as exc:
                self.outage.stopped_waiting(exc)
                self.outage.down(exc)
        if epoch is not None:
            self.role_epoch, self.role_since_ms = epoch, int(now_ms())
        self.heartbeat.update(**{"role": role.name, "node": "", "endpoints": {}, **role.registration()},
                              role_epoch=self.role_epoch, role_since_ms=self.role_since_ms, switching_to="",
                              load=self.load())
        self.beat_now()

    def advertise(self, **fields) -> None:
        """Show these fields in ``worker:<id>`` now (``beat_now``)."""
        self.heartbeat.update(**fields)
        self.beat_now()

    def beat_now(self) -> None:
        """Write the heartbeat now (a role or switch state others must see at once); the
        heartbeat thread writes it again soon anyway, should Redis be down."""
        if self.heartbeat.beats:   # not before the first beat (``_register``)
            try:
                self.heartbeat.beat()
            except REDIS_DOWN as exc:
                log.warning("heartbeat: redis unavailable (%s)", exc)

    def _resume(self) -> None:
        """Entries of the role's group delivered to this worker id and never acknowledged:
        a restart under the same id picks up what the previous process had taken."""
        try:
            entries = self.recovery.own_pending(self.role.group, self.role.streams())
        except REDIS_DOWN as exc:   # Recovery compares our pending list with what we hold later
            self.outage.down(exc)
            return
        self.role.accept(entries, resumed=True)

    def _register(self) -> None:
        """The first heartbeat, so the worker is visible; retried while Redis is down."""
        while True:
            try:
                self.heartbeat.start()
                return
            except REDIS_DOWN as exc:
                self.outage.stopped_waiting(exc)
                self.outage.down(exc, "redis unavailable at start (%s); retrying")

    # ---- Redis ---------------------------------------------------------------------------
    def ensure_groups(self) -> None:
        """Every group exists (created at "0": entries added before any worker are served)."""
        role = self.role
        groups = [(s, PREFILL_GROUP) for s in streams.request_streams(self.keys)] + [(self.keys.handoff, DECODE_GROUP)]
        # The streams it reads (its own among them), not every stream it scans: another
        # worker's own stream, deleted once empty and owner-less, must not come back.
        groups += [(s, role.group) for s in role.read_streams() if (s, role.group) not in groups]
        for stream, group in groups:
            streams.ensure_group(self.r, stream, group)

    def _unit_failed(self, exc: BaseException, ops: list) -> None:
        """Publisher thread: a unit was dropped or a command in it failed. Its entries may
        be pending for us with nobody holding them: Recovery takes them in again."""
        self.failed_units += 1
        self.metrics.unit_failed()
        log.error("a unit of answers failed (%s); entries of %s are taken in again if still pending",
                  exc, request_ids(ops) or "tokens only")
        self.recovery.on_unit_failed()


class ShellView:
    """The shell as a role sees it: ``RoleHost`` (workers/role.py), these members and no
    other, handed to the role at ``start``. The values are the shell's; the methods act on
    the shell's parts (publisher, recovery, heartbeat, switch control) for the role now."""

    def __init__(self, shell: WorkerShell):
        self._shell = shell
        self.config, self.loaded, self.metrics = shell.config, shell.loaded, shell.metrics
        self.worker_id, self.incarnation, self.node = shell.worker_id, shell.incarnation, shell.node
        self.keys, self.r = shell.keys, shell.r

    @property
    def segment(self):
        return self._shell.kv.segment

    @property
    def accepting(self) -> bool:
        return not self._shell.stop.warm.is_set() and self._shell.next_role is None

    @property
    def cold_stop(self) -> bool:
        return self._shell.stop.cold.is_set()

    def kv_pool(self, shared: bool = False):
        return self._shell.kv.pool(shared)

    @contextmanager
    def unit(self) -> Iterator[Unit]:
        """A ``Unit`` of answers, submitted to the publisher when the block ends (not when
        it raises: then the entries stay pending and are taken in again)."""
        shell = self._shell
        unit = Unit(self.keys, self.worker_id, shell.role.group, model=self.config.engine.model)
        yield unit
        if unit:
            shell.publisher.submit(unit.ops)
            self.metrics.answered(unit.tally)

    def take(self, limit: int, block_ms: int, only: str | None = None) -> Input:
        role = self._shell.role
        if only is not None:
            return Input(self._read([only], limit, block_ms), resumed=False)
        entries = self._shell.recovery.recover(role, limit)
        if entries:
            return Input(entries, resumed=True)
        return Input(self._read(role.read_streams(), limit, block_ms), resumed=False)

    def _read(self, stream_names: list[str], limit: int, block_ms: int) -> list:
        """XREADGROUP of ``stream_names``, highest priority first; [] while Redis is down."""
        shell = self._shell
        try:
            entries = streams.read_group(self.r, shell.role.group, self.worker_id, stream_names,
                                         count=limit, block_ms=block_ms or None)
            shell.outage.answered()
            return entries
        except REDIS_DOWN as exc:
            shell.outage.down(exc)
            return []
        except redis.ResponseError as exc:
            if "NOGROUP" in str(exc) or "no longer exists" in str(exc):
                # Redis restarted without persistence, or a stream was deleted under a blocked read
                shell.ensure_groups()
                return []
            raise

    def cancelled(self, request_ids_: list[str]) -> set[str]:
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
        stopped = {rid: FinishReason.CANCELLED for rid in self.cancelled(list(requests))}
        t = now_ms()
        stopped.update({rid: FinishReason.EXPIRED for rid, req in requests.items()
                        if rid not in stopped and req.expired(t)})
        return stopped

    def tick(self) -> None:
        self._shell.tick()

    def advertise(self, **fields) -> None:
        self._shell.advertise(**fields)

    def answer_command(self, kind: str, command_id: str, status: str, **fields) -> None:
        self._shell.switches.answer(kind, command_id, status, **fields)


def make_worker(role_name: str, config: WorkerConfig, loaded) -> WorkerShell:
    """The worker process for ``pdqueue worker ROLE`` (``--switchable``: ``config.switchable``)."""
    return WorkerShell(config, loaded, role_for(role_name))
