"""Continuous batching: which sequences run in the next step, and how many tokens each.

A step is a list of ``(sequence, num_new_tokens)``. The scheduler keeps the queues
(``waiting``, ``running``) and the two operations on them a step is made of: ``admit``
(waiting prompts start) and ``decode_all`` (a token for each running sequence that decodes).
The policies are objects of policies.py: ``prefill`` (``PrefillFirst`` or ``Chunked``, by
``EngineConfig.policy``) composes each step of those; ``tbt`` (``TbtBudget``: the prompt
tokens that fit beside the decodes under a TBT target), ``share`` (``ClassShare``: which
sequences are background, and the slots, prompt tokens and decode rows they may take) and
``lateness`` (``TtftLateness``: the prompts past their TTFT target) decide within a step;
``waiting_key`` is the waiting order. They share the step cost model ``cost``, which ``observe_step`` feeds.

When the pool runs out of blocks the newest running sequence (the newest background one
first) is preempted by recompute: its blocks are freed and it goes back to the front of its
part of the waiting queue with its generated tokens, to be prefilled again (from its own
blocks, if the prefix cache still has them). A waiting sequence's cached prefix is not
counted against the token budget.

Imports config, sequence, block_manager, step_cost, policies.
"""

from __future__ import annotations

from collections import deque

from pdqueue.engine.block_manager import BlockManager
from pdqueue.engine.config import EngineConfig
from pdqueue.engine.policies import PREFILL_POLICIES, ClassShare, TbtBudget, TtftLateness, waiting_key
from pdqueue.engine.sequence import Sequence, SequenceStatus
from pdqueue.engine.step_cost import StepCostModel

ScheduledBatch = list[tuple[Sequence, int]]


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.prefill = PREFILL_POLICIES[config.policy]()   # which operations a step takes
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.cost = StepCostModel()
        self.tbt = TbtBudget(config.tbt_slo_ms, config.tbt_percentile, self.cost)
        self.share = ClassShare(config.background_seqs, self.tbt)
        self.lateness = TtftLateness(self.cost, self.share)
        self._arrivals = 0            # sequences queued so far (their arrival order)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def key(self, seq: Sequence) -> tuple:
        """``seq``'s place in the waiting order (``policies.waiting_key``)."""
        return waiting_key(seq, self.share.yields(seq))

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence in the waiting order: behind every one that comes first,
        ahead of the rest."""
        seq.status = SequenceStatus.WAITING
        self._arrivals += 1
        seq.arrival = self._arrivals
        key = self.key(seq)
        i = next((i for i, other in enumerate(self.waiting) if self.key(other) > key), len(self.waiting))
        self.waiting.insert(i, seq)

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

    # ---- views of the queues --------------------------------------------------------------
    @property
    def num_background(self) -> int:
        """Background sequences holding a slot (running, preempted ones not counted)."""
        return sum(self.share.yields(s) for s in self.running)

    @property
    def num_waiting_foreground(self) -> int:
        return sum(not self.share.yields(s) for s in self.waiting)

    @property
    def num_waiting_on_time(self) -> int:
        """Foreground sequences waiting that can still make their TTFT target (all of them
        without one)."""
        return sum(not self.share.yields(s) and not s.late for s in self.waiting)

    def num_waiting_rank(self, rank: int) -> int:
        """Waiting sequences of service-class rank ``rank`` (0: interactive)."""
        return sum(s.rank == rank for s in self.waiting)

    def can_run_background(self) -> bool:
        """Whether one more background sequence may take a slot now."""
        return self.share.can_run(self.running)

    # ---- the step -------------------------------------------------------------------------
    def mark_late(self, now_ms: float) -> None:
        """Late prompts (``TtftLateness``) move behind those still in time, in their own order."""
        if self.lateness.mark(self.waiting, now_ms):
            self.waiting = deque(sorted(self.waiting, key=self.key))

    def schedule(self, now_ms: float | None = None) -> ScheduledBatch:
        """The next step; ``now_ms`` (epoch ms): the clock for TTFT targets (``mark_late``)."""
        if now_ms is not None:
            self.mark_late(now_ms)
        self.share.begin_step(self.running, self.waiting)
        return self.prefill.step(self)

    def observe_step(self, batch: ScheduledBatch, seconds: float, ended_s: float | None = None) -> None:
        """After a step ran: its cost feeds the model; its decodes' slow gaps are counted
        (``TbtBudget.observe``; ``ended_s``: perf_counter at the step's end)."""
        # (called after the step: a decode row's one token was an output token)
        decodes = [seq for seq, n in batch if n == 1 and seq.num_cached_tokens > seq.num_prompt_tokens]
        self.cost.observe(len(decodes), sum(n for _, n in batch) - len(decodes), seconds)
        self.tbt.observe(decodes, seconds, ended_s)

    def admit(self, budget: int, whole_prompts: bool) -> ScheduledBatch:
        """Start waiting prompts, in the waiting order, while ``budget`` tokens, a slot and
        their blocks allow (``whole_prompts``: each computed whole, else chunked)."""
        batch: ScheduledBatch = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # A waiting sequence holds no blocks; a prefix cache hit is not computed again.
            num_new = seq.num_uncomputed_tokens - self.block_manager.num_hit_tokens(seq)
            if whole_prompts and batch and num_new > budget:
                break  # the first prompt may exceed the budget; later ones wait
            # Background prompts queue behind every foreground one, so from here on the
            # queue is background: each needs a slot and prompt tokens of the share.
            if not self.share.may_admit(seq, self.running, num_new, whole_prompts, first=not batch):
                break
            if not self.block_manager.can_allocate(seq):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            assert seq.num_uncomputed_tokens == num_new
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            num_new = self.share.admitted(seq, num_new if whole_prompts else min(num_new, budget), whole_prompts)
            batch.append((seq, num_new))
            budget -= num_new
        return batch

    def paused(self, batch: ScheduledBatch) -> tuple[Sequence, ...]:
        """Background decodes that sit this step out (``ClassShare.paused``)."""
        return self.share.paused(self.running, batch)

    def decode_all(self) -> ScheduledBatch:
        """One token for every running sequence that decodes (background ones as
        ``ClassShare`` allows), preempting when blocks run out."""
        batch: ScheduledBatch = []
        chosen = self.share.decoding(self.running, self.waiting)   # None: every background decode runs
        for seq in list(self.running):
            if seq.status != SequenceStatus.RUNNING or seq.num_uncomputed_tokens != 1:
                continue  # preempted below, or still prefilling in chunks
            if chosen is not None and id(seq) not in chosen and self.share.yields(seq):
                continue  # paused: its KV stays, it decodes in a later step
            while not self.block_manager.can_append(seq):
                victim = self.share.victim(self.running)
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
        victim = self.share.newest(self.running)
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
        self.waiting.insert(self.share.requeue_at(self.waiting, seq), seq)
