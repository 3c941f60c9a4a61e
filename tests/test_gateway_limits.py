"""The model's context as a limit, answered before any work starts, as OpenAI and vLLM answer
it: a prompt plus ``max_tokens`` over the context is a 400, from the gateway where it can tell
(``max_tokens`` alone, token ids), else from the worker that tokenizes the prompt, which
refuses it before decoding (the Python client's ``RequestFailed``, code ``too_long``). A
streamed request refused so gets the same 400 as a plain one, before any event. A chat
without ``max_tokens`` (``max_tokens=None``) runs up to the context.

Real parts: `pdqueue up` (tiny model: a 4096-token context, one byte a token) on the
session's Redis, its gateway, http.client and the ``openai`` package as the HTTP clients.
"""

from __future__ import annotations

import http.client
import json
import os
import time
from urllib.parse import urlparse

import openai
import pytest

from pdqueue.client import Client, RequestFailed
from tests.helpers import pdqueue_up

CLUSTER = "gwlimits"
CONTEXT = 4096   # tiny's max_position_embeddings


@pytest.fixture(scope="module")
def up(redis_server, tmp_path_factory):
    if not redis_server.running:
        redis_server.restart()
    logs = tmp_path_factory.mktemp("gateway-limits")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDQ_") or k == "PDQ_CACHE_DIR"}
    env = {**env, "PYTHONUNBUFFERED": "1", "XDG_RUNTIME_DIR": str(logs)}
    with pdqueue_up(redis_server.url, CLUSTER, logs, env, logs / "up-logs") as (proc, url):
        yield redis_server.url, url
    assert proc.returncode == 0, (logs / "up.err").read_text()


def post(base: str, path: str, body: dict) -> tuple[int, dict, bytes]:
    """One request with http.client: (status, headers, the whole body)."""
    parsed = urlparse(base)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=60)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"content-type": "application/json"})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def error_of(status: int, headers: dict, raw: bytes) -> dict:
    assert status == 400, (status, raw[:300])
    assert headers["content-type"].startswith("application/json"), headers   # not an event stream
    return json.loads(raw)["error"]


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_over_the_context_is_a_400_from_the_gateway(up, stream):
    _, base = up
    started = time.monotonic()
    error = error_of(*post(base, "/v1/completions", {"prompt": "Hi", "max_tokens": 100000, "stream": stream}))
    assert error["param"] == "max_tokens" and error["code"] == "too_long", error
    assert f"maximum context length is {CONTEXT} tokens" in error["message"], error
    error = error_of(*post(base, "/v1/completions", {"prompt": [5] * 4000, "max_tokens": 97, "stream": stream}))
    assert "asks for 4097 tokens (4000 in the prompt, 97 in the completion)" in error["message"], error
    error = error_of(*post(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                          "max_completion_tokens": 100000, "stream": stream}))
    assert error["code"] == "too_long", error
    assert time.monotonic() - started < 5   # nothing decoded
    # With the openai package: the same 400, raised by create() itself.
    oa = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        oa.completions.create(model="tiny", prompt="Hi", max_tokens=100000, stream=stream)


@pytest.mark.parametrize("stream", [False, True])
def test_a_text_prompt_over_the_context_is_a_400_from_the_worker_streamed_or_not(up, stream):
    """The gateway cannot count a text prompt's tokens: the worker refuses it at intake, and
    the stream has not started yet, so a streamed request gets the same JSON 400."""
    _, base = up
    fits_alone = {"prompt": "a" * 100, "max_tokens": CONTEXT - 50, "stream": stream}   # 100 + 4046 > 4096
    error = error_of(*post(base, "/v1/completions", fits_alone))
    assert error["code"] == "too_long" and "100 in the prompt, 4046 in the completion" in error["message"], error
    over_long = {"prompt": "a" * 5000, "max_tokens": 4, "stream": stream}
    error = error_of(*post(base, "/v1/completions", over_long))
    assert error["code"] == "too_long" and "the prompt has 5000 tokens" in error["message"], error
    chat = {"messages": [{"role": "user", "content": "a" * 5000}], "stream": stream}
    assert error_of(*post(base, "/v1/chat/completions", chat))["code"] == "too_long"
    oa = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="the prompt has 5000 tokens"):
        oa.completions.create(model="tiny", prompt="a" * 5000, max_tokens=4, stream=stream)


def test_a_stream_that_runs_still_starts_with_200_and_ends_with_done(up):
    _, base = up
    status, headers, raw = post(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                               "max_tokens": 5, "temperature": 0, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream"), raw[:300]
    events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["delta"].get("role") == "assistant" and events[-1] == "[DONE]"


def test_a_chat_without_max_tokens_runs_up_to_the_context(up):
    _, base = up
    content = "a" * 3900
    status, _, raw = post(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": content}],
                                                         "temperature": 0, "ignore_eos": True})
    assert status == 200, raw[:300]
    usage = json.loads(raw)["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == CONTEXT, usage


def test_the_python_client_is_refused_before_any_decoding(up):
    redis_url, _ = up
    with Client(redis_url, CLUSTER) as client:
        started = time.monotonic()
        with pytest.raises(RequestFailed) as info:
            client.submit("Hi", max_tokens=100000).result(timeout=30)
        assert info.value.code == "too_long" and "2 in the prompt, 100000 in the completion" in str(info.value)
        assert time.monotonic() - started < 5
        # max_tokens=None: up to the context, exactly what the prompt leaves of it.
        c = client.submit(prompt_ids=[5] * 4000, max_tokens=None, temperature=0, ignore_eos=True).result(timeout=60)
        assert c.num_tokens == CONTEXT - 4000
