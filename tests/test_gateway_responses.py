"""The gateway's Responses API (/v1/responses) end to end: a real Redis, real tiny-model workers
(one prefill, one decode), real `pdqueue serve` processes with a tenants file, and the official
`openai` package (`client.responses`) as the client.

- create with text or messages and instructions: the greedy answer is a chat completion's over
  the same messages (the same text, and the same token ids as pdqueue's Client gets);
- previous_response_id: the second turn's prompt is the first's conversation and output, then
  the new input (the same answer as a chat completion over those messages; its prompt starts
  with the first turn's, so the prefix cache serves part of it);
- stream: every event numbered in order; a client that hangs up does not cancel a stored
  response, and `retrieve(stream=True, starting_after=N)` sends exactly the events after N;
- background: queued at once, finished by a gateway's sweep with nobody reading; cancel;
- delete, input_items; errors as OpenAI shapes them; another tenant's id is a 404;
- the gateway SIGKILLed mid-stream, a new one started on the same Redis: the client resumes
  with starting_after and gets every event once, in order, the response run once.

One set of workers and one gateway serve the module (the kill test replaces the gateway). The
pure tests at the end check the parsing and the events' numbering without a process.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
from pathlib import Path

import openai
import pytest
import redis

from pdqueue.client import Client
from pdqueue.frontends import responses_compat as rc
from pdqueue.frontends.responses_compat import request_id_of
from pdqueue.frontends.responses_store import ResponseKeys
from pdqueue.keys import Keys
from pdqueue.models.tokenizer import ByteTokenizer
from tests.cluster import Cluster
from tests.helpers import wait_for
from tests.test_gateway import Gateway, hang_up

pytestmark = pytest.mark.xdist_group("test_gateway_responses")   # module-scoped cluster
processes = pytest.mark.processes   # all but the pure tests at the end

CLUSTER = "gwr"
KEYS = Keys(CLUSTER)
RKEYS = ResponseKeys(KEYS)
TTL_S = 7200
TENANTS = """
[tenants.alice]
api_keys = ["sk-alice"]

[tenants.bob]
api_keys = ["sk-bob"]
"""
INSTRUCTIONS = "You are a terse assistant. Answer in one short line, please."   # over a 16-token block


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gateway-responses")


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


class Gateways:
    """The module's gateway; ``replace()`` starts the next one (after a kill)."""

    def __init__(self, url: str, logs: Path):
        self.url, self.logs = url, logs
        self.tenants = logs / "tenants.toml"
        self.tenants.write_text(TENANTS)
        self.started = 0
        self.gw = self._start()

    def _start(self) -> Gateway:
        self.started += 1
        return Gateway(self.url, CLUSTER, self.logs, "--tenants", str(self.tenants), "--responses-ttl-s",
                       str(TTL_S), name=f"gateway-{self.started}")

    def replace(self) -> Gateway:
        self.gw = self._start()
        return self.gw


@pytest.fixture(scope="module")
def gateways(url, logs, workers):
    g = Gateways(url, logs)
    yield g
    assert g.gw.stop() == 0, g.gw.log()


@pytest.fixture(scope="module")
def client(url, workers):
    with Client(url, CLUSTER) as c:
        yield c


def oa(gateways: Gateways, key: str = "sk-alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=gateways.gw.url + "/v1", api_key=key, max_retries=0, timeout=120)


def record(workers: Cluster, response_id: str) -> dict:
    return {k.decode(): v.decode() for k, v in workers.r.hgetall(RKEYS.record(response_id)).items()}


def outcome(workers: Cluster, response_id: str) -> dict:
    return json.loads(record(workers, response_id)["outcome"])


def runs(workers: Cluster, response_id: str) -> int:
    """How many times the workers finished the response's request (1: run once)."""
    rid = request_id_of(response_id).encode()
    return sum(1 for _, f in workers.r.xrange(KEYS.done) if f.get(b"id") == rid)


def sse(resp):
    """A Responses stream read as it comes: its events' data, parsed."""
    kind, data = None, []
    while True:
        line = resp.readline()
        if not line:
            return
        line = line.decode().rstrip("\n")
        if line.startswith("event: "):
            kind = line[len("event: "):]
        elif line.startswith("data: "):
            data.append(line[len("data: "):])
        elif not line and data:
            event = json.loads("\n".join(data))
            assert event["type"] == kind, (kind, event)
            yield event
            kind, data = None, []


def open_stream(gw: Gateway, body: dict):
    c = gw.conn(timeout=60)
    c.request("POST", "/v1/responses", body=json.dumps({**body, "stream": True}).encode(),
              headers={"content-type": "application/json", "authorization": "Bearer sk-alice"})
    resp = c.getresponse()
    assert resp.status == 200, resp.read()
    return c, resp


def check_events(events: list, text: str) -> None:
    """Every event once, numbered 0, 1, 2, ... in order; the deltas make ``text``."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    done = [e for e in events if e.type == "response.output_text.done"]
    assert len(done) == 1 and done[0].text == text


# ---- create ----------------------------------------------------------------------------------------

@processes
def test_create_with_text_or_messages_answers_as_a_chat_completion(gateways, workers, client):
    api = oa(gateways)
    conversation = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "What is a KV cache?"}]
    chat = api.chat.completions.create(model="tiny", messages=conversation, max_tokens=12, temperature=0)
    want = client.submit(messages=conversation, chat=True, max_tokens=12, temperature=0.0).result(timeout=60)
    assert chat.choices[0].message.content == want.text

    by_text = api.responses.create(input="What is a KV cache?", instructions=INSTRUCTIONS, max_output_tokens=12,
                                   temperature=0)
    by_messages = api.responses.create(input=conversation, max_output_tokens=12, temperature=0)
    for got in (by_text, by_messages):
        assert got.object == "response" and got.id.startswith("resp_") and got.model == "tiny"
        assert got.output_text == want.text
        if want.finish_reason.value == "length":
            assert got.status == "incomplete" and got.incomplete_details.reason == "max_output_tokens"
        else:
            assert got.status == "completed" and got.incomplete_details is None
        assert got.output[0].role == "assistant" and got.output[0].content[0].type == "output_text"
        assert (got.usage.input_tokens, got.usage.output_tokens) == (want.num_prompt_tokens, len(want.token_ids))
        assert outcome(workers, got.id)["output_ids"] == list(want.token_ids)   # the same tokens
        again = api.responses.retrieve(got.id)
        assert again.model_dump() == got.model_dump()
    assert by_text.instructions == INSTRUCTIONS and by_messages.instructions is None
    ttl = workers.r.ttl(RKEYS.record(by_text.id))
    assert 0 < ttl <= TTL_S   # --responses-ttl-s
    assert not workers.r.zrange(RKEYS.active, 0, -1)   # nothing left running

    with pytest.raises(openai.NotFoundError):   # store=false: answered, not kept
        api.responses.retrieve(api.responses.create(input="hi", store=False, max_output_tokens=2).id)


@processes
def test_previous_response_id_continues_the_conversation(gateways, workers):
    api = oa(gateways)
    first = api.responses.create(input="Hello there.", instructions=INSTRUCTIONS, max_output_tokens=8,
                                 temperature=0)
    second = api.responses.create(input="And then?", previous_response_id=first.id, instructions=INSTRUCTIONS,
                                  max_output_tokens=8, temperature=0)
    turn1 = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Hello there."}]
    turn2 = [*turn1, {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And then?"}]
    chat = api.chat.completions.create(model="tiny", messages=turn2, max_tokens=8, temperature=0)
    assert second.output_text == chat.choices[0].message.content
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    # The second prompt starts with the first's prompt and output: the prefix cache serves the
    # first prompt's whole blocks (a KV tier could serve the output's too).
    tokenizer = ByteTokenizer()
    prompt1, prompt2 = tokenizer.encode_chat(turn1), tokenizer.encode_chat(turn2)
    assert prompt2[:len(prompt1)] == prompt1
    assert tokenizer.decode(prompt2[len(prompt1):]).startswith(first.output_text)
    assert second.usage.input_tokens == len(prompt2)
    assert second.usage.input_tokens_details.cached_tokens >= len(prompt1) // 16 * 16 > 0
    # Its input items are its own turn's; the first is unchanged.
    assert [i.content[0].text for i in api.responses.input_items.list(second.id).data] == ["And then?"]
    assert api.responses.retrieve(first.id).output_text == first.output_text


# ---- streams ---------------------------------------------------------------------------------------

@processes
def test_a_stream_resumes_after_any_event_and_a_hang_up_does_not_cancel_it(gateways, workers):
    api = oa(gateways)
    events = list(api.responses.create(input="Tell a story", max_output_tokens=40, temperature=0, stream=True))
    final = events[-1].response
    check_events(events, final.output_text)
    assert events[-1].type == "response.incomplete" and final.usage.output_tokens == 40
    types = [e.type for e in events]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    whole = [e.model_dump() for e in events]
    replay = [e.model_dump() for e in api.responses.retrieve(final.id, stream=True)]
    assert replay == whole   # from the record: the same events, numbers and all
    for after in (0, 5, len(events) - 2):
        rest = api.responses.retrieve(final.id, stream=True, starting_after=after)
        assert [e.model_dump() for e in rest] == whole[after + 1:]

    # A client that hangs up mid-stream: the stored response goes on; the rest comes on resume.
    c, resp = open_stream(gateways.gw, {"input": "Another story", "max_output_tokens": 300, "temperature": 0,
                                        "ignore_eos": True})
    reading = sse(resp)
    before = [next(reading) for _ in range(8)]
    hang_up(c, resp)
    response_id = before[0]["response"]["id"]
    rest = list(api.responses.retrieve(response_id, stream=True, starting_after=before[-1]["sequence_number"]))
    got = [e["sequence_number"] for e in before] + [e.sequence_number for e in rest]
    assert got == list(range(len(got)))
    assert rest[-1].type == "response.incomplete" and rest[-1].response.usage.output_tokens == 300
    text = "".join(e["delta"] for e in before if e["type"] == "response.output_text.delta")
    text += "".join(e.delta for e in rest if e.type == "response.output_text.delta")
    assert text == rest[-1].response.output_text == outcome(workers, response_id)["text"]
    assert runs(workers, response_id) == 1


@processes
def test_a_refused_request_is_the_chat_paths_400_before_any_stream_starts(gateways):
    api = oa(gateways)
    long = "x" * 5000   # tiny's context is 4096 tokens, a byte each
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            api.responses.create(input=long, max_output_tokens=4, stream=stream)
        assert info.value.code == "too_long" and info.value.status_code == 400
        with pytest.raises(openai.BadRequestError) as info:   # max_output_tokens alone: the gateway's check
            api.responses.create(input="hi", max_output_tokens=5000, stream=stream)
        assert info.value.code == "too_long"


# ---- background, cancel, delete, input_items ---------------------------------------------------------

@processes
def test_background_responses_run_detached_and_can_be_cancelled(gateways, workers):
    api = oa(gateways)
    short = api.responses.create(input="Quick one", background=True, max_output_tokens=6, temperature=0)
    assert short.status == "queued" and short.background and short.output == []
    # Nobody reads it: a gateway's sweep writes its end into the record.
    wait_for(lambda: record(workers, short.id).get("status"), 30, what="the sweep finishing a background response")
    done = api.responses.retrieve(short.id)
    assert done.status == "incomplete" and done.usage.output_tokens == 6 and done.output_text

    long = api.responses.create(input="A long one", background=True, max_output_tokens=3000, temperature=0,
                                extra_body={"ignore_eos": True})
    wait_for(lambda: api.responses.retrieve(long.id).status == "in_progress", 30, what="the background answer")
    cancelled = api.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    wait_for(lambda: record(workers, long.id).get("status"), 30, what="the cancelled answer's end")
    after = api.responses.retrieve(long.id)
    assert after.status == "cancelled" and 0 < after.usage.output_tokens < 3000
    assert api.responses.cancel(long.id).model_dump() == after.model_dump()   # twice: the same, as it is
    events = list(api.responses.retrieve(long.id, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "cancelled"
    check_events(events, after.output_text)


@processes
def test_input_items_and_delete(gateways, workers):
    api = oa(gateways)
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "One"},
                {"role": "assistant", "content": "Two"}, {"role": "user", "content": [{"type": "input_text",
                                                                                        "text": "Three"}]}]
    got = api.responses.create(input=messages, max_output_tokens=2, temperature=0)
    asc = api.responses.input_items.list(got.id, order="asc")
    assert [(i.role, i.content[0].text) for i in asc.data] == [("developer", "Be brief."), ("user", "One"),
                                                               ("assistant", "Two"), ("user", "Three")]
    desc = api.responses.input_items.list(got.id, limit=2)
    assert [i.content[0].text for i in desc.data] == ["Three", "Two"] and desc.has_more
    page = api.responses.input_items.list(got.id, limit=2, after=desc.data[-1].id)
    assert [i.content[0].text for i in page.data] == ["One", "Be brief."] and not page.has_more

    api.responses.delete(got.id)
    assert not workers.r.exists(RKEYS.record(got.id))
    for call in (lambda: api.responses.retrieve(got.id), lambda: api.responses.delete(got.id),
                 lambda: api.responses.input_items.list(got.id)):
        with pytest.raises(openai.NotFoundError):
            call()


# ---- errors and tenants ------------------------------------------------------------------------------

@processes
def test_errors_have_openais_shape(gateways):
    api = oa(gateways)
    for kwargs, param in (({"input": []}, "input"),
                          ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                           "input"),
                          ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
                          ({"input": "hi", "background": True, "store": False}, "background"),
                          ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
                          ({"input": "hi", "temperature": -1}, "temperature"),
                          ({"input": "hi", "truncation": "auto"}, "truncation")):
        with pytest.raises(openai.BadRequestError) as info:
            api.responses.create(**kwargs)
        assert info.value.param == param, (kwargs, info.value)
    for call in (lambda: api.responses.retrieve("resp_" + "0" * 32), lambda: api.responses.retrieve("nope"),
                 lambda: api.responses.create(input="hi", previous_response_id="resp_" + "1" * 32)):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert info.value.code == "response_not_found"
    with pytest.raises(openai.AuthenticationError):
        oa(gateways, key="sk-nobody").responses.create(input="hi")


@processes
def test_another_tenants_response_is_a_404(gateways, workers):
    alice, bob = oa(gateways), oa(gateways, "sk-bob")
    mine = alice.responses.create(input="secret", max_output_tokens=2, temperature=0)
    for call in (lambda: bob.responses.retrieve(mine.id), lambda: bob.responses.retrieve(mine.id, stream=True),
                 lambda: bob.responses.cancel(mine.id), lambda: bob.responses.delete(mine.id),
                 lambda: bob.responses.input_items.list(mine.id),
                 lambda: bob.responses.create(input="x", previous_response_id=mine.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert alice.responses.retrieve(mine.id).output_text == mine.output_text   # untouched


# ---- a gateway killed mid-stream --------------------------------------------------------------------

@processes
def test_a_stream_resumes_on_a_new_gateway_after_kill_9(gateways, workers):
    """The gateway serving a stream dies (SIGKILL) and the client's connection is cut; a new
    gateway process on the same Redis serves the resume: every event once, in order, and the
    response's end is recorded (the new gateway's sweep, or the read)."""
    first = gateways.gw
    c, resp = open_stream(first, {"input": "Tell a long story", "max_output_tokens": 600, "temperature": 0,
                                  "ignore_eos": True})
    reading = sse(resp)
    before = [next(reading) for _ in range(10)]
    os.killpg(first.proc.pid, signal.SIGKILL)
    try:
        before += list(reading)   # what the dead gateway had written reaches the client, then the cut
    except (http.client.IncompleteRead, ConnectionError):
        pass
    c.close()
    first.proc.wait(10)
    assert before[-1]["type"] != "response.incomplete", "the stream ended before the kill"
    response_id = before[0]["response"]["id"]
    second = gateways.replace()
    assert second.proc.pid != first.proc.pid
    api = oa(gateways)
    rest = list(api.responses.retrieve(response_id, stream=True, starting_after=before[-1]["sequence_number"]))
    numbers = [e["sequence_number"] for e in before] + [e.sequence_number for e in rest]
    assert numbers == list(range(len(numbers))), numbers
    final = rest[-1].response
    assert rest[-1].type == "response.incomplete" and final.usage.output_tokens == 600
    text = "".join(e["delta"] for e in before if e["type"] == "response.output_text.delta")
    text += "".join(e.delta for e in rest if e.type == "response.output_text.delta")
    assert text == final.output_text == outcome(workers, response_id)["text"]
    assert runs(workers, response_id) == 1
    assert api.responses.retrieve(response_id).status == "incomplete"
    assert response_id.encode() not in workers.r.zrange(RKEYS.active, 0, -1)


# ---- pure: the body, the events ---------------------------------------------------------------------

def test_a_create_body_becomes_a_chat_request():
    turn = rc.parse_create({"input": [{"role": "developer", "content": "Be brief."},
                                      {"type": "message", "role": "user",
                                       "content": [{"type": "input_text", "text": "Hi"}]}],
                            "instructions": "Answer in French.", "max_output_tokens": 7, "temperature": 0,
                            "reasoning": {"effort": "low"}, "frobnicate": 1})
    assert turn.messages == ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"})
    assert turn.store and not turn.background and turn.ignored == ("frobnicate",)
    parsed = turn.chat([{"role": "user", "content": "Earlier"}, {"role": "assistant", "content": "Yes"},
                        *turn.messages])
    assert [m["role"] for m in parsed.messages] == ["system", "user", "assistant", "system", "user"]
    assert parsed.messages[0]["content"] == "Answer in French."   # instructions first, this turn's only
    assert (parsed.max_tokens, parsed.temperature) == (7, 0.0)
    one = rc.parse_create({"input": "Hello"}).chat([{"role": "user", "content": "Hello"}])
    assert one.prompt == "Hello" and one.messages is None and one.max_tokens is None   # as the chat path sends it
    for body, param in (({"input": "x", "top_p": 2}, "top_p"), ({"input": "x", "seed": -1}, "seed"),
                        ({"input": [{"role": "tool", "content": "x"}]}, "input"), ({"instructions": "x"}, "input"),
                        ({"input": "x", "text": {"format": {"type": "json_object"}}}, "text.format")):
        with pytest.raises(rc.OpenAIError) as info:
            rc.parse_create(body)
        assert (info.value.status, info.value.param) == (400, param), body


def test_events_are_numbered_alike_live_and_replayed():
    rec = rc.Record("resp_" + "a" * 32, "t", 1, "tiny", False, True, {}, (), ())
    live = rc.Events(rec)
    events = live.opening() + live.delta("") + live.delta("Hel") + live.delta("lo")
    done = rc.Outcome("Hello!", ("Hel", "lo", "!"), "stop", 3, (1, 2, 3), 0)
    events += [e for text in done.deltas[2:] for e in live.delta(text)] + live.closing("completed", done)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events == rc.Events(rec).replay("completed", done)
    assert [e["type"] for e in events][-1] == "response.completed" and events[-1]["response"]["output"][0][
        "content"][0]["text"] == "Hello!"
    cancelled = rc.Events(rec).replay("cancelled", rc.Outcome("He", ("He",), "cancelled"))
    assert cancelled[-1]["type"] == "response.incomplete" and cancelled[-1]["response"]["status"] == "cancelled"
    refused = rc.Events(rec).replay("failed", rc.Outcome.failed([], "too_long", "over the context"))
    assert [e["type"] for e in refused] == ["response.created", "response.in_progress", "response.failed"]
    assert refused[-1]["response"]["error"]["code"] == "invalid_prompt"

    class Completion:   # a cancel that flushed held-back text: one delta more
        text, token_ids, finish_reason, num_prompt_tokens, cached_tokens = "ab\ufffd", (1, 2, 3), "cancelled", 4, 0
    assert rc.Outcome.of(Completion, ["a", "b"]).deltas == ("a", "b", "\ufffd")
