"""Exactly-once hand-over of a stream entry's outcome, and keeping ownership alive.

A worker's output for an input entry (a handoff for a request, a completion for a
handoff) is written only if the worker still owns the entry at that moment: one Lua script
acknowledges the entry and, only if the XACK removed it from the group's pending list,
deletes it and performs the writes. A worker that hung (SIGSTOP) while another one took its
entry over (XCLAIM) therefore cannot publish a second outcome when it wakes: exactly one
``done`` per request, whoever finishes first. Token entries carry their index and are
de-duplicated by clients, so they need no such guard.

A write may carry a *guard* key of its own (``Write(guard=)``): inside the script it happens
only if ``SET guard NX`` succeeds. The usage ledger (pdqueue/queue/ledger.py) writes a
request's record so, in the same script as its ``done``: both survive a failover or
neither, and a second final answer for the same request id (a copy of the request run after
a failover lost its ``seen:<id>``) adds no second record. A stream write may be trimmed by
count (``maxlen``) or by age (``min_id_ms``: ``XADD MINID ~``).

``touch_owned`` resets the idle time of the entries a live worker still works on (long
generations) without stealing entries that another worker has meanwhile claimed; it
returns the ids this worker lost, so it can abort them.

All keys of a pdqueue cluster share one hash slot, so the scripts run on Redis Cluster too.
Imports redis and pdqueue.protocol (``as_str``) only.
"""

from __future__ import annotations

import json
from typing import Mapping

from pdqueue.protocol import as_str

# KEYS[1] = input stream; KEYS[2..] = keys the writes touch.
# ARGV[1] = group, ARGV[2] = entry id, ARGV[3] = JSON list of writes
#   [key_index (into KEYS), ttl_ms (0 = none), maxlen (0 = none), num_args,
#    guard_index (into KEYS; 0 = none), guard_ttl_ms, min_id ("" = none)];
# ARGV[4..] = each write's field names and values in turn (binary-safe: not in the JSON).
# A guarded write happens only if SET guard NX (value: the input entry id) succeeds.
_ACK_AND_WRITE = """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then
  return 0
end
redis.call('XDEL', KEYS[1], ARGV[2])
local at = 4
for _, w in ipairs(cjson.decode(ARGV[3])) do
  local key = KEYS[w[1]]
  local args = {}
  for i = 0, w[4] - 1 do args[#args + 1] = ARGV[at + i] end
  at = at + w[4]
  if w[5] == 0 or redis.call('SET', KEYS[w[5]], ARGV[2], 'NX', 'PX', w[6]) then
    if w[3] > 0 then
      redis.call('XADD', key, 'MAXLEN', '~', w[3], '*', unpack(args))
    elseif w[7] ~= '' then
      redis.call('XADD', key, 'MINID', '~', w[7], '*', unpack(args))
    else
      redis.call('XADD', key, '*', unpack(args))
    end
    if w[2] > 0 then
      redis.call('PEXPIRE', key, w[2])
    end
  end
end
return 1
"""

# KEYS[1] = input stream, KEYS[2] = destination stream, KEYS[3] = the request's seen: key;
# ARGV[1] = group, ARGV[2] = entry id, ARGV[3..] = the entry's field names and values.
# The destination must exist (its owner made it with its group): else nothing happens (0),
# and the caller runs the request itself. The seen: key follows the entry to its new id, so
# the destination's intake does not take the moved entry for a duplicate.
_FORWARD = """
if redis.call('EXISTS', KEYS[2]) == 0 then
  return 0
end
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then
  return -1
end
redis.call('XDEL', KEYS[1], ARGV[2])
local args = {}
for i = 3, #ARGV do args[#args + 1] = ARGV[i] end
local id = redis.call('XADD', KEYS[2], '*', unpack(args))
if redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('SET', KEYS[3], id, 'KEEPTTL')
end
return 1
"""

# KEYS[1] = stream; ARGV[1] = group, ARGV[2] = consumer, ARGV[3..] = entry ids.
_TOUCH_OWNED = """
local lost = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    table.insert(lost, ARGV[i])
  end
end
return lost
"""


class Write:
    """One XADD of ``fields`` to ``key``, trimmed (approximately) to ``maxlen`` entries or to
    the entries added since ``min_id_ms`` (unix ms), and giving ``key`` a TTL of ``ttl_ms``
    (0: none of these). The one write type: inside ``ack_and_write`` it happens only if the
    entry was still pending (and, with a ``guard`` key, only if ``SET guard NX PX
    guard_ttl_ms`` succeeds); called as a ``Publisher`` op (``write(pipe)``) it is a plain
    XADD, for entries that need no guard (tokens carry their index, and clients drop
    repeats): a guarded or age-trimmed write runs inside ``ack_and_write`` only."""

    __slots__ = ("key", "fields", "ttl_ms", "maxlen", "guard", "guard_ttl_ms", "min_id_ms")

    def __init__(self, key: str, fields: Mapping, ttl_ms: int = 0, maxlen: int = 0, *, guard: str = "",
                 guard_ttl_ms: int = 0, min_id_ms: int = 0):
        if maxlen and min_id_ms:
            raise ValueError("a write is trimmed by maxlen or by min_id_ms, not both")
        if guard and guard_ttl_ms <= 0:
            raise ValueError("a guard key needs a TTL (guard_ttl_ms > 0)")
        self.key, self.fields, self.ttl_ms, self.maxlen = key, fields, int(ttl_ms), int(maxlen)
        self.guard, self.guard_ttl_ms, self.min_id_ms = guard, int(guard_ttl_ms), int(min_id_ms)

    def __call__(self, pipe) -> None:
        if self.guard or self.min_id_ms:
            raise ValueError(f"{self!r} runs inside ack_and_write only")
        if self.maxlen:
            pipe.xadd(self.key, dict(self.fields), maxlen=self.maxlen, approximate=True)
        else:
            pipe.xadd(self.key, dict(self.fields))
        if self.ttl_ms:
            pipe.pexpire(self.key, self.ttl_ms)

    def __repr__(self) -> str:
        guard = f", guard={self.guard!r}" if self.guard else ""
        return f"Write({self.key!r}, ttl_ms={self.ttl_ms}, maxlen={self.maxlen}{guard})"


def ack_and_write(pipe, stream: str, group: str, entry_id: str, writes: list[Write]) -> None:
    """Add to ``pipe``: XACK+XDEL ``entry_id`` and, only if it was still pending, the writes.
    The script's reply (1 written, 0 skipped) is in the pipeline's results."""
    keys = [stream]
    spec = []
    args: list = []
    for w in writes:
        for key in (w.key, w.guard) if w.guard else (w.key,):
            if key not in keys:
                keys.append(key)
        flat = [x for item in w.fields.items() for x in item]
        spec.append([keys.index(w.key) + 1, w.ttl_ms, w.maxlen, len(flat),
                     keys.index(w.guard) + 1 if w.guard else 0, w.guard_ttl_ms,
                     f"{w.min_id_ms}-0" if w.min_id_ms else ""])
        args += flat
    pipe.eval(_ACK_AND_WRITE, len(keys), *keys, group, entry_id, json.dumps(spec), *args)


def forward(r, stream: str, group: str, entry_id: str, fields: Mapping, destination: str, seen_key: str) -> int:
    """Move a pending entry to another stream, exactly once: XACK+XDEL it and XADD its
    ``fields`` to ``destination`` in one script, only if it was still pending (else -1:
    someone finished it) and ``destination`` exists (else 0, nothing done); 1 when moved."""
    flat = [x for item in fields.items() for x in item]
    return int(r.eval(_FORWARD, 3, stream, destination, seen_key, group, entry_id, *flat))


def touch_owned(r, stream: str, group: str, consumer: str, entry_ids: list[str]) -> list[str]:
    """Reset the idle time of ``entry_ids`` still owned by ``consumer``; returns the ids it
    no longer owns (claimed by another worker, or acknowledged)."""
    if not entry_ids:
        return []
    lost = r.eval(_TOUCH_OWNED, 1, stream, group, consumer, *entry_ids)
    return [as_str(x, "surrogateescape") for x in lost]
