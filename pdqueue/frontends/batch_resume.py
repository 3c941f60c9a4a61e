"""Sending a batch's requests so that each is computed once across crashes: a request
already in Redis is re-attached to, never sent again.

- ``out:<id>`` exists (running or finished), or ``seen:<id>`` names an entry still in a
  request stream (queued or running): re-attach. The submit writes ``seen:<id>`` (the
  idempotency key intake checks; its value is the entry id) and the entry in one script,
  so no request is ever queued but unmarked.
- ``seen:<id>`` set, its entry finished and ``out:<id>`` expired (OUT_TTL_S after its last
  write): nothing of it is left, so it is computed again under ``<id>.2`` (then ``.3``...).
"""

from __future__ import annotations

import dataclasses
import re

import redis

from pdqueue.frontends.batch_input import request_id
from pdqueue.keys import SEEN_TTL_S, Keys
from pdqueue.protocol import request_to_fields
from pdqueue.queue.streams import request_streams

__all__ = ["MAX_ATTEMPTS", "place"]

MAX_ATTEMPTS = 5              # ids <id>, <id>.2 ... <id>.5 when answers expired before they were read
_ENTRY_ID = re.compile(r"^[0-9]+-[0-9]+$")


# XADD + SET seen:<id> in one step. KEYS: request stream, seen key; ARGV: ttl, field, value, ...
# Returns {1, entry id} when queued, {0, the entry id already holding the id} otherwise.
_SUBMIT = """
local cur = redis.call('GET', KEYS[2])
if cur then return {0, cur} end
local eid = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 2))
redis.call('SET', KEYS[2], eid, 'EX', tonumber(ARGV[1]))
return {1, eid}
"""


def place(r: redis.Redis, keys: Keys, batch_id: str, jobs: list) -> tuple[list, list]:
    """Send each job's request (``job.request``, ``job.attempt``, ``job.custom_id``), or
    re-attach to it. Returns ``(placed, lost)``: ``placed`` holds ``(job, "submitted" |
    "reattached")``, ``lost`` the jobs whose answers expired unread ``MAX_ATTEMPTS``
    times. Idempotent: run again after a lost connection, it re-attaches to what the first
    try sent."""
    placed: list[tuple[object, str]] = []   # (job, "submitted" | "reattached")
    lost: list = []
    pending = list(jobs)
    while pending:
        pipe = r.pipeline(transaction=True)
        for job in pending:
            pipe.exists(keys.out(job.request.id))
            pipe.get(keys.seen(job.request.id))
        state = pipe.execute()
        fresh, queued = [], []
        for i, job in enumerate(pending):
            has_out, seen = state[2 * i], state[2 * i + 1]
            if has_out:
                placed.append((job, "reattached"))
            elif seen is None:
                fresh.append(job)
            else:
                queued.append((job, seen.decode() if isinstance(seen, bytes) else str(seen)))
        if fresh:
            pipe = r.pipeline(transaction=False)
            for job in fresh:
                req = job.request
                stream = keys.request_stream_for(req.cls)
                args = [SEEN_TTL_S]
                for name, value in request_to_fields(req).items():
                    args += [name, value]
                # EVAL, not a registered script's EVALSHA: redis-py's cluster pipelines
                # refuse EVALSHA, and a replica promoted at a failover has no script cache.
                pipe.eval(_SUBMIT, 2, stream, keys.seen(req.id), *args)
            for job, (took, entry) in zip(fresh, pipe.execute()):
                if took:
                    placed.append((job, "submitted"))
                else:  # someone sent it between the two round trips
                    queued.append((job, entry.decode() if isinstance(entry, bytes) else str(entry)))
        pending = []
        if queued:
            # Still queued or running: its entry is in a request stream (finishing deletes
            # the entry and writes out:<id> in one transaction, so one of the two is seen).
            streams = request_streams(keys)
            n = len(streams) + 1   # replies per job: one per stream, then out:<id>
            pipe = r.pipeline(transaction=True)
            for job, entry in queued:
                entry = entry if _ENTRY_ID.match(entry) else "0-0"
                for stream in streams:
                    pipe.xrange(stream, entry, entry, count=1)
                pipe.exists(keys.out(job.request.id))
            state = pipe.execute()
            for i, (job, entry) in enumerate(queued):
                if _ENTRY_ID.match(entry) and any(state[n * i:n * i + n - 1]) or state[n * i + n - 1]:
                    placed.append((job, "reattached"))
                elif job.attempt < MAX_ATTEMPTS:   # answered, but the answer expired unread
                    job.attempt += 1
                    job.request = _with_id(job.request, request_id(batch_id, job.custom_id, job.attempt))
                    pending.append(job)
                else:
                    lost.append(job)
    return placed, lost


def _with_id(req, rid: str):
    return dataclasses.replace(req, id=rid)
