"""The usage ledger (pdqueue/queue/ledger.py): one record per request, written with its final
answer, equal to what its client received.

Redis tier: the record and its answer are one script (``ack_and_write``), a second answer for
the same request id adds no record, an error records the tokens published before it, a
duplicate's refusal records nothing, the stream is trimmed to its retention; records, labels
and totals without Redis.

Processes (one prefill and one decode worker and a gateway with two tenants, on a Redis of
the module's own): requests through the client and the gateway get one record each whose
counts are what the client and the gateway's ``usage`` said; a request id sent twice
(``Client.submit(id=)``, ``Idempotency-Key``) one record; a decode worker SIGKILLed
mid-stream (the requests resumed by recompute elsewhere) and a cancel mid-stream one record
each with the tokens the client received; `pdqueue usage --json` sums the records.
"""

from __future__ import annotations

import collections
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import redis

from pdqueue.client import Client
from pdqueue.keys import PREFILL_GROUP, SEEN_TTL_S, Keys
from pdqueue.protocol import Completion, ErrorCode, FinishReason, parse_request
from pdqueue.queue import ledger
from pdqueue.queue.ownership import Write, ack_and_write
from pdqueue.queue.redis_server import RedisServer
from tests.cluster import ROOT, Cluster
from tests.helpers import FAST, wait_for
from workers.answers import Unit

CLUSTER = "ledger"
TENANTS = ('[tenants.alpha]\napi_keys = ["sk-alpha"]\n'
           '[tenants.beta]\napi_keys = ["sk-beta"]\nservice_class = "interactive"\n')


# ---- the record and its answer, in one script (redis tier) ---------------------------------------

def taken(r, keys: Keys, fields: dict) -> str:
    """A request entry added to ``requests`` and read by consumer ``w`` (pending): its id."""
    try:
        r.xgroup_create(keys.requests, PREFILL_GROUP, id="0", mkstream=True)
    except redis.ResponseError:
        pass
    entry_id = r.xadd(keys.requests, fields).decode()
    r.xreadgroup(PREFILL_GROUP, "w", {keys.requests: ">"})
    return entry_id


def run(r, unit: Unit) -> list:
    """The unit's ops in one MULTI/EXEC, as the publisher runs them."""
    with r.pipeline(transaction=True) as pipe:
        for op in unit.ops:
            op(pipe)
        return pipe.execute()


def records(r, keys: Keys) -> list[ledger.Record]:
    return list(ledger.read(r, keys))


def test_a_done_and_its_record_are_one_write_and_a_second_answer_adds_no_record(r):
    keys = Keys("ledger-unit")
    fields = {"id": "req-1", "prompt": "hi", "tenant": "acme", "ref": "batch:b1:line:7", "class": "batch"}
    first = taken(r, keys, fields)
    request = parse_request(first, fields)
    c = Completion("req-1", "abc", (5, 6, 7), FinishReason.LENGTH, num_prompt_tokens=9, cached_tokens=4,
                   recomputed_tokens=11, prefill_worker="p0", decode_worker="d0")
    unit = Unit(keys, "d0", PREFILL_GROUP, model="tiny")
    unit.done(keys.requests, first, c, request)
    assert run(r, unit) == [1]
    [rec] = records(r, keys)
    assert (rec.request_id, rec.outcome, rec.tenant, rec.ref, rec.model, rec.service_class) == \
        ("req-1", "length", "acme", "batch:b1:line:7", "tiny", "batch")
    assert (rec.prompt_tokens, rec.cached_tokens, rec.pulled_tokens, rec.computed_tokens, rec.recomputed_tokens,
            rec.output_tokens) == (9, 4, 0, 5, 11, 3)
    assert (rec.batch_id, rec.custom_id, rec.idempotency_key) == ("b1", "line:7", "")
    assert (rec.prefill_worker, rec.decode_worker) == ("p0", "d0") and rec.at_ms > 0
    assert 0 < r.pttl(keys.usage_guard("req-1")) <= SEEN_TTL_S * 1000
    # The same entry finished again (a worker that hung while another took it over): nothing.
    again = Unit(keys, "d1", PREFILL_GROUP, model="tiny")
    again.done(keys.requests, first, c, request)
    assert run(r, again) == [0] and r.xlen(keys.done) == 1 and len(records(r, keys)) == 1
    # Another entry of the same request id finished (a copy sent again after a failover lost
    # seen:<id>): its answer is written, and no second record.
    second = taken(r, keys, fields)
    copy = Unit(keys, "d1", PREFILL_GROUP, model="tiny")
    copy.done(keys.requests, second, Completion("req-1", "a", (5,), FinishReason.STOP, num_prompt_tokens=9), request)
    assert run(r, copy) == [1] and r.xlen(keys.done) == 2
    assert records(r, keys) == [rec]


def test_errors_and_refusals_record_what_the_client_received(r):
    keys = Keys("ledger-errors")
    unit = Unit(keys, "w0", PREFILL_GROUP, model="tiny")
    failed = {"id": "req-err", "prompt": "x", "tenant": "t1"}
    entry = taken(r, keys, failed)
    # An error after 4 tokens were published: they are what its client received.
    unit.error(keys.requests, entry, "req-err", "gave up", ErrorCode.INTERNAL, 4, parse_request(entry, failed), 12)
    refused = {"id": "req-bad", "prompt": "y", "tenant": "t2", "priority": "high"}
    unit.reject(keys.requests, taken(r, keys, refused), refused, "req-bad", "too long", ErrorCode.TOO_LONG)
    # A duplicate's refusal: the record is the first entry's.
    unit.reject(keys.requests, taken(r, keys, {"id": "req-bad", "prompt": "z"}), {"id": "req-bad", "prompt": "z"},
                None, "already taken", ErrorCode.DUPLICATE)
    # An entry whose id is unusable: no answer stream, no record.
    unit.reject(keys.requests, taken(r, keys, {"id": "bad id!"}), {"id": "bad id!"}, None, "bad id",
                ErrorCode.BAD_REQUEST)
    run(r, unit)
    got = {rec.request_id: rec for rec in records(r, keys)}
    assert set(got) == {"req-err", "req-bad"}
    err, bad = got["req-err"], got["req-bad"]
    assert (err.outcome, err.output_tokens, err.prompt_tokens, err.tenant, err.service_class) == \
        ("internal", 4, 12, "t1", "standard")
    assert (bad.outcome, bad.output_tokens, bad.prompt_tokens, bad.tenant, bad.service_class) == \
        ("too_long", 0, 0, "t2", "interactive")


def test_the_usage_stream_keeps_its_retention(r):
    """Each record's write trims the stream (XADD MINID ~) to the records of the last
    ``retention`` seconds; a record older than that goes, a newer one stays."""
    keys = Keys("ledger-trim")
    node = r.config_get("stream-node-max-entries")["stream-node-max-entries"]
    r.config_set("stream-node-max-entries", 1)   # "~" trims whole nodes: one entry each here
    try:
        old = r.xadd(keys.usage, {"id": "old"}, id=f"{int(time.time() * 1000) - 120_000}-0")
        recent = r.xadd(keys.usage, {"id": "recent"})
        entry = taken(r, keys, {"id": "new", "prompt": "p"})
        with r.pipeline(transaction=True) as pipe:
            ack_and_write(pipe, keys.requests, PREFILL_GROUP, entry,
                          [ledger.record_write(keys, ledger.Record("new", "stop"), retention=60)])
            pipe.execute()
        assert [e[1][b"id"] for e in r.xrange(keys.usage)] == [b"recent", b"new"], (old, recent)
    finally:
        r.config_set("stream-node-max-entries", node)


def test_records_labels_and_totals():
    rec = ledger.Record("r1", "stop", tenant="acme", ref=ledger.idempotency_ref("k-1"), model="tiny",
                        service_class="standard", prompt_tokens=10, cached_tokens=4, computed_tokens=6,
                        output_tokens=3, at_ms=0)
    back = ledger.Record.from_entry("1700000000000-3", rec.to_fields())
    assert back == ledger.Record(**{**{f: getattr(rec, f) for f in rec.__slots__}, "at_ms": 1700000000000})
    assert rec.idempotency_key == "k-1" and rec.batch_id == "" and ledger.idempotency_ref("") == ""
    line = ledger.Record("r2", "length", ref=ledger.batch_ref("b-2", "c:1"))
    assert (line.batch_id, line.custom_id) == ("b-2", "c:1")
    assert len(ledger.batch_ref("b", "x" * 5000)) == 1024
    # Labels of an entry refused before it parsed: what its fields say.
    assert ledger.labels_of(None, {b"tenant": b"t", b"class": b"batch"}) == \
        {"tenant": "t", "ref": "", "service_class": "batch"}
    assert ledger.labels_of(None, {b"id": b"x", b"data": b"\x80"})["service_class"] == ""   # a handoff's
    recs = [rec, ledger.Record("r3", "stop", tenant="acme", model="tiny", service_class="batch", output_tokens=5),
            ledger.Record("r4", "stop", tenant="zed", model="tiny", service_class="batch", output_tokens=1)]
    assert ledger.totals(recs, ["tenant"]) == [
        {"tenant": "acme", "requests": 2, "prompt_tokens": 10, "cached_tokens": 4, "pulled_tokens": 0,
         "computed_tokens": 6, "recomputed_tokens": 0, "output_tokens": 8},
        {"tenant": "zed", "requests": 1, "prompt_tokens": 0, "cached_tokens": 0, "pulled_tokens": 0,
         "computed_tokens": 0, "recomputed_tokens": 0, "output_tokens": 1}]
    assert [(g["tenant"], g["class"], g["requests"]) for g in ledger.totals(recs)] == \
        [("acme", "batch", 1), ("acme", "standard", 1), ("zed", "batch", 1)]
    assert ledger.totals([], ())[0]["requests"] == 0
    with pytest.raises(ValueError, match="cannot group by 'ref'"):
        ledger.totals(recs, ["ref"])
    assert ledger.retention_s({}) == ledger.USAGE_RETENTION_S
    assert ledger.retention_s({"PDQ_USAGE_RETENTION_S": "3600"}) == 3600
    for bad in ("30", "1h", "-5"):
        with pytest.raises(ValueError, match="PDQ_USAGE_RETENTION_S"):
            ledger.retention_s({"PDQ_USAGE_RETENTION_S": bad})
    with pytest.raises(ValueError, match="needs a TTL"):
        Write("k", {}, guard="g")
    with pytest.raises(ValueError, match="inside ack_and_write"):
        Write("k", {"a": "b"}, guard="g", guard_ttl_ms=1)(None)


# ---- real workers and a gateway (processes) ------------------------------------------------------

@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A Redis of the module's own, a prefill and a decode worker (cluster ``ledger``), and
    `pdqueue serve` with tenants alpha and beta."""
    tmp = tmp_path_factory.mktemp("ledger")
    server = RedisServer().start()
    cluster = Cluster(server.url, tmp, cluster=CLUSTER)
    gateway = None
    try:
        cluster.start_together(("prefill", *FAST, {"worker_id": "p0"}), ("decode", *FAST, {"worker_id": "d0"}))
        (tmp / "tenants.toml").write_text(TENANTS)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PDQ_") or k == "PDQ_CACHE_DIR"}
        with open(tmp / "gateway.out", "wb") as out, open(tmp / "gateway.log", "wb") as log:
            gateway = subprocess.Popen([sys.executable, "-m", "workers", "serve", "--redis-url", server.url,
                                        "--cluster", CLUSTER, "--port", "0", "--tenants", str(tmp / "tenants.toml")],
                                       stdout=out, stderr=log, cwd=ROOT, env=env, start_new_session=True)

        def first_line():
            assert gateway.poll() is None, (tmp / "gateway.log").read_text()
            text = (tmp / "gateway.out").read_text()
            return text if "\n" in text else None

        port = int(re.search(r"http://127\.0\.0\.1:(\d+)/v1", wait_for(first_line, 60, what="the gateway")).group(1))
        yield {"url": server.url, "cluster": cluster, "port": port, "r": redis.Redis.from_url(server.url),
               "keys": Keys(CLUSTER), "env": env, "tmp": tmp}
    finally:
        if gateway is not None and gateway.poll() is None:
            gateway.send_signal(signal.SIGTERM)
            try:
                gateway.wait(30)
            except subprocess.TimeoutExpired:
                gateway.kill()
                gateway.wait()
        cluster.stop_and_check(killed_ok=True)
        server.stop()


def post(stack, path: str, body: dict, key: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", stack["port"], timeout=120)
    try:
        conn.request("POST", path, body=json.dumps(body),
                     headers={"content-type": "application/json", "authorization": f"Bearer {key}", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def sse_usage(raw: bytes) -> dict:
    """The usage chunk of a streamed answer (``stream_options.include_usage``)."""
    chunks = [json.loads(line[len("data: "):]) for line in raw.decode().splitlines()
              if line.startswith("data: {")]
    return next(c["usage"] for c in chunks if c.get("usage"))


def ledger_of(stack, ids) -> dict[str, ledger.Record]:
    """The records of ``ids`` once each has one (a record is written with its answer, which
    the client may have read a moment before); fails on an id with two."""
    r, keys = stack["r"], stack["keys"]

    def all_there():
        got = collections.Counter(rec.request_id for rec in ledger.read(r, keys))
        return all(got[i] >= 1 for i in ids) and got

    counts = wait_for(all_there, 30, what="every request's record")
    assert all(counts[i] == 1 for i in ids), {i: counts[i] for i in ids if counts[i] != 1}
    return {rec.request_id: rec for rec in ledger.read(r, keys) if rec.request_id in set(ids)}


def assert_record_is(rec: ledger.Record, c: Completion) -> None:
    """The record says what the completion its client read says."""
    assert (rec.prompt_tokens, rec.cached_tokens, rec.output_tokens, rec.recomputed_tokens) == \
        (c.num_prompt_tokens, c.cached_tokens, len(c.token_ids), c.recomputed_tokens), (rec, c)
    assert rec.computed_tokens == c.num_prompt_tokens - c.cached_tokens and rec.pulled_tokens == 0
    assert rec.outcome == c.finish_reason.value and rec.model == "tiny"
    assert (rec.prefill_worker, rec.decode_worker) == (c.prefill_worker, c.decode_worker)


@pytest.mark.processes
def test_client_and_gateway_requests_have_one_record_each_equal_to_their_usage(stack):
    with Client(stack["url"], CLUSTER) as client:
        handles = [client.submit("hello ledger", max_tokens=6, temperature=0, tenant="acme", ref="order-17"),
                   client.submit("a batch one", max_tokens=3, temperature=0, service_class="batch", tenant="acme"),
                   *client.submit_many([dict(prompt=f"many {i}", max_tokens=4, temperature=0) for i in range(2)])]
        # The same id twice (a retry): the second entry is refused as a duplicate, one answer, one record.
        twice = [client.submit("twice", max_tokens=5, temperature=0, id="ledger-twice", tenant="acme")
                 for _ in range(2)]
        results = [h.result(timeout=120) for h in handles + twice[:1]]
        assert twice[1].result(timeout=60).token_ids == results[-1].token_ids
    # Through the gateway: tenant alpha's completion, asked twice with one Idempotency-Key (the
    # retry attaches to the first request); tenant beta's streamed chat with its usage chunk;
    # a long prompt twice, the second partly from the prefix cache.
    body = {"model": "tiny", "prompt": "gateway ledger", "max_tokens": 5, "temperature": 0}
    keyed = [post(stack, "/v1/completions", body, "sk-alpha", {"idempotency-key": "ledger-key-1"}) for _ in range(2)]
    assert [k[0] for k in keyed] == [200, 200], keyed
    assert json.loads(keyed[0][2])["usage"] == json.loads(keyed[1][2])["usage"]
    chat = post(stack, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 7, "temperature": 0, "stream": True,
                                                "stream_options": {"include_usage": True}}, "sk-beta")
    long_prompt = "A long shared system prompt that repeats itself for the cache. " * 3
    cached = [post(stack, "/v1/completions", {"model": "tiny", "prompt": long_prompt, "max_tokens": 2,
                                              "temperature": 0}, "sk-alpha") for _ in range(2)]
    gateway = {resp[1]["x-request-id"]: (resp, json.loads(resp[2])["usage"]) for resp in [keyed[0], *cached]}
    gateway[chat[1]["x-request-id"]] = (chat, sse_usage(chat[2]))
    assert all(resp[0] == 200 for resp, _ in gateway.values())
    assert gateway[cached[1][1]["x-request-id"]][1]["prompt_tokens_details"]["cached_tokens"] >= 16

    recs = ledger_of(stack, [h.request_id for h in handles] + ["ledger-twice", *gateway])
    for h, res in zip(handles + twice[:1], results):
        assert_record_is(recs[h.request_id], res)
    assert [(recs[h.request_id].tenant, recs[h.request_id].ref, recs[h.request_id].service_class)
            for h in handles] == [("acme", "order-17", "standard"), ("acme", "", "batch"), ("", "", "standard"),
                                  ("", "", "standard")]
    assert recs["ledger-twice"].tenant == "acme"
    for rid, (_, usage) in gateway.items():   # the gateway's usage fields are the record's
        rec = recs[rid]
        assert (usage["prompt_tokens"], usage["completion_tokens"], usage["prompt_tokens_details"]["cached_tokens"]) \
            == (rec.prompt_tokens, rec.output_tokens, rec.cached_tokens), (usage, rec)
        assert usage["total_tokens"] == rec.prompt_tokens + rec.output_tokens
    key_rec, chat_rec = recs["ledger-key-1"], recs[chat[1]["x-request-id"]]
    assert (key_rec.tenant, key_rec.idempotency_key, key_rec.service_class) == ("alpha", "ledger-key-1", "standard")
    assert (chat_rec.tenant, chat_rec.ref, chat_rec.service_class) == ("beta", "", "interactive")
    # The Responses API: its request (resp-<hex> for resp_<hex>) is recorded for the tenant too.
    status, _, raw = post(stack, "/v1/responses", {"model": "tiny", "input": "respond", "max_output_tokens": 4,
                                                   "temperature": 0}, "sk-beta")
    assert status == 200, raw
    response = json.loads(raw)
    rec = ledger_of(stack, ["resp-" + response["id"][len("resp_"):]])["resp-" + response["id"][len("resp_"):]]
    usage = response["usage"]
    assert (rec.tenant, rec.prompt_tokens, rec.output_tokens, rec.cached_tokens) == \
        ("beta", usage["input_tokens"], usage["output_tokens"], usage["input_tokens_details"]["cached_tokens"])


@pytest.mark.processes
def test_a_decode_worker_killed_mid_stream_and_a_cancel_leave_one_record_of_what_was_streamed(stack):
    """d0 SIGKILLed while it streams 4 long answers: d1 takes them over, recomputes prompt +
    the tokens out so far and goes on; each request's one record counts the tokens its
    client read (the stream, without gaps or repeats) and what was recomputed. A request
    cancelled mid-stream: its record counts the tokens its done holds."""
    cluster, r, keys = stack["cluster"], stack["r"], stack["keys"]
    with Client(stack["url"], CLUSTER) as client:
        handles = client.submit_many([dict(prompt=f"killed mid stream {i}", max_tokens=300, ignore_eos=True,
                                           temperature=0.0 if i % 2 else 0.9, seed=i, tenant="kill")
                                      for i in range(4)])
        wait_for(lambda: all(r.xlen(keys.out(h.request_id)) > 5 for h in handles), 120, what="tokens flowing")
        cluster.signal("d0", signal.SIGKILL)
        cluster.start("decode", *FAST, worker_id="d1")
        results = [h.result(timeout=180) for h in handles]
        streamed = {h.request_id: [t for e in client.handle(h.request_id).stream(timeout=30) for t in e.token_ids]
                    for h in handles}
        cancelled = client.submit("cancelled mid stream", max_tokens=2000, ignore_eos=True, temperature=0,
                                  tenant="kill")
        events = cancelled.stream(timeout=120)
        first = [next(events) for _ in range(3)]
        cancelled.cancel()
        rest = list(events)
        stopped = cancelled.completion
    recs = ledger_of(stack, [h.request_id for h in handles] + [cancelled.request_id])
    resumed = 0
    for h, res in zip(handles, results):
        rec = recs[h.request_id]
        assert rec.output_tokens == len(streamed[h.request_id]) == len(res.token_ids) == 300
        assert_record_is(rec, res)
        if res.transfer_path == "recompute":
            resumed += 1
            assert res.decode_worker == cluster.id("d1")
            assert rec.prompt_tokens < rec.recomputed_tokens < rec.prompt_tokens + 300, rec
        else:
            assert rec.recomputed_tokens == 0
    assert resumed, [res.transfer_path for res in results]
    rec = recs[cancelled.request_id]
    assert stopped.finish_reason == FinishReason.CANCELLED and rec.outcome == "cancelled"
    assert rec.output_tokens == len(stopped.token_ids) == sum(len(e.token_ids) for e in first + rest)


@pytest.mark.processes
def test_batch_lines_are_recorded_with_their_batch_and_custom_id(stack, tmp_path):
    """`pdqueue batch` and the gateway's Batch API (tenant alpha's): each line's record names
    its batch and custom_id, in the batch class, with the tokens its output line reports."""
    lines = [{"custom_id": f"line:{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "tiny", "prompt": f"batch line {i}", "max_tokens": 2 + i, "temperature": 0}}
             for i in range(2)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run = subprocess.run([sys.executable, "-m", "workers", "batch", str(inp), "-o", str(out), "--batch-id", "ledger-b1",
                          "--redis-url", stack["url"], "--cluster", CLUSTER], capture_output=True, text=True,
                         env=stack["env"], cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    import io

    import openai

    oa = openai.OpenAI(base_url=f"http://127.0.0.1:{stack['port']}/v1", api_key="sk-alpha", max_retries=0)
    upload = oa.files.create(file=("in.jsonl", io.BytesIO(inp.read_bytes())), purpose="batch")
    batch = oa.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    batch = wait_for(lambda: (b := oa.batches.retrieve(batch.id)).status in ("completed", "failed") and b, 120,
                     what="the batch's end")
    assert batch.status == "completed", batch
    answers = {("ledger-b1", json.loads(x)["custom_id"]): json.loads(x) for x in out.read_text().splitlines()}
    answers.update({(batch.id, a["custom_id"]): a for a in map(json.loads, oa.files.content(
        batch.output_file_id).content.splitlines()) if a})
    r, keys = stack["r"], stack["keys"]
    wait_for(lambda: len([rec for rec in ledger.read(r, keys) if rec.batch_id]) >= 4, 30, what="the lines' records")
    recs = {(rec.batch_id, rec.custom_id): rec for rec in ledger.read(r, keys) if rec.batch_id}
    assert set(recs) == set(answers) and len(answers) == 4
    for key, answer in answers.items():
        rec, usage = recs[key], answer["response"]["body"]["usage"]
        assert (rec.prompt_tokens, rec.output_tokens) == (usage["prompt_tokens"], usage["completion_tokens"])
        assert rec.service_class == "batch" and rec.tenant == ("alpha" if key[0] == batch.id else "")


@pytest.mark.processes
def test_pdqueue_usage_sums_the_records(stack):
    with Client(stack["url"], CLUSTER) as client:
        for h in client.submit_many([dict(prompt="cli one", max_tokens=2, temperature=0, tenant="cli-a"),
                                     dict(prompt="cli two", max_tokens=3, temperature=0, tenant="cli-b")]):
            h.result(timeout=120)
    r, keys = stack["r"], stack["keys"]
    wait_for(lambda: {"cli-a", "cli-b"} <= {rec.tenant for rec in ledger.read(r, keys)}, 30, what="the records")
    target = ["--redis-url", stack["url"], "--cluster", CLUSTER]

    def usage(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "workers", "usage", *target, *args], capture_output=True,
                              text=True, env=stack["env"], cwd=ROOT, timeout=60)

    out = usage("--json", "--requests", "--since", "1h")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    recs = [rec for rec in ledger.read(r, keys) if rec.at_ms >= report["since_ms"]]
    assert report["groups"] == ledger.totals(recs) and report["by"] == ["tenant", "model", "class"]
    assert report["total"] == ledger.totals(recs, ())[0] and report["total"]["requests"] == len(recs)
    assert [x["request_id"] for x in report["requests"]] == [rec.request_id for rec in recs]
    assert report["requests"][0] == recs[0].as_json()
    one = json.loads(usage("--json", "--by", "tenant", "--tenant", "cli-b").stdout)
    assert one["groups"] == [{"tenant": "cli-b", "requests": 1, **{n: one["total"][n] for n in ledger.COUNTS}}]
    assert one["total"]["output_tokens"] == 3 and "requests" not in one
    table = usage("--by", "tenant")
    assert table.returncode == 0 and "cli-a" in table.stdout and "total" in table.stdout, table.stderr
    empty = json.loads(usage("--json", "--since", "2000-01-01", "--until", "2000-01-02").stdout)
    assert empty["groups"] == [] and empty["total"]["requests"] == 0
    bad = usage("--since", "yesterday")
    assert bad.returncode == 1 and "--since: cannot read 'yesterday'" in bad.stderr and "Traceback" not in bad.stderr
