"""Prompt placement (workers/placement.py): a prefill worker sends short prompts to a decode
worker that takes prompts when it would answer sooner; that worker prefills them beside its
decodes. With real worker processes and a real Redis: every answer is the colocated
engine's, token for token, once, also when the decode worker dies holding placed prompts;
and the rule itself on heartbeats written to Redis and a real engine's cost model."""

from __future__ import annotations

import signal
import time

import pytest

from pdqueue.client import Client
from pdqueue.engine.config import EngineConfig
from pdqueue.engine.llm_engine import LLMEngine
from pdqueue.engine.sampling import SamplingParams
from pdqueue.keys import PREFILL_GROUP, Keys
from pdqueue.protocol import as_str
from pdqueue.queue.registry import Heartbeat, list_workers
from tests.cluster import Cluster
from tests.helpers import FAST, mixed_prompts, oracle, wait_for, wait_pools_free, wait_takes_prompts
from tests.test_metrics import endpoint, scrape, total
from tests.test_migration import check_answers
from workers.placement import MAX_PROMPT_TOKENS, MIN_WAIT_S, Placement, SpareTime, local_wait_s

N = 8
TAKES = ("--take-prompts", "--policy", "chunked", "--tbt-slo-ms", "200")


@pytest.fixture
def cluster(redis_url, tmp_path):
    c = Cluster(redis_url, tmp_path)
    yield c
    c.stop_and_check(killed_ok=True)


def load(tiny, n: int, max_tokens: int, seed: int):
    prompts = mixed_prompts(n, seed=seed)
    params = [{"max_tokens": max_tokens, "temperature": 0.0 if i % 2 else 0.9, "seed": 10 + i, "ignore_eos": True}
              for i in range(n)]
    return prompts, params, oracle(tiny, prompts, params)


def test_placed_prompts_are_prefilled_on_the_decode_worker_token_for_token(cluster, tiny):
    cluster.start_together(("prefill", *FAST, "--placement", "always", {"worker_id": "p0"}),
                           ("decode", *FAST, *TAKES, {"worker_id": "d0"}))
    wait_takes_prompts(cluster)
    prompts, params, runs = load(tiny, N, 24, seed=3)
    client = Client(cluster.redis_url)
    handles = client.submit_many([dict(prompt=p, **kw) for p, kw in zip(prompts, params)])
    results = check_answers(cluster, tiny, client, handles, runs)
    placed = [res for res in results if res.prefill_worker == cluster.id("d0")]
    lengths = [len(tiny.tokenizer.encode(p)) for p in prompts]
    assert len(placed) == sum(n <= MAX_PROMPT_TOKENS for n in lengths) > 0, (lengths, results)
    assert {res.transfer_path for res in placed} == {"local"}
    assert all(res.ttft_ms > 0 and res.decode_worker == cluster.id("d0") for res in placed)
    wait_for(lambda: cluster.workers()["p0"]["load"].get("placed_out") == len(placed),
             what="p0's heartbeat counting them")
    # ... and their metrics say so: prompts placed (prefill), their tokens prefilled (decode)
    p0, d0 = endpoint(cluster, "p0"), endpoint(cluster, "d0")
    assert total(scrape(p0), "pdqueue:prompts_placed_total") == len(placed)
    assert total(scrape(d0), "pdqueue:placed_prompt_tokens_total") == sum(res.num_prompt_tokens for res in placed)
    wait_pools_free(cluster)


def test_a_prefill_worker_with_prompts_waiting_reads_on_and_places_the_short_ones_behind_them(cluster):
    """Placement decides at intake, so a prefill worker whose engine holds waiting prompts still
    reads the stream while a decode worker has room (``reads_ahead``): the short prompts queued
    behind long ones are placed at once, not once the long ones have started."""
    # One prompt at a time, 8 tokens a step: each long prompt takes ~150 steps.
    cluster.start_together(("prefill", *FAST, "--placement", "always", "--max-num-seqs", "1", "--policy", "chunked",
                            "--max-batched-tokens", "8", {"worker_id": "p0"}),
                           ("decode", *FAST, *TAKES, {"worker_id": "d0"}))
    wait_takes_prompts(cluster)
    client = Client(cluster.redis_url)
    text = "the quick brown fox " * 60   # 1200 tokens: past MAX_PROMPT_TOKENS, never placed
    longs = client.submit_many([dict(prompt=f"{i} {text}", max_tokens=2, temperature=0.0) for i in range(12)])
    # Once p0 holds all 12, 11 of them wait in its engine
    wait_for(lambda: cluster.r.xpending(cluster.keys.requests, PREFILL_GROUP)["pending"] == len(longs),
             what="p0 holding the long prompts")
    shorts = client.submit_many([dict(prompt=f"short prompt {i}", max_tokens=4, temperature=0.0) for i in range(4)])
    results = [h.result(timeout=60) for h in shorts]
    finished = {as_str(f.get(b"id", f.get("id"))) for _, f in cluster.r.xrange(cluster.keys.done)}
    longs_done = sum(h.request_id in finished for h in longs)
    assert all(res.prefill_worker == cluster.id("d0") for res in results), results
    # Read only once no prompt waited, they would have come after 11 of the 12 had started.
    assert longs_done <= 5, f"the short prompts were answered after {longs_done} of 12 long ones"
    assert all(h.result(timeout=120).num_prompt_tokens > MAX_PROMPT_TOKENS for h in longs)
    wait_pools_free(cluster)


def test_has_room_while_a_decode_worker_taking_prompts_has_a_free_slot_and_a_short_wait(r):
    hb = decode_beat(r, "d0", prompt_tok_s=100.0, free_slots=1)
    placer = Placement(r, Keys(), "p0")
    assert placer.has_room(time.monotonic())
    hb.update(prompt_backlog=300)   # 3 s of prompt tokens there
    hb.beat()
    time.sleep(0.6)   # the placer reads heartbeats every 0.5 s
    assert not placer.has_room(time.monotonic())
    assert Placement(r, Keys(), "p1", mode="always").has_room(time.monotonic())   # always: a free slot is enough
    hb.update(prompt_backlog=0, free_slots=0)
    hb.beat()
    time.sleep(0.6)
    assert not placer.has_room(time.monotonic())


def test_a_decode_worker_killed_holding_placed_prompts_loses_nothing(cluster, tiny):
    """d0 holds placed prompts, some prefilled and streaming; SIGKILL; d1 (started after,
    so that d0 took them all) takes its entries over: prompts not started are prefilled
    there, the others go on from what out:<id> shows (recompute). Each answer once, exact."""
    cluster.start_together(("prefill", *FAST, "--placement", "always", {"worker_id": "p0"}),
                           ("decode", *FAST, *TAKES, {"worker_id": "d0"}))
    wait_takes_prompts(cluster)
    # 400 tokens (~3 s of decoding alone, more under load): the kill comes as soon as d0's
    # heartbeat shows the placed prompts running, and d1 starts only after it (1500 before:
    # the oracle and d1's recompute decoded 4x as much for the same check).
    prompts, params, runs = load(tiny, N, 400, seed=5)
    short = [i for i, p in enumerate(prompts) if len(tiny.tokenizer.encode(p)) <= MAX_PROMPT_TOKENS]
    client = Client(cluster.redis_url)
    handles = client.submit_many([dict(prompt=p, **kw) for p, kw in zip(prompts, params)])
    d0_running = lambda: cluster.workers()["d0"]["load"].get("running", 0) >= len(short)   # noqa: E731
    wait_for(d0_running, what="every placed prompt running on d0")
    cluster.signal("d0", signal.SIGKILL)
    cluster.procs["d0"].wait(timeout=10)
    cluster.start("decode", *FAST, *TAKES, worker_id="d1")
    results = check_answers(cluster, tiny, client, handles, runs)
    assert {results[i].decode_worker for i in short} == {cluster.id("d1")}
    # The times stay true across the takeover: token 0 of a prompt d0 prefilled came out when
    # d0 published it (its out:<id> entry), not at the epoch (a TTFT of minus 56 years).
    for res in results:
        assert 0 < res.ttft_ms < 600_000 and 0 <= res.prefill_ms <= res.ttft_ms, res


# ---- the rule, on heartbeats in Redis and a real engine's cost model ------------------------
def decode_beat(r, worker_id: str, **load) -> Heartbeat:
    base = {"takes_prompts": 1, "prompt_tok_s": 200.0, "prompt_backlog": 0, "free_slots": 8, "accepting": True}
    hb = Heartbeat(r, Keys(), worker_id, role="decode", node="n1", load={**base, **load})
    hb.beat()
    return hb


def prefill_engine(tiny, seconds_per_token: float) -> LLMEngine:
    """A prefill engine whose step cost model has seen steps costing ``seconds_per_token``."""
    engine = LLMEngine(tiny, EngineConfig(kv_cache_mb=8), prefill_only=True)
    for tokens in (50, 100, 200, 400, 100, 300):
        engine.scheduler.cost.observe(0, tokens, 0.002 + seconds_per_token * tokens)
    return engine


def queue(engine, num_tokens: int) -> None:
    engine.add_request(f"q{num_tokens}", list(range(3, 3 + num_tokens)), SamplingParams(max_tokens=1))


def test_an_unloaded_prefill_worker_keeps_its_prompts(r, tiny):
    decode_beat(r, "d0")
    engine = prefill_engine(tiny, 0.001)
    assert local_wait_s(engine, 40) < MIN_WAIT_S
    assert Placement(r, Keys(), "p0").place(engine, 40) is None


def test_a_queued_prefill_worker_places_short_prompts_while_the_decode_worker_answers_sooner(r, tiny):
    decode_beat(r, "d0", prompt_tok_s=400.0, free_slots=3)
    engine = prefill_engine(tiny, 0.003)
    queue(engine, 500)   # 1.5 s of prompt tokens ahead here
    placer = Placement(r, Keys(), "p0")
    assert placer.place(engine, MAX_PROMPT_TOKENS + 1) is None   # long prompts stay
    assert placer.place(engine, 40) == Keys().handoff_node("n1")
    assert placer.place(engine, 40) == Keys().handoff_node("n1")
    assert placer.place(engine, 40) == Keys().handoff_node("n1")
    assert placer.place(engine, 40) is None   # its 3 free slots are taken by what we sent
    assert placer.placed == 3


def test_a_heartbeat_with_an_interval_beats_that_often_and_never_slower_than_ttl_over_3(r):
    fast = Heartbeat(r, Keys(), "fast", role="decode", ttl_s=9.0, interval_s=0.2).start()
    capped = Heartbeat(r, Keys(), "capped", role="decode", ttl_s=0.6, interval_s=5.0)
    try:
        assert capped.interval_s == pytest.approx(0.2)
        wait_for(lambda: fast.beats >= 4, timeout=5, what="4 beats of a heartbeat beating every 0.2 s")
    finally:
        fast.stop()


def test_a_decode_worker_with_a_prompt_backlog_or_not_taking_prompts_gets_none(r, tiny):
    engine = prefill_engine(tiny, 0.003)
    queue(engine, 200)   # 0.6 s here
    hb = decode_beat(r, "d0", prompt_backlog=400)   # 2 s there
    placer = Placement(r, Keys(), "p0")
    assert placer.place(engine, 40) is None
    hb.update(prompt_backlog=0, draining=1)
    hb.beat()
    time.sleep(0.6)   # the placer reads heartbeats every 0.5 s
    assert placer.place(engine, 40) is None
    hb.update(draining=0, takes_prompts=0)
    hb.beat()
    time.sleep(0.6)
    assert placer.place(engine, 40) is None
    hb.update(takes_prompts=1)
    hb.beat()
    time.sleep(0.6)
    assert placer.place(engine, 40) == Keys().handoff_node("n1")


def test_spare_time_follows_what_the_decodes_leave_of_the_clock():
    now = [0.0]   # its own clock (time.sleep(0.01) under load slept 15 ms: "all the time" read 0.14)
    spare = SpareTime(tau_s=0.1, clock=lambda: now[0])
    for _ in range(40):   # decodes stepping half the time
        now[0] += 0.01
        spare.add(0.005)
    assert 0.45 < spare.share < 0.55, spare.share
    for _ in range(60):   # stepping all the time
        now[0] += 0.01
        spare.add(0.01)
    assert spare.share < 0.01, spare.share
    now[0] += 0.5   # idle for 5 tau: nearly all of it spare again
    spare.add(0.0)
    assert spare.share > 0.99, spare.share


def test_spare_time_counts_a_step_against_the_tbt_step_budget():
    """A decode worker stepping back to back has no idle time, but decode steps of 60 ms
    under a 100 ms step budget leave 40 % of what each step may take: the spare share reads
    that, not 0; steps that use the spare for prompt chunks (decode part 60 ms of 100 ms
    steps) read the same; and decodes longer than the budget leave nothing."""
    now = [0.0]
    spare = SpareTime(tau_s=0.1, clock=lambda: now[0])
    for _ in range(40):   # 60 ms decode steps, back to back
        now[0] += 0.06
        spare.add(0.06, frame_s=0.1)
    assert 0.38 < spare.share < 0.42, spare.share
    for _ in range(40):   # 100 ms steps: 60 ms of decodes + 40 ms of a prompt chunk
        now[0] += 0.1
        spare.add(0.06, frame_s=0.1)
    assert 0.38 < spare.share < 0.42, spare.share
    for _ in range(40):   # 150 ms of decodes alone
        now[0] += 0.15
        spare.add(0.15, frame_s=0.1)
    assert spare.share < 0.01, spare.share
    for _ in range(40):   # without a budget the same 60 ms steps back to back leave nothing
        now[0] += 0.06
        spare.add(0.06)
    assert spare.share < 0.01, spare.share


def test_the_gap_guard_stops_placed_prompts_while_the_decode_steps_run_long(redis_url, tiny):
    """The decode role's own heartbeat (a real WorkerShell on a real Redis, its engine on the
    chunked policy with a 200 ms TBT target): with plenty of spare time it advertises a
    prompt rate and a prefill worker places a prompt there; once the p90 of its last 32
    steps with decodes passes GAP_GUARD x 200 ms, it advertises 0 and gets none, though its
    spare share is unchanged; back under, it takes prompts again. Fewer than 8 steps
    recorded are no evidence either way."""
    from workers.common import WorkerConfig
    from workers.decode import DecodeRole
    from workers.placement import GAP_GUARD, RECENT_STEPS
    from workers.shell import WorkerShell

    target_ms = 200.0
    engine = EngineConfig(model="tiny", num_threads=1, kv_cache_mb=8, policy="chunked", tbt_slo_ms=target_ms)
    shell = WorkerShell(WorkerConfig(redis_url=redis_url, engine=engine, heartbeat_ttl_s=30.0, take_prompts=True),
                        tiny, DecodeRole())
    try:
        shell._start_role(shell.role)   # the engine, the groups, the load in the heartbeat
        shell._register()
        role = shell.role
        prefill = prefill_engine(tiny, 0.003)
        queue(prefill, 500)   # 1.5 s of prompt tokens ahead at the prefill worker

        def advertised(steps_s: list[float]) -> dict:
            """The load a prefill worker reads after the decode role's last steps took
            ``steps_s`` (its step-time record, as ``step`` keeps it)."""
            role.recent_steps.clear()
            role.recent_steps.extend(steps_s)
            role.spare.share = 0.9   # its decodes leave 90 % of the clock, whatever the steps
            shell.tick()       # the load, as after each step
            shell.beat_now()   # written to Redis
            [me] = [w for w in list_workers(shell.r, shell.keys) if w["worker_id"] == shell.worker_id]
            return me["load"]

        def placed(steps_s: list[float]) -> tuple[dict, str | None]:
            """That load, and where a (new) placer at a queued prefill worker sends a prompt."""
            load = advertised(steps_s)
            return load, Placement(shell.r, shell.keys, "p0").place(prefill, 40)

        guard_ms = GAP_GUARD * target_ms
        fast = [0.05] * RECENT_STEPS                                    # p90 50 ms
        edge_under = [0.05] * 28 + [(guard_ms - 5) / 1000] * 4          # p90 just under the guard
        slow = [0.05] * 24 + [(guard_ms + 5) / 1000] * 8                # p90 just past the guard
        few_slow = [1.0] * 7                                            # too few to judge
        for steps, open_ in ((fast, True), (slow, False), (edge_under, True), ([1.0] * RECENT_STEPS, False),
                             (few_slow, True), (fast, True)):
            load, where = placed(steps)
            assert load["takes_prompts"] == 1 and load["spare"] == 0.9, load
            if open_:
                assert load["prompt_tok_s"] > 0 and where == shell.keys.handoff_node(shell.node), (steps, load, where)
            else:
                assert load["prompt_tok_s"] == 0 and where is None, (steps, load, where)
    finally:
        shell.close()
