"""The scheduler's policies: scheduler.py keeps the queues and asks these objects, as
mini-sglang's scheduler asks its ``PrefillAdder``.

- ``waiting_key``: the waiting order (class, lateness, preemption, rank, deadline, arrival);
- ``TbtBudget``: the TBT target (``EngineConfig.tbt_slo_ms``; ``LLMEngine.set_tbt_target``
  changes it), its one conversion to seconds, and the prompt tokens it allows beside decodes;
- ``ClassShare``: what the sequences of the service classes that yield (background: the
  batch class) may take: slots, prompt tokens, decode rows; which is preempted first, where a
  preempted one waits again. Keyed by the class's rank (``Sequence.rank``): the ranks that
  yield come from the protocol's class table (``pdqueue.protocol.YIELDING_RANKS``);
- ``TtftLateness``: which waiting prompts can no longer make their TTFT target;
- ``PrefillFirst``, ``Chunked`` (``PREFILL_POLICIES``, by ``EngineConfig.policy``): the
  prefill policies, which compose a step of the scheduler's operations (``admit``,
  ``decode_all``) and these objects' decisions.

Each is state plus decisions; none holds a queue. The step cost model (step_cost.py) is the
scheduler's, shared with them.

Imports config, sequence, step_cost and pdqueue.protocol (the class table).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdqueue.engine.config import PrefillPolicy
from pdqueue.engine.sequence import Sequence, SequenceStatus
from pdqueue.engine.step_cost import StepCostModel
from pdqueue.protocol import YIELDING_RANKS

if TYPE_CHECKING:
    from pdqueue.engine.scheduler import ScheduledBatch, Scheduler

MIN_CHUNK = 16        # prompt tokens a step takes at least, whatever the TBT budget leaves
STEP_SHARE = 0.85     # of a TBT target, what the step may take (publishing and intake take the rest)
# A step that spends a slow gap ends within this many TBT targets: a decode worker taking
# placed prompts did best with 64-token chunks under a 60 ms target and 256 under 250 ms,
# steps of ~1.2-1.5 targets either way; a fixed chunk is right for one target only.
SLOW_STEP_TARGETS = 1.5
COLD_CHUNK = 64       # prompt tokens of a slow-gap step before the cost model is ready
BACKGROUND_EVERY = 4  # paused background decodes still run every this many steps (their bounded share)
# What background work may add to a step. On a CPU a decode row costs a fraction of a step
# of one decode and a prompt token less, so beside online decodes background gets one row a
# step and a few prompt tokens in the steps that prefill online prompts; alone, short steps
# (an online request arriving during one waits half of it).
BACKGROUND_ROWS = 1   # background decodes per step beside foreground sequences, at least
# ... and as many more as keep the step within this share of the TBT target (by the step
# cost model): one row a step alone left most of the capacity the online decodes leave unused.
BACKGROUND_STEP_SHARE = 0.5
BACKGROUND_PROMPT_TOKENS = 64   # background prompt tokens per step, nothing else running
BACKGROUND_PROMPT_TOKENS_BESIDE = 16   # ... beside foreground sequences (in steps with foreground prompt tokens)


def waiting_key(seq: Sequence, background: bool) -> tuple:
    """Where a sequence waits (smallest first): foreground before ``background`` (its class
    yields, ``ClassShare.yields``); those that can still make their TTFT target before those
    that cannot (``late``: under overload, serving the lost ones first only loses the next ones
    too); a preempted one (its tokens are out) before new ones; then the service class's rank
    (``Sequence.rank``: interactive first); then the deadline, earliest first, those without
    one last; then arrival. Admission takes the head of the queue while it fits (the tokens are
    the same in any order: per-row batch invariance)."""
    return (background, seq.late, seq.num_preemptions == 0, seq.rank,
            seq.deadline_ms is None, seq.deadline_ms or 0.0, seq.arrival)


def slow_gaps_allowed(num_gaps: int, percentile: int) -> int:
    """How many of ``num_gaps`` gaps may exceed a target while their ``percentile``-th
    percentile (linear interpolation, as pdqueue.bench.stats) stays within it."""
    if num_gaps <= 1:
        return 0
    return num_gaps - 1 - (-(-percentile * (num_gaps - 1) // 100))


def slow_gaps_left(seq: Sequence, percentile: int) -> int:
    """A request's allowance, counted on the gaps it will have: ``max_tokens - 1`` with
    ``ignore_eos``, else the gaps it already has (it may stop at any token)."""
    p = seq.params
    num_gaps = p.max_tokens - 1 if p.ignore_eos else seq.num_output_tokens
    return slow_gaps_allowed(num_gaps, percentile) - seq.slow_gaps


class TbtBudget:
    """The TBT target (chunked policy only). A running request meets it when the
    ``percentile``-th percentile of its gaps is within it, so a few of its gaps may be slow:
    with n gaps, ``n - 1 - ceil(p (n - 1) / 100)`` of them (``slow_gaps_allowed``; 2 of 30 at
    p90, none of 8). While every decode in the step can still afford one slow gap, prompt
    chunks take what fits in ``SLOW_STEP_TARGETS`` targets (TTFT first, but no gap of seconds
    behind a whole token budget of prompt); otherwise they take only what fits beside the
    decodes within ``STEP_SHARE`` of the target, as predicted by the step cost model from this
    engine's own steps (at least ``MIN_CHUNK`` tokens, so prompts always progress; exactly that
    while the model has not learned the cost of a prompt token). A step that runs past its
    share counts one slow gap for each of its decodes, and so does a gap since a decode's
    previous token (the time between steps included) past the whole target.

    ``target_ms`` is the one name of the target; ``target_s`` and ``step_s`` (the step's
    share) derive from it in ``set``; None: no target (chunks fill the token budget)."""

    def __init__(self, target_ms: float | None, percentile: int, cost: StepCostModel):
        self.percentile = percentile
        self.cost = cost
        self.num_budgeted_steps = 0   # steps whose prompt chunks the budget cut
        self.set(target_ms)

    def set(self, target_ms: float | None) -> None:
        if target_ms is not None and not target_ms > 0:
            raise ValueError(f"a TBT target must be > 0 ms, got {target_ms}")
        self.target_ms = target_ms
        self.target_s = None if target_ms is None else target_ms / 1000
        self.step_s = None if target_ms is None else self.target_s * STEP_SHARE

    def budget(self, decodes: list[Sequence], full: int, prompts_pending: bool) -> int:
        """Prompt tokens a step of ``decodes`` may take (``full``: what the token budget
        leaves): all of it without a target, decodes or prompts to compute, else
        ``prompt_tokens``."""
        if self.step_s is None or not decodes or not prompts_pending:
            return full
        return self.prompt_tokens(decodes, full)

    def prompt_tokens(self, decodes: list[Sequence], full: int) -> int:
        """Prompt tokens a step of ``decodes`` may take while prompts wait to be computed
        (``full``: what the token budget leaves; with a target only)."""
        if all(slow_gaps_left(seq, self.percentile) > 0 for seq in decodes):
            # A slow gap to spend: prompts take more, but the step stays within
            # SLOW_STEP_TARGETS targets; before the cost is learned, COLD_CHUNK.
            fit = self.cost.prefill_tokens_within(self.target_s * SLOW_STEP_TARGETS, len(decodes))
            return min(full, COLD_CHUNK if fit is None else max(MIN_CHUNK, fit))
        fit = self.cost.prefill_tokens_within(self.step_s, len(decodes))
        if fit is not None and fit >= full:   # the whole budget fits
            return full
        # Not learned yet (or no positive per-token cost seen): the smallest chunk, whose
        # step teaches the model what a prompt token costs here.
        self.num_budgeted_steps += 1
        return MIN_CHUNK if fit is None else max(MIN_CHUNK, fit)

    def observe(self, decodes: list[Sequence], seconds: float, ended_s: float | None) -> None:
        """After a step of ``seconds`` that ended at ``ended_s`` (perf_counter; None: unknown):
        its ``decodes`` each count a slow gap if the step ran past its share or the gap since
        the decode's previous token (the time between the steps included: publishing, intake,
        waits for fetches) ran past the whole target."""
        if self.step_s is None:
            return
        for seq in decodes:
            gap_s = ended_s - seq.last_token_s if ended_s is not None and seq.last_token_s is not None else 0.0
            if seconds > self.step_s or gap_s > self.target_s:
                seq.slow_gaps += 1

    def rows_within(self, share: float, num_rows: int) -> int:
        """Decode rows a step of ``num_rows`` rows can add and still end within ``share`` of the
        target (0 without a target or a fitted cost model)."""
        if self.target_s is None or not self.cost.ready:
            return 0
        a, b, _ = self.cost.theta
        if b <= 0:
            return 0
        return max(0, int((self.target_s * share - max(a, 0.0)) / b) - num_rows)


class ClassShare:
    """What background sequences (those of a class that yields: the batch class) take: only
    what the others leave, given back at the next step.

    - slots: at most ``max_seqs`` (``EngineConfig.background_seqs``, 3/4 of the slots by
      default) run at once, so an online request always finds one; a foreground prompt waits
      ahead of every background one (``waiting_key``);
    - prompt tokens: at most ``BACKGROUND_PROMPT_TOKENS`` of a step's while no foreground
      sequence runs or waits (a step of batch prompts is short, so an online request that
      arrives during it waits little); beside foreground sequences, at most
      ``BACKGROUND_PROMPT_TOKENS_BESIDE``, and only in steps that compute foreground prompt
      tokens anyway: any prompt token in a step of decodes makes it a mixed step, which
      gathers every row's K/V (decode_kv.py);
    - decode rows: while foreground sequences run or wait, ``BACKGROUND_ROWS`` background
      decodes a step, in turn, or with a TBT target as many as keep the step within
      ``BACKGROUND_STEP_SHARE`` of it; while foreground prompt tokens wait to be computed,
      none, except every ``BACKGROUND_EVERY``-th step, so they never starve. A paused decode
      keeps its KV: nothing is recomputed;
    - preemption: the newest background sequence goes before any foreground one, and waits
      again first of the background ones, behind every foreground prompt.

    Which sequences yield is their class's rank (``Sequence.rank``) in ``yielding`` (the
    protocol's ``YIELDING_RANKS``): a request's class, wherever the engine is told of it
    (``add_request``, and ``reserve`` for imported KV), is all the engine knows of it."""

    def __init__(self, max_seqs: int, tbt: TbtBudget, yielding: frozenset[int] = YIELDING_RANKS):
        self.max_seqs = max_seqs
        self.tbt = tbt
        self.yielding = yielding
        self.alone = False          # no foreground sequence runs or waits in the step being scheduled
        self.num_paused_steps = 0   # steps in a row that paused the background decodes
        self.tokens = 0             # background prompt tokens left in the step being scheduled
        self._turn = 0              # which background decodes run beside foreground ones (in turn)

    def yields(self, seq: Sequence) -> bool:
        """Whether ``seq`` is background: its class's rank is one that yields."""
        return seq.rank in self.yielding

    def begin_step(self, running, waiting) -> None:
        """A step is being scheduled over ``running`` and ``waiting``."""
        yields = self.yields
        self.alone = not any(not yields(s) for s in running) and not any(not yields(s) for s in waiting)
        self.tokens = BACKGROUND_PROMPT_TOKENS if self.alone else 0

    def ride_along(self, batch, waiting, whole_prompts: bool) -> bool:
        """Whether background prompts may join the step ``batch`` beside foreground work (then
        with ``BACKGROUND_PROMPT_TOKENS_BESIDE``): a step of whole prompts (prefill_first) whose
        next waiting prompt is background; a chunked step that computes foreground prompt
        tokens anyway. Not in a pure decode step: that step would gather every row's K/V."""
        if self.alone:
            return False
        if whole_prompts:
            ok = bool(batch) and bool(waiting) and self.yields(waiting[0])
        else:
            ok = any(not self.yields(s) and n > 1 for s, n in batch)
        if ok:
            self.tokens = BACKGROUND_PROMPT_TOKENS_BESIDE
        return ok

    def can_run(self, running) -> bool:
        """Whether one more background sequence may take a slot beside ``running``."""
        return sum(self.yields(s) for s in running) < self.max_seqs

    def chunk(self, seq: Sequence, num_new: int) -> int:
        """Of ``num_new`` tokens of ``seq``'s prompt being continued, what it takes (0: none)."""
        if not self.yields(seq):
            return num_new
        num_new = min(num_new, self.tokens)
        if num_new > 0:
            self.tokens -= num_new
        return num_new

    def may_admit(self, seq: Sequence, running, num_new: int, whole_prompts: bool, first: bool) -> bool:
        """Whether ``seq``'s prompt of ``num_new`` tokens may start (``first``: the first of the
        step's batch): a background one needs a slot and prompt tokens of the share."""
        if not self.yields(seq):
            return True
        return self.can_run(running) and self.tokens > 0 and not (whole_prompts and not first
                                                                   and num_new > self.tokens)

    def admitted(self, seq: Sequence, num_new: int, whole_prompts: bool) -> int:
        """``seq``'s prompt starts: the tokens it computes in this step."""
        if not self.yields(seq):
            return num_new
        if not whole_prompts:
            num_new = min(num_new, self.tokens)
        self.tokens -= num_new
        return num_new

    def paused(self, running, batch) -> tuple[Sequence, ...]:
        """Background decodes that sit this step out (running, between two decode steps)."""
        if not any(self.yields(s) for s in running):
            return ()
        stepping = {id(s) for s, _ in batch}
        return tuple(s for s in running if self.yields(s) and s.status == SequenceStatus.RUNNING
                     and s.num_uncomputed_tokens == 1 and id(s) not in stepping)

    def newest(self, running) -> Sequence | None:
        """The background sequence to preempt first: the newest (None: none runs)."""
        return next((s for s in reversed(running) if self.yields(s)), None)

    def victim(self, running) -> Sequence:
        """Whom to preempt when blocks run out: the newest background sequence, else the newest."""
        return self.newest(running) or running[-1]

    def requeue_at(self, waiting, seq: Sequence) -> int:
        """Where preempted ``seq`` waits again: a background one first of the background ones
        (still behind every foreground prompt), a foreground one at the head."""
        if not self.yields(seq):
            return 0
        return next((i for i, other in enumerate(waiting) if self.yields(other)), len(waiting))

    def decoding(self, running, waiting) -> set[int] | None:
        """The ids of the background decodes that run this step (None: every one does)."""
        rows = self.rows(running, waiting)
        return None if rows is None else self.chosen(running, rows)

    def rows(self, running, waiting) -> int | None:
        """How many background decodes this step takes: 0 while foreground prompt tokens wait
        to be computed (but every ``BACKGROUND_EVERY``-th step), ``BACKGROUND_ROWS`` (or as
        many as fit the TBT budget's share) while foreground sequences run or wait, else all
        (None)."""
        yields = self.yields
        if not any(yields(s) for s in running):
            return None
        foreground_waiting = any(not yields(s) for s in waiting)
        prompt_pending = foreground_waiting or any(not yields(s) and s.num_uncomputed_tokens > 1 for s in running)
        if prompt_pending and self.num_paused_steps < BACKGROUND_EVERY - 1:
            self.num_paused_steps += 1
            return 0
        self.num_paused_steps = 0
        if foreground_waiting or any(not yields(s) for s in running):
            foreground = sum(1 for s in running if not yields(s) and s.num_uncomputed_tokens == 1)
            return max(BACKGROUND_ROWS, self.tbt.rows_within(BACKGROUND_STEP_SHARE, foreground))
        return None

    def chosen(self, running, rows: int) -> set[int] | None:
        """The ids of the ``rows`` background decodes that run this step, in turn (None: none is ready)."""
        ready = [s for s in running if self.yields(s) and s.num_uncomputed_tokens == 1]
        if not ready:
            return None
        start = self._turn % len(ready)
        self._turn = start + rows
        return {id(s) for s in (ready[start:] + ready[:start])[:rows]}


class TtftLateness:
    """With a TTFT target (``EngineConfig.ttft_slo_ms``; each sequence's ``ttft_due_ms``): a
    waiting prompt whose first token can no longer come by its due time (now, plus what
    computing the prompt costs by the step cost model) is late, and waits behind those that
    still can: under overload, serving the ones already lost first only loses the next ones too."""

    def __init__(self, cost: StepCostModel, share: ClassShare):
        self.cost = cost
        self.share = share   # (background prompts have no TTFT target to miss)

    def mark(self, waiting, now_ms: float) -> bool:
        """Mark the late ones among ``waiting``; whether any became late."""
        changed = False
        for seq in waiting:
            if seq.late or seq.ttft_due_ms is None or self.share.yields(seq) or seq.num_output_tokens:
                continue   # (a preempted sequence's first token is out: it keeps its place)
            cost_ms = 1000 * self.cost.predict(0, seq.num_uncomputed_tokens) if self.cost.ready else 0.0
            if now_ms + cost_ms > seq.ttft_due_ms:
                seq.late = changed = True
        return changed


class PrefillFirst:
    """``prefill_first``: admit waiting prompts whole (up to the token budget) and run them as a
    prefill step; only when none can be admitted, one decode token for every running sequence
    (the classic colocated server, whose decodes stall behind each prefill). Background prompts
    ride along a step of foreground prompts (``ClassShare.ride_along``)."""

    def step(self, sched: Scheduler) -> ScheduledBatch:
        batch = sched.admit(sched.max_num_batched_tokens, whole_prompts=True)
        if sched.share.ride_along(batch, sched.waiting, whole_prompts=True):
            batch += sched.admit(sched.max_num_batched_tokens - sum(n for _, n in batch), whole_prompts=True)
        return batch or sched.decode_all()


class Chunked:
    """``chunked``: every step decodes all running sequences first, then spends what is left of
    the token budget (with a TBT target, what ``TbtBudget`` allows beside the decodes) on prompt
    chunks: those already being prefilled first, then new prompts (Sarathi-style), so a long
    prompt never stalls decodes by more than one budget's worth of compute. Background prompts
    ride along a step that computes foreground prompt tokens (``ClassShare.ride_along``)."""

    def step(self, sched: Scheduler) -> ScheduledBatch:
        batch = sched.decode_all()
        prompts_pending = bool(sched.waiting) or any(s.num_uncomputed_tokens > 1 for s in sched.running)
        budget = sched.tbt.budget([seq for seq, _ in batch], sched.max_num_batched_tokens - len(batch),
                                  prompts_pending)
        budget = self.continue_prompts(sched, batch, budget)
        admitted = sched.admit(budget, whole_prompts=False)
        batch += admitted
        budget -= sum(n for _, n in admitted)
        if budget > 0 and sched.share.ride_along(batch, sched.waiting, whole_prompts=False):
            stepping = {id(s) for s, _ in batch}
            extra: ScheduledBatch = []
            budget = self.continue_prompts(sched, extra, budget,
                                           only=[s for s in sched.running if id(s) not in stepping])
            batch += extra + sched.admit(budget, whole_prompts=False)
        return batch

    @staticmethod
    def continue_prompts(sched: Scheduler, batch: ScheduledBatch, budget: int, only=None) -> int:
        """Continue prompts already being prefilled in chunks (of ``only``, else every running
        sequence), adding them to ``batch``; returns the budget left."""
        for seq in sched.running if only is None else only:
            if budget <= 0:
                break
            if seq.num_uncomputed_tokens > 1:
                num_new = sched.share.chunk(seq, min(seq.num_uncomputed_tokens, budget))
                if num_new <= 0:
                    continue
                batch.append((seq, num_new))
                budget -= num_new
        return budget


PREFILL_POLICIES = {PrefillPolicy.PREFILL_FIRST: PrefillFirst, PrefillPolicy.CHUNKED: Chunked}
