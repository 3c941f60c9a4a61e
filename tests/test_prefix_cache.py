"""Automatic prefix caching (pdqueue/engine/block_manager.py) on the real tiny model.

What must hold:
- the same tokens with caching on and off (greedy and seeded sampling; prefill_first and
  chunked prefill; a pool too small for every prefix, so blocks are evicted), compared with
  ``tests.oracle`` (equal, or a near-tie flip);
- a hit is not computed again: the model runner processes exactly the uncached tokens (the
  last prompt token always, a whole cached prompt's last block again);
- blocks are shared by reference count, never rewritten while a sequence or a lease holds
  them, kept (with their KV and their epochs) when a lease ends, evicted least recently
  used first, and every count is back to zero at the end;
- the prefill role's epochs: a block's epoch changes exactly when its bytes may change (it
  is handed out for new content), so shm copies under tickets sharing cached blocks stay
  valid until a block is really rewritten (a real segment, sender and shm receiver);
- ``cached_tokens`` in the engine's output and the done entry (old entries parse as 0), and
  the engines' counters in the workers' heartbeats (real worker shells and Redis).

One torch thread (a fixture), as in tests/test_engine.py.
"""

from __future__ import annotations

import random
import uuid

import pytest
import torch

from pdqueue.engine.block_manager import BlockManager
from pdqueue.engine.config import EngineConfig
from pdqueue.engine.kv_cache import KVCacheLayout
from pdqueue.engine.llm_engine import LLMEngine, kv_layout_for
from pdqueue.engine.sampling import SamplingParams
from pdqueue.engine.sequence import Sequence
from pdqueue.protocol import Completion, FinishReason, done_entry, parse_result
from pdqueue.transfer import FailureCode, KVReceiver, KVSender, LeaseTable, SharedKVPool, TransferError
from tests.oracle import assert_all_same, assert_same_tokens

BS = 16
NODE = "prefix-cache-test-node"


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here runs torch on one thread."""


def engine(loaded, caching: bool = True, prefill_only: bool = False, on_rewrite=None, kv_cache=None,
           **overrides) -> LLMEngine:
    fields = dict(model=loaded.config.name, block_size=BS, num_blocks=128, prefix_caching=caching)
    fields.update(overrides)
    return LLMEngine(loaded, EngineConfig(**fields), kv_cache=kv_cache, prefill_only=prefill_only,
                     on_rewrite=on_rewrite)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(0, 256) for _ in range(n)]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


def sampled(max_tokens: int, seed: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9, top_k=50, seed=seed, **kw)


def assert_all_released(eng: LLMEngine) -> None:
    """Nothing runs, no block is referenced, every block can be handed out."""
    bm = eng.block_manager
    assert not eng.has_unfinished and eng.request_ids() == []
    assert [bm.ref_count(b) for b in range(bm.num_blocks) if bm.ref_count(b)] == []
    assert bm.num_free_blocks == bm.num_blocks


def run_waves(eng: LLMEngine, waves: list[list[tuple[list[int], SamplingParams]]]) -> list[list[int]]:
    """Each wave's requests generated together, one wave after the other."""
    out: list[list[int]] = []
    for wave in waves:
        out += eng.generate([p for p, _ in wave], [q for _, q in wave])
    return out


def shared_prefix_waves(seed: int, kind: str, max_tokens: int = 8):
    """Three waves of four requests over four prefixes (1, 2.5, 4 and 6.25 blocks long); some
    prompts are exactly a block-aligned prefix (wholly cached the second time)."""
    rng = random.Random(seed)
    prefixes = [tokens(rng, n) for n in (16, 40, 64, 100)]
    waves = []
    for w in range(3):
        wave = []
        for i in range(4):
            prefix = prefixes[(i + w) % 4]
            suffix = tokens(rng, rng.choice([0, 1, 5, 16, 23]) if len(prefix) % BS == 0 else rng.choice([1, 5, 23]))
            q = (greedy(max_tokens, ignore_eos=True) if kind == "greedy"
                 else sampled(max_tokens, seed=100 * w + i, ignore_eos=True))
            wave.append((prefix + suffix, q))
        waves.append(wave)
    return waves


# --- the block manager on its own -------------------------------------------------------

def computed(bm: BlockManager, seq: Sequence) -> None:
    """What a step does to ``seq`` once the model ran: all its tokens computed, blocks named."""
    seq.num_cached_tokens = seq.num_tokens
    bm.cache_computed(seq)


def test_hits_share_blocks_by_reference_count():
    rewritten: list[int] = []
    bm = BlockManager(8, 4, enable_caching=True, on_rewrite=rewritten.extend)
    a = Sequence("a", list(range(10)), greedy(1))        # blocks [0-3] [4-7] [8, 9]
    bm.allocate(a)
    assert rewritten == a.block_table and len(a.block_table) == 3
    computed(bm, a)
    b = Sequence("b", list(range(8)) + [50, 51, 52], greedy(1))
    assert bm.num_hit_tokens(b) == 8 and bm.can_allocate(b)
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert b.num_cached_tokens == 8 and b.cached_tokens == 8 and b.num_uncomputed_tokens == 3
    assert [bm.ref_count(x) for x in b.block_table] == [2, 2, 1]
    assert rewritten == a.block_table + b.block_table[2:]   # hits are not handed out for writing
    assert (bm.queries, bm.hits) == (10 + 11, 8)
    bm.free(a)
    assert [bm.ref_count(x) for x in b.block_table] == [1, 1, 1] and bm.num_free_blocks == 8 - 3
    b_blocks = list(b.block_table)
    bm.free(b)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2   # b's third block is partial
    assert all(bm.ref_count(x) == 0 for x in range(8))
    with pytest.raises(RuntimeError):
        bm.free_blocks(b_blocks[:1])   # freed twice


def test_a_wholly_cached_prompt_recomputes_its_last_block():
    bm = BlockManager(8, 4, enable_caching=True)
    a = Sequence("a", list(range(8)), greedy(1))
    bm.allocate(a)
    computed(bm, a)
    first = list(a.block_table)
    bm.free(a)
    again = Sequence("again", list(range(8)), greedy(1))
    bm.allocate(again)
    assert again.num_cached_tokens == 4 and again.block_table[0] == first[0]
    assert again.block_table[1] != first[1]          # fresh: the cached block is never rewritten
    assert bm.ref_count(first[1]) == 0 and bm.is_cached(first[1])


def test_eviction_is_least_recently_used_and_never_of_held_blocks():
    bm = BlockManager(4, 2, enable_caching=True)
    seqs = []
    for i in range(4):   # four one-block prompts fill the pool
        s = Sequence(f"s{i}", [10 * i, 10 * i + 1], greedy(1))
        bm.allocate(s)
        computed(bm, s)
        seqs.append(s)
    first_blocks = [s.block_table[0] for s in seqs]
    for s in seqs:
        bm.free(s)   # s0 released first: the least recently used
    assert bm.num_cached_blocks == 4 and bm.num_free_blocks == 4

    def hit(prefix):
        return bm.num_hit_tokens(Sequence("q", prefix + [5], greedy(1)))

    held = Sequence("h", [30, 31, 5], greedy(1))   # hits s3's block (held from now on), evicts s0's
    bm.allocate(held)
    assert held.block_table[0] == first_blocks[3] and held.num_cached_tokens == 2
    assert [hit([10 * i, 10 * i + 1]) for i in range(4)] == [0, 2, 2, 2]
    bm.allocate(Sequence("n", [7, 7, 7], greedy(1)))   # two more blocks: s1's, then s2's
    assert bm.num_free_blocks == 0
    assert [hit([10 * i, 10 * i + 1]) for i in range(4)] == [0, 0, 0, 2]   # held: never evicted
    assert not bm.can_allocate(Sequence("z", [1, 2, 3], greedy(1)))
    bm.free(held)
    assert bm.num_free_blocks == 2 and hit([30, 31]) == 2   # cached and evictable now


def test_hashes_chain_over_every_block_before():
    """A block is found only after the same blocks before it: [A, B] is not served by the B
    of [C, B] when [A, E] is cached too."""
    bm = BlockManager(8, 2, enable_caching=True)
    for prompt in ([3, 4, 1, 2], [5, 6, 7, 8]):   # [C, B] and [A, E]
        s = Sequence("s", prompt, greedy(1))
        bm.allocate(s)
        computed(bm, s)
        bm.free(s)
    assert bm.num_hit_tokens(Sequence("y", [5, 6, 1, 2, 9], greedy(1))) == 2   # A only
    assert bm.num_hit_tokens(Sequence("z", [3, 4, 1, 2, 9], greedy(1))) == 4
    other = BlockManager(8, 2, enable_caching=True, root=b"another model")   # what changes the KV
    assert other.block_hashes(Sequence("o", [3, 4, 1], greedy(1)), 1) != \
        bm.block_hashes(Sequence("o", [3, 4, 1], greedy(1)), 1)


def test_caching_off_never_hits():
    bm = BlockManager(8, 4)
    a = Sequence("a", list(range(10)), greedy(1))
    bm.allocate(a)
    computed(bm, a)
    bm.free(a)
    b = Sequence("b", list(range(10)), greedy(1))
    assert bm.num_hit_tokens(b) == 0
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and bm.num_cached_blocks == 0 and (bm.queries, bm.hits) == (0, 0)


def test_leases_may_share_blocks_when_asked():
    table = LeaseTable(lease_s=10, shared_blocks=True)
    table.add("a", [1, 2], 5)
    table.add("b", [2, 3], 5)          # block 2 is in both (a cached prefix)
    assert table.held_blocks() == {1, 2, 3}
    assert table.release("a") and table.poll_freeable() == [("a", (1, 2))]
    assert table.held_blocks() == {2, 3}   # still b's
    assert table.release("b") and table.poll_freeable() == [("b", (2, 3))]
    assert table.held_blocks() == set() and table.num_held_blocks() == 0
    with pytest.raises(ValueError):
        exclusive = LeaseTable(lease_s=10)
        exclusive.add("a", [1, 2], 5)
        exclusive.add("b", [2, 3], 5)


# --- the engine: same tokens, less work -------------------------------------------------

@pytest.mark.parametrize("policy", ["prefill_first", "chunked"])
@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_same_tokens_with_caching_on_and_off(tiny, kind, policy):
    waves = shared_prefix_waves(seed=1 if kind == "greedy" else 2, kind=kind)
    overrides = dict(policy=policy, max_num_batched_tokens=32 if policy == "chunked" else 2048)
    on, off = engine(tiny, True, **overrides), engine(tiny, False, **overrides)
    got, expected = run_waves(on, waves), run_waves(off, waves)
    prompts = [p for wave in waves for p, _ in wave]
    params = [q for wave in waves for _, q in wave]
    assert len({tuple(t) for t in expected}) > len(prompts) // 2   # outputs vary: a real check
    assert_all_same(tiny, prompts, expected, got, params, label=f"{kind} {policy} cache on vs off")
    # Lengths are fixed (ignore_eos): the runner computed exactly the tokens not hit.
    assert on.prefix_cache_hits > 0 and (off.prefix_cache_queries, off.prefix_cache_hits) == (0, 0)
    assert off.stats.num_tokens - on.stats.num_tokens == on.prefix_cache_hits
    assert_all_released(on)
    assert_all_released(off)


def test_chunked_prefill_shares_blocks_of_a_prompt_still_being_prefilled(tiny):
    """Two requests with one 96-token prefix added together, 40-token budget: the second is
    admitted in the step of the first's last chunk (40 + 40 + 23 tokens) and hits the five
    blocks of the first 80 tokens, already computed and named."""
    rng = random.Random(3)
    prefix = tokens(rng, 96)
    prompts = [prefix + tokens(rng, 7), prefix + tokens(rng, 9)]
    params = [greedy(6, ignore_eos=True), sampled(6, seed=5, ignore_eos=True)]
    on = engine(tiny, True, policy="chunked", max_num_batched_tokens=40)
    ids = {}
    for i, (p, q) in enumerate(zip(prompts, params)):
        ids[f"r{i}"] = on.add_request(f"r{i}", p, q)
    results = {rid: [] for rid in ids}
    shared = False
    while on.has_unfinished:
        for out in on.step():
            results[out.request_id].append(out.token_id)
        a, b = ids["r0"].block_table, ids["r1"].block_table
        shared = shared or (bool(a) and bool(b) and a[0] == b[0] and on.block_manager.ref_count(a[0]) == 2)
    assert shared and ids["r1"].cached_tokens == 80
    off = engine(tiny, False, policy="chunked", max_num_batched_tokens=40).generate(prompts, params)
    assert_all_same(tiny, prompts, off, [results["r0"], results["r1"]], params, label="chunked sharing")
    assert_all_released(on)


def test_a_prefix_hit_is_not_computed_again(tiny):
    rng = random.Random(4)
    a = tokens(rng, 100)                      # 6 full blocks + 4 tokens
    cases = [                                 # (prompt, tokens served from the cache)
        (a, 0),
        (a[:96] + tokens(rng, 4), 96),        # the 6 full blocks
        (a[:96], 80),                         # wholly cached: the last block is computed again
        (a, 96),
        (a[:50] + tokens(rng, 30), 48),
        (tokens(rng, 100), 0),
    ]
    on, off = engine(tiny, True), engine(tiny, False)
    for prompt, hit in cases:
        before = on.stats.num_tokens
        on.add_request("r", prompt, greedy(1))
        outs = [o for _ in range(3) for o in on.step()]
        assert [o.cached_tokens for o in outs] == [hit]
        assert on.stats.num_tokens - before == len(prompt) - hit
        [expected] = off.generate([prompt], greedy(1))
        assert_same_tokens(tiny, prompt, expected, [outs[0].token_id])
        assert_all_released(on)
    assert on.prefix_cache_queries == sum(len(p) for p, _ in cases)
    assert on.prefix_cache_hits == sum(h for _, h in cases)
    assert off.stats.num_tokens == on.stats.num_tokens + on.prefix_cache_hits


@pytest.mark.parametrize("policy", ["prefill_first", "chunked"])
def test_eviction_in_a_pool_smaller_than_the_prefixes(tiny, policy):
    """Eight 3-block prefixes, a 10-block pool: two rounds (the second in reverse order, so
    the most recently used prefixes hit and the older ones were evicted), two at a time."""
    rng = random.Random(5)
    prefixes = [tokens(rng, 48) for _ in range(8)]
    order = list(range(8)) + list(reversed(range(8)))
    def params(i):
        return greedy(4, ignore_eos=True) if i % 2 else sampled(4, seed=i, ignore_eos=True)

    waves = [[(prefixes[i] + tokens(rng, 5), params(i)) for i in order[k:k + 2]] for k in range(0, len(order), 2)]
    overrides = dict(policy=policy, num_blocks=10, max_num_batched_tokens=32 if policy == "chunked" else 2048)
    on, off = engine(tiny, True, **overrides), engine(tiny, False, **overrides)
    got, expected = run_waves(on, waves), run_waves(off, waves)
    prompts = [p for wave in waves for p, _ in wave]
    params = [q for wave in waves for _, q in wave]
    assert_all_same(tiny, prompts, expected, got, params, label=f"eviction {policy}")
    hits, misses = on.prefix_cache_hits, 16 * 48 - on.prefix_cache_hits
    assert hits > 0 and misses > 8 * 48, (hits, misses)   # some hit, some were evicted
    assert on.block_manager.num_cached_blocks <= 10
    assert_all_released(on)
    assert_all_released(off)


def test_preempted_sequences_finish_alike_with_caching(tiny):
    """Preemption by recompute with caching on: same tokens as a big pool without it."""
    rng = random.Random(6)
    prefix = tokens(rng, 32)
    prompts = [prefix + tokens(rng, n) for n in (5, 12, 20, 31, 40, 8)]
    params = [greedy(30, ignore_eos=True) if i % 2 else sampled(30, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    small = engine(tiny, True, num_blocks=10, max_num_batched_tokens=64)
    got = small.generate(prompts, params)
    assert small.scheduler.num_preemptions > 0
    expected = engine(tiny, False, max_num_batched_tokens=64).generate(prompts, params)
    assert_all_same(tiny, prompts, expected, got, params, label="preemption with caching")
    assert_all_released(small)


# --- the prefill role: leases, epochs, a real shm segment -------------------------------

def run_one(eng: LLMEngine, rid: str, prompt: list[int]):
    eng.add_request(rid, prompt, greedy(4, ignore_eos=True))
    while True:
        outs = eng.step()
        if outs:
            [out] = outs
            assert out.detached_blocks, "the prefill role detaches the blocks"
            return out


def test_leased_cached_blocks_are_never_rewritten_and_epochs_move_only_on_rewrite(tiny):
    """A prefill engine on a shared segment, tickets exported as the prefill role does. Two
    requests share a 3-block prefix (two leases on the same blocks); while they are held the
    pool is churned by other prefixes: their bytes and epochs do not change, and shm copies
    under both tickets validate. When the leases end the blocks stay cached (a third request
    reuses them, same epochs); then churn evicts them: their epochs move, and the old ticket
    no longer validates. Throughout, no block's bytes change without its epoch moving."""
    config = EngineConfig(model="tiny", block_size=BS, num_blocks=12)
    layout = kv_layout_for(tiny.config, config)
    pool = SharedKVPool.create(layout, f"pdqtest-pc-{uuid.uuid4().hex[:8]}", "p0", uuid.uuid4().hex[:12])
    sender = receiver = None
    try:
        eng = LLMEngine(tiny, config, kv_cache=pool.tensor, prefill_only=True, on_rewrite=pool.bump_epochs)
        sender = KVSender.for_shared_pool(pool, NODE, data_port=None, shared_blocks=True)
        dst_layout = KVCacheLayout.from_dict({**layout.to_dict(), "num_blocks": 16})
        dst = dst_layout.allocate()
        receiver = KVReceiver(dst, dst_layout, NODE, mode="shm", timeout_s=5)
        rng = random.Random(7)
        prefix = tokens(rng, 48)
        all_blocks = list(range(layout.num_blocks))

        def snapshot():
            return pool.tensor.clone(), pool.epochs_of(all_blocks)

        def check_bytes_change_only_with_epochs(before):
            kv, epochs = before
            now = pool.epochs_of(all_blocks)
            for b in all_blocks:
                if not torch.equal(kv[:, :, b], pool.tensor[:, :, b]):
                    assert now[b] != epochs[b], f"block {b} was rewritten without its epoch moving"

        def churn(n: int, seed: int):
            """n requests of other prefixes through the engine, their leases ended at once."""
            r = random.Random(seed)
            for i in range(n):
                out = run_one(eng, f"churn-{seed}-{i}", tokens(r, 40))
                eng.free_blocks(out.detached_blocks)

        def fetch(ticket, n):
            receiver.fetch(ticket, list(range(n)))
            return dst[:, :, :n].clone()

        def end_lease(ticket):
            assert sender.leases.release(ticket.request_id)
            for _rid, blocks in sender.poll_freeable():
                eng.free_blocks(list(blocks))

        start = snapshot()
        a = run_one(eng, "a", prefix + tokens(rng, 5))
        ta = sender.export("a", a.detached_blocks, len(a.seq.prompt_ids))
        b = run_one(eng, "b", prefix + tokens(rng, 9))
        assert b.cached_tokens == 48 and b.detached_blocks[:3] == a.detached_blocks[:3]
        tb = sender.export("b", b.detached_blocks, len(b.seq.prompt_ids))   # leases share 3 blocks
        shared = a.detached_blocks[:3]
        assert [eng.block_manager.ref_count(x) for x in shared] == [2, 2, 2]
        assert tuple(tb.block_epochs[:3]) == tuple(ta.block_epochs[:3])
        held_kv = pool.tensor[:, :, shared].clone()
        held_epochs = pool.epochs_of(shared)
        check_bytes_change_only_with_epochs(start)

        before = snapshot()
        churn(12, seed=1)   # 12 prompts of 3 blocks through the 4 blocks left free, and back
        check_bytes_change_only_with_epochs(before)
        assert torch.equal(pool.tensor[:, :, shared], held_kv) and pool.epochs_of(shared) == held_epochs
        got_a = fetch(ta, 4)   # both tickets still validate
        assert torch.equal(got_a, pool.tensor[:, :, list(a.detached_blocks)])
        end_lease(ta)

        before = snapshot()
        churn(6, seed=2)    # a's own last block went back; b still holds the prefix
        check_bytes_change_only_with_epochs(before)
        assert torch.equal(pool.tensor[:, :, shared], held_kv) and pool.epochs_of(shared) == held_epochs
        got_b = fetch(tb, 4)
        assert torch.equal(got_b[:, :, :3], held_kv)
        end_lease(tb)
        assert [eng.block_manager.ref_count(x) for x in shared] == [0, 0, 0]
        assert pool.epochs_of(shared) == held_epochs   # handed back: kept, not bumped

        c = run_one(eng, "c", prefix + tokens(rng, 3))   # the next request with the prefix
        assert c.cached_tokens == 48 and c.detached_blocks[:3] == shared
        assert torch.equal(pool.tensor[:, :, shared], held_kv) and pool.epochs_of(shared) == held_epochs
        eng.free_blocks(c.detached_blocks)

        before = snapshot()
        churn(12, seed=3)   # nobody holds the prefix: evicted and rewritten
        check_bytes_change_only_with_epochs(before)
        assert all(now > then for now, then in zip(pool.epochs_of(shared), held_epochs))
        with pytest.raises(TransferError) as err:
            receiver.fetch(ta, [0, 1, 2, 3])
        assert err.value.code == FailureCode.LEASE_EXPIRED
        assert eng.block_manager.num_free_blocks == layout.num_blocks
        assert all(eng.block_manager.ref_count(x) == 0 for x in all_blocks)
    finally:
        if receiver is not None:
            receiver.close()
        if sender is not None:
            sender.close()
        pool.close()


def test_disaggregated_with_shared_prefixes_matches_colocated(tiny):
    """Prefill engine (caching, detached blocks shared by several requests at once) -> KV copied
    into a decode engine -> the colocated engine's tokens; every count back to zero."""
    waves = shared_prefix_waves(seed=8, kind="sampled", max_tokens=6)
    prompts = [p for wave in waves for p, _ in wave]
    params = [q for wave in waves for _, q in wave]
    expected = engine(tiny, False).generate(prompts, params)
    pre, dec = engine(tiny, True, prefill_only=True), engine(tiny, True)
    got: dict[str, list[int]] = {}
    held = []
    for w, wave in enumerate(waves):
        for i, (p, q) in enumerate(wave):
            pre.add_request(f"r{w * 4 + i}", p, q)
        while pre.has_unfinished:
            for out in pre.step():
                got[out.request_id] = [out.token_id]
                held.append(out)   # the leases of a wave stay held while the next wave prefills
    assert pre.prefix_cache_hits > 0
    assert any(pre.block_manager.ref_count(b) > 1 for b in range(pre.block_manager.num_blocks))
    for out in held:
        seq = dec.kv_import.reserve(out.request_id, out.seq.prompt_ids, out.seq.params, [out.token_id])
        src = torch.tensor(out.detached_blocks, dtype=torch.long)
        dec.kv_cache[:, :, torch.tensor(seq.block_table[: len(src)])] = pre.kv_cache[:, :, src]
        dec.kv_import.add_prefilled(seq)
        pre.free_blocks(out.detached_blocks)
    assert_all_released(pre)
    while dec.has_unfinished:
        for out in dec.step():
            got[out.request_id].append(out.token_id)
    assert_all_same(tiny, prompts, expected, [got[f"r{i}"] for i in range(len(prompts))], params,
                    label="disaggregated with shared prefixes")
    assert_all_released(dec)


def test_a_decode_engine_copies_only_the_blocks_it_lacks(tiny):
    """Tickets name their full blocks (the prefill engine's chain); a decode engine that holds
    some of those names already takes them from its cache and copies only the rest, and the
    tokens are the colocated engine's. Wave 2 shares wave 1's prefixes, so it must hit."""
    waves = shared_prefix_waves(seed=9, kind="sampled", max_tokens=6)
    prompts = [p for wave in waves for p, _ in wave]
    params = [q for wave in waves for _, q in wave]
    expected = engine(tiny, False).generate(prompts, params)
    pre, dec = engine(tiny, True, prefill_only=True), engine(tiny, True)
    assert pre.prefix_root == dec.prefix_root
    got: dict[str, list[int]] = {}
    reused = []
    for w, wave in enumerate(waves):
        outs = []
        for i, (p, q) in enumerate(wave):
            pre.add_request(f"r{w * 4 + i}", p, q)
        while pre.has_unfinished:
            outs += pre.step()
        for out in outs:
            got[out.request_id] = [out.token_id]
            seq = dec.kv_import.reserve(out.request_id, out.seq.prompt_ids, out.seq.params, [out.token_id],
                              block_hashes=out.seq.block_hashes, hash_root=pre.prefix_root)
            held = seq.num_cached_tokens // BS
            reused.append(held)
            assert all(dec.block_manager.is_cached(b) for b in seq.block_table[:held])
            src = torch.tensor(out.detached_blocks[held:], dtype=torch.long)
            dst = torch.tensor(seq.block_table[held:len(out.detached_blocks)], dtype=torch.long)
            dec.kv_cache[:, :, dst] = pre.kv_cache[:, :, src]   # only the blocks it lacks
            dec.kv_import.add_prefilled(seq)
            pre.free_blocks(out.detached_blocks)
        while dec.has_unfinished:
            for out in dec.step():
                got[out.request_id].append(out.token_id)
    assert sum(reused[len(waves[0]):]) > 0, reused   # the later waves found blocks in the decode cache
    assert dec.prefix_cache_hits == sum(reused) * BS
    assert_all_same(tiny, prompts, expected, [got[f"r{i}"] for i in range(len(prompts))], params,
                    label="decode reusing cached blocks")
    assert_all_released(dec)


def test_a_decode_engine_never_extends_another_engines_chain():
    """KV named by a sender whose chain starts elsewhere (other weights) is registered under
    the sender's names only; blocks the decode engine computes after them stay unnamed."""
    bm = BlockManager(16, BS, enable_caching=True, root=b"r" * 16)
    seq = Sequence("a", list(range(3 * BS + 5)), SamplingParams(), [1])
    theirs = [bytes([i]) * 16 for i in range(3)]
    assert bm.allocate_known(seq, theirs, same_root=False) == 0
    seq.num_cached_tokens = seq.num_tokens - 1
    bm.cache_computed(seq)
    for t in range(2 * BS):   # decode fills the fourth block and more
        seq.append_token(t)
        bm.append(seq)
        seq.num_cached_tokens += 1
        bm.cache_computed(seq)
    assert [bm.is_cached(b) for b in seq.block_table[:5]] == [True, True, True, False, False]
    same = Sequence("b", list(range(3 * BS + 5)), SamplingParams(), [1])
    assert bm.allocate_known(same, theirs, same_root=False) == 3   # the names still hit


# --- workers: done entries and heartbeats --------------------------------------------------

def run_shells(*shells):
    import threading
    threads = [threading.Thread(target=s.run, daemon=True) for s in shells]
    for t in threads:
        t.start()
    return threads


def stop_shells(shells, threads):
    for s in shells:
        s.stop.warm.set()
        s.stop.cold.set()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)


def test_workers_report_cached_tokens_and_counters(redis_url, tiny):
    """Colocated, then prefill + decode (one process, real Redis): a second request sharing a
    prefix gets the oracle's tokens, its done entry counts the cached prompt tokens (colocated;
    prefill when the first token ends it), and the heartbeats carry the engines' counters."""
    import json

    from pdqueue.client import Client
    from pdqueue.keys import Keys
    from tests.helpers import oracle, wait_for
    from workers.colocated import ColocatedRole
    from workers.common import WorkerConfig
    from workers.decode import DecodeRole
    from workers.prefill import PrefillRole
    from workers.shell import WorkerShell

    config = WorkerConfig(redis_url=redis_url, engine=EngineConfig(model="tiny", num_threads=1, kv_cache_mb=16),
                          heartbeat_ttl_s=2.0, lease_s=5.0)
    client, keys = Client(redis_url), Keys()
    prefix = "A shared system prompt, long enough to fill a few KV blocks of the tiny model. "
    prompts = [prefix + "First question?", prefix + "Second one, please.", prefix + "Third.", prefix + "Last."]
    params = [{"max_tokens": 6, "temperature": 0.0, "seed": 0}, {"max_tokens": 6, "temperature": 0.8, "seed": 3},
              {"max_tokens": 6, "temperature": 0.0, "seed": 0}, {"max_tokens": 1, "temperature": 0.0, "seed": 0}]
    ids, expected, sampling = oracle(tiny, prompts, params)
    common = len(tiny.tokenizer.encode(prefix))
    cached = [min(common // BS, (len(p) - 1) // BS) * BS for p in ids]
    assert all(c >= 3 * BS for c in cached)

    def load(shell):
        return json.loads(client.redis.hget(keys.worker(shell.worker_id), "load") or b"{}")

    colocated = WorkerShell(config, tiny, ColocatedRole())
    threads = run_shells(colocated)
    try:
        results = [client.submit(prompts[i], **params[i]).result(timeout=60) for i in (0, 1)]
        for i, res in enumerate(results):
            assert_same_tokens(tiny, ids[i], expected[i], list(res.token_ids), sampling[i])
        assert [r.cached_tokens for r in results] == [0, cached[1]]
        wait_for(lambda: load(colocated).get("prefix_cache_hits") == cached[1], timeout=10, what="colocated counters")
        assert load(colocated)["prefix_cache_queries"] == len(ids[0]) + len(ids[1])
    finally:
        stop_shells([colocated], threads)

    prefill, decode = WorkerShell(config, tiny, PrefillRole()), WorkerShell(config, tiny, DecodeRole())
    threads = run_shells(prefill, decode)
    try:
        results = [client.submit(prompts[i], **params[i]).result(timeout=60) for i in (2, 3)]
        assert results[0].transfer_path == "shm" and results[1].transfer_path == "none"
        for i, res in zip((2, 3), results):
            assert_same_tokens(tiny, ids[i], expected[i], list(res.token_ids), sampling[i])
        assert results[1].cached_tokens == cached[3]   # the prefill worker's done entry
        wait_for(lambda: load(prefill).get("prefix_cache_hits") == cached[3], timeout=10, what="prefill counters")
        # The decode engine looked the ticket's block names up (nothing cached there yet).
        wait_for(lambda: load(decode).get("prefix_cache_queries") == len(ids[2]) // BS * BS, timeout=10,
                 what="decode counters")
        assert load(decode)["prefix_cache_hits"] == 0
    finally:
        stop_shells([prefill, decode], threads)


@pytest.mark.parametrize("transfer", ["auto", "tcp", "zmq"])
def test_only_the_missing_blocks_travel_between_workers(cluster, tiny, transfer):
    """Real prefill and decode processes: a conversation's second turn resends the first turn
    and more; the decode worker holds the first turn's blocks already, so only the rest is
    fetched (over each path), and every answer is the colocated engine's."""
    from pdqueue.client import Client
    from tests.helpers import oracle, wait_pools_free

    cluster.start_together(("prefill", "--transfer", transfer, {"worker_id": "prefill0"}),
                           ("decode", "--transfer", transfer, {"worker_id": "decode0"}))
    turn1 = "You are a careful assistant. Answer in one short sentence. " * 3 + "What is a fox?"
    turn2 = turn1 + " A fox is a small wild dog. And what is a raven?"
    turn3 = turn2[:-6] + "ravine?"   # shares all but the last block or two
    prompts = [turn1, turn2, turn3]
    params = [{"max_tokens": 6, "temperature": 0.0, "seed": 0}, {"max_tokens": 6, "temperature": 0.8, "seed": 5},
              {"max_tokens": 6, "temperature": 0.0, "seed": 0}]
    ids, expected, sampling = oracle(tiny, prompts, params)
    client = Client(cluster.redis_url, cluster.cluster)
    results = [client.submit(p, **kw).result(timeout=60) for p, kw in zip(prompts, params)]
    for i, res in enumerate(results):
        assert_same_tokens(tiny, ids[i], expected[i], list(res.token_ids), sampling[i])
    path = "shm" if transfer == "auto" else transfer
    assert [r.transfer_path for r in results] == [path] * 3
    held = [r.kv_reused_tokens for r in results]
    full_blocks_of_turn1 = len(ids[0]) // BS
    assert held[0] == 0 and held[1] == full_blocks_of_turn1 * BS, (held, len(ids[0]))
    assert held[2] >= held[1]
    token_bytes = results[0].transfer_bytes // -(-len(ids[0]) // BS) // BS   # bytes of one token's KV
    for r, n in zip(results, ids):
        assert r.transfer_bytes == (-(-len(n) // BS) * BS - r.kv_reused_tokens) * token_bytes
    wait_pools_free(cluster)


def test_a_prefill_worker_killed_while_its_cached_blocks_are_leased_loses_nothing(cluster, tiny):
    """Requests sharing a cached prefix are prefilled and handed off (their leases share the
    cached blocks) while the decode worker is stopped; the prefill worker is then killed. The
    decode worker, resumed, copies from the dead owner's segment or recomputes: every request
    gets the colocated engine's tokens and exactly one done entry."""
    import glob
    import signal

    from pdqueue.client import Client
    from pdqueue.keys import Keys
    from tests.helpers import oracle, wait_for

    cluster.start_together(("prefill", "--lease-s", "3", {"worker_id": "prefill0"}),
                           ("decode", {"worker_id": "decode0"}))
    prefix = "A long shared instruction that every request starts with, to be cached. " * 2
    prompts = [prefix + f"Question {i}?" for i in range(4)]
    params = [{"max_tokens": 5, "temperature": 0.0, "seed": 0}, {"max_tokens": 5, "temperature": 0.9, "seed": 7}] * 2
    ids, expected, sampling = oracle(tiny, prompts, params)
    client = Client(cluster.redis_url, cluster.cluster)
    keys = Keys(cluster.cluster)
    cluster.signal("decode0", signal.SIGSTOP)
    try:
        def handoffs() -> int:
            return cluster.r.xlen(keys.handoff) + sum(cluster.r.xlen(k) for k in
                                                      cluster.r.scan_iter(match=keys.handoff_node("*")))

        # The first alone, so that its prefix is cached when the others come (sent together,
        # all four could be read and prefilled in one step, none of them hitting the cache).
        handles = [client.submit(prompts[0], **params[0])]
        wait_for(lambda: handoffs() >= 1, 30, "the first handoff queued")
        handles += [client.submit(p, **kw) for p, kw in zip(prompts[1:], params[1:])]
        wait_for(lambda: handoffs() >= 4, 30, "4 handoffs queued")
        cluster.signal("prefill0", signal.SIGKILL)
        cluster.procs.pop("prefill0").wait()
    finally:
        cluster.signal("decode0", signal.SIGCONT)
    results = [h.result(timeout=60) for h in handles]
    for i, res in enumerate(results):
        assert_same_tokens(tiny, ids[i], expected[i], list(res.token_ids), sampling[i])
    assert sum(r.cached_tokens for r in results) > 0, "the later requests should have hit the prefix cache"
    for h in handles:
        kinds = [f[b"type"] for _, f in cluster.r.xrange(keys.out(h.request_id))]
        assert kinds.count(b"done") == 1 and b"error" not in kinds, kinds
    # The dead owner's segment goes once its last lease could have ended (the decode worker's sweep).
    wait_for(lambda: not glob.glob(f"/dev/shm/pdq-kv-{cluster.id('prefill0')}-*"), 30, "the dead segment removed")


# --- output, protocol, options -----------------------------------------------------------

def test_cached_tokens_in_the_done_entry_and_old_entries_parse():
    c = Completion("r1", "hi", (1, 2), FinishReason.STOP, num_prompt_tokens=100, cached_tokens=96)
    fields = done_entry(c)
    assert fields["cached_tokens"] == "96"
    assert parse_result("1-0", fields).completion.cached_tokens == 96
    old = {k: v for k, v in fields.items() if k != "cached_tokens"}   # a worker before this field
    assert parse_result("1-0", old).completion.cached_tokens == 0


def test_prefix_caching_is_on_by_default_and_an_option():
    from workers.cli.generate import generate
    from workers.cli.worker import worker

    assert EngineConfig().prefix_caching is True
    for command in (generate, worker):
        [opt] = [p for p in command.params if p.name == "prefix_caching"]
        assert opt.default is True and "--no-prefix-caching" in opt.secondary_opts
