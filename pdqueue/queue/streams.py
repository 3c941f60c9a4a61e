"""Thin helpers over redis-py for Redis Streams with consumer groups.

Conventions: stream names and entry ids come back as ``str``; entry fields come back as
redis returns them (``bytes`` keys and values with the default client), which the
protocol parsers accept.

The rule these serve (DESIGN, principle 1): a worker acknowledges its input only in the
same MULTI/EXEC that writes its output; the workers do it with
``queue.ownership.ack_and_write`` (workers/answers.py), which writes only if the entry is
still theirs. ``dead_record`` is a dead-letter entry. (The plain pipeline helpers the tests
use live in tests/redis_ops.py.)

Imports redis, pdqueue.keys and pdqueue.protocol (``as_str``, ``ServiceClass``) only.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import redis

from pdqueue.keys import SEEN_TTL_S, Keys
from pdqueue.protocol import ServiceClass, as_str
from pdqueue.protocol.compat import compat_of

Entry = tuple[str, str, dict]
"""(stream, entry_id, fields)"""


def request_streams(keys: Keys) -> tuple[str, ...]:
    """The service classes' request streams, in class order (``ServiceClass``: interactive's
    ``requests:high``, standard's ``requests``, batch's ``requests:batch``)."""
    return tuple(keys.request_stream_for(c) for c in ServiceClass)


def request_streams_of(r: redis.Redis, keys: Keys) -> list[str]:
    """Every request stream of the cluster: the classes' (``request_streams``), then each
    worker's own stream (``requests:w:<id>``: routed requests, workers/routing.py)."""
    own = sorted(as_str(m) for m in r.smembers(keys.routed_streams))
    return [*request_streams(keys), *own]


def handoff_streams_of(keys: Keys, workers: Iterable[Mapping]) -> list[str]:
    """Every handoff stream the listed workers (``registry.list_workers``) may leave entries in:
    the shared one, each node's, and each compatibility kind's (``protocol.compat``: used while
    the cluster is mixed). For backlogs: a reader of only the first two misses a mixed cluster's."""
    nodes = sorted({w["node"] for w in workers if w.get("node")})
    kinds = sorted({c.key for c in (compat_of(w) for w in workers) if c is not None})
    return [keys.handoff, *(keys.handoff_node(n) for n in nodes), *(keys.handoff_compat(k) for k in kinds)]


def handoff_streams_found(r: redis.Redis, keys: Keys) -> list[str]:
    """Every handoff stream Redis holds now, found by SCAN: the shared one, then each node's and
    each compatibility kind's, sorted. Unlike ``handoff_streams_of`` it also finds the stream of
    a node or kind whose workers are gone, with entries still in it: for what must see every
    entry (metrics, ``status``, ``up``'s stop), where the other is for a live cluster's backlog."""
    found = {as_str(k, "replace") for k in r.scan_iter(match=keys.handoff_node("*"), count=500, _type="stream")}
    return [keys.handoff, *sorted(found - {keys.handoff})]


def ensure_group(r: redis.Redis, stream: str, group: str, start_id: str = "0") -> bool:
    """Create ``group`` on ``stream`` (and the stream itself); True if created, False if it
    existed. Starts at "0" so entries added before the first worker came up are served."""
    try:
        r.xgroup_create(stream, group, id=start_id, mkstream=True)
        return True
    except redis.ResponseError as exc:
        if "BUSYGROUP" in str(exc):
            return False
        raise


def _normalize_read(reply: Any) -> list[tuple[str, list]]:
    """XREAD/XREADGROUP replies come as [[stream, entries], ...] (RESP2 shape, redis-py's
    default) or {stream: entries} / {stream: [entries]} (RESP3 shapes)."""
    if not reply:
        return []
    if isinstance(reply, dict):
        out = []
        for stream, value in reply.items():
            if value and isinstance(value[0], list):  # {stream: [[entries]]}
                value = value[0]
            out.append((as_str(stream), value))
        return out
    return [(as_str(stream), entries) for stream, entries in reply]


def parse_read_reply(reply: Any) -> list[Entry]:
    """(stream, entry_id, fields) triples of an XREAD/XREADGROUP reply, in reply order."""
    return [(stream, as_str(eid), fields)
            for stream, entries in _normalize_read(reply)
            for eid, fields in entries if eid is not None]


def read_group(r: redis.Redis, group: str, consumer: str, streams: Iterable[str],
               count: int = 1, block_ms: int | None = None) -> list[Entry]:
    """Read up to ``count`` new entries for ``consumer``, higher-priority streams first.

    ``streams`` is in priority order. One non-blocking XREADGROUP per stream in order, each
    asking only for what is still missing, so a lower stream is never read while a higher
    one can fill the batch. Only if all are empty and ``block_ms`` is set does it block on
    all of them at once and return what that one call brings: at most ``count //
    len(streams)`` (at least 1) per stream, so ``max(count, len(streams))`` in all. (No
    top-up reads after the wake: they cost two round trips on every idle worker's first
    request, and the next call reads the higher streams first anyway.)
    """
    streams = list(streams)
    result = _read_pass(r, group, consumer, streams, count)
    if result or not block_ms:
        return result
    per_stream = max(1, count // len(streams))
    reply = r.xreadgroup(group, consumer, {s: ">" for s in streams}, count=per_stream, block=block_ms)
    order = {s: i for i, s in enumerate(streams)}
    return sorted(parse_read_reply(reply), key=lambda e: order.get(e[0], len(order)))  # stable: FIFO per stream


def _read_pass(r: redis.Redis, group: str, consumer: str, streams: list[str],
               count: int) -> list[Entry]:
    result: list[Entry] = []
    for stream in streams:
        missing = count - len(result)
        if missing <= 0:
            break
        reply = r.xreadgroup(group, consumer, {stream: ">"}, count=missing)
        result.extend(parse_read_reply(reply))
    return result


def read_own_pending(r: redis.Redis, group: str, consumer: str, streams: Iterable[str],
                     count: int = 100) -> list[Entry]:
    """Entries delivered to ``consumer`` and never acknowledged (a worker restarted under
    the same consumer name resumes them). Fields are None for entries deleted since;
    acknowledge those."""
    result: list[Entry] = []
    for stream in streams:
        result.extend(parse_read_reply(r.xreadgroup(group, consumer, {stream: "0"}, count=count)))
    return result


def claim_request(r: redis.Redis, keys: Keys, request_id: str, entry_id: str,
                  ttl_s: int = SEEN_TTL_S) -> tuple[bool, bool]:
    """Idempotency check before running a request, and whether it was cancelled, in one
    round trip: (may_run, cancelled). ``may_run``: the id is new, or this is a redelivery of
    the very entry that first carried it; False: another entry already took the id (a
    duplicate: acknowledge it, answer nothing on ``out:<id>``, which belongs to the first
    one)."""
    key = keys.seen(request_id)
    pipe = r.pipeline(transaction=False)
    pipe.set(key, entry_id, nx=True, ex=ttl_s)
    pipe.get(key)   # ours if the SET took, else the entry that took the id first
    pipe.exists(keys.cancel(request_id))
    _, current, cancelled = pipe.execute()
    return current is None or as_str(current) == as_str(entry_id), bool(cancelled)


def dead_record(fields: Mapping, reason: str, source_stream: str, entry_id: str,
                code: str = "bad_request", worker: str = "") -> dict:
    """The dead-letter entry of an input entry that died: why, where from, and the original
    fields kept byte for byte under a ``field:`` prefix."""
    record: dict[Any, Any] = {"reason": reason, "code": str(getattr(code, "value", code)),
                              "source": source_stream, "entry_id": as_str(entry_id)}
    if worker:
        record["worker"] = worker
    for name, value in fields.items():
        name = name if isinstance(name, bytes) else str(name).encode()
        record[b"field:" + name] = value
    return record
