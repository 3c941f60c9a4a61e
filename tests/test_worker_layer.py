"""The worker layer's parts on a real Redis, in this process: answers (one owner-only way),
recovery (failed units taken in again, reclaim, keep), and a worker switching its role in
place. The whole worker processes are tested in test_pipeline/test_faults/test_chaos."""

from __future__ import annotations

import re
import threading
import time

import pytest

from pdqueue.client import Client
from pdqueue.keys import PREFILL_GROUP, Keys
from pdqueue.protocol import Completion, ErrorCode, FinishReason
from pdqueue.queue.publisher import Publisher
from pdqueue.queue.streams import ensure_group, read_group, request_streams
from tests.helpers import oracle, wait_for
from workers.answers import Unit
from workers.recovery import Recovery

KEYS = Keys()


class FakeRole:
    """Just what Recovery asks of a role."""
    group = PREFILL_GROUP

    def __init__(self, held=None):
        self._held = held or {}

    def streams(self):
        return list(request_streams(KEYS))

    def held(self):
        return self._held


def deliver(r, consumer: str, n: int = 1) -> list[str]:
    ensure_group(r, KEYS.requests, PREFILL_GROUP)
    for i in range(n):
        r.xadd(KEYS.requests, {"id": f"r{i}", "prompt": "hi"})
    return [e[1] for e in read_group(r, PREFILL_GROUP, consumer, [KEYS.requests], count=n)]


def run_unit(r, unit: Unit) -> list:
    with r.pipeline(transaction=True) as pipe:
        for op in unit.ops:
            op(pipe)
        return pipe.execute()


def test_an_entry_gets_one_answer_whoever_finishes_first(r):
    mine, theirs = deliver(r, "w1", 2)
    r.xclaim(KEYS.requests, PREFILL_GROUP, "w2", 0, [theirs])   # taken over meanwhile ...
    other = Unit(KEYS, "w2", PREFILL_GROUP)
    other.ack(KEYS.requests, theirs)
    assert run_unit(r, other) == [1]                             # ... and finished there
    unit = Unit(KEYS, "w1", PREFILL_GROUP)
    unit.reject(KEYS.requests, theirs, {"id": "r1"}, "r1", "no", ErrorCode.BAD_REQUEST)
    unit.done(KEYS.requests, mine, Completion("r0", "", (), FinishReason.EXPIRED))
    assert run_unit(r, unit) == [0, 1]
    assert not r.exists(KEYS.out("r1")) and not r.exists(KEYS.dead)
    assert [f[b"type"] for _, f in r.xrange(KEYS.out("r0"))] == [b"done"] and r.xlen(KEYS.done) == 1
    assert 0 < r.pttl(KEYS.out("r0")) <= 3600 * 1000
    assert r.xpending(KEYS.requests, PREFILL_GROUP)["pending"] == 0 and r.xlen(KEYS.requests) == 0


def test_a_failed_unit_reaches_the_worker_and_its_entry_is_taken_in_again(r, redis_url):
    import redis

    entry_id, = deliver(r, "w1")
    failed = []

    def on_error(exc, ops):
        failed.append(ops)
        recovery.on_unit_failed()

    def broken(pipe):
        raise RuntimeError("cannot build")

    publisher = Publisher(lambda: redis.Redis.from_url(redis_url), on_error=on_error)
    recovery = Recovery(r, KEYS, "w1", reclaim_idle_ms=3000, publisher=publisher)
    try:
        assert recovery.recover(FakeRole(), 10) == []          # nothing to resync yet
        unit = Unit(KEYS, "w1", PREFILL_GROUP)
        unit.ack(KEYS.requests, entry_id, "r0")
        publisher.submit([broken, *unit.ops])
        assert publisher.flush(timeout=10) and len(failed) == 1
        held = FakeRole({"r0": (KEYS.requests, entry_id)})
        assert recovery.recover(held, 10) == []                 # in hand: nothing lost
        recovery.on_unit_failed()
        lost = recovery.recover(FakeRole(), 10)                 # dropped from hand: taken in again
        assert [e[1] for e in lost] == [entry_id]
    finally:
        publisher.close()


def test_reclaim_takes_dead_workers_entries_at_once_and_hung_ones_when_idle(r, monkeypatch):
    dead, = deliver(r, "dead-worker")
    r.xadd(KEYS.requests, {"id": "x", "prompt": "hi"})
    hung, = [e[1] for e in read_group(r, PREFILL_GROUP, "hung-worker", [KEYS.requests], count=1)]
    r.set(KEYS.worker("hung-worker"), "alive")
    monkeypatch.setattr(r, "exists", None)   # liveness is one pipelined round trip, not EXISTS each
    time.sleep(0.25)   # past the 200 ms minimum idle time of a dead worker's entries
    # The hung worker's entry is taken once idle past reclaim_idle_ms (6x the wait above, so a
    # slow first call still finds it too young), and only then: polled, not slept for.
    recovery = Recovery(r, KEYS, "w1", reclaim_idle_ms=1500, publisher=Publisher(lambda: r))
    try:
        assert [e[1] for e in recovery.reclaim(PREFILL_GROUP, request_streams(KEYS), 10)] == [dead]
        assert recovery.reclaim(PREFILL_GROUP, request_streams(KEYS), 10) == []   # at most every 0.5 s
        taken = wait_for(lambda: recovery.reclaim(PREFILL_GROUP, request_streams(KEYS), 10), timeout=10,
                         what="the hung worker's entry reclaimed")
        assert [e[1] for e in taken] == [hung]
    finally:
        recovery.publisher.close()


def test_keep_reports_what_another_worker_took_over(r):
    a, b = deliver(r, "w1", 2)
    r.xclaim(KEYS.requests, PREFILL_GROUP, "w2", 0, [b])
    recovery = Recovery(r, KEYS, "w1", reclaim_idle_ms=3000, publisher=Publisher(lambda: r))
    try:
        role = FakeRole({"r0": (KEYS.requests, a), "r1": (KEYS.requests, b)})
        assert recovery.keep(role) == ["r1"]
        assert recovery.keep(role) == []   # not again before reclaim_idle_ms / 3
    finally:
        recovery.publisher.close()


def test_a_worker_switches_its_role_in_place(redis_url, tiny):
    """Colocated -> prefill in one process, the model loaded once; a decode worker (another
    shell in this process) finishes what the prefill role hands off."""
    from pdqueue.engine.config import EngineConfig
    from workers.colocated import ColocatedRole
    from workers.common import WorkerConfig
    from workers.decode import DecodeRole
    from workers.prefill import PrefillRole
    from workers.shell import WorkerShell

    engine = EngineConfig(model="tiny", num_threads=1, kv_cache_mb=16)
    config = WorkerConfig(redis_url=redis_url, engine=engine, heartbeat_ttl_s=2.0, lease_s=5.0)
    shell = WorkerShell(config, tiny, ColocatedRole())
    decode = WorkerShell(config, tiny, DecodeRole())
    threads = [threading.Thread(target=s.run, daemon=True) for s in (shell, decode)]
    threads[0].start()
    client = Client(redis_url)
    params = {"max_tokens": 6, "temperature": 0.0, "seed": 0}
    prompt_ids, expected, _ = oracle(tiny, ["switch me", "and again"], [params, params])
    try:
        first = client.submit("switch me", **params).result(timeout=60)
        assert first.transfer_path == "local" and list(first.token_ids) == expected[0]
        shell.switch_role(PrefillRole())
        wait_for(lambda: client.redis.hget(KEYS.worker(shell.worker_id), "role") == b"prefill",
                 timeout=30, what="the worker to come back as prefill")
        assert shell.loaded is tiny
        threads[1].start()
        second = client.submit("and again", **params).result(timeout=60)
        assert second.prefill_worker == shell.worker_id and second.decode_worker == decode.worker_id
        assert second.transfer_path == "shm" and list(second.token_ids) == expected[1]
    finally:
        for s in (decode, shell):
            s.stop.warm.set()
            s.stop.cold.set()
        for t in threads:
            t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)


def test_a_worker_config_refuses_bad_values_and_the_cli_shows_its_defaults():
    import dataclasses

    from click.testing import CliRunner

    from workers.cli.worker import worker
    from workers.common import WorkerConfig

    for bad, field_name in ((dict(routing="nearest"), "routing"), (dict(transfer="rdma"), "transfer"),
                            (dict(lease_s=0), "lease_s"), (dict(reclaim_idle_ms=10), "reclaim_idle_ms"),
                            (dict(data_port=70000), "data_port"), (dict(max_attempts=0), "max_attempts"),
                            (dict(redis_gone_exit_s=-1), "redis_gone_exit_s"), (dict(cluster=""), "cluster")):
        with pytest.raises(ValueError, match=f"WorkerConfig.{field_name}"):
            WorkerConfig(**bad)
    with pytest.raises(ValueError, match="WorkerConfig.lease_s"):
        dataclasses.replace(WorkerConfig(), lease_s=-1.0)
    shown = CliRunner().invoke(worker, ["--help"], terminal_width=200).output
    defaults = WorkerConfig()
    for option, value in (("--lease-s", defaults.lease_s), ("--reclaim-idle-ms", defaults.reclaim_idle_ms),
                          ("--heartbeat-ttl-s", defaults.heartbeat_ttl_s),
                          ("--max-num-seqs", defaults.engine.max_num_seqs)):
        assert re.search(rf"{option}\b[^\[]*\[default: {value}[;\]]", shown), (option, shown)
