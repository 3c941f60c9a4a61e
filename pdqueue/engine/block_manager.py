"""Owner of the KV pool's blocks: which are free, which are cached, who holds which.

Check/act pairs, as in nano-vllm: the caller asks ``can_allocate``/``can_append`` and only
then calls ``allocate``/``append``, so running out of blocks is a scheduling decision, not
an exception. A sequence's blocks are released by ``free(seq)``; blocks detached from a
sequence (exported to a decode worker under a lease) come back through ``free_blocks``.

**Automatic prefix caching** (``enable_caching``):

- *Identity.* A full block is named by a hash chained over the token ids of every block
  before it and its own: ``h[i] = blake2b(h[i-1] || tokens of block i)``, where ``h[-1]``
  is ``root``, a digest of what else decides the KV (the model's identity and config, the
  weights' and the KV pool's dtypes, the block size; ``LLMEngine`` builds it). Equal hashes
  mean equal token prefixes, so equal KV. Only full blocks are ever named; a partial last
  block belongs to its sequence alone. The hashes of a sequence are kept on it
  (``Sequence.block_hashes``) and extended as its tokens grow.
- *Reference counts.* Every block has a count of its holders: each sequence whose block
  table names it, and each caller holding detached blocks (the prefill role's leases, one
  reference per lease). Blocks with the same prefix are shared (count > 1). A block is
  written only while its count is 1 and it is not in the cache's index: a hit block is
  only ever read, and a sequence writes only the blocks ``allocate``/``append`` gave it.
- *Hits.* ``allocate`` on a sequence with no blocks takes the longest chain of its full
  blocks found in the index (a reference each) and sets ``num_cached_tokens`` past them;
  only the rest is computed. The last token is always computed (its logits are needed):
  when every block of the sequence is cached, the last one is not taken from the cache
  but recomputed into a fresh block, as vLLM does (rewriting a shared block in place,
  even with the same values, could race with a reader of it).
- *Registration.* Once a step computed a block in full (``cache_computed``), its hash goes
  into the index, unless another block already holds that hash (two sequences computed the
  same prefix at once: the later block stays unnamed and is plainly freed later).
- *Free list, LRU.* A block whose count drops to zero stays in the pool, with its KV: named
  blocks go to the end of ``_evictable`` (least recently used first), unnamed ones to
  ``_free``. A new block comes from ``_free`` first, then by evicting the least recently
  used named block (its hash leaves the index). A referenced block is never evicted. A
  sequence's blocks are released last-first, so a chain's tail goes before its head
  (the head is the most likely to be shared). ``num_free_blocks`` counts both lists: every
  block that can be handed out.
- *Tiers* (``tier``: engine/kv_tiers.py's ``KVTiers``, or None): a named block evicted from
  the pool is first copied into the tier (``spill``), keyed by its hash. A sequence's chain
  that the pool's index holds only in part continues in the tier: ``allocate`` (and
  ``allocate_known``) fetch the payloads of the leading run the tier holds past the pool's
  hits, copy each into a fresh block (``load``, after ``on_rewrite``), name it and count its
  tokens as cached, exactly like a pool hit; only the rest is computed. The payloads are
  fetched once per admission (memoized for the sequence between ``num_hit_tokens``,
  ``can_allocate`` and ``allocate``), so a tier entry lost meanwhile cannot change what the
  scheduler was told. A tier's failure is a miss. With ``tier.write_finished`` (a decode
  worker's), a finished sequence's named blocks past its prompt (its answer's) are written
  to the disk tier at once (``persist``), for the next turn's prefill on this node.
- *Epochs* (``on_rewrite``, wired by the prefill role to the shared segment's
  ``bump_epochs``): called with the blocks handed out for new content (``allocate``,
  ``append``), before the step that writes them. That is exactly when a block's bytes can
  change: a block that comes back from a lease or a finished sequence keeps its bytes (and
  its epoch) while it waits in ``_evictable``/``_free``, so shm copies of it stay valid
  until it is reused, and a cached block leased again carries the same epoch.

Imports nothing but sequence (a tier is any object with kv_tiers.KVTiers' methods).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from typing import Callable

from pdqueue.engine.sequence import Sequence, SequenceStatus

_DIGEST = 16   # bytes of blake2b per block hash (collisions: ~2^-64 at 2^32 blocks)


def prefix_root(*parts) -> bytes:
    """The hash before a sequence's first block: a digest of ``parts`` (their reprs)."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=_DIGEST).digest()


def chain_hashes(parent: bytes, token_ids, block_size: int) -> list[bytes]:
    """The chained hashes of the full blocks of ``token_ids`` after the block hashed
    ``parent`` (token ids as little-endian int64, one conversion for all blocks)."""
    data = array("q", token_ids).tobytes()
    step = 8 * block_size
    out = []
    for start in range(0, len(data) - step + 1, step):
        parent = hashlib.blake2b(parent + data[start:start + step], digest_size=_DIGEST).digest()
        out.append(parent)
    return out


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = False,
                 root: bytes = b"", on_rewrite: Callable[[list[int]], None] | None = None, tier=None):
        """``enable_caching``: automatic prefix caching (see the module docstring) with
        ``root`` as the chain's start. ``on_rewrite(block_ids)``: called before blocks get
        new content. ``tier``: a KVTiers bound to this pool, or None (no tiers)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.root = prefix_root(root) if not root else root
        self.on_rewrite = on_rewrite
        self._free: deque[int] = deque(range(num_blocks))      # count 0, unnamed
        self._evictable: OrderedDict[int, None] = OrderedDict()  # count 0, named; LRU first
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._index: dict[bytes, int] = {}                      # hash -> the block holding it
        self.queries = 0   # tokens of sequences looked up in the cache (at each admission)
        self.hits = 0      # of those, tokens found cached
        self.tier = tier if enable_caching else None
        self.tier_hits = 0   # of ``hits``, tokens served from a tier
        self._fetched: tuple[int, list[bytes], list] | None = None   # (id(seq), hashes, payloads)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix cache's index (held or evictable)."""
        return len(self._index)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def is_cached(self, block_id: int) -> bool:
        return self._hash[block_id] is not None

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # ---- prefix lookup -----------------------------------------------------------------
    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The chained hashes of ``seq``'s first ``num_blocks`` full blocks (memoized on it)."""
        hashes, bs = seq.block_hashes, self.block_size
        if num_blocks > len(hashes):
            parent = hashes[-1] if hashes else self.root
            hashes += chain_hashes(parent, seq.token_ids[len(hashes) * bs:num_blocks * bs], bs)
        return hashes

    def _hit_blocks(self, seq: Sequence) -> list[int]:
        """The cached blocks ``allocate`` would give ``seq``: the longest chain of its full
        blocks in the index, never covering its last token."""
        if not self.enable_caching or seq.block_table:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        return self._cached_chain(self.block_hashes(seq, max_blocks)) if max_blocks else []

    def _cached_chain(self, hashes) -> list[int]:
        """The blocks named by the leading run of ``hashes`` (a chain, in order) found in the index."""
        hit: list[int] = []
        for h in hashes:
            block_id = self._index.get(h)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    def _tier_payloads(self, seq: Sequence, start: int, hashes: list[bytes] | None = None) -> list:
        """The tier's payloads for ``seq``'s chain past its ``start`` pool hits (the leading
        run the tier holds, never covering the last token), fetched once per admission."""
        if self.tier is None or seq.block_table:
            return []
        if hashes is None:
            max_blocks = (seq.num_tokens - 1) // self.block_size
            hashes = self.block_hashes(seq, max_blocks)[:max_blocks]
        wanted = hashes[start:]
        if not wanted or not self.tier.has(wanted[0]):
            return []
        memo = self._fetched
        if memo is not None and memo[0] == id(seq) and memo[1] == wanted:
            return memo[2]
        payloads = self.tier.fetch(wanted)
        self._fetched = (id(seq), wanted, payloads)
        return payloads

    def _load_tier(self, seq: Sequence, start: int, payloads: list, hashes: list[bytes]) -> None:
        """Copy ``payloads`` into ``seq``'s fresh blocks from ``start`` on and name them."""
        self._fetched = None
        for i, payload in enumerate(payloads, start):
            block_id, h = seq.block_table[i], hashes[i]
            self.tier.load(block_id, payload)
            if h not in self._index:
                self._index[h] = block_id
                self._hash[block_id] = h
        self.tier_hits += len(payloads) * self.block_size

    def num_cached_leading(self, hashes: list[bytes]) -> int:
        """How many of ``hashes`` (a chain, in order) name blocks in the cache or a tier, from the first on."""
        n = len(self._cached_chain(hashes))
        return n + (self.tier.leading(hashes[n:]) if self.tier is not None else 0)

    def num_hit_tokens(self, seq: Sequence) -> int:
        """Tokens of ``seq`` that ``allocate`` would serve from the cache (or a tier) now."""
        hit = len(self._hit_blocks(seq))
        return (hit + (len(self._tier_payloads(seq, hit)) if self.enable_caching else 0)) * self.block_size

    # ---- check/act pairs ---------------------------------------------------------------
    def can_allocate(self, seq: Sequence) -> bool:
        hit = self._hit_blocks(seq)
        needed = self.blocks_for(seq.num_tokens) - len(seq.block_table) - len(hit)
        evictable_hits = sum(1 for b in hit if self._ref[b] == 0)   # taken as hits, not handed out
        return needed <= self.num_free_blocks - evictable_hits

    def allocate(self, seq: Sequence, use_cache: bool = True) -> None:
        """Give ``seq`` blocks for all of its current tokens: cached ones for the longest
        cached prefix (``use_cache``, when it holds none yet), fresh ones for the rest.
        ``use_cache=False``: fresh blocks only (the decode role copies KV into them)."""
        hit = self._hit_blocks(seq) if use_cache else []
        tiered = self._tier_payloads(seq, len(hit)) if use_cache and self.enable_caching else []
        needed = self.blocks_for(seq.num_tokens) - len(seq.block_table) - len(hit)
        available = self.num_free_blocks - sum(1 for b in hit if self._ref[b] == 0)
        if needed > available:
            raise RuntimeError(f"allocate without can_allocate: need {needed}, free {available}")
        caching = self.enable_caching and use_cache and not seq.block_table
        num_hit = len(hit)   # (``hit`` becomes the block table, extended below)
        if caching:
            for block_id in hit:
                self._hold(block_id)
            seq.block_table = hit
        if needed > 0:
            fresh = [self._take() for _ in range(needed)]
            seq.block_table.extend(fresh)
            if self.on_rewrite is not None:
                self.on_rewrite(fresh)
        if caching:
            if tiered:
                self._load_tier(seq, num_hit, tiered, seq.block_hashes)
            seq.num_hashed_blocks = num_hit + len(tiered)
            seq.num_cached_tokens = seq.num_hashed_blocks * self.block_size
            if seq.num_preemptions == 0:   # the first admission: what the request saved
                seq.cached_tokens = min(seq.num_cached_tokens, seq.num_prompt_tokens)
            self.queries += seq.num_tokens
            self.hits += seq.num_cached_tokens

    def allocate_known(self, seq: Sequence, hashes: list[bytes], same_root: bool) -> int:
        """Decode role: give ``seq`` blocks for all of its tokens, whose KV (all but the
        last token's) another engine computed and named ``hashes`` (its chain, one hash per
        full block, in order). The longest run of those names found in the index is taken
        from the cache (a reference each, only ever read: they never cover the last token);
        fresh blocks for the rest, which the caller fills. Returns how many leading blocks
        were hits. ``same_root``: that engine's chain starts where ours does (same model,
        weights and dtypes), so blocks this engine computes later may extend the chain;
        otherwise only the given names are ever registered. Call ``can_allocate``-like
        checks first (``blocks_for(num_tokens)`` free blocks always suffice)."""
        hit: list[int] = []
        tiered: list = []
        if self.enable_caching and not seq.block_table:
            usable = hashes[:(seq.num_tokens - 1) // self.block_size]
            hit = self._cached_chain(usable)
            tiered = self._tier_payloads(seq, len(hit), usable)
            for block_id in hit:
                self._hold(block_id)
            seq.block_table = list(hit)
            seq.block_hashes = list(hashes)
            seq.num_hashed_blocks = len(hit) + len(tiered)
            seq.max_hashed_blocks = None if same_root else len(hashes)
            self.queries += min(len(hashes) * self.block_size, seq.num_tokens)
            self.hits += (len(hit) + len(tiered)) * self.block_size
        self.allocate(seq, use_cache=False)
        if tiered:
            self._load_tier(seq, len(hit), tiered, hashes)
        return len(hit) + len(tiered)

    def can_append(self, seq: Sequence) -> bool:
        """Room to compute the sequence's next token (its last one) without a new block, or a free block."""
        return len(seq.block_table) * self.block_size >= seq.num_tokens or self.num_free_blocks >= 1

    def append(self, seq: Sequence) -> None:
        if len(seq.block_table) * self.block_size < seq.num_tokens:
            if not self.num_free_blocks:
                raise RuntimeError("append without can_append")
            block_id = self._take()
            seq.block_table.append(block_id)
            if self.on_rewrite is not None:
                self.on_rewrite([block_id])

    def cache_computed(self, seq: Sequence) -> None:
        """Name the blocks of ``seq`` that are now computed in full (after a step)."""
        if not self.enable_caching:
            return
        num_full = seq.num_cached_tokens // self.block_size
        if seq.max_hashed_blocks is not None:   # KV named by another engine's chain (allocate_known)
            num_full = min(num_full, seq.max_hashed_blocks)
        if num_full <= seq.num_hashed_blocks:
            return
        hashes = self.block_hashes(seq, num_full)
        for i in range(seq.num_hashed_blocks, num_full):
            block_id, h = seq.block_table[i], hashes[i]
            if h not in self._index and self._hash[block_id] is None:
                self._index[h] = block_id
                self._hash[block_id] = h
        seq.num_hashed_blocks = num_full

    # ---- giving blocks back ------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        if self.tier is not None and self.tier.write_finished and seq.status == SequenceStatus.FINISHED:
            # Its answer's named blocks, for the next turn's prefill on this node (kv_tiers.py).
            first = seq.num_prompt_tokens // self.block_size
            self.tier.persist([(seq.block_hashes[i], seq.block_table[i])
                               for i in range(first, min(seq.num_hashed_blocks, len(seq.block_table)))])
        self.free_blocks(seq.block_table)
        seq.block_table = []
        seq.num_cached_tokens = 0
        seq.num_hashed_blocks = 0

    def detach(self, seq: Sequence) -> list[int]:
        """Take the blocks away from ``seq`` without releasing them: its references are now
        the caller's, who returns them with ``free_blocks`` (after the lease on them ends).
        Meanwhile they are never rewritten; cached ones may be shared by new sequences."""
        block_ids, seq.block_table = seq.block_table, []
        seq.num_hashed_blocks = 0
        return block_ids

    def free_blocks(self, block_ids: list[int]) -> None:
        """Drop one reference to each block (last first: see the module docstring)."""
        for block_id in block_ids:
            if self._ref[block_id] <= 0:
                raise RuntimeError(f"block {block_id} freed twice or never allocated")
        for block_id in reversed(block_ids):
            self._ref[block_id] -= 1
            if self._ref[block_id] == 0:
                if self._hash[block_id] is not None:
                    self._evictable[block_id] = None   # most recently used: evicted last
                else:
                    self._free.append(block_id)

    def hold_cached(self, hashes) -> list[int]:
        """Take a reference on each block named by the leading run of ``hashes`` (a chain, in
        order) in the index and return them: the caller holds them (never evicted nor
        rewritten) until it gives them back with ``free_blocks`` (a finished sequence's KV
        kept exported for the next turn: workers/kv_holds.py)."""
        blocks = self._cached_chain(hashes)
        for block_id in blocks:
            self._hold(block_id)
        return blocks

    def named_blocks(self) -> list[tuple[bytes, int]]:
        """(hash, block id) of every named block, the evictable ones least recently used
        first, then the held ones (what a clean stop writes to the disk tier)."""
        held = [(h, b) for h, b in self._index.items() if self._ref[b] > 0]
        return [(self._hash[b], b) for b in self._evictable] + held

    def _hold(self, block_id: int) -> None:
        if self._ref[block_id] == 0:
            del self._evictable[block_id]
        self._ref[block_id] += 1

    def _take(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)   # the least recently used
            if self.tier is not None:
                self.tier.spill(self._hash[block_id], block_id)   # its KV, before it is rewritten
            del self._index[self._hash[block_id]]
            self._hash[block_id] = None
        self._ref[block_id] = 1
        return block_id
