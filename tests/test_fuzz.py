"""Fuzzing the workers' inputs: thousands of random entries into ``requests`` and the
handoff stream. No worker exits; every bad entry ends on ``dead`` with a reason; good
requests sent in between all complete."""

from __future__ import annotations

import time

import msgpack
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdqueue.client import Client
from pdqueue.keys import Keys
from pdqueue.protocol import REQUEST_FIELDS
from tests.cluster import Cluster

names = st.one_of(st.sampled_from(REQUEST_FIELDS), st.binary(min_size=1, max_size=12))
values = st.one_of(st.binary(max_size=40), st.text(max_size=40).map(str.encode),
                   st.integers(-2**70, 2**70).map(lambda i: str(i).encode()),
                   st.sampled_from([b"", b"-1", b"0", b"nan", b"[1,2", b"[]", b"[-5]", b"1e999", b"high", b"\xff"]))
entries = st.dictionaries(names, values, min_size=1, max_size=6)
handoff_bodies = st.one_of(
    entries,
    st.builds(lambda body: {b"id": b"h", b"data": msgpack.packb(body)},
              st.dictionaries(st.sampled_from(["version", "request", "prompt_ids", "output_ids", "seed", "ticket",
                                               "prefill_worker", "attempt"]),
                              st.one_of(st.integers(-3, 2**40), st.text(max_size=5), st.none(),
                                        st.lists(st.integers(0, 2**20), max_size=5),
                                        st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=3)),
                              max_size=8)),
)


SENT = {"requests": [], "good": [], "handoffs": 0}


@pytest.fixture(scope="module")
def fuzz_cluster(redis_server, tmp_path_factory):
    redis.Redis.from_url(redis_server.url).flushall()
    c = Cluster(redis_server.url, tmp_path_factory.mktemp("fuzz"))
    c.start("prefill", worker_id="fp")
    c.start("decode", worker_id="fd")
    yield c
    codes = c.stop_all()
    assert all(code == 0 for code in codes.values()), {w: c.log(w) for w in codes}


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(batch=st.lists(entries, min_size=3, max_size=20))
def test_fuzz_requests(fuzz_cluster, batch):
    r = redis.Redis.from_url(fuzz_cluster.redis_url)
    keys = Keys()
    with r.pipeline(transaction=False) as pipe:
        for fields in batch:
            rid = f"fuzz-{len(SENT['requests'])}"
            fields = {k: v for k, v in fields.items() if k not in ("id", b"id")}
            fields["id"] = rid
            pipe.xadd(keys.requests, fields)
            SENT["requests"].append(rid)
        rid = f"good-{len(SENT['good'])}"
        pipe.xadd(keys.requests, {"id": rid, "prompt": "still fine", "max_tokens": "3", "temperature": "0"})
        SENT["good"].append(rid)
        pipe.execute()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(batch=st.lists(handoff_bodies, min_size=5, max_size=20))
def test_fuzz_handoffs(fuzz_cluster, batch):
    r = redis.Redis.from_url(fuzz_cluster.redis_url)
    with r.pipeline(transaction=False) as pipe:
        for fields in batch:
            pipe.xadd(Keys().handoff, fields)
        pipe.execute()
    SENT["handoffs"] += len(batch)


def test_fuzz_outcome(fuzz_cluster):
    """Every fuzz entry answered (an error with a dead-letter copy, or a completion if it
    happened to be valid); every good request completed; no worker exited."""
    assert len(SENT["requests"]) > 1000 and SENT["handoffs"] > 200
    r = redis.Redis.from_url(fuzz_cluster.redis_url)
    keys = Keys()
    client = Client(fuzz_cluster.redis_url)
    for rid in SENT["good"]:
        assert client.handle(rid).result(timeout=120).num_tokens == 3
    deadline = time.monotonic() + 60
    while r.xlen(keys.requests) or r.xlen(keys.handoff):  # acked entries are deleted
        assert time.monotonic() < deadline, (r.xlen(keys.requests), r.xlen(keys.handoff))
        time.sleep(0.2)
    for rid in SENT["requests"]:
        assert r.xlen(keys.out(rid)), f"{rid} got no answer"
    dead = r.xrange(keys.dead, count=100000)
    assert all(f[b"reason"] for _, f in dead)
    assert [f[b"source"] for _, f in dead].count(keys.handoff.encode()) == SENT["handoffs"]
    assert all(p.poll() is None for p in fuzz_cluster.procs.values()), "a worker exited"
    print(f"\nfuzz: {len(SENT['requests'])} random requests, {SENT['handoffs']} random handoffs, "
          f"{len(dead)} dead-lettered")
