"""The decode role: handoffs in, tokens and completions out, continuous batching.

A request here, from handoff to done. Each handoff in hand is one ``Job`` in ``jobs`` (by
request id), and its ``state`` says where it is:

    accept      handoff:<own node>, handoff:kv:<its key>, then handoff (group decode) -> BACKLOG
                (``intake``, workers/handoff_intake.py: a handoff that cannot run is
                dead-lettered; one of another kind, KV format, model or wire version, is
                passed on to its kind's stream and never run here: workers/compat.py; one
                taken over from another worker first catches up with what out:<id> shows)
    start       BACKLOG -> FETCHING: once the engine can reserve blocks for the whole
                sequence and a batch slot; the fetch thread copies the KV in (``fetches``,
                workers/kv_fetches.py: shm when the ticket's node is ours, else the
                sender's TCP data wire, else ZeroMQ)
                BACKLOG -> RUNNING by ``recompute`` when there is no ticket
                BACKLOG -> RUNNING by ``prefill_here`` for a prompt handoff (no ticket, no
                token: a prefill worker placed the prompt here, workers/placement.py); the
                engine prefills it within its TBT budget and publishes from token 0
                BACKLOG -> answered (done: expired, cancelled) before any work
    fetched     FETCHING -> RUNNING: the sequence joins the running batch at a step
                boundary (the prompt's KV is in place; the first decode step computes the
                first token's); a failed fetch -> ``recompute``
    recompute   -> RUNNING: the engine prefills prompt + tokens so far and sampling goes on
                at the next index (same seed); after max_attempts -> answered (error)
    finish      RUNNING -> answered: the last token and done, in one unit (once: ack_and_write)
    stop        RUNNING -> answered (done: cancelled, expired; checked every ~100 ms)
    drop        any state -> gone, unanswered: another worker took the entry over

Every token goes to out:<id> through the publisher, so a step never waits on Redis.

Admission happens at step boundaries (``step``): take every handoff there is room for,
start its fetch before the step, and give the fetches just started a short grace
(``admit_grace_s``) so fast ones (shm: a few ms) join this very step; slower ones join at
the next boundary while the step runs. A warm stop takes nothing new and finishes what
is in hand (a switch to another role too).
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field, replace
from enum import Enum

from pdqueue.engine.llm_engine import LLMEngine
from pdqueue.engine.sampling import SamplingParams
from pdqueue.engine.sequence import Sequence
from pdqueue.keys import DECODE_GROUP
from pdqueue.protocol import Completion, ErrorCode, FinishReason, Handoff, encode_handoff
from pdqueue.protocol import Role as RoleName
from workers.common import Every, now_ms, tbt_stats
from workers.compat import Rerouter, engine_compat
from workers.fetch import FetchOutcome
from workers.handoff_intake import HandoffIntake
from workers.kv_fetches import KVFetches
from workers.kv_holds import KVHolds
from workers.migration import Migrator
from workers.placement import RECENT_STEPS, SpareTime, prompt_load
from workers.role import IDLE_BLOCK_MS, Role, RoleHost

log = logging.getLogger("pdqueue.decode")

READ_LIMIT = 16        # handoffs taken per step boundary at most (each still needs room to start)
CHECK_EVERY_S = 0.1    # cancel keys and deadlines of the running requests
FETCH_WAIT_S = 0.05    # nothing to step: wait this long for a fetch to land


class JobState(Enum):
    BACKLOG = "backlog"     # taken from Redis, waiting for room
    FETCHING = "fetching"   # blocks reserved, the fetch thread copies its KV
    RUNNING = "running"     # in the engine


@dataclass(slots=True)
class Job:
    """A handoff in hand. Touched by the loop's thread only."""
    stream: str
    entry_id: str
    handoff: Handoff                    # frozen: resume and recompute replace it
    params: SamplingParams
    read_ms: float
    state: JobState = JobState.BACKLOG
    seq: Sequence | None = None         # its reserved blocks, while FETCHING
    kv: FetchOutcome = FetchOutcome()   # how its KV got here
    admitted_ms: float = 0.0
    token_times_ms: list[float] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.handoff.request.id


class DecodeRole(Role):
    name = RoleName.DECODE.value
    group = DECODE_GROUP

    def start(self, shell: RoleHost) -> None:
        self.shell = shell
        self.engine = LLMEngine(shell.loaded, shell.config.engine, kv_cache=shell.kv_pool())
        self.holds = KVHolds(shell, self.engine)   # finished requests' KV, for the next turn's puller
        self.fetches = KVFetches(shell, self.engine)   # the KV's way in: reserve, fetch, admit
        self.rerouter = Rerouter(shell.r, shell.keys, engine_compat(self.engine), shell.metrics)
        self.intake = HandoffIntake(shell, self.engine, self.rerouter)   # entries -> jobs (or passed on)
        self.jobs: dict[str, Job] = {}
        self.migrator = Migrator(shell, self.engine) if shell.config.migrate else None
        self.takes_prompts = shell.config.take_prompts
        self.spare = SpareTime()   # what its decodes leave of its time (prompt_load)
        self.recent_steps: collections.deque[float] = collections.deque(maxlen=RECENT_STEPS)   # steps with decodes
        self._step_s = 0.05   # moving average of an engine step
        self._check = Every(CHECK_EVERY_S)
        log.info("decode: node %s, transfer %s%s", shell.node, shell.config.transfer,
                 ", takes prompts" if self.takes_prompts else "")

    def streams(self) -> list[str]:
        keys = self.shell.keys
        return [keys.handoff_node(self.shell.node), keys.handoff_compat(self.rerouter.mine.key), keys.handoff]

    def registration(self) -> dict:
        return {"node": self.shell.node}

    def load(self) -> dict:
        return decode_load(self)

    def held(self) -> dict[str, tuple[str, str]]:
        return {rid: (job.stream, job.entry_id) for rid, job in self.jobs.items()}

    def in_state(self, state: JobState) -> list[Job]:
        return [job for job in self.jobs.values() if job.state is state]

    # ---- one step boundary ---------------------------------------------------------------
    def step(self) -> bool:
        self.admit_fetched()
        self.holds.relieve(backlog_blocks(self))   # holds never keep the backlog from blocks
        if self.migrator is not None:
            self.migrator.free_released()
            if not self.shell.accepting and self.jobs:
                self.migrate_out()
        backlog = self.in_state(JobState.BACKLOG)
        started = len(self.jobs) - len(backlog)
        idle = not self.engine.has_unfinished and not started
        if self.shell.accepting:
            room = min(READ_LIMIT, self.shell.config.engine.max_num_seqs - started)
            # Read while nothing online waits in the backlog: batch jobs waiting for a batch
            # slot (scheduler.py) do not stop online handoffs from being read, up to
            # READ_LIMIT of them held (the rest stays in the stream for other workers).
            batch_waiting = sum(j.handoff.request.background for j in backlog)
            online_waiting = len(backlog) - batch_waiting
            if not online_waiting and batch_waiting < READ_LIMIT and room > 0 \
                    and self.engine.block_manager.num_free_blocks > 0:
                self.accept(*self.shell.take(room, block_ms=IDLE_BLOCK_MS if idle else 0))
        elif not self.engine.has_unfinished and not self.jobs and not self.fetches.in_flight:
            # (a fetch of a dropped job still writes into its reserved blocks: the pool
            # outlives this role, so the next one must not get them before it is over)
            return False
        if self.start_backlog() and self.engine.has_unfinished:
            self.admit_fetched(wait_s=admit_grace_s(self._step_s))
        self.housekeeping()
        if self.engine.has_unfinished:
            scheduler = self.engine.scheduler
            rows = sum(1 for s in scheduler.running if s.num_uncomputed_tokens <= 1)
            prompts = bool(scheduler.waiting) or rows < len(scheduler.running)
            t0 = time.perf_counter()
            outputs = self.engine.step()
            dt = time.perf_counter() - t0
            self._step_s = 0.8 * self._step_s + 0.2 * dt
            self.spare.add_step(scheduler, rows, prompts, dt)
            if rows:
                self.recent_steps.append(dt)
            self.publish(outputs)
            return True
        self.spare.add(0.0)
        if self.shell.config.burst and not self.jobs:
            return False
        if self.fetches.in_flight:
            self.admit_fetched(wait_s=FETCH_WAIT_S)
        return True

    # ---- accept: -> BACKLOG ----------------------------------------------------------------
    def accept(self, entries: list, resumed: bool) -> None:
        self.intake.accept(entries, resumed, self.jobs, self.new_job)

    def new_job(self, stream: str, entry_id: str, h: Handoff) -> None:
        """A handoff taken in (``HandoffIntake``): a job in the backlog."""
        self.jobs[h.request.id] = Job(stream, entry_id, h, SamplingParams.for_request(h.request, h.seed), now_ms())

    # ---- start: BACKLOG -> FETCHING | RUNNING | answered -------------------------------------
    def start_backlog(self) -> int:
        """Start jobs while there is room, by class, then in the order they came; returns how
        many fetches it started. By class: after an outage, batch jobs in front held online
        ones back until their KV leases expired (docs/performance.md)."""
        fetches = 0
        for job in sorted(self.in_state(JobState.BACKLOG), key=lambda j: j.handoff.request.rank):
            h = job.handoff
            background = h.request.background
            if background and not self.engine.scheduler.can_run_background():
                continue   # batch waits for one of its own slots; the online jobs behind it go on
            if not self.fetches.room(h):
                break   # (online work takes the room of running batch sequences: make_room)
            if h.request.expired(now_ms()):
                self.answer_expired(job, h.output_ids)
            elif self.shell.cancelled([h.request.id]):
                self.answer_done(job, h.output_ids, FinishReason.CANCELLED)
            elif h.prompt_only:
                self.prefill_here(job)
            elif h.ticket is None:
                self.recompute(job, "no KV ticket")
            else:
                self.fetches.start(job)
                job.state = JobState.FETCHING
                fetches += 1
        return fetches

    # ---- move: BACKLOG | RUNNING -> handed to a peer (workers/migration.py) -----------------
    def migrate_out(self) -> None:
        """Not accepting (warm stop, switch): hand what is in hand to a peer decode worker,
        the running requests with their KV and tokens so far; a job still fetching moves
        once it runs, one still prefilling (recompute) finishes here."""
        self.migrator.announce()
        target = self.migrator.target()
        if target is None:
            return
        with self.shell.unit() as unit:
            for job in [j for j in self.jobs.values() if j.state is not JobState.FETCHING]:
                h = job.handoff if job.state is JobState.BACKLOG else self.migrator.resume(job.handoff)
                if h is None:
                    continue
                del self.jobs[job.request_id]
                unit.handoff(job.stream, job.entry_id, job.request_id, target, encode_handoff(h))

    # ---- fetched: FETCHING -> RUNNING | recompute ----------------------------------------
    def admit_fetched(self, wait_s: float = 0.0) -> None:
        """Add every finished fetch to the engine (recompute the failed ones); with
        ``wait_s``, wait up to that long for the fetches still running."""
        for job, kv in self.fetches.collect(wait_s, lambda j: self.jobs.get(j.request_id) is j):
            if kv.error:
                log.warning("KV fetch for %s failed (%s): recomputing", job.request_id, kv.error)
                self.recompute(job, kv.error)
                continue
            job.kv, job.admitted_ms, job.state = kv, now_ms(), JobState.RUNNING
            self.fetches.admit(job)

    # ---- a prompt handoff: -> RUNNING ---------------------------------------------------------
    def prefill_here(self, job: Job) -> None:
        """A prompt a prefill worker placed here: the engine prefills it (chunks within the
        TBT budget, beside the decodes) and samples from token 0, as a colocated worker would."""
        h = job.handoff
        t = now_ms()
        job.kv, job.admitted_ms, job.state = FetchOutcome("local", done_ms=t, started_ms=t), t, JobState.RUNNING
        self.engine.add_request(h.request.id, h.prompt_ids, job.params, rank=h.request.rank,
                                deadline_ms=h.request.deadline_at_ms, enqueued_ms=h.request.enqueued_ms)
        self.shell.metrics.prefilled_placed(len(h.prompt_ids))

    # ---- recompute: -> RUNNING | answered ------------------------------------------------------
    def recompute(self, job: Job, why: str) -> None:
        h = job.handoff
        if h.attempt >= self.shell.config.max_attempts:
            del self.jobs[h.request.id]
            with self.shell.unit() as unit:
                unit.error(job.stream, job.entry_id, h.request.id, f"gave up after {h.attempt} attempts: {why}",
                           ErrorCode.INTERNAL, len(h.output_ids), h.request, len(h.prompt_ids))
            return
        job.handoff = replace(h, attempt=h.attempt + 1)
        self.shell.metrics.recomputed("no_ticket" if h.ticket is None else "fetch_failed",
                                      len(h.prompt_ids) + len(h.output_ids))
        t = now_ms()
        job.kv, job.admitted_ms, job.state = FetchOutcome("recompute", done_ms=t, started_ms=t), t, JobState.RUNNING
        self.engine.add_request(h.request.id, h.prompt_ids, job.params, output_ids=h.output_ids,
                                rank=h.request.rank, deadline_ms=h.request.deadline_at_ms)

    # ---- stop, drop -------------------------------------------------------------------------
    def housekeeping(self) -> None:
        """Every ~100 ms: stop cancelled and expired requests, running (blocks freed) or
        waiting in the backlog for room (their leases given back), done published."""
        if not self._check.due():
            return
        held = {job.request_id: job.handoff.request for job in self.jobs.values()
                if job.state in (JobState.RUNNING, JobState.BACKLOG)}
        for rid, reason in self.shell.to_stop(held).items():
            job = self.jobs[rid]
            if job.state is JobState.RUNNING:
                output_ids = self.engine.abort(rid, reason.value).output_ids
            else:
                output_ids = job.handoff.output_ids
            if reason is FinishReason.EXPIRED:
                self.answer_expired(job, output_ids)
            else:
                self.answer_done(job, output_ids, reason)

    def answer_expired(self, job: Job, output_ids) -> None:
        """Past its deadline: a classed prompt handoff with no token out yet (placed here,
        workers/placement.py) gets the error ``deadline_exceeded``, as it would on a
        colocated or prefill worker (``RequestRole.refuse_late``); anything else ends
        ``done``/``expired`` with its tokens so far."""
        h = job.handoff
        if not (h.prompt_only and h.request.service_class is not None and not job.token_times_ms):
            self.answer_done(job, output_ids, FinishReason.EXPIRED)
            return
        del self.jobs[job.request_id]
        t = now_ms()
        with self.shell.unit() as unit:
            unit.deadline_exceeded(job.stream, job.entry_id, h.request, t, f"placed on worker {self.shell.worker_id}")

    def drop(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            job = self.jobs.pop(rid)
            if job.state is JobState.RUNNING:
                self.engine.abort(rid)
            # FETCHING: the blocks go back once the fetch thread is done with them (admit_fetched)

    def answer_done(self, job: Job, output_ids, reason: FinishReason) -> None:
        """A request stopped before its end: done published, the handoff finished. One
        that never fetched gives its ticket's lease back, so the prefill worker frees those
        blocks now rather than when the lease expires."""
        del self.jobs[job.request_id]
        if job.state is JobState.BACKLOG and job.handoff.ticket is not None:
            self.fetches.release(job.handoff.ticket)
        c = job_completion(job, output_ids, now_ms(), self.shell.loaded.tokenizer.decode(output_ids), reason,
                           self.shell.worker_id, self.engine.config.block_size)
        with self.shell.unit() as unit:
            unit.done(job.stream, job.entry_id, c, job.handoff.request)

    # ---- finish: tokens out, RUNNING -> answered ---------------------------------------------
    def publish(self, outputs) -> None:
        publish_outputs(self, outputs)

    def drain(self) -> None:
        if self.migrator is not None:
            self.migrator.drain()

    def close(self) -> None:
        if self.migrator is not None:
            self.migrator.close()
        self.holds.close()
        self.fetches.close()


# ---- what the role computes from its state, kept out of the class --------------------------

def decode_load(role: DecodeRole) -> dict:
    """What a decode worker's heartbeat says of its load."""
    return {"running": role.engine.num_running, "waiting": role.engine.num_waiting,
            "fetching": role.fetches.in_flight, "backlog": len(role.in_state(JobState.BACKLOG)),
            # held blocks are given back on demand (workers/kv_holds.py)
            "kv_free": role.engine.block_manager.num_free_blocks + role.holds.reclaimable(),
            "kv_total": role.engine.layout.num_blocks, **role.holds.load(),
            "step_ms": round(role._step_s * 1000, 2), "auth_failures": role.fetches.receiver.auth_failures,
            "prefix_cache_queries": role.engine.prefix_cache_queries,
            "prefix_cache_hits": role.engine.prefix_cache_hits,
            "draining": int(role.migrator is not None and role.migrator.announced_at is not None),
            "migrated_out": role.migrator.moved if role.migrator is not None else 0,
            "rerouted": role.rerouter.rerouted,   # handoffs of another kind passed on (workers/compat.py)
            # what a prefill worker decides by whether to hand a request over or decode it
            # itself (workers/decode_peers.py), and where to place prompts
            "free_slots": max(0, role.engine.config.max_num_seqs - len(role.jobs)),
            **(prompt_load(role.engine, role.spare, role.recent_steps, placed_waiting(role),
                           role.shell.config.engine.tbt_slo_ms) if role.takes_prompts else {})}


def publish_outputs(role: DecodeRole, outputs) -> None:
    """A step's tokens out, in one unit: each token, and a finished request's done (its KV
    then held for the next turn's puller: workers/kv_holds.py)."""
    t = now_ms()
    with role.shell.unit() as unit:
        for out in outputs:
            job = role.jobs[out.request_id]
            # The gap to the previous token: decode's first one starts at prefill's token 0
            # (unknown when the request resumed after tokens published elsewhere).
            if job.token_times_ms:
                role.shell.metrics.token_gap(t - job.token_times_ms[-1])
            elif out.index == 0:   # a prompt handoff's first token
                role.shell.metrics.first_token(t - job.handoff.request.enqueued_ms, len(job.handoff.prompt_ids))
            elif out.index == 1 and job.handoff.first_token_ms:
                role.shell.metrics.token_gap(t - job.handoff.first_token_ms)
            job.token_times_ms.append(t)
            unit.token(out.request_id, out.index, out.token_id, out.text)
            if out.finished:
                del role.jobs[out.request_id]
                role.holds.hold(unit, out.seq)
                c = job_completion(job, out.seq.output_ids, t, out.full_text or "", out.finish_reason,
                                   role.shell.worker_id, role.engine.config.block_size)
                unit.done(job.stream, job.entry_id, c, job.handoff.request)


def placed_waiting(role: DecodeRole) -> int:
    """The prompt tokens of prompts placed here that wait in the backlog (not yet in the engine)."""
    return sum(len(j.handoff.prompt_ids) for j in role.in_state(JobState.BACKLOG) if j.handoff.prompt_only)


def backlog_blocks(role: DecodeRole) -> int:
    """The blocks the handoffs waiting in the backlog need to start."""
    bm = role.engine.block_manager
    return sum(bm.blocks_for(len(j.handoff.prompt_ids) + len(j.handoff.output_ids) + 1)
               for j in role.in_state(JobState.BACKLOG))


def admit_grace_s(step_s: float) -> float:
    """How long the running batch may wait at a step boundary for fetches just started:
    a quarter of a recent step, between 2 and 25 ms (a new sequence that misses this
    step waits a whole step more, while the batch pays this once)."""
    return min(0.025, max(0.002, 0.25 * step_s))


def job_completion(job: Job, output_ids, t: float, text: str, reason, worker_id: str, block_size: int) -> Completion:
    """The completion of a job answered at ``t`` (ms): prefilled here (a placed prompt) or handed over."""
    h = job.handoff
    req = h.request
    if h.prompt_only:   # prefilled here: its times are this worker's (job.read_ms: placed -> read)
        first = job.token_times_ms[0] if job.token_times_ms else t
        p50, pmax = tbt_stats(job.token_times_ms)
        return Completion(
            req.id, text, tuple(output_ids), reason, num_prompt_tokens=len(h.prompt_ids),
            ttft_ms=first - req.enqueued_ms if job.token_times_ms else 0.0,
            queue_ms=job.admitted_ms - req.enqueued_ms, prefill_ms=first - job.admitted_ms,
            decode_ms=t - first, tbt_p50_ms=p50, tbt_max_ms=pmax, e2e_ms=t - req.enqueued_ms,
            prefill_worker=worker_id, decode_worker=worker_id, transfer_path="local",
            handoff_ms=job.read_ms - h.prefill_start_ms)
    p50, pmax = tbt_stats([h.first_token_ms] + job.token_times_ms)
    second = job.token_times_ms[0] if job.token_times_ms else 0.0
    return Completion(
        req.id, text, tuple(output_ids), reason,
        num_prompt_tokens=len(h.prompt_ids), cached_tokens=h.cached_tokens,
        ttft_ms=h.first_token_ms - req.enqueued_ms,
        queue_ms=h.prefill_start_ms - req.enqueued_ms, prefill_ms=h.prefill_end_ms - h.prefill_start_ms,
        transfer_ms=job.kv.seconds * 1e3, transfer_bytes=job.kv.nbytes,
        kv_reused_tokens=job.kv.reused_blocks * block_size,
        recomputed_tokens=len(h.prompt_ids) + len(h.output_ids) if job.kv.path == "recompute" else 0,
        decode_ms=t - job.admitted_ms, tbt_p50_ms=p50, tbt_max_ms=pmax, e2e_ms=t - req.enqueued_ms,
        prefill_worker=h.prefill_worker, decode_worker=worker_id, transfer_path=job.kv.path,
        handoff_ms=(job.kv.started_ms or job.read_ms) - h.first_token_ms,
        first_step_ms=second - job.kv.done_ms if second else 0.0,
        ttst_ms=second - req.enqueued_ms if second else 0.0)
