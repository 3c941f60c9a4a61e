"""KV that outlives the pool (pdqueue/engine/kv_tiers.py under block_manager.py).

What must hold:
- the stores alone: the host tier is LRU and bounded in bytes, never evicts a leased entry,
  and overflows into the disk tier; the disk tier round-trips a payload, leaves no
  temporary file, is bounded (oldest first), is read again by a new store on the same
  directory (a restart), keeps roots apart, and takes a short or corrupt file for a miss;
- on the real tiny model: a conversation's second turn (the first turn's prompt and answer,
  then more) after the pool evicted the first turn gets the same greedy tokens with the tiers
  as without any cache, and reports the tokens the tier served as cached; an engine started
  anew on the same disk directory serves them from disk; an engine of another block size or
  dtype never does; a decode engine (``reserve``) takes tier blocks as hits;
- real worker processes (tiny model, real Redis): colocated, the second turn after the pool
  evicted the first is served from the host tier, and after a restart from the disk tier up
  to a file cut short; prefill + decode (shm and TCP) restarted on a shared disk directory:
  the history is cached at the prefill worker and held by the decode worker; cache-aware
  routing sends the next turn to the colocated worker whose tier holds its history.

One torch thread (a fixture), as in tests/test_engine.py.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from pdqueue.engine.config import EngineConfig
from pdqueue.engine.kv_tiers import _HEADER, DiskTier, HostTier, KVTiers, attach
from pdqueue.engine.llm_engine import LLMEngine
from pdqueue.engine.sampling import SamplingParams
from pdqueue.models.loader import load_model
from tests.helpers import wait_for

BS = 16
SHAPE = (2, 2, 4, 1, 2)   # layers, K/V, block size, KV heads, head dim


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here runs torch on one thread."""


def payload(i: int) -> torch.Tensor:
    return torch.full(SHAPE, float(i))


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def nbytes(n: int) -> int:
    return n * payload(0).numel() * 4


def files(n: int) -> int:
    """Disk bytes of ``n`` entries (header and payload)."""
    return n * (_HEADER.size + nbytes(1))


# --- the stores alone ---------------------------------------------------------------------

def test_host_tier_is_lru_bounded_and_never_evicts_a_leased_entry():
    spilled = []
    tier = HostTier(nbytes(3), overflow=lambda k, p: spilled.append(k))
    for i in range(3):
        tier.put(h(i), payload(i))
    assert tier.get(h(0)) is not None            # 0 is now the most recently used
    tier.put(h(3), payload(3))                   # evicts 1, the least recently used
    assert h(1) not in tier and spilled == [h(1)] and tier.nbytes == nbytes(3)
    with tier.lease([h(2)]):
        tier.put(h(4), payload(4))               # 2 is held: 0 goes instead
        assert h(2) in tier and h(0) not in tier
        tier.put(h(5), payload(5))
        assert h(2) in tier and len(tier) == 3
    assert torch.equal(tier.get(h(2)), payload(2))
    assert spilled == [h(1), h(0), h(3)]


def test_disk_tier_round_trips_bounds_restarts_and_keeps_roots_apart(tmp_path):
    disk = DiskTier(tmp_path, b"root-a", files(3), SHAPE, "float32")
    for i in range(4):
        disk.put(h(i), payload(i))
    assert not list(disk.dir.glob("*.tmp"))
    assert h(0) not in disk and len(disk) == 3    # bounded: the oldest went
    assert torch.equal(disk.get(h(2)), payload(2))
    stray = disk.dir / (h(9).hex() + ".4242.tmp")   # a write cut short by a kill
    stray.write_bytes(b"partial")
    again = DiskTier(tmp_path, b"root-a", files(3), SHAPE, "float32")   # a restart
    assert len(again) == 3 and torch.equal(again.get(h(3)), payload(3))
    assert not stray.exists() and h(9) not in again
    other = DiskTier(tmp_path, b"root-b", files(3), SHAPE, "float32")
    assert len(other) == 0 and other.get(h(3)) is None


def test_a_short_or_corrupt_disk_file_is_a_miss(tmp_path):
    disk = DiskTier(tmp_path, b"root", files(8), SHAPE, "float32")
    for i in range(3):
        disk.put(h(i), payload(i))
    short = disk.path(h(0))
    short.write_bytes(short.read_bytes()[:-7])
    flipped = disk.path(h(1))
    data = bytearray(flipped.read_bytes())
    data[-1] ^= 0xFF
    flipped.write_bytes(bytes(data))
    assert disk.get(h(0)) is None and disk.get(h(1)) is None and disk.corrupt == 2
    assert not short.exists() and not flipped.exists()   # removed: the next write can replace them
    assert torch.equal(disk.get(h(2)), payload(2))
    wrong_shape = DiskTier(tmp_path, b"root", files(8), (2, 2, 8, 1, 2), "float32")
    assert wrong_shape.get(h(2)) is None


def test_the_host_tier_overflows_to_disk_and_fetch_promotes(tmp_path):
    pool = torch.zeros(2, 2, 8, 4, 1, 2)
    tiers = KVTiers(host_bytes=nbytes(2), disk_dir=tmp_path, disk_bytes=2**20)
    tiers.bind(pool, b"root")
    for i in range(4):
        pool[:, :, i] = float(i)
        tiers.spill(h(i), i)
    assert len(tiers.host) == 2 and len(tiers.disk) == 2
    got = tiers.fetch([h(0), h(1), h(2), h(9), h(3)])
    assert [float(p.flatten()[0]) for p in got] == [0.0, 1.0, 2.0]   # the run ends at the first miss
    tiers.load(7, got[1])
    assert torch.equal(pool[:, :, 7], pool[:, :, 1])


# --- on the tiny model ----------------------------------------------------------------------

def make_engine(loaded, tiers: KVTiers | None = None, caching: bool = True, **overrides) -> LLMEngine:
    fields = dict(model=loaded.config.name, block_size=BS, num_blocks=24, prefix_caching=caching)
    fields.update(overrides)
    eng = LLMEngine(loaded, EngineConfig(**fields))
    attach(tiers, eng)
    return eng


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0)


def one(eng: LLMEngine, prompt: list[int], n: int) -> tuple[list[int], int]:
    """The output tokens and cached prompt tokens of one request."""
    cached = []
    out = eng.generate([prompt], greedy(n), on_output=lambda o: cached.append(o.cached_tokens))[0]
    return out, cached[-1]


def conversation(seed: int = 1) -> tuple[list[int], list[int], list[list[int]]]:
    rng = random.Random(seed)
    turn1 = [rng.randrange(0, 256) for _ in range(5 * BS + 3)]
    more = [rng.randrange(0, 256) for _ in range(BS + 5)]
    others = [[rng.randrange(0, 256) for _ in range(10 * BS)] for _ in range(3)]
    return turn1, more, others


def evict_all(eng: LLMEngine, others: list[list[int]]) -> None:
    """Unrelated requests that need every block of the pool."""
    for p in others:
        eng.generate([p], greedy(2))


def test_a_second_turn_after_eviction_is_served_by_the_host_tier(tiny):
    turn1, more, others = conversation()
    plain = make_engine(tiny, caching=False)
    out1, _ = one(plain, turn1, 2 * BS)
    turn2 = turn1 + out1 + more
    expected, _ = one(plain, turn2, 8)

    tiers = KVTiers(host_bytes=64 * 2**20)
    eng = make_engine(tiny, tiers)
    assert one(eng, turn1, 2 * BS)[0] == out1
    evict_all(eng, others)
    assert eng.block_manager.num_cached_leading(eng.block_manager.block_hashes(
        eng.add_request("probe", turn2, greedy(1)), 3)) == 3   # routing sees the tier's blocks
    eng.abort("probe")
    assert eng.block_manager.tier_hits == 0
    got, cached = one(eng, turn2, 8)
    assert got == expected
    # The first turn's prompt and the answer's full blocks but the last token's came back.
    assert cached == (len(turn1) + len(out1) - 1) // BS * BS, (cached, len(turn1), len(out1))
    assert eng.block_manager.tier_hits >= cached - 0 and tiers.loaded >= cached // BS

    bounded = KVTiers(host_bytes=2 * tiny_block_bytes(eng))   # a full tier: only 2 blocks kept
    small = make_engine(tiny, bounded)
    one(small, turn1, 2 * BS)
    evict_all(small, others)
    assert len(bounded.host) == 2 and bounded.host.evicted > 0
    got, cached = one(small, turn2, 8)
    assert got == expected and cached == 0   # the chain's head was evicted: recomputed


def tiny_block_bytes(eng: LLMEngine) -> int:
    return eng.layout.num_layers * 2 * eng.layout.block_nbytes


def test_the_disk_tier_serves_a_new_engine_and_never_another_layout(tiny, tmp_path):
    turn1, more, others = conversation(seed=2)
    plain = make_engine(tiny, caching=False)
    out1, _ = one(plain, turn1, BS)
    turn2 = turn1 + out1 + more
    expected, _ = one(plain, turn2, 6)

    first = KVTiers(host_bytes=2**20, disk_dir=tmp_path, disk_bytes=2**30)
    eng = make_engine(tiny, first)
    one(eng, turn1, BS)
    assert first.flush(eng.block_manager.named_blocks()) > 0   # a clean stop

    restarted = KVTiers(disk_dir=tmp_path, disk_bytes=2**30)
    eng = make_engine(tiny, restarted)
    got, cached = one(eng, turn2, 6)
    assert got == expected and cached == (len(turn1) + len(out1) - 1) // BS * BS
    assert restarted.loaded == cached // BS

    # Another block size, other weights under the same name, another dtype: never matched.
    bf16 = load_model("tiny", dtype=torch.bfloat16)
    for loaded, other in ((tiny, dict(block_size=8)), (dataclasses.replace(tiny, fingerprint="retrained"), {}),
                          (bf16, dict(dtype="bfloat16"))):
        tiers = KVTiers(disk_dir=tmp_path, disk_bytes=2**30)
        eng = make_engine(loaded, tiers, **other)
        assert one(eng, turn2, 6)[1] == 0 and tiers.loaded == 0, other
    assert len(list(tmp_path.iterdir())) == 4   # a directory per prefix root


def test_a_decode_engine_takes_tier_blocks_as_hits(tiny):
    turn1, _, others = conversation(seed=3)
    tiers = KVTiers(host_bytes=64 * 2**20)
    eng = make_engine(tiny, tiers)
    one(eng, turn1, 2)
    evict_all(eng, others)
    bm = eng.block_manager
    hashes = list(bm.block_hashes(eng.add_request("probe", turn1, greedy(1)), len(turn1) // BS))
    eng.abort("probe")
    seq = eng.kv_import.reserve("d1", turn1, greedy(4), [7], block_hashes=hashes, hash_root=bm.root)
    assert seq.num_cached_tokens == len(hashes) * BS and tiers.loaded == len(hashes)
    for i, block in enumerate(seq.block_table[:len(hashes)]):
        assert bm.is_cached(block) and bm.ref_count(block) == 1, i
    eng.kv_import.unreserve(seq)


# --- real worker processes ---------------------------------------------------------------------

TURN1 = [random.Random(7).randrange(0, 256) for _ in range(9 * BS + 5)]
MORE = [random.Random(8).randrange(0, 256) for _ in range(BS + 3)]
FILLERS = [[random.Random(s).randrange(0, 256) for _ in range(50 * BS)] for s in (11, 12, 13)]


def turns(tiny) -> tuple[list[int], list[int], list[int]]:
    """The first turn's answer, the second turn's prompt (first prompt + answer + more) and
    its answer, by the colocated engine without any cache."""
    plain = make_engine(tiny, caching=False, num_blocks=256)
    out1 = plain.generate([TURN1], SamplingParams(max_tokens=2 * BS, temperature=0, ignore_eos=True))[0]
    turn2 = TURN1 + out1 + MORE
    out2 = plain.generate([turn2], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    return out1, turn2, out2


def worker_root(tiny) -> bytes:
    """The prefix root of the test cluster's workers (tests/cluster.py: tiny, default engine options)."""
    return LLMEngine(tiny, EngineConfig(model=tiny.config.name, num_blocks=8)).block_manager.root


def ask(client, prompt_ids: list[int], max_tokens: int):
    return client.submit(prompt_ids=prompt_ids, max_tokens=max_tokens, temperature=0.0, seed=0,
                         ignore_eos=True).result(timeout=60)


def test_a_colocated_worker_serves_the_next_turn_from_its_tiers_and_from_disk_after_a_restart(cluster, tiny, tmp_path):
    """A colocated worker with a 1 MiB pool (128 blocks) and both tiers: the first turn, then
    requests that take the whole pool (the first turn's blocks are evicted into the host
    tier), then the second turn: the no-cache answer, its history (the first prompt and
    answer) reported cached and loaded from the tier. Stopped (its blocks written to disk)
    and started again with one file of the chain cut short: the chain is served up to it."""
    import json

    from pdqueue.client import Client
    from pdqueue.engine.block_manager import chain_hashes

    out1, turn2, out2 = turns(tiny)
    history = (len(TURN1) + len(out1) - 1) // BS * BS
    disk = tmp_path / "kv"
    # (--kv-pull never: a finished request's blocks are not held for pullers, workers/kv_holds.py; a
    # held block is not evicted, and this is about blocks the pool evicts into the tiers)
    tier_args = ("--kv-cache-mb", "1", "--kv-host-tier-mb", "4", "--kv-disk-dir", str(disk), "--kv-disk-gb", "1",
                 "--kv-pull", "never")
    cluster.start("colocated", *tier_args, worker_id="c1")
    client = Client(cluster.redis_url, cluster.cluster)

    def load(name: str) -> dict:
        return json.loads(cluster.r.hget(cluster.keys.worker(cluster.id(name)), "load") or b"{}")

    assert list(ask(client, TURN1, 2 * BS).token_ids) == out1
    for filler in FILLERS:
        ask(client, filler, 1)
    second = ask(client, turn2, 8)
    assert list(second.token_ids) == out2
    assert second.cached_tokens == history
    wait_for(lambda: load("c1").get("kv_tier_loaded", 0) >= history // BS, 10, "the tier's counters")
    assert cluster.stop("c1") == 0

    root_dir = disk / worker_root(tiny).hex()
    hashes = chain_hashes(worker_root(tiny), turn2, BS)
    assert all((root_dir / h.hex()).exists() for h in hashes[:history // BS])
    cut = root_dir / hashes[4].hex()
    cut.write_bytes(cut.read_bytes()[:100])
    cluster.start("colocated", *tier_args, worker_id="c2")
    third = ask(client, turn2, 8)
    assert list(third.token_ids) == out2 and third.cached_tokens == 4 * BS
    wait_for(lambda: load("c2").get("kv_tier_loaded", 0) == 4, 10, "the tier's counters")


@pytest.mark.parametrize("transfer", ["auto", "tcp"])
def test_prefill_and_decode_workers_sharing_a_disk_tier_compute_only_the_new_tokens(cluster, tiny, tmp_path, transfer):
    """Prefill and decode workers sharing a --kv-disk-dir. The second turn: the prefill worker
    holds the first prompt, and reads the first answer's blocks the decode worker wrote at
    its finish, so the whole history is cached; the decode worker holds it too (only the
    rest travels). Then both restart (their pools' blocks written at the stop) and the
    third turn's history is served from disk alike. Every answer is the no-cache engine's."""
    from pdqueue.client import Client

    out1, turn2, out2 = turns(tiny)
    turn3 = turn2 + out2 + MORE
    plain = make_engine(tiny, caching=False, num_blocks=256)
    out3 = plain.generate([turn3], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    tier_args = ("--transfer", transfer, "--kv-host-tier-mb", "4", "--kv-disk-dir", str(tmp_path / "kv"))
    cluster.start_together(("prefill", *tier_args, {"worker_id": "p1"}), ("decode", *tier_args, {"worker_id": "d1"}))
    client = Client(cluster.redis_url, cluster.cluster)
    first = ask(client, TURN1, 2 * BS)
    assert list(first.token_ids) == out1 and first.transfer_path == ("shm" if transfer == "auto" else transfer)
    second = ask(client, turn2, 8)
    history = (len(TURN1) + len(out1) - 1) // BS * BS
    assert list(second.token_ids) == out2
    assert second.cached_tokens == history and second.kv_reused_tokens == history
    assert cluster.stop("d1") == 0 and cluster.stop("p1") == 0
    cluster.start_together(("prefill", *tier_args, {"worker_id": "p2"}), ("decode", *tier_args, {"worker_id": "d2"}))
    third = ask(client, turn3, 8)
    history = (len(turn2) + len(out2) - 1) // BS * BS
    assert list(third.token_ids) == out3
    assert third.cached_tokens == history and third.kv_reused_tokens == history


def test_the_next_turn_runs_on_the_colocated_worker_whose_tier_holds_its_history(cluster, tiny):
    """Colocated worker h runs the first turn and evicts it into its host tier; then worker r
    starts (a tier of its own, empty). Whichever reads the second turn, it runs on h (r routes
    it there: h advertised the history's blocks, and a tier's blocks count as held), which
    serves the history from its tier with the no-cache tokens. (Which one reads is Redis's
    choice: a worker stopped by a signal keeps its blocked read, so h cannot be kept out.)"""
    import json

    from pdqueue.client import Client

    out1, turn2, out2 = turns(tiny)
    history = (len(TURN1) + len(out1) - 1) // BS * BS
    tier_args = ("--kv-cache-mb", "1", "--kv-host-tier-mb", "4", "--kv-pull", "never")   # (held blocks are not evicted)
    cluster.start("colocated", *tier_args, worker_id="h")
    client = Client(cluster.redis_url, cluster.cluster)
    assert list(ask(client, TURN1, 2 * BS).token_ids) == out1
    for filler in FILLERS:
        ask(client, filler, 1)
    cluster.start("colocated", *tier_args, worker_id="r")

    def load(name: str) -> dict:
        return json.loads(cluster.r.hget(cluster.keys.worker(cluster.id(name)), "load") or b"{}")

    second = ask(client, turn2, 8)
    assert list(second.token_ids) == out2
    assert second.prefill_worker == cluster.id("h") and second.cached_tokens == history
    wait_for(lambda: load("h").get("kv_tier_loaded", 0) >= history // BS, 10, "h's tier counters")
    assert load("r").get("kv_tier_loaded", 0) == 0
