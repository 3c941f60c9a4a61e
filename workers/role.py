"""What a role is: the contract between the process shell (``WorkerShell``, workers/shell.py)
and the part of a worker that can be replaced while the process lives (prefill, decode,
colocated). Both directions are written down here, and each is one way:

- ``Role``: what the shell calls of a role, in this order:

      start(shell)                  build the engine and what serves it; nothing read yet
      accept(entries, resumed=True) entries an earlier process under this worker id held
      loop:  drop(lost)             entries another worker took over (``Recovery.keep``)
             step() -> bool         one iteration: it pulls its input (``shell.take``) and
                                    takes it in itself; False: nothing left to do
             load()                 for the heartbeat
      drain()                       after the loop ended (warm stop, burst, switch); a long
                                    one calls ``shell.tick()`` now and then (switch commands)
      close()                       always, last

  and the planner's levers (``set_tbt_budget``, ``migrate_some``), which every role has:
  by default they refuse with a reason, so the switch control (workers/switching.py) calls
  them on any role and never probes it.

- ``RoleHost``: what a role may use of the shell, all of it, typed. ``shell`` in a role is
  a ``RoleHost`` (the shell hands it a ``ShellView``, which has these members and no
  other), never the ``WorkerShell``: a role cannot reach the shell's parts (heartbeat,
  switch control, recovery, publisher); what it needs of them is a method here
  (``advertise``, ``answer_command``, ``take``, ``unit``). Input flows one way: ``take``
  *returns* what Recovery finds or one read brings (an ``Input``) and the role takes it in
  (``accept``); the shell never calls back into the role to deliver it.
  tests/test_role_contract.py pins this: the role modules use no other member of the shell
  and the view has exactly these.

- ``ROLE_CLASSES``: the roles a worker can run, name (``pdqueue.protocol.Role``) ->
  ``module:class``, imported when first asked for (``role_for``).

A role's engine uses the process's KV pool (``shell.kv_pool()``), so a switch from one role
to another allocates nothing.

``RequestRole`` is the part prefill and colocated share: they read the request streams.
"""

from __future__ import annotations

import importlib
import time
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, NamedTuple, Protocol

from pdqueue.keys import PREFILL_GROUP
from pdqueue.protocol import Completion, FinishReason, ServiceClass
from pdqueue.protocol import Role as RoleName
from workers.admission import BatchGate
from workers.common import kv_auth_for, now_ms, tbt_stats
from workers.intake import Admitted, Intake
from workers.kv_pull import KVPull
from workers.routing import Router, online_load

if TYPE_CHECKING:
    import redis
    import torch

    from pdqueue.keys import Keys
    from pdqueue.models.loader import LoadedModel
    from pdqueue.protocol import Request
    from pdqueue.telemetry.metrics import WorkerMetrics
    from pdqueue.transfer.shm import SharedKVPool
    from workers.answers import Unit
    from workers.common import WorkerConfig

IDLE_BLOCK_MS = 100  # an idle role's read blocks this long (a busy one never blocks)


class Input(NamedTuple):
    """What ``RoleHost.take`` hands a role: entries ((stream, entry_id, fields)) and whether
    they were taken over (``resumed``: redelivered or reclaimed by Recovery, so work may
    have been done) rather than read new."""
    entries: list
    resumed: bool


class RoleHost(Protocol):
    """What a role may use of the process it runs in: the values the shell holds for every
    role, and what it does for one. Nothing else (see the module docstring)."""

    config: WorkerConfig        # the worker's settings
    loaded: LoadedModel         # the model, loaded once per process
    worker_id: str
    incarnation: str            # this process under ``worker_id`` (a KV sender's identity)
    node: str                   # the shared-memory domain (pdqueue/transfer/node.py)
    keys: Keys
    r: redis.Redis              # the worker's Redis client
    metrics: WorkerMetrics      # what the role observes (answers, TTFT, gaps, ...)

    @property
    def segment(self) -> SharedKVPool | None:
        """The KV pool's shared memory segment, if it has one (after ``kv_pool``)."""

    @property
    def accepting(self) -> bool:
        """Whether to take new input: not after a warm stop, nor while a switch waits."""

    @property
    def cold_stop(self) -> bool:
        """A cold stop was asked: whatever blocks (a drain) ends now."""

    def kv_pool(self, shared: bool = False) -> torch.Tensor:
        """The process's KV pool, which every role's engine uses (``shared``: in a named
        shared memory segment, on CPU)."""

    def take(self, limit: int, block_ms: int, only: str | None = None) -> Input:
        """Input for the role: what Recovery finds (resumed), else up to ``limit`` new
        entries of the role's ``read_streams`` (one read, blocking ``block_ms`` when nothing
        is there); with ``only``: one read of that stream alone, nothing recovered."""

    def unit(self) -> AbstractContextManager[Unit]:
        """A unit of answers (workers/answers.py), published when the block ends."""

    def cancelled(self, request_ids: list[str]) -> set[str]:
        """Which of ``request_ids`` a producer cancelled (one round trip)."""

    def to_stop(self, requests: dict[str, Request]) -> dict[str, FinishReason]:
        """Which of ``requests`` (by id) must stop now: cancelled, else past their deadline."""

    def tick(self) -> None:
        """The shell's chores between steps (switch commands, the heartbeat's load): for a
        role that blocks a while (a drain serving its leases)."""

    def advertise(self, **fields) -> None:
        """Show these fields in the worker's heartbeat, written now."""

    def answer_command(self, kind: str, command_id: str, status: str, **fields) -> None:
        """An event answering a planner's command later than when it came (``migrate``'s
        ``done``, workers/switching.py)."""


# The roles a worker can run: name -> "module:class", imported when first asked for (a
# worker imports its own roles' modules only).
ROLE_CLASSES: dict[str, str] = {
    RoleName.PREFILL.value: "workers.prefill:PrefillRole",
    RoleName.DECODE.value: "workers.decode:DecodeRole",
    RoleName.COLOCATED.value: "workers.colocated:ColocatedRole",
}


def role_for(role_name: str) -> Role:
    """A new (not started) role of that name (``ROLE_CLASSES``)."""
    if role_name not in ROLE_CLASSES:
        raise ValueError(f"unknown role {role_name!r} (one of {', '.join(ROLE_CLASSES)})")
    module, _, class_name = ROLE_CLASSES[role_name].partition(":")
    return vars(importlib.import_module(module))[class_name]()


class Role(ABC):
    name: str    # a pdqueue.protocol.Role value (ROLE_CLASSES): the heartbeat's role, the default worker id's prefix
    group: str   # the consumer group it reads its input with

    @abstractmethod
    def streams(self) -> list[str]:
        """Its input streams, highest priority first (groups made, pending entries scanned)."""

    def read_streams(self) -> list[str]:
        """The streams it reads new entries from, highest priority first."""
        return self.streams()

    def registration(self) -> dict:
        """What ``worker:<id>`` shows of it besides load: ``node``, ``endpoints``."""
        return {}

    @abstractmethod
    def start(self, shell: RoleHost) -> None:
        """Build the engine and what serves it (``shell``: all the role may use of the
        process, ``RoleHost``; kept as ``self.shell``)."""

    @abstractmethod
    def step(self) -> bool:
        """One loop iteration. False when there is nothing left to do: a warm stop (or a
        switch) found it idle, or in burst mode it ran out of work."""

    @abstractmethod
    def accept(self, entries: list, resumed: bool) -> None:
        """Take in input entries ((stream, entry_id, fields)); ``resumed``: taken over from
        another consumer (or an earlier process of ours), so work may have been done. The
        shell calls it once, at start, with what an earlier process held; after that the
        role calls it itself, with what it pulled (``shell.take``)."""

    @abstractmethod
    def held(self) -> dict[str, tuple[str, str]]:
        """The entries in hand: request id -> (stream, entry_id)."""

    @abstractmethod
    def drop(self, request_ids: list[str]) -> None:
        """Forget these requests without answering: another worker took their entries."""

    @abstractmethod
    def load(self) -> dict:
        """The load fields of the heartbeat (``running``, ``waiting``, ``kv_free``, ...)."""

    def drain(self) -> None:
        """After the loop ended normally: finish what still needs this process."""

    def close(self) -> None:
        """Release what ``start`` built (also after a failure)."""

    # ---- the planner's levers (budget and migrate commands: switching.py) ---------------------
    def set_tbt_budget(self, tbt_slo_ms: float | None) -> str | None:
        """Its engine's TBT target from now on (None: none, ``LLMEngine.set_tbt_target``); why
        not, if it cannot. By default it cannot."""
        return f"the {self.name} role has no TBT budget"

    def migrate_some(self, count: int, command_id: str) -> str | None:
        """Move up to ``count`` running decodes to a decode worker; why not, if it cannot. By
        default it cannot."""
        return f"the {self.name} role has no running decodes to move"


class RequestRole(Role):
    """A role that reads the request streams (group ``prefill``) through ``Intake`` and
    keeps what it admitted in ``inflight`` (request id -> Admitted). Subclasses build
    ``engine`` in ``start`` and provide ``publish(outputs)``."""

    group = PREFILL_GROUP

    def start(self, shell: RoleHost) -> None:
        self.shell = shell
        # Cache-aware routing (workers/routing.py): its own stream, read after requests:high.
        self.router = Router(shell.r, shell.keys, shell.worker_id, self, shell.config.routing)
        self.router.start()
        # The history a peer holds (the last turn's KV) pulled at intake when cheaper (workers/kv_pull.py).
        self.puller = (KVPull(shell.r, shell.keys, shell.worker_id, shell.node, shell.config,
                              auth=kv_auth_for(shell.config, shell.r, shell.keys))
                       if shell.config.kv_pull != "never" else None)
        self.intake = Intake(shell.r, shell.keys, shell.worker_id, shell.loaded, shell.config.limits,
                             router=self.router, metrics=shell.metrics, puller=self.puller)
        self.inflight: dict[str, Admitted] = {}
        # Batch only into the capacity the higher classes leave (workers/admission.py).
        self.batch_gate = BatchGate()
        self.step_s = 0.0   # moving average of an engine step

    def streams(self) -> list[str]:
        """Every request stream it may hold entries of: high, its own, the shared one, and
        the other workers' own streams (Recovery reclaims a dead owner's entries there)."""
        return self.router.all_streams()

    def read_streams(self) -> list[str]:
        return self.router.read_streams()

    def _read_only(self, stream: str, n: int) -> int:
        """One read of ``stream`` alone (at most ``n`` entries, no wait), then accept them; how many."""
        entries, resumed = self.shell.take(n, block_ms=0, only=stream)
        if entries:
            self.accept(entries, resumed)
        return len(entries)

    def take_interactive(self) -> None:
        """Lower classes wait in the engine and no interactive request does: the interactive
        stream is read anyway (the engine's waiting order puts what comes ahead of them,
        engine/scheduler.py), so interactive requests never queue in Redis behind the standard
        ones this worker already holds (read in turn with those, their TTFT would grow
        several-fold beside a busy standard tenant)."""
        first = next(iter(ServiceClass))   # rank 0: the interactive class
        self._read_only(self.shell.keys.request_stream_for(first), self.read_limit())

    def take_batch(self) -> None:
        """Batch entries, as many as the gate lets in after the higher classes' turn: no more
        than the batch slots free now, so none waits in the engine (a request waiting there
        would stop this worker reading the higher classes' streams)."""
        scheduler = self.engine.scheduler
        free_slots = min(self.engine.config.max_num_seqs - scheduler.num_unfinished,
                         self.engine.config.background_seqs - scheduler.num_background, self.batch_room())
        n = self.batch_gate.limit(waiting=self.engine.num_waiting, kv_free=self.engine.block_manager.num_free_blocks,
                                  kv_total=self.engine.layout.num_blocks, want=min(self.read_limit(), free_slots),
                                  batch_running=sum(a.request.background for a in self.inflight.values()),
                                  now_s=time.monotonic())
        for cls in ServiceClass:   # the classes that yield (batch), in class order
            if cls.yields and n > 0:
                n -= self._read_only(self.shell.keys.request_stream_for(cls), n)

    def refuse_late(self) -> None:
        """Classed requests in hand whose deadline passed before their first token (waiting
        in the engine, or still prefilling) are answered now with the error
        ``deadline_exceeded`` and leave the engine, their blocks freed: one that cannot meet
        its deadline is not computed late. (Once its tokens are out, a request past its
        deadline ends ``done``/``expired`` with them, as an old producer's does; a request
        without a class too.)"""
        t = now_ms()
        late = [rid for rid, it in self.inflight.items()
                if it.request.service_class is not None and not it.token_times_ms and it.request.expired(t)]
        if not late:
            return
        with self.shell.unit() as unit:
            for rid in late:
                it = self.inflight.pop(rid)
                self.engine.abort(rid, FinishReason.EXPIRED)   # its blocks go back to the pool
                unit.deadline_exceeded(it.stream, it.entry_id, it.request, t,
                                       f"it waited {t - it.read_ms:.0f} ms in worker {self.shell.worker_id}")

    def step(self) -> bool:
        self.refuse_late()
        self.housekeeping()
        self.router.refresh()
        busy = self.engine.has_unfinished
        # Online streams are read while no online request waits in the engine (batch ones
        # waiting there queue behind whatever this brings), nor one that can still make its TTFT
        # target (the late ones wait behind what this brings; at most read_limit of them held).
        if self.shell.accepting and self.nothing_waits_on_time():
            self.accept(*self.shell.take(self.read_limit(), block_ms=0 if busy else IDLE_BLOCK_MS))
            if self.engine.scheduler.num_waiting_foreground == 0 and self.shell.accepting:
                # Entries routed to a dead worker (or, when idle, to one that lags)
                taken = self.router.take_over(self.read_limit(), idle=not self.engine.has_unfinished)
                if taken:
                    self.accept(taken, resumed=False)
            if self.shell.accepting:
                self.take_batch()
        elif self.shell.accepting and self.reads_ahead():
            self.accept(*self.shell.take(self.read_limit() - self.engine.scheduler.num_waiting_foreground, block_ms=0))
        elif self.shell.accepting and not self.engine.scheduler.num_waiting_rank(0):
            self.take_interactive()
        elif not busy:
            return False
        if self.engine.has_unfinished:
            self.before_step()
            t0 = time.perf_counter()
            outputs = self.engine.step()
            dt = time.perf_counter() - t0
            self.step_s = dt if not self.step_s else 0.8 * self.step_s + 0.2 * dt
            self.publish(outputs)
        elif self.shell.config.burst and not self.inflight:
            return False
        return True

    def read_limit(self) -> int:
        """How many request entries to take at once."""
        return self.shell.config.max_batch_requests

    def nothing_waits_on_time(self) -> bool:
        """No online prompt waits in the engine, except late ones (past their TTFT target,
        scheduler.mark_late), fewer than ``--max-batch-requests`` of them."""
        scheduler = self.engine.scheduler
        return (scheduler.num_waiting_on_time == 0
                and scheduler.num_waiting_foreground - scheduler.num_waiting_on_time
                < self.shell.config.max_batch_requests)

    def reads_ahead(self) -> bool:
        """Whether to read the request streams although online prompts wait in the engine
        (then up to ``read_limit`` waiting in all); no by default: they wait in Redis, where
        any worker may take them."""
        return False

    def batch_room(self) -> int:
        """How many more batch entries the role's own downstream can take (no bound here)."""
        return self.read_limit()

    def housekeeping(self) -> None:
        """Chores before each step's reads (none by default)."""

    def before_step(self) -> None:
        """Right before the engine steps, after the reads (nothing by default)."""

    def end_stopped(self, among: dict[str, Admitted]) -> None:
        """Requests among ``among`` that were cancelled or are past their deadline end at once
        (blocks freed, done published with what they have so far)."""
        stopped = self.shell.to_stop({rid: it.request for rid, it in among.items()})
        t = now_ms()
        with self.shell.unit() as unit:
            for rid, reason in stopped.items():
                it = self.inflight.pop(rid)
                output = self.engine.abort(rid, reason.value).output_ids
                unit.done(it.stream, it.entry_id, Completion(
                    rid, self.shell.loaded.tokenizer.decode(output), tuple(output), reason,
                    num_prompt_tokens=len(it.prompt_ids), e2e_ms=t - it.request.enqueued_ms,
                    prefill_worker=self.shell.worker_id, decode_worker=self.shell.worker_id, transfer_path="local"),
                    it.request)

    def publish_local(self, unit, out, t: float) -> None:
        """One token of a request decoded here, from its first to its last (the done, with
        ``transfer_path`` local)."""
        it = self.inflight[out.request_id]
        if it.token_times_ms:
            self.shell.metrics.token_gap(t - it.token_times_ms[-1])
        else:
            self.shell.metrics.first_token(t - it.request.enqueued_ms, len(it.prompt_ids))
            self.router.advertise(unit, out.seq)
        it.token_times_ms.append(t)
        unit.token(out.request_id, out.index, out.token_id, out.text)
        if out.finished:
            del self.inflight[out.request_id]
            self.router.advertise(unit, out.seq, whole=True)
            req = it.request
            p50, pmax = tbt_stats(it.token_times_ms)
            first = it.token_times_ms[0]
            unit.done(it.stream, it.entry_id, Completion(
                req.id, out.full_text or "", tuple(out.seq.output_ids), out.finish_reason,
                num_prompt_tokens=len(it.prompt_ids), ttft_ms=first - req.enqueued_ms,
                queue_ms=it.read_ms - req.enqueued_ms, prefill_ms=first - it.read_ms,
                decode_ms=t - first, tbt_p50_ms=p50, tbt_max_ms=pmax, e2e_ms=t - req.enqueued_ms,
                prefill_worker=self.shell.worker_id, decode_worker=self.shell.worker_id,
                transfer_path="local", cached_tokens=out.cached_tokens), req)

    @abstractmethod
    def publish(self, outputs) -> None:
        """Answer a step's outputs (``engine.step()``) in one unit."""

    def accept(self, entries: list, resumed: bool) -> None:
        in_hand = {(a.stream, a.entry_id) for a in self.inflight.values()}
        with self.shell.unit() as unit:
            for stream, entry_id, fields in entries:
                if (stream, entry_id) in in_hand:
                    # The very entry in hand, delivered again (its first delivery lost at a
                    # Redis failover): pending for us once more, and answered when it ends.
                    continue
                admitted = self.intake.take(self.engine, stream, entry_id, fields, unit)
                if admitted:
                    self.inflight[admitted.request.id] = admitted
                    self.shell.metrics.queued(admitted.read_ms - admitted.request.enqueued_ms)

    def held(self) -> dict[str, tuple[str, str]]:
        return {rid: (a.stream, a.entry_id) for rid, a in self.inflight.items()}

    def drain(self) -> None:
        """It takes nothing new from here on: requests routed to it go back to ``requests``."""
        self.router.give_back()

    def drop(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.engine.abort(rid)
            del self.inflight[rid]

    def load(self) -> dict:
        return {"running": self.engine.num_running, "waiting": self.engine.num_waiting,
                "online": online_load(self.engine),
                "kv_free": self.engine.block_manager.num_free_blocks, "kv_total": self.engine.layout.num_blocks,
                "accepting": self.shell.accepting, **self.router.load(),
                **(self.puller.load() if self.puller is not None else {})}

    def close(self) -> None:
        if getattr(self, "puller", None) is not None:   # (start may have failed before it)
            self.puller.close()
