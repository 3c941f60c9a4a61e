"""Scheduler and block manager on their own: no model, no KV tensors."""

import pytest

from pdqueue.engine.block_manager import BlockManager
from pdqueue.engine.config import EngineConfig
from pdqueue.engine.sampling import SamplingParams, draw_seed, sample
from pdqueue.engine.scheduler import Scheduler
from pdqueue.engine.sequence import Sequence, SequenceStatus
from pdqueue.protocol import ServiceClass


def make(policy="prefill_first", num_blocks=16, block_size=4, budget=32, max_seqs=8):
    config = EngineConfig(policy=policy, block_size=block_size, max_num_batched_tokens=budget,
                          max_num_seqs=max_seqs)
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(config, bm), bm


def seq(rid, n):
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(temperature=0))


def run_step(batch):
    """What the engine does after the model ran: cache the tokens, append one where sampled."""
    for s, n in batch:
        s.num_cached_tokens += n
        if s.num_cached_tokens == s.num_tokens:
            s.append_token(7)


def test_block_manager_check_act_pairs():
    bm = BlockManager(4, 4)
    s = seq("a", 9)  # 3 blocks
    assert bm.can_allocate(s)
    bm.allocate(s)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 1
    big = seq("b", 8)
    assert not bm.can_allocate(big)
    with pytest.raises(RuntimeError):
        bm.allocate(big)
    s.append_token(1)  # 10 tokens still fit in 3 blocks
    assert bm.can_append(s)
    bm.append(s)
    assert len(s.block_table) == 3
    for _ in range(3):
        s.append_token(1)
    bm.append(s)  # 13 tokens: a 4th block
    assert bm.num_free_blocks == 0
    s.append_token(1)
    assert bm.can_append(s)  # 14 tokens fit in 4 blocks
    blocks = bm.detach(s)
    assert s.block_table == [] and bm.num_free_blocks == 0
    bm.free_blocks(blocks)
    assert bm.num_free_blocks == 4
    with pytest.raises(RuntimeError):
        bm.free_blocks(blocks[:1])


def test_prefill_first_runs_whole_prompts_then_decodes():
    sch, bm = make(budget=10)
    a, b, c = seq("a", 6), seq("b", 4), seq("c", 3)
    for s in (a, b, c):
        sch.add(s)
    batch = sch.schedule()
    assert [(s.request_id, n) for s, n in batch] == [("a", 6), ("b", 4)]
    run_step(batch)
    batch = sch.schedule()
    assert [(s.request_id, n) for s, n in batch] == [("c", 3)]
    run_step(batch)
    batch = sch.schedule()
    assert [(s.request_id, n) for s, n in batch] == [("a", 1), ("b", 1), ("c", 1)]


def test_prefill_first_admits_a_prompt_longer_than_the_budget_alone():
    sch, _ = make(budget=4, num_blocks=16)
    sch.add(seq("long", 20))
    sch.add(seq("short", 2))
    batch = sch.schedule()
    assert [(s.request_id, n) for s, n in batch] == [("long", 20)]


def test_chunked_decodes_first_and_chunks_prompts_in_budget():
    sch, _ = make(policy="chunked", budget=8)
    a = seq("a", 3)
    sch.add(a)
    run_step(sch.schedule())  # a prefilled, now decoding
    long = seq("long", 20)
    sch.add(long)
    sizes = []
    while long.num_cached_tokens < long.num_tokens - 1 or long.num_output_tokens == 0:
        batch = sch.schedule()
        assert batch[0] == (a, 1), "the running decode goes first every step"
        assert sum(n for _, n in batch) <= 8
        sizes.append(dict((s.request_id, n) for s, n in batch).get("long"))
        run_step(batch)
    assert sizes == [7, 7, 6]
    assert long.num_output_tokens == 1


def test_preemption_by_recompute_when_blocks_run_out():
    sch, bm = make(num_blocks=4, block_size=4, budget=64)
    a, b = seq("a", 8), seq("b", 8)  # two blocks each: pool full
    sch.add(a)
    sch.add(b)
    run_step(sch.schedule())
    assert bm.num_free_blocks == 0
    # Both now have 9 tokens and need a third block for the decode step: b is preempted.
    batch = sch.schedule()
    assert [(s.request_id, n) for s, n in batch] == [("a", 1)]
    assert b.status == SequenceStatus.WAITING and b.block_table == [] and b.num_cached_tokens == 0
    assert sch.waiting[0] is b and sch.num_preemptions == 1
    assert b.output_ids == [7], "generated tokens survive preemption and are recomputed"


def test_sampling_depends_only_on_seed_and_index():
    import torch

    logits = torch.randn(3, 50)
    p = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=123)
    alone = [sample(logits[i : i + 1], [p], [5])[0] for i in range(3)]
    together = sample(logits, [p, p, p], [5, 5, 5])
    assert alone == together
    # Different index -> different draw stream; same (seed, index) -> same draw.
    assert draw_seed(123, 5) == draw_seed(123, 5) != draw_seed(123, 6)
    draws = {sample(logits[:1], [SamplingParams(temperature=1.0, seed=s)], [0])[0] for s in range(40)}
    assert len(draws) > 5, "seeds must change the draw"


def test_top_k_one_is_greedy():
    import torch

    logits = torch.randn(4, 100)
    p = SamplingParams(temperature=1.0, top_k=1, seed=3)
    assert sample(logits, [p] * 4, [0, 1, 2, 3]) == torch.argmax(logits, -1).tolist()


@pytest.mark.parametrize("params,expected", [
    (dict(), [0.563, 0.207, 0.126, 0.076, 0.028]),       # softmax of the logits
    (dict(top_p=0.7), [0.731, 0.269, 0, 0, 0]),          # nucleus: the two best, renormalised
    (dict(top_k=3), [0.631, 0.232, 0.137, 0, 0]),
    (dict(temperature=2.0, top_k=4, top_p=0.6), [0.622, 0.378, 0, 0, 0]),
])
def test_sampled_frequencies_follow_the_distribution(params, expected):
    import torch

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    p = SamplingParams(**{"temperature": 1.0, "seed": 11, **params})
    n = 20000
    counts = [0] * 5
    for i in range(n):
        counts[sample(logits[None], [p], [i])[0]] += 1
    for got, want in zip(counts, expected):
        assert abs(got / n - want) < 0.015, (counts, expected)


# ---- the TBT budget of the chunked policy ----------------------------------------------------

@pytest.mark.parametrize("percentile", [50, 90, 99])
def test_slow_gaps_allowed_is_what_the_percentile_tolerates(percentile):
    from pdqueue.bench.stats import percentile as pct
    from pdqueue.engine.policies import slow_gaps_allowed

    for n in range(1, 80):
        allowed = slow_gaps_allowed(n, percentile)
        for k in range(n + 1):   # k slow gaps, as slow as can be: meets iff within the allowance
            gaps = [10.0] * (n - k) + [1e9] * k
            assert (pct(gaps, percentile) <= 100.0) == (k <= allowed), (n, k, allowed)


def test_step_cost_model_learns_a_linear_cost():
    import random

    from pdqueue.engine.step_cost import StepCostModel

    model, rng = StepCostModel(), random.Random(0)
    assert model.prefill_tokens_within(0.1, 4) is None   # nothing learned yet
    for _ in range(200):
        d, p = rng.randint(0, 16), rng.choice([0, 0, 16, 64, 256])
        model.observe(d, p, 0.010 + 0.002 * d + 0.0005 * p + rng.uniform(-1e-4, 1e-4))
    assert model.ready
    assert model.predict(8, 100) == pytest.approx(0.010 + 0.016 + 0.05, rel=0.02)
    assert model.prefill_tokens_within(0.1, 8) == pytest.approx((0.1 - 0.026) / 0.0005, rel=0.03)


def budgeted(tbt_slo_ms=50.0, budget=512, max_seqs=8):
    config = EngineConfig(policy="chunked", block_size=4, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                          tbt_slo_ms=tbt_slo_ms)
    bm = BlockManager(512, 4)
    sch = Scheduler(config, bm)
    for d in range(0, 8):     # a step costs 10 ms + 2 ms per decode + 0.1 ms per prompt token
        for p in (0, 64, 256):
            sch.cost.observe(d, p, 0.010 + 0.002 * d + 0.0001 * p)
    return sch


def decoding(sch, rid, max_tokens, ignore_eos=True, slow_gaps=0):
    s = Sequence(rid, [1, 2, 3], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos))
    sch.add(s)
    run_step(sch.schedule())          # its prompt, then it decodes
    s.slow_gaps = slow_gaps
    return s


def test_tbt_budget_cuts_prompt_chunks_only_for_decodes_without_slow_gaps_left():
    sch = budgeted()
    a = decoding(sch, "a", max_tokens=31)          # 30 gaps: 2 may be slow at p90
    sch.add(seq("doc", 400))
    batch = sch.schedule()
    assert dict((s.request_id, n) for s, n in batch) == {"a": 1, "doc": 400 if 511 >= 400 else 511}
    run_step(batch)
    sch.observe_step(batch, 0.2)                  # slow: a's first slow gap
    assert a.slow_gaps == 1

    sch2 = budgeted()
    decoding(sch2, "b", max_tokens=8)          # 7 gaps: none may be slow
    sch2.add(seq("doc", 400))
    batch = dict((s.request_id, n) for s, n in sch2.schedule())
    # within 50 ms x STEP_SHARE: (42.5 ms - 10 - 2 x 1) / 0.1 ms = 305 tokens
    assert batch["b"] == 1 and batch["doc"] == pytest.approx(305, abs=2)
    assert sch2.tbt.num_budgeted_steps == 1


def test_a_gap_past_the_target_counts_slow_though_its_step_was_within_the_share():
    """The gap a client sees runs from one token to the next, the time between the steps
    included: a 30 ms step (within 50 ms x STEP_SHARE) that ends 55 ms after the decode's
    previous token is a slow gap; one that ends 45 ms after it is not; a 45 ms step is one
    whatever the gap; without the step's end (a caller that has none) only the step counts."""
    sch = budgeted()
    a = decoding(sch, "a", max_tokens=31)
    a.last_token_s = 100.0
    batch = sch.schedule()
    run_step(batch)
    sch.observe_step(batch, 0.030, 100.045)
    assert a.slow_gaps == 0
    a.last_token_s = 100.0
    sch.observe_step(batch, 0.030, 100.055)
    assert a.slow_gaps == 1
    a.last_token_s = 100.0
    sch.observe_step(batch, 0.045, 100.045)
    assert a.slow_gaps == 2
    sch.observe_step(batch, 0.030)
    assert a.slow_gaps == 2


def test_a_step_that_spends_a_slow_gap_stays_within_slow_step_targets():
    """A decode that may still have a slow gap lets prompts take more than fits in the target,
    but not the whole 2048-token budget: what the cost model fits in SLOW_STEP_TARGETS targets
    (50 ms x 1.5 = 75 ms: (75 - 10 - 2 x 1) / 0.1 ms = 630 tokens); cold, COLD_CHUNK."""
    from pdqueue.engine.policies import COLD_CHUNK, SLOW_STEP_TARGETS

    sch = budgeted(budget=2048)
    decoding(sch, "a", max_tokens=31)          # 30 gaps: 2 may be slow at p90
    sch.add(seq("doc", 2000))
    batch = dict((s.request_id, n) for s, n in sch.schedule())
    assert SLOW_STEP_TARGETS == 1.5 and batch["doc"] == pytest.approx(630, abs=2)

    config = EngineConfig(policy="chunked", block_size=4, max_num_batched_tokens=2048, max_num_seqs=8, tbt_slo_ms=50)
    cold = Scheduler(config, BlockManager(1024, 4))
    decoding(cold, "a", max_tokens=31)
    cold.add(seq("doc", 2000))
    assert dict((s.request_id, n) for s, n in cold.schedule())["doc"] == COLD_CHUNK


def test_tbt_budget_counts_earned_gaps_without_ignore_eos_and_keeps_a_minimum_chunk():
    from pdqueue.engine.policies import MIN_CHUNK

    sch = budgeted(tbt_slo_ms=12.0)   # 10.2 ms for the step: 10 + 2 ms of decode leave nothing
    decoding(sch, "a", max_tokens=100, ignore_eos=False)   # may stop any time: no slow gap to spend
    sch.add(seq("doc", 400))
    batch = dict((s.request_id, n) for s, n in sch.schedule())
    assert batch == {"a": 1, "doc": MIN_CHUNK}


def test_without_a_tbt_target_chunks_fill_the_token_budget():
    sch = budgeted(tbt_slo_ms=None)
    decoding(sch, "a", max_tokens=8)
    sch.add(seq("doc", 400))
    assert dict((s.request_id, n) for s, n in sch.schedule())["doc"] == 400


def test_the_tbt_target_is_held_in_ms_and_converted_once():
    """TbtBudget holds the target (ms) and derives the seconds and the step's share from it;
    setting it changes the next step's decision; a target <= 0 is refused."""
    from pdqueue.engine.policies import STEP_SHARE

    sch = budgeted(tbt_slo_ms=50.0)
    assert (sch.tbt.target_ms, sch.tbt.target_s, sch.tbt.step_s) == (50.0, 0.05, 0.05 * STEP_SHARE)
    decoding(sch, "b", max_tokens=8)           # 7 gaps: none may be slow
    sch.add(seq("doc", 400))
    sch.tbt.set(None)                           # off: chunks fill the token budget
    assert (sch.tbt.target_s, sch.tbt.step_s) == (None, None)
    assert dict((s.request_id, n) for s, n in sch.schedule())["doc"] == 400
    for bad in (0, -5.0):
        with pytest.raises(ValueError):
            sch.tbt.set(bad)


# ---- background sequences (the batch service class) -------------------------------------------
BATCH = ServiceClass.BATCH.rank   # a class that yields


def bg(rid, n):
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(temperature=0), rank=BATCH)


def test_a_foreground_prompt_waits_ahead_of_every_background_one():
    sch, _ = make(policy="chunked")
    for s in (bg("b1", 4), seq("f1", 4), bg("b2", 4), seq("f2", 4)):
        sch.add(s)
    assert [s.request_id for s in sch.waiting] == ["f1", "f2", "b1", "b2"]


def test_background_decodes_pause_while_foreground_prompts_wait_but_never_starve():
    from pdqueue.engine.policies import BACKGROUND_EVERY

    sch, _ = make(policy="chunked", num_blocks=64, budget=4)
    b = bg("b", 4)
    sch.add(b)
    run_step(sch.schedule())                  # b prefilled: it now decodes
    assert b.num_uncomputed_tokens == 1
    sch.add(seq("f", 40))                      # a long foreground prompt: 10 chunked steps
    ran = []
    for _ in range(2 * BACKGROUND_EVERY):
        batch = sch.schedule()
        ran.append(any(s is b for s, _ in batch))
        run_step(batch)
    # paused BACKGROUND_EVERY - 1 steps in a row, then one step with it, and again
    assert ran == ([False] * (BACKGROUND_EVERY - 1) + [True]) * 2
    assert b.num_preemptions == 0              # paused, not recomputed


def test_background_decodes_run_beside_foreground_decodes():
    sch, _ = make(policy="chunked", num_blocks=64)
    b, f = bg("b", 4), seq("f", 4)
    sch.add(b)
    run_step(sch.schedule())
    sch.add(f)
    run_step(sch.schedule())                  # f's prompt (b sits it out)
    assert {s.request_id for s, n in sch.schedule()} == {"b", "f"}   # no prompt waits: both decode


def test_background_prompts_ride_along_foreground_prompts_only():
    from pdqueue.engine.policies import BACKGROUND_PROMPT_TOKENS_BESIDE

    sch, _ = make(policy="chunked", num_blocks=256, budget=512)
    f = seq("f", 4)
    sch.add(f)
    run_step(sch.schedule())                  # f decodes from now on
    sch.add(bg("b", 200))
    for _ in range(6):                        # pure decode steps: no background prompt token
        batch = sch.schedule()
        assert [s.request_id for s, _ in batch] == ["f"]
        run_step(batch)
    sch.add(seq("f2", 40))                    # a foreground prompt: the step is mixed anyway
    batch = sch.schedule()
    assert sum(n for s, n in batch if sch.share.yields(s)) == BACKGROUND_PROMPT_TOKENS_BESIDE
    assert sum(n for s, n in batch if s.request_id == "f2") == 40


def test_the_newest_background_sequence_is_preempted_first():
    sch, bm = make(policy="prefill_first", num_blocks=5, block_size=4, budget=64)
    f1, b1, f2 = seq("f1", 4), bg("b1", 4), seq("f2", 4)
    sch.add(b1)
    run_step(sch.schedule())                   # b1 alone
    sch.add(f1)
    sch.add(f2)
    run_step(sch.schedule())                   # f1, f2: three full blocks in all, two free
    batch = sch.schedule()                     # each needs a second block: one must go
    assert b1.num_preemptions == 1 and f1.num_preemptions == f2.num_preemptions == 0
    assert {s.request_id for s, _ in batch} == {"f1", "f2"}


def test_a_preempted_background_sequence_waits_behind_the_foreground_prompts():
    sch, bm = make(policy="chunked", num_blocks=64, budget=64)
    b = bg("b", 4)
    sch.add(b)
    run_step(sch.schedule())
    f = seq("f", 4)
    sch.add(f)
    sch._preempt(b)                             # as the pool running out does
    assert list(sch.waiting) == [f, b]          # a foreground prompt is never stuck behind it


def test_background_sequences_take_at_most_their_slots_and_prompt_tokens_per_step():
    from pdqueue.engine.policies import BACKGROUND_PROMPT_TOKENS

    config = EngineConfig(policy="chunked", block_size=4, max_num_batched_tokens=1024, max_num_seqs=8,
                          max_background_seqs=3)
    sch = Scheduler(config, BlockManager(512, 4))
    for i in range(5):
        sch.add(bg(f"b{i}", 100))
    batch = sch.schedule()
    assert sum(n for _, n in batch) == BACKGROUND_PROMPT_TOKENS      # 2 of 3 prompts started, 128 tokens in all
    assert sch.num_background <= 3
    for _ in range(10):
        run_step(sch.schedule())
    assert sch.num_background == 3 and len(sch.waiting) == 2       # never more than its 3 slots
    sch.add(seq("f", 8))
    run_step(sch.schedule())
    assert any(s.request_id == "f" for s in sch.running)            # a foreground request finds a slot


def test_beside_foreground_work_background_decodes_take_turns():
    from pdqueue.engine.policies import BACKGROUND_ROWS

    sch, _ = make(policy="chunked", num_blocks=256, budget=512, max_seqs=16)
    bgs = [bg(f"b{i}", 4) for i in range(2 * BACKGROUND_ROWS)]
    for s in bgs:
        sch.add(s)
    for _ in range(4):
        run_step(sch.schedule())                   # prefilled, then decoding together (nothing else runs)
    assert all(s.num_output_tokens >= 1 for s in bgs)
    f = seq("f", 4)
    sch.add(f)
    while f.num_uncomputed_tokens > 1 or f.status.value == "waiting":
        run_step(sch.schedule())
    counts = {s.request_id: s.num_output_tokens for s in bgs}
    steps = 2 * len(bgs)
    for _ in range(steps):
        batch = sch.schedule()
        assert sum(sch.share.yields(s) for s, _ in batch) == BACKGROUND_ROWS
        run_step(batch)
    grown = {s.request_id: s.num_output_tokens - counts[s.request_id] for s in bgs}
    assert set(grown.values()) == {steps * BACKGROUND_ROWS // len(bgs)}, grown   # in turn: as many each


@pytest.mark.parametrize("tbt_slo_ms,expected", [(100.0, 18), (40.0, 3), (20.0, 1)])
def test_with_a_tbt_target_background_decodes_fill_half_of_it_beside_foreground_ones(tbt_slo_ms, expected):
    """A step of 10 ms + 2 ms a decode row: beside 2 foreground decodes, background rows up to
    half the TBT target (100 ms: 50 ms = 20 rows, less the 2 foreground ones), never fewer than
    BACKGROUND_ROWS; without a fitted cost model BACKGROUND_ROWS."""
    from pdqueue.engine.policies import BACKGROUND_ROWS, BACKGROUND_STEP_SHARE

    assert BACKGROUND_STEP_SHARE == 0.5 and BACKGROUND_ROWS == 1
    sch = budgeted(tbt_slo_ms=tbt_slo_ms, max_seqs=40)
    bgs = [bg(f"b{i}", 4) for i in range(30)]
    for s in bgs:
        sch.add(s)
    while any(s.num_uncomputed_tokens > 1 for s in bgs):
        run_step(sch.schedule())
    fs = [decoding(sch, f"f{i}", 50) for i in range(2)]
    batch = sch.schedule()
    assert sum(not sch.share.yields(s) for s, _ in batch) == 2 and all(f in [s for s, _ in batch] for f in fs)
    rows = sum(sch.share.yields(s) for s, _ in batch)
    a, b, _ = sch.cost.theta   # the fitted model (recursive least squares: ~10 ms, ~2 ms)
    budget = tbt_slo_ms / 1000 * BACKGROUND_STEP_SHARE
    assert abs(rows - expected) <= 1
    assert rows == BACKGROUND_ROWS or a + b * (2 + rows) <= budget < a + b * (2 + rows + 1)
    sch.cost.steps = 0   # not fitted: one row a step
    assert sum(sch.share.yields(s) for s, _ in sch.schedule()) == BACKGROUND_ROWS


# ---- the waiting order: class, then deadline (issue 27) ---------------------------------------
def classed(rid, n, deadline_ms=None, rank=1):
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(temperature=0), rank=rank, deadline_ms=deadline_ms)


def test_waiting_prompts_of_one_class_are_ordered_by_deadline_those_without_one_last():
    sch, _ = make()
    for s in (classed("none1", 4), classed("late", 4, 900.0), classed("early", 4, 100.0),
              classed("none2", 4), classed("mid", 4, 500.0), classed("mid2", 4, 500.0)):
        sch.add(s)
    # earliest deadline first; equal deadlines and no deadline in arrival order
    assert [s.request_id for s in sch.waiting] == ["early", "mid", "mid2", "late", "none1", "none2"]


def test_class_comes_before_deadline_and_foreground_before_background():
    sch, _ = make()
    for s in (classed("batch-early", 4, 1.0, rank=BATCH), classed("std-early", 4, 10.0, rank=1),
              classed("inter-none", 4, None, rank=0), classed("inter-late", 4, 50.0, rank=0),
              classed("batch-none", 4, None, rank=BATCH), classed("std-none", 4, rank=1)):
        sch.add(s)
    assert [s.request_id for s in sch.waiting] == [
        "inter-late", "inter-none", "std-early", "std-none", "batch-early", "batch-none"]


def test_prompts_are_admitted_in_deadline_order_one_per_step_under_a_small_budget():
    """prefill_first with a budget that holds one prompt: the prompts start one a step, the
    earliest deadline first, whatever order they came in."""
    sch, _ = make(budget=6, num_blocks=64)
    for rid, deadline in (("c", 300.0), ("b", 200.0), ("a", 100.0)):
        sch.add(classed(rid, 5, deadline))
    started = []
    for _ in range(3):
        batch = sch.schedule()
        assert len(batch) == 1 and batch[0][1] == 5
        started.append(batch[0][0].request_id)
        run_step(batch)
    assert started == ["a", "b", "c"]


def test_a_preempted_sequence_still_goes_ahead_of_new_prompts_with_earlier_deadlines():
    sch, _ = make(policy="chunked", num_blocks=64, budget=64)
    started = classed("started", 4, None)
    sch.add(started)
    run_step(sch.schedule())
    sch._preempt(started)                       # its tokens are out: it resumes first
    sch.add(classed("urgent", 4, 1.0))
    assert [s.request_id for s in sch.waiting] == ["started", "urgent"]


# ---- the share is keyed by the class's rank ----------------------------------------------------
def _workload_decisions(seed: int, yielding: frozenset[int], rank_of) -> list:
    """Every decision of a random workload (waiting order, steps, pauses, preemptions, the
    queues' views; new prompts, imported sequences, make_room) with ``ClassShare.yielding`` and
    the sequences' ranks given by ``rank_of`` (of a class's rank in the table)."""
    import random

    rng = random.Random(seed)
    policy = rng.choice(["prefill_first", "chunked"])
    max_seqs = rng.choice([2, 4, 8])
    config = EngineConfig(policy=policy, block_size=rng.choice([2, 4]), max_num_batched_tokens=rng.choice([16, 64]),
                          max_num_seqs=max_seqs, tbt_slo_ms=rng.choice([None, 50.0]) if policy == "chunked" else None,
                          max_background_seqs=rng.choice([None, 1, max_seqs]))
    bm = BlockManager(rng.choice([12, 32, 128]), config.block_size)
    sch = Scheduler(config, bm)
    sch.share.yielding = yielding
    out, now, n = [], 1e6, 0
    for _ in range(rng.randint(20, 60)):
        for _ in range(rng.choice([0, 0, 1, 2])):
            sp = SamplingParams(temperature=0, max_tokens=rng.randint(1, 12))
            s = Sequence(f"r{n}", [1] * rng.randint(1, 30), sp,
                         rank=rank_of(rng.choice([0, 1, 2, 2])), deadline_ms=rng.choice([None, rng.uniform(0, 9e3)]))
            s.ttft_due_ms = now + rng.uniform(0, 400)
            sch.add(s)
            n += 1
        if rng.random() < 0.15:   # imported KV (a decode worker's reserve + add_prefilled)
            sp = SamplingParams(temperature=0, max_tokens=rng.randint(2, 12))
            s = Sequence(f"r{n}", [1] * rng.randint(1, 20), sp,
                         [7], rank=rank_of(rng.choice([0, 1, 2])))
            n += 1
            if (len(sch.running) < max_seqs and (s.rank not in yielding or sch.can_run_background())
                    and bm.blocks_for(s.num_tokens) <= bm.num_free_blocks):
                bm.allocate_known(s, [], same_root=False)
                s.num_cached_tokens = s.num_tokens - 1
                sch.add_running(s)
        if rng.random() < 0.05:
            out.append(sch.preempt_background())
        now += rng.uniform(5, 60)
        batch = sch.schedule(now)
        out.append(([(s.request_id, k) for s, k in batch], [s.request_id for s in sch.paused(batch)],
                    [s.request_id for s in sch.waiting], sch.num_preemptions, sch.num_background,
                    sch.num_waiting_foreground, sch.num_waiting_on_time))
        run_step(batch)
        sch.observe_step(batch, rng.uniform(0.005, 0.1))
        for s, _ in batch:
            if s.num_output_tokens >= s.params.max_tokens and s in sch.running:
                sch.remove(s)
                bm.free(s)
    return out


def test_which_sequences_yield_is_the_rank_the_class_table_says():
    """ClassShare asks a sequence only its rank: the batch class's sequences decide as before
    under a table where another rank is the one that yields (as a new class that yields would
    be), in 150 random workloads; and with no rank yielding, no sequence is background (the
    rank still orders them)."""
    from pdqueue.protocol import YIELDING_RANKS

    assert YIELDING_RANKS == {BATCH} == {c.rank for c in ServiceClass if c.yields}
    for seed in range(150):
        table = _workload_decisions(seed, YIELDING_RANKS, lambda r: r)
        moved = _workload_decisions(seed, frozenset({7}), lambda r: 7 if r == BATCH else r)
        assert table == moved, seed
    sch, _ = make(policy="chunked")
    sch.share.yielding = frozenset()
    sch.add(bg("b", 4))
    sch.add(seq("f", 4))
    assert [s.request_id for s in sch.waiting] == ["f", "b"] and sch.num_waiting_foreground == 2
    assert sch.num_waiting_on_time == 2 and sch.share.newest(sch.waiting) is None
