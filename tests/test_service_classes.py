"""Service classes (issue 27, the worker side): the request field ``class``, the stream each
class goes to, the batch gate's policy (pure), and a real cluster where batch yields."""

from __future__ import annotations

import collections
import time

import pytest

from pdqueue.client import Client
from pdqueue.engine.config import EngineConfig
from pdqueue.engine.llm_engine import LLMEngine
from pdqueue.engine.sampling import SamplingParams
from pdqueue.keys import Keys
from pdqueue.protocol import (
    ErrorCode,
    Priority,
    Request,
    RequestError,
    ServiceClass,
    entry_id_ms,
    parse_request,
    request_to_fields,
)
from pdqueue.queue.streams import request_streams
from tests.cluster import Cluster
from tests.helpers import FAST, mixed_prompts, oracle, wait_for, wait_takes_prompts
from tests.oracle import assert_same_tokens
from workers.admission import STARVE_TAKE, BatchGate
from workers.routing import _load_of, online_load

KEYS = Keys()


# ---- the request field --------------------------------------------------------------------------
def test_class_round_trips_and_an_old_producer_maps_priority_onto_a_class():
    req = Request(id="a", prompt="hi", service_class="batch")
    fields = request_to_fields(req)
    assert fields["class"] == "batch"
    assert parse_request("1-0", fields).cls is ServiceClass.BATCH
    old_high = parse_request("1-0", {"id": "b", "prompt": "hi", "priority": "high"})
    old_normal = parse_request("1-0", {"id": "c", "prompt": "hi"})
    assert old_high.service_class is None and old_high.cls is ServiceClass.INTERACTIVE
    assert old_normal.cls is ServiceClass.STANDARD
    assert "class" not in request_to_fields(old_normal)


def test_an_unknown_class_is_a_clear_error():
    with pytest.raises(RequestError, match="class must be one of interactive, standard, batch"):
        parse_request("1-0", {"id": "a", "prompt": "hi", "class": "gold"})


def test_each_class_has_its_stream_read_in_class_order():
    high = KEYS.prefix + "requests:high"
    assert KEYS.request_stream_for(ServiceClass.INTERACTIVE) == high
    assert KEYS.request_stream_for(ServiceClass("standard")) == KEYS.requests
    assert KEYS.request_stream_for(Request(id="x", prompt="p", priority=Priority.HIGH).cls) == high
    assert request_streams(KEYS) == (high, KEYS.requests, KEYS.prefix + "requests:batch")
    assert ErrorCode.DEADLINE_EXCEEDED.value == "deadline_exceeded"


# ---- the batch gate (pure) ------------------------------------------------------------------------
def gate_limit(gate, now_s, waiting=0, kv_free=90, kv_total=100, batch_running=0, want=16):
    return gate.limit(waiting=waiting, kv_free=kv_free, kv_total=kv_total, batch_running=batch_running,
                      want=want, now_s=now_s)


def test_batch_is_admitted_only_while_nothing_higher_waits_and_the_kv_is_above_the_reserve():
    gate = BatchGate(reserve=0.2, starve_s=0)
    assert gate_limit(gate, 0.0) == 16
    assert gate_limit(gate, 0.1, waiting=1) == 0          # a higher-class request waits
    assert gate_limit(gate, 0.2, kv_free=20) == 0         # at the reserve: kept for the others
    assert gate_limit(gate, 0.3, kv_free=21) == 16


def test_max_running_caps_the_batch_requests_in_the_engine():
    gate = BatchGate(max_running=4, starve_s=0)
    assert gate_limit(gate, 0.0, batch_running=1) == 3
    assert gate_limit(gate, 0.0, batch_running=4) == 0


def test_a_starved_batch_class_still_gets_its_bounded_share():
    gate = BatchGate(reserve=0.2, starve_s=5.0)
    assert gate_limit(gate, 0.0, waiting=3) == 0
    assert gate_limit(gate, 4.9, waiting=3) == 0
    assert gate_limit(gate, 5.0, waiting=3) == STARVE_TAKE   # one entry each starve_s
    assert gate_limit(gate, 5.1, waiting=3) == 0
    assert gate_limit(gate, 10.0, waiting=3) == STARVE_TAKE


def test_bad_gate_settings_are_refused():
    for kwargs in ({"reserve": 1.0}, {"reserve": -0.1}, {"max_running": -1}, {"starve_s": -1}):
        with pytest.raises(ValueError):
            BatchGate(**kwargs)


# ---- a real worker: batch yields to the interactive class -------------------------------------------
@pytest.fixture
def cluster(redis_url, tmp_path):
    c = Cluster(redis_url, tmp_path)
    yield c
    c.stop_and_check()


NUM_BATCH, NUM_INTERACTIVE, SLOTS = 12, 4, 4
PROMPTS = mixed_prompts(NUM_BATCH + NUM_INTERACTIVE, seed=27)
PARAMS = [{"max_tokens": 300 if i < NUM_BATCH else 40, "temperature": 0.0 if i % 2 else 0.8, "seed": 100 + i,
           "ignore_eos": True} for i in range(NUM_BATCH + NUM_INTERACTIVE)]


def test_interactive_requests_start_before_batch_work_queued_ahead_of_them(cluster, tiny):
    """A colocated worker with 4 slots, 12 batch requests queued first, then 4 interactive:
    batch is admitted only into free slots while nothing higher waits, so every interactive
    request starts before the fifth batch request does; every answer is the colocated
    engine's, token for token, once."""
    cluster.start("colocated", *FAST, "--max-num-seqs", str(SLOTS), worker_id="c0")
    client = Client(cluster.redis_url)
    handles = [client.submit(p, service_class="batch" if i < NUM_BATCH else "interactive", **kw)
               for i, (p, kw) in enumerate(zip(PROMPTS, PARAMS))]
    results = [h.result(timeout=180) for h in handles]
    ids, expected, sampling = oracle(tiny, PROMPTS, PARAMS)
    for pid, exp, res, sp in zip(ids, expected, results, sampling):
        assert_same_tokens(tiny, pid, exp, list(res.token_ids), sp)
    started = [entry_id_ms(h.entry_id) + res.queue_ms for h, res in zip(handles, results)]
    batch_starts = sorted(started[:NUM_BATCH])
    assert max(started[NUM_BATCH:]) <= batch_starts[SLOTS], (started[NUM_BATCH:], batch_starts)
    done = collections.Counter(f[b"id"].decode() for _, f in cluster.r.xrange(Keys().done))
    assert all(done[h.request_id] == 1 for h in handles), done


def test_a_prefill_worker_prefills_batch_only_a_few_ahead_of_the_decode_side(cluster, tiny):
    """30 batch requests and a prefill worker with no decode worker yet: it prefills
    BATCH_AHEAD of them (handed off, their KV leased) and leaves the rest in the request
    stream, where an online handoff would otherwise have waited behind them; once a decode
    worker comes, every one is answered, token for token the colocated engine's, once."""
    from workers.prefill import BATCH_AHEAD

    n = 30
    prompts = mixed_prompts(n, seed=31)
    params = [{"max_tokens": 6, "temperature": 0.0, "seed": i, "ignore_eos": True} for i in range(n)]
    cluster.start("prefill", *FAST, worker_id="p0")
    client = Client(cluster.redis_url)
    handles = [client.submit(p, service_class="batch", **kw) for p, kw in zip(prompts, params)]

    def handed_off() -> int:
        return sum(cluster.r.xlen(k) for k in cluster.r.scan_iter(match=f"{cluster.keys.handoff}*"))

    wait_for(lambda: handed_off() == BATCH_AHEAD, timeout=60)
    time.sleep(1.0)   # the tiny model prefills the other 22 in far less: a worker without the bound would have
    assert handed_off() == BATCH_AHEAD
    # The others were never read (a handed-off entry leaves the stream).
    assert cluster.r.xlen(cluster.keys.request_stream_for(ServiceClass.BATCH)) == n - BATCH_AHEAD
    cluster.start("decode", *FAST, worker_id="d0")
    results = [h.result(timeout=120) for h in handles]
    ids, expected, sampling = oracle(tiny, prompts, params)
    for pid, exp, res, sp in zip(ids, expected, results, sampling):
        assert_same_tokens(tiny, pid, exp, list(res.token_ids), sp)
    done = collections.Counter(f[b"id"].decode() for _, f in cluster.r.xrange(cluster.keys.done))
    assert all(done[h.request_id] == 1 for h in handles), done


def test_a_classed_request_past_its_deadline_is_refused_and_an_old_one_expires(cluster):
    """Both wait past their deadline with no worker; a worker then reads them: the one that
    names a class gets the error deadline_exceeded, the one without (an old producer) the
    done entry with finish_reason expired, as before."""
    from pdqueue.client import RequestFailed

    client = Client(cluster.redis_url)
    classed = client.submit("too late", max_tokens=4, deadline_ms=50, service_class="standard")
    old = client.submit("too late", max_tokens=4, deadline_ms=50)
    time.sleep(0.2)
    cluster.start("colocated", *FAST, worker_id="c0")
    with pytest.raises(RequestFailed) as failed:
        classed.result(timeout=120)
    assert failed.value.code == ErrorCode.DEADLINE_EXCEEDED.value, failed.value
    assert old.result(timeout=120).finish_reason == "expired"


# ---- deadlines inside a class: the engine's waiting order, and a deadline passed while waiting ------
def submit_together(client, specs):
    """XADD ``specs`` (build_request arguments) in one MULTI/EXEC, so that a worker's read
    takes them all at once (then they wait in its engine together)."""
    from pdqueue.client import RequestHandle, build_request

    reqs = [build_request(**spec) for spec in specs]
    with client.redis.pipeline(transaction=True) as pipe:
        for req in reqs:
            pipe.xadd(KEYS.request_stream_for(req.cls), request_to_fields(req))
        entry_ids = pipe.execute()
    return [RequestHandle(client, req.id, eid.decode()) for req, eid in zip(reqs, entry_ids)]


def test_requests_of_one_class_start_in_deadline_order_not_arrival_order(cluster, tiny):
    """A colocated worker busy with a long request and a prompt budget that admits one prompt
    a step; five standard requests arrive together, their deadlines in the reverse order of
    their arrival. They start (first token, done: max_tokens 1) earliest deadline first, each
    answer the colocated engine's token for token, and the long one's too."""
    cluster.start("colocated", *FAST, "--max-batched-tokens", "48", "--routing", "off", worker_id="c0")
    client = Client(cluster.redis_url)
    long_prompt = [(7 * i) % 250 + 3 for i in range(60)]
    long_params = {"max_tokens": 150, "temperature": 0.8, "seed": 5, "ignore_eos": True}
    long = client.submit(prompt_ids=long_prompt, **long_params)
    next(long.stream(timeout=60))                      # it runs: its first token is out
    n = 5
    prompts = [[(13 * i + 5 * k) % 250 + 3 for i in range(40)] for k in range(n)]
    deadlines = [60_000 - 10_000 * k for k in range(n)]   # arrival order: latest deadline first
    specs = [{"prompt_ids": p, "max_tokens": 1, "temperature": 0.8, "seed": 40 + k, "deadline_ms": d,
              "service_class": "standard"} for k, (p, d) in enumerate(zip(prompts, deadlines))]
    handles = submit_together(client, specs)
    results = [h.result(timeout=60) for h in handles]
    long_result = long.result(timeout=120)
    assert long_result.finish_reason == "length" and len(long_result.token_ids) == 150
    by_deadline = [h.request_id for _, h in sorted(zip(deadlines, handles), key=lambda x: x[0])]
    done_order = [f[b"id"].decode() for _, f in cluster.r.xrange(KEYS.done)]
    assert [rid for rid in done_order if rid in set(by_deadline)] == by_deadline   # not arrival order
    first_token_ms = {h.request_id: entry_id_ms(h.entry_id) + res.ttft_ms for h, res in zip(handles, results)}
    assert [first_token_ms[rid] for rid in by_deadline] == sorted(first_token_ms.values()), first_token_ms
    from pdqueue.engine.sampling import SamplingParams

    for spec, res, h in zip(specs, results, handles):
        sp = SamplingParams(max_tokens=1, temperature=0.8, seed=spec["seed"])
        [expected] = LLMEngine(tiny, EngineConfig(model="tiny", kv_cache_mb=16)).generate([spec["prompt_ids"]], sp)
        assert_same_tokens(tiny, spec["prompt_ids"], expected, list(res.token_ids), sp)
    long_sp = SamplingParams(**long_params)
    [expected] = LLMEngine(tiny, EngineConfig(model="tiny", kv_cache_mb=16)).generate([long_prompt], long_sp)
    assert_same_tokens(tiny, long_prompt, expected, list(long_result.token_ids), long_sp)


def test_an_interactive_request_is_read_while_standard_ones_wait_in_the_engine_and_goes_first(cluster, tiny):
    """A colocated worker reads 16 standard prompts at once (200 tokens each, 16 prompt tokens
    a step: they wait in its engine for ~200 steps); an interactive request sent once they are
    all read is read at once too (not after the last standard prompt has started) and, first
    in the engine's order, gets its first token before most of them. Every answer the colocated engine's."""
    cluster.start("colocated", *FAST, "--max-batched-tokens", "16", "--routing", "off", worker_id="c0")
    client = Client(cluster.redis_url)
    n = 16
    prompts = [[(11 * i + 7 * k) % 250 + 3 for i in range(200)] for k in range(n)]
    specs = [{"prompt_ids": p, "max_tokens": 1, "temperature": 0.0, "seed": k, "service_class": "standard"}
             for k, p in enumerate(prompts)]
    standard = submit_together(client, specs)
    last = standard[-1].entry_id.encode()
    wait_for(lambda: any(g["last-delivered-id"] == last for g in cluster.r.xinfo_groups(KEYS.requests)),
             timeout=30, what="c0 reading the 16 standard requests", interval=0.002)
    chat_prompt = [(5 * i) % 250 + 3 for i in range(20)]
    chat = client.submit(prompt_ids=chat_prompt, max_tokens=4, temperature=0.0, service_class="interactive")
    chat_result = chat.result(timeout=60)
    results = [h.result(timeout=120) for h in standard]
    # its first token (prefill_first: its later tokens wait until no prompt does) against the
    # standard ones' single tokens
    done_ms = {f[b"id"].decode(): entry_id_ms(eid) for eid, f in cluster.r.xrange(KEYS.done)}
    chat_first_ms = entry_id_ms(chat.entry_id) + chat_result.ttft_ms
    before = sum(done_ms[h.request_id] < chat_first_ms for h in standard)
    assert before <= n // 2, (f"{before} of {n} standard requests answered before the interactive one's first token",
                              entry_id_ms(chat.entry_id), chat_first_ms,
                              sorted(done_ms[h.request_id] for h in standard))
    sp = SamplingParams(max_tokens=4, temperature=0.0)
    [expected] = LLMEngine(tiny, EngineConfig(model="tiny", kv_cache_mb=16)).generate([chat_prompt], sp)
    assert_same_tokens(tiny, chat_prompt, expected, list(chat_result.token_ids), sp)
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    outs = LLMEngine(tiny, EngineConfig(model="tiny", kv_cache_mb=16)).generate(prompts, sp)
    for p, exp, res in zip(prompts, outs, results):
        assert_same_tokens(tiny, p, exp, list(res.token_ids), sp)


def test_a_classed_request_whose_deadline_passes_while_it_waits_in_the_engine_is_refused_at_once(cluster):
    """A 1 MB pool (2048 tokens) held by a long request (600 prompt tokens, 1400 more to
    come); a standard request whose 1500-token prompt cannot get its blocks waits in the
    engine. Its 1 s deadline passes there: it is answered deadline_exceeded within about a
    step of it, long before the long request ends, and leaves the engine (waiting back to 0
    in the heartbeat); the long request runs on to its end, and a request without a deadline
    queued behind the refused one then runs."""
    from pdqueue.client import RequestFailed

    cluster.start("colocated", *FAST, "--kv-cache-mb", "1", "--routing", "off", worker_id="c0")
    client = Client(cluster.redis_url)
    long = client.submit(prompt_ids=[(3 * i) % 250 + 3 for i in range(600)], max_tokens=1400, temperature=0.0,
                         ignore_eos=True, service_class="interactive")
    next(long.stream(timeout=60))
    deadline_ms = 1000
    late = client.submit(prompt_ids=[(5 * i) % 250 + 3 for i in range(1500)], max_tokens=4, temperature=0.0,
                         deadline_ms=deadline_ms, service_class="standard")
    after = client.submit(prompt_ids=[11] * 30, max_tokens=3, temperature=0.0, service_class="standard")
    with pytest.raises(RequestFailed) as failed:
        late.result(timeout=30)
    refused_ms = time.time() * 1000
    assert failed.value.code == ErrorCode.DEADLINE_EXCEEDED.value, failed.value
    assert "before the first token" in failed.value.reason, failed.value.reason
    waited = refused_ms - entry_id_ms(late.entry_id)
    assert deadline_ms <= waited < deadline_ms + 1000, waited   # promptly: not when the long one ends
    assert all(f[b"type"] != b"done" for _, f in cluster.r.xrange(KEYS.out(long.request_id))), \
        "the long request ended first: the refusal was not prompt"
    assert all(f[b"type"] != b"token" for _, f in cluster.r.xrange(KEYS.out(late.request_id)))   # nothing computed
    # It left the engine: the request queued behind it is read and answered while the long one still runs.
    assert after.result(timeout=60).finish_reason == "length"
    assert long.result(timeout=120).finish_reason == "length"
    done_order = [f[b"id"].decode() for _, f in cluster.r.xrange(KEYS.done)]
    assert done_order.index(after.request_id) < done_order.index(long.request_id), done_order
    wait_for(lambda: cluster.workers()["c0"]["load"]["kv_free"] == cluster.workers()["c0"]["load"]["kv_total"],
             timeout=10, what="every block back in the pool")
    dead = [f for _, f in cluster.r.xrange(KEYS.dead) if f.get(b"field:id") == late.request_id.encode()]
    assert [f[b"code"] for f in dead] == [b"deadline_exceeded"]


def test_a_prefill_worker_refuses_a_classed_request_whose_deadline_passes_in_its_engine(cluster):
    """A prefill worker with a 1 MB pool (2048 tokens) and no decode worker: a 1500-token
    prompt is prefilled and its KV stays held under its lease (10 s) for a decode worker;
    a standard request with a 1000-token prompt then waits in the engine for blocks. Its 1 s
    deadline passes there: it is answered deadline_exceeded within a second of it, with no
    token, while the lease still holds the pool."""
    from pdqueue.client import RequestFailed

    cluster.start("prefill", *FAST, "--kv-cache-mb", "1", "--routing", "off", "--placement", "off", worker_id="p0")
    client = Client(cluster.redis_url)
    held = client.submit(prompt_ids=[(3 * i) % 250 + 3 for i in range(1500)], max_tokens=4, temperature=0.0,
                         service_class="standard")
    next(held.stream(timeout=60))   # prefilled: its blocks are now the lease's
    deadline_ms = 1000
    late = client.submit(prompt_ids=[(5 * i) % 250 + 3 for i in range(1000)], max_tokens=4, temperature=0.0,
                         deadline_ms=deadline_ms, service_class="standard")
    with pytest.raises(RequestFailed) as failed:
        late.result(timeout=30)
    waited = time.time() * 1000 - entry_id_ms(late.entry_id)
    assert failed.value.code == ErrorCode.DEADLINE_EXCEEDED.value, failed.value
    assert "before the first token" in failed.value.reason, failed.value.reason
    assert deadline_ms <= waited < deadline_ms + 1000, waited
    assert all(f[b"type"] != b"token" for _, f in cluster.r.xrange(KEYS.out(late.request_id)))
    assert cluster.workers()["p0"]["load"]["leases"] == 1   # the pool was still held: it waited in the engine


def long_then_late(cluster, long_tokens: int, long_max_tokens: int, late_tokens: int, deadline_ms: int):
    """A long standard request, once it decodes (holding the decode worker's pool), then a
    standard request of ``late_tokens`` with ``deadline_ms``, which cannot get its blocks
    there until the long one ends. Returns their handles."""
    client = Client(cluster.redis_url)
    long = client.submit(prompt_ids=[(3 * i) % 250 + 3 for i in range(long_tokens)], max_tokens=long_max_tokens,
                         temperature=0.0, ignore_eos=True, service_class="standard")
    wait_for(lambda: len(cluster.r.xrange(KEYS.out(long.request_id))) > 3, timeout=60, what="the long one decoding")
    late = client.submit(prompt_ids=[(5 * i) % 250 + 3 for i in range(late_tokens)], max_tokens=8, temperature=0.0,
                         ignore_eos=True, deadline_ms=deadline_ms, service_class="standard")
    return long, late


def test_a_handoff_whose_deadline_passes_while_it_waits_for_kv_is_answered_then(cluster):
    """A decode worker with a 2 MB pool (4096 tiny tokens), 2000 of them held by a long
    request that grows to 4000; a second request's first token comes from the prefill worker
    (which does not decode here) and its handoff (a 2500-token prompt) waits in the decode
    worker's backlog for blocks. Its 1 s deadline passes there: it ends done / expired with
    that one token within a second of the deadline, long before the blocks free
    (DecodeRole.housekeeping reads the backlog's deadlines too), its lease given back; the
    long request runs on to its end."""
    cluster.start("prefill", *FAST, "--decode-here", "off", worker_id="p0")
    cluster.start("decode", *FAST, "--kv-cache-mb", "2", worker_id="d0")
    deadline_ms = 1000
    long, late = long_then_late(cluster, 2000, 2000, 2500, deadline_ms)
    result = late.result(timeout=60)
    answered_ms = time.time() * 1000
    assert result.finish_reason == "expired" and len(result.token_ids) == 1, result   # its first token only
    waited = answered_ms - entry_id_ms(late.entry_id)
    assert deadline_ms <= waited < deadline_ms + 1000, waited   # not when the long one's blocks free
    assert all(f[b"type"] != b"done" for _, f in cluster.r.xrange(KEYS.out(long.request_id))), \
        "the long request ended first: the answer came when the blocks freed, not at the deadline"
    assert long.result(timeout=120).finish_reason == "length"
    done = collections.Counter(f[b"id"].decode() for _, f in cluster.r.xrange(KEYS.done))
    assert done[late.request_id] == 1 and done[long.request_id] == 1, done


def test_a_placed_prompt_whose_deadline_passes_on_the_decode_worker_is_refused_there(cluster):
    """A prefill worker placing every short prompt (<= 1024 tokens) on a decode worker that
    takes prompts, whose 2 MB pool (4096 tokens) a long request handed over with its KV
    holds (3100 prompt tokens, growing to 4090); a classed request's 1000-token prompt is
    placed there and waits in its backlog for blocks. Its 1 s deadline passes with no token
    out: the decode worker answers deadline_exceeded, as a colocated or prefill worker would
    (DecodeRole.answer_expired), within a second of it, before the long one ends."""
    from pdqueue.client import RequestFailed

    cluster.start("prefill", *FAST, "--placement", "always", "--decode-here", "off", worker_id="p0")
    cluster.start("decode", *FAST, "--kv-cache-mb", "2", "--take-prompts", "--policy", "chunked",
                  "--tbt-slo-ms", "200", worker_id="d0")
    wait_takes_prompts(cluster)
    deadline_ms = 1000
    long, late = long_then_late(cluster, 3100, 990, 1000, deadline_ms)
    with pytest.raises(RequestFailed) as failed:
        late.result(timeout=60)
    assert all(f[b"type"] != b"done" for _, f in cluster.r.xrange(KEYS.out(long.request_id))), \
        "the long request ended first: the refusal came when the blocks freed, not at the deadline"
    refused_ms = time.time() * 1000
    assert failed.value.code == ErrorCode.DEADLINE_EXCEEDED.value, failed.value
    assert f"placed on worker {cluster.id('d0')}" in failed.value.reason, failed.value.reason
    waited = refused_ms - entry_id_ms(late.entry_id)
    assert deadline_ms <= waited < deadline_ms + 1000, waited
    assert all(f[b"type"] != b"token" for _, f in cluster.r.xrange(KEYS.out(late.request_id)))   # nothing computed
    assert long.result(timeout=120).finish_reason == "length"
    assert long.result().decode_worker == cluster.id("d0")
    wait_for(lambda: cluster.workers()["d0"]["load"]["kv_free"] == cluster.workers()["d0"]["load"]["kv_total"],
             timeout=10, what="every block back in d0's pool")


def test_the_gateway_answers_deadline_exceeded_as_a_timeout():
    from pdqueue.frontends.openai_compat import worker_error

    error = worker_error("deadline_exceeded", "deadline passed before the first token (12 ms ago)")
    assert error.status == 504 and error.code == "deadline_exceeded" and "12 ms ago" in error.message


def test_routing_weighs_a_peer_by_its_online_work_only(tiny):
    """Batch work yields to online work wherever it runs, so cache-aware routing compares
    online requests (the heartbeat's ``online``; running + waiting from a worker without it)."""
    engine = LLMEngine(tiny, EngineConfig(kv_cache_mb=8))
    engine.add_request("batch", [3] * 20, SamplingParams(max_tokens=4), rank=ServiceClass.BATCH.rank)
    engine.add_request("chat", [4] * 20, SamplingParams(max_tokens=4))
    assert online_load(engine) == 1
    engine.step()   # both admitted and running
    assert engine.num_running == 2 and online_load(engine) == 1
    assert _load_of({"load": {"running": 5, "waiting": 2, "online": 1}}) == 1
    assert _load_of({"load": {"running": 5, "waiting": 2}}) == 7


def test_an_imported_sequence_is_told_its_class(tiny):
    """A decode worker reserves imported KV with the request's class rank: one of a class
    that yields takes a background slot (there are none left here once one runs) and is
    background once reserved, as one the engine prefilled itself would be."""
    engine = LLMEngine(tiny, EngineConfig(kv_cache_mb=8, max_num_seqs=4, max_background_seqs=1))
    batch = ServiceClass.BATCH.rank
    assert engine.kv_import.can_reserve(10, rank=batch)
    seq = engine.kv_import.reserve("imported", [3] * 9, SamplingParams(max_tokens=4), [5], rank=batch)
    engine.kv_import.add_prefilled(seq)
    assert seq.rank == batch and engine.scheduler.share.yields(seq) and engine.scheduler.num_background == 1
    kv = engine.kv_import
    assert not kv.can_reserve(10, rank=batch) and kv.can_reserve(10, rank=ServiceClass.INTERACTIVE.rank)
    assert engine.scheduler.preempt_background() and engine.scheduler.waiting[0] is seq   # it yields its room


def test_everything_about_a_class_derives_from_its_row():
    """The protocol's ServiceClass is the one table: the streams, the read order of a request
    role, the ACL's producer streams, the gateway's online backlog, the engine's yielding ranks,
    the front ends' names and fields, submit's --class and a classless request's class all
    follow its rows (so a new class is a row and this test)."""
    import click

    from pdqueue.frontends.service_classes import SERVICE_CLASSES, class_fields
    from pdqueue.protocol import YIELDING_RANKS
    from workers.cli.acl import role_rules
    from workers.cli.submit import submit
    from workers.routing import Router

    classes = list(ServiceClass)
    assert [c.rank for c in classes] == list(range(len(classes)))
    assert request_streams(KEYS) == tuple(KEYS.prefix + c.stream for c in classes)
    assert len(set(request_streams(KEYS))) == len(classes) and ServiceClass.STANDARD.stream == "requests"
    router = Router(None, KEYS, "w1", role=None, mode="off")
    online = [KEYS.request_stream_for(c) for c in classes if not c.yields]
    assert [s for s in router.read_streams() if s != router.own] == online
    assert router.read_streams().index(router.own) == next(i for i, c in enumerate(c for c in classes if not c.yields)
                                                           if c.routed)
    assert router.all_streams() == [*router.read_streams(), *(KEYS.request_stream_for(c) for c in classes if c.yields)]
    assert router._routed == {KEYS.request_stream_for(c) for c in classes if c.routed}
    producer = role_rules(KEYS, "producer")
    assert all(f"~{KEYS.request_stream_for(c)}" in producer for c in classes)
    assert YIELDING_RANKS == {c.rank for c in classes if c.yields}
    assert SERVICE_CLASSES == tuple(c.value for c in classes)
    choices = next(p for p in submit.params if p.name == "service_class").type
    assert isinstance(choices, click.Choice) and tuple(choices.choices) == SERVICE_CLASSES
    for c in classes:
        req = Request(id="x", prompt="p", **class_fields(c.value))
        assert req.cls is c and req.rank == c.rank and req.background == c.yields
        assert parse_request("1-0", request_to_fields(req)).cls is c
        if c.priority is not None:
            assert Request(id="x", prompt="p", priority=c.priority).cls is c   # an older producer's request
