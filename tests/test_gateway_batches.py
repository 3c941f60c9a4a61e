"""The gateway's tenants and its OpenAI Batch API, end to end: a real Redis, real tiny-model
workers (one prefill, one decode), real `pdqueue serve` processes started with a tenants
file, and the official `openai` client.

- A tenant over its requests-per-second limit gets a 429 (openai.RateLimitError) with
  Retry-After, counted in /metrics by tenant; an unknown key is a 401.
- A batch uploaded and created through the client is answered line by line; the gateway
  running it is SIGKILLed mid-batch, a new one takes it over after the lease, and the
  output file holds every line exactly once (each request computed once: one `done`
  entry per line, no `.2` ids), with the greedy text pdqueue's Client gets.
- Bad input gets OpenAI errors that say what is wrong: malformed JSONL at upload, a wrong
  purpose, unknown file and batch ids, another tenant's batch, an endpoint the lines do
  not use; a cancelled batch ends `cancelled` with each answered line once.
"""

from __future__ import annotations

import io
import json
import os
import signal
import time
from pathlib import Path

import openai
import pytest
import redis

from pdqueue.client import Client
from pdqueue.frontends.batch_input import request_id
from pdqueue.keys import Keys
from tests.cluster import Cluster
from tests.helpers import wait_for
from tests.test_gateway import Gateway

pytestmark = [pytest.mark.processes, pytest.mark.xdist_group("test_gateway_batches")]   # module-scoped cluster

CLUSTER = "gwb"
KEYS = Keys(CLUSTER)
TENANTS = """
[tenants.alice]
api_keys = ["sk-alice"]
share = 2
service_class = "standard"

[tenants.bob]
api_keys = ["sk-bob"]

[tenants.slow]
api_keys = ["sk-slow"]
requests_per_s = 0.2     # one request, then one every 5 s
service_class = "interactive"
"""


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gateway-batches")


@pytest.fixture(scope="module")
def url(redis_server):
    if not redis_server.running:
        redis_server.restart()
    with redis.Redis.from_url(redis_server.url) as r:
        r.flushall()
    return redis_server.url


@pytest.fixture(scope="module")
def workers(url, logs):
    cluster = Cluster(url, logs, cluster=CLUSTER)
    cluster.start("prefill", wait=False)
    cluster.start("decode", wait=False)
    for name in list(cluster.procs):
        cluster.wait_registered(name)
    yield cluster
    cluster.stop_and_check()


@pytest.fixture(scope="module")
def tenants_file(logs) -> Path:
    path = logs / "tenants.toml"
    path.write_text(TENANTS)
    return path


def start_gateway(url, logs, tenants_file, name: str) -> Gateway:
    return Gateway(url, CLUSTER, logs, "--tenants", str(tenants_file), "--batch-lease-s", "2",
                   "--batch-concurrency", "4", name=name)


@pytest.fixture(scope="module")
def gateway(url, logs, tenants_file, workers):
    gw = start_gateway(url, logs, tenants_file, "gateway-1")
    yield gw
    gw.stop()


def oa(gw: Gateway, key: str = "sk-alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


def jsonl(lines: list) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def line(cid: str, prompt: str, max_tokens: int = 8) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}}


def upload(client: openai.OpenAI, data: bytes, name: str = "input.jsonl"):
    return client.files.create(file=(name, io.BytesIO(data)), purpose="batch")


def wait_status(client: openai.OpenAI, batch_id: str, statuses: tuple, timeout: float = 240):
    def ended():
        try:
            b = client.batches.retrieve(batch_id)
        except openai.InternalServerError as exc:
            # 503 is the gateway's answer while the cluster's Redis is unreachable (a restart
            # loading its append-only file): asked again, as a client told to retry would.
            if exc.status_code != 503:
                raise
            return None
        return b if b.status in statuses else None
    return wait_for(ended, timeout, what=f"batch {batch_id} in {statuses}", interval=0.2)


def output_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).content.splitlines() if x.strip()]


def metric(gw: Gateway, name: str, **labels) -> float:
    status, _, body = gw.get("/metrics")
    assert status == 200
    for text in body.decode().splitlines():
        if text.startswith(name + "{") and all(f'{k}="{v}"' in text for k, v in labels.items()):
            return float(text.rsplit(" ", 1)[1])
    return 0.0


# ---- tenants ----------------------------------------------------------------------------------

def test_a_tenant_over_its_rate_gets_429_with_retry_after(gateway):
    slow = oa(gateway, "sk-slow")
    first = slow.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0)
    assert first.choices[0].text is not None
    with pytest.raises(openai.RateLimitError) as info:
        slow.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0)
    retry_after = int(info.value.response.headers["retry-after"])
    assert 1 <= retry_after <= 5
    error = info.value.response.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and "slow" in error["message"]
    assert error["type"] == "rate_limit_error"
    # Another tenant is not limited by it.
    assert oa(gateway, "sk-bob").completions.create(model="tiny", prompt="hi", max_tokens=2).choices
    assert metric(gateway, "pdqueue:gateway_tenant_rate_limited_total", tenant="slow", limit="requests") == 1
    assert metric(gateway, "pdqueue:gateway_tenant_requests_total", tenant="slow", status="200") == 1
    assert metric(gateway, "pdqueue:gateway_tenant_generation_tokens_total", tenant="slow") >= 1
    assert metric(gateway, "pdqueue:gateway_tenant_requests_total", tenant="bob", status="200") == 1
    with pytest.raises(openai.AuthenticationError):
        oa(gateway, "sk-nobody").models.list()


# ---- the Batch API ------------------------------------------------------------------------------

def test_a_batch_is_answered_once_per_line_across_a_gateway_kill(url, logs, tenants_file, workers, gateway):
    n = 40
    prompts = [f"Line {i}: the quick brown fox" for i in range(n)]
    client = oa(gateway)
    f = upload(client, jsonl([line(f"req-{i}", p, max_tokens=24) for i, p in enumerate(prompts)]))
    assert f.purpose == "batch" and f.bytes > 0 and f.object == "file"
    assert client.files.content(f.id).content == jsonl([line(f"req-{i}", p, max_tokens=24)
                                                        for i, p in enumerate(prompts)])
    # A second gateway, to be killed while it runs the batch; the module's waits (it runs
    # nothing it did not take: the first gateway takes part only after the kill).
    victim = start_gateway(url, logs, tenants_file, "gateway-victim")
    gateway_pid = gateway.proc.pid
    os.kill(gateway_pid, signal.SIGSTOP)   # the module's gateway takes no batch meanwhile
    try:
        vclient = oa(victim)
        batch = vclient.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h",
                                       metadata={"run": "restart"})
        assert batch.status in ("validating", "in_progress") and batch.request_counts.total == n

        def some_done():
            b = vclient.batches.retrieve(batch.id)
            return b if b.request_counts.completed >= 3 else None
        at_kill = wait_for(some_done, 120, what="some lines answered", interval=0.1)
        os.killpg(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait()
    finally:
        os.kill(gateway_pid, signal.SIGCONT)
        if victim.proc.poll() is None:   # the test failed before the kill
            os.killpg(victim.proc.pid, signal.SIGKILL)
            victim.proc.wait()
    assert at_kill.request_counts.completed < n, "the batch ended before the kill: make it longer"
    done = wait_status(client, batch.id, ("completed", "failed", "cancelled"))
    assert done.status == "completed", done
    assert done.request_counts.completed == n and done.request_counts.failed == 0
    assert done.error_file_id is None and done.metadata == {"run": "restart"}
    out = output_lines(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(n))   # each once
    assert all(o["response"]["status_code"] == 200 and o["error"] is None for o in out)
    assert {o["response"]["request_id"] for o in out} == {request_id(batch.id, f"req-{i}") for i in range(n)}
    # Each request computed once: one done entry per line on the done stream.
    with redis.Redis.from_url(url) as r:
        ids = [fields[b"id"].decode() for _, fields in r.xrange(KEYS.done)
               if fields.get(b"id", b"").startswith(f"batch:{batch.id}:".encode())]
    assert len(ids) == n and len(set(ids)) == n
    by_id = {o["custom_id"]: o for o in out}
    with Client(url, CLUSTER) as c:
        for i in (0, n - 1):
            want = c.submit(prompt=prompts[i], max_tokens=24, temperature=0.0).result(timeout=60)
            assert by_id[f"req-{i}"]["response"]["body"]["choices"][0]["text"] == want.text


def test_batch_api_bad_input_gets_clear_openai_errors(gateway):
    client = oa(gateway)
    with pytest.raises(openai.BadRequestError) as info:
        upload(client, jsonl([line("a", "x"), "{not json", {"custom_id": "c", "method": "GET",
                                                             "url": "/v1/completions", "body": {}}]))
    message = info.value.response.json()["error"]["message"]
    assert "line 2 is not valid JSON" in message and "line 3: method must be POST" in message
    assert info.value.response.json()["error"]["code"] == "invalid_file_format"
    with pytest.raises(openai.BadRequestError) as info:
        upload(client, jsonl([line("a", "x"), line("a", "y")]))
    assert "duplicate_custom_id" in info.value.response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.files.create(file=("x.jsonl", io.BytesIO(jsonl([line("a", "x")]))), purpose="fine-tune")
    assert info.value.response.json()["error"]["param"] == "purpose"
    with pytest.raises(openai.NotFoundError) as info:
        client.batches.create(input_file_id="file-doesnotexist", endpoint="/v1/completions",
                              completion_window="24h")
    assert "file-doesnotexist" in info.value.response.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve("file-doesnotexist")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_doesnotexist")
    good = upload(client, jsonl([line("a", "x")]))
    with pytest.raises(openai.BadRequestError) as info:   # the lines are completions
        client.batches.create(input_file_id=good.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert info.value.response.json()["error"]["param"] == "endpoint"
    with pytest.raises(openai.NotFoundError):   # files and batches are the tenant's
        oa(gateway, "sk-bob").files.retrieve(good.id)


def test_a_cancelled_batch_ends_cancelled_with_each_answered_line_once(gateway):
    client = oa(gateway)
    n = 200
    f = upload(client, jsonl([line(f"c-{i}", f"Cancel me {i}", max_tokens=32) for i in range(n)]))
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 1, 120, what="a line answered",
             interval=0.1)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_status(client, batch.id, ("cancelled", "completed", "failed"), timeout=60)
    assert done.status == "cancelled" and done.cancelled_at is not None
    out = output_lines(client, done.output_file_id)
    ids = [o["custom_id"] for o in out]
    assert 1 <= len(ids) < n and len(set(ids)) == len(ids)
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)
    listed = client.batches.list(limit=10)
    assert batch.id in [b.id for b in listed.data]


def test_a_batch_is_answered_once_per_line_across_a_redis_restart(tmp_path, tenants_file):
    """Its own Redis (appendonly, fsync always), workers and gateway: Redis is killed
    (SIGKILL) mid-batch and started again; the gateway stops the run while Redis is gone,
    resumes it when it is back, and every line is answered once, each computed once."""
    from pdqueue.queue.redis_server import RedisServer

    n = 40
    with RedisServer(dir=tmp_path, appendonly=True, extra_args=("--appendfsync", "always")) as server:
        cluster = Cluster(server.url, tmp_path, cluster=CLUSTER)
        try:
            cluster.start("prefill", wait=False)
            cluster.start("decode", wait=False)
            for name in list(cluster.procs):
                cluster.wait_registered(name)
            gw = start_gateway(server.url, tmp_path, tenants_file, "gateway-redis-restart")
            try:
                client = oa(gw)
                f = upload(client, jsonl([line(f"r-{i}", f"Restart {i}: once upon a time", max_tokens=24)
                                          for i in range(n)]))
                batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                              completion_window="24h")
                at_kill = wait_for(lambda: (b := client.batches.retrieve(batch.id)).request_counts.completed >= 3
                                   and b, 120, what="some lines answered", interval=0.1)
                server.kill()
                time.sleep(1.0)   # an outage: the gateway, the workers and the run see Redis gone
                server.start()
                assert at_kill.request_counts.completed < n, "the batch ended before the restart: make it longer"
                done = wait_status(client, batch.id, ("completed", "failed", "cancelled"))
                assert done.status == "completed", done
                out = output_lines(client, done.output_file_id)
                assert sorted(o["custom_id"] for o in out) == sorted(f"r-{i}" for i in range(n))
                assert all(o["response"]["status_code"] == 200 for o in out)
                with redis.Redis.from_url(server.url) as r:
                    ids = [fields[b"id"].decode() for _, fields in r.xrange(Keys(CLUSTER).done)
                           if fields.get(b"id", b"").startswith(f"batch:{batch.id}:".encode())]
                assert len(ids) == n and len(set(ids)) == n   # each computed once
            finally:
                gw.stop()
        finally:
            cluster.stop_and_check()
