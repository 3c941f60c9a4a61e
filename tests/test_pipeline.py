"""The disaggregated pipeline end to end: real Redis, real worker processes, real shared
memory and sockets. The colocated engine in this process is the oracle: the pipeline must
return its tokens, token for token."""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import pytest
import redis

from pdqueue.client import Client
from pdqueue.engine.config import EngineConfig
from pdqueue.engine.llm_engine import LLMEngine
from pdqueue.engine.sampling import SamplingParams
from pdqueue.keys import Keys
from pdqueue.models.loader import load_model
from tests.cluster import Cluster
from tests.helpers import mixed_prompts, oracle, wait_pools_free
from tests.oracle import assert_same_tokens

MAX_TOKENS = 12


def request_params(i: int, sampled: bool) -> dict:
    if sampled:
        return {"max_tokens": MAX_TOKENS, "temperature": 0.8, "top_p": 0.95, "top_k": 40, "seed": 1000 + i}
    return {"max_tokens": MAX_TOKENS, "temperature": 0.0, "seed": 0}


def run_and_compare(cluster: Cluster, loaded, n: int = 32, expect_path: str | None = None):
    prompts = mixed_prompts(n) * 2
    params = [request_params(i, sampled=i >= n) for i in range(2 * n)]
    prompt_ids, expected, sampling = oracle(loaded, prompts, params)
    client = Client(cluster.redis_url, cluster.cluster)
    handles = client.submit_many([dict(prompt=p, **kw) for p, kw in zip(prompts, params)])
    results = [h.result(timeout=120) for h in handles]
    # A prompt sent twice may find all of its KV in the decode worker's prefix cache the
    # second time: nothing to fetch ("cache"); that is the path working, not another one.
    paths = {r.transfer_path for r in results} - {"cache"}
    assert all(r.kv_reused_tokens > 0 for r in results if r.transfer_path == "cache")
    for pid, exp, res, sp in zip(prompt_ids, expected, results, sampling):
        assert_same_tokens(loaded, pid, exp, list(res.token_ids), sp)
    if expect_path:
        nodes = {name: w.get("node") for name, w in cluster.workers().items()}
        assert paths == {expect_path}, (paths, nodes, {w: cluster.log(w)[-1500:] for w in cluster.procs})
    # The stream carries the completion's tokens, each index once, in order.
    for h, res in list(zip(handles, results))[:4]:
        events = list(client.handle(h.request_id).stream(timeout=10))
        streamed = [t for e in events if e.type == "token" for t in e.token_ids]
        assert streamed == list(res.token_ids)
    return results


@pytest.mark.parametrize("num_prefill,num_decode,transfer,path", [
    (1, 1, "auto", "shm"),
    (1, 1, "tcp", "tcp"),
    (1, 1, "zmq", "zmq"),
    (2, 2, "auto", "shm"),
    (2, 2, "tcp", "tcp"),
    (2, 2, "zmq", "zmq"),
])
def test_pipeline_matches_colocated_engine(cluster, tiny, num_prefill, num_decode, transfer, path):
    prefills = [("prefill", "--transfer", transfer, {"worker_id": f"prefill{i}"}) for i in range(num_prefill)]
    decodes = [("decode", "--transfer", transfer, {"worker_id": f"decode{i}"}) for i in range(num_decode)]
    cluster.start_together(*prefills, *decodes)
    results = run_and_compare(cluster, tiny, n=32, expect_path=path)
    if num_decode > 1:
        assert len({r.decode_worker for r in results}) > 1, "work should spread over decode workers"
    wait_pools_free(cluster)


def test_cross_host_path_is_chosen_by_itself(cluster, tiny):
    """A decode worker with a private /dev/shm (its own mount namespace) is another
    shared-memory domain: the network path (the TCP data wire) is chosen automatically and
    tokens still match."""
    probe = ["unshare", "--mount", "--propagation", "private", "sh", "-c", "mount -t tmpfs tmpfs /dev/shm"]
    if not shutil.which("unshare") or subprocess.run(probe, capture_output=True).returncode != 0:
        pytest.skip("needs unshare and the right to mount a private /dev/shm (root or CAP_SYS_ADMIN)")
    cluster.start("prefill", worker_id="prefillA")
    cluster.start("decode", worker_id="decodeB",
                  prefix=["unshare", "--mount", "--propagation", "private", "sh", "-c",
                          "mount -t tmpfs -o size=256m tmpfs /dev/shm && exec {cmd}"])
    nodes = {name: w["node"] for name, w in cluster.workers().items()}
    assert nodes["prefillA"] != nodes["decodeB"]
    run_and_compare(cluster, tiny, n=8, expect_path="tcp")
    wait_pools_free(cluster)


def test_plain_redis_producer(cluster):
    """Any Redis client can produce and read: flat string fields in, flat fields out."""
    cluster.start_together(("prefill",), ("decode",))
    raw = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    prefix = "pdq:{default}:"
    raw.xadd(prefix + "requests", {"id": "plain-1", "prompt": "hello there", "max_tokens": "5",
                                   "temperature": "0"})
    entry_id = raw.xadd(prefix + "requests", {"prompt": "no id given", "max_tokens": "3"})
    for rid, n in (("plain-1", 5), (entry_id, 3)):
        last, tokens, done = "0", [], None
        deadline = time.monotonic() + 60
        while done is None and time.monotonic() < deadline:
            for _stream, entries in raw.xread({prefix + f"out:{rid}": last}, block=1000) or []:
                for last, fields in entries:
                    if fields["type"] == "token":
                        tokens.extend(json.loads(fields["token_ids"]))
                    elif fields["type"] == "done":
                        done = fields
        assert done is not None, f"no answer for {rid}"
        assert json.loads(done["token_ids"]) == tokens
        # The second request samples (temperature 1, no seed): it may draw EOS before n tokens.
        assert (done["finish_reason"], len(tokens)) == ("length", n) or (
            done["finish_reason"] == "stop" and 0 < len(tokens) <= n), (done["finish_reason"], tokens)


BAD_ENTRIES = [
    ({"id": "bad-missing-prompt", "max_tokens": "4"}, "prompt"),
    ({"id": "bad-max-tokens", "prompt": "hi", "max_tokens": "lots"}, "max_tokens"),
    ({"id": "bad-negative", "prompt": "hi", "max_tokens": "-3"}, "max_tokens"),
    ({"id": "bad-unknown", "prompt": "hi", "colour": "blue"}, "colour"),
    ({"id": "bad-bytes", "prompt": b"\xff\xfe\xfa"}, "UTF-8"),
    ({"id": "bad-too-long", "prompt": "x" * 5000}, "context"),
    ({"id": "bad-ids", "prompt_ids": "[1, 2, 99999]"}, "vocabulary"),
    ({"id": "bad-json", "prompt_ids": "[1, 2"}, "prompt_ids"),
]


def test_bad_input_gets_an_error_and_nothing_is_lost(cluster):
    cluster.start_together(("prefill",), ("decode",))
    r = redis.Redis.from_url(cluster.redis_url)
    keys = Keys()
    good = []
    for i, (fields, _) in enumerate(BAD_ENTRIES):
        r.xadd(keys.requests, fields)
        rid = f"good-{i}"
        r.xadd(keys.requests, {"id": rid, "prompt": f"fine request {i}", "max_tokens": "4", "temperature": "0"})
        good.append(rid)
    r.xadd(keys.requests, {b"\x00\xff": b"\xfe"})  # garbage field name, no id
    client = Client(cluster.redis_url)
    for rid in good:
        assert client.handle(rid).result(timeout=60).num_tokens == 4
    for fields, needle in BAD_ENTRIES:
        rid = fields["id"]
        with pytest.raises(Exception) as info:
            client.handle(rid).result(timeout=30)
        assert needle.lower() in str(info.value).lower(), (rid, str(info.value))
    dead = r.xrange(keys.dead)
    reasons = {e[1].get(b"field:id", b"").decode(): e[1][b"reason"].decode() for e in dead}
    for fields, needle in BAD_ENTRIES:
        assert needle.lower() in reasons[fields["id"]].lower()
    assert len(dead) == len(BAD_ENTRIES) + 1
    assert all(p.poll() is None for p in cluster.procs.values()), "no worker may exit"
    wait_pools_free(cluster)


@pytest.mark.slow
def test_smollm2_pipeline_matches_colocated_engine(redis_url, tmp_path):
    """The real model through 1 prefill + 1 decode: greedy and seeded, token for token."""
    loaded = load_model("smollm2")
    c = Cluster(redis_url, tmp_path, model="smollm2")
    try:
        c.start("prefill", "--kv-cache-mb", "64", worker_id="prefill-s")
        c.start("decode", "--kv-cache-mb", "64", worker_id="decode-s")
        prompts = ["The capital of France is", "Write a haiku about the sea.",
                   "1, 2, 3, 4, 5,", "Explain what a KV cache is in one sentence."]
        params = [{"max_tokens": 10, "temperature": 0.0, "seed": 0}] * 2 + \
                 [{"max_tokens": 10, "temperature": 0.7, "top_p": 0.9, "seed": 7 + i} for i in range(2)]
        ids = [loaded.tokenizer.encode(p) for p in prompts]
        engine = LLMEngine(loaded, EngineConfig(kv_cache_mb=64))
        sampling = [SamplingParams(max_tokens=p["max_tokens"], temperature=p["temperature"],
                                   top_p=p.get("top_p", 1.0), seed=p["seed"]) for p in params]
        expected = engine.generate(ids, sampling)
        client = Client(redis_url)
        handles = client.submit_many([dict(prompt=p, **kw) for p, kw in zip(prompts, params)])
        results = [h.result(timeout=120) for h in handles]
        for pid, exp, res, sp in zip(ids, expected, results, sampling):
            assert_same_tokens(loaded, pid, exp, list(res.token_ids), sp)
        assert "Paris" in results[0].text
        assert {r.transfer_path for r in results} == {"shm"}, {w: c.log(w)[-1500:] for w in c.procs}
        token_bytes = 30 * 2 * 3 * 64 * 4  # layers x (K, V) x kv heads x head dim x fp32
        for r, i in zip(results, ids):  # whole blocks of 16 tokens move
            assert r.transfer_bytes == -(-len(i) // 16) * 16 * token_bytes
        wait_pools_free(c)
    finally:
        codes = c.stop_all()
    assert all(code == 0 for code in codes.values())
    assert not c.segments()


def test_timing_breakdown_adds_up(cluster):
    """queue + prefill + handoff + transfer + first decode step ~= time to the second token."""
    cluster.start_together(("prefill", {"worker_id": "prefill-t"}), ("decode", {"worker_id": "decode-t"}))
    client = Client(cluster.redis_url)
    for i in range(6):
        c = client.submit(f"timing {i} " * (i * 10 + 1), max_tokens=4, temperature=0).result(timeout=60)
        parts = c.queue_ms + c.prefill_ms + c.handoff_ms + c.transfer_ms + c.first_step_ms
        assert c.ttst_ms > 0 and c.transfer_ms > 0 and c.transfer_bytes > 0
        assert min(c.queue_ms, c.prefill_ms, c.handoff_ms, c.first_step_ms) >= 0, c
        assert abs(parts - c.ttst_ms) <= 5.0, (parts, c)   # the stages share their clock reads
        assert c.ttft_ms <= c.ttst_ms <= c.e2e_ms
