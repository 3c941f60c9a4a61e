"""`pdqueue serve`, the OpenAI-compatible gateway, end to end: a real Redis, real tiny-model
workers (one prefill, one decode) and the gateway, all started by `pdqueue up` (so its
gateway, started and stopped with the cluster, is the one under test), and the official
`openai` package as the client (sync and async, streaming and not). Raw HTTP
(http.client) checks the SSE framing and hangs up mid-stream.

One cluster serves the whole module (the workers take a few seconds to load); tests that
need another gateway (no workers, a short timeout, one to stop or kill) start their own
`python -m workers serve` on the same cluster. Greedy requests are sent one at a time, so
each runs alone in its batch and the gateway's text must equal, byte for byte, what
pdqueue's Client gets for the same request.
"""

from __future__ import annotations

import asyncio
import glob
import http.client
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

import openai
import pytest
import redis

from pdqueue.client import Client
from pdqueue.models.tokenizer import ByteTokenizer
from tests.cluster import ROOT, Cluster
from tests.helpers import pdqueue_up, wait_for, wait_pools_free

CLUSTER = "gw"
API_KEY = "sk-test-gateway"
PROMPTS = ["The capital of France is", "Once upon a time", "x"]


# ---- processes -------------------------------------------------------------------------------

def clean_env(**extra: str) -> dict:
    """This environment without the developer's PDQ_* settings (the cache directory stays)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDQ_") or k == "PDQ_CACHE_DIR"}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


class Gateway:
    """A `pdqueue serve` process on a free port (``url``: what its first line printed), or,
    with ``url``, the one `pdqueue up` started."""

    def __init__(self, redis_url: str, cluster: str, log_dir: Path, *args: str, name: str = "gateway",
                 url: str | None = None):
        self.out_path = log_dir / f"{name}.out"
        self.log_path = log_dir / f"{name}.log"
        self.proc = None
        if url is None:
            with open(self.out_path, "wb") as out, open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "workers", "serve", "--redis-url", redis_url, "--cluster", cluster,
                     "--port", "0", "--log-level", "INFO", *args],
                    stdout=out, stderr=log, cwd=ROOT, env=clean_env(), start_new_session=True)
            line = wait_for(self._first_line, 30, what=f"{name}'s first line")
            match = re.search(r"(http://\S+)/v1", line)
            assert match, line
            url = match.group(1)
        self.url = url
        parsed = urlparse(self.url)
        self.host, self.port = parsed.hostname, parsed.port
        wait_for(lambda: self._answers(), 30, what=f"{name} answering HTTP")

    def _first_line(self) -> str | None:
        if self.proc.poll() is not None:
            raise AssertionError(f"the gateway exited with {self.proc.returncode}: {self.log()}")
        text = self.out_path.read_text()
        return text.splitlines()[0] if "\n" in text else None

    @staticmethod
    def _listening(url: str) -> bool:
        parsed = urlparse(url)
        try:
            socket.create_connection((parsed.hostname, parsed.port), timeout=2).close()
            return True
        except OSError:
            return False

    def _answers(self) -> bool:
        try:
            self.get("/health")
            return True
        except OSError:
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def conn(self, timeout: float = 60) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def get(self, path: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
        c = self.conn()
        try:
            c.request("GET", path, headers=headers or {})
            resp = c.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            c.close()

    def post(self, path: str, body, headers: dict | None = None) -> tuple[int, dict, bytes]:
        c = self.conn()
        try:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            c.request("POST", path, body=data, headers={"content-type": "application/json",
                                                        "authorization": f"Bearer {API_KEY}", **(headers or {})})
            resp = c.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            c.close()

    def openai(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kwargs.pop("api_key", API_KEY), max_retries=0,
                             **kwargs)

    def async_openai(self, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0, **kwargs)

    def stop(self) -> int:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def shared_redis_url(redis_server):
    """The session's server, emptied once for this module (not before each test: the
    module's workers and gateway live across tests)."""
    if not redis_server.running:
        redis_server.restart()
    with redis.Redis.from_url(redis_server.url) as r:
        r.flushall()
    return redis_server.url


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gateway")


@pytest.fixture(scope="module")
def up(shared_redis_url, logs):
    """`pdqueue up` on the session's Redis: one prefill and one decode worker and its
    gateway (which reads PDQ_API_KEY from up's environment); stopped at the end, when the
    gateway goes first and nothing may be left running."""
    log_dir = logs / "up-logs"
    env = clean_env(PDQ_API_KEY=API_KEY, XDG_RUNTIME_DIR=str(logs / "run"))
    with pdqueue_up(shared_redis_url, CLUSTER, logs, env, log_dir, stop_timeout=90) as (proc, url):
        state = json.loads((logs / "run" / "pdqueue" / f"up-{CLUSTER}.json").read_text())
        assert state["gateway_url"] == url
        yield Gateway(shared_redis_url, CLUSTER, log_dir, url=url), state
    err = (logs / "up.err").read_text()
    assert proc.returncode == 0, err
    lines = err.splitlines()
    first = {what: next((i for i, line in enumerate(lines) if what in line), len(lines))
             for what in ("gateway", "stopping 1 prefill worker")}
    assert first["gateway"] < first["stopping 1 prefill worker"] < len(lines), err   # the gateway is told first
    assert "nothing left running" in err and "Traceback" not in err, err
    assert not Gateway._listening(url), "the gateway's port is still open"
    assert not [p for w in state["workers"] for p in glob.glob(f"/dev/shm/pdq-kv-{w['worker_id']}-*")]


@pytest.fixture(scope="module")
def gateway(up):
    return up[0]


@pytest.fixture(scope="module")
def cluster(up, shared_redis_url, logs):
    """The cluster's keys and a Redis client (its workers are `up`'s)."""
    return Cluster(shared_redis_url, logs, cluster=CLUSTER)


@pytest.fixture(scope="module")
def client(cluster, shared_redis_url):
    with Client(shared_redis_url, CLUSTER) as c:
        yield c


def expected(client: Client, **kwargs):
    """pdqueue's own answer to the same request (greedy: the same text)."""
    return client.submit(**kwargs).result(timeout=60)


# ---- answers ---------------------------------------------------------------------------------

def test_completions_greedy_text_equals_the_clients(gateway, client):
    oa = gateway.openai()
    for prompt in PROMPTS:
        want = expected(client, prompt=prompt, max_tokens=12, temperature=0.0)
        got = oa.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert got.choices[0].text == want.text
        assert got.choices[0].finish_reason == want.finish_reason.value
        assert got.object == "text_completion" and got.model == "tiny" and got.id.startswith("cmpl-")
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (want.num_prompt_tokens,
                                                                          len(want.token_ids))
        assert got.usage.total_tokens == want.num_prompt_tokens + len(want.token_ids)
        streamed = oa.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True)
        chunks = list(streamed)
        assert "".join(c.choices[0].text for c in chunks) == want.text
        assert [c.choices[0].finish_reason for c in chunks][-1] == want.finish_reason.value
        assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_usage_reports_the_prompt_tokens_the_prefix_cache_served(gateway):
    """The same prompt twice: the second is served from the prefill worker's prefix cache,
    and usage.prompt_tokens_details.cached_tokens says how much of it (whole blocks)."""
    oa = gateway.openai()
    prompt = "A long shared system prompt that repeats itself for the cache. " * 3
    first = oa.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    second = oa.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 32
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < second.usage.prompt_tokens and cached % 16 == 0, second.usage
    assert second.choices[0].text == first.choices[0].text


def test_completion_without_max_tokens_gets_16_and_token_ids_as_prompt(gateway, client):
    oa = gateway.openai()
    got = oa.completions.create(model="tiny", prompt="abc", temperature=0, extra_body={"ignore_eos": True})
    assert got.usage.completion_tokens == 16 and got.choices[0].finish_reason == "length"
    ids = [97, 98, 99]
    want = expected(client, prompt_ids=ids, max_tokens=5, temperature=0.0)
    got = oa.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0)
    assert got.choices[0].text == want.text


def test_chat_greedy_text_equals_the_clients_sync_and_async(gateway, client):
    conversation = [{"role": "system", "content": "Answer briefly."},
                    {"role": "user", "content": "What is a KV cache?"}]
    want_one = expected(client, prompt="Hello there", chat=True, max_tokens=10, temperature=0.0)
    want_conv = expected(client, messages=conversation, chat=True, max_tokens=10, temperature=0.0)
    tokenizer = ByteTokenizer()  # the tiny model's: the template is applied to the whole conversation
    assert want_conv.num_prompt_tokens == len(tokenizer.encode(tokenizer.apply_chat_template(conversation)))
    oa = gateway.openai()
    one = [{"role": "user", "content": "Hello there"}]
    for messages, want in ((one, want_one), (conversation, want_conv)):
        got = oa.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
        assert got.choices[0].message.content == want.text and got.choices[0].message.role == "assistant"
        assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
        assert got.usage.prompt_tokens == want.num_prompt_tokens
        chunks = list(oa.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=10,
                                                 temperature=0, stream=True))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
        assert chunks[-1].choices[0].finish_reason == want.finish_reason.value

    async def run_async():
        aoa = gateway.async_openai()
        try:
            got = await aoa.chat.completions.create(model="tiny", messages=conversation, max_tokens=10,
                                                    temperature=0)
            stream = await aoa.chat.completions.create(model="tiny", messages=conversation, max_tokens=10,
                                                       temperature=0, stream=True,
                                                       stream_options={"include_usage": True})
            chunks = [c async for c in stream]
            return got, chunks
        finally:
            await aoa.close()

    got, chunks = asyncio.run(run_async())
    assert got.choices[0].message.content == want_conv.text
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want_conv.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want_conv.token_ids)
    assert chunks[-1].usage.prompt_tokens == want_conv.num_prompt_tokens


def test_sse_framing(gateway):
    status, headers, raw = gateway.post("/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}}, headers={"X-Request-Id": "sse-check-1"})
    assert status == 200, raw
    assert headers["content-type"].startswith("text/event-stream")
    assert headers["x-request-id"] == "sse-check-1"
    text = raw.decode()
    assert text.endswith("data: [DONE]\n\n")
    events = text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    # A plain stream is data lines only, no id and no comment: some clients read every line as data.
    assert all(e.startswith("data: ") and "\n" not in e for e in events[:-1]), events
    chunks = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert {c["id"] for c in chunks} == {"chatcmpl-sse-check-1"}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content, usage = chunks[1:-1], chunks[-1]
    assert content, chunks
    assert [c["choices"][0]["finish_reason"] for c in content][:-1] == [None] * (len(content) - 1)
    assert content[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] >= 1
    assert all(c["usage"] is None for c in chunks[:-1])


def test_64_concurrent_streams_complete(gateway):
    async def one(aoa, i):
        stream = await aoa.completions.create(model="tiny", prompt=f"request {i}", max_tokens=8, temperature=0.5,
                                              seed=i, stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        return chunks

    async def run():
        aoa = gateway.async_openai(timeout=120)
        try:
            return await asyncio.gather(*(one(aoa, i) for i in range(64)))
        finally:
            await aoa.close()

    results = asyncio.run(run())
    assert len(results) == 64
    for chunks in results:
        assert chunks[-1].choices == [] and 1 <= chunks[-1].usage.completion_tokens <= 8
        assert chunks[-2].choices[0].finish_reason in ("stop", "length")


def done_entry(cluster, request_id: str) -> dict | None:
    for _id, fields in cluster.r.xrange(cluster.keys.out(request_id)):
        if fields.get(b"type") == b"done":
            return fields
    return None


def open_stream(gw: Gateway, path: str, body: dict, headers: dict | None = None, timeout: float = 60):
    """A POST whose answer is read as it comes: (the connection, its response)."""
    c = gw.conn(timeout=timeout)
    c.request("POST", path, body=json.dumps(body).encode(), headers={
        "content-type": "application/json", "authorization": f"Bearer {API_KEY}", **(headers or {})})
    return c, c.getresponse()


def sse_events(resp):
    """The events of an SSE response as they come, as (id or None, data); comments skipped."""
    event_id, data = None, []
    while True:
        line = resp.readline()
        if not line:
            return
        line = line.decode().rstrip("\n")
        if line.startswith("id: "):
            event_id = int(line[len("id: "):])
        elif line.startswith("data: "):
            data.append(line[len("data: "):])
        elif not line and data:
            yield event_id, "\n".join(data)
            event_id, data = None, []


def hang_up(c: http.client.HTTPConnection, resp) -> None:
    """Close the connection for good: the response's file object holds the socket's
    descriptor too, so close it as well (a shut-down socket whose descriptor stays open
    still ACKs what the gateway sends, which is a client that stopped reading, not one that
    left)."""
    c.sock.shutdown(socket.SHUT_RDWR)
    resp.close()
    c.close()


def test_disconnect_mid_stream_cancels_the_request_and_frees_blocks(gateway, cluster):
    rid = f"hangup-{uuid.uuid4().hex[:8]}"
    c = gateway.conn()
    c.request("POST", "/v1/completions", body=json.dumps({
        # 4000 of tiny's 4096 positions (~15 s): an answer that ends by itself long after the
        # hang-up. (It once did end first, 1 run in ~12: the gateway saw the hang-up at once, but
        # its reader had swallowed the cancellation and read on; see raise_dropped_cancellation.)
        "model": "tiny", "prompt": "a long story", "max_tokens": 4000, "temperature": 0, "ignore_eos": True,
        "stream": True}).encode(), headers={"content-type": "application/json", "x-request-id": rid,
                                             "authorization": f"Bearer {API_KEY}"})
    resp = c.getresponse()
    assert resp.status == 200
    for _ in range(3):  # a few chunks: the request runs in the decode worker
        assert resp.readline().startswith(b"data: ")
        assert resp.readline() == b"\n"
    hung_up = time.time()
    hang_up(c, resp)
    fields = wait_for(lambda: done_entry(cluster, rid), 60, what="the request's done entry after the hang-up")
    entries = cluster.r.xrange(cluster.keys.out(rid))
    first_ms, last_ms = (int(e[0].split(b"-")[0]) for e in (entries[0], entries[-1]))
    mentions = "\n".join(line for path in sorted(gateway.log_path.parent.glob("*.log"))
                          for line in path.read_text(errors="replace").splitlines() if rid in line)
    assert fields[b"finish_reason"] == b"cancelled", (
        f"hung up at {hung_up:.3f}; answer from {first_ms / 1e3:.3f} to {last_ms / 1e3:.3f}; "
        f"cancel key: {cluster.r.exists(cluster.keys.cancel(rid))}; logs:\n{mentions}")
    assert len(json.loads(fields[b"token_ids"])) < 4000
    wait_pools_free(cluster, timeout=10)


# ---- errors and the other endpoints ----------------------------------------------------------

def test_errors(gateway):
    oa = gateway.openai()
    with pytest.raises(openai.BadRequestError) as info:
        oa.completions.create(model="tiny", prompt="Hi", n=2)
    assert "n=2" in str(info.value) and info.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError):
        oa.chat.completions.create(model="tiny", messages=[], max_tokens=4)
    with pytest.raises(openai.AuthenticationError) as info:
        gateway.openai(api_key="sk-wrong").completions.create(model="tiny", prompt="Hi", max_tokens=2)
    assert info.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as info:
        oa.completions.create(model="no-such-model", prompt="Hi", max_tokens=2)
    assert info.value.body["code"] == "model_not_found" and "no-such-model" in info.value.body["message"]

    status, headers, raw = gateway.post("/v1/completions", b"{not json", headers={"x-request-id": "bad-json-1"})
    body = json.loads(raw)
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error" and headers["x-request-id"] == "bad-json-1"
    status, _, raw = gateway.post("/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 0})
    assert status == 400 and json.loads(raw)["error"]["param"] == "max_tokens"
    status, _, raw = gateway.post("/v1/completions", {"prompt": "Hi"}, headers={"x-request-id": "bad id!"})
    assert status == 400 and "X-Request-Id" in json.loads(raw)["error"]["message"]
    status, _, _ = gateway.get("/v1/models")
    assert status == 401
    for headers, param in (({"last-event-id": "7"}, "Last-Event-ID"),   # a resume needs the request's id
                           ({"idempotency-key": "k-1", "last-event-id": "seven"}, "Last-Event-ID"),
                           ({"idempotency-key": "k-1", "x-request-id": "k-2"}, "Idempotency-Key"),
                           ({"idempotency-key": "bad key!"}, "Idempotency-Key")):
        status, _, raw = gateway.post("/v1/completions", {"prompt": "Hi", "stream": True}, headers=headers)
        assert status == 400 and json.loads(raw)["error"]["param"] == param, (headers, raw)


def test_unknown_routes_and_methods_are_openai_errors(gateway):
    with pytest.raises(openai.NotFoundError) as info:   # an endpoint this server does not have
        gateway.openai().embeddings.create(model="tiny", input="not served here")
    assert info.value.body["code"] == "unknown_url" and "POST /v1/embeddings" in info.value.body["message"]
    status, headers, raw = gateway.get("/nowhere")
    body = json.loads(raw)
    assert status == 404 and headers["content-type"] == "application/json"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    status, headers, raw = gateway.get("/v1/completions")   # the route, another method
    assert status == 405 and headers["allow"] == "POST", raw
    assert json.loads(raw)["error"]["code"] == "method_not_allowed"
    status, _, raw = gateway.get("/v1/requests/never-sent", headers={"authorization": f"Bearer {API_KEY}"})
    assert status == 404 and json.loads(raw)["error"]["code"] == "request_not_found"


def test_unknown_fields_are_ignored_with_a_warning(gateway, client):
    want = expected(client, prompt="Hello", max_tokens=6, temperature=0.0)
    got = gateway.openai().completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=0,
                                              extra_body={"some_future_field": {"a": 1}})
    assert got.choices[0].text == want.text
    wait_for(lambda: "some_future_field" in gateway.log(), 5, what="the ignored-fields warning in the log")
    assert "were present in the request but ignored" in gateway.log()


def test_request_id_is_the_pdqueue_id_and_is_echoed(gateway, cluster):
    raw = gateway.openai().completions.with_raw_response.create(
        model="tiny", prompt="Hi", max_tokens=3, temperature=0, extra_headers={"X-Request-Id": "my-req-42"})
    assert raw.headers["x-request-id"] == "my-req-42"
    assert raw.parse().id == "cmpl-my-req-42"
    assert cluster.r.exists(cluster.keys.out("my-req-42"))
    status, headers, _ = gateway.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert status == 200 and re.fullmatch(r"[0-9a-f]{32}", headers["x-request-id"])


def test_models_health_metrics(gateway):
    models = gateway.openai().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    m = models.data[0]
    assert m.owned_by == "pdqueue" and m.model_extra["max_model_len"] == 4096
    status, _, body = gateway.get("/health")  # no key needed
    assert (status, body) == (200, b"")
    stream = gateway.openai().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                      max_tokens=3, stream=True)
    assert sum(1 for _ in stream) >= 2   # read to its end: a stream closed early is a disconnect (cancelled)
    status, headers, body = gateway.get("/metrics")
    text = body.decode()
    assert status == 200 and headers["content-type"].startswith("text/plain")
    count = re.search(r'^vllm:e2e_request_latency_seconds_count\{model_name="tiny",role="gateway"\} (\S+)$', text,
                      re.M)
    assert count and float(count.group(1)) >= 1, text
    assert re.search(r'^vllm:time_to_first_token_seconds_count\{model_name="tiny",role="gateway"\} [1-9]', text,
                     re.M), text
    assert re.search(r'^pdqueue:gateway_requests_total\{endpoint="chat",role="gateway",status="200"\} [1-9]',
                     text, re.M), text


def role_pid(cluster, role: str) -> int:
    return next(int(w["pid"]) for w in cluster.workers().values() if w["role"] == role)


@contextmanager
def stopped(pid: int):
    """The process stopped (SIGSTOP) for the block: no token comes meanwhile."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_client_that_leaves_before_the_first_token_cancels_with_nothing_written(gateway, cluster):
    """No SSE comment by default (some benchmark clients drop every event after one): while
    no token comes (the prefill worker is stopped) the gateway writes nothing, not even the
    response's start (a stream starts with the answer's first entry, so that a request the
    worker refuses is a 400), and a client that hangs up meanwhile is seen on the connection
    itself: its request is cancelled before any token (the cancel key at once, the done
    entry says cancelled)."""
    rid = f"early-{uuid.uuid4().hex[:8]}"
    with stopped(role_pid(cluster, "prefill")):
        c = gateway.conn()
        c.request("POST", "/v1/completions", body=json.dumps({"prompt": "a long prefill", "max_tokens": 50,
                                                               "temperature": 0, "stream": True}).encode(),
                  headers={"content-type": "application/json", "authorization": f"Bearer {API_KEY}",
                           "x-request-id": rid})
        c.sock.settimeout(2.0)
        with pytest.raises(TimeoutError):   # not a byte while no token came
            c.sock.recv(1)
        c.sock.shutdown(socket.SHUT_RDWR)
        c.close()
        wait_for(lambda: cluster.r.exists(cluster.keys.cancel(rid)), 3, what="the gateway's cancel after the hang-up")
        assert not cluster.r.exists(cluster.keys.out(rid))   # not a token yet
    fields = wait_for(lambda: done_entry(cluster, rid), 30, what="the request's done entry")
    assert fields[b"finish_reason"] == b"cancelled" and json.loads(fields[b"token_ids"]) == []


def test_sse_keepalive_s_writes_comments_while_no_token_comes(cluster, shared_redis_url, logs):
    gw = Gateway(shared_redis_url, CLUSTER, logs, "--sse-keepalive-s", "0.2", name="gateway-keepalive")
    try:
        with stopped(role_pid(cluster, "prefill")):
            c, resp = open_stream(gw, "/v1/completions", {"prompt": "quiet", "max_tokens": 4, "temperature": 0,
                                                          "stream": True})
            assert resp.status == 200
            deadline = time.monotonic() + 5
            while resp.readline() != b": keep-alive\n":
                assert time.monotonic() < deadline, "no keep-alive comment while no token came"
        events = list(sse_events(resp))   # then the answer, its framing unchanged
        c.close()
        assert events[-1] == (None, "[DONE]") and len(events) >= 2
    finally:
        assert gw.stop() == 0, gw.log()


# ---- stopping: drain on the first signal, end the open answers on the second -----------------

def test_a_first_sigterm_drains_open_answers_run_to_their_end(cluster, shared_redis_url, logs):
    """After SIGTERM the gateway keeps its listener: /health and new requests get 503 with
    Retry-After, while the open stream, stalled for longer than uvicorn's old 10 s limit
    (its decode worker stopped), gets every token and [DONE]; then the gateway exits 0."""
    gw = Gateway(shared_redis_url, CLUSTER, logs, name="gateway-drain")
    rid = f"drain-{uuid.uuid4().hex[:8]}"
    try:
        c, resp = open_stream(gw, "/v1/completions", {"prompt": "drain", "max_tokens": 200, "temperature": 0,
                                                      "ignore_eos": True, "stream": True,
                                                      "stream_options": {"include_usage": True}}, {"x-request-id": rid})
        events = sse_events(resp)
        got = [next(events)]
        with stopped(role_pid(cluster, "decode")):   # the answer cannot end by itself meanwhile
            os.killpg(gw.proc.pid, signal.SIGTERM)
            signalled = time.monotonic()
            wait_for(lambda: gw.get("/health")[0] == 503, 5, what="/health 503 while draining")
            status, headers, raw = gw.post("/v1/completions", {"prompt": "too late", "max_tokens": 2})
            assert status == 503 and headers["retry-after"] == "5", raw
            assert json.loads(raw)["error"]["code"] == "service_unavailable"
            time.sleep(max(0.0, signalled + 11 - time.monotonic()))
            assert gw.proc.poll() is None, f"the gateway exited with an answer open: {gw.log()}"
        got += list(events)
        c.close()
        assert got[-1] == (None, "[DONE]")
        chunks = [json.loads(data) for _, data in got[:-1]]
        text, token_ids, finish = out_answer(cluster, rid)
        assert "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"]) == text
        assert chunks[-1]["usage"]["completion_tokens"] == len(token_ids) == 200 and finish == "length"
        assert gw.proc.wait(20) == 0, gw.log()
    finally:
        gw.stop()
        wait_for(lambda: "decode" in {w["role"] for w in cluster.workers().values()}, 15,
                 what="the decode worker's heartbeat back")


# What a gateway runs on (pdqueue serve --loop/--http/--redis-parser): "auto" is uvloop,
# httptools and hiredis where scripts/setup installed pdqueue[fast], the other the fallback.
RUNTIMES = {"auto": (), "asyncio-h11-python": ("--loop", "asyncio", "--http", "h11", "--redis-parser", "python")}


def runtime_line(name: str) -> str:
    """The line `pdqueue serve` writes on stderr for RUNTIMES[name]."""
    from pdqueue.frontends.gateway import runtime

    if name == "auto":
        return f"pdqueue serve: {runtime().describe()}"
    os.environ["PDQ_REDIS_PARSER"] = "python"
    try:
        return f"pdqueue serve: {runtime('asyncio', 'h11').describe()}"
    finally:
        del os.environ["PDQ_REDIS_PARSER"]


@pytest.mark.parametrize("runtime", list(RUNTIMES))
def test_a_second_sigterm_ends_open_answers_with_an_error_and_cancels_them(cluster, shared_redis_url, logs, runtime):
    """A second SIGTERM during the drain: the open stream ends with an error event and
    [DONE] (the body is ended, not cut), the open non-streaming request gets a JSON 503,
    both requests are cancelled, and the gateway exits 0; on uvloop + httptools (auto, where
    installed) as on asyncio + h11 (signals reach uvicorn's handle_exit, acted on in on_tick)."""
    gw = Gateway(shared_redis_url, CLUSTER, logs, *RUNTIMES[runtime], name=f"gateway-forced-{runtime}")
    assert runtime_line(runtime) in gw.log(), gw.log()
    sid, wid = (f"{what}-{uuid.uuid4().hex[:8]}" for what in ("forced-stream", "forced-whole"))
    long = {"max_tokens": 3000, "temperature": 0, "ignore_eos": True}
    whole: dict = {}
    try:
        c, resp = open_stream(gw, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Go on"}],
                                                           "stream": True, **long}, {"x-request-id": sid})
        events = sse_events(resp)
        got = [next(events), next(events)]
        waiting = threading.Thread(target=lambda: whole.update(answer=gw.post(
            "/v1/completions", {"prompt": "go on", **long}, headers={"x-request-id": wid})))
        waiting.start()
        wait_for(lambda: cluster.r.exists(cluster.keys.out(wid)), 30, what="the non-streaming request running")
        os.killpg(gw.proc.pid, signal.SIGTERM)
        wait_for(lambda: gw.get("/health")[0] == 503, 5, what="/health 503 while draining")
        os.killpg(gw.proc.pid, signal.SIGTERM)
        got += list(events)   # to the body's end (a cut connection raises IncompleteRead)
        c.close()
        waiting.join(30)
        assert got[-1] == (None, "[DONE]")
        event_id, data = got[-2]
        assert event_id is None and json.loads(data)["error"]["code"] == "service_unavailable", got[-2]
        status, headers, raw = whole["answer"]
        assert status == 503 and headers["retry-after"] == "5", raw
        assert json.loads(raw)["error"]["code"] == "service_unavailable"
        assert gw.proc.wait(10) == 0, gw.log()
        for rid in (sid, wid):
            fields = wait_for(lambda: done_entry(cluster, rid), 30, what=f"{rid}'s done entry")
            assert fields[b"finish_reason"] == b"cancelled" and len(json.loads(fields[b"token_ids"])) < 3000
        wait_pools_free(cluster)
    finally:
        gw.stop()


# ---- resuming: Idempotency-Key, Last-Event-ID, GET /v1/requests/{id} -------------------------

def out_answer(cluster, request_id: str) -> tuple[str, list[int], str]:
    """The request's answer as the workers wrote it (its done entry): text, token ids, finish reason."""
    fields = wait_for(lambda: done_entry(cluster, request_id), 60, what=f"{request_id}'s done entry")
    return fields[b"text"].decode(), json.loads(fields[b"token_ids"]), fields[b"finish_reason"].decode()


def submissions(cluster, request_id: str) -> tuple[int, int]:
    """(times the workers finished the request, duplicates they refused): (1, 0) is run once, sent once."""
    rid = request_id.encode()
    done = sum(1 for _, f in cluster.r.xrange(cluster.keys.done) if f.get(b"id") == rid)
    dead = sum(1 for _, f in cluster.r.xrange(cluster.keys.dead) if f.get(b"field:id") == rid)
    return done, dead


def content(chunk: dict) -> str:
    choice = chunk["choices"][0]
    return choice["delta"].get("content") or "" if "delta" in choice else choice["text"]


def stream_body(kind: str, max_tokens: int) -> tuple[str, dict]:
    body = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if kind == "chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "Tell a story"}]}
    return "/v1/completions", {**body, "prompt": "Tell a story"}


def check_resumed(cluster, key: str, before: list, after: list, max_tokens: int) -> str:
    """Events read before and after a resume: every one with an id, ids increasing (none
    twice), their text the request's whole answer, which ran once and to its end (the
    hang-up did not cancel it). Returns the text."""
    ids = [event_id for event_id, _ in before + after]
    assert None not in ids and ids == sorted(set(ids)), ids
    assert after[-1][1] == "[DONE]" and ids[-3:] == [max_tokens, max_tokens + 1, max_tokens + 2], ids
    chunks = [json.loads(data) for _, data in before + after[:-1]]
    text, token_ids, finish = out_answer(cluster, key)
    assert "".join(content(ch) for ch in chunks if ch["choices"]) == text
    assert len(token_ids) == max_tokens and finish == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == max_tokens
    assert len({ch["created"] for ch in chunks}) == 1 and len({ch["id"] for ch in chunks}) == 1
    assert submissions(cluster, key) == (1, 0)
    return text


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_stream_resumed_with_last_event_id_gets_every_token_once(gateway, cluster, kind):
    """An Idempotency-Key makes a stream resumable: its events carry ids, and a client that
    hangs up after a few events does not cancel it. A POST with the same key and
    Last-Event-ID re-attaches (no second submit) and sends exactly the rest; GET
    /v1/requests/{id} reads it again, whole or from an event on."""
    key = f"resume-{kind}-{uuid.uuid4().hex[:8]}"
    path, body = stream_body(kind, 300)
    c, resp = open_stream(gateway, path, body, {"idempotency-key": key})
    assert resp.status == 200 and resp.getheader("x-request-id") == key
    events = sse_events(resp)
    before = [next(events) for _ in range(4)]
    hang_up(c, resp)
    if kind == "chat":
        assert before[0][0] == -1   # the role chunk
    c, resp = open_stream(gateway, path, body, {"idempotency-key": key, "last-event-id": str(before[-1][0])})
    assert resp.status == 200
    after = list(sse_events(resp))
    c.close()
    text = check_resumed(cluster, key, before, after, 300)

    auth = {"authorization": f"Bearer {API_KEY}"}
    response_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{key}"
    status, _, raw = gateway.get(f"/v1/requests/{response_id}", headers=auth)   # by the response's id
    whole = json.loads(raw)
    assert status == 200 and whole["id"] == response_id and whole["usage"]["completion_tokens"] == 300
    assert (whole["choices"][0]["message"]["content"] if kind == "chat" else whole["choices"][0]["text"]) == text
    mid = before[2][0]
    status, headers, raw = gateway.get(f"/v1/requests/{key}", headers={**auth, "accept": "text/event-stream",
                                                                       "last-event-id": str(mid)})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    again = list(sse_events(io.BytesIO(raw)))
    assert again[0][0] > mid and again[-1] == (302, "[DONE]")
    said = "".join(content(json.loads(d)) for i, d in before if i <= mid and json.loads(d)["choices"])
    assert said + "".join(content(json.loads(d)) for _, d in again[:-1] if json.loads(d)["choices"]) == text


def test_a_stream_resumes_on_a_new_gateway_after_kill_9(cluster, shared_redis_url, logs):
    """The gateway serving a resumable stream dies (SIGKILL): the client's connection is cut
    mid-stream; a new gateway process takes the resume and sends the rest exactly once."""
    key = f"killed-{uuid.uuid4().hex[:8]}"
    path, body = stream_body("completion", 400)
    first = Gateway(shared_redis_url, CLUSTER, logs, name="gateway-killed")
    try:
        c, resp = open_stream(first, path, body, {"idempotency-key": key})
        events = sse_events(resp)
        before = [next(events) for _ in range(5)]
        os.killpg(first.proc.pid, signal.SIGKILL)
        try:
            before += list(events)   # what the dead gateway had written reaches the client, then the cut
        except (http.client.IncompleteRead, ConnectionError):
            pass
        c.close()
        assert before[-1][1] != "[DONE]", "the stream ended before the kill"
    finally:
        first.stop()
    second = Gateway(shared_redis_url, CLUSTER, logs, name="gateway-after-kill")
    try:
        c, resp = open_stream(second, path, body, {"idempotency-key": key, "last-event-id": str(before[-1][0])})
        assert resp.status == 200
        after = list(sse_events(resp))
        c.close()
        check_resumed(cluster, key, before, after, 400)
    finally:
        assert second.stop() == 0, second.log()


def test_an_idempotency_key_retry_gets_the_first_answer_and_runs_once(gateway, cluster):
    """Retries with the same Idempotency-Key, one while the first runs and one after it
    ended (sampled, no seed: a second generation would differ), all get the first's whole
    answer; the request was submitted and run once. Other parameters with the key: 422."""
    key = f"idem-{uuid.uuid4().hex[:8]}"
    body = {"model": "tiny", "prompt": "Count to", "max_tokens": 200, "temperature": 0.9, "ignore_eos": True}
    answers: dict = {}
    first = threading.Thread(target=lambda: answers.update(
        first=gateway.post("/v1/completions", body, headers={"idempotency-key": key})))
    first.start()
    wait_for(lambda: cluster.r.exists(cluster.keys.out(key)), 30, what="the first request running")
    answers["while"] = gateway.post("/v1/completions", body, headers={"idempotency-key": key})
    first.join(60)
    oa = gateway.openai()
    later = oa.completions.create(**{k: v for k, v in body.items() if k != "ignore_eos"},
                                  extra_body={"ignore_eos": True}, extra_headers={"Idempotency-Key": key})
    text, token_ids, _ = out_answer(cluster, key)
    for status, headers, raw in answers.values():
        assert status == 200 and headers["x-request-id"] == key, raw
        got = json.loads(raw)
        assert got["choices"][0]["text"] == text and got["id"] == f"cmpl-{key}"
    assert later.choices[0].text == text and later.usage.completion_tokens == len(token_ids) == 200
    assert submissions(cluster, key) == (1, 0)
    with pytest.raises(openai.UnprocessableEntityError) as info:
        oa.completions.create(model="tiny", prompt="Count to", max_tokens=5, extra_headers={"Idempotency-Key": key})
    assert info.value.body["code"] == "idempotency_key_reused"


def test_timeout_gives_504_and_drops_the_request(cluster, shared_redis_url, logs):
    gw = Gateway(shared_redis_url, CLUSTER, logs, "--timeout", "1", name="gateway-timeout")
    try:
        status, headers, raw = gw.post("/v1/completions", {"prompt": "slow", "max_tokens": 3000, "temperature": 0,
                                                           "ignore_eos": True}, headers={"x-request-id": "late-1"})
        assert status == 504, raw
        assert json.loads(raw)["error"]["code"] == "timeout"
        # The workers stopped it too (the gateway cancelled it; its deadline had passed), and
        # freed its blocks (a handoff answered before its fetch gives its lease back).
        fields = wait_for(lambda: done_entry(cluster, "late-1"), 10, what="the request's done entry")
        assert fields[b"finish_reason"] in (b"cancelled", b"expired")
        assert len(json.loads(fields[b"token_ids"])) < 3000   # fewer than it asked for
        wait_pools_free(cluster)
    finally:
        assert gw.stop() == 0, gw.log()


def test_no_workers_and_no_capacity_wait_503_then_backlog_429(shared_redis_url, logs):
    """--capacity-wait-s 0: no worker is a 503 at once (tests/test_capacity.py: the wait)."""
    gw = Gateway(shared_redis_url, "gw-empty", logs, "--max-backlog", "2", "--capacity-wait-s", "0",
                 name="gateway-empty")
    try:
        status, _, _ = gw.get("/health")
        assert status == 503
        oa = gw.openai(api_key="unused")
        with pytest.raises(openai.InternalServerError) as info:
            oa.completions.create(model="tiny", prompt="Hi", max_tokens=2)
        assert info.value.status_code == 503 and "no workers" in info.value.body["message"]
        with Client(shared_redis_url, "gw-empty") as c:  # nobody reads these
            c.submit_many([dict(prompt="queued", max_tokens=1)] * 3)
        wait_for(lambda: gw.post("/v1/completions", {"prompt": "Hi"})[0] == 429, 5, what="a 429")
        with pytest.raises(openai.RateLimitError) as info:
            oa.completions.create(model="tiny", prompt="Hi", max_tokens=2)
        assert "backlog (3)" in info.value.body["message"]
        assert info.value.response.headers["retry-after"] == "1"
    finally:
        assert gw.stop() == 0, gw.log()


# ---- openai_compat (pure functions: no cluster) --------------------------------------------

@pytest.mark.parametrize("parse,body,param", [
    ("completion", {"prompt": "a", "n": 2}, "n"),
    ("completion", {"prompt": ["a", "b"]}, "prompt"),
    ("completion", {"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ("completion", {"prompt": "a", "echo": True}, "echo"),
    ("completion", {"prompt": "a", "seed": -1}, "seed"),
    ("completion", {"prompt": "a", "temperature": "0"}, "temperature"),
    ("chat", {"messages": [{"role": "tool", "content": "x"}]}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
])
def test_parse_refuses_what_it_cannot_honour(parse, body, param):
    from pdqueue.frontends.openai_compat import OpenAIError, parse_chat, parse_completion

    with pytest.raises(OpenAIError) as info:
        (parse_chat if parse == "chat" else parse_completion)(body)
    assert info.value.status == 400 and info.value.param == param


def test_parse_maps_fields_to_submit_arguments():
    from pdqueue.frontends.openai_compat import parse_chat, parse_completion

    p = parse_chat({"model": "tiny", "max_completion_tokens": 7, "top_k": -1, "seed": 3, "stop": "\n",
                    "stream": True, "stream_options": {"include_usage": True}, "user": "u", "foo": 1,
                    "messages": [{"role": "developer", "content": "Be brief."},
                                 {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]})
    assert p.ignored == ("foo",) and p.include_usage and p.model == "tiny"
    assert p.submit_kwargs() == {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": 3, "stop": ("\n",),
                                     "max_tokens": 7, "chat": True,
                                     "messages": [{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "Hi"}]}
    one = parse_chat({"messages": [{"role": "user", "content": "Hi"}]}).submit_kwargs()
    assert one["prompt"] == "Hi" and one["chat"] and "messages" not in one
    assert one["max_tokens"] is None   # up to the context: what the prompt leaves of it (the worker's to say)
    assert parse_completion({"prompt": [[1, 2]]}).submit_kwargs() == {
        "temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": (), "max_tokens": 16, "prompt_ids": [1, 2]}


def test_bench_serve_drives_an_openai_endpoint(gateway):
    """`pdqueue bench serve --openai-url` sends its load to any OpenAI-compatible server:
    here the gateway, every request answered and timed from the client side."""
    proc = subprocess.run([sys.executable, "-m", "workers", "bench", "serve", "--openai-url", gateway.url,
                           "--model", "tiny", "--rates", "8", "--num-requests", "6", "--warmup", "1", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**clean_env(), "OPENAI_API_KEY": API_KEY})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["target"] == gateway.url and list(result["modes"]) == ["openai"]
    figures = result["modes"]["openai"]
    assert figures["completed"] == figures["requests"] == 6, figures["errors"]
    assert figures["ttft_ms"]["p50"] > 0 and figures["throughput_tok_s"] > 0
    assert figures["queue_overhead_ms"]["n"] == 0   # no worker timings through HTTP
