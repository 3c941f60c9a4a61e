"""pdqueue on a real Redis Cluster (3 masters + 3 replicas of redis-server on loopback,
``tests/redis_cluster.py``), one for the whole session; skipped where redis-server or
redis-cli lack cluster support.

One `pdqueue up --redis-url redis+cluster://...` (one prefill and one decode worker, its
gateway) serves the module: the workers answer with the colocated engine's tokens, the
gateway answers over HTTP, `status`, `submit` and `batch` work, a second pdqueue cluster
whose slot lives on another master runs beside it, and, last, the master holding the first
cluster's slot is killed (SIGKILL) with requests in flight: the cluster promotes its
replica by itself, and every request completes exactly once, with one usage record that
counts the tokens its client received. `up` must then still stop cleanly (the module's
teardown).
"""

from __future__ import annotations

import asyncio
import collections
import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from pdqueue.client import AsyncClient, Client
from pdqueue.keys import Keys
from pdqueue.queue.connection import (
    ClusterUnavailable,
    LazyRedisCluster,
    cluster_nodes,
    connect,
    is_cluster_url,
)
from tests.cluster import ROOT, Cluster
from tests.helpers import assert_ledger_is, mixed_prompts, oracle, pdqueue_up, wait_for
from tests.oracle import assert_same_tokens
from tests.redis_cluster import RedisClusterServers, unavailable_reason

# ---- fixtures ------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def rcluster():
    """A 6-node Redis Cluster on free loopback ports, in a temporary directory."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    servers = RedisClusterServers().start()
    try:
        yield servers
    finally:
        servers.stop()


def names_on_distinct_masters(rc: RedisClusterServers, n: int) -> list[str]:
    """``n`` pdqueue cluster names whose hash slots are served by ``n`` different masters."""
    chosen: dict[int, str] = {}
    for i in range(1000):
        name = f"rc{i}"
        chosen.setdefault(rc.master_of(Keys(name).requests), name)
        if len(chosen) == n:
            return list(chosen.values())
    raise AssertionError("no names found on distinct masters")


@pytest.fixture(scope="module")
def names(rcluster) -> list[str]:
    return names_on_distinct_masters(rcluster, 2)


def clean_env(tmp: Path) -> dict:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("PDQ_") or k == "PDQ_CACHE_DIR"}
    return {**env, "PYTHONUNBUFFERED": "1", "XDG_RUNTIME_DIR": str(tmp / "run")}


@pytest.fixture(scope="module")
def up(rcluster, names, tmp_path_factory):
    """`pdqueue up` against the Redis Cluster: 1 prefill + 1 decode worker and a gateway.
    Stopped at the end with SIGINT: exit 0, nothing left running."""
    logs = tmp_path_factory.mktemp("rcluster-up")
    (logs / "run").mkdir()
    with pdqueue_up(rcluster.url, names[0], logs, clean_env(logs), logs / "logs") as (proc, gateway):
        yield {"proc": proc, "gateway": gateway, "logs": logs, "cluster": names[0]}
    err = (logs / "up.err").read_text()
    assert proc.returncode == 0, err
    assert "nothing left running" in err and "Traceback" not in err, err


def pdq(*args: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workers", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=timeout, stdin=subprocess.DEVNULL)


def greedy_params(n: int, max_tokens: int = 12) -> list[dict]:
    return [{"max_tokens": max_tokens, "temperature": 0.0 if i % 2 else 0.8, "seed": 7 + i} for i in range(n)]


# ---- URLs and the client ---------------------------------------------------------------------------

def test_cluster_urls_and_a_plain_url_of_a_cluster_node(rcluster, tmp_path):
    assert is_cluster_url("rediss+cluster://h:1") and not is_cluster_url("redis://h:1")
    assert cluster_nodes("redis+cluster://u:p@a:1,b:2/0?ssl_check_hostname=false") == (
        "redis://u:p@a:1?ssl_check_hostname=false", [("a", 1), ("b", 2)])
    with pytest.raises(ValueError, match="only database 0"):
        cluster_nodes("redis+cluster://a:1/2")
    # A redis:// URL of a cluster node gets MOVED for most keys: the CLI says what to write.
    port = rcluster.live_ports()[0]
    result = pdq("status", "--redis-url", f"redis://127.0.0.1:{port}/0", env=clean_env(tmp_path))
    assert result.returncode != 0
    assert f"use redis+cluster://127.0.0.1:{port}" in result.stderr, result.stderr
    # No node answers: the lazy client raises ClusterUnavailable (a ConnectionError) on first
    # use, and tries again on the next.
    dead = connect("redis+cluster://127.0.0.1:1", purpose="check")
    assert isinstance(dead, LazyRedisCluster)
    for _ in range(2):
        with pytest.raises(ClusterUnavailable):
            dead.ping()


def test_clients_follow_moved_and_keep_one_slot_per_pdqueue_cluster(rcluster, names):
    r = connect(rcluster.url)
    keys = Keys(names[1])
    # MULTI/EXEC and EVAL over several keys of one pdqueue cluster: one slot, one master.
    with r.pipeline(transaction=True) as pipe:
        pipe.xadd(keys.requests, {"a": "1"})
        pipe.set(keys.seen("x"), "1", ex=60)
        pipe.eval("return redis.call('EXISTS', KEYS[1], KEYS[2])", 2, keys.requests, keys.seen("x"))
        assert pipe.execute()[2] == 2
    # A plain client of another master is redirected (MOVED); the cluster client follows.
    other = next(p for p in rcluster.live_ports() if p != rcluster.master_of(keys.requests)
                 and rcluster.role(p) == "master")
    with pytest.raises(redis.exceptions.MovedError):
        rcluster.node(other).xlen(keys.requests)
    assert r.xlen(keys.requests) == 1
    # Keys of two pdqueue clusters in one transaction: refused by the client (a programming
    # error, never taken for a passing outage).
    with pytest.raises(redis.exceptions.CrossSlotTransactionError):
        with r.pipeline(transaction=True) as pipe:
            pipe.xadd(keys.requests, {"a": "2"})
            pipe.xadd(Keys(names[0]).requests, {"a": "2"})
            pipe.execute()
    r.delete(keys.requests, keys.seen("x"))   # one slot: one DEL


def test_password_and_tls_reach_a_cluster_through_the_one_factory(tmp_path, monkeypatch):
    """A TLS-only cluster (bus and replication too) with a password: the URL carries no
    secret, the password comes from a file and the CA from the environment (what the CLI's
    --redis-password-file and --redis-ca set), for the Client, the AsyncClient and a CLI
    command alike."""
    import shutil

    from pdqueue.config import redis_security

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    if not shutil.which("openssl"):
        pytest.skip("no openssl to make certificates")
    from tests.test_security import make_certs

    with pytest.raises(ValueError, match="need a rediss://"):   # TLS files with a plain cluster URL
        redis_security("redis+cluster://h:1", ca=__file__, environ={})
    certs = make_certs(tmp_path)
    (tmp_path / "pw").write_text("tls-cluster-pw\n")
    with RedisClusterServers(masters=3, replicas_per_master=0, password="tls-cluster-pw", tls=certs) as tc:
        url = tc.url.replace(":tls-cluster-pw@", "")
        assert url.startswith("rediss+cluster://127.0.0.1:")
        monkeypatch.setenv("PDQ_REDIS_CA", certs["ca.crt"])
        monkeypatch.setenv("PDQ_REDIS_PASSWORD_FILE", str(tmp_path / "pw"))
        with Client(url, "tls") as client:
            handle = client.submit("hi", max_tokens=2)
            client.cancel(handle.request_id)
        r = connect(url)
        assert r.xlen(Keys("tls").requests) == 1 and r.exists(Keys("tls").cancel(handle.request_id))

        async def run_async():
            async with AsyncClient(url, "tls") as ac:
                await ac.submit("hi", max_tokens=2)

        asyncio.run(run_async())
        assert r.xlen(Keys("tls").requests) == 2
        env = {**clean_env(tmp_path), "PDQ_REDIS_CA": certs["ca.crt"], "PDQ_REDIS_PASSWORD_FILE": str(tmp_path / "pw")}
        status = pdq("status", "--redis-url", url, "--cluster", "tls", env=env)
        assert status.returncode == 0, status.stderr
        (tmp_path / "bad").write_text("wrong\n")
        env["PDQ_REDIS_PASSWORD_FILE"] = str(tmp_path / "bad")
        refused = pdq("status", "--redis-url", url, "--cluster", "tls", env=env)
        assert refused.returncode != 0 and "tls-cluster-pw" not in refused.stderr
        assert "password" in refused.stderr or "WRONGPASS" in refused.stderr, refused.stderr


# ---- workers, gateway and tools against the cluster ---------------------------------------------------

def test_up_workers_answer_with_the_colocated_engines_tokens(up, rcluster, tiny):
    prompts = mixed_prompts(6, seed=3)
    params = greedy_params(6)
    prompt_ids, expected, sampling = oracle(tiny, prompts, params)
    with Client(rcluster.url, up["cluster"]) as client:
        handles = client.submit_many([dict(prompt=p, **kw) for p, kw in zip(prompts, params)])
        results = [h.result(timeout=120) for h in handles]
    for pid, exp, res, sp in zip(prompt_ids, expected, results, sampling):
        assert_same_tokens(tiny, pid, exp, list(res.token_ids), sp)
    assert {res.transfer_path for res in results} <= {"shm", "tcp", "zmq"}

    async def run_async():
        async with AsyncClient(rcluster.url, up["cluster"]) as ac:
            handles = await ac.submit_many([dict(prompt=p, **kw) for p, kw in zip(prompts[:2], params[:2])])
            return [await h.result(timeout=120) for h in handles]

    for exp, res in zip(expected[:2], asyncio.run(run_async())):
        assert list(res.token_ids) == list(exp)


def test_gateway_answers_over_http(up, rcluster):
    import http.client
    from urllib.parse import urlparse

    with Client(rcluster.url, up["cluster"]) as client:
        want = client.submit("The capital of France is", max_tokens=10, temperature=0).result(timeout=60)
    url = urlparse(up["gateway"])
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 10, "temperature": 0}),
        headers={"content-type": "application/json"})
    resp = conn.getresponse()
    body = json.loads(resp.read())
    assert resp.status == 200, body
    assert body["choices"][0]["text"] == want.text
    conn.request("GET", "/health")
    health = conn.getresponse()
    assert health.status == 200, health.read()


def test_status_submit_and_batch_against_the_cluster(up, rcluster, tmp_path):
    env = clean_env(tmp_path)
    target = ["--redis-url", rcluster.url, "--cluster", up["cluster"]]
    status = pdq("status", *target, env=env)
    assert status.returncode == 0, status.stderr
    assert "prefill-0" in status.stdout and "decode-0" in status.stdout and "requests" in status.stdout
    submitted = pdq("submit", *target, "--max-tokens", "4", "--temperature", "0", "hi", env=env)
    assert submitted.returncode == 0, submitted.stderr
    assert "4 tokens" in submitted.stdout + submitted.stderr
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                       "body": {"model": "tiny", "prompt": f"p{i}", "max_tokens": 4,
                                                "temperature": 0}}) + "\n" for i in range(4)))
    result = pdq("batch", str(inp), "-o", str(out), *target, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(x["custom_id"] for x in lines) == ["c0", "c1", "c2", "c3"]
    assert all(x["response"]["status_code"] == 200 for x in lines), lines
    # Run again: every line is already in OUTPUT, nothing is sent twice.
    again = pdq("batch", str(inp), "-o", str(out), *target, env=env, timeout=300)
    assert again.returncode == 0, again.stderr
    assert len(out.read_text().splitlines()) == 4


def test_pdqueue_clusters_on_different_masters(up, rcluster, names, tiny, tmp_path):
    """A second pdqueue cluster (a colocated worker) whose slot another master serves; each
    cluster's keys are all on its own master, in its one slot."""
    first, second = names
    masters = {name: rcluster.master_of(Keys(name).requests) for name in names}
    assert masters[first] != masters[second]
    c = Cluster(rcluster.url, tmp_path, cluster=second)
    try:
        c.start("colocated")
        prompts, params = mixed_prompts(3, seed=5), greedy_params(3)
        prompt_ids, expected, sampling = oracle(tiny, prompts, params)
        with Client(rcluster.url, second) as client:
            results = [h.result(timeout=120) for h in
                       client.submit_many([dict(prompt=p, **kw) for p, kw in zip(prompts, params)])]
        for pid, exp, res, sp in zip(prompt_ids, expected, results, sampling):
            assert_same_tokens(tiny, pid, exp, list(res.token_ids), sp)
        for name in names:
            prefix, slot = Keys(name).prefix.encode(), rcluster.slot(Keys(name).requests)
            on_master = list(rcluster.node(masters[name]).scan_iter(match=prefix + b"*", count=1000))
            assert on_master, f"no keys of {name} on its master"
            assert {rcluster.slot(k.decode()) for k in on_master} == {slot}
            for port in rcluster.live_ports():
                if port != masters[name] and rcluster.role(port) == "master":
                    assert not list(rcluster.node(port).scan_iter(match=prefix + b"*", count=1000))
        c.stop_and_check()
    finally:
        c.kill_all()


def test_a_lost_delivery_of_a_handoff_in_hand_is_answered_once(up, rcluster, tiny):
    """What a failover can do to a decode worker: the delivery of the handoff it works on
    is lost (not replicated), so the same entry is delivered to it again. Simulated exactly:
    XACK the entry and move the group's last-delivered id back before it. The worker must
    keep answering it (one ``done``), not acknowledge it as a duplicate."""
    from pdqueue.keys import DECODE_GROUP

    name = up["cluster"]
    keys = Keys(name)
    r = connect(rcluster.url)
    params = {"max_tokens": 150, "temperature": 0.0, "seed": 1, "ignore_eos": True}
    prompt_ids, expected, sampling = oracle(tiny, ["a lost delivery"], [params])
    with Client(rcluster.url, name) as client:
        handle = client.submit("a lost delivery", **params)

        def pending_handoff():
            for stream in [keys.handoff, *(keys.handoff_node(w.get("node", "")) for w in
                                           Cluster(rcluster.url, up["logs"], cluster=name).workers().values())]:
                try:
                    entries = r.xpending_range(stream, DECODE_GROUP, "-", "+", 10)
                except redis.ResponseError:
                    continue
                if entries and r.xlen(keys.out(handle.request_id)) >= 3:
                    return stream, entries[0]["message_id"]
            return None

        stream, entry_id = wait_for(pending_handoff, 60, what="the handoff in the decode worker's hands")
        with r.pipeline(transaction=True) as pipe:
            pipe.xack(stream, DECODE_GROUP, entry_id)
            pipe.xgroup_setid(stream, DECODE_GROUP, "0")
            pipe.execute()
        wait_for(lambda: r.xpending(stream, DECODE_GROUP)["pending"] == 1, 30, what="the entry delivered again")
        result = handle.result(timeout=120)
    assert_same_tokens(tiny, prompt_ids[0], expected[0], list(result.token_ids), sampling[0])
    done = [f for _, f in r.xrange(keys.done) if f[b"id"].decode() == handle.request_id]
    assert len(done) == 1


# ---- failover (last: it changes which node is master) -----------------------------------------------

def test_master_killed_right_after_a_submit_every_request_runs_once(rcluster, names, tiny, tmp_path):
    """The master of the second pdqueue cluster's slot SIGKILLed right after a submit of 16
    requests: whatever the failover lost, every request is answered exactly once. The clients
    check every 2 s of silence whether Redis still has their requests (``LostCheck``), so the
    check runs during the failover; a request a worker holds must never look lost (the
    worker's read can survive on the replica while the ``seen:<id>`` it set did not; a copy
    sent then would run twice: seen before the check asked XPENDING)."""
    from pdqueue.config import RedisConfig

    second = names[1]
    keys = Keys(second)
    n = 16
    prompts = mixed_prompts(n, seed=12)
    params = [{"max_tokens": 20, "temperature": 0.0 if i % 2 else 0.9, "seed": 40 + i, "ignore_eos": True}
              for i in range(n)]
    prompt_ids, expected, sampling = oracle(tiny, prompts, params)
    c = Cluster(rcluster.url, tmp_path, cluster=second)
    try:
        c.start_together(("prefill",), ("decode",))
        master = rcluster.master_of(keys.requests)
        replicas = rcluster.replicas_of(master)
        with Client(rcluster.url, second, config=RedisConfig(url=rcluster.url, lost_check_s=2.0)) as client:
            handles = client.submit_many([dict(prompt=p, **kw) for p, kw in zip(prompts, params)])
            rcluster.fail_over(master, replicas)
            results = [h.result(timeout=120) for h in handles]
        for pid, exp, res, sp in zip(prompt_ids, expected, results, sampling):
            assert_same_tokens(tiny, pid, exp, list(res.token_ids), sp)
        r = connect(rcluster.url)
        counts = collections.Counter(f[b"id"].decode() for _, f in r.xrange(keys.done))
        assert all(counts[h.request_id] == 1 for h in handles), {h.request_id: counts[h.request_id] for h in handles}
        assert_ledger_is(r, keys, handles, results)   # a record per request, none lost with its done
        # A request sent again only when Redis had lost it: a copy of one it still had would
        # be turned away as a duplicate (what the check without XPENDING did, 3 runs of 4).
        ours = {h.request_id for h in handles}
        needless = [f[b"field:id"].decode() for _, f in r.xrange(keys.dead)
                    if f.get(b"code") == b"duplicate" and f.get(b"field:id", b"").decode() in ours]
        assert not needless, needless
        print(f"sent again after the failover: {sum(h._lost.resent for h in handles)} of {n}")
        c.stop_and_check()
    finally:
        c.kill_all()


def test_master_killed_with_requests_in_flight_every_request_completes_once(up, rcluster, tiny):
    """SIGKILL the master of the cluster's slot while requests are being generated; the
    Redis Cluster promotes its replica by itself (cluster-node-timeout 1 s); workers and
    clients see connection errors and CLUSTERDOWN for a moment, retry, and every request
    completes with one ``done`` and the colocated engine's tokens."""
    name = up["cluster"]
    keys = Keys(name)
    n = 8
    prompts = mixed_prompts(n, seed=11)
    params = [{"max_tokens": 80, "temperature": 0.0 if i % 2 else 0.9, "seed": 30 + i, "ignore_eos": True}
              for i in range(n)]
    prompt_ids, expected, sampling = oracle(tiny, prompts, params)
    r = connect(rcluster.url)
    done_before = r.xlen(keys.done)
    client = Client(rcluster.url, name)
    handles = client.submit_many([dict(prompt=p, **kw) for p, kw in zip(prompts, params)])
    wait_for(lambda: sum(r.xlen(keys.out(h.request_id)) > 0 for h in handles) >= 3, 60, what="first answers")
    assert r.xlen(keys.done) - done_before < n, "every request finished before the kill"
    master = rcluster.master_of(keys.requests)
    replicas = rcluster.replicas_of(master)
    for port in replicas:   # replicated up to the last writes, which the kill may lose
        with rcluster.node(port) as node:
            assert node.info("replication")["master_link_status"] == "up"
    promoted_s = rcluster.fail_over(master, replicas)
    assert rcluster.master_of(keys.requests) in replicas
    results = [h.result(timeout=180) for h in handles]
    for pid, exp, res, sp in zip(prompt_ids, expected, results, sampling):
        assert_same_tokens(tiny, pid, exp, list(res.token_ids), sp)
    done = connect(rcluster.url).xrange(keys.done)
    counts = collections.Counter(f[b"id"].decode() for _, f in done)
    assert all(counts[h.request_id] == 1 for h in handles), {h.request_id: counts[h.request_id] for h in handles}
    assert_ledger_is(connect(rcluster.url), keys, handles, results)
    for h, res in zip(handles, results):   # the answer streams, read again from the start: no gap
        streamed = [t for e in client.handle(h.request_id).stream(timeout=30) for t in e.token_ids]
        assert streamed == list(res.token_ids)
    print(f"replica promoted {promoted_s:.1f} s after the SIGKILL")
    client.close()
