"""Redis stream helpers that only the tests use (moved out of ``pdqueue.queue``): XAUTOCLAIM,
the unconditional ``touch`` (an XCLAIM; the workers use ``ownership.touch_owned``), plain
pipeline commands, ``XAdd`` and the ``Registry`` facade."""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import redis

from pdqueue.keys import DEAD_MAXLEN, SEEN_TTL_S, Keys
from pdqueue.protocol import as_str
from pdqueue.queue.ownership import Write
from pdqueue.queue.registry import Heartbeat, _decode_worker, list_workers
from pdqueue.queue.streams import Entry, claim_request, dead_record


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


def claim_request_id(r: redis.Redis, keys: Keys, request_id: str, entry_id: str,
                     ttl_s: int = SEEN_TTL_S) -> bool:
    """``streams.claim_request`` without the cancellation check."""
    return claim_request(r, keys, request_id, entry_id, ttl_s)[0]


def touch(r: redis.Redis, stream: str, group: str, consumer: str, entry_ids: list[str]) -> None:
    """Reset the idle time of ``entry_ids`` for ``consumer``, so a long-running but live
    worker is not mistaken for a dead one by ``autoclaim``. Unconditional: it claims entries
    another consumer took meanwhile back. The workers use ``ownership.touch_owned``, which
    touches only those still theirs and reports the others."""
    if entry_ids:
        r.xclaim(stream, group, consumer, 0, entry_ids, justid=True)


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


def dead_letter(pipe, keys: Keys, fields: Mapping, reason: str, source_stream: str,
                entry_id: str, code: str = "bad_request", worker: str = "",
                maxlen: int = DEAD_MAXLEN) -> None:
    """Copy an entry to the dead-letter stream with why it died (``dead_record``)."""
    record = dead_record(fields, reason, source_stream, entry_id, code, worker)
    pipe.xadd(keys.dead, record, maxlen=maxlen, approximate=True)


def XAdd(stream: str, fields: Mapping, maxlen: int | None = None, ttl_s: float | None = None) -> Write:
    """A plain XADD op (TTL in seconds): a ``Write``, whose TTL is in milliseconds."""
    return Write(stream, fields, ttl_ms=0 if ttl_s is None else max(1, int(ttl_s * 1000)), maxlen=maxlen or 0)


class Registry:
    """Register a process (``heartbeat``) and look up the others, over one client."""

    def __init__(self, r: redis.Redis, keys: Keys):
        self._r = r
        self.keys = keys

    def heartbeat(self, worker_id: str, **kwargs: Any) -> Heartbeat:
        """A started ``Heartbeat``; see its constructor for ``kwargs``."""
        return Heartbeat(self._r, self.keys, worker_id, **kwargs).start()

    def list_workers(self, role: str | None = None) -> list[dict[str, Any]]:
        return list_workers(self._r, self.keys, role)

    def get(self, worker_id: str) -> dict[str, Any] | None:
        key = self.keys.worker(worker_id)
        raw = self._r.hgetall(key)
        return _decode_worker(self.keys, key, raw) if raw else None
