"""Cache-aware routing in a pull queue: a request goes where its prefix's KV is cached.

Producers XADD to ``requests`` and any prefill (or colocated) worker may take an entry;
that is what makes the queue fair, fault tolerant and free of a central router. Routing
is layered on top, inside the workers, so none of that changes:

- **Advertise.** When a worker computes or reuses a prompt's full blocks, it sets
  ``prefix:<hash>`` (the prefix cache's chained block hash, block_manager.py) to its id with
  a TTL (``ADVERTISE_TTL_S``), in the same unit as the step's answers. An advertisement is a
  hint: a block evicted meanwhile only costs a cache miss, never a wrong answer.
- **Route at intake.** A worker that reads a request from ``requests`` tokenizes it (as it
  must anyway), hashes its full blocks, and reads in one round trip who advertised each
  block plus the backlog of every peer's own stream. The rule of the best routers (SGLang's,
  Dynamo's): if a peer holds a longer prefix than this worker by at least ``MIN_GAIN_BLOCKS``
  (and a quarter of the prompt), and that peer's load is within ``MAX_IMBALANCE`` of this
  worker's, and it is of this worker's kind (KV format, model and wire versions:
  workers/compat.py), the entry moves to the peer's own stream ``requests:w:<id>``; otherwise
  it runs here. The move is one Lua script (``ownership.forward``): the entry is acknowledged and
  deleted here, and added there, only if it is still pending for this worker; ``seen:<id>``
  follows it, so exactly one outcome per request still holds. A moved entry is never moved
  again, and only the entries of a class that routes are moved (``ServiceClass.routed``: the
  standard class; ``requests:high`` entries are never moved, priority first).
- **Read.** Each worker reads the online classes' streams in class order, its own stream just
  before the stream of the class that routes: ``requests:high``, its own, ``requests``.
- **Take over.** An idle worker looks at the other workers' own streams (every
  ``TAKEOVER_EVERY_S``): entries whose owner is gone (no heartbeat), or that waited there
  longer than ``TAKEOVER_AFTER_MS`` (the owner lags), are read by it instead (XREADGROUP on
  that stream: the consumer group still hands each entry to one worker). Entries a dead
  owner had read but not finished are reclaimed as before (``Recovery``, which scans every
  worker's own stream too). An owner-less stream left empty is deleted.

Imports redis, pdqueue.keys, queue.streams/ownership/registry, engine.block_manager (hashing),
workers.compat.
"""

from __future__ import annotations

import logging
import time

import redis

from pdqueue.engine.block_manager import chain_hashes
from pdqueue.keys import PREFILL_GROUP, Keys
from pdqueue.protocol import REQUEST_ROLES, Priority, ServiceClass, as_str, entry_id_ms
from pdqueue.protocol.compat import compat_of
from pdqueue.queue import streams
from pdqueue.queue.ownership import forward
from pdqueue.queue.registry import list_workers
from workers.common import ROUTING_MODES
from workers.compat import engine_compat

log = logging.getLogger("pdqueue.worker")

ADVERTISE_TTL_S = 120       # an advertisement of a cached block lives this long unless renewed
MIN_GAIN_BLOCKS = 2         # a peer must hold at least this many more leading blocks ...
MIN_GAIN_SHARE = 0.25       # ... and this share of the prompt's full blocks
MAX_IMBALANCE = 4           # ... and have at most this many more requests in hand or queued
REFRESH_S = 1.0             # peers (heartbeats) and the set of own streams are re-read this often
MIN_REFRESH_S = 0.25        # ... and sooner when an advertisement names a worker not seen yet
TAKEOVER_EVERY_S = 0.2      # an idle worker looks at the others' own streams this often
TAKEOVER_AFTER_MS = 1500    # an entry waiting this long in a live owner's stream may be taken over

# KEYS[1] = a dead owner's stream, KEYS[2] = the set of own streams; ARGV[1] = group.
_DROP_IF_EMPTY = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  if redis.call('XLEN', KEYS[1]) > 0 then return 0 end
  local p = redis.call('XPENDING', KEYS[1], ARGV[1])
  if p[1] > 0 then return 0 end
  redis.call('DEL', KEYS[1])
end
redis.call('SREM', KEYS[2], KEYS[1])
return 1
"""


class Advertise:
    """A unit op: ``prefix:<hash>`` -> this worker, for each hash (pipelined SETs with a TTL)."""

    __slots__ = ("keys", "worker_id", "hashes")

    def __init__(self, keys: Keys, worker_id: str, hashes: list[bytes]):
        self.keys, self.worker_id, self.hashes = keys, worker_id, hashes

    def __call__(self, pipe) -> None:
        for h in self.hashes:
            pipe.set(self.keys.prefix_owner(h.hex()), self.worker_id, ex=ADVERTISE_TTL_S)

    def __repr__(self) -> str:
        return f"Advertise({len(self.hashes)} blocks)"


class Router:
    """One worker's side of routing (see the module docstring). ``mode`` "off": it still
    reads its own stream (peers may have routed to it before) but routes and advertises
    nothing."""

    def __init__(self, r: redis.Redis, keys: Keys, worker_id: str, role, mode: str = "cache"):
        """``role``: the RequestRole whose ``engine`` (made after this) holds the cache."""
        if mode not in ROUTING_MODES:
            raise ValueError(f"routing must be one of {ROUTING_MODES}, got {mode!r}")
        self.r, self.keys, self.worker_id, self.role, self.mode = r, keys, worker_id, role, mode
        self.own = keys.requests_for(worker_id)
        self._routed = {keys.request_stream_for(c) for c in ServiceClass if c.routed}   # whose entries may move
        self.others: list[str] = []               # the other workers' own streams
        self.peers: dict[str, dict] = {}          # live request-reading workers but us, accepting, by id
        self.all_workers: set[str] = set()        # every live worker (heartbeat), whatever it does
        self.readers: set[str] = set()            # live workers in (or switching to) a request role
        self._refreshed = 0.0
        self._looked = 0.0
        self.forwarded = 0                        # requests this worker moved to a peer
        self.taken_over = 0                       # entries it took from another worker's stream
        self.route_lookups = 0
        self._compat = None                       # this worker's record (workers/compat.py), once its engine is made

    @property
    def engine(self):
        return self.role.engine

    @property
    def enabled(self) -> bool:
        return self.mode == "cache" and self.engine.prefix_caching

    # -- set-up and views --------------------------------------------------------------------
    def start(self) -> None:
        """Register the own stream (the shell's ensure_groups makes it and its group, since
        it is among ``all_streams``); Redis errors wait for the next ``refresh``."""
        self.refresh(force=True)

    def read_streams(self) -> list[str]:
        """What this worker reads every turn, in order: the streams of the classes that do not
        yield, in class order, its own stream just before the first class that routes."""
        out: list[str] = []
        for c in ServiceClass:
            if c.yields:
                continue
            if c.routed and self.own not in out:
                out.append(self.own)
            out.append(self.keys.request_stream_for(c))
        return out

    def all_streams(self) -> list[str]:
        """Every request stream it may hold entries of (Recovery scans these): those it reads
        every turn, the yielding classes' (read through the gate, workers/admission.py), the
        others' own streams."""
        return [*self.read_streams(), *(self.keys.request_stream_for(c) for c in ServiceClass if c.yields),
                *self.others]

    def home_stream(self, fields) -> str:
        """The stream of the class a routed entry is in (its ``class``, else its ``priority``'s)."""
        def field(name: str) -> str | None:
            value = fields.get(name.encode(), fields.get(name))
            return None if value is None else as_str(value, "replace").strip().lower()
        try:
            cls = ServiceClass.of(ServiceClass(field("class")) if field("class") else None,
                                  Priority(field("priority") or Priority.NORMAL.value))
        except ValueError:   # malformed: where the intake that reads it answers the error
            cls = next(c for c in ServiceClass if c.routed)
        return self.keys.request_stream_for(cls)

    def refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._refreshed < REFRESH_S:
            return
        self._refreshed = now
        try:
            members = sorted(as_str(m) for m in self.r.smembers(self.keys.routed_streams))
            if self.own not in members:   # first time, or removed while we looked dead: back in
                streams.ensure_group(self.r, self.own, PREFILL_GROUP)
                self.r.sadd(self.keys.routed_streams, self.own)
            workers = list_workers(self.r, self.keys)
        except (redis.ConnectionError, redis.TimeoutError):
            return
        self.others = [m for m in members if m != self.own]
        self.all_workers = {w["worker_id"] for w in workers}
        # Who still reads its own stream: a worker that became a decode worker does not.
        self.readers = {w["worker_id"] for w in workers if w.get("role") in REQUEST_ROLES
                        and (w.get("switching_to") or w.get("role")) in REQUEST_ROLES}
        self.peers = {w["worker_id"]: w for w in workers
                      if w["worker_id"] != self.worker_id and w.get("role") in REQUEST_ROLES
                      and not w.get("switching_to") and (w.get("load") or {}).get("accepting", True)}

    def compatible(self, worker: dict) -> bool:
        """Whether ``worker`` is of this worker's kind (KV format, model, wire versions:
        workers/compat.py). Peers of another kind never advertise a prompt's blocks (the
        chain hashes start from the engine's prefix root, which differs whenever the KV
        identity does), so this only says where the decision is made."""
        if self._compat is None:
            self._compat = engine_compat(self.engine)
        return self._compat.accepts(compat_of(worker))

    # -- advertising ---------------------------------------------------------------------------
    def advertise(self, unit, seq, whole: bool = False) -> None:
        """Add to ``unit`` the op announcing ``seq``'s full prompt blocks (when its prompt is
        computed), or with ``whole`` every full block it computed (when it ends here: a
        conversation's next turn resends the answer too)."""
        if not self.enabled:
            return
        n = len(seq.block_hashes) if whole else min(len(seq.block_hashes),
                                                     seq.num_prompt_tokens // self.engine.config.block_size)
        if n:
            unit.ops.append(Advertise(self.keys, self.worker_id, seq.block_hashes[:n]))

    # -- routing at intake -----------------------------------------------------------------------
    def route(self, stream: str, entry_id: str, fields: dict, request_id: str, prompt_ids: list[int],
              enqueued_ms: float) -> int | None:
        """Move the entry to a peer that caches a longer prefix, if the rule says so: 1
        moved, -1 someone else finished it meanwhile (drop it), None: run it here."""
        if (not self.enabled or stream not in self._routed
                or "routed_from" in fields or b"routed_from" in fields):   # moved once already: it stays
            return None
        bs = self.engine.config.block_size
        num_full = (len(prompt_ids) - 1) // bs
        if num_full < MIN_GAIN_BLOCKS:
            return None
        bm = self.engine.block_manager
        hashes = chain_hashes(bm.root, prompt_ids[:num_full * bs], bs)
        mine = bm.num_cached_leading(hashes)
        need = max(MIN_GAIN_BLOCKS, int(MIN_GAIN_SHARE * num_full + 0.999))
        if num_full - mine < need:
            return None
        self.route_lookups += 1
        owners = self.r.mget([self.keys.prefix_owner(h.hex()) for h in hashes])
        depth: dict[str, int] = {}
        for i, owner in enumerate(owners):
            if owner is None and i >= mine:
                break   # a chain is only held whole: nobody advertises what lies past a gap
            if owner is not None:
                depth[as_str(owner)] = i + 1
        depth.pop(self.worker_id, None)
        if not depth:
            return None
        if any(wid not in self.peers for wid in depth) and time.monotonic() - self._refreshed > MIN_REFRESH_S:
            self.refresh(force=True)   # a peer that started (or stopped) since the last look
        peers = [wid for wid in depth if wid in self.peers and self.compatible(self.peers[wid])]
        if not peers:
            return None
        with self.r.pipeline(transaction=False) as pipe:
            for wid in peers:
                pipe.xlen(self.keys.requests_for(wid))
            queued = pipe.execute()
        my_load = online_load(self.engine)
        best = None
        for wid, backlog in zip(peers, queued):
            d = depth.get(wid, 0)
            if d - mine < need:
                continue
            load = backlog + _load_of(self.peers[wid])
            if load - my_load > MAX_IMBALANCE:
                continue
            if best is None or (d, -load) > (best[1], -best[2]):
                best = (wid, d, load)
        if best is None:
            return None
        moved = forward(self.r, stream, PREFILL_GROUP, entry_id,
                        {**{as_str(k): v for k, v in fields.items()}, "routed_from": self.worker_id,
                         "enqueued_ms": str(int(enqueued_ms))},
                        self.keys.requests_for(best[0]), self.keys.seen(request_id))
        if moved == 1:
            self.forwarded += 1
            log.debug("routed %s to %s (%d cached blocks there, %d here)", entry_id, best[0], best[1], mine)
            return 1
        return -1 if moved == -1 else None

    # -- taking over -------------------------------------------------------------------------------
    def take_over(self, limit: int, idle: bool = True) -> list:
        """Entries of the other workers' own streams that their owners cannot serve: the
        owner is gone, or (only when this worker is ``idle``) the oldest unread entry has
        waited over TAKEOVER_AFTER_MS."""
        now = time.monotonic()
        if not self.others or now - self._looked < TAKEOVER_EVERY_S:
            return []
        self._looked = now
        with self.r.pipeline(transaction=False) as pipe:
            for s in self.others:
                pipe.xinfo_groups(s)
            infos = pipe.execute(raise_on_error=False)
        candidates = []
        for s, info in zip(self.others, infos):
            if isinstance(info, Exception):
                continue
            group = next((g for g in info if as_str(g.get("name")) == PREFILL_GROUP), None)
            if group is not None:
                candidates.append((s, as_str(group.get("last-delivered-id")), group.get("lag")))
        taken: list = []
        alive = self.readers | {self.worker_id}   # owners that will read their stream again
        wall_ms = time.time() * 1000
        for s, last, lag in candidates:
            owner = s[len(self.keys.requests_for("")):]
            if owner in alive and (lag == 0 or not idle):
                continue
            first = self.r.xrange(s, min=f"({last}", count=1) if last else self.r.xrange(s, count=1)
            if not first:
                if owner not in self.all_workers and owner != self.worker_id:   # gone for good
                    self.r.eval(_DROP_IF_EMPTY, 2, s, self.keys.routed_streams, PREFILL_GROUP)
                continue
            waited = wall_ms - entry_id_ms(first[0][0])
            if owner in alive and waited < TAKEOVER_AFTER_MS:
                continue
            got = streams.parse_read_reply(
                self.r.xreadgroup(PREFILL_GROUP, self.worker_id, {s: ">"}, count=limit - len(taken)))
            if got:
                log.info("took over %d entries of %s (%s)", len(got), s,
                         "its owner is gone" if owner not in alive else f"waited {waited:.0f} ms")
            taken += got
            if len(taken) >= limit:
                break
        self.taken_over += len(taken)
        return taken

    def give_back(self) -> int:
        """When the role stops taking requests (warm stop, switch): entries routed to it and
        not read yet go back to their class's stream (each moved once, by script), so nobody waits
        for a take-over. Best effort: what stays is taken over anyway."""
        moved = 0
        try:
            while True:
                got = streams.parse_read_reply(self.r.xreadgroup(PREFILL_GROUP, self.worker_id, {self.own: ">"},
                                                                 count=100))
                if not got:
                    return moved
                for stream, entry_id, fields in got:
                    rid = as_str(fields.get(b"id", fields.get("id", entry_id)))
                    moved += forward(self.r, stream, PREFILL_GROUP, entry_id, fields, self.home_stream(fields),
                                     self.keys.seen(rid)) == 1
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError) as exc:
            log.warning("could not give back the requests routed here (%s): others take them over", exc)
            return moved

    def load(self) -> dict:
        return {"routed_out": self.forwarded, "taken_over": self.taken_over}


def online_load(engine) -> int:
    """The online (not batch-class) requests running or waiting in ``engine``: what routing
    compares, since batch work yields to online work wherever it runs (admission.py)."""
    scheduler = engine.scheduler
    return engine.num_running - scheduler.num_background + scheduler.num_waiting_foreground


def _load_of(worker: dict) -> int:
    """A peer's online load from its heartbeat (``online``; running + waiting from a worker
    that does not report it)."""
    load = worker.get("load") or {}
    if "online" in load:
        return int(load["online"] or 0)
    return int(load.get("running", 0) or 0) + int(load.get("waiting", 0) or 0)

