"""A prefill worker decodes a request itself when no decode worker has room (workers/prefill.py,
workers/decode_peers.py): with real worker processes and a real Redis. The decode worker
holds one request at a time (--max-num-seqs 1) and is busy with a long one (SIGSTOPped
while it holds it, so that it stays full however fast the machine; its heartbeat lives
10 s); the requests after it are decoded by the prefill worker, every answer the colocated engine's, once, its
stream gapless; with --decode-here off they wait for the decode worker instead; a warm stop
of the prefill worker finishes what it decodes."""

from __future__ import annotations

import signal

import pytest

from pdqueue.client import Client
from pdqueue.keys import Keys
from pdqueue.queue.registry import Heartbeat
from tests.cluster import Cluster
from tests.helpers import FAST, mixed_prompts, oracle, wait_for, wait_pools_free
from tests.test_migration import check_answers
from workers.decode_peers import DecodePeers

ONE_SLOT = ("--max-num-seqs", "1")
AUTO = ("--decode-here", "auto")


@pytest.fixture
def cluster(redis_url, tmp_path):
    c = Cluster(redis_url, tmp_path)
    yield c
    for name, proc in c.procs.items():
        if proc.poll() is None:
            c.signal(name, signal.SIGCONT)
    c.stop_and_check(killed_ok=True)


def full_decode_worker(cluster, client):
    """A one-slot d0 holding a long request (all the context allows: it could not end within
    the test), stopped (SIGSTOP) once its heartbeat says it has no free slot; the heartbeat
    lives 10 s from its last beat (a beat every 3.3 s). Returns the long request's handle."""
    cluster.start("decode", *FAST, *ONE_SLOT, "--heartbeat-ttl-s", "10", worker_id="d0")
    long = client.submit(prompt="Once upon a time", max_tokens=4000, temperature=0.0, ignore_eos=True)
    wait_for(lambda: cluster.workers().get("d0", {}).get("load", {}).get("free_slots") == 0,
             what="d0 full with the long request")
    cluster.signal("d0", signal.SIGSTOP)
    return long


def end_long(cluster, long) -> None:
    """d0 goes on; the long request is cancelled, and answered once, by d0."""
    cluster.signal("d0", signal.SIGCONT)
    long.cancel()
    res = long.result(timeout=120)
    assert res.decode_worker == cluster.id("d0") and res.transfer_path != "local"
    done = [f for _, f in cluster.r.xrange(Keys().done) if f[b"id"].decode() == long.request_id]
    assert len(done) == 1


def small_load(tiny, n: int, seed: int):
    prompts = mixed_prompts(n, seed=seed)
    params = [{"max_tokens": 24, "temperature": 0.0 if i % 2 else 0.9, "seed": 40 + i, "ignore_eos": True}
              for i in range(n)]
    return prompts, params, oracle(tiny, prompts, params)


def test_requests_decode_on_the_prefill_worker_while_the_decode_worker_is_full(cluster, tiny):
    prompts, params, runs = small_load(tiny, 6, seed=11)   # before d0 stops (its heartbeat lives 10 s)
    cluster.start("prefill", *FAST, *AUTO, worker_id="p0")
    client = Client(cluster.redis_url)
    long = full_decode_worker(cluster, client)
    handles = client.submit_many([dict(prompt=p, **kw) for p, kw in zip(prompts, params)])
    results = check_answers(cluster, tiny, client, handles, runs)
    p0 = cluster.id("p0")
    where = [(res.prefill_worker, res.decode_worker, res.transfer_path) for res in results]
    assert where == [(p0, p0, "local")] * len(handles), where
    # (the heartbeat's count lags the answers by up to a beat: wait for it to reach them all)
    wait_for(lambda: cluster.workers()["p0"]["load"].get("decoded_here") == len(handles),
             what=f"p0's heartbeat counting {len(handles)} requests decoded here")
    end_long(cluster, long)
    wait_pools_free(cluster)


def test_with_decode_here_off_they_wait_for_the_decode_worker(cluster, tiny):
    prompts, params, runs = small_load(tiny, 3, seed=12)   # before d0 stops (its heartbeat lives 10 s)
    cluster.start("prefill", *FAST, worker_id="p0")   # off: the default
    client = Client(cluster.redis_url)
    long = full_decode_worker(cluster, client)
    handles = client.submit_many([dict(prompt=p, **kw) for p, kw in zip(prompts, params)])
    wait_for(lambda: cluster.r.xlen(Keys().requests) == 0 and not cluster.workers()["p0"]["load"].get("running"),
             what="p0 done with the three prompts")
    finished = {f[b"id"].decode() for _, f in cluster.r.xrange(Keys().done)}
    assert not finished & {h.request_id for h in handles}   # handed over: they wait for d0
    end_long(cluster, long)   # d0's slot frees: the three go on there
    results = check_answers(cluster, tiny, client, handles, runs)
    assert {res.decode_worker for res in results} == {cluster.id("d0")}
    assert not cluster.workers()["p0"]["load"].get("decoded_here")


def test_a_warm_stopped_prefill_worker_finishes_what_it_decodes(cluster, tiny):
    prompts, params, _ = small_load(tiny, 3, seed=13)
    params = [{**kw, "max_tokens": 300} for kw in params]
    # Before d0 is stopped: its heartbeat lives 10 s after that, and on a loaded machine this
    # oracle took longer (d0 then looked gone, and p0 handed the requests off instead).
    runs = oracle(tiny, prompts, params)
    cluster.start("prefill", *FAST, *AUTO, worker_id="p0")
    client = Client(cluster.redis_url)
    long = full_decode_worker(cluster, client)
    handles = client.submit_many([dict(prompt=p, **kw) for p, kw in zip(prompts, params)])
    wait_for(lambda: cluster.workers()["p0"]["load"].get("decoded_here") == len(handles),
             what="p0 decoding the three requests")
    cluster.signal("p0", signal.SIGTERM)
    assert cluster.procs["p0"].wait(timeout=120) == 0
    results = check_answers(cluster, tiny, client, handles, runs)
    assert {res.decode_worker for res in results} == {cluster.id("p0")}
    end_long(cluster, long)


# ---- the room rule, on heartbeats in Redis ---------------------------------------------------
def test_room_counts_free_slots_and_kv_of_decode_workers_that_take_work(r):
    keys = Keys()
    peers = DecodePeers(r, keys, every_s=0)
    assert peers.room() is None                          # no decode worker: a handoff waits, as always
    Heartbeat(r, keys, "d-full", role="decode", load={"free_slots": 0, "kv_free": 100}).beat()
    assert peers.room() is False
    Heartbeat(r, keys, "d-nokv", role="decode", load={"free_slots": 4, "kv_free": 0}).beat()
    Heartbeat(r, keys, "d-stop", role="decode", load={"free_slots": 4, "kv_free": 100, "draining": 1}).beat()
    switching = Heartbeat(r, keys, "d-switch", role="decode", load={"free_slots": 4, "kv_free": 100})
    switching.update(switching_to="prefill")
    switching.beat()
    assert peers.room() is False
    Heartbeat(r, keys, "d-room", role="decode", load={"free_slots": 2, "kv_free": 100}).beat()
    assert peers.room() is True
    beat_ms = float(cluster_beat(r, keys, "d-room"))
    peers.handed_off(beat_ms - 1)                        # before its beat: the beat counts it already
    assert peers.room() is True
    peers.handed_off(beat_ms + 1)                        # after: it takes one of the 2 free slots
    assert peers.room() is True
    peers.handed_off(beat_ms + 2)
    assert peers.room() is False


def cluster_beat(r, keys, worker_id: str) -> str:
    return r.hget(keys.worker(worker_id), "beat_ms").decode()
