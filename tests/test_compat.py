"""The compatibility handshake (pdqueue/protocol/compat.py, workers/compat.py): workers of two
kinds (another KV format, model or wire version) exchange no KV, route around each other, say
so once, and every answer is still right.

The record and the handoff's fields in this process; who is a peer (room, placement,
migration, prefix routing, ``pdqueue status``) on heartbeats written to a real Redis; and two
builds that differ in the KV format (``--dtype bfloat16``: the KV cache's dtype) as real worker
processes: a prefill worker of a kind no decode worker serves waits and says so once, a
handoff of that kind on the shared stream is passed on, never run; then with both kinds'
decode workers up, every answer is the colocated engine's of its own kind, token for token,
and no request's prefill and decode workers are of two kinds.
"""

from __future__ import annotations

import collections
import logging
import re

import msgpack

from pdqueue.client import Client
from pdqueue.keys import Keys
from pdqueue.protocol import Handoff, Request, decode_handoff, encode_handoff
from pdqueue.protocol.compat import COMPAT_FIELD, Compat, compat_of, entry_compat
from pdqueue.queue.registry import Heartbeat, list_workers
from pdqueue.transfer.base import TRANSFER_VERSION
from tests.helpers import FAST, mixed_prompts, wait_for, wait_pools_free
from tests.oracle import assert_same_tokens
from workers.compat import Rerouter, handoff_stream, own_compat, split
from workers.decode_peers import DecodePeers
from workers.migration import target_stream
from workers.placement import Placement

A = Compat("a" * 16, TRANSFER_VERSION, kv_format="float32, block 16, 2 layers x 2 KV heads x 16")
B = Compat("b" * 16, TRANSFER_VERSION, kv_format="bfloat16, block 16, 2 layers x 2 KV heads x 16")


# ---- the record and the handoff ------------------------------------------------------------------

def test_a_record_round_trips_and_an_absent_one_is_compatible_with_every_kind():
    assert Compat.from_record(A.record()) == A
    assert compat_of({"compat": B.record()}) == B
    assert compat_of({}) is None and compat_of({"compat": {}}) is None and compat_of({"compat": "x"}) is None
    assert A.accepts(A) and A.accepts(None) and not A.accepts(B)
    newer_wire = Compat(A.kv_identity, TRANSFER_VERSION + 1, kv_format=A.kv_format)
    assert not A.accepts(newer_wire) and newer_wire.key != A.key
    assert "KV format bfloat16" in A.differs(B) and "transfer wire version" in A.differs(newer_wire)


def test_the_record_is_the_engines_kind(tiny):
    """Every role computes the same record from its engine as the shell from its config; the
    KV dtype and the block size change it, the weights' format does not (the same KV)."""
    from pdqueue.engine.config import EngineConfig
    from pdqueue.engine.llm_engine import LLMEngine
    from workers.compat import engine_compat

    config = EngineConfig(model="tiny", kv_cache_mb=4)
    mine = own_compat(tiny, config)
    assert engine_compat(LLMEngine(tiny, config)) == mine
    assert mine.kv_format.startswith("float32, block 16") and mine.transfer == TRANSFER_VERSION
    assert own_compat(tiny, EngineConfig(model="tiny", kv_cache_mb=4, dtype="bfloat16")).key != mine.key
    assert own_compat(tiny, EngineConfig(model="tiny", kv_cache_mb=4, block_size=8)).key != mine.key
    assert own_compat(tiny, EngineConfig(model="tiny", kv_cache_mb=4, num_blocks=7)) == mine


def handoff(**overrides) -> Handoff:
    values = dict(request=Request(id="r1", prompt="hi"), prompt_ids=[1, 2, 3], output_ids=[], seed=5, ticket=None,
                  prefill_worker="p0", kv_identity=A.kv_identity, model="tiny", transfer_version=TRANSFER_VERSION)
    values.update(overrides)
    return Handoff(**values)


def test_a_handoff_carries_its_senders_key_beside_its_data():
    fields = encode_handoff(handoff())
    assert entry_compat(fields) == A.key and decode_handoff(fields).compat == A.key
    assert decode_handoff(fields).transfer_version == TRANSFER_VERSION
    # an older sender's handoff: no key, no wire version; it decodes as before
    old = encode_handoff(handoff(kv_identity="", transfer_version=0))
    assert COMPAT_FIELD not in old and decode_handoff(old).transfer_version == 0
    body = msgpack.unpackb(old["data"])
    del body["transfer_version"]
    assert decode_handoff({"data": msgpack.packb(body)}).transfer_version == 0


def test_a_decode_worker_passes_on_what_is_not_of_its_kind_and_says_so_once(r, caplog):
    keys = Keys("compat")
    rerouter = Rerouter(r, keys, A)
    assert rerouter.target(encode_handoff(handoff())) is None   # its own kind
    assert rerouter.target(encode_handoff(handoff(kv_identity="", transfer_version=0))) is None   # older: as before
    assert rerouter.target(None) is None
    with caplog.at_level(logging.WARNING, logger="pdqueue.compat"):
        for _ in range(3):
            assert rerouter.target(encode_handoff(handoff(kv_identity=B.kv_identity))) == keys.handoff_compat(B.key)
        # an older sender of another KV identity: the key it would have
        older = encode_handoff(handoff(kv_identity=B.kv_identity, transfer_version=0))
        assert rerouter.target(older) == keys.handoff_compat(B.key)
        # a handoff of another version that this worker cannot decode: its key says where
        unreadable = {b"id": b"r2", b"data": msgpack.packb({"version": 99}), COMPAT_FIELD.encode(): b"c.2.7"}
        assert rerouter.target(unreadable) == keys.handoff_compat("c.2.7")
    assert rerouter.rerouted == 5
    lines = [rec.getMessage() for rec in caplog.records]
    assert len(lines) == 2 and "handoffs of p0 are not compatible" in lines[0], lines   # p0 once; the unreadable one
    assert "model, weights or KV layout" in lines[0]


# ---- who is a peer, on heartbeats in Redis ---------------------------------------------------------

def beat(r, keys, worker_id: str, role: str, compat: Compat | None, node: str = "n1", **load) -> Heartbeat:
    hb = Heartbeat(r, keys, worker_id, role=role, node=node, load=load)
    if compat is not None:
        hb.update(compat=compat.record())
    hb.beat()
    return hb


def test_the_handoff_stream_is_the_shared_one_until_a_decode_worker_of_another_kind_lives(r):
    keys = Keys("compat")
    beat(r, keys, "da", "decode", A)
    peers = DecodePeers(r, keys, every_s=0, mine=A)
    assert peers.stream("n1", "auto") == keys.handoff_node("n1")   # as before the handshake
    assert peers.stream("n2", "auto") == keys.handoff and peers.compat_stream() is None
    assert peers.load() == {"incompatible_decode": 0, "no_compatible_decode": 0}
    beat(r, keys, "db", "decode", B)
    assert peers.stream("n1", "auto") == keys.handoff_compat(A.key) == peers.compat_stream()
    assert [w["worker_id"] for w in peers.workers] == ["da"] and peers.load()["incompatible_decode"] == 1
    # only db: nobody takes A's handoffs, which wait in A's stream; room says "no decode worker"
    r.delete(keys.worker("da"))
    assert peers.stream("n1", "auto") == keys.handoff_compat(A.key)
    assert peers.room() is None and peers.load()["no_compatible_decode"] == 1
    # an older decode worker (no record) is compatible as before, and reads the shared streams only
    beat(r, keys, "old", "decode", None, free_slots=1, kv_free=10)
    assert peers.stream("n1", "auto") == keys.handoff_node("n1") and peers.room() is True
    # without a record of its own (an older prefill worker's view) every decode worker counts
    older_view = DecodePeers(r, keys, every_s=0)
    older_view.refresh()
    assert len(older_view.workers) == 2 and older_view.load() == {}


def test_placement_never_places_on_a_decode_worker_of_another_kind(r):
    keys = Keys("compat")
    takes = dict(takes_prompts=1, prompt_tok_s=10_000, prompt_backlog=0, free_slots=8)
    beat(r, keys, "db", "decode", B, **takes)   # the one with room: of another kind
    placer = Placement(r, keys, "pa", mode="always", peers=DecodePeers(r, keys, every_s=0, mine=A))
    assert placer.place(None, 10) is None
    beat(r, keys, "da", "decode", A, **{**takes, "prompt_tok_s": 1})
    assert placer.place(None, 10) == keys.handoff_compat(A.key)   # da's kind's stream, not the node's db reads
    assert list(placer.peers) == ["da"]


def test_migration_moves_running_decodes_to_a_compatible_decode_worker_only(r):
    keys = Keys("compat")
    beat(r, keys, "me", "decode", A)
    beat(r, keys, "db", "decode", B)
    workers = list_workers(r, keys)
    stream, other = target_stream(keys, A, "me", "n1", "auto", workers)
    assert stream is None and [w["worker_id"] for w in other] == ["db"]   # finish here rather
    beat(r, keys, "da", "decode", A)
    stream, _ = target_stream(keys, A, "me", "n1", "auto", list_workers(r, keys))
    assert stream == keys.handoff_compat(A.key)
    r.delete(keys.worker("db"))   # one kind again: the node's stream, as before
    assert target_stream(keys, A, "me", "n1", "auto", list_workers(r, keys))[0] == keys.handoff_node("n1")


def test_prefix_routing_forwards_to_a_peer_of_its_own_kind_only(r, tiny):
    from pdqueue.engine.config import EngineConfig
    from pdqueue.engine.llm_engine import LLMEngine
    from workers.routing import Router

    class Role:   # what the router reads of its role: the engine
        engine = LLMEngine(tiny, EngineConfig(model="tiny", kv_cache_mb=4))

    keys = Keys("compat")
    mine = own_compat(tiny, Role.engine.config)
    router = Router(r, keys, "pa", Role())
    assert router.compatible({"compat": mine.record()}) and router.compatible({})
    assert not router.compatible({"compat": B.record()})


def test_status_shows_the_kinds_and_a_prefill_worker_nobody_serves(r):
    from rich.console import Console

    from workers.cli.status_view import collect, render

    keys = Keys("compat")
    beat(r, keys, "da", "decode", A)
    beat(r, keys, "pb", "prefill", B, incompatible_decode=1, no_compatible_decode=1)
    snapshot = collect(r, keys)
    assert {w["worker_id"]: w["compat"]["kv"] for w in snapshot["workers"]} == {"da": A.kv_identity,
                                                                              "pb": B.kv_identity}
    console = Console(width=200, record=True)
    console.print(render(snapshot))
    text = console.export_text()
    assert "mixed versions" in text and "bfloat16, block 16" in text
    assert "pb: no live decode worker is compatible with it" in text


def test_a_split_keeps_the_order_and_the_older_workers():
    workers = [{"worker_id": "a", "compat": A.record()}, {"worker_id": "b", "compat": B.record()},
               {"worker_id": "old"}]
    compatible, other = split(workers, A)
    assert [w["worker_id"] for w in compatible] == ["a", "old"] and [w["worker_id"] for w in other] == ["b"]
    keys = Keys("compat")
    assert handoff_stream(keys, A, "n1", "tcp", compatible, other) == keys.handoff_compat(A.key)
    assert handoff_stream(keys, A, "n1", "tcp", compatible[1:], other) == keys.handoff   # older ones only
    assert handoff_stream(keys, A, "n1", "tcp", compatible, []) == keys.handoff   # tcp: no node stream


# ---- two builds that differ in the KV format, as real workers -----------------------------------------

BF16 = ("--dtype", "bfloat16")
MAX_TOKENS = 16


def reference(dtype: str, prompts: list[str]):
    """The colocated engine of that build: (loaded, prompt ids, greedy outputs)."""
    import torch

    from pdqueue.engine.config import EngineConfig
    from pdqueue.engine.llm_engine import LLMEngine
    from pdqueue.engine.sampling import SamplingParams
    from pdqueue.models.loader import load_model

    loaded = load_model("tiny", dtype=getattr(torch, dtype))
    ids = [loaded.tokenizer.encode(p) for p in prompts]
    sp = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True) for _ in prompts]
    return loaded, ids, LLMEngine(loaded, EngineConfig(model="tiny", kv_cache_mb=16, dtype=dtype)).generate(ids, sp)


def said(cluster, name: str, pattern: str) -> int:
    return len(re.findall(pattern, (cluster.log_dir / f"{name}.log").read_text(errors="replace")))


def check(cluster, results, refs) -> None:
    """Each answer (of the prompts in order) is its prefill worker's build's, and its decode
    worker is of that build."""
    kind = {cluster.id(n): k for n, k in (("pa", "a"), ("da", "a"), ("pb", "b"), ("db", "b"))}
    for i, res in enumerate(results):
        assert kind[res.prefill_worker] == kind[res.decode_worker], res   # never across kinds
        loaded, ids, outputs = refs[kind[res.prefill_worker]]
        assert_same_tokens(loaded, ids[i], outputs[i], list(res.token_ids), label=f"{res.request_id} {res}")


def test_two_kv_formats_exchange_no_kv_and_every_answer_is_right(cluster):
    prompts = mixed_prompts(10, seed=7)
    refs = {"a": reference("float32", prompts), "b": reference("bfloat16", prompts)}
    assert refs["a"][2] != refs["b"][2]   # the two builds do answer differently: a mix-up would show
    cluster.start_together(("prefill", *FAST, {"worker_id": "pa"}), ("decode", *FAST, {"worker_id": "da"}),
                           ("prefill", *FAST, *BF16, {"worker_id": "pb"}))
    workers = cluster.workers()
    b_kind = compat_of(workers["pb"])
    assert b_kind.kv_format.startswith("bfloat16") and compat_of(workers["da"]).kv_format.startswith("float32")
    wait_for(lambda: cluster.workers()["pb"]["load"].get("no_compatible_decode") == 1, what="pb: nobody serves it")
    client = Client(cluster.redis_url, cluster.cluster)
    first = client.submit_many([dict(prompt=p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
                                for p in prompts])
    # A handoff of pb's kind on the shared stream (what a sender with a stale view writes): da,
    # the only decode worker, passes it on to pb's kind's stream and runs none of it.
    placed = Handoff(request=Request(id="placed-b", prompt=prompts[0], max_tokens=MAX_TOKENS, temperature=0.0,
                                     ignore_eos=True),
                     prompt_ids=refs["b"][1][0], output_ids=[], seed=1, ticket=None, prefill_worker="stale-sender",
                     kv_identity=b_kind.kv_identity, model="tiny", transfer_version=b_kind.transfer)
    cluster.r.xadd(cluster.keys.handoff, encode_handoff(placed))
    wait_for(lambda: cluster.workers()["da"]["load"].get("rerouted") == 1, what="da passing it on")
    assert cluster.r.xlen(cluster.keys.handoff_compat(b_kind.key)) >= 1
    # The requests pa took are answered; those pb took wait for a decode worker of its kind.
    cluster.start("decode", *FAST, *BF16, worker_id="db")
    results = [h.result(timeout=120) for h in first]
    check(cluster, results, refs)
    assert {res.prefill_worker for res in results} <= {cluster.id("pa"), cluster.id("pb")}
    late = client.handle("placed-b").result(timeout=60)
    assert late.decode_worker == cluster.id("db")
    assert_same_tokens(refs["b"][0], refs["b"][1][0], refs["b"][2][0], list(late.token_ids))
    # Both kinds serving: all of it again, each kind's KV moving within its kind only.
    again = client.submit_many([dict(prompt=p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
                                for p in prompts])
    results = [h.result(timeout=120) for h in again]
    check(cluster, results, refs)
    assert {res.transfer_path for res in results} <= {"shm", "cache"}, [res.transfer_path for res in results]
    done = collections.Counter(f[b"id"].decode() for _, f in cluster.r.xrange(cluster.keys.done))
    assert all(done[h.request_id] == 1 for h in first + again) and done["placed-b"] == 1
    # Said once: each prefill worker of the decode worker of the other kind, pb of having none,
    # da of the stale sender; whatever the number of requests.
    assert said(cluster, "pa", rf"decode worker {cluster.id('db')} is not compatible") == 1
    assert said(cluster, "pb", rf"decode worker {cluster.id('da')} is not compatible") == 1
    assert said(cluster, "pb", "no live decode worker is compatible") == 1
    assert said(cluster, "da", "handoffs of stale-sender are not compatible") == 1
    for name in ("da", "db"):
        senders = re.findall(r"handoffs of (\S+) are not compatible", cluster.log(name))
        assert len(senders) == len(set(senders)), (name, senders)
    # ... and the heartbeats show it (a beat or two later)
    wait_for(lambda: (cluster.workers()["pa"]["load"].get("incompatible_decode"),
                      cluster.workers()["pb"]["load"].get("no_compatible_decode")) == (1, 0), what="the loads")
    wait_pools_free(cluster)
