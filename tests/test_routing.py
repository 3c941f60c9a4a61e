"""Cache-aware routing (workers/routing.py) with real worker processes and a real Redis:
a conversation's next turn runs where its earlier turn's KV is cached; entries routed to a
worker that hangs or dies are taken over; every request gets exactly one outcome."""

from __future__ import annotations

import json
import signal
import time

import pytest

from pdqueue.client import Client
from pdqueue.keys import Keys
from tests.helpers import oracle, wait_for
from tests.oracle import assert_same_tokens
from workers.role import IDLE_BLOCK_MS
from workers.routing import REFRESH_S

BS = 16
SYSTEM = "You are a patient assistant who answers questions about animals in one short sentence. "


def conversation(i: int) -> tuple[str, str]:
    """Turn 1 and turn 2 of conversation ``i``: turn 2 resends turn 1 and adds to it."""
    turn1 = f"[conversation {i}] " + SYSTEM * 2 + f"Tell me about animal number {i}."
    return turn1, turn1 + f" It lives in forest {i}. And what does it eat in winter, number {i}?"


def greedy(n: int = 4) -> dict:
    return {"max_tokens": n, "temperature": 0.0, "seed": 0}


def load_of(cluster, name: str) -> dict:
    raw = cluster.r.hget(Keys(cluster.cluster).worker(cluster.id(name)), "load")
    return json.loads(raw or b"{}")


def test_a_next_turn_runs_where_its_prefix_is_cached(cluster, tiny):
    """Two colocated workers: each conversation's second turn runs on the worker that ran its
    first (cache-aware routing moves it there when the other one reads it), hits the cache,
    and gives the colocated engine's tokens. Cache-blind, about half would land elsewhere.
    The second turns go one at a time, as the first ones: sent all at once, those routed to
    the busier worker could wait there past TAKEOVER_AFTER_MS on a loaded machine, and the
    idle one then takes them over (as it should: the owner lags), cache or not (a full run
    once saw 2 of 8 land elsewhere)."""
    cluster.start_together(("colocated", {"worker_id": "a"}), ("colocated", {"worker_id": "b"}))
    client = Client(cluster.redis_url, cluster.cluster)
    convs = [conversation(i) for i in range(8)]
    first = [client.submit(t1, **greedy()).result(timeout=60) for t1, _ in convs]
    assert {r.prefill_worker for r in first} == {cluster.id("a"), cluster.id("b")}, "both should have served"
    second = [client.submit(t2, **greedy()).result(timeout=60) for _, t2 in convs]
    prompts = [t2 for _, t2 in convs]
    ids, expected, sampling = oracle(tiny, prompts, [greedy()] * len(prompts))
    for i, res in enumerate(second):
        assert_same_tokens(tiny, ids[i], expected[i], list(res.token_ids), sampling[i])
    turn1_blocks = [len(tiny.tokenizer.encode(t1)) // BS for t1, _ in convs]
    placed = [(r1.prefill_worker == r2.prefill_worker, r2.cached_tokens // BS, n)
              for r1, r2, n in zip(first, second, turn1_blocks)]
    assert all(same and cached >= n for same, cached, n in placed), \
        (placed, [line for w in ("a", "b") for line in cluster.log(w).splitlines() if "took over" in line])
    routed = sum(load_of(cluster, w).get("routed_out", 0) for w in ("a", "b"))
    assert routed <= len(convs)


def test_requests_routed_to_a_hung_worker_are_taken_over_exactly_once(cluster, tiny):
    """Worker a caches the conversations, then hangs (SIGSTOP; its heartbeat lives on). Worker
    b routes the next turns to a's stream; nobody reads them there, so b takes them over
    after TAKEOVER_AFTER_MS and answers them. When a wakes it answers nothing twice."""
    cluster.start("colocated", "--heartbeat-ttl-s", "60", worker_id="a")
    client = Client(cluster.redis_url, cluster.cluster)
    convs = [conversation(100 + i) for i in range(4)]
    for t1, _ in convs:
        assert client.submit(t1, **greedy()).result(timeout=60).prefill_worker == cluster.id("a")
    # b reclaims after 3 s (not the default 15): a, stopped while blocked in its idle read of
    # `requests`, still gets the first turn sent (Redis serves a blocked XREADGROUP whether
    # or not its client runs); b takes that entry of a hung worker once it has been idle that long.
    cluster.start("colocated", "--reclaim-idle-ms", "3000", worker_id="b")
    wait_for(lambda: cluster.r.scard(Keys(cluster.cluster).routed_streams) == 2, 10, "both own streams")
    time.sleep(2 * REFRESH_S)   # b's view of its peers, re-read every REFRESH_S, includes a
    cluster.signal("a", signal.SIGSTOP)
    try:
        handles = [client.submit(t2, **greedy()) for _, t2 in convs]
        results = [h.result(timeout=60) for h in handles]
    finally:
        cluster.signal("a", signal.SIGCONT)
        woke = time.monotonic()
    prompts = [t2 for _, t2 in convs]
    ids, expected, sampling = oracle(tiny, prompts, [greedy()] * len(prompts))
    for i, res in enumerate(results):
        assert_same_tokens(tiny, ids[i], expected[i], list(res.token_ids), sampling[i])
    assert {r.prefill_worker for r in results} == {cluster.id("b")}
    wait_for(lambda: load_of(cluster, "b").get("taken_over", 0) >= 1, 10, "b's heartbeat counting take-overs")
    assert load_of(cluster, "b")["routed_out"] >= 1
    # a is awake again: it must not answer any of them a second time. What it would answer
    # with is what it read before it was stopped, so it would do so within its first loop
    # iterations: wait 20 of its idle reads (IDLE_BLOCK_MS each). (A consumer's idle time is
    # no clock of its reads here: Redis 7.0 restarts it only on reads that deliver.)
    wait_for(lambda: cluster.procs["a"].poll() is None and time.monotonic() - woke > 20 * IDLE_BLOCK_MS / 1000,
             what="a awake for 20 read periods")
    keys = Keys(cluster.cluster)
    for h in handles:
        kinds = [f[b"type"] for _, f in cluster.r.xrange(keys.out(h.request_id))]
        assert kinds.count(b"done") == 1 and b"error" not in kinds, kinds
    done_ids = [f[b"id"].decode() for _, f in cluster.r.xrange(keys.done)]
    assert sorted(i for i in done_ids if i in {h.request_id for h in handles}) == sorted(h.request_id for h in handles)


def test_a_dead_workers_routed_requests_are_served_and_its_stream_goes(cluster, tiny):
    """Entries waiting in the own stream of a worker that was killed are read by a live one
    at once (no heartbeat: no waiting), and the dead worker's empty stream is removed."""
    cluster.start("colocated", "--heartbeat-ttl-s", "2", worker_id="a")
    keys = Keys(cluster.cluster)
    cluster.signal("a", signal.SIGKILL)
    cluster.procs.pop("a").wait()   # killed on purpose: not among those that must stop cleanly
    wait_for(lambda: not cluster.r.exists(keys.worker(cluster.id("a"))), 10, "a's heartbeat gone")
    own = keys.requests_for(cluster.id("a"))
    client = Client(cluster.redis_url, cluster.cluster)
    # As if a peer had routed them there just before a died (the script a router runs).
    from pdqueue.queue.ownership import forward
    from pdqueue.queue.streams import read_group

    handles = []
    for i in range(3):
        h = client.submit(f"routed before the crash {i}", **greedy())
        (stream, entry_id, fields), = read_group(cluster.r, "prefill", "router-probe", [keys.requests], count=1)
        assert forward(cluster.r, stream, "prefill", entry_id, fields, own, keys.seen(h.request_id)) == 1
        handles.append(h)
    cluster.r.xgroup_delconsumer(keys.requests, "prefill", "router-probe")
    cluster.start("colocated", worker_id="b")
    results = [h.result(timeout=60) for h in handles]
    assert {r.prefill_worker for r in results} == {cluster.id("b")}
    wait_for(lambda: not cluster.r.exists(own) and cluster.r.sismember(keys.routed_streams, own) == 0, 10,
             "the dead worker's empty stream removed")


def test_forward_moves_an_entry_exactly_once(r):
    """The script: a pending entry moves once; a second attempt (it is no longer pending) does
    nothing; a destination that does not exist leaves the entry where it is."""
    from pdqueue.queue.ownership import forward
    from pdqueue.queue.streams import ensure_group, read_group

    keys = Keys("fwd")
    ensure_group(r, keys.requests, "prefill")
    ensure_group(r, keys.requests_for("w2"), "prefill")
    r.xadd(keys.requests, {"id": "x", "prompt": "hi"})
    r.set(keys.seen("x"), "0-1", ex=60)
    (stream, entry_id, fields), = read_group(r, "prefill", "w1", [keys.requests], count=1)
    assert forward(r, stream, "prefill", entry_id, fields, keys.requests_for("nobody"), keys.seen("x")) == 0
    assert r.xpending(keys.requests, "prefill")["pending"] == 1
    assert forward(r, stream, "prefill", entry_id, fields, keys.requests_for("w2"), keys.seen("x")) == 1
    assert forward(r, stream, "prefill", entry_id, fields, keys.requests_for("w2"), keys.seen("x")) == -1
    moved = r.xrange(keys.requests_for("w2"))
    assert len(moved) == 1 and moved[0][1][b"id"] == b"x" and r.xlen(keys.requests) == 0
    assert r.get(keys.seen("x")) == moved[0][0]   # the new entry is not a duplicate of the old
    assert 0 < r.ttl(keys.seen("x")) <= 60


@pytest.mark.parametrize("routing", ["cache", "off"])
def test_routing_option_and_heartbeat(cluster, routing):
    cluster.start("colocated", "--routing", routing, worker_id="a")
    load = load_of(cluster, "a")
    assert load["routed_out"] == 0 and load["taken_over"] == 0
    keys = Keys(cluster.cluster)
    assert cluster.r.sismember(keys.routed_streams, keys.requests_for(cluster.id("a")))
    res = Client(cluster.redis_url, cluster.cluster).submit(SYSTEM * 3, **greedy()).result(timeout=60)
    advertised = list(cluster.r.scan_iter(match=keys.prefix_owner("*")))
    assert bool(advertised) == (routing == "cache"), advertised
    assert res.finish_reason in ("length", "stop")
