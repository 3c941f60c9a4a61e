"""The next turn pulls the last turn's KV from the worker that holds it, when that is
cheaper than computing it again (issue 41, item 2): the puller's half (a prefill or
colocated role, at intake); workers/kv_holds.py is the holder's.

At intake, after routing and placement and before the request enters the engine
(workers/intake.py), ``KVPull.pull``:

1. hashes the prompt's full blocks with this engine's chain (all but the last token's,
   as the prefix cache does) and counts what this worker holds itself (pool and tiers:
   ``num_cached_leading``); fewer than ``MIN_PULL_BLOCKS`` missing: nothing to do;
2. one MGET of ``kvhold:<hash>`` for the missing blocks: the deepest hold found with no
   gap before it, then its ticket (``kvticket:<hold id>``). A ticket of another prefix
   root (another model, weights, dtype or block size: the chain's start) or of this worker
   is never used; the run used is where the ticket's block names equal the prompt's;
3. decides (``--kv-pull``): ``always`` pulls, ``never`` never does, ``auto`` pulls when
   the predicted pull is cheaper than the predicted recompute of the tokens it saves:
   recompute from the engine's step cost model (engine/step_cost.py: its cost per prompt
   token; before it has learned one, the engine's average step cost per token; before any
   step, a pull), pull from ``PullCost``, a per-path estimate (shm, tcp, zmq) of latency
   and bandwidth learned from this worker's own pulls and seeded conservatively;
4. fetches the blocks past those it holds with a ``KVReceiver`` into a staging pool in
   host memory (shm out of the holder's segment on the same node, else its TCP data
   server, else ZeroMQ; the ticket's MAC and the holder's incarnation checked, the lease
   released after the copy), and stages the payloads under the ticket's block names in
   the engine's tier (``StagedTier``: over the process's KV tiers, or alone). The
   admission that follows finds them as tier hits: copied into fresh pool blocks, named,
   counted as cached (``cached_tokens``); only the rest is computed.

Failure rules: every failure is a recompute, never a wrong or failed answer. No hold, an
expired or revoked one, a dead holder (its incarnation is checked first; a connection
refused or cut mid-copy; a segment gone), a refused MAC, a timeout (``PULL_TIMEOUT_S`` at
most), a staged payload dropped before the admission (``STAGED_TTL_S``, the staging bound):
the blocks are computed here, as without a pull. KV of other weights is never used: its
names start from another root, so they never equal this prompt's, and a ticket whose
``hash_root`` is not this engine's is refused.

The pull runs on the role's loop thread, like the compute it replaces (a step of that
prompt would block it as long); a pull that costs more than the compute is what ``auto``
avoids. The heartbeat shows ``kv_pulls`` (and ``kv_pulls_<path>``), ``kv_pulled_tokens``,
``kv_pull_bytes``, ``kv_pull_failed``, ``kv_pull_declined``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict

import redis

from pdqueue.engine.block_manager import chain_hashes
from pdqueue.engine.kv_codec import NATIVE, KVCodec, effective
from pdqueue.engine.kv_tiers import leading_run
from pdqueue.engine.step_cost import MIN_STEPS
from pdqueue.protocol import as_str
from pdqueue.transfer import registry
from pdqueue.transfer.base import Ticket
from pdqueue.transfer.errors import TransferError
from pdqueue.transfer.receiver import KVReceiver

log = logging.getLogger("pdqueue.worker")

MIN_PULL_BLOCKS = 2      # fewer missing blocks than this: not worth a lookup
PULL_TIMEOUT_S = 5.0     # a pull's transfer timeout at most (the worker's --fetch-timeout-s if lower)
STAGED_TTL_S = 30.0      # a staged payload not admitted by then is dropped
MIN_STAGING_BLOCKS = 64  # the staging pool's first size (grown to a pull's need, up to the engine's pool)

# Per path: (latency s, bytes/s) before the first pull of that path; conservative (lower
# bandwidth than a loopback or a memcpy gives), so ``auto`` pulls where it clearly pays.
SEED = {"shm": (0.002, 1e9), "tcp": (0.005, 2e8)}
SEED_OTHER = (0.01, 1e8)
LEARN = 0.3              # weight of each new pull in the bandwidth estimate


class PullCost:
    """A per-path estimate of a pull's seconds, ``latency + bytes / bandwidth``: the latency
    stays its seed, the bandwidth follows this worker's own pulls (an exponential average)."""

    def __init__(self):
        self.est: dict[str, list[float]] = {}

    def _of(self, path: str) -> list[float]:
        if path not in self.est:
            self.est[path] = list(SEED.get(path, SEED_OTHER))
        return self.est[path]

    def predict(self, path: str, nbytes: int) -> float:
        latency, bandwidth = self._of(path)
        return latency + nbytes / bandwidth

    def observe(self, path: str, nbytes: int, seconds: float) -> None:
        est = self._of(path)
        if nbytes <= 0:
            return
        seen = nbytes / max(seconds - est[0], 1e-4)
        est[1] = (1 - LEARN) * est[1] + LEARN * seen


def recompute_s(engine, tokens: int) -> float | None:
    """What computing ``tokens`` prompt tokens costs this engine, by its step cost model
    (its per-token term, once learned), else its average step cost per token so far; None
    before it ran any step."""
    cost = getattr(engine.scheduler, "cost", None)   # engine/step_cost.py's StepCostModel
    per_token = cost.theta[2] if cost is not None and cost.steps >= MIN_STEPS and cost.theta[2] > 0 else None
    if per_token is None and engine.stats.num_tokens:
        per_token = engine.stats.seconds / engine.stats.num_tokens
    return None if per_token is None else per_token * tokens


def decide(mode: str, recompute: float | None, pull: float) -> bool:
    """Whether to pull: ``always``, ``never``, or ``auto``: when the pull is predicted cheaper
    (or the recompute cost is unknown yet)."""
    if mode == "always":
        return True
    if mode == "never":
        return False
    return recompute is None or pull < recompute


class StagedTier:
    """The engine's tier (block_manager.py's ``tier``) with pulled payloads staged on top:
    ``has``/``leading``/``fetch`` see the staged entries first, then ``inner`` (the process's
    KVTiers, or None); a staged entry is dropped once loaded into the pool, after
    ``STAGED_TTL_S``, or when the staged bytes pass ``max_bytes`` (oldest first)."""

    def __init__(self, inner, pool, max_bytes: int):
        self.inner, self.pool, self.max_bytes = inner, pool, max_bytes
        self._staged: OrderedDict[bytes, tuple] = OrderedDict()   # hash -> (payload, expires at)
        self._bytes = 0
        self.loaded = 0

    @property
    def write_finished(self) -> bool:
        return bool(self.inner is not None and self.inner.write_finished)

    def stage(self, hashes, payloads) -> None:
        expires = time.monotonic() + STAGED_TTL_S
        for h, payload in zip(hashes, payloads):
            self._drop(h)
            self._staged[h] = (payload, expires)
            self._bytes += payload.numel() * payload.element_size()
        self._expire(force_bytes=True)

    def _drop(self, h: bytes) -> None:
        old = self._staged.pop(h, None)
        if old is not None:
            self._bytes -= old[0].numel() * old[0].element_size()

    def _expire(self, force_bytes: bool = False) -> None:
        now = time.monotonic()
        for h, (_payload, expires) in list(self._staged.items()):
            if expires > now and not (force_bytes and self._bytes > self.max_bytes):
                break
            self._drop(h)

    def has(self, h: bytes) -> bool:
        self._expire()
        return h in self._staged or (self.inner is not None and self.inner.has(h))

    def leading(self, hashes) -> int:
        return leading_run(self.has, hashes)

    def fetch(self, hashes) -> list:
        out = []
        for h in hashes:
            staged = self._staged.get(h)
            if staged is not None:
                out.append(staged[0])
                continue
            got = self.inner.fetch([h]) if self.inner is not None else []
            if not got:
                break
            out.append(got[0])
        return out

    def load(self, block_id: int, payload) -> None:
        """A staged payload is the pool's format (copied as it is); any other is the inner
        tier's, which decodes its own (``KVTiers.load``)."""
        for h, (staged, _expires) in self._staged.items():
            if staged is payload:
                self.pool[:, :, block_id].copy_(payload)
                self._drop(h)
                self.loaded += 1
                return
        self.inner.load(block_id, payload)

    def spill(self, h: bytes, block_id: int) -> None:
        if self.inner is not None:
            self.inner.spill(h, block_id)

    def persist(self, named) -> None:
        if self.inner is not None:
            self.inner.persist(named)


class KVPull:
    """A request role's pulls (see the module docstring)."""

    def __init__(self, r: redis.Redis, keys, worker_id: str, node: str, config, auth=None):
        self.r, self.keys, self.worker_id, self.node = r, keys, worker_id, node
        self.mode = config.kv_pull
        self.transfer = config.transfer
        self.timeout_s = min(config.fetch_timeout_s, PULL_TIMEOUT_S)
        self.kv_format = config.kv_wire_format   # asked of the holder over tcp/zmq, as a handoff's fetch asks
        self.auth = auth
        self.cost = PullCost()
        self._receiver: KVReceiver | None = None
        self._staging = None
        self.pulls = self.pulled_tokens = self.pulled_bytes = self.failed = self.declined = 0
        self.by_path: dict[str, int] = {}   # pulls per transport (shm, tcp, zmq)

    # -- where the holder is, what it costs --------------------------------------------------
    def path_for(self, ticket: Ticket) -> str:
        """The transport a receiver in this worker's mode would use for ``ticket`` (the
        receiver's own order: transfer.receiver)."""
        for name in registry.candidates(self.transfer):
            if name == "shm" and not (ticket.node == self.node and ticket.segment):
                continue
            if name == "tcp" and not ticket.data_endpoint:
                continue
            return name
        return "zmq"

    def _is_current(self, worker_id: str, incarnation: str) -> bool:
        try:
            inc = self.r.hget(self.keys.worker(worker_id), "incarnation")
        except redis.RedisError:
            return True   # cannot tell: the transfer decides
        return inc is not None and as_str(inc) == incarnation

    # -- the pull ------------------------------------------------------------------------
    def pull(self, engine, prompt_ids: list[int]) -> int:
        """Stage the blocks of ``prompt_ids``'s history a peer holds, when the rule says so;
        the tokens staged (0: none, the engine computes them)."""
        bm = engine.block_manager
        if self.mode == "never" or not bm.enable_caching:
            return 0
        bs = bm.block_size
        num_full = (len(prompt_ids) - 1) // bs
        if num_full < MIN_PULL_BLOCKS:
            return 0
        hashes = chain_hashes(bm.root, prompt_ids[:num_full * bs], bs)
        mine = bm.num_cached_leading(hashes)
        if num_full - mine < MIN_PULL_BLOCKS:
            return 0
        try:
            ticket = self._find(hashes, mine)
        except (redis.RedisError, ValueError, TypeError) as exc:
            log.debug("KV pull: no usable hold (%s)", exc)
            return 0
        if ticket is None or ticket.worker_id == self.worker_id or ticket.hash_root != bm.root:
            return 0
        depth = 0
        for theirs, ours in zip(ticket.block_hashes, hashes):
            if theirs != ours:
                break
            depth += 1
        if depth - mine < MIN_PULL_BLOCKS:
            return 0
        layout = engine.layout
        nblocks = len(ticket.block_ids) - mine
        path = self.path_for(ticket)
        # The bytes that will move (what ``observe`` learns from: the fetch's encoded bytes):
        # the asked format where the path encodes (transfer.registry), else native.
        fmt = effective(self.kv_format, layout.torch_dtype) if registry.encodes(path) else NATIVE
        nbytes = KVCodec.for_layout(fmt, layout).nbytes(2 * layout.num_layers, nblocks)
        if not decide(self.mode, recompute_s(engine, (depth - mine) * bs), self.cost.predict(path, nbytes)):
            self.declined += 1
            return 0
        try:
            staging = self._stage_pool(engine, nblocks)
            result = self._receiver.fetch(ticket, list(range(nblocks)), mine)
        except TransferError as exc:
            self.failed += 1
            log.info("KV pull from %s failed (%s): computing it here", ticket.worker_id, exc)
            return 0
        except Exception as exc:   # a bug must not fail the request: it is computed instead
            self.failed += 1
            log.warning("KV pull from %s failed (%s): computing it here", ticket.worker_id, exc, exc_info=True)
            return 0
        self.cost.observe(result.path, result.nbytes, result.seconds)
        payloads = staging[:, :, :depth - mine].clone()
        tier = self._tier(engine)
        tier.stage(hashes[mine:depth], [payloads[:, :, i] for i in range(depth - mine)])
        self.pulls += 1
        self.by_path[result.path] = self.by_path.get(result.path, 0) + 1
        self.pulled_tokens += (depth - mine) * bs
        self.pulled_bytes += result.nbytes
        log.debug("KV pull: %d blocks from %s over %s in %.1f ms", depth - mine, ticket.worker_id, result.path,
                  result.seconds * 1e3)
        return (depth - mine) * bs

    def _find(self, hashes: list[bytes], mine: int) -> Ticket | None:
        """The ticket of the deepest hold covering the missing blocks from the first on."""
        found = self.r.mget([self.keys.kv_hold(h.hex()) for h in hashes[mine:]])
        hold_id = None
        for value in found:
            if value is None:
                break
            hold_id = value
        if hold_id is None:
            return None
        raw = self.r.get(self.keys.kv_ticket(as_str(hold_id)))
        return None if raw is None else Ticket.unpack(raw)

    def _stage_pool(self, engine, nblocks: int):
        """The staging pool (host memory, the engine's layout), at least ``nblocks`` big,
        and its receiver."""
        layout = engine.layout
        if self._staging is None or self._staging.shape[2] < nblocks:
            size = min(max(MIN_STAGING_BLOCKS, 1 << (nblocks - 1).bit_length()), max(nblocks, layout.num_blocks))
            staging_layout = dataclasses.replace(layout, num_blocks=size)
            if self._receiver is not None:
                self._receiver.close()
            self._staging = staging_layout.allocate(device="cpu")
            self._receiver = KVReceiver(self._staging, staging_layout, self.node, mode=self.transfer,
                                        timeout_s=self.timeout_s, is_current=self._is_current, auth=self.auth,
                                        kv_format=self.kv_format)
        return self._staging

    def _tier(self, engine) -> StagedTier:
        bm = engine.block_manager
        if not isinstance(bm.tier, StagedTier):
            bm.tier = StagedTier(bm.tier, engine.kv_cache, max_bytes=engine.layout.nbytes // 2)
        return bm.tier

    def load(self) -> dict:
        if self.mode == "never":
            return {}
        return {"kv_pulls": self.pulls, "kv_pulled_tokens": self.pulled_tokens, "kv_pull_bytes": self.pulled_bytes,
                "kv_pull_failed": self.failed, "kv_pull_declined": self.declined,
                **{f"kv_pulls_{path}": n for path, n in self.by_path.items()}}

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None
