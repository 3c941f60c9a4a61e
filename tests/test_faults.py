"""Fault injection: a worker killed or hung mid-request, a Redis restart. Every request
completes exactly once from the client's view, with the colocated engine's tokens, and
nothing leaks (blocks, segments)."""

from __future__ import annotations

import collections
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import redis

from pdqueue.client import Client
from pdqueue.keys import DECODE_GROUP, PREFILL_GROUP, Keys
from pdqueue.procs import pid_alive
from pdqueue.queue.redis_server import RedisServer
from pdqueue.queue.streams import request_streams
from pdqueue.transfer.shm import read_segment_info
from tests.cluster import Cluster
from tests.helpers import FAST, mixed_prompts, oracle, wait_for, wait_pools_free
from tests.oracle import assert_same_tokens


@pytest.fixture
def cluster(redis_url, tmp_path):
    """Workers are killed on purpose here: only those that exited cleanly must have removed
    their segments."""
    c = Cluster(redis_url, tmp_path)
    yield c
    c.stop_and_check(killed_ok=True)


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


def out_len(cluster, rid) -> int:
    return redis.Redis.from_url(cluster.redis_url).xlen(Keys().out(rid))


def pending_request_ids(cluster, consumer: str) -> set[str]:
    """The request ids of the entries pending under ``consumer`` in the prefill group."""
    r, keys, found = cluster.r, cluster.keys, set()
    for stream in (*request_streams(keys), keys.requests_for(consumer)):
        if not r.exists(stream):
            continue
        for p in r.xpending_range(stream, PREFILL_GROUP, "-", "+", 1000, consumername=consumer):
            entry = r.xrange(stream, p["message_id"], p["message_id"])
            if entry:
                found.add(entry[0][1][b"id"].decode())
    return found


def holds_any(cluster, consumer: str) -> bool:
    """Whether ``consumer`` holds an entry of the prefill group: one round trip, so the poll
    is fast enough to land inside a tiny model's prefill."""
    r, keys = cluster.r, cluster.keys
    with r.pipeline(transaction=False) as pipe:
        for stream in (*request_streams(keys), keys.requests_for(consumer)):
            pipe.xpending_range(stream, PREFILL_GROUP, "-", "+", 1, consumername=consumer)
        replies = pipe.execute(raise_on_error=False)
    return any(isinstance(rep, list) and rep for rep in replies)


def test_prefill_killed_mid_batch(cluster, tiny):
    """p0 dies holding requests it took and never handed off; p1 takes them over (they
    are pending under p0 in the group) and every request is answered once. p0 prefills a
    few prompts a step (--max-batched-tokens 64), so it holds some for a while; should the
    poll still miss that window (a loaded machine), the next round of requests is tried."""
    cluster.start_together(("prefill", *FAST, "--max-batched-tokens", "64", {"worker_id": "p0"}),
                           ("decode", *FAST, {"worker_id": "d0"}))
    p0 = cluster.id("p0")
    for round_ in range(3):
        client, handles, ids, expected = submit(cluster, tiny, 24, 8, seed=round_)
        deadline, polls = time.monotonic() + 30, 0
        while not holds_any(cluster, p0) and time.monotonic() < deadline:
            polls += 1
            if polls % 50 == 0 and all(out_len(cluster, h.request_id) for h in handles):
                break   # every request has its first token: p0 holds nothing more
            time.sleep(0.001)
        cluster.signal("p0", signal.SIGSTOP)   # frozen: what it holds now is what it dies with
        time.sleep(0.2)                        # writes already on the wire land first
        held = pending_request_ids(cluster, p0)
        if held:
            break
        cluster.signal("p0", signal.SIGCONT)   # it answered this round before the poll saw it
        check_all(cluster, tiny, client, handles, ids, expected)
    cluster.signal("p0", signal.SIGKILL)
    assert held, "p0 answered everything it held before it was stopped, three rounds running"
    cluster.start("prefill", *FAST, worker_id="p1")
    results = check_all(cluster, tiny, client, handles, ids, expected)
    by_id = {h.request_id: res for h, res in zip(handles, results)}
    assert {by_id[rid].prefill_worker for rid in held} == {cluster.id("p1")}, \
        {rid: by_id[rid].prefill_worker for rid in held}
    wait_pools_free(cluster)


def kill_prefill_after_handoffs(cluster, tiny, n: int, *args: str):
    """Start prefill p0 (with FAST and ``args``), submit ``n`` requests, SIGKILL p0 once all
    their handoffs are out (no decode worker runs yet, so none was fetched). Returns what
    ``check_all`` needs."""
    cluster.start("prefill", *FAST, *args, worker_id="p0")
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
    # A SIGKILLed owner cannot unlink its segment; the periodic sweep of any pdqueue worker on
    # this node (here d0; whatever its Redis) removes it once p0's last lease would have ended.
    wait_for(lambda: not cluster.segments(["p0"]), timeout=30, what="p0's segment removed")
    wait_pools_free(cluster)


def test_prefill_killed_and_its_segment_removed_before_fetch(cluster, tiny):
    """Once the dead worker's segment is removed, its tickets cannot be served by any path
    (no segment, a refused TCP connection, a silent ZeroMQ endpoint): every request is
    recomputed by the decode worker and still gives the colocated engine's tokens."""
    # p0's leases last 3 s (FAST's 10 s: its segment waited that long for them to end)
    client, handles, ids, expected = kill_prefill_after_handoffs(cluster, tiny, 4, "--lease-s", "3")
    wait_for(lambda: "p0" not in cluster.workers(), what="p0's heartbeat to expire")
    cluster.start("prefill", *FAST, worker_id="p1")   # its sweeps remove p0's segment
    wait_for(lambda: not cluster.segments(["p0"]), timeout=30, what="p0's segment removed (its leases ended)")
    cluster.start("decode", *FAST, worker_id="d0")
    results = check_all(cluster, tiny, client, handles, ids, expected)
    assert {res.transfer_path for res in results} == {"recompute"}
    wait_pools_free(cluster)


# -- segments of crashed prefill workers restarted at once (as a supervisor does) ---------

RESTART_TTL_S, RESTART_LEASE_S = 20.0, 3.0
# A TTL far longer than a worker's start (3 s idle, 13 s seen under load), so the restart
# comes within it; a short lease, so that the dead segment goes soon.
RESTART = ("--heartbeat-ttl-s", str(RESTART_TTL_S), "--lease-s", str(RESTART_LEASE_S),
           "--reclaim-idle-ms", "3000", "--fetch-timeout-s", "2")
SWEEP_S = min(RESTART_TTL_S, RESTART_LEASE_S) / 3   # WorkerShell.sweep_segments
# Once the restart is up, the dead segment goes after its last lease (RESTART_LEASE_S from
# the kill at most), at the next sweep: with a 2x margin.
DEAD_SEGMENT_GONE_S = 2 * (RESTART_LEASE_S + SWEEP_S)


def kill_prefill_with_leases_and_restart(cluster, restart_as: str) -> str:
    """p0 exports two tickets (no decode worker takes them), is SIGKILLed, and ``restart_as``
    starts at once; returns once it has registered, with p0's segment path."""
    cluster.start("prefill", *RESTART, worker_id="p0")
    [old_segment] = cluster.segments(["p0"])
    old_incarnation = cluster.workers()["p0"]["incarnation"]
    client = Client(cluster.redis_url)
    client.submit_many([dict(prompt=f"held lease {i}", max_tokens=8, temperature=0.0) for i in range(2)])
    r = redis.Redis.from_url(cluster.redis_url)
    wait_for(lambda: r.xlen(Keys().handoff) == 2, what="2 handoffs")
    cluster.signal("p0", signal.SIGKILL)
    cluster.procs["p0"].wait()
    killed_at = time.monotonic()
    cluster.start("prefill", *RESTART, worker_id=restart_as, wait=False)
    wait_for(lambda: cluster.workers().get(restart_as, {}).get("incarnation") not in (None, old_incarnation),
             timeout=60, what=f"{restart_as} registered anew")
    assert time.monotonic() - killed_at < RESTART_TTL_S, "the restart should come within the heartbeat TTL"
    return old_segment


@pytest.mark.parametrize("restart_as", ["p0", "p1"], ids=["same_id", "another_id"])
def test_prefill_killed_and_restarted_at_once_its_dead_segment_goes(cluster, restart_as):
    """A supervisor restarts a SIGKILLed prefill worker at once (within the heartbeat TTL),
    under its id or another one: the dead incarnation's segment is removed within its
    leases' lifetime and a sweep period (not at a start after the TTL only), while the new
    incarnation's segment stays."""
    old_segment = kill_prefill_with_leases_and_restart(cluster, restart_as)
    wait_for(lambda: not os.path.exists(old_segment), timeout=DEAD_SEGMENT_GONE_S,
             what=f"the dead p0's segment removed within {DEAD_SEGMENT_GONE_S:.0f}s of the restart")
    new_incarnation = cluster.workers()[restart_as]["incarnation"]
    assert os.path.exists(f"/dev/shm/pdq-kv-{cluster.id(restart_as)}-{new_incarnation}")


def unused_pid() -> int:
    """A pid no process of this PID namespace has (near pid_max, where pids come last)."""
    with open("/proc/sys/kernel/pid_max") as f:
        top = int(f.read()) - 2
    return next(pid for pid in range(top, top - 1000, -1) if not pid_alive(pid))


def make_dead_segment(name: str) -> str:
    """A complete segment whose owner died (SIGKILL, in this PID namespace)."""
    code = ("import os, signal\n"
            "from pdqueue.engine.kv_cache import KVCacheLayout\n"
            "from pdqueue.transfer.shm import SharedKVPool\n"
            "layout = KVCacheLayout(num_layers=1, num_blocks=4, block_size=4, num_kv_heads=1, head_dim=8)\n"
            f"SharedKVPool.create(layout, 'pdq-kv', {name!r}, 'dead')\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.returncode == -signal.SIGKILL   # it made the segment, then died holding it
    # (Not checked that it is still there: any pdqueue worker on this machine may sweep a dead
    # owner's segment at once, e.g. those of the tests running beside this one under xdist.)
    return f"/dev/shm/pdq-kv-{name}-dead"


def test_live_segment_of_another_cluster_in_another_pid_namespace_is_never_removed(cluster, tmp_path):
    """Another cluster (its own Redis and cluster name) shares /dev/shm but runs its prefill
    worker in its own PID namespace, as a container with shared IPC does: the pid in its
    segment's header means nothing here (no such process), and our registry does not know
    it. Our workers' sweeps (at start and periodically) never remove its live segment."""
    probe = ["unshare", "--pid", "--fork", "--mount-proc", "true"]
    if not shutil.which("unshare") or subprocess.run(probe, capture_output=True).returncode != 0:
        pytest.skip("needs unshare and the right to make a PID namespace (root or CAP_SYS_ADMIN)")
    pid = unused_pid()
    server = RedisServer().start()
    other = Cluster(server.url, tmp_path / "other", cluster="other")
    other.log_dir.mkdir()
    try:
        # In its namespace the worker gets ``pid``, which no process here has.
        # (a long TTL and lease: its own sweeps, rare, do not race ours for the canary)
        other.start("prefill", *FAST, "--heartbeat-ttl-s", "30", "--lease-s", "30", worker_id="q0",
                    prefix=["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c",
                            f"echo {pid - 1} > /proc/sys/kernel/ns_last_pid && {{cmd}}; exit $?"])
        [live] = other.segments(["q0"])
        assert read_segment_info(live).pid == pid and not pid_alive(pid)
        cluster.start("prefill", *FAST, worker_id="p0")   # sweeps at start, then periodically
        assert os.path.exists(live)
        canary = make_dead_segment(f"canary-{cluster.tag}")
        wait_for(lambda: not os.path.exists(canary), timeout=10, what="a sweep after the dead canary")
        assert os.path.exists(live)
        assert other.procs["q0"].poll() is None
    finally:
        other.stop_all()
        other.kill_all()
        server.stop()


def test_decode_killed_mid_generation(cluster, tiny):
    cluster.start_together(("prefill", *FAST, {"worker_id": "p0"}), ("decode", *FAST, {"worker_id": "d0"}))
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
    """A decode worker hangs (SIGSTOP) holding handoffs: its heartbeat expires and the other
    one claims every handoff it held and answers them; the hung one, resumed, finds them
    taken and drops them. One answer per request, all from the worker that took over.
    1000 tokens each: the freeze comes once every request streams, and their starts spread
    over seconds on a loaded machine (a prompt of 600 tokens prefilled after seven others, a
    fetch given up after --fetch-timeout-s and recomputed); with 300 (~2 s of decoding) the
    first ones had ended by then (seen: 7 of 8 held at the freeze, the others' answer streams
    all at 149 entries and none held by d0). p0 never decodes a request itself (--decode-here off): such a
    request would be pending on no decode worker either."""
    cluster.start_together(("prefill", *FAST, "--decode-here", "off", {"worker_id": "p0"}),
                           ("decode", *FAST, {"worker_id": "d0"}), ("decode", *FAST, {"worker_id": "d1"}))
    client, handles, ids, expected = submit(cluster, tiny, 8, 1000)
    wait_for(lambda: all(out_len(cluster, h.request_id) > 3 for h in handles), what="tokens flowing")
    r, keys = cluster.r, cluster.keys
    streams = keys.handoff_streams(cluster.workers()["d0"]["node"])

    def held() -> collections.Counter:
        """Handoffs pending per decode worker (by short name)."""
        counts: collections.Counter = collections.Counter()
        for stream in streams:
            for c in r.xpending(stream, DECODE_GROUP)["consumers"]:
                counts[c["name"].decode().removesuffix(f"-{cluster.tag}")] += c["pending"]
        return counts

    # Freeze both to see who holds what; the one holding more stays hung, the other goes on.
    cluster.signal("d0", signal.SIGSTOP)
    cluster.signal("d1", signal.SIGSTOP)
    before = held()
    hung, other = ("d0", "d1") if before["d0"] >= before["d1"] else ("d1", "d0")
    cluster.signal(other, signal.SIGCONT)
    try:
        assert before[hung] > 0 and sum(before.values()) == len(handles), \
            (before, cluster.workers()["p0"]["load"], [out_len(cluster, h.request_id) for h in handles])
        # Only a claim can empty a stopped worker's pending list: that is the takeover.
        wait_for(lambda: held()[hung] == 0, timeout=60, what=f"{other} to claim the handoffs of the hung {hung}")
    finally:
        cluster.signal(hung, signal.SIGCONT)
    results = check_all(cluster, tiny, client, handles, ids, expected)
    assert {res.decode_worker for res in results} == {cluster.id(other)}, [res.decode_worker for res in results]
    for h in handles:  # exactly one answer each on out:<id> too (check_all counted ``done``)
        finals = [f[b"type"] for _, f in r.xrange(keys.out(h.request_id)) if f[b"type"] in (b"done", b"error")]
        assert finals == [b"done"], (h.request_id, finals)
    wait_for(lambda: "was taken over by another worker" in cluster.log(hung), timeout=30,
             what=f"the resumed {hung} to drop what it lost")
    assert cluster.procs[hung].poll() is None, "the hung worker resumes and goes on"
    wait_pools_free(cluster)


def test_redis_restart_with_requests_in_flight(tmp_path, tiny):
    server = RedisServer(appendonly=True).start()
    c = Cluster(server.url, tmp_path)
    try:
        c.start_together(("prefill", *FAST, {"worker_id": "p0"}), ("decode", *FAST, {"worker_id": "d0"}))
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
        c.start_together(("prefill", *FAST, {"worker_id": "p0"}), ("decode", *FAST, {"worker_id": "d0"}))
        prompt_ids, expected, sampling = oracle(tiny, ["lost and found"],
                                                [{"max_tokens": 12, "temperature": 0.0, "seed": 1}])
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
        cluster.start_together(("prefill", *FAST, {"worker_id": "p0"}), ("decode", *FAST, {"worker_id": "d0"}))
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


def test_a_handoff_cancelled_before_its_fetch_gives_its_lease_back(cluster):
    """A decode worker that answers a handoff (cancelled, expired) before fetching its KV
    releases the ticket: the prefill worker's blocks are free at once, not when the lease
    (60 s here) expires."""
    cluster.start("prefill", *FAST, "--lease-s", "60", worker_id="p0")
    client = Client(cluster.redis_url)
    handle = client.submit("cancel me once prefilled", max_tokens=50, temperature=0, ignore_eos=True)
    wait_for(lambda: out_len(cluster, handle.request_id) >= 1, what="token 0 from the prefill worker")
    client.cancel(handle.request_id)
    cluster.start("decode", *FAST, worker_id="d0")   # takes the handoff, finds it cancelled
    assert handle.result(timeout=30).finish_reason == "cancelled"
    wait_pools_free(cluster, timeout=10)


def test_warm_stop_drains_a_decode_worker(cluster, tiny):
    """The first SIGTERM: running sequences finish; what it had not started goes to others."""
    cluster.start_together(("prefill", *FAST, {"worker_id": "p0"}), ("decode", *FAST, {"worker_id": "d0"}),
                           ("decode", *FAST, {"worker_id": "d1"}))
    client, handles, ids, expected = submit(cluster, tiny, 12, 150)
    wait_for(lambda: sum(out_len(cluster, h.request_id) > 2 for h in handles) >= 6, what="tokens flowing")
    assert cluster.stop("d0") == 0
    check_all(cluster, tiny, client, handles, ids, expected)
    wait_pools_free(cluster)
