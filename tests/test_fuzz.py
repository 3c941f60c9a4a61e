"""Fuzzing the workers' inputs: thousands of random entries into ``requests`` and the
handoff stream. No worker exits; every bad entry ends on ``dead`` with a reason; good
requests sent in between all complete.

Each test fuzzes its own fresh cluster and checks its own outcome: hypothesis drives an
inner function that only sends, then the test checks what came of everything it sent.
"""

from __future__ import annotations

import collections

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdqueue.client import Client
from pdqueue.keys import DECODE_GROUP, PREFILL_GROUP
from pdqueue.protocol import REQUEST_FIELDS
from pdqueue.queue.streams import request_streams
from tests.cluster import Cluster
from tests.helpers import wait_for

names = st.one_of(st.sampled_from(REQUEST_FIELDS), st.binary(min_size=1, max_size=12))
values = st.one_of(st.binary(max_size=40), st.text(max_size=40).map(str.encode),
                   st.integers(-2**70, 2**70).map(lambda i: str(i).encode()),
                   st.sampled_from([b"", b"-1", b"0", b"nan", b"[1,2", b"[]", b"[-5]", b"1e999", b"high", b"\xff"]))
entries = st.dictionaries(names, values, min_size=1, max_size=6)
handoff_bodies = st.one_of(
    entries,
    st.builds(lambda body: {b"id": b"h", b"data": msgpack.packb(body)},
              st.dictionaries(st.sampled_from(["version", "request", "prompt_ids", "output_ids", "seed", "ticket",
                                               "prefill_worker", "attempt"]),
                              st.one_of(st.integers(-3, 2**40), st.text(max_size=5), st.none(),
                                        st.lists(st.integers(0, 2**20), max_size=5),
                                        st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=3)),
                              max_size=8)),
)
FUZZ = settings(deadline=None, suppress_health_check=list(HealthCheck), database=None)


@pytest.fixture
def fuzz_cluster(redis_url, tmp_path):
    """One prefill and one decode worker on an empty Redis; both must exit 0 at the end."""
    c = Cluster(redis_url, tmp_path)
    try:
        c.start("prefill", worker_id="fp")
        c.start("decode", worker_id="fd")
        yield c
    finally:
        codes = c.stop_all()
    assert all(code == 0 for code in codes.values()), {w: c.log(w) for w in codes}


def good_request(i: int) -> tuple[str, dict]:
    rid = f"good-{i}"
    return rid, {"id": rid, "prompt": "still fine", "max_tokens": "3", "temperature": "0"}


def check_survived(cluster: Cluster, good: list[str]) -> list[tuple[str, dict]]:
    """Every good request completed, no entry is left in (or pending on) any input stream,
    no worker exited. Returns the dead-letter records."""
    assert all(p.poll() is None for p in cluster.procs.values()), \
        {w: cluster.log(w) for w, p in cluster.procs.items() if p.poll() is not None}
    client = Client(cluster.redis_url)
    for rid in good:
        assert client.handle(rid).result(timeout=120).num_tokens == 3
    r, keys = cluster.r, cluster.keys
    inputs = [(s, PREFILL_GROUP) for s in request_streams(keys)]
    inputs += [(s, DECODE_GROUP) for s in keys.handoff_streams(cluster.workers()["fd"]["node"])]

    def left() -> dict:
        """What is still in, or pending on, each input stream (acked entries are deleted)."""
        out = {}
        for stream, group in inputs:
            if r.exists(stream):
                n, pending = r.xlen(stream), r.xpending(stream, group)["pending"]
                if n or pending:
                    out[stream] = (n, pending)
        return out

    wait_for(lambda: not left(), timeout=60, what="every input entry answered and acknowledged")
    assert all(p.poll() is None for p in cluster.procs.values()), "a worker exited"
    return [(eid.decode(), f) for eid, f in r.xrange(keys.dead, count=100000)]


def test_fuzz_requests(fuzz_cluster):
    """Random request entries (a good one after each batch): each answered exactly once
    on out:<id>, with a done, or an error and exactly one dead-letter copy."""
    r, keys = fuzz_cluster.r, fuzz_cluster.keys
    fuzzed: dict[str, str] = {}  # request id -> its entry id on ``requests``
    good: list[str] = []

    @settings(FUZZ, max_examples=400)
    @given(batch=st.lists(entries, min_size=3, max_size=20))
    def send(batch):
        rids = [f"fuzz-{len(fuzzed) + i}" for i in range(len(batch))]
        rid, fields = good_request(len(good))
        with r.pipeline(transaction=False) as pipe:
            for request_id, entry in zip(rids, batch):
                entry = {k: v for k, v in entry.items() if k not in ("id", b"id")}
                pipe.xadd(keys.requests, {**entry, "id": request_id})
            pipe.xadd(keys.requests, fields)
            entry_ids = pipe.execute()
        fuzzed.update(zip(rids, (e.decode() for e in entry_ids)))
        good.append(rid)

    send()
    assert len(fuzzed) > 1000
    dead = check_survived(fuzz_cluster, good)
    assert all(f[b"reason"] and f[b"source"] == keys.requests.encode() for _, f in dead), \
        [f for _, f in dead if not f[b"reason"] or f[b"source"] != keys.requests.encode()][:3]
    dead_per_entry = collections.Counter(f[b"entry_id"].decode() for _, f in dead)
    answers = {"done": 0, "error": 0}
    for rid, entry_id in fuzzed.items():
        finals = [f[b"type"].decode() for _, f in r.xrange(keys.out(rid)) if f[b"type"] in (b"done", b"error")]
        assert len(finals) == 1, f"{rid} answered {len(finals)} times: {finals}"
        answers[finals[0]] += 1
        # An error answer comes with its dead-letter copy, a completion with none.
        assert dead_per_entry[entry_id] == int(finals[0] == "error"), (rid, finals, dead_per_entry[entry_id])
    assert sum(dead_per_entry.values()) == answers["error"], "dead-letter records of entries not sent here"
    print(f"\nfuzz: {len(fuzzed)} random requests ({answers['done']} done, {answers['error']} errors, "
          f"all dead-lettered), {len(good)} good requests")


def test_fuzz_handoffs(fuzz_cluster):
    """Random handoff entries (a good request after each batch): each dead-lettered
    exactly once, with a reason."""
    r, keys = fuzz_cluster.r, fuzz_cluster.keys
    sent: list[str] = []  # entry ids on ``handoff``
    good: list[str] = []

    @settings(FUZZ, max_examples=60)
    @given(batch=st.lists(handoff_bodies, min_size=5, max_size=20))
    def send(batch):
        rid, fields = good_request(len(good))
        with r.pipeline(transaction=False) as pipe:
            for entry in batch:
                pipe.xadd(keys.handoff, entry)
            pipe.xadd(keys.requests, fields)
            entry_ids = pipe.execute()
        sent.extend(e.decode() for e in entry_ids[:-1])
        good.append(rid)

    send()
    assert len(sent) > 200
    dead = check_survived(fuzz_cluster, good)
    assert all(f[b"reason"] for _, f in dead)
    from_handoff = collections.Counter(f[b"entry_id"].decode() for _, f in dead
                                       if f[b"source"] == keys.handoff.encode())
    assert from_handoff == collections.Counter(sent), (
        f"{sum(from_handoff.values())} dead-letter records for {len(sent)} fuzzed handoffs; not once: "
        f"{[e for e in sent if from_handoff[e] != 1][:5]}")
    assert len(dead) == len(sent), "dead-letter records of other entries (the good requests?)"
    print(f"\nfuzz: {len(sent)} random handoffs, all dead-lettered once; {len(good)} good requests")
