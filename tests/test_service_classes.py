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
from pdqueue.protocol import (ErrorCode, Priority, Request, RequestError, ServiceClass, entry_id_ms, parse_request,
                              request_to_fields)
from tests.cluster import Cluster
from tests.helpers import FAST, mixed_prompts, oracle
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
    assert KEYS.request_stream_for(ServiceClass.INTERACTIVE) == KEYS.requests_high
    assert KEYS.request_stream_for("standard") == KEYS.requests
    assert KEYS.request_stream_for(Request(id="x", prompt="p", priority=Priority.HIGH).cls) == KEYS.requests_high
    assert KEYS.request_streams == (KEYS.requests_high, KEYS.requests, KEYS.requests_batch)
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


def test_routing_weighs_a_peer_by_its_online_work_only(tiny):
    """Batch work yields to online work wherever it runs, so cache-aware routing compares
    online requests (the heartbeat's ``online``; running + waiting from a worker without it)."""
    engine = LLMEngine(tiny, EngineConfig(kv_cache_mb=8))
    engine.add_request("batch", [3] * 20, SamplingParams(max_tokens=4), background=True)
    engine.add_request("chat", [4] * 20, SamplingParams(max_tokens=4))
    assert online_load(engine) == 1
    engine.step()   # both admitted and running
    assert engine.num_running == 2 and online_load(engine) == 1
    assert _load_of({"load": {"running": 5, "waiting": 2, "online": 1}}) == 1
    assert _load_of({"load": {"running": 5, "waiting": 2}}) == 7
