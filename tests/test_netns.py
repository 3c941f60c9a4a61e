"""Real multi-host runs: Redis, prefill workers and decode workers on three "hosts", each a
Linux network namespace with its own address and its own /dev/shm (``tests/netns.py``),
joined by a bridge. The workers reach Redis and each other over the network only, started
with ``--bind`` and ``--advertise-host`` as the README says; the test process itself watches
Redis through a Unix socket, so network faults between the hosts never blind it.

Checked: the colocated engine's tokens over each network path (``tcp``, ``zmq``, and
``auto``, which must pick a network path since the hosts' shared-memory domains differ);
then faults only a network has: the prefill <-> decode link cut in the middle of a transfer
(the fetch times out and the request is recomputed), packet loss and delay through a
delaying proxy (answers still right; a fetch whose peer stays silent longer than
``--fetch-timeout-s`` is given up and recomputed), and a partition from Redis that heals
(the workers resume, every request gets exactly one outcome).

Skipped, with the reason, where namespaces cannot be made (not root, no ``ip`` or
``iptables``). Nothing is left behind: ``Net.close`` removes the namespaces, bridge, veths,
rules, mounts and processes, and the module checks it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from pdqueue.client import Client
from pdqueue.keys import Keys
from pdqueue.queue.redis_server import find_redis_server_binary
from tests import netns
from tests.cluster import Cluster
from tests.helpers import mixed_prompts, oracle, wait_for
from tests.oracle import assert_same_tokens

HOSTS = ["redis", "prefill", "decode", "proxy"]
REDIS_PORT = 6379
KV_PORT, DATA_PORT = 5555, 5556     # fixed where the proxy must forward them
LEASE = ("--lease-s", "4")   # fault tests: leases the decode side never released end soon (a warm stop waits)


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    reason = netns.unavailable()
    if reason:
        pytest.skip(f"network namespaces: {reason}")
    n = netns.Net(HOSTS, workdir=tmp_path_factory.mktemp("netns")).start()
    try:
        sock = n.workdir / "redis.sock"
        server = n.popen("redis", [find_redis_server_binary(), "--bind", n.addr("redis"), "--port", str(REDIS_PORT),
                                   "--unixsocket", str(sock), "--unixsocketperm", "700", "--save", "",
                                   "--appendonly", "no", "--protected-mode", "no", "--dir", str(n.workdir)],
                         stdout=open(n.workdir / "redis.log", "ab"), stderr=subprocess.STDOUT)
        n.unix_url = f"unix://{sock}"
        n.tcp_url = f"redis://{n.addr('redis')}:{REDIS_PORT}/0"

        def up():
            try:
                return redis.Redis.from_url(n.unix_url).ping()
            except (redis.RedisError, OSError):
                assert server.poll() is None, (n.workdir / "redis.log").read_text()
                return False

        wait_for(up, 20, "Redis in its namespace")
        netns.wait_port(n, "prefill", "redis", REDIS_PORT)
        yield n
    finally:
        n.close()
        assert not n.list_ours(), "network namespaces left behind"
        assert all(p.poll() is not None for p in n.procs)


class Clusters:
    """``tests.cluster.Cluster``s watching Redis through its Unix socket; the workers they
    start get the TCP URL and run on their host (``start(cluster, host, role, ...)``)."""

    def __init__(self, net, tmp_path):
        self.net, self.tmp_path, self.all = net, tmp_path, []

    def cluster(self, name: str = "default") -> Cluster:
        log_dir = self.tmp_path / name
        log_dir.mkdir()
        c = Cluster(self.net.unix_url, log_dir, cluster=name)
        self.all.append(c)
        return c

    def start(self, c: Cluster, host: str, role: str, *args: str, wait: bool = True, name: str | None = None) -> str:
        name = c.start(role, "--redis-url", self.net.tcp_url, *args, worker_id=name or f"{role}-{len(c.procs)}",
                       prefix=self.net.prefix_for(host), wait=False)
        self.net.adopt(c.procs[name])
        if wait:
            c.wait_registered(name)
        return name

    def stop_and_check(self) -> None:
        for host in HOSTS:
            self.net.flush(host)
            self.net.link(host, True)
        codes = {}
        for c in self.all:   # every worker at once (prefill drains while decode finishes)
            for wid, proc in c.procs.items():
                if proc.poll() is None:
                    c.signal(wid, signal.SIGTERM)
        for c in self.all:
            codes.update({f"{c.cluster}/{w}": (c.stop(w, signalled=True), c.log(w)) for w in c.procs})
        left = {h: sorted(p.name for p in self.net.shm_dir(h).glob("pdq-kv-*")) for h in HOSTS}
        assert all(code == 0 for code, _ in codes.values()), codes
        assert not any(left.values()), f"KV segments left behind: {left}"


@pytest.fixture
def hosts(net, tmp_path):
    redis.Redis.from_url(net.unix_url).flushall()
    h = Clusters(net, tmp_path)
    try:
        yield h
    finally:
        h.stop_and_check()


def prefill_args(net, *extra, via=None):
    """A prefill worker reachable by the other hosts: bound to its own address, or (``via``
    a proxy host) on every interface with fixed ports, advertising the proxy's address."""
    if via is None:
        return ["--bind", f"tcp://{net.addr('prefill')}:*", *extra]
    return ["--bind", f"tcp://0.0.0.0:{KV_PORT}", "--data-port", str(DATA_PORT), "--advertise-host",
            net.addr(via), *extra]


def start_proxy(net, delay_ms=0.0, rate_kbps=0.0):
    stats = net.workdir / f"proxy-{time.monotonic_ns()}.json"
    proc = net.popen("proxy", [sys.executable, "-m", "tests.netns", "proxy", "--listen", net.addr("proxy"),
                               "--to", net.addr("prefill"), "--port", str(KV_PORT), "--port", str(DATA_PORT),
                               "--delay-ms", str(delay_ms), "--rate-kbps", str(rate_kbps), "--stats", str(stats)],
                     cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.DEVNULL)
    netns.wait_port(net, "decode", "proxy", DATA_PORT)
    return proc, stats


def stop_proxy(proc):
    proc.kill()
    proc.wait(10)


def full_log(c: Cluster, name: str) -> str:
    return (c.log_dir / f"{name}.log").read_text(errors="replace")   # Cluster.log keeps the tail only


def proxy_stats(path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def requests(n: int, seed: int = 0, offset: int = 0):
    prompts = mixed_prompts(n, seed)
    params = [{"max_tokens": 6, "temperature": 0.0, "seed": 0} if i % 2 else
              {"max_tokens": 6, "temperature": 0.8, "top_p": 0.95, "seed": 500 + offset + i} for i in range(n)]
    return prompts, params


def submit_and_check(c, tiny, prompts, params, timeout=90):
    """Submit, wait for every answer, compare with the colocated engine; the results."""
    prompt_ids, expected, sampling = oracle(tiny, prompts, params)
    client = Client(c.redis_url, c.cluster)
    handles = client.submit_many([dict(prompt=p, **kw) for p, kw in zip(prompts, params)])
    results = [h.result(timeout=timeout) for h in handles]
    for pid, exp, res, sp in zip(prompt_ids, expected, results, sampling):
        assert_same_tokens(tiny, pid, exp, list(res.token_ids), sp)
    return results


def one_outcome_each(c, ids):
    """Every request has exactly one done entry on `done` and on its out: stream, no error,
    nothing dead-lettered."""
    r = redis.Redis.from_url(c.redis_url, decode_responses=True)
    keys = Keys(c.cluster)
    done = [f["id"] for _, f in r.xrange(keys.done)]
    for rid in ids:
        assert done.count(rid) == 1, (rid, done.count(rid))
        types = [f["type"] for _, f in r.xrange(keys.out(rid))]
        assert types.count("done") == 1 and "error" not in types, (rid, types)
    assert r.xlen(keys.dead) == 0, r.xrange(keys.dead)


def start_pair(hosts, c, prefill_extra=(), decode_extra=(), transfer="tcp", via=None):
    """One prefill worker on its host and one decode worker on its host, started together."""
    p = hosts.start(c, "prefill", "prefill", *prefill_args(hosts.net, "--transfer", transfer, *prefill_extra, via=via),
                    wait=False)
    d = hosts.start(c, "decode", "decode", "--transfer", transfer, *decode_extra, wait=False)
    c.wait_registered(p)
    c.wait_registered(d)
    return p, d


PATHS = {"tcp": "tcp", "zmq": "zmq", "auto": "tcp"}   # --transfer -> the path the done entries must name


def test_tokens_match_over_each_network_path(hosts, tiny):
    """One cluster per --transfer mode, side by side (one prefill and one decode worker each,
    on their hosts): the colocated engine's tokens, and the expected path in every done
    entry (auto: the TCP data wire, since the two hosts' /dev/shm differ)."""
    net = hosts.net
    clusters = {mode: hosts.cluster(mode) for mode in PATHS}
    pairs = {}
    for mode, c in clusters.items():
        pairs[mode] = (hosts.start(c, "prefill", "prefill", *prefill_args(net, "--transfer", mode), wait=False),
                       hosts.start(c, "decode", "decode", "--transfer", mode, wait=False))
    prompts, params = requests(8)
    prompt_ids, expected, sampling = oracle(tiny, prompts, params)
    handles = {}
    for mode, c in clusters.items():
        p, d = pairs[mode]
        c.wait_registered(p)
        c.wait_registered(d)
        workers = c.workers()
        assert workers[p]["node"] != workers[d]["node"], "the hosts must be two shared-memory domains"
        assert f"tcp://{net.addr('prefill')}:" in json.dumps(workers[p]), workers[p]   # the advertised KV host
        client = Client(c.redis_url, c.cluster)
        handles[mode] = client.submit_many([dict(prompt=pr, **kw) for pr, kw in zip(prompts, params)])
    for mode, hs in handles.items():
        results = [h.result(timeout=90) for h in hs]
        for pid, exp, res, sp in zip(prompt_ids, expected, results, sampling):
            assert_same_tokens(tiny, pid, exp, list(res.token_ids), sp)
        assert {r.transfer_path for r in results} == {PATHS[mode]}, (mode, [r.transfer_path for r in results])
        assert all(r.transfer_bytes > 0 for r in results)


def test_link_cut_mid_transfer_recomputes(hosts, tiny):
    """A transfer slowed to 256 KiB/s by the proxy is cut (iptables DROP between decode and
    the path to prefill) after part of its bytes arrived: the decode worker hears nothing for
    --fetch-timeout-s, gives the fetch up and recomputes; once the link heals, KV moves over
    the network again. No request is lost, each is answered once, tokens are right."""
    net = hosts.net
    c = hosts.cluster()
    proxy, stats = start_proxy(net, rate_kbps=256)
    p, d = start_pair(hosts, c, LEASE, ("--fetch-timeout-s", "1.5"), via="proxy")
    long_prompt = ("the quick brown fox jumps over a lazy dog " * 40)[:1500]   # ~1500 tokens, ~750 KiB of KV
    prompt_ids, expected, sampling = oracle(tiny, [long_prompt], [{"max_tokens": 6, "temperature": 0.0, "seed": 0}])
    client = Client(c.redis_url, c.cluster)
    handle = client.submit(long_prompt, max_tokens=6, temperature=0.0, seed=0)
    wait_for(lambda: proxy_stats(stats).get("to_client", 0) > 128 * 1024, 30, "the transfer under way")
    net.cut("decode", "proxy")
    cut_at = time.monotonic()
    res = handle.result(timeout=60)
    stalled = proxy_stats(stats).get("to_client", 0)
    assert stalled < len(prompt_ids[0]) * 512, "the cut came after the whole transfer"
    assert res.transfer_path == "recompute", res
    assert time.monotonic() - cut_at >= 1.4
    assert_same_tokens(tiny, prompt_ids[0], expected[0], list(res.token_ids), sampling[0])
    assert "nothing for 1.5s" in full_log(c, d), c.log(d)
    # Healed: the network path works again.
    net.flush("decode")
    prompts, params = requests(4, seed=3)
    results = submit_and_check(c, tiny, prompts, params)
    assert {r.transfer_path for r in results} == {"tcp"}
    one_outcome_each(c, [handle.request_id, *[r.request_id for r in results]])
    stop_proxy(proxy)


def test_packet_loss_and_delay(hosts, tiny):
    """Through a proxy adding 100 ms each way and with 10% of the packets between decode and
    the proxy dropped at random, answers stay right and KV still moves over TCP (TCP resends
    what was lost; a fetch that losses happen to stall past --fetch-timeout-s is recomputed,
    as documented). With 1 s each way (a 2 s round trip), longer than the 1.5 s fetch
    timeout, every fetch is given up after 1.5 s of silence and recomputed, answers still
    right."""
    net = hosts.net
    c = hosts.cluster()
    proxy, _ = start_proxy(net, delay_ms=100)
    # A lease long enough for 8 handoffs fetched one after another through a slow, lossy
    # path: a recompute here must come from a fetch timeout, not from an expired lease.
    p, d = start_pair(hosts, c, ("--lease-s", "10"), ("--fetch-timeout-s", "1.5"), via="proxy")
    net.cut("decode", "proxy", probability=0.10)
    prompts, params = requests(8, seed=5)
    results = submit_and_check(c, tiny, prompts, params)
    paths = [r.transfer_path for r in results]
    timeouts = full_log(c, d).count("peer_timeout")
    assert set(paths) <= {"tcp", "recompute"} and paths.count("tcp") >= 4, paths
    failures = [line for line in full_log(c, d).splitlines() if "KV fetch for" in line]
    assert paths.count("recompute") == timeouts == len(failures), (paths, failures)
    # Every network fetch took at least one round trip through the proxy (hello or fetch).
    assert all(r.transfer_ms >= 200 for r in results if r.transfer_path == "tcp"), [r.transfer_ms for r in results]
    net.flush("decode")
    stop_proxy(proxy)
    # A round trip longer than the fetch timeout: every fetch is given up after 1.5 s.
    proxy, _ = start_proxy(net, delay_ms=1000)
    prompts, params = requests(4, seed=7)
    later = submit_and_check(c, tiny, prompts, params)
    assert {r.transfer_path for r in later} == {"recompute"}, [r.transfer_path for r in later]
    failed_later = [line for line in full_log(c, d).splitlines() if "KV fetch for" in line][len(failures):]
    assert len(failed_later) == len(later) and all("peer_timeout" in line for line in failed_later), failed_later
    assert all(r.ttst_ms >= 1500 for r in later), [r.ttst_ms for r in later]
    one_outcome_each(c, [r.request_id for r in results + later])
    stop_proxy(proxy)


def test_partition_from_redis_heals(hosts, tiny):
    """Redis's host goes off the network for ~5 s (longer than the workers' 3 s heartbeat
    TTL) while requests arrive: the workers ride it out, register again, and every request
    gets exactly one answer with the colocated engine's tokens."""
    net = hosts.net
    c = hosts.cluster()
    ttl = ("--heartbeat-ttl-s", "3")
    p, d = start_pair(hosts, c, ttl, ttl)
    prompts, params = requests(12, seed=9)
    expected_ids, expected, sampling = oracle(tiny, prompts, params)
    client = Client(c.redis_url, c.cluster)
    handles = client.submit_many([dict(prompt=pr, **kw) for pr, kw in zip(prompts[:4], params[:4])])
    net.link("redis", False)
    assert not net.can_connect("prefill", "redis", REDIS_PORT, timeout_s=0.5)
    handles += client.submit_many([dict(prompt=pr, **kw) for pr, kw in zip(prompts[4:8], params[4:8])])
    wait_for(lambda: not c.workers(), 10, "the heartbeats to expire during the partition")
    time.sleep(1.0)
    net.link("redis", True)
    handles += client.submit_many([dict(prompt=pr, **kw) for pr, kw in zip(prompts[8:], params[8:])])
    results = [h.result(timeout=90) for h in handles]
    for pid, exp, res, sp in zip(expected_ids, expected, results, sampling):
        assert_same_tokens(tiny, pid, exp, list(res.token_ids), sp)
    wait_for(lambda: {p, d} <= set(c.workers()), 10, "the workers to register again")
    assert all(proc.poll() is None for proc in c.procs.values())
    one_outcome_each(c, [h.request_id for h in handles])
