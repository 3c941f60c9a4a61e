"""A submit survives a Redis restart, and a request sent again is answered once.

``Client.submit``/``submit_many`` (and the asyncio twins) send the same request, same id,
again after a lost connection or a server still loading its AOF (LOADING) or running a
slow script (BUSY), for ``submit_retry_s``. A resend whose first try did reach Redis
queues a second entry with the same id: the workers' intake runs an id once
(``seen:<id>``), the other entry goes to ``dead`` as a duplicate. Real Redis servers,
killed with SIGKILL as a crash, and a real colocated worker; nothing mocked.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pdqueue import AsyncClient, Client
from pdqueue.client import RedisUnavailable
from pdqueue.client_outage import transient
from pdqueue.config import RedisConfig
from pdqueue.keys import Keys
from pdqueue.protocol import ResultType, parse_result
from pdqueue.queue.redis_server import RedisServer, free_port
from tests.cluster import Cluster
from tests.helpers import FAST, wait_for

pytestmark = [pytest.mark.timeout(180), pytest.mark.xdist_group("test_submit_retry")]

KEYS = Keys()
PROMPT = "Once upon a restart"
PARAMS = dict(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A Redis that keeps every write (AOF, fsync always) and takes ~1 s to load it at each
    start (``key-load-delay``: LOADING replies meanwhile), and one colocated worker on it."""
    root = tmp_path_factory.mktemp("submit-retry")
    server = RedisServer(dir=root / "redis", appendonly=True, extra_args=(
        "--appendfsync", "always", "--key-load-delay", "100", "--loading-process-events-interval-bytes", "1024"))
    server.start()
    with redis.Redis.from_url(server.url) as r, r.pipeline(transaction=False) as pipe:
        for i in range(10_000):   # 10k keys x 0.1 ms; clients are served between every 1024 of them
            pipe.set(f"filler:{i}", "x")
        pipe.execute()
    cluster = Cluster(server.url, root)
    try:
        cluster.start("colocated", *FAST, worker_id="c0")
        yield server, cluster
        cluster.stop_and_check()
    finally:
        cluster.kill_all()   # only a failed test leaves it running
        server.stop()


def answers(url: str, request_id: str) -> tuple[int, list[int], int]:
    """(done entries on the ``done`` stream, the token indexes on ``out:<id>`` in order, final
    entries on ``out:<id>``) for ``request_id``."""
    with redis.Redis.from_url(url) as r:
        done = sum(f[b"id"].decode() == request_id for _, f in r.xrange(KEYS.done))
        events = [parse_result(eid.decode(), f) for eid, f in r.xrange(KEYS.out(request_id))]
    indexes = [i for e in events if e.type is ResultType.TOKEN
               for i in range(e.index, e.index + max(1, len(e.token_ids)))]
    return done, indexes, sum(e.type is not ResultType.TOKEN for e in events)


def assert_answered_once(url: str, request_id: str, num_tokens: int) -> None:
    done, indexes, finals = answers(url, request_id)
    assert (done, finals) == (1, 1), f"request {request_id}: {done} done entries, {finals} final entries on out:"
    assert indexes == list(range(num_tokens)), f"request {request_id}: token indexes {indexes}"


def duplicates(url: str, request_id: str) -> int:
    """Dead-letter entries of ``request_id``'s duplicates."""
    with redis.Redis.from_url(url) as r:
        return sum(f.get(b"field:id") == request_id.encode() and f[b"code"] == b"duplicate"
                   for _, f in r.xrange(KEYS.dead))


def submit_across_an_outage(url: str, how: str, request_id: str, warmed: threading.Event,
                            killed: threading.Event):
    """The producer (in a thread of its own: the test's thread kills and starts Redis): a
    first request, so the pool holds a connection, then ``request_id`` once Redis is
    killed. Returns (the first completion, the second, how long the second submit took).
    ``how``: sync, async, or loading: sync on a redis-py client that does not retry by itself
    (its default retries a LOADING reply for a few seconds, so a longer load would reach the
    client's own loop: this one does at once)."""
    config = RedisConfig(url=url, backoff_max_s=0.1)   # tries often enough to meet LOADING
    own = redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0)) if how == "loading" else None

    if how != "async":
        try:
            with Client(config=config, redis_client=own) as client:
                first = client.submit(PROMPT, **PARAMS).result(timeout=60)
                warmed.set()
                killed.wait(30)
                started = time.monotonic()
                handle = client.submit(PROMPT, id=request_id, **PARAMS)
                took = time.monotonic() - started
                return first, handle.result(timeout=60), took
        finally:
            if own is not None:
                own.close()

    async def main():
        async with AsyncClient(config=config) as client:
            first = await (await client.submit(PROMPT, **PARAMS)).result(timeout=60)
            warmed.set()
            await asyncio.to_thread(killed.wait, 30)
            started = time.monotonic()
            handle = await client.submit(PROMPT, id=request_id, **PARAMS)
            took = time.monotonic() - started
            return first, await handle.result(timeout=60), took

    return asyncio.run(main())


@pytest.mark.processes
@pytest.mark.parametrize("how", ["sync", "async", "loading"])
def test_a_submit_while_redis_is_down_is_sent_when_it_is_back_and_answered_once(served, how, caplog):
    server, _ = served
    request_id = f"outage-{how}"
    warmed, killed = threading.Event(), threading.Event()
    with ThreadPoolExecutor(1) as pool:
        producer = pool.submit(submit_across_an_outage, server.url, how, request_id, warmed, killed)
        assert warmed.wait(60), producer.exception(0) if producer.done() else "no first answer"
        server.kill()   # SIGKILL: the producer's pooled connection dies with it
        killed.set()
        time.sleep(0.5)
        assert not producer.done(), "the submit gave up while Redis was down"
        server.start()   # same port and AOF; ~1 s of LOADING before it serves
        first, completion, took = producer.result(timeout=90)
    assert took >= 0.5
    assert completion.token_ids == first.token_ids and completion.finish_reason == first.finish_reason
    assert_answered_once(server.url, request_id, completion.num_tokens)
    assert duplicates(server.url, request_id) == 0
    retried = [r.getMessage() for r in caplog.records if f"request {request_id}: submitted after" in r.getMessage()]
    assert retried and "ConnectionError x" in retried[0], retried
    if how == "loading":
        assert "BusyLoadingError x" in retried[0], retried


@pytest.mark.processes
def test_the_same_request_id_submitted_again_is_answered_once(served):
    """What a resend sends when its first try reached Redis but the reply was lost: the same
    request, same id, in a second entry (and once more through ``submit_many``)."""
    server, _ = served
    request_id = "twice"
    with Client(server.url) as client:
        first = client.submit(PROMPT, id=request_id, **PARAMS)
        again = client.submit(PROMPT, id=request_id, **PARAMS)
        [third] = client.submit_many([dict(prompt=PROMPT, id=request_id, **PARAMS)])
        assert len({first.entry_id, again.entry_id, third.entry_id}) == 3, "three entries queued"
        results = [h.result(timeout=60) for h in (first, again, third)]
    assert all(r.token_ids == results[0].token_ids for r in results)   # each handle reads the one answer
    wait_for(lambda: duplicates(server.url, request_id) == 2, 30, what="the two duplicates dead-lettered")
    assert_answered_once(server.url, request_id, results[0].num_tokens)


@pytest.mark.parametrize("how", ["submit", "async", "submit_many"])
def test_a_redis_down_past_the_window_fails_the_submit_naming_the_request_and_the_time(how):
    url = f"redis://127.0.0.1:{free_port()}/0"   # nothing listens there
    started = time.monotonic()
    with pytest.raises(RedisUnavailable) as info:
        if how == "submit":
            with Client(url, submit_retry_s=1.0) as client:
                client.submit("nobody hears", id="gone-1")
        elif how == "submit_many":
            with Client(url, config=RedisConfig(url=url, submit_retry_s=1.0)) as client:
                client.submit_many([dict(prompt="nobody", id="gone-1"), dict(prompt="hears", id="gone-2")])
        else:
            async def main():
                async with AsyncClient(url, submit_retry_s=1.0) as client:
                    await client.submit("nobody hears", id="gone-1")
            asyncio.run(main())
    elapsed = time.monotonic() - started
    assert 1.0 <= elapsed < 5, elapsed
    error = info.value
    message = str(error)
    what = "2 requests (gone-1, gone-2)" if how == "submit_many" else "request gone-1"
    assert message.startswith(f"could not submit {what} to Redis at {url}: tried for 1."), message
    assert "submit_retry_s=1;" in message and "ConnectionError x" in message and "Error 111" in message, message
    assert error.request_ids == (("gone-1", "gone-2") if how == "submit_many" else ("gone-1",))
    assert error.outage_s >= 1.0 and isinstance(error, redis.ConnectionError)
    assert isinstance(error.__cause__, redis.ConnectionError)   # the last redis error, for who wants it


@pytest.mark.processes
def test_a_submit_rides_out_a_busy_script_and_queues_one_entry(tmp_path):
    """BUSY (a script past ``busy-reply-threshold``): the command was refused, not run, so
    the resend queues the one entry."""
    with RedisServer(dir=tmp_path) as server, redis.Redis.from_url(server.url) as r:
        r.config_set("busy-reply-threshold", 100)

        def busy():
            with redis.Redis.from_url(server.url) as own:
                try:
                    own.eval("while true do end", 0)
                except redis.ResponseError:   # killed by SCRIPT KILL
                    pass

        def refused_busy() -> bool:
            try:
                r.ping()
            except redis.ResponseError as exc:
                return str(exc).startswith("BUSY")
            return False

        blocker = threading.Thread(target=busy, daemon=True)
        blocker.start()
        wait_for(refused_busy, 10, what="BUSY replies")
        with Client(server.url, config=RedisConfig(backoff_max_s=0.1)) as client, ThreadPoolExecutor(1) as pool:
            sent = pool.submit(client.submit, "busy", id="busy-1")
            time.sleep(0.5)
            assert not sent.done(), sent.exception(0) if sent.done() else None
            r.script_kill()
            handle = sent.result(timeout=10)
        blocker.join(10)
        assert [(eid.decode(), f[b"id"]) for eid, f in r.xrange(KEYS.requests)] == [(handle.entry_id, b"busy-1")]


def test_what_a_submit_sends_again():
    """Transient: connection lost or refused, a timeout, LOADING, BUSY, cluster hiccups.
    Not: credentials, permissions, the client's own pool limit, a wrong command."""
    e = redis.exceptions
    assert all(transient(exc) for exc in (
        e.ConnectionError("Connection closed by server."), e.TimeoutError("Timeout reading from socket"),
        e.BusyLoadingError("Redis is loading the dataset in memory"),
        e.ResponseError("BUSY Redis is busy running a script."), e.TryAgainError("x"),
        e.MasterDownError("Link with MASTER is down")))
    assert not any(transient(exc) for exc in (
        e.AuthenticationError("invalid password"), e.NoPermissionError("no permissions"),
        e.MaxConnectionsError("Too many connections"), e.ResponseError("WRONGTYPE Operation against a key"),
        e.ReadOnlyError("You can't write against a read only replica.")))
