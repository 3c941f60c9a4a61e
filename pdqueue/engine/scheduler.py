"""Continuous batching: which sequences run in the next step, and how many tokens each.

A step is a list of ``(sequence, num_new_tokens)``. Two policies:

- ``prefill_first``: admit waiting prompts whole (up to the token budget) and run them as a
  prefill step; only when none can be admitted run one decode token for every running
  sequence. This is the classic colocated server, whose decodes stall behind each prefill.
- ``chunked``: every step decodes all running sequences first, then spends what is left of
  the token budget on prompt chunks (Sarathi-style), so a long prompt never stalls decodes
  by more than one budget's worth of compute.

**The TBT budget** (``tbt_slo_ms``, chunked only). A running request meets its TBT target when
the ``tbt_percentile``-th percentile of its gaps is within it, so a few of its gaps may be
slow: with n gaps, ``n - 1 - ceil(p (n - 1) / 100)`` of them (``slow_gaps_allowed``; 2 of 30
at p90, none of 8). While every decode in the step can still afford one slow gap, prompt
chunks take what fits in ``SLOW_STEP_TARGETS`` targets (TTFT first, but no gap of seconds
behind a whole token budget of prompt); otherwise they take only what fits beside
the decodes within the target, as predicted by ``StepCostModel`` from this engine's own
steps (at least ``MIN_CHUNK`` tokens, so prompts always progress; exactly that while the
model has not learned the cost of a prompt token). A request's allowance is
counted on the gaps it will have: ``max_tokens - 1`` with ``ignore_eos``, else the gaps it
already has (it may stop at any token). A step that runs past the target counts one slow gap
for each of its decodes, and so does a gap since a decode's previous token (the time between
steps included) past the whole target.

When the pool runs out of blocks the newest running sequence is preempted by recompute: its
blocks are freed and it goes back to the front of the waiting queue with its generated
tokens, to be prefilled again (from its own blocks, if the prefix cache still has them).

**Background sequences** (the batch service class, ``Sequence.background``) take only what
the others leave, and give it back at the next step:

- slots: at most ``EngineConfig.background_seqs`` of them run at once (3/4 of the slots by
  default), so an online request always finds one; a foreground prompt waits ahead of every
  background one;
- prompt tokens: at most ``BACKGROUND_PROMPT_TOKENS`` of a step's while no foreground
  sequence runs or waits (a step of batch prompts is short, so an online request that
  arrives during it waits little); beside foreground sequences, at most
  ``BACKGROUND_PROMPT_TOKENS_BESIDE``, and only in steps that compute foreground prompt
  tokens anyway: any prompt token in a step of decodes makes it a mixed step, which gathers
  every row's K/V (decode_kv.py);
- decode rows: while foreground sequences run or wait, ``BACKGROUND_ROWS`` background
  decodes a step, in turn, or with a TBT target as many as keep the step within
  ``BACKGROUND_STEP_SHARE`` of it (the step cost model's estimate); while foreground
  prompt tokens wait to be computed, none,
  except every ``BACKGROUND_EVERY``-th step, so they never starve. A paused decode keeps its
  KV: nothing is recomputed;
- preemption: the newest background sequence goes before any foreground one.

**The waiting order** (``waiting_key``): foreground before background; with a TTFT target
(``ttft_slo_ms``), prompts that can still make it before those that cannot (``mark_late``,
each step: due time against now plus the prompt's cost by the step cost model; under overload
serving the lost ones first only loses the next ones too); a preempted sequence before new
ones; then the service class's rank (``Sequence.rank``: interactive before
standard); then the deadline (``Sequence.deadline_ms``), the earliest first, those without
one last; then arrival. Admission takes the head of the queue while it fits, so prompts
start in that order (their tokens are the same in any order: per-row batch invariance).

Admission asks the block manager how much of a waiting sequence's prefix is cached: only
the rest counts against the token budget and is computed.

Imports config, sequence, block_manager.
"""

from __future__ import annotations

from collections import deque

from pdqueue.engine.block_manager import BlockManager
from pdqueue.engine.config import EngineConfig, PrefillPolicy
from pdqueue.engine.sequence import Sequence, SequenceStatus
from pdqueue.engine.step_cost import StepCostModel

ScheduledBatch = list[tuple[Sequence, int]]

MIN_CHUNK = 16        # prompt tokens a step takes at least, whatever the TBT budget leaves
STEP_SHARE = 0.85     # of a TBT target, what the step may take (publishing and intake take the rest)
# A step that spends a slow gap ends within this many TBT targets. Measured (docs/performance.md,
# sessions 15-16): a decode worker taking placed prompts did best with 64-token chunks under a
# 60 ms target and 256 under 250 ms, steps of ~1.2-1.5 targets either way; a fixed chunk is
# right for one target only.
SLOW_STEP_TARGETS = 1.5
COLD_CHUNK = 64       # prompt tokens of a slow-gap step before the cost model is ready
BACKGROUND_EVERY = 4  # paused background decodes still run every this many steps (their bounded share)
# What background work may add to a step. Measured on SmolLM2 int4, one thread: a decode row
# costs ~7 ms and a prompt token ~2 ms beside a ~31 ms step of one decode, so beside online
# decodes background gets one row a step and a few prompt tokens in the steps that prefill
# online prompts; alone, steps of at most ~150-200 ms (an online request then waits half that).
BACKGROUND_ROWS = 1   # background decodes per step beside foreground sequences, at least
# ... and as many more as keep the step within this share of the TBT target (``tbt_slo_ms``,
# by the step cost model): with the q4_1 kernels a decode row costs ~2.5 ms beside a ~14 ms
# step of one decode (docs/performance.md, session 13), so one row a step left most of the
# capacity the online decodes leave unused (batch got 0.29-0.38 of it, session 12).
BACKGROUND_STEP_SHARE = 0.5
BACKGROUND_PROMPT_TOKENS = 64   # background prompt tokens per step, nothing else running
BACKGROUND_PROMPT_TOKENS_BESIDE = 16   # ... beside foreground sequences (in steps with foreground prompt tokens)


def slow_gaps_allowed(num_gaps: int, percentile: int) -> int:
    """How many of ``num_gaps`` gaps may exceed a target while their ``percentile``-th
    percentile (linear interpolation, as pdqueue.bench.stats) stays within it."""
    if num_gaps <= 1:
        return 0
    return num_gaps - 1 - (-(-percentile * (num_gaps - 1) // 100))


def slow_gaps_left(seq: Sequence, percentile: int) -> int:
    p = seq.params
    num_gaps = p.max_tokens - 1 if p.ignore_eos else seq.num_output_tokens
    return slow_gaps_allowed(num_gaps, percentile) - seq.slow_gaps


def waiting_key(seq: Sequence) -> tuple:
    """Where a sequence waits (smallest first): foreground before background; then those
    that can still make their TTFT target before those that cannot (``late``); a preempted
    one (it has started: its tokens are out) before new ones; then the service class's rank;
    then the deadline, earliest first, those without one last; then arrival."""
    return (seq.background, seq.late, seq.num_preemptions == 0, seq.rank,
            seq.deadline_ms is None, seq.deadline_ms or 0.0, seq.arrival)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.policy = config.policy
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.tbt_step_s = None if config.tbt_slo_ms is None else config.tbt_slo_ms / 1000 * STEP_SHARE
        self.tbt_percentile = config.tbt_percentile
        self.cost = StepCostModel()
        self.num_budgeted_steps = 0   # steps whose prompt chunks the TBT budget cut
        self.num_paused_steps = 0     # steps in a row that paused the background decodes
        self.max_background = config.background_seqs
        self._background_turn = 0     # which background decodes run beside foreground ones (in turn)
        self._background_tokens = 0   # background prompt tokens left in the step being scheduled
        self._arrivals = 0            # sequences queued so far (their arrival order)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence in the waiting order (``waiting_key``): behind every one that
        comes first, ahead of the rest."""
        seq.status = SequenceStatus.WAITING
        self._arrivals += 1
        seq.arrival = self._arrivals
        key = waiting_key(seq)
        for i, other in enumerate(self.waiting):
            if waiting_key(other) > key:
                self.waiting.insert(i, seq)
                return
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose blocks are allocated and whose KV is already in place (imported)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Forget ``seq`` (finished, aborted or handed off); its blocks are the caller's."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    @property
    def num_background(self) -> int:
        """Background sequences holding a slot (running, preempted ones not counted)."""
        return sum(s.background for s in self.running)

    @property
    def num_waiting_foreground(self) -> int:
        return sum(not s.background for s in self.waiting)

    @property
    def num_waiting_on_time(self) -> int:
        """Foreground sequences waiting that can still make their TTFT target (all of them
        without one)."""
        return sum(not s.background and not s.late for s in self.waiting)

    def mark_late(self, now_ms: float) -> None:
        """Waiting prompts whose first token can no longer come by its due time (now, plus
        what computing the prompt costs by the step cost model) move behind those that still
        can: under overload, serving the ones already lost first only loses the next ones
        too. Their order among themselves stays."""
        changed = False
        for seq in self.waiting:
            if seq.late or seq.ttft_due_ms is None or seq.background or seq.num_output_tokens:
                continue   # (a preempted sequence's first token is out: it keeps its place)
            cost_ms = 1000 * self.cost.predict(0, seq.num_uncomputed_tokens) if self.cost.ready else 0.0
            if now_ms + cost_ms > seq.ttft_due_ms:
                seq.late = changed = True
        if changed:
            self.waiting = deque(sorted(self.waiting, key=waiting_key))

    def num_waiting_rank(self, rank: int) -> int:
        """Waiting sequences of service-class rank ``rank`` (0: interactive)."""
        return sum(s.rank == rank for s in self.waiting)

    def can_run_background(self) -> bool:
        """Whether one more background sequence may take a slot now."""
        return self.num_background < self.max_background

    def schedule(self, now_ms: float | None = None) -> ScheduledBatch:
        """The next step; ``now_ms`` (epoch ms): the clock for TTFT targets (``mark_late``)."""
        if now_ms is not None:
            self.mark_late(now_ms)
        alone = not any(not s.background for s in self.running) and not any(not s.background for s in self.waiting)
        self._background_tokens = BACKGROUND_PROMPT_TOKENS if alone else 0
        if self.policy == PrefillPolicy.PREFILL_FIRST:
            batch = self._admit(self.max_num_batched_tokens, whole_prompts=True)
            if batch and not alone and self.waiting and self.waiting[0].background:
                # a prefill step anyway: background prompts may ride along
                self._background_tokens = BACKGROUND_PROMPT_TOKENS_BESIDE
                batch += self._admit(self.max_num_batched_tokens - sum(n for _, n in batch), whole_prompts=True)
            return batch or self._decode_all()
        batch = self._decode_all()
        budget = self._continue_prompts(batch, self._prompt_budget(batch))
        admitted = self._admit(budget, whole_prompts=False)
        batch += admitted
        budget -= sum(n for _, n in admitted)
        if not alone and budget > 0 and any(not s.background and n > 1 for s, n in batch):
            # Foreground prompt tokens make this a mixed step anyway (no DecodeKV copies, see
            # decode_kv.py): background prompts may ride along. In a pure decode step they
            # would not: that step would gather every row's K/V instead (measured: 16 batch
            # prompt tokens took a step of 5 chat decodes from ~60 to ~140 ms).
            self._background_tokens = BACKGROUND_PROMPT_TOKENS_BESIDE
            stepping = {id(s) for s, _ in batch}
            extra: ScheduledBatch = []
            budget = self._continue_prompts(extra, budget, only=[s for s in self.running if id(s) not in stepping])
            batch += extra + self._admit(budget, whole_prompts=False)
        return batch

    def _continue_prompts(self, batch: ScheduledBatch, budget: int, only=None) -> int:
        """Continue prompts already being prefilled in chunks (of ``only``, else every
        running sequence); returns the budget left."""
        for seq in self.running if only is None else only:
            if budget <= 0:
                break
            if seq.num_uncomputed_tokens > 1:
                num_new = min(seq.num_uncomputed_tokens, budget)
                if seq.background:
                    num_new = min(num_new, self._background_tokens)
                    if num_new <= 0:
                        continue
                    self._background_tokens -= num_new
                batch.append((seq, num_new))
                budget -= num_new
        return budget

    @property
    def tbt_target_s(self) -> float | None:
        """The whole TBT target (a step may take ``STEP_SHARE`` of it: ``tbt_step_s``)."""
        return None if self.tbt_step_s is None else self.tbt_step_s / STEP_SHARE

    def _prompt_budget(self, decodes: ScheduledBatch) -> int:
        """Prompt tokens this step may take beside ``decodes`` (see the TBT budget above)."""
        full = self.max_num_batched_tokens - len(decodes)
        if self.tbt_step_s is None or not decodes or not self.waiting and not any(
                s.num_uncomputed_tokens > 1 for s in self.running):
            return full
        if all(slow_gaps_left(seq, self.tbt_percentile) > 0 for seq, _ in decodes):
            # A slow gap to spend: prompts take more, but the step stays within
            # SLOW_STEP_TARGETS targets (a gap of 2 s behind a 2048-token chunk is one no
            # stream should see); before the cost is learned, COLD_CHUNK.
            fit = self.cost.prefill_tokens_within(self.tbt_target_s * SLOW_STEP_TARGETS, len(decodes))
            return min(full, COLD_CHUNK if fit is None else max(MIN_CHUNK, fit))
        fit = self.cost.prefill_tokens_within(self.tbt_step_s, len(decodes))
        if fit is not None and fit >= full:   # the whole budget fits
            return full
        # Not learned yet (or no positive per-token cost seen): the smallest chunk, whose
        # step teaches the model what a prompt token costs here.
        self.num_budgeted_steps += 1
        return MIN_CHUNK if fit is None else max(MIN_CHUNK, fit)

    def observe_step(self, batch: ScheduledBatch, seconds: float, ended_s: float | None = None) -> None:
        """After a step ran: its cost feeds the model; past the target, its decodes each
        had one slow gap. ``ended_s`` (perf_counter at the step's end): a decode whose gap
        since its previous token here, the time between the steps included (publishing,
        intake, waits for fetches), was past the whole target had one too, though the step
        alone was within its share (measured: p90 gaps of 253-258 ms at a 250 ms target
        when only the steps were counted)."""
        # (called after the step: a decode row's one token was an output token)
        decodes = [seq for seq, n in batch if n == 1 and seq.num_cached_tokens > seq.num_prompt_tokens]
        self.cost.observe(len(decodes), sum(n for _, n in batch) - len(decodes), seconds)
        if self.tbt_step_s is None:
            return
        for seq in decodes:
            gap_s = ended_s - seq.last_token_s if ended_s is not None and seq.last_token_s is not None else 0.0
            if seconds > self.tbt_step_s or gap_s > self.tbt_target_s:
                seq.slow_gaps += 1

    def _admit(self, budget: int, whole_prompts: bool) -> ScheduledBatch:
        batch: ScheduledBatch = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # A waiting sequence holds no blocks; a prefix cache hit is not computed again.
            num_new = seq.num_uncomputed_tokens - self.block_manager.num_hit_tokens(seq)
            if whole_prompts and batch and num_new > budget:
                break  # the first prompt may exceed the budget; later ones wait
            # Background prompts queue behind every foreground one, so from here on the
            # queue is background: each takes a slot of its own and BACKGROUND_PROMPT_TOKENS.
            if seq.background and (not self.can_run_background() or self._background_tokens <= 0
                                   or whole_prompts and batch and num_new > self._background_tokens):
                break
            if not self.block_manager.can_allocate(seq):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            assert seq.num_uncomputed_tokens == num_new
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if not whole_prompts:
                num_new = min(num_new, budget)
            if seq.background:
                if not whole_prompts:
                    num_new = min(num_new, self._background_tokens)
                self._background_tokens -= num_new
            batch.append((seq, num_new))
            budget -= num_new
        return batch

    def paused(self, batch: ScheduledBatch) -> tuple[Sequence, ...]:
        """Background decodes that sit this step out (running, between two decode steps)."""
        if not any(s.background for s in self.running):
            return ()
        stepping = {id(s) for s, _ in batch}
        return tuple(s for s in self.running if s.background and s.status == SequenceStatus.RUNNING
                     and s.num_uncomputed_tokens == 1 and id(s) not in stepping)

    def _background_rows(self) -> int | None:
        """How many background decodes this step takes: 0 while foreground prompt tokens
        wait to be computed (but every ``BACKGROUND_EVERY``-th step), ``BACKGROUND_ROWS``
        while foreground sequences run or wait, else all (None)."""
        if not any(s.background for s in self.running):
            return None
        foreground_waiting = any(not s.background for s in self.waiting)
        prompt_pending = foreground_waiting or any(
            not s.background and s.num_uncomputed_tokens > 1 for s in self.running)
        if prompt_pending and self.num_paused_steps < BACKGROUND_EVERY - 1:
            self.num_paused_steps += 1
            return 0
        self.num_paused_steps = 0
        if foreground_waiting or any(not s.background for s in self.running):
            return max(BACKGROUND_ROWS, self._rows_within_budget())
        return None

    def _rows_within_budget(self) -> int:
        """Background decodes that a step of the foreground decodes can add and still end
        within ``BACKGROUND_STEP_SHARE`` of the TBT target (0 without a target or a fitted
        cost model)."""
        if self.tbt_step_s is None or not self.cost.ready:
            return 0
        a, b, _ = self.cost.theta
        if b <= 0:
            return 0
        foreground = sum(1 for s in self.running if not s.background and s.num_uncomputed_tokens == 1)
        budget = self.tbt_target_s * BACKGROUND_STEP_SHARE
        return max(0, int((budget - max(a, 0.0)) / b) - foreground)

    def _victim(self) -> Sequence:
        """The sequence to preempt: the newest background one, else the newest."""
        return self._newest_background() or self.running[-1]

    def _newest_background(self) -> Sequence | None:
        return next((s for s in reversed(self.running) if s.background), None)

    def _decode_all(self) -> ScheduledBatch:
        batch: ScheduledBatch = []
        rows = self._background_rows()
        chosen = None
        if rows is not None:   # which background decodes run: ``rows`` of them, in turn
            ready = [s for s in self.running if s.background and s.num_uncomputed_tokens == 1]
            if ready:
                start = self._background_turn % len(ready)
                chosen = {id(s) for s in (ready[start:] + ready[:start])[:rows]}
                self._background_turn = start + rows
        for seq in list(self.running):
            if seq.status != SequenceStatus.RUNNING or seq.num_uncomputed_tokens != 1:
                continue  # preempted below, or still prefilling in chunks
            if seq.background and chosen is not None and id(seq) not in chosen:
                continue  # paused: its KV stays, it decodes in a later step
            while not self.block_manager.can_append(seq):
                victim = self._victim()
                self._preempt(victim)
                # (a background victim may already be in this step: it leaves it)
                batch = [(s, n) for s, n in batch if s is not victim]
                if victim is seq:
                    break
            else:
                self.block_manager.append(seq)
                batch.append((seq, 1))
        return batch

    def preempt_background(self) -> bool:
        """Preempt the newest running background sequence (by recompute, as when blocks run
        out), for foreground work that needs its slot or blocks; False when none runs."""
        victim = self._newest_background()
        if victim is None:
            return False
        self._preempt(victim)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if seq.background:   # first of the background ones, still behind every foreground prompt
            i = next((i for i, other in enumerate(self.waiting) if other.background), len(self.waiting))
            self.waiting.insert(i, seq)
        else:
            self.waiting.appendleft(seq)
