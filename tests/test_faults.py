"""Fault injection: a worker killed or hung mid-request, a Redis restart. Every request
completes exactly once from the client's view, with the colocated engine's tokens, and
nothing leaks (blocks, segments)."""

from __future__ import annotations

import collections
import signal
import time

import pytest
import redis

from pdqueue.client import Client
from pdqueue.keys import Keys
from pdqueue.models.loader import load_model
from pdqueue.queue.redis_server import RedisServer
from tests.cluster import Cluster
from tests.oracle import assert_same_tokens
from tests.test_pipeline import mixed_prompts, oracle, wait_pools_free

FAST = ("--heartbeat-ttl-s", "1.5", "--reclaim-idle-ms", "3000", "--fetch-timeout-s", "2", "--lease-s", "10")


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


@pytest.fixture
def cluster(redis_url, tmp_path):
    c = Cluster(redis_url, tmp_path)
    yield c
    c.stop_all()
    assert not c.segments([w for w, p in c.procs.items() if p.returncode == 0])


def submit(cluster, tiny, n: int, max_tokens: int, seed: int = 0):
    prompts = mixed_prompts(n, seed)
    # Long requests run to max_tokens, so that a fault lands mid-generation.
    params = [{"max_tokens": max_tokens, "temperature": 0.0 if i % 2 else 0.9, "seed": 10 + i,
               "ignore_eos": max_tokens >= 100} for i in range(n)]
    prompt_ids, expected, sampling = oracle(tiny, prompts, params)
    client = Client(cluster.redis_url)
    handles = client.submit_many([dict(prompt=p, **kw) for p, kw in zip(prompts, params)])
    return client, handles, prompt_ids, (expected, sampling)


def check_all(cluster, tiny, client, handles, prompt_ids, expected, timeout=120):
    """Every request answered once, with the oracle's tokens; streams without gaps."""
    results = [h.result(timeout=timeout) for h in handles]
    expected, sampling = expected
    for pid, exp, res, sp in zip(prompt_ids, expected, results, sampling):
        assert_same_tokens(tiny, pid, exp, list(res.token_ids), sp)
    done = redis.Redis.from_url(cluster.redis_url).xrange(Keys().done)
    counts = collections.Counter(f[b"id"].decode() for _, f in done)
    assert all(counts[h.request_id] == 1 for h in handles), {h.request_id: counts[h.request_id] for h in handles
                                                               if counts[h.request_id] != 1}
    for h, res in zip(handles[:6], results):
        streamed = [t for e in client.handle(h.request_id).stream(timeout=10) for t in e.token_ids]
        assert streamed == list(res.token_ids)
    return results


def wait_for(pred, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def out_len(cluster, rid) -> int:
    return redis.Redis.from_url(cluster.redis_url).xlen(Keys().out(rid))


def test_prefill_killed_mid_batch(cluster, tiny):
    cluster.start("prefill", *FAST, worker_id="p0")
    cluster.start("decode", *FAST, worker_id="d0")
    client, handles, ids, expected = submit(cluster, tiny, 24, 8)
    cluster.signal("p0", signal.SIGKILL)  # whatever it had taken is pending under p0
    cluster.start("prefill", *FAST, worker_id="p1")
    check_all(cluster, tiny, client, handles, ids, expected)
    wait_pools_free(cluster)


def kill_prefill_after_handoffs(cluster, tiny, n: int):
    """Start prefill p0, submit ``n`` requests, SIGKILL p0 once all their handoffs are out
    (no decode worker runs yet, so none was fetched). Returns what ``check_all`` needs."""
    cluster.start("prefill", *FAST, worker_id="p0")
    client, handles, ids, expected = submit(cluster, tiny, n, 10)
    r = redis.Redis.from_url(cluster.redis_url)
    wait_for(lambda: r.xlen(Keys().handoff) == n, what=f"{n} handoffs")
    cluster.signal("p0", signal.SIGKILL)
    cluster.procs["p0"].wait()
    return client, handles, ids, expected


def test_prefill_killed_after_handoff_before_fetch(cluster, tiny):
    """The KV of a SIGKILLed prefill worker outlives it in its segment: nobody can rewrite
    those blocks any more (the epochs still match the tickets), so a decode worker on the
    node copies them and does not recompute."""
    client, handles, ids, expected = kill_prefill_after_handoffs(cluster, tiny, 8)
    cluster.start("decode", *FAST, worker_id="d0")
    results = check_all(cluster, tiny, client, handles, ids, expected)
    assert {res.transfer_path for res in results} == {"shm"}
    # A SIGKILLed owner cannot unlink its segment; the next prefill start on this node removes
    # it (or any other pdqueue prefill starting on this host, whatever its Redis).
    cluster.start("prefill", *FAST, worker_id="p1")
    assert not cluster.segments(["p0"])
    wait_pools_free(cluster)


def test_prefill_killed_and_its_segment_removed_before_fetch(cluster, tiny):
    """Once the dead worker's segment is removed, its tickets cannot be served by any path
    (no segment, a refused TCP connection, a silent ZeroMQ endpoint): every request is
    recomputed by the decode worker and still gives the colocated engine's tokens."""
    client, handles, ids, expected = kill_prefill_after_handoffs(cluster, tiny, 4)
    wait_for(lambda: "p0" not in cluster.workers(), what="p0's heartbeat to expire")
    cluster.start("prefill", *FAST, worker_id="p1")   # its start removes p0's segment
    assert not cluster.segments(["p0"])
    cluster.start("decode", *FAST, worker_id="d0")
    results = check_all(cluster, tiny, client, handles, ids, expected)
    assert {res.transfer_path for res in results} == {"recompute"}
    wait_pools_free(cluster)


def test_decode_killed_mid_generation(cluster, tiny):
    cluster.start("prefill", *FAST, worker_id="p0")
    cluster.start("decode", *FAST, worker_id="d0")
    client, handles, ids, expected = submit(cluster, tiny, 6, 300)
    wait_for(lambda: all(out_len(cluster, h.request_id) > 5 for h in handles), what="tokens flowing")
    cluster.signal("d0", signal.SIGKILL)
    killed_at = time.monotonic()
    cluster.start("decode", *FAST, worker_id="d1")
    results = check_all(cluster, tiny, client, handles, ids, expected)
    assert any(r.transfer_path == "recompute" and r.decode_worker == cluster.id("d1") for r in results)
    print(f"recovered {time.monotonic() - killed_at:.1f}s after the kill")
    wait_pools_free(cluster)


def test_hung_decode_worker_is_taken_over_and_answers_once(cluster, tiny):
    cluster.start("prefill", *FAST, worker_id="p0")
    cluster.start("decode", *FAST, worker_id="d0")
    cluster.start("decode", *FAST, worker_id="d1")
    client, handles, ids, expected = submit(cluster, tiny, 8, 300)
    wait_for(lambda: all(out_len(cluster, h.request_id) > 3 for h in handles), what="tokens flowing")
    cluster.signal("d0", signal.SIGSTOP)
    time.sleep(4.0)  # longer than the heartbeat TTL and the reclaim idle time
    cluster.signal("d0", signal.SIGCONT)
    check_all(cluster, tiny, client, handles, ids, expected)
    assert cluster.procs["d0"].poll() is None, "the hung worker resumes and goes on"
    wait_pools_free(cluster)


def test_redis_restart_with_requests_in_flight(tmp_path, tiny):
    server = RedisServer(appendonly=True).start()
    c = Cluster(server.url, tmp_path)
    try:
        c.start("prefill", *FAST, worker_id="p0")
        c.start("decode", *FAST, worker_id="d0")
        client, handles, ids, expected = submit(c, tiny, 12, 200)
        wait_for(lambda: sum(out_len(c, h.request_id) > 0 for h in handles) >= 4, what="first answers")
        server.restart()
        client = Client(server.url)
        check_all(c, tiny, client, [client.handle(h.request_id) for h in handles], ids, expected)
        wait_pools_free(c)
        codes = c.stop_all()
        assert all(code == 0 for code in codes.values()), {w: c.log(w) for w in codes}
    finally:
        c.kill_all()   # only a failed test leaves any running
        server.stop()


def test_delivery_lost_with_the_connection_is_taken_in_again(tmp_path, tiny):
    """An XREADGROUP whose reply dies with the connection leaves the entry in the worker's
    pending list, unknown to it, and nobody reclaims a live worker's own entries. After a
    Redis error the worker compares its pending list with what it holds and takes the rest
    in again. Simulated exactly: a transaction delivers a request to p0's consumer name
    (so p0's blocked read never sees it), then Redis restarts."""
    server = RedisServer(appendonly=True).start()
    c = Cluster(server.url, tmp_path)
    try:
        c.start("prefill", *FAST, worker_id="p0")
        c.start("decode", *FAST, worker_id="d0")
        prompt_ids, expected, sampling = oracle(tiny, ["lost and found"], [{"max_tokens": 12, "temperature": 0.0, "seed": 1}])
        r = redis.Redis.from_url(server.url)
        with r.pipeline(transaction=True) as pipe:
            pipe.xadd(Keys().requests, {"id": "lost-1", "prompt": "lost and found", "max_tokens": "12",
                                        "temperature": "0", "seed": "1"})
            pipe.xreadgroup("prefill", c.id("p0"), {Keys().requests: ">"}, count=1)
            _, delivered = pipe.execute()
        assert delivered, "the transaction should have delivered the entry to p0's name"
        time.sleep(0.5)
        assert out_len(c, "lost-1") == 0   # p0 does not know it has it
        server.restart()
        client = Client(server.url)
        check_all(c, tiny, client, [client.handle("lost-1")], prompt_ids, (expected, sampling), timeout=60)
        assert "taking in again 1 entries" in c.log("p0")
        codes = c.stop_all()
        assert all(code == 0 for code in codes.values()), {w: c.log(w) for w in codes}
    finally:
        c.kill_all()   # only a failed test leaves any running
        server.stop()


@pytest.mark.parametrize("layout", ["disaggregated", "colocated"])
def test_cancel_and_deadline_stop_the_work_and_free_blocks(cluster, layout):
    if layout == "disaggregated":
        cluster.start("prefill", *FAST, worker_id="p0")
        cluster.start("decode", *FAST, worker_id="d0")
    else:
        cluster.start("colocated", *FAST, worker_id="c0")
    client = Client(cluster.redis_url)
    cancel_me = client.submit("cancel me", max_tokens=3000, temperature=0, ignore_eos=True)
    expire_me = client.submit("expire me", max_tokens=3000, temperature=0, ignore_eos=True, deadline_ms=1500)
    wait_for(lambda: out_len(cluster, cancel_me.request_id) > 3, what="tokens flowing")
    client.cancel(cancel_me.request_id)
    cancelled = cancel_me.result(timeout=30)
    expired = expire_me.result(timeout=30)
    assert cancelled.finish_reason == "cancelled" and 0 < cancelled.num_tokens < 3000
    assert expired.finish_reason == "expired" and expired.num_tokens < 3000
    assert expired.e2e_ms < 1500 + 1000
    wait_pools_free(cluster)


def test_warm_stop_drains_a_decode_worker(cluster, tiny):
    """The first SIGTERM: running sequences finish; what it had not started goes to others."""
    cluster.start("prefill", *FAST, worker_id="p0")
    cluster.start("decode", *FAST, worker_id="d0")
    cluster.start("decode", *FAST, worker_id="d1")
    client, handles, ids, expected = submit(cluster, tiny, 12, 150)
    wait_for(lambda: sum(out_len(cluster, h.request_id) > 2 for h in handles) >= 6, what="tokens flowing")
    assert cluster.stop("d0") == 0
    check_all(cluster, tiny, client, handles, ids, expected)
    wait_pools_free(cluster)
