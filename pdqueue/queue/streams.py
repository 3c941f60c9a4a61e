"""Thin helpers over redis-py for Redis Streams with consumer groups.

Conventions: stream names and entry ids come back as ``str``; entry fields come back as
redis returns them (``bytes`` keys and values with the default client), which the
protocol parsers accept. Transactions are built by callers with
``r.pipeline(transaction=True)``; the ``*_into`` helpers add commands to such a pipeline.

The rule these serve (DESIGN, principle 1): a worker acknowledges its input only in the
same MULTI/EXEC that writes its output. How the workers do it (workers/answers.py): every
answer to an input entry, whether its outcome or a rejection, goes through
``queue.ownership.ack_and_write``, which acknowledges the entry and writes the outcome only
if this worker still owns it (a worker whose entry was claimed meanwhile writes nothing).
Token entries are plain XADDs (``ownership.Write`` as an op). The ops run as one unit of a
``Publisher``, i.e. one MULTI/EXEC, e.g. a prefill worker's first token and handoff::

    entries = read_group(r, PREFILL_GROUP, worker_id, keys.request_streams,   # high first
                         count=limit, block_ms=block_ms)
    ...   # per entry: claim_request, prefill, ticket = sender.export(...)
    with r.pipeline(transaction=True) as pipe:   # the workers: publisher.submit(unit.ops)
        Write(keys.out(rid), token_entry(0, [t], text), ttl_ms=OUT_TTL_S * 1000)(pipe)
        ack_and_write(pipe, stream, PREFILL_GROUP, entry_id,
                      [Write(keys.handoff_node(node), encode_handoff(handoff))])
        pipe.execute()

``ack_into``, ``xadd_into``, ``xadd_expiring`` and ``dead_letter`` add the plain commands to
a pipeline, for tools and tests; ``dead_record`` is the dead-letter entry itself.

Imports redis and pdqueue.keys only.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, NamedTuple

import redis

from pdqueue.keys import DEAD_MAXLEN, SEEN_TTL_S, Keys
from pdqueue.protocol import as_str

Entry = tuple[str, str, dict]
"""(stream, entry_id, fields)"""


def request_streams_of(r: redis.Redis, keys: Keys) -> list[str]:
    """Every request stream of the cluster: ``requests:high``, ``requests``, then each
    worker's own stream (``requests:w:<id>``: routed requests, workers/routing.py)."""
    own = sorted(as_str(m) for m in r.smembers(keys.routed_streams))
    return [*keys.request_streams, *own]


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


class Claimed(NamedTuple):
    next_id: str            # cursor for the next call; "0-0" when the scan wrapped around
    entries: list[Entry]    # now owned by the claiming consumer
    deleted_ids: list[str]  # pending entries that no longer exist (removed from the PEL)


def parse_autoclaim(stream: str, reply: Any) -> Claimed:
    """Normalize an XAUTOCLAIM reply: Redis >= 7 sends [next, entries, deleted_ids];
    6.2 sends [next, entries] with nil in place of deleted entries. (6.2 also leaves those
    in the PEL and tells not their ids; they are dropped here.)"""
    if not isinstance(reply, (list, tuple)) or len(reply) not in (2, 3):
        raise ValueError(f"unexpected XAUTOCLAIM reply: {reply!r}")
    entries = [(stream, as_str(eid), fields or {}) for item in (reply[1] or [])
               if item is not None and item[0] is not None for eid, fields in [item]]
    deleted = [as_str(eid) for eid in reply[2]] if len(reply) == 3 and reply[2] else []
    return Claimed(as_str(reply[0]), entries, deleted)


def autoclaim(r: redis.Redis, stream: str, group: str, consumer: str, min_idle_ms: int,
              count: int = 100, start_id: str = "0-0") -> Claimed:
    """Take over entries of ``stream`` pending longer than ``min_idle_ms`` in ``group``
    (their consumer is presumed dead). Call again with ``next_id`` until it is "0-0" to
    scan the whole pending list."""
    reply = r.xautoclaim(stream, group, consumer, min_idle_ms, start_id=start_id, count=count)
    return parse_autoclaim(stream, reply)


def read_own_pending(r: redis.Redis, group: str, consumer: str, streams: Iterable[str],
                     count: int = 100) -> list[Entry]:
    """Entries delivered to ``consumer`` and never acknowledged (a worker restarted under
    the same consumer name resumes them). Fields are None for entries deleted since;
    acknowledge those."""
    result: list[Entry] = []
    for stream in streams:
        result.extend(parse_read_reply(r.xreadgroup(group, consumer, {stream: "0"}, count=count)))
    return result


def claim_request_id(r: redis.Redis, keys: Keys, request_id: str, entry_id: str,
                     ttl_s: int = SEEN_TTL_S) -> bool:
    """Idempotency check before running a request: True if this entry may run (the id is
    new, or this is a redelivery of the very entry that first carried it), False if
    another entry already took the id (a duplicate: acknowledge it, answer nothing on
    ``out:<id>``, which belongs to the first one)."""
    return claim_request(r, keys, request_id, entry_id, ttl_s)[0]


def claim_request(r: redis.Redis, keys: Keys, request_id: str, entry_id: str,
                  ttl_s: int = SEEN_TTL_S) -> tuple[bool, bool]:
    """``claim_request_id`` and whether the request was cancelled, in one round trip:
    (may_run, cancelled)."""
    key = keys.seen(request_id)
    pipe = r.pipeline(transaction=False)
    pipe.set(key, entry_id, nx=True, ex=ttl_s)
    pipe.get(key)   # ours if the SET took, else the entry that took the id first
    pipe.exists(keys.cancel(request_id))
    _, current, cancelled = pipe.execute()
    return current is None or as_str(current) == as_str(entry_id), bool(cancelled)


def touch(r: redis.Redis, stream: str, group: str, consumer: str, entry_ids: list[str]) -> None:
    """Reset the idle time of ``entry_ids`` for ``consumer``, so a long-running but live
    worker is not mistaken for a dead one by ``autoclaim``. Unconditional: it claims entries
    another consumer took meanwhile back. The workers use ``ownership.touch_owned``, which
    touches only those still theirs and reports the others."""
    if entry_ids:
        r.xclaim(stream, group, consumer, 0, entry_ids, justid=True)


# -- pipeline helpers ----------------------------------------------------------------------

def xadd_into(pipe, stream: str, fields: Mapping, maxlen: int | None = None) -> None:
    """XADD, trimmed approximately to ``maxlen`` entries when given."""
    if maxlen is None:
        pipe.xadd(stream, dict(fields))
    else:
        pipe.xadd(stream, dict(fields), maxlen=maxlen, approximate=True)


def xadd_expiring(pipe, stream: str, fields: Mapping, ttl_s: float) -> None:
    """XADD then (re)set the stream's TTL: an answer stream lives ``ttl_s`` after its last write."""
    pipe.xadd(stream, dict(fields))
    pipe.pexpire(stream, max(1, int(ttl_s * 1000)))


def ack_into(pipe, stream: str, group: str, entry_id: str, delete: bool = True) -> None:
    """XACK (and XDEL, so the stream does not grow without bound: trimming with MAXLEN
    would drop entries not yet read)."""
    pipe.xack(stream, group, entry_id)
    if delete:
        pipe.xdel(stream, entry_id)


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


def dead_letter(pipe, keys: Keys, fields: Mapping, reason: str, source_stream: str,
                entry_id: str, code: str = "bad_request", worker: str = "",
                maxlen: int = DEAD_MAXLEN) -> None:
    """Copy an entry to the dead-letter stream with why it died (``dead_record``)."""
    record = dead_record(fields, reason, source_stream, entry_id, code, worker)
    pipe.xadd(keys.dead, record, maxlen=maxlen, approximate=True)
