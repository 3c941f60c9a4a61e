"""`pdqueue serve`, the OpenAI-compatible gateway, end to end: a real Redis, real tiny-model
workers (one prefill, one decode) and the gateway, all started by `pdqueue up` (so its
gateway, started and stopped with the cluster, is the one under test), and the official
`openai` package as the client (sync and async, streaming and not). Raw HTTP
(http.client) checks the SSE framing and hangs up mid-stream.

One cluster serves the whole module (the workers take a few seconds to load); tests that
need another gateway (no workers, a short timeout) start their own `python -m workers
serve`. Greedy requests are sent one at a time, so each runs alone in its batch and the
gateway's text must equal, byte for byte, what pdqueue's Client gets for the same request.
"""

from __future__ import annotations

import asyncio
import glob
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
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
    assert lines.index("stopping the gateway (answers in progress get up to 10 s)") < next(
        i for i, line in enumerate(lines) if line.startswith("stopping 1 prefill worker")), err
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
    # Hang up for good: the response's file object holds the socket's descriptor too, so
    # close it as well (a shut-down socket whose descriptor stays open still ACKs what the
    # gateway sends, which is a client that stopped reading, not one that left).
    hung_up = time.time()
    c.sock.shutdown(2)
    resp.close()
    c.close()
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


def test_a_stream_waiting_for_tokens_sends_keepalives_and_notices_a_hang_up(gateway, cluster):
    """While no token comes (the decode worker is stopped), the gateway writes an SSE comment
    every second; so a client that hangs up meanwhile is found within about a second (the
    cancel key is set before any further token), not at the next token."""
    decode_pid = next(int(w["pid"]) for w in cluster.workers().values() if w["role"] == "decode")
    rid = f"idle-{uuid.uuid4().hex[:8]}"
    c = gateway.conn(timeout=10)
    c.request("POST", "/v1/completions", body=json.dumps({
        "model": "tiny", "prompt": "a quiet story", "max_tokens": 3000, "temperature": 0, "ignore_eos": True,
        "stream": True}).encode(), headers={"content-type": "application/json", "x-request-id": rid,
                                             "authorization": f"Bearer {API_KEY}"})
    resp = c.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    os.kill(decode_pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 8
        while not resp.readline().startswith(b": keep-alive"):   # (tokens already sent come first)
            assert time.monotonic() < deadline, "no keep-alive comment while no token came"
        c.sock.shutdown(2)
        resp.close()
        c.close()
        wait_for(lambda: cluster.r.exists(cluster.keys.cancel(rid)), 5, what="the gateway's cancel after the hang-up")
    finally:
        os.kill(decode_pid, signal.SIGCONT)
    fields = wait_for(lambda: done_entry(cluster, rid), 30, what="the request's done entry")
    assert fields[b"finish_reason"] == b"cancelled"
    wait_pools_free(cluster, timeout=20)


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


def test_no_workers_503_then_backlog_429(shared_redis_url, logs):
    gw = Gateway(shared_redis_url, "gw-empty", logs, "--max-backlog", "2", name="gateway-empty")
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
    from pdqueue.openai_compat import OpenAIError, parse_chat, parse_completion

    with pytest.raises(OpenAIError) as info:
        (parse_chat if parse == "chat" else parse_completion)(body)
    assert info.value.status == 400 and info.value.param == param


def test_parse_maps_fields_to_submit_arguments():
    from pdqueue.openai_compat import parse_chat, parse_completion

    p = parse_chat({"model": "tiny", "max_completion_tokens": 7, "top_k": -1, "seed": 3, "stop": "\n",
                    "stream": True, "stream_options": {"include_usage": True}, "user": "u", "foo": 1,
                    "messages": [{"role": "developer", "content": "Be brief."},
                                 {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]})
    assert p.ignored == ("foo",) and p.include_usage and p.model == "tiny"
    assert p.submit_kwargs(4096) == {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": 3, "stop": ("\n",),
                                     "max_tokens": 7, "chat": True,
                                     "messages": [{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "Hi"}]}
    assert parse_chat({"messages": [{"role": "user", "content": "Hi"}]}).submit_kwargs(4096)["max_tokens"] == 4096
    one = parse_chat({"messages": [{"role": "user", "content": "Hi"}]}).submit_kwargs()
    assert one["prompt"] == "Hi" and one["chat"] and "messages" not in one and "max_tokens" not in one
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
