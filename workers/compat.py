"""A worker's side of the compatibility handshake (pdqueue/protocol/compat.py): its own record,
which peers it may exchange KV with, where its handoffs go, and saying once what it routes
around.

Who asks what:

- every worker shows its record in its heartbeat from its start (``own_compat``; the shell);
- a prefill worker sees only the compatible decode workers (``DecodePeers``,
  workers/decode_peers.py): whether one has room, where a prompt is placed (placement.py),
  which handoff stream it writes (``handoff_stream``);
- a worker that moves its running decodes (migration.py) moves them to a compatible decode
  worker only, else finishes them itself;
- prefix routing (routing.py) forwards a request to a compatible peer only (the prefix
  cache's chain hashes already differ between two KV identities, so no peer of another kind
  ever advertises a prompt's blocks; the check says so where the decision is made);
- a decode worker never runs a handoff of another key (``Rerouter``, workers/decode.py).

Where handoffs go (``handoff_stream``). While every live decode worker is compatible (or shows
no record: an older build, compatible as before), the shared streams, exactly as before the
handshake: ``handoff:<node>`` when one lives on this node (and the transfer can use shared
memory), else ``handoff``. Once a decode worker of another kind lives, which reads the shared
streams too, the stream of this worker's key, ``handoff:kv:<key>``, which every decode worker
of that key reads besides the shared ones (one stream per kind, whatever the node: the
ticket still says the node, so a decode worker on the sender's node copies over shared
memory). Exception: when the only compatible decode workers are older builds (they read the
shared streams only), the shared streams.

The safety net. A handoff may still reach a decode worker of another kind: the sender's view
of the heartbeats is up to half a second old, an older sender writes the shared streams, a
pending entry is taken over from a dead decode worker. That decode worker runs none of it:
``Rerouter`` finds the entry's key (its ``compat`` field, read before the data, whose version
may be one this worker does not speak; else the handoff's ``kv_identity``) and the decode
role finishes the entry with a copy of it on the stream of that key, in one unit
(``ack_and_write``: exactly once, whoever finishes the entry first). So no request fails for a
peer of another kind while a compatible decode worker lives; when none lives, the handoff
waits in its key's stream until one starts (the sender says so once, and its heartbeat shows
``no_compatible_decode``). A lease that expires meanwhile costs a recompute, never an answer.

Saying so once (``Once``): one log line per peer of another kind (a decode worker a sender
routes around, a sender whose handoffs a decode worker passes on), never one per request;
the count is the metric ``pdqueue:kv_incompatible`` (``WorkerMetrics.incompatible``) and the
heartbeat's load (``incompatible_decode``, ``rerouted``).

Not covered: a cluster that mixes an older build (no record) with a build of another KV kind.
The older worker takes every handoff of the shared streams as compatible (its own check then
refuses one of another model with an error, as it always did), and handoffs passed on to the
stream of its kind wait there, since it reads only the shared streams. A rolling upgrade
brings every worker to a build that shows a record first, then changes the format
(docs/operations/failures.md, "Mixed versions").
"""

from __future__ import annotations

import json
import logging
from typing import Iterable

from pdqueue.engine.llm_engine import kv_identity, kv_layout_for
from pdqueue.protocol import HandoffError, as_str, decode_handoff
from pdqueue.protocol.compat import COMPAT_FIELD, Compat, compat_key, compat_of, entry_compat
from pdqueue.transfer.base import TRANSFER_VERSION
from pdqueue.transfer.registry import same_host_possible

log = logging.getLogger("pdqueue.compat")


def kv_format(layout) -> str:
    """A KV layout in words (the record's ``format``)."""
    return (f"{layout.dtype}, block {layout.block_size}, {layout.num_layers} layers x {layout.num_kv_heads} "
            f"KV heads x {layout.head_dim}")


def own_compat(loaded, engine_config) -> Compat:
    """The record of a worker that loaded ``loaded`` and runs engines of ``engine_config``
    (whatever its role: every role's engine has this layout)."""
    layout = kv_layout_for(loaded.config, engine_config)
    return Compat(kv_identity(loaded, layout), TRANSFER_VERSION, kv_format=kv_format(layout))


def engine_compat(engine) -> Compat:
    """The record of a worker running ``engine`` (the same as ``own_compat``)."""
    return Compat(engine.kv_identity, TRANSFER_VERSION, kv_format=kv_format(engine.layout))


def sender_fields(engine) -> dict:
    """What a handoff says of its sender (``Handoff`` fields): its model, KV identity and wire."""
    return {"kv_identity": engine.kv_identity, "model": engine.config.model, "transfer_version": TRANSFER_VERSION}


def split(workers: Iterable[dict], mine: Compat) -> tuple[list[dict], list[dict]]:
    """(the workers ``mine`` may exchange KV with, those of another kind)."""
    compatible, other = [], []
    for w in workers:
        (compatible if mine.accepts(compat_of(w)) else other).append(w)
    return compatible, other


def separate(compatible: list[dict], incompatible: list[dict]) -> bool:
    """Whether handoffs go to the stream of their key rather than the shared ones (see the
    module docstring): a decode worker of another kind lives, and some compatible one reads
    the streams of its key (or none lives: the handoff then waits there)."""
    return bool(incompatible) and (not compatible or any(compat_of(w) is not None for w in compatible))


def handoff_stream(keys, mine: Compat | None, node: str, transfer: str, compatible: list[dict],
                   incompatible: list[dict]) -> str:
    """The stream a handoff of this worker (record ``mine``, on ``node``, ``--transfer``) goes
    to, given the live decode workers it may hand to and those of another kind."""
    if mine is not None and separate(compatible, incompatible):
        return keys.handoff_compat(mine.key)
    if same_host_possible(transfer) and node in {w.get("node") for w in compatible}:
        return keys.handoff_node(node)
    return keys.handoff


class Once:
    """Which peers were already spoken of: ``first(peer, key)`` is True once per pair."""

    def __init__(self):
        self._seen: set[tuple[str, str]] = set()

    def first(self, peer: str, key: str) -> bool:
        if (peer, key) in self._seen:
            return False
        self._seen.add((peer, key))
        return True


def say_incompatible(once: Once, mine: Compat, workers: Iterable[dict], what: str, metrics=None) -> None:
    """One log line (and one count) per worker of ``workers`` not yet spoken of: ``what`` says
    what this worker does about it."""
    for w in workers:
        theirs = compat_of(w)
        if theirs is not None and once.first(w["worker_id"], theirs.key):
            log.warning("%s worker %s is not compatible with this worker (%s): %s", w.get("role") or "a",
                        w["worker_id"], mine.differs(theirs), what)
            if metrics is not None:
                metrics.incompatible("peer")


class Rerouter:
    """A decode worker's side: the stream a handoff entry of another key goes on to."""

    def __init__(self, r, keys, mine: Compat, metrics=None):
        self.r, self.keys, self.mine, self.metrics = r, keys, mine, metrics
        self.once = Once()
        self.rerouted = 0   # handoff entries passed on (the heartbeat's ``rerouted``)

    def target(self, fields) -> str | None:
        """The stream to pass this handoff entry on to (counted, and said once per sender),
        or None: this worker may run it (or it is malformed: the role rejects it as before)."""
        key = entry_compat(fields)
        if key == self.mine.key or fields is None:
            return None   # (the common case reads no data)
        try:
            handoff = decode_handoff(fields)
        except HandoffError:
            handoff = None   # another handoff version: its compat field says where it goes, if anything
        if not key and handoff is not None and handoff.kv_identity and handoff.kv_identity != self.mine.kv_identity:
            # An older sender that names its KV but not its key: the key it would have.
            version = handoff.transfer_version or (handoff.ticket or {}).get("version") or self.mine.transfer
            key = compat_key(handoff.kv_identity, version)
        if not key:
            return None
        stream = self.keys.handoff_compat(key)
        self.rerouted += 1
        if self.metrics is not None:
            self.metrics.incompatible("rerouted")
        sender = handoff.prefill_worker if handoff is not None else ""
        if self.once.first(sender, key):
            log.warning("handoffs of %s are not compatible with this decode worker (%s): passed on to %s, "
                        "whose decode workers run them (no KV is fetched from it here)",
                        sender or "a sender", self._differs(sender, key), stream)
        return stream

    def _differs(self, sender: str, key: str) -> str:
        """What differs, from the sender's heartbeat when it still has one (else from its key)."""
        theirs = None
        if sender:
            try:
                raw = self.r.hget(self.keys.worker(sender), COMPAT_FIELD)
                theirs = Compat.from_record(json.loads(as_str(raw))) if raw else None
            except Exception:   # (the message only: a Redis error here is the next read's)
                theirs = None
        if theirs is None or theirs.key != key:
            kv, handoff, transfer = (key.split(".") + ["0", "0"])[:3]
            theirs = Compat(kv, int(transfer) if transfer.isdigit() else 0, int(handoff) if handoff.isdigit() else 0)
        return self.mine.differs(theirs)
