"""Running requests that move with their KV (workers/migration.py): a decode worker that is
stopped warm hands its running requests to a peer, which goes on token for token; nothing
is lost or answered twice when the receiver dies mid-move or when no peer takes work."""

from __future__ import annotations

import collections
import re
import signal
import time

import pytest

from pdqueue.client import Client
from pdqueue.keys import Keys
from pdqueue.protocol import entry_id_ms
from tests.cluster import Cluster
from tests.helpers import FAST, mixed_prompts, oracle, wait_for, wait_pools_free
from tests.oracle import assert_same_tokens

# Tiny decodes ~150 steps/s: 600 tokens (~4 s alone, more under load) are long enough to be
# caught mid-way where every worker is started before the load. LONG_TOKENS for the two
# tests that must start a decode worker while the load runs (one started before it would
# read some of the prefill worker's burst of handoffs: a blocked XREADGROUP is served even
# to a frozen worker): that start (`import torch`, seconds under load) falls inside the window.
N, MAX_TOKENS, LONG_TOKENS = 8, 600, 1500


@pytest.fixture
def cluster(redis_url, tmp_path):
    c = Cluster(redis_url, tmp_path)
    yield c
    c.stop_and_check(killed_ok=True)


PROMPTS = mixed_prompts(N, seed=7)
PARAMS = [{"max_tokens": MAX_TOKENS, "temperature": 0.0 if i % 2 else 0.9, "seed": 40 + i, "ignore_eos": True}
          for i in range(N)]
LONG_PARAMS = [{**p, "max_tokens": LONG_TOKENS} for p in PARAMS]


@pytest.fixture(scope="module")
def runs(tiny):
    """The colocated engine's answers to PROMPTS (the same load in every test)."""
    return oracle(tiny, PROMPTS, PARAMS)


@pytest.fixture(scope="module")
def long_runs(tiny):
    """The same with LONG_PARAMS."""
    return oracle(tiny, PROMPTS, LONG_PARAMS)


def submit(cluster, runs, params=PARAMS):
    client = Client(cluster.redis_url)
    handles = client.submit_many([dict(prompt=p, **kw) for p, kw in zip(PROMPTS, params)])
    return client, handles, runs


def out_of(cluster, rid) -> list:
    return cluster.r.xrange(Keys().out(rid))


def all_streaming_on(cluster, handles, worker: str) -> bool:
    load = cluster.workers().get(worker, {}).get("load", {})
    return load.get("running", 0) == len(handles) and all(len(out_of(cluster, h.request_id)) > 5 for h in handles)


def check_answers(cluster, tiny, client, handles, oracle_runs):
    """Every request answered once, with the colocated engine's tokens, its stream gapless."""
    ids, expected, sampling = oracle_runs
    results = [h.result(timeout=120) for h in handles]
    for pid, exp, res, sp in zip(ids, expected, results, sampling):
        assert_same_tokens(tiny, pid, exp, list(res.token_ids), sp)
    done = collections.Counter(f[b"id"].decode() for _, f in cluster.r.xrange(Keys().done))
    assert all(done[h.request_id] == 1 for h in handles), done
    for h, res in zip(handles, results):
        streamed = [t for e in client.handle(h.request_id).stream(timeout=10) for t in e.token_ids]
        assert streamed == list(res.token_ids)
    return results


def moved_by(cluster, worker: str) -> int:
    """How many running requests ``worker`` moved (its drain's log line), 0 if none."""
    m = re.search(r"migration: (\d+) running requests moved", cluster.log(worker) or "")
    return int(m.group(1)) if m else 0


def test_a_warm_stopped_decode_worker_moves_its_running_requests_with_their_kv(cluster, tiny, runs):
    """Both decode workers run before the load (a worker started later could arrive after
    the requests ended, on a loaded machine); one of them stops while it decodes some of
    them (either: the prefill worker's handoffs come in one burst, which one read may take
    whole)."""
    cluster.start_together(("prefill", *FAST, {"worker_id": "p0"}), ("decode", *FAST, {"worker_id": "d0"}),
                           ("decode", *FAST, {"worker_id": "d1"}))
    client, handles, runs = submit(cluster, runs)

    def holder() -> str | None:
        if not all(len(out_of(cluster, h.request_id)) > 5 for h in handles):
            return None
        workers = cluster.workers()
        return next((d for d in ("d0", "d1") if workers[d]["load"].get("running", 0) > 0), None)

    stopping = wait_for(holder, what="tokens flowing, some on a decode worker")
    staying = "d1" if stopping == "d0" else "d0"
    stopped = time.monotonic()
    cluster.signal(stopping, signal.SIGTERM)
    assert cluster.procs[stopping].wait(timeout=30) == 0
    took = time.monotonic() - stopped
    results = check_answers(cluster, tiny, client, handles, runs)
    moved = moved_by(cluster, stopping)
    assert moved > 0, cluster.log(stopping)
    # Every request ended on the other one, those it got with the KV they had (copied, not recomputed).
    assert {res.decode_worker for res in results} == {cluster.id(staying)}
    assert {res.transfer_path for res in results} <= {"shm", "tcp", "zmq"}, {res.transfer_path for res in results}
    print(f"{stopping} stopped in {took:.2f} s, {moved} requests moved")
    wait_pools_free(cluster)


def test_decode_workers_stopped_together_finish_their_own_requests(cluster, tiny, runs):
    """Two decode workers stopped at once (as `pdqueue up` stops them) must not hand their
    requests to each other: nobody would be left to take them."""
    cluster.start_together(("prefill", *FAST, {"worker_id": "p0"}), ("decode", *FAST, {"worker_id": "d0"}),
                           ("decode", *FAST, {"worker_id": "d1"}))
    client, handles, runs = submit(cluster, runs)
    wait_for(lambda: all(len(out_of(cluster, h.request_id)) > 5 for h in handles), what="tokens flowing")
    cluster.signal("d0", signal.SIGTERM)
    cluster.signal("d1", signal.SIGTERM)
    assert cluster.procs["d0"].wait(timeout=60) == 0 and cluster.procs["d1"].wait(timeout=60) == 0
    results = check_answers(cluster, tiny, client, handles, runs)
    assert all(res.transfer_path != "recompute" for res in results)


def test_a_receiver_killed_mid_move_loses_nothing(cluster, tiny, long_runs):
    """d0 moves its requests to d1, which is frozen and then killed before it serves them;
    a new decode worker takes them (fetching the KV while d0 still serves it, or
    recomputing): every request still gives the colocated engine's tokens, once."""
    # d0's leases last 4 s (FAST's 10 s would keep it serving the KV nobody fetches that long)
    cluster.start_together(("prefill", *FAST, {"worker_id": "p0"}),
                           ("decode", *FAST, "--lease-s", "4", {"worker_id": "d0"}))
    client, handles, runs = submit(cluster, long_runs, LONG_PARAMS)
    wait_for(lambda: all(len(out_of(cluster, h.request_id)) > 5 for h in handles)
             and cluster.workers()["d0"]["load"].get("running", 0) > 0, what="tokens flowing, some on d0")
    # d1 only now: started with d0, it could read the prefill worker's whole burst of handoffs.
    # Its heartbeat lives 8 s (renewed every 2.7 s): alive to d0 for 5 s or more after the
    # freeze, d0 reads its peers within a second of its SIGTERM; d2 takes d1's entries once it is gone.
    cluster.start("decode", *FAST, "--heartbeat-ttl-s", "8", worker_id="d1")
    cluster.signal("d1", signal.SIGSTOP)   # alive to d0, serving nothing
    cluster.signal("d0", signal.SIGTERM)
    assert cluster.procs["d0"].wait(timeout=60) == 0
    assert moved_by(cluster, "d0") > 0, cluster.log("d0")
    cluster.signal("d1", signal.SIGKILL)
    cluster.start("decode", *FAST, worker_id="d2")
    results = check_answers(cluster, tiny, client, handles, runs)
    assert {res.decode_worker for res in results} == {cluster.id("d2")}
    wait_pools_free(cluster)


def test_a_stopped_colocated_worker_moves_its_decodes_to_a_decode_worker(cluster, tiny, runs):
    """A colocated worker finishes its request entries with handoffs of its running
    requests (prompt, tokens so far, KV): a decode worker goes on with them."""
    # (d0 reads handoffs only: c0 takes every request)
    cluster.start_together(("colocated", *FAST, {"worker_id": "c0"}), ("decode", *FAST, {"worker_id": "d0"}))
    client, handles, runs = submit(cluster, runs)
    wait_for(lambda: all_streaming_on(cluster, handles, "c0"), what="every request decoding on c0")
    stopped = time.monotonic()
    cluster.signal("c0", signal.SIGTERM)
    assert cluster.procs["c0"].wait(timeout=30) == 0
    took = time.monotonic() - stopped
    unfinished = [h for h in handles if not any(f[b"type"] == b"done" for _, f in out_of(cluster, h.request_id))]
    assert unfinished, "every request ended before c0 did: nothing was moved"
    results = check_answers(cluster, tiny, client, handles, runs)
    moved = [res for h, res in zip(handles, results) if h in unfinished]
    assert {(res.prefill_worker, res.decode_worker) for res in moved} == {(cluster.id("c0"), cluster.id("d0"))}
    assert {res.transfer_path for res in moved} <= {"shm", "tcp", "zmq"}
    print(f"c0 stopped in {took:.2f} s, {len(moved)} requests moved")
    wait_pools_free(cluster)


def test_a_migrate_command_moves_running_decodes_off_a_serving_colocated_worker(cluster, tiny, runs):
    """The planner's lever (op=migrate): c0 keeps its role and takes work, moves up to 3 of
    its running decodes to d0 with their KV, and every answer is token for token the
    colocated engine's, once; a budget command sets c0's TBT budget and is refused by d0."""
    from pdqueue.control import commands

    cluster.start_together(("colocated", *FAST, "--policy", "chunked", "--tbt-slo-ms", "200", {"worker_id": "c0"}),
                           ("decode", *FAST, {"worker_id": "d0"}))
    c0, keys = cluster.id("c0"), cluster.keys
    assert cluster.workers()["c0"]["load"].get("tbt_budget_ms") == 200
    client, handles, runs = submit(cluster, runs)
    wait_for(lambda: all_streaming_on(cluster, handles, "c0"), what="every request decoding on c0")
    done = commands.wait_switch(cluster.r, keys, commands.send_migrate(cluster.r, keys, c0, 3, by="test"), 60)
    assert done is not None and done["status"] == "done" and done["type"] == "migrate", done
    assert done["moved"] == "3", done
    budget = commands.wait_switch(cluster.r, keys, commands.send_budget(cluster.r, keys, c0, 120.0), 30)
    assert budget["status"] == "done", budget
    wait_for(lambda: cluster.workers()["c0"]["load"].get("tbt_budget_ms") == 120, what="c0 reports its new budget")
    refused = commands.wait_switch(cluster.r, keys, commands.send_budget(cluster.r, keys, cluster.id("d0"), 120.0), 30)
    assert refused["status"] == "refused" and "has no TBT budget" in refused["reason"], refused
    results = check_answers(cluster, tiny, client, handles, runs)
    moved = [res for res in results if res.decode_worker == cluster.id("d0")]
    assert len(moved) == 3 and {res.prefill_worker for res in moved} == {c0}
    assert {res.transfer_path for res in moved} <= {"shm", "tcp", "zmq"}   # the KV travelled
    assert {res.decode_worker for res in results if res not in moved} == {c0}
    assert cluster.workers()["c0"]["role"] == "colocated" and cluster.procs["c0"].poll() is None
    wait_pools_free(cluster)


def test_a_sender_killed_mid_move_loses_nothing(cluster, tiny, runs):
    """c0 (switchable: its KV pool is a shared segment) moves 3 running decodes to d0 on a
    migrate command while d0 is frozen, and is SIGKILLed before d0 fetched any of them: the
    handoffs are in Redis and the KV in c0's segment for the lease, so d0 copies it from
    the dead worker's segment and goes on; the 5 requests c0 still ran are taken over by c1
    from what out:<id> shows. Every answer the colocated engine's, once."""
    from pdqueue.control import commands

    cluster.start_together(("colocated", *FAST, "--switchable", {"worker_id": "c0"}),
                           # (its heartbeat keeps it alive to c0 while it is frozen)
                           ("decode", *FAST, "--heartbeat-ttl-s", "20", {"worker_id": "d0"}))
    client, handles, runs = submit(cluster, runs)
    wait_for(lambda: all_streaming_on(cluster, handles, "c0"), what="every request decoding on c0")
    cluster.signal("d0", signal.SIGSTOP)
    cid = commands.send_migrate(cluster.r, cluster.keys, cluster.id("c0"), 3, by="test")
    done = commands.wait_switch(cluster.r, cluster.keys, cid, 30)
    assert done is not None and done["status"] == "done" and done["moved"] == "3", done
    cluster.signal("c0", signal.SIGKILL)   # mid-move: handed off, its KV not fetched yet
    cluster.procs["c0"].wait()
    cluster.start("colocated", *FAST, worker_id="c1")
    cluster.signal("d0", signal.SIGCONT)
    results = check_answers(cluster, tiny, client, handles, runs)
    moved = [res for res in results if res.decode_worker == cluster.id("d0")]
    assert len(moved) == 3 and {res.prefill_worker for res in moved} == {cluster.id("c0")}
    assert {res.transfer_path for res in moved} == {"shm"}   # copied out of the dead worker's segment
    assert {res.decode_worker for res in results if res not in moved} == {cluster.id("c1")}
    wait_pools_free(cluster)


def test_a_sender_killed_while_it_serves_the_moved_kv_loses_nothing(cluster, tiny, long_runs):
    """d0 (a plain pool: its KV goes over TCP) is stopped warm and moves every running
    request to d1, which is frozen; d0 is SIGKILLed while it waits to serve that KV (its
    drain). d1 then finds the sender gone, the fetch fails, and it recomputes from prompt +
    tokens so far: every answer the colocated engine's, once."""
    cluster.start_together(("prefill", *FAST, {"worker_id": "p0"}), ("decode", *FAST, {"worker_id": "d0"}))
    client, handles, runs = submit(cluster, long_runs, LONG_PARAMS)
    wait_for(lambda: all_streaming_on(cluster, handles, "d0"), what="every request decoding on d0")
    cluster.start("decode", *FAST, "--heartbeat-ttl-s", "20", worker_id="d1")   # alive to d0 while frozen
    cluster.signal("d1", signal.SIGSTOP)
    cluster.signal("d0", signal.SIGTERM)
    wait_for(lambda: cluster.workers().get("d0", {}).get("load", {}).get("migrated_out") == N,
             what="d0 to have moved every request")
    assert cluster.procs["d0"].poll() is None, "d0 should still serve the moved KV (d1 fetched none)"
    cluster.signal("d0", signal.SIGKILL)
    cluster.procs["d0"].wait()
    cluster.signal("d1", signal.SIGCONT)
    results = check_answers(cluster, tiny, client, handles, runs)
    assert {(res.decode_worker, res.transfer_path) for res in results} == {(cluster.id("d1"), "recompute")}
    wait_pools_free(cluster)


def long_prompt(tiny, num_tokens: int, seed: int) -> str:
    """A prompt of about ``num_tokens`` tiny tokens."""
    words = mixed_prompts(400, seed=seed)
    text = ""
    while len(tiny.tokenizer.encode(text)) < num_tokens:
        text += " " + words.pop()
    return text.strip()


def test_a_move_to_a_decode_worker_whose_pool_is_full_waits_and_loses_nothing(cluster, tiny):
    """d0's KV pool (128 blocks of 16 tokens) holds request A (moved there from c0), frozen
    mid-way so that it holds its blocks; c0 is asked to move its running request B, which
    needs more blocks than d0 has free. d0 resumes: B's handoff waits in its backlog until
    A has finished (no token of B from d0 before A's done), then d0 takes it (the KV
    fetched while the lease lives, else recomputed). Both answered once, the colocated
    engine's tokens."""
    from pdqueue.control import commands

    prompts = [long_prompt(tiny, 1000, seed=1), long_prompt(tiny, 1100, seed=2)]
    params = [{"max_tokens": 900, "temperature": 0.0, "seed": 1, "ignore_eos": True},
              {"max_tokens": 300, "temperature": 0.9, "seed": 2, "ignore_eos": True}]
    ids, expected, sampling = oracle(tiny, prompts, params)
    block, pool_blocks = 16, 128
    # (d0's heartbeat lives 20 s: alive to c0 while frozen)
    cluster.start_together(("colocated", *FAST, {"worker_id": "c0"}),
                           ("decode", *FAST, "--kv-cache-mb", "1", "--heartbeat-ttl-s", "20", {"worker_id": "d0"}))
    assert cluster.workers()["d0"]["load"]["kv_total"] == pool_blocks
    client = Client(cluster.redis_url)

    def move_one() -> None:
        cid = commands.send_migrate(cluster.r, cluster.keys, cluster.id("c0"), 1, by="test")
        done = commands.wait_switch(cluster.r, cluster.keys, cid, 30)
        assert done is not None and done["status"] == "done" and done["moved"] == "1", done

    def tokens(handle) -> list[tuple[float, dict]]:
        return [(entry_id_ms(eid), f) for eid, f in out_of(cluster, handle.request_id) if f[b"type"] == b"token"]

    a = client.submit(prompts[0], **params[0])
    wait_for(lambda: len(tokens(a)) > 5, what="A decoding on c0")
    move_one()
    moved_at = len(tokens(a))
    wait_for(lambda: len(tokens(a)) > moved_at + 20, what="A decoding on d0")
    cluster.signal("d0", signal.SIGSTOP)
    a_len = len(ids[0]) + len(tokens(a))   # d0 holds at least the blocks of these tokens
    assert not any(f[b"type"] == b"done" for _, f in out_of(cluster, a.request_id)), "A ended before the freeze"
    try:
        b = client.submit(prompts[1], **params[1])
        wait_for(lambda: len(tokens(b)) > 5, what="B decoding on c0")
        free = pool_blocks - -(-a_len // block)
        need = -(-(len(ids[1]) + len(tokens(b)) + 1) // block)
        assert need > free, (need, free)   # B cannot start on d0 while A runs there
        move_one()
        time.sleep(0.3)   # c0's tokens of B published
        resumed = time.time() * 1000
    finally:
        cluster.signal("d0", signal.SIGCONT)
    results = check_answers(cluster, tiny, client, [a, b], (ids, expected, sampling))
    assert [(res.prefill_worker, res.decode_worker) for res in results] == [(cluster.id("c0"), cluster.id("d0"))] * 2
    a_done = next(entry_id_ms(eid) for eid, f in out_of(cluster, a.request_id) if f[b"type"] == b"done")
    assert a_done > resumed   # A was still running on d0 when B's handoff came
    during = [t for t, _ in tokens(b) if resumed < t < a_done]
    assert not during, f"{len(during)} tokens of B before A ended: d0 started B with its pool full"
    assert any(t > a_done for t, _ in tokens(b))
    wait_pools_free(cluster)


def test_a_colocated_worker_that_moved_decodes_on_command_then_switches_and_stops_cleanly(cluster, tiny, runs):
    """After a migrate command (its KV served, nothing announced: it never stopped), c0
    serves on; a switch later drains the migrator too: the switch completes (done, c0 now a
    decode worker) and the warm stop after it exits 0. (The drain's report once assumed a
    stop had been announced, and the worker died with a TypeError at its next switch or stop.)"""
    from pdqueue.control import commands

    cluster.start_together(("colocated", *FAST, "--switchable", {"worker_id": "c0"}),
                           ("decode", *FAST, {"worker_id": "d0"}))
    client, handles, runs = submit(cluster, runs)
    wait_for(lambda: all_streaming_on(cluster, handles, "c0"), what="every request decoding on c0")
    done = commands.wait_switch(cluster.r, cluster.keys,
                                commands.send_migrate(cluster.r, cluster.keys, cluster.id("c0"), 3, by="test"), 30)
    assert done is not None and done["status"] == "done" and done["moved"] == "3", done
    check_answers(cluster, tiny, client, handles, runs)
    epoch = cluster.workers()["c0"]["role_epoch"]
    cid = commands.send_switch(cluster.r, cluster.keys, cluster.id("c0"), "decode", epoch, by="test")
    switched = commands.wait_switch(cluster.r, cluster.keys, cid, 30)
    assert switched is not None and switched["status"] == "done", (switched, cluster.log("c0"))
    assert cluster.workers()["c0"]["role"] == "decode"
    assert cluster.stop("c0") == 0, cluster.log("c0")
    wait_pools_free(cluster)
