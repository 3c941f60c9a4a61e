"""Role switching in place (pdqueue/control/commands.py, workers/switching.py), with real worker
processes started ``--switchable`` on a real Redis: switches each way with requests in
flight, roles flipping under load, a worker killed mid-switch, and the commands a worker
must refuse. Every request is answered exactly once (on ``done`` and on ``out:<id>``), with
the colocated engine's tokens."""

from __future__ import annotations

import collections
import random
import signal
import socket
import threading
import time

import pytest

from pdqueue.client import Client
from pdqueue.control import commands
from pdqueue.keys import DECODE_GROUP, PREFILL_GROUP
from pdqueue.queue.streams import request_streams
from tests.cluster import Cluster
from tests.helpers import FAST, mixed_prompts, oracle, wait_for, wait_pools_free
from tests.oracle import assert_same_tokens

SWITCHABLE = ("--switchable", *FAST)


@pytest.fixture
def cluster(redis_url, tmp_path):
    """Workers are killed on purpose here: only those that exited cleanly must have removed
    their segments."""
    c = Cluster(redis_url, tmp_path)
    yield c
    c.stop_and_check(killed_ok=True)


def start_all(cluster, *workers: tuple[str, str, tuple]) -> None:
    """Start (name, role, args) workers together (they load in parallel), then wait for each."""
    for name, role, args in workers:
        cluster.start(role, *args, worker_id=name, wait=False)
    for name, _, _ in workers:
        cluster.wait_registered(name)


# -- commands and events -------------------------------------------------------------------

def beat(cluster, name: str) -> dict:
    return cluster.workers()[name]


def send(cluster, name: str, role: str, epoch: int | None = None) -> str:
    """A switch command for ``name`` with the epoch its heartbeat shows (or ``epoch``)."""
    epoch = beat(cluster, name)["role_epoch"] if epoch is None else epoch
    return commands.send_switch(cluster.r, cluster.keys, cluster.id(name), role, epoch, by="test")


def final(cluster, command_id: str, timeout: float = 60) -> dict:
    event = commands.wait_switch(cluster.r, cluster.keys, command_id, timeout_s=timeout)
    assert event is not None, f"no final event for switch command {command_id}"
    return event


def events_of(cluster, command_id: str) -> list[dict]:
    return commands.switch_events(cluster.r, cluster.keys, command_id)


def switch(cluster, name: str, role: str) -> dict:
    """Switch ``name`` to ``role``; returns the ``done`` event (after checking it)."""
    before = beat(cluster, name)
    cid = send(cluster, name, role)
    done = final(cluster, cid)
    assert done["status"] == "done", done
    after = beat(cluster, name)
    assert (after["role"], after["role_epoch"]) == (role, before["role_epoch"] + 1), after
    assert int(done["epoch"]) == after["role_epoch"] and after["switching_to"] == ""
    assert 0 <= float(done["drain_ms"]) <= float(done["switch_ms"])
    assert [e["status"] for e in events_of(cluster, cid)] == ["accepted", "done"]
    return done


def refused(cluster, command_id: str, needle: str) -> dict:
    event = final(cluster, command_id)
    assert event["status"] == "refused" and needle in event["reason"], event
    return event


# -- requests ------------------------------------------------------------------------------

class Load:
    """Requests submitted over a test, checked at its end against the colocated engine."""

    def __init__(self, cluster, tiny):
        self.cluster, self.tiny = cluster, tiny
        self.client = Client(cluster.redis_url)
        self.handles, self.prompt_ids, self.expected, self.sampling = [], [], [], []

    def submit(self, n: int, max_tokens, seed: int, ignore_eos: bool = True) -> list:
        return self.send(self.prepare(n, max_tokens, seed, ignore_eos))

    def prepare(self, n: int, max_tokens, seed: int, ignore_eos: bool = True) -> list[dict]:
        """``n`` requests (``max_tokens``: a number or a list to pick from), their expected
        tokens computed now; ``send`` submits them."""
        rng = random.Random(seed)
        prompts = mixed_prompts(n, seed)
        params = [{"max_tokens": max_tokens if isinstance(max_tokens, int) else rng.choice(max_tokens),
                   "temperature": 0.0 if i % 2 else 0.8, "seed": seed * 1000 + i, "ignore_eos": ignore_eos}
                  for i in range(n)]
        ids, expected, sampling = oracle(self.tiny, prompts, params)
        self.prompt_ids += ids
        self.expected += expected
        self.sampling += sampling
        return [dict(prompt=p, **kw) for p, kw in zip(prompts, params)]

    def send(self, requests: list[dict]) -> list:
        handles = self.client.submit_many(requests)
        self.handles += handles
        return handles

    def check(self, timeout: float = 120) -> list:
        """Every request answered exactly once (``done`` stream and ``out:<id>``), with
        the colocated engine's tokens (or a near-tie flip, tests/oracle.py)."""
        results = [h.result(timeout=timeout) for h in self.handles]
        for pid, exp, res, sp in zip(self.prompt_ids, self.expected, results, self.sampling):
            assert_same_tokens(self.tiny, pid, exp, list(res.token_ids), sp, label=res.request_id)
        r, keys = self.cluster.r, self.cluster.keys
        counts = collections.Counter(f[b"id"].decode() for _, f in r.xrange(keys.done))
        wrong = {h.request_id: counts[h.request_id] for h in self.handles if counts[h.request_id] != 1}
        assert not wrong, f"done entries per request (want 1): {wrong}"
        with r.pipeline(transaction=False) as pipe:
            for h in self.handles:
                pipe.xrange(keys.out(h.request_id))
            outs = pipe.execute()
        for h, entries in zip(self.handles, outs):
            finals = [f[b"type"] for _, f in entries if f[b"type"] in (b"done", b"error")]
            assert finals == [b"done"], (h.request_id, finals)
        return results


def held(cluster, name: str, group: str, streams) -> list[str]:
    """Entry ids pending for worker ``name`` in ``group`` on ``streams``."""
    out = []
    for stream in streams:
        if cluster.r.exists(stream):
            out += [p["message_id"].decode() for p in
                    cluster.r.xpending_range(stream, group, "-", "+", 1000, consumername=cluster.id(name))]
    return out


def held_requests(cluster, name: str, group: str, streams) -> list[str]:
    """The request ids of the entries pending for worker ``name``."""
    out = []
    for stream in streams:
        for eid in held(cluster, name, group, [stream]):
            for _, fields in cluster.r.xrange(stream, eid, eid):
                out.append(fields[b"id"].decode())
    return out


def handoff_streams(cluster) -> list[str]:
    nodes = {w.get("node") for w in cluster.workers().values() if w.get("node")}
    return [cluster.keys.handoff, *(cluster.keys.handoff_node(n) for n in sorted(nodes))]


def holding(cluster, name: str) -> int:
    """What ``name`` holds in its current role's group (from Redis, at once)."""
    role = beat(cluster, name)["role"]
    if role == "decode":
        return len(held(cluster, name, DECODE_GROUP, handoff_streams(cluster)))
    return len(held(cluster, name, PREFILL_GROUP, request_streams(cluster.keys)))


def feed(load: Load, name: str, n: int, max_tokens: int, seed: int) -> list:
    """Submit ``n`` requests, again (up to 4 times) until worker ``name`` holds some: which
    worker a batch goes to is a race between the readers."""
    handles = []
    for attempt in range(4):
        handles += load.submit(n, max_tokens, seed=seed * 10 + attempt)
        try:
            wait_for(lambda: holding(load.cluster, name) > 0, timeout=5, what=f"{name} to hold requests")
            return handles
        except AssertionError:
            if attempt == 3:
                raise
    return handles


def out_len(cluster, request_id: str) -> int:
    return cluster.r.xlen(cluster.keys.out(request_id))


# -- the tests -----------------------------------------------------------------------------

def test_switch_each_way_with_requests_in_flight(cluster, tiny):
    """prefill->decode, decode->prefill, decode->colocated, colocated->decode,
    prefill->colocated, colocated->prefill, each while requests run: the worker finishes
    what it holds, then serves in the new role; none lost or answered twice, the colocated
    engine's tokens. A second command sent with the first (same epoch) is refused while the
    switch is in progress."""
    start_all(cluster, ("a", "prefill", SWITCHABLE), ("b", "decode", SWITCHABLE), ("c", "decode", SWITCHABLE))
    load = Load(cluster, tiny)
    moves = [("c", "prefill"), ("a", "decode"), ("b", "colocated"), ("b", "decode"), ("c", "colocated"),
             ("c", "prefill")]
    done_events = []
    for i, (name, role) in enumerate(moves):
        source = beat(cluster, name)["role"]
        if source == "prefill":   # in flight through the cluster; the prefill worker may hold some
            handles = load.submit(8, 200, seed=i)
            wait_for(lambda: any(out_len(cluster, h.request_id) for h in handles), what="first tokens")
        else:                     # the worker itself holds running requests
            feed(load, name, 8, 200, seed=i)
        if i == 0:   # two commands at once: the second finds the first in progress
            epoch = beat(cluster, name)["role_epoch"]
            with cluster.r.pipeline(transaction=True) as pipe:
                first = commands.send_switch(pipe, cluster.keys, cluster.id(name), role, epoch)
                second = commands.send_switch(pipe, cluster.keys, cluster.id(name), "colocated", epoch)
            assert final(cluster, first)["status"] == "done"
            refused(cluster, second, f"a switch to {role} is in progress")
            done = [e for e in events_of(cluster, first) if e["status"] == "done"][0]
        else:
            done = switch(cluster, name, role)
        if source != "prefill":
            assert int(done["held"]) > 0, done
        done_events.append(done)
    assert [beat(cluster, n)["role"] for n in "abc"] == ["decode", "decode", "prefill"]
    load.check()
    print("\n" + "\n".join(f"{e['from']:>9} -> {e['to']:<9} held {e['held']:>2} leases {e['leases']:>2}: "
                           f"drain {e['drain_ms']:>6} ms, switch {e['switch_ms']:>6} ms" for e in done_events))
    wait_pools_free(cluster)


def test_roles_flipping_under_load(cluster, tiny):
    """200 requests through 3 switchable workers whose roles a flipper changes every second
    or so (always leaving a prefill-capable and a decode worker), sending also commands the
    workers must refuse (stale epoch, same role, a switch in progress, a switch that would
    leave prefill workers with no decode worker). 0 lost, 0 answered twice, every answer the
    colocated engine's."""
    start_all(cluster, ("w0", "prefill", SWITCHABLE), ("w1", "decode", SWITCHABLE),
              ("w2", "decode", SWITCHABLE))
    names = ["w0", "w1", "w2"]
    load = Load(cluster, tiny)
    rng = random.Random(5)
    stop = threading.Event()
    log: list[tuple[str, str, dict]] = []    # (kind, what, final event)
    errors: list[BaseException] = []

    def roles() -> dict[str, str]:
        return {n: beat(cluster, n)["role"] for n in names}

    def fine(r: dict[str, str]) -> bool:
        return any(v in ("prefill", "colocated") for v in r.values()) and "decode" in r.values()

    def expect_refused(kind: str, cid: str, *needles: str) -> None:
        event = final(cluster, cid)
        assert event["status"] == "refused" and any(n in event["reason"] for n in needles), (kind, event)
        log.append(("refused", kind, event))

    def flip(k: int) -> None:
        now = roles()
        name = rng.choice(names)
        epoch = beat(cluster, name)["role_epoch"]
        kind = k % 4
        if kind == 1:
            expect_refused("stale", send(cluster, name, rng.choice(["prefill", "decode", "colocated"]), epoch - 1),
                           "stale epoch")
        elif kind == 2:
            expect_refused("same", send(cluster, name, now[name]), f"already {now[name]}")
        elif kind == 3:
            decode = [n for n, v in now.items() if v == "decode"]
            if len(decode) == 1 and any(v == "prefill" for n, v in now.items() if n != decode[0]):
                expect_refused("guard", send(cluster, decode[0], rng.choice(["prefill", "colocated"])),
                               "nobody left to serve it")
        moves = [(n, role) for n in names for role in ("prefill", "decode", "colocated")
                 if role != now[n] and fine({**now, n: role})]
        name, role = rng.choice(moves)
        epoch = beat(cluster, name)["role_epoch"]
        cid = send(cluster, name, role, epoch)
        if kind == 0:   # a second command to the same worker at once
            expect_refused("in progress", send(cluster, name, now[name], epoch), "in progress", "stale epoch")
        event = final(cluster, cid)
        assert event["status"] == "done", event
        log.append(("done", f"{name} {now[name]}->{role}", event))

    def flipper():
        try:
            k = 0
            while not stop.wait(rng.uniform(0.5, 1.5)):
                flip(k)
                k += 1
        except BaseException as exc:   # reported by the test
            errors.append(exc)

    thread = threading.Thread(target=flipper, daemon=True)
    thread.start()
    try:
        for j in range(10):   # arrivals spread over time
            load.submit(20, [16, 64, 256], seed=100 + j, ignore_eos=False)
            time.sleep(1.0)
        results = load.check(timeout=300)
    finally:
        stop.set()
        thread.join(timeout=120)
    assert not errors, errors
    assert len(results) == 200
    dones = [e for kind, _, e in log if kind == "done"]
    refusals = collections.Counter(what for kind, what, _ in log if kind == "refused")
    assert len(dones) >= 5 and {"stale", "same", "in progress"} <= set(refusals), (len(dones), refusals)
    print(f"\nflips: {len(dones)} done ({', '.join(w for k, w, _ in log if k == 'done')}); refused: {dict(refusals)}; "
          f"switch ms p50 {sorted(float(e['switch_ms']) for e in dones)[len(dones) // 2]:.0f}, "
          f"max {max(float(e['switch_ms']) for e in dones):.0f}")
    wait_pools_free(cluster, timeout=30)


def test_worker_killed_mid_switch(cluster, tiny):
    """A decode worker accepts a switch to prefill and is SIGKILLed while it drains its
    running requests: another decode worker takes them over and finishes them; nothing is
    answered twice, and the switch never reports done."""
    start_all(cluster, ("p", "prefill", FAST), ("d0", "decode", SWITCHABLE), ("d1", "decode", FAST))
    load = Load(cluster, tiny)
    handles = feed(load, "d0", 6, 600, seed=1)
    wait_for(lambda: all(out_len(cluster, h.request_id) > 3 for h in handles), what="tokens flowing")
    cid = send(cluster, "d0", "prefill")
    wait_for(lambda: [e for e in events_of(cluster, cid) if e["status"] == "accepted"], what="accepted")
    cluster.signal("d0", signal.SIGKILL)
    cluster.procs["d0"].wait()
    taken = held_requests(cluster, "d0", DECODE_GROUP, handoff_streams(cluster))   # what it died holding
    assert taken, "d0 should die holding requests (mid-drain)"
    results = {res.request_id: res for res in load.check()}
    assert [e["status"] for e in events_of(cluster, cid)] == ["accepted"]
    for rid in taken:   # taken over by d1, which resumed them from what out:<id> showed
        assert (results[rid].decode_worker, results[rid].transfer_path) == (cluster.id("d1"), "recompute"), rid
    wait_pools_free(cluster)


def test_stale_and_malformed_commands_are_refused(cluster, tiny):
    """Each refused with its reason (an event naming the command, or its entry id when it
    has none); the role and epoch stay, and the worker goes on serving."""
    cluster.start("colocated", *SWITCHABLE, worker_id="c")
    before = beat(cluster, "c")
    epoch, stream = before["role_epoch"], cluster.keys.control(cluster.id("c"))
    sent = {
        "stale": (commands.switch_fields("decode", epoch - 1),
                  f"stale epoch: expected {epoch - 1}, worker is at {epoch}"),
        "older": (commands.switch_fields("decode", 1700000000000), "stale epoch"),
        "same": (commands.switch_fields("colocated", epoch), "already colocated"),
        "op": ({"op": "flip", "id": "m-op", "role": "decode", "epoch": str(epoch)}, "op must be"),
        "role": ({"op": "switch", "id": "m-role", "role": "gpu", "epoch": str(epoch)}, "role must be one of"),
        "epoch": ({"op": "switch", "id": "m-epoch", "role": "decode", "epoch": "soon"}, "epoch must be an integer"),
        "field": ({"op": "switch", "id": "m-field", "role": "decode", "epoch": str(epoch), "force": "1"},
                  "unknown field"),
    }
    with cluster.r.pipeline(transaction=True) as pipe:
        for fields, _ in sent.values():
            pipe.xadd(stream, fields)
        pipe.xadd(stream, {"op": "switch", "role": "decode"})   # no id, no epoch
        *_, anonymous = pipe.execute()
    for fields, needle in sent.values():
        refused(cluster, fields["id"], needle)
    refused(cluster, anonymous.decode(), "epoch must be an integer")
    after = beat(cluster, "c")
    assert (after["role"], after["role_epoch"], after["switching_to"]) == ("colocated", epoch, "")
    assert not cluster.r.exists(stream) or cluster.r.xlen(stream) == 0   # each command read once
    load = Load(cluster, tiny)
    load.submit(2, 8, seed=3)
    assert {res.transfer_path for res in load.check()} == {"local"}


def test_last_worker_of_a_role_refuses_to_leave_a_backlog(cluster, tiny):
    """The last decode worker refuses to leave while prefill workers run, and while handoffs
    are queued (its prefill worker gone); the last prefill-capable worker refuses to leave
    while requests are queued. Everything is then served."""
    start_all(cluster, ("p", "prefill", FAST), ("d", "decode", (*SWITCHABLE, "--max-num-seqs", "1")))
    load = Load(cluster, tiny)
    # 1000 tokens each (~6 s for tiny): d, one at a time, still has handoffs queued after p's
    # heartbeat has expired below (with 300, a fast machine had served all but one by then)
    load.submit(6, 1000, seed=2)
    refused(cluster, send(cluster, "d", "colocated"), f"last decode worker, prefill worker(s) {cluster.id('p')}")
    queued = handoff_streams(cluster)
    # d runs one at a time, so at least 4 of the 6 handoffs wait unread for a while
    wait_for(lambda: sum(cluster.r.xlen(s) for s in queued) == 6 and holding(cluster, "d") == 1,
             what="d to run 1 of 6 handoffs")
    cluster.signal("p", signal.SIGKILL)
    cluster.procs["p"].wait()
    wait_for(lambda: "p" not in cluster.workers(), what="p's heartbeat to expire")
    event = refused(cluster, send(cluster, "d", "colocated"), "last decode worker")
    assert "handoff(s) queued" in event["reason"], event
    assert beat(cluster, "d")["role"] == "decode"
    cluster.start("decode", *FAST, worker_id="d2")   # help with the queue
    load.check()

    # the last prefill-capable worker, with requests queued: c reads at most 16 before it
    # next looks at its commands, so 40 sent while it is stopped are still queued then
    start_all(cluster, ("c", "colocated", (*SWITCHABLE, "--heartbeat-ttl-s", "10")))   # (not dead while stopped)
    epoch, batch = beat(cluster, "c")["role_epoch"], load.prepare(40, 4, seed=4)
    cluster.signal("c", signal.SIGSTOP)
    try:
        load.send(batch)
        cid = send(cluster, "c", "decode", epoch)
    finally:
        cluster.signal("c", signal.SIGCONT)
    event = refused(cluster, cid, "last prefill-capable worker")
    assert "request(s) queued" in event["reason"], event
    assert beat(cluster, "c")["role"] == "colocated"
    load.check()


def test_fixed_role_worker_refuses(cluster):
    cluster.start("colocated", *FAST, worker_id="c")
    before = beat(cluster, "c")
    assert before["switchable"] == 0
    refused(cluster, send(cluster, "c", "decode"), "fixed role: started without --switchable")
    after = beat(cluster, "c")
    assert (after["role"], after["role_epoch"]) == ("colocated", before["role_epoch"])


def test_failed_switch_goes_back_to_the_old_role(cluster, tiny):
    """The new role cannot start (its KV server's port is taken): ``failed`` with the
    reason, and the worker starts its old role again, same epoch, and serves."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start_all(cluster, ("c", "colocated", (*SWITCHABLE, "--bind", f"tcp://127.0.0.1:{port}")),
                  ("d", "decode", FAST))
        epoch = beat(cluster, "c")["role_epoch"]
        cid = send(cluster, "c", "prefill")
        event = final(cluster, cid)
        assert event["status"] == "failed" and "prefill failed to start" in event["reason"], event
        assert [e["status"] for e in events_of(cluster, cid)] == ["accepted", "failed"]
        after = wait_for(lambda: (w := beat(cluster, "c"))["role"] == "colocated" and w, what="c back")
        assert (after["role_epoch"], after["switching_to"]) == (epoch, "")
        load = Load(cluster, tiny)
        load.submit(2, 8, seed=6)
        assert {res.transfer_path for res in load.check()} == {"local"}


def test_a_switch_keeps_the_kv_pool_and_old_tickets_cannot_validate(redis_url, tiny):
    """In one process: a prefill role exports a ticket nobody fetches, then the worker
    becomes decode. Every role's engine uses the same pool (the shell's segment: nothing is
    allocated), the old role's tickets no longer validate (every block's epoch moved on),
    and the decode role, finding its own old handoff, recomputes it: the colocated engine's
    tokens."""
    from pdqueue.engine.config import EngineConfig
    from pdqueue.protocol import decode_handoff
    from workers.common import WorkerConfig
    from workers.decode import DecodeRole
    from workers.prefill import PrefillRole
    from workers.shell import WorkerShell

    engine = EngineConfig(model="tiny", num_threads=1, kv_cache_mb=16)
    config = WorkerConfig(redis_url=redis_url, engine=engine, heartbeat_ttl_s=2.0, lease_s=0.5, switchable=True)
    shell = WorkerShell(config, tiny, PrefillRole())
    thread = threading.Thread(target=shell.run, daemon=True)
    thread.start()
    client = Client(redis_url)
    keys = shell.keys
    params = {"max_tokens": 8, "temperature": 0.0, "seed": 0}
    prompt_ids, expected, _ = oracle(tiny, ["left behind"], [params])
    try:
        wait_for(lambda: client.redis.hget(keys.worker(shell.worker_id), "role") == b"prefill", what="prefill")
        epoch = int(client.redis.hget(keys.worker(shell.worker_id), "role_epoch"))
        pool = shell.segment
        assert pool is not None and shell.role.engine.kv_cache.data_ptr() == pool.tensor.data_ptr()
        handle = client.submit("left behind", **params)
        [(_, fields)] = wait_for(lambda: client.redis.xrange(keys.handoff), what="the handoff")
        ticket = decode_handoff(fields).ticket
        assert ticket["segment"] == pool.name and pool.epochs_of(ticket["block_ids"]) == ticket["block_epochs"]
        shell.switch_role(DecodeRole())
        result = handle.result(timeout=60)
        beat = client.redis.hgetall(keys.worker(shell.worker_id))
        assert (beat[b"role"], int(beat[b"role_epoch"])) == (b"decode", epoch + 1)
        assert shell.segment is pool and shell.role.engine.kv_cache.data_ptr() == pool.tensor.data_ptr()
        assert all(now > then for now, then in zip(pool.epochs_of(ticket["block_ids"]), ticket["block_epochs"]))
        assert result.transfer_path == "recompute" and list(result.token_ids) == expected[0]
        assert result.prefill_worker == result.decode_worker == shell.worker_id
    finally:
        shell.stop.warm.set()
        shell.stop.cold.set()
        thread.join(timeout=30)
    assert not thread.is_alive()
