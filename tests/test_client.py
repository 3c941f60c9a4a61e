"""Client/AsyncClient end to end against real Redis and an in-test echo worker.

The echo worker reads the request streams like a prefill worker would and answers with one
token per prompt character (token id = code point), through the real protocol functions
and the Publisher; the done entry and the XACK go out in one transaction.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import redis

from pdqueue import AsyncClient, Client
from pdqueue.client import RequestFailed
from pdqueue.config import RedisConfig
from pdqueue.keys import PREFILL_GROUP, Keys
from pdqueue.protocol import (
    Completion,
    ErrorCode,
    FinishReason,
    RequestError,
    done_entry,
    error_entry,
    parse_request,
    token_entry,
)
from pdqueue.queue import (
    Publisher,
    RedisServer,
    ensure_group,
    read_group,
    read_own_pending,
)
from pdqueue.queue.streams import request_streams
from tests.helpers import wait_for
from tests.redis_ops import XAdd, ack_into, dead_letter

KEYS = Keys()


class EchoWorker:
    def __init__(self, url: str, *, duplicate_tokens: bool = False, token_delay_s: float = 0.0):
        self.r = redis.Redis.from_url(url, socket_timeout=5)
        self.duplicate_tokens = duplicate_tokens
        self.token_delay_s = token_delay_s
        self.publisher = Publisher(lambda: redis.Redis.from_url(url), backoff_max_s=0.1)
        self.handled: list[str] = []
        self._stop = threading.Event()
        for stream in request_streams(KEYS):
            ensure_group(self.r, stream, PREFILL_GROUP)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        recover = False
        while not self._stop.is_set():
            try:
                if recover:  # redo what was taken but not acknowledged (tokens get republished)
                    entries = read_own_pending(self.r, PREFILL_GROUP, "echo", request_streams(KEYS))
                    recover = False
                else:
                    entries = read_group(self.r, PREFILL_GROUP, "echo", request_streams(KEYS),
                                         count=16, block_ms=50)
                for stream, entry_id, fields in entries:
                    if fields:
                        self._handle(stream, entry_id, fields)
            except (redis.ConnectionError, redis.TimeoutError):
                recover = True
                time.sleep(0.05)

    def _handle(self, stream: str, entry_id: str, fields: dict) -> None:
        def finish(*ops):
            self.publisher.submit([*ops, lambda pipe: ack_into(pipe, stream, PREFILL_GROUP, entry_id)])

        try:
            req = parse_request(entry_id, fields)
            if req.prompt == "FAIL":
                raise RequestError("prompt too long for this echo", req.id, ErrorCode.TOO_LONG)
        except RequestError as exc:
            reason, code = exc.reason, exc.code
            ops = [lambda pipe: dead_letter(pipe, KEYS, fields, reason, stream, entry_id, code)]
            if exc.request_id:
                ops.append(XAdd(KEYS.out(exc.request_id), error_entry(reason, code), ttl_s=60))
            finish(*ops)
            return
        self.handled.append(req.id)
        text = req.prompt if req.prompt is not None else "".join(chr(t) for t in req.prompt_ids)
        out, reason, emitted = KEYS.out(req.id), FinishReason.STOP, ""
        for index, char in enumerate(text):
            if index >= req.max_tokens:
                reason = FinishReason.LENGTH
                break
            if self.r.exists(KEYS.cancel(req.id)):
                reason = FinishReason.CANCELLED
                break
            entry = XAdd(out, token_entry(index, [ord(char)], char), ttl_s=60)
            self.publisher.submit([entry, entry] if self.duplicate_tokens else [entry])
            emitted += char
            time.sleep(self.token_delay_s)
        completion = Completion(req.id, emitted, tuple(ord(c) for c in emitted), reason,
                                num_prompt_tokens=len(text), prefill_worker="echo",
                                e2e_ms=time.time() * 1000 - req.enqueued_ms)
        finish(XAdd(out, done_entry(completion), ttl_s=60), XAdd(KEYS.done, done_entry(completion), 100))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.publisher.close()
        self.r.close()


@pytest.fixture
def echo(redis_url):
    worker = EchoWorker(redis_url)
    yield worker
    worker.close()


@pytest.fixture
def client(redis_url):
    with Client(redis_url) as c:
        yield c


def test_submit_stream_and_result(client, echo, r):
    handle = client.submit("hello", max_tokens=3, temperature=0)
    assert list(handle.text_stream(timeout=10)) == ["h", "e", "l"]
    completion = handle.result(timeout=1)
    assert completion.text == "hel" and completion.token_ids == (104, 101, 108)
    assert completion.finish_reason is FinishReason.LENGTH and completion.request_id == handle.request_id
    assert r.xpending(KEYS.requests, PREFILL_GROUP)["pending"] == 0
    assert r.xlen(KEYS.done) == 1 and 0 < r.ttl(KEYS.out(handle.request_id)) <= 60


def test_stream_events_and_generator_return_value(client, echo):
    handle = client.submit(prompt_ids=[72, 105], id="my-id.1")
    gen = handle.stream(timeout=10)
    events = []
    with pytest.raises(StopIteration) as stop:
        while True:
            events.append(next(gen))
    assert [(e.index, e.token_ids, e.text) for e in events] == [(0, (72,), "H"), (1, (105,), "i")]
    assert stop.value.value.text == "Hi" and stop.value.value.finish_reason is FinishReason.STOP
    assert handle.result() is handle.completion  # cached


def test_repeated_token_entries_are_yielded_once(redis_url, client):
    worker = EchoWorker(redis_url, duplicate_tokens=True)
    try:
        handle = client.submit("abcd")
        events = list(handle.stream(timeout=10))
        assert [e.index for e in events] == [0, 1, 2, 3]
        assert "".join(e.text for e in events) == handle.completion.text == "abcd"
    finally:
        worker.close()


def test_tokens_after_a_gap_wait_for_it_and_the_completion_supplies_lost_ones(redis_url, client, r):
    """Entries of ``out:<id>`` a failover lost: the stream never skips them. Tokens after a
    gap wait; a repeat that fills the gap releases them in order; tokens still missing at the
    completion come from it, with their text, so the stream's text is the completion's."""
    handle = client.handle("gappy")
    out = KEYS.out("gappy")
    for i, ch in enumerate("abcdef"):
        if i not in (1, 4):   # lost: 1 comes again later (a retried worker), 4 never does
            r.xadd(out, token_entry(i, [ord(ch)], ch))
    r.xadd(out, token_entry(1, [ord("b")], "b"))
    r.xadd(out, done_entry(Completion("gappy", "abcdef", tuple(map(ord, "abcdef")), FinishReason.LENGTH)))
    events = list(handle.stream(timeout=10))
    assert [(e.index, e.text) for e in events] == [(0, "a"), (1, "b"), (2, "c"), (3, "d"), (4, "ef")]
    assert [t for e in events for t in e.token_ids] == list(map(ord, "abcdef"))
    assert "".join(e.text for e in events) == handle.completion.text


def test_errors_raise_request_failed(client, echo, r):
    with pytest.raises(RequestFailed) as info:
        client.submit("FAIL").result(timeout=10)
    assert info.value.code == "too_long" and "too long" in info.value.reason
    # A bad request from a producer that skips validation (raw XADD) is answered too.
    r.xadd(KEYS.requests, {"id": "raw-1", "prompt": "x", "top_p": "2"})
    with pytest.raises(RequestFailed) as info:
        client.handle("raw-1").result(timeout=10)
    assert info.value.code == "bad_request" and "top_p" in info.value.reason
    wait_for(lambda: r.xlen(KEYS.dead) == 2, timeout=5, what="2 dead-letter records")
    assert r.xpending(KEYS.requests, PREFILL_GROUP)["pending"] == 0


def test_client_validates_before_sending(client, r):
    for kwargs in [{}, {"prompt": "a", "max_tokens": 0}, {"prompt": "a", "top_p": 0},
                   {"prompt": "a", "priority": "urgent"}, {"prompt": "a", "id": "bad id"}]:
        with pytest.raises(RequestError):
            client.submit(**kwargs)
    with pytest.raises(RequestError):
        client.submit_many([{"prompt": "ok"}, {"prompt": "a", "temperature": -1}])
    assert not r.exists(KEYS.requests)


def test_submit_many_and_priority(client, echo, r):
    specs = [{"prompt": f"p{i}", "seed": i} for i in range(20)] + [{"prompt": "hi", "priority": "high"}]
    handles = client.submit_many(specs)
    assert [h.result(timeout=10).text for h in handles] == [f"p{i}" for i in range(20)] + ["hi"]
    assert len({h.request_id for h in handles}) == 21


def test_high_priority_is_taken_first(redis_url, client):
    client.submit_many([{"prompt": "n", "id": f"normal-{i}"} for i in range(3)])
    client.submit("h", priority="high", id="high-0")
    worker = EchoWorker(redis_url)
    try:
        client.handle("normal-2").result(timeout=10)
        assert worker.handled[0] == "high-0"
    finally:
        worker.close()


def test_timeout(client):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        client.handle("nobody-answers").result(timeout=0.2)
    assert time.monotonic() - t0 < 1.0


def test_cancel(redis_url, client, r):
    worker = EchoWorker(redis_url, token_delay_s=0.02)
    try:
        handle = client.submit("x" * 200)
        stream = handle.stream(timeout=10)
        next(stream)
        handle.cancel()
        assert 0 < r.ttl(KEYS.cancel(handle.request_id)) <= 3600
        completion = handle.result(timeout=10)
        assert completion.finish_reason is FinishReason.CANCELLED
        assert 0 < len(completion.text) < 200
    finally:
        worker.close()


def test_async_client(redis_url, echo):
    async def main():
        async with AsyncClient(redis_url) as client:
            handle = await client.submit("async", max_tokens=10)
            deltas = [d async for d in handle.text_stream(timeout=10)]
            assert deltas == list("async") and handle.completion.text == "async"
            handles = await client.submit_many([{"prompt": "ab"}, {"prompt": "cd", "priority": "high"}])
            assert [(await h.result(timeout=10)).text for h in handles] == ["ab", "cd"]
            with pytest.raises(RequestFailed):
                await (await client.submit("FAIL")).result(timeout=10)
            with pytest.raises(TimeoutError):
                await client.handle("nobody").result(timeout=0.1)
            await handles[0].cancel()
            assert await client.redis.exists(KEYS.cancel(handles[0].request_id))

    asyncio.run(main())


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Python 3.10 has no Task.cancelling(): a cancellation "
                    "that redis-py drops cannot be told from none there")
def test_cancelling_an_async_stream_stops_it_at_once(redis_url):
    """A task reading a stream whose tokens keep coming stops when it is cancelled (and
    ``asyncio.timeout`` around it fires). On Python 3.11 redis-py times out each command's
    write with ``asyncio.wait_for``, which drops a cancellation that lands just as the write
    completes; the stream then read on to the answer's end (the gateway's hang-up flake)."""
    worker = EchoWorker(redis_url, token_delay_s=0.0005)

    async def read_all(handle):
        async for _ in handle.stream(timeout=60):
            pass

    async def main():
        async with AsyncClient(redis_url) as client:
            for i in range(25):
                handle = await client.submit("y" * 4000, max_tokens=4000)
                async for _ in handle.stream(timeout=60):   # tokens are flowing
                    break
                task = asyncio.ensure_future(read_all(handle))
                await asyncio.sleep(0.002 * (i % 7))
                task.cancel()
                done, _ = await asyncio.wait({task}, timeout=2.0)
                assert done and task.cancelled(), f"round {i}: the cancelled stream kept reading"
                started = time.monotonic()
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0.01 + 0.002 * (i % 7)):
                        await client.handle(handle.request_id).result(timeout=60)
                assert time.monotonic() - started < 2.0, f"round {i}: the timeout fired late"
                await handle.cancel()

    try:
        asyncio.run(main())
    finally:
        worker.close()


def test_async_client_streams_more_requests_at_once_than_redis_pys_default_pool(redis_url):
    """Every stream being read holds a connection while its XREAD blocks: 150 requests
    submitted and read at once need 150 (redis-py's default pool stops at 100, and the
    101st submit failed with "Too many connections")."""
    async def one(client, i):
        handle = await client.submit(f"x{i:03d}", max_tokens=8)
        return (await handle.result(timeout=60)).text

    async def main():
        async with AsyncClient(redis_url) as client:
            requests = asyncio.gather(*(one(client, i) for i in range(150)))
            await asyncio.sleep(1.0)   # nobody answers yet: every stream is waiting
            worker = EchoWorker(redis_url)
            try:
                return await requests
            finally:
                worker.close()

    assert asyncio.run(main()) == [f"x{i:03d}" for i in range(150)]


@pytest.mark.processes
def test_stream_survives_a_redis_restart(tmp_path):
    with RedisServer(dir=tmp_path, appendonly=True, extra_args=("--appendfsync", "always")) as server:
        worker = EchoWorker(server.url, token_delay_s=0.01)
        try:
            with Client(server.url) as client:
                handle = client.submit("y" * 60)
                stream = handle.text_stream(timeout=30)
                received = [next(stream) for _ in range(5)]
                server.restart()
                received.extend(stream)
            assert "".join(received) == "y" * 60 == handle.completion.text
        finally:
            worker.close()


@pytest.mark.processes
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_a_request_redis_lost_is_sent_again_and_a_queued_one_is_not(use_async):
    """A Redis restarted without persistence comes back empty: the queued request is gone,
    and nothing would ever answer it. The reader's check (after ``lost_check_s`` without an
    answer) finds it nowhere and sends it again, same id; before the restart, the same check
    found it queued and sent nothing."""
    config = RedisConfig(lost_check_s=0.2, backoff_max_s=0.2)
    with RedisServer() as server:
        r = redis.Redis.from_url(server.url)

        async def submit_async():
            async with AsyncClient(server.url, config=config) as client:
                handle = await client.submit("lost and found", max_tokens=64)
                with pytest.raises(TimeoutError):   # nobody serves it: it waits, checked 4 times
                    await handle.result(timeout=1.0)
                assert r.xlen(KEYS.requests) == 1 and handle.entry_id == r.xrange(KEYS.requests)[0][0].decode()
                server.restart()
                assert r.xlen(KEYS.requests) == 0   # gone with the restart
                echo = EchoWorker(server.url)
                try:
                    return handle, await handle.result(timeout=20), list(echo.handled)
                finally:
                    echo.close()

        if use_async:
            handle, completion, handled = asyncio.run(submit_async())
        else:
            with Client(server.url, config=config) as client:
                handle = client.submit("lost and found", max_tokens=64)
                with pytest.raises(TimeoutError):   # nobody serves it: it waits, checked 4 times
                    handle.result(timeout=1.0)
                assert r.xlen(KEYS.requests) == 1 and handle.entry_id == r.xrange(KEYS.requests)[0][0].decode()
                server.restart()
                assert r.xlen(KEYS.requests) == 0
                echo = EchoWorker(server.url)
                try:
                    completion, handled = handle.result(timeout=20), list(echo.handled)
                finally:
                    echo.close()
        assert completion.text == "lost and found" and handled == [handle.request_id]
        assert handle._lost.resent == 1
        r.close()


def test_lost_check_reads_queued_taken_and_answered_as_known():
    from pdqueue.client_outage import LostCheck

    check = LostCheck(KEYS, "rid", KEYS.requests, {}, "1000-5", interval_s=5.0)
    assert not check.due(answered=False)                        # quiet for less than 5 s
    check.quiet_since -= 6
    assert check.due(answered=False) and not check.due(answered=True)   # an answer begun: never resent

    def group(delivered: str) -> list[dict]:
        return [{"name": b"other", "last-delivered-id": b"9999-0"},
                {"name": b"prefill", "last-delivered-id": delivered.encode()}]

    gone = redis.ResponseError("no such key")
    nogroup = redis.ResponseError("NOGROUP No such key 'x' or consumer group 'prefill'")
    pending = [{"message_id": b"1000-5", "consumer": b"p0", "time_since_delivered": 5, "times_delivered": 1}]
    assert not check.lost([1, gone, 0, gone])            # taken (seen:<id>) or answered (out:<id>)
    assert not check.due(answered=False)                  # the clock restarted
    assert not check.lost([0, [], 3, group("1000-4")])    # the group has not reached it: maybe queued
    assert not check.lost([0, nogroup, 3, []])            # no group yet: nobody has read the stream
    assert not check.lost([0, pending, 3, group("1000-5")])   # in a worker's hands (its seen:<id> lost)
    assert check.lost([0, [], 3, group("1000-5")])        # read, neither pending nor taken
    assert check.lost([0, [], 0, group("0-0")])           # an empty stream (made again after a restart)
    assert check.lost([0, gone, 0, gone])                 # the stream is gone
    with pytest.raises(redis.ResponseError, match="NOPERM"):
        check.lost([0, [], 3, redis.ResponseError("NOPERM this user has no permissions")])


@pytest.mark.processes
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_a_redis_gone_for_good_raises_redis_unavailable(use_async):
    """Not a silent wait for the whole timeout: after ``unavailable_after_s`` of failed
    reconnects the stream raises (a short outage, like a restart, is still survived: above)."""
    from pdqueue.client import RedisUnavailable

    config = RedisConfig(unavailable_after_s=1.0, backoff_max_s=0.2)
    with RedisServer() as server:
        if use_async:
            async def read() -> None:
                async with AsyncClient(server.url, config=config) as client:
                    handle = await client.submit("nobody answers")
                    server.kill()
                    await handle.result(timeout=30)

            started = time.monotonic()
            with pytest.raises(RedisUnavailable) as info:
                asyncio.run(read())
        else:
            with Client(server.url, config=config) as client:
                handle = client.submit("nobody answers")
                server.kill()
                started = time.monotonic()
                with pytest.raises(RedisUnavailable) as info:
                    handle.result(timeout=30)
    assert time.monotonic() - started < 10
    assert info.value.outage_s >= 1.0 and "unreachable for" in str(info.value)
    assert isinstance(info.value, redis.ConnectionError)


@pytest.fixture
def no_local_settings(tmp_path, monkeypatch):
    """No PDQ_* variables and a private, empty state directory."""
    for name in ("PDQ_REDIS_URL", "PDQ_CLUSTER"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return tmp_path / "pdqueue"


def write_up_state(url: str, cluster: str) -> None:
    from pdqueue.discovery import write_state

    write_state({"url": url, "cluster": cluster, "pid": os.getpid()})  # this live process stands in for `up`


def test_client_without_a_url_finds_the_running_up(redis_url, echo, no_local_settings, monkeypatch):
    with Client() as client:  # nothing up, nothing set: Redis's own port, cluster default
        assert (client.url, client.keys.cluster) == ("redis://127.0.0.1:6379/0", "default")
    write_up_state(redis_url, "default")
    assert (no_local_settings / "up-default.json").exists()
    with Client() as client:
        assert client.url == redis_url
        assert client.submit("found", max_tokens=5).result(timeout=10).text == "found"

    async def async_url():
        async with AsyncClient() as client:
            return client.url, client.keys.cluster

    assert asyncio.run(async_url()) == (redis_url, "default")
    monkeypatch.setenv("PDQ_REDIS_URL", "redis://127.0.0.1:1/0")  # the environment before the state file
    with Client() as client:
        assert client.url == "redis://127.0.0.1:1/0"
    with Client(redis_url) as client:  # an explicit URL before everything
        assert client.url == redis_url


@pytest.mark.processes
def test_resolve_order(no_local_settings, monkeypatch):
    from pdqueue.discovery import DEFAULT_URL, DiscoveryError, Target, resolve

    assert resolve() == Target(DEFAULT_URL, "default", "the default URL")
    write_up_state("redis://127.0.0.1:7001/0", "blue")
    assert where(resolve()) == ("redis://127.0.0.1:7001/0", "blue")  # the only one up
    assert where(resolve(cluster="red")) == (DEFAULT_URL, "red")      # a cluster without an `up`
    write_up_state("redis://127.0.0.1:7002/0", "green")
    with pytest.raises(DiscoveryError, match="blue.*green"):          # two, neither is `default`
        resolve()
    assert where(resolve(cluster="green")) == ("redis://127.0.0.1:7002/0", "green")
    assert where(resolve("redis://127.0.0.1:7001/0")) == ("redis://127.0.0.1:7001/0", "blue")  # the `up` there
    monkeypatch.setenv("PDQ_CLUSTER", "blue")
    assert where(resolve()) == ("redis://127.0.0.1:7001/0", "blue")
    monkeypatch.delenv("PDQ_CLUSTER")
    write_up_state("redis://127.0.0.1:7003/0", "default")
    assert where(resolve()) == ("redis://127.0.0.1:7003/0", "default")  # several: `default`
    monkeypatch.setenv("PDQ_REDIS_URL", "redis://h:1/0")
    assert resolve() == Target("redis://h:1/0", "default", "PDQ_REDIS_URL")
    assert resolve("redis://h:2/0", "x") == Target("redis://h:2/0", "x", "the redis_url argument")
    # A state file whose `up` is gone does not count.
    path = no_local_settings / "up-default.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "pid": dead_pid()}))
    monkeypatch.delenv("PDQ_REDIS_URL")
    with pytest.raises(DiscoveryError):
        resolve()


def where(target) -> tuple[str, str]:
    return target.url, target.cluster


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.processes
def test_discovery_and_the_client_import_no_torch():
    code = ("import sys, pdqueue.discovery; from pdqueue import Client; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_raw_redis_producer_needs_no_pdqueue(redis_url, echo):
    """The write side as any Redis client sees it: plain XADD, plain XREAD of plain fields."""
    raw = redis.Redis.from_url(redis_url, decode_responses=True)
    entry_id = raw.xadd("pdq:{default}:requests", {"prompt": "hi", "max_tokens": "8"})
    answer, last = [], "0-0"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (answer and answer[-1]["type"] == "done"):
        for _, entries in raw.xread({f"pdq:{{default}}:out:{entry_id}": last}, block=200) or []:
            for last, fields in entries:
                answer.append(fields)
    assert [f["type"] for f in answer] == ["token", "token", "done"]
    assert answer[0] == {"type": "token", "index": "0", "token_ids": "[104]", "text": "h"}
    assert answer[-1]["text"] == "hi" and answer[-1]["finish_reason"] == "stop"
    assert answer[-1]["token_ids"] == "[104,105]" and answer[-1]["id"] == entry_id
    raw.close()
