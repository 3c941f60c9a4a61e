"""The TTFT order (``--ttft-slo-ms``): prompts that can no longer make their first token in
time wait behind those that still can, in the engine (``Scheduler.mark_late``) and at the
worker's reads (``RequestRole.nothing_waits_on_time``), and nothing is lost on the way."""

from __future__ import annotations

import time

from pdqueue.client import Client
from pdqueue.engine.block_manager import BlockManager
from pdqueue.engine.config import EngineConfig
from pdqueue.engine.sampling import SamplingParams
from pdqueue.engine.scheduler import Scheduler
from pdqueue.engine.sequence import Sequence
from pdqueue.protocol import as_str
from tests.helpers import FAST, wait_for, wait_pools_free


def _seq(rid: str, n: int, due_ms: float | None) -> Sequence:
    s = Sequence(rid, list(range(1, n + 1)), SamplingParams(temperature=0, max_tokens=4))
    s.ttft_due_ms = due_ms
    return s


def _scheduler() -> Scheduler:
    config = EngineConfig(policy="prefill_first", block_size=4, max_num_batched_tokens=64, max_num_seqs=1,
                          ttft_slo_ms=1000)
    return Scheduler(config, BlockManager(256, 4))


def test_prompts_past_their_ttft_due_time_wait_behind_those_still_in_time_in_their_own_order():
    sch = _scheduler()
    for rid, due in (("late-a", 1000.0), ("on-time", 5000.0), ("late-b", 1500.0), ("no-target", None)):
        sch.add(_seq(rid, 8, due))
    batch = sch.schedule(now_ms=2000.0)   # late-a and late-b are past due
    assert [s.request_id for s, _ in batch] == ["on-time"]
    assert [s.request_id for s in sch.waiting] == ["no-target", "late-a", "late-b"]
    assert sch.num_waiting_on_time == 1 and sch.num_waiting_foreground == 3


def test_without_a_clock_or_a_due_time_the_order_is_arrival():
    sch = _scheduler()
    for rid in ("a", "b"):
        sch.add(_seq(rid, 8, 10.0))
    assert [s.request_id for s, _ in sch.schedule()] == ["a"]   # no now_ms: nothing is marked late
    assert not any(s.late for s in sch.waiting)


def test_the_cost_of_the_prompt_counts_toward_its_due_time():
    sch = _scheduler()
    for _ in range(8):   # a prompt token costs 10 ms, a step 5 ms
        sch.cost.observe(1, 0, 0.005)
        sch.cost.observe(0, 100, 0.005 + 1.0)
    sch.add(_seq("long", 60, due_ms=2300.0))    # ~0.6 s to compute: due in 0.3 s -> late
    sch.add(_seq("short", 4, due_ms=2300.0))    # ~0.05 s: in time
    assert [s.request_id for s, _ in sch.schedule(now_ms=2000.0)] == ["short"]


def test_a_worker_reads_past_late_prompts_and_answers_the_new_ones_first(cluster):
    """A prefill worker that computes one prompt at a time, 4 tokens a step, takes 12 long
    prompts (~150 steps each) that waited in Redis past its 2 s TTFT target: they are late, so
    it reads on and prefills the 4 short prompts that arrive next before them. Without the
    target it reads them only once all 12 have started (measured: 11-12 long ones first)."""
    client = Client(cluster.redis_url)
    text = "the quick brown fox " * 30   # 600 tokens
    sent = time.monotonic()
    longs = client.submit_many([dict(prompt=f"{i} {text}", max_tokens=2, temperature=0.0, ignore_eos=True)
                                for i in range(12)])
    time.sleep(max(0.0, 2.5 - (time.monotonic() - sent)))   # the long prompts are past their target
    cluster.start_together(("prefill", *FAST, "--max-num-seqs", "1", "--policy", "chunked", "--max-batched-tokens",
                            "4", "--ttft-slo-ms", "2000", {"worker_id": "p0"}),
                           ("decode", *FAST, {"worker_id": "d0"}))
    # p0 read all 12 at once (1 computing, 11 waiting)
    wait_for(lambda: cluster.r.xinfo_groups(cluster.keys.requests)[0]["lag"] == 0, what="p0 holding the long prompts")
    shorts = client.submit_many([dict(prompt=f"short prompt {i}", max_tokens=4, temperature=0.0, ignore_eos=True)
                                 for i in range(4)])
    results = [h.result(timeout=60) for h in shorts]
    finished = {as_str(f.get(b"id", f.get("id"))) for _, f in cluster.r.xrange(cluster.keys.done)}
    longs_done = sum(h.request_id in finished for h in longs)
    assert longs_done <= 4, f"the short prompts were answered after {longs_done} of 12 long ones"
    assert all(len(res.token_ids) == 4 for res in results)
    assert all(len(h.result(timeout=180).token_ids) == 2 for h in longs)   # the late ones too
    wait_pools_free(cluster)
