"""The Responses API's state, all in Redis, so a gateway killed mid-answer loses nothing: any
gateway (the same one restarted, or another) reads, resumes, chains and finishes a response.

Keys (the cluster's prefix, so one hash slot):

- ``gwresp:<response id>``: a hash: ``tenant``, ``created_at``, ``model``, ``background``,
  ``store``, ``params`` (what the response object echoes), ``items`` (this turn's input
  items), ``conversation`` (its prompt's messages but the instructions: what a next turn
  continues), ``deadline_at`` (its request's, from the creating gateway's ``--timeout``),
  ``cancelled`` (asked); once ended ``status``, ``outcome`` (text, the stream's deltas,
  finish, prompt tokens, the output's token ids, cached tokens, error) and ``completed_at``.
  Each record holds its whole conversation (a chain of n turns stores O(n^2) messages), so a
  chain does not depend on the records before it.
- ``gwresponses:active``: the responses not ended yet (sorted set by ``created_at``).

A record lives ``ttl_s`` (``pdqueue serve --responses-ttl-s``, 30 days as OpenAI keeps
responses) from its creation, and again from its end. The answer itself is the request's ``out:<id>`` stream,
which the workers write whatever the gateways do and which lives an hour after its last
entry; a record is *finished* (its outcome copied from that stream, the response taken out of
the active set) by whichever comes first: the gateway answering it, any read of it, or a
gateway's sweep of the active set (``sweep``, every second), which is what finishes a
background response nobody reads, or one whose gateway died. Finishing is one script that
writes only a record that exists and has not ended: every writer computes the same outcome
from the same stream, and the first one's status stands (a cancel asked before is kept).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace

from pdqueue.client import RequestFailed
from pdqueue.frontends import responses_compat as rc
from pdqueue.frontends.responses_compat import FINAL, Outcome, Record
from pdqueue.keys import Keys

log = logging.getLogger("pdqueue.frontends.gateway")

__all__ = ["DEFAULT_TTL_S", "ResponseKeys", "ResponsesStore"]

DEFAULT_TTL_S = 30 * 86400
LOST_GRACE_S = 60.0     # past its request's deadline + this, a response with no end has failed
SWEEP_BATCH = 200       # active responses looked at per sweep
READ_S = 10.0           # reading an ended answer to its end

# KEYS: the record, the active set; ARGV: id, status, outcome, completed_at, ttl. Returns the
# record's final status ("" when there is no record: deleted, or never stored).
_FINISH = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('ZREM', KEYS[2], ARGV[1])
  return ''
end
local ended = redis.call('HGET', KEYS[1], 'status')
if ended then
  redis.call('ZREM', KEYS[2], ARGV[1])
  return ended
end
local status = ARGV[2]
if redis.call('HGET', KEYS[1], 'cancelled') == '1' and status ~= 'failed' then status = 'cancelled' end
redis.call('HSET', KEYS[1], 'status', status, 'outcome', ARGV[3], 'completed_at', ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[5])
redis.call('ZREM', KEYS[2], ARGV[1])
return status
"""


class ResponseKeys:
    def __init__(self, keys: Keys):
        self.prefix = keys.prefix

    def record(self, response_id: str) -> str:
        return f"{self.prefix}gwresp:{response_id}"

    @property
    def active(self) -> str:
        return self.prefix + "gwresponses:active"


def _text(raw: dict) -> dict:
    return {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in raw.items()}


def _record(response_id: str, raw: dict) -> Record:
    d = _text(raw)
    outcome = Outcome.from_json(json.loads(d["outcome"])) if d.get("outcome") else None
    return Record(response_id, d["tenant"], int(d["created_at"]), d["model"], d["background"] == "1",
                  d.get("store", "1") == "1", json.loads(d["params"]), tuple(json.loads(d["items"])),
                  tuple(json.loads(d["conversation"])), d.get("status") or None, outcome,
                  int(d["completed_at"]) if d.get("completed_at") else None,
                  float(d["deadline_at"]) if d.get("deadline_at") else None)


class ResponsesStore:
    """The records. ``client``: the gateway's ``AsyncClient`` (made when it starts: a
    function that returns it), whose Redis client the records use and which reads answers."""

    def __init__(self, keys: Keys, ttl_s: int, client):
        self.rkeys = ResponseKeys(keys)
        self.keys = keys
        self.ttl_s = int(ttl_s)
        self._client = client

    @property
    def client(self):
        return self._client()

    @property
    def r(self):
        return self.client.redis

    async def create(self, rec: Record) -> None:
        mapping = {"tenant": rec.tenant, "created_at": rec.created_at, "model": rec.model,
                   "background": "1" if rec.background else "0", "store": "1", "params": json.dumps(rec.params),
                   "items": json.dumps(list(rec.items)), "conversation": json.dumps(list(rec.conversation)),
                   "deadline_at": "" if rec.deadline_at is None else repr(rec.deadline_at)}
        key = self.rkeys.record(rec.id)
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(key, mapping=mapping)
        pipe.expire(key, self.ttl_s)
        pipe.zadd(self.rkeys.active, {rec.id: rec.created_at})
        await pipe.execute()

    async def load(self, response_id: str, tenant: str, param: str = "response_id") -> Record:
        """The tenant's response; a 404 for an unknown id, or another tenant's."""
        if not rc.valid_response_id(response_id):
            raise rc.not_found(response_id, param)
        raw = await self.r.hgetall(self.rkeys.record(response_id))
        if not raw or _text(raw).get("tenant") != tenant:
            raise rc.not_found(response_id, param)
        try:
            return _record(response_id, raw)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("response %s: its record is unreadable (%s); treated as absent", response_id, exc)
            raise rc.not_found(response_id, param) from None

    async def delete(self, response_id: str) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(self.rkeys.record(response_id))
        pipe.zrem(self.rkeys.active, response_id)
        await pipe.execute()

    async def mark_cancelled(self, response_id: str) -> None:
        await self.r.hset(self.rkeys.record(response_id), "cancelled", "1")

    async def finish(self, rec: Record, outcome: Outcome) -> tuple[Record, str]:
        """Write ``outcome`` unless the record has ended already; the record as it ended, and
        its status (for a response not stored: ``rec`` with ``outcome``)."""
        status = outcome.status
        if rec.store:
            written = await self.r.eval(_FINISH, 2, self.rkeys.record(rec.id), self.rkeys.active, rec.id, status,
                                        json.dumps(outcome.to_json()), int(time.time()), self.ttl_s)
            status = (written.decode() if isinstance(written, bytes) else written) or status
            raw = await self.r.hgetall(self.rkeys.record(rec.id))
            try:
                ended = _record(rec.id, raw) if raw else None
            except (ValueError, KeyError, TypeError):
                ended = None
            if ended is not None and ended.outcome is not None:
                return ended, ended.status or status
        return replace(rec, status=status, outcome=outcome, completed_at=int(time.time())), status

    async def ended(self, rec: Record) -> tuple[Record, str]:
        """``rec`` with its status now: an ended record as it is; else its answer looked at
        (one XREVRANGE), and, if it has ended, read and the record finished; else
        ``queued`` (no answer yet) or ``in_progress``, or ``failed`` when it had no end past
        its time (lost)."""
        if rec.status is not None:
            return rec, rec.status
        last = await self.r.xrevrange(self.keys.out(rec.request_id), count=1)
        kind = _text(last[0][1]).get("type") if last else None
        outcome = None
        if kind in ("done", "error"):
            outcome = await self.read_outcome(rec.request_id)
        elif rec.deadline_at is not None and time.time() > rec.deadline_at + LOST_GRACE_S:
            outcome = Outcome.failed([], None, "the response has no complete answer: its requests's deadline passed "
                                               "(or its answer expired unread)")
        if outcome is None:
            return rec, "in_progress" if last else "queued"
        return await self.finish(rec, outcome)

    async def read_outcome(self, request_id: str) -> Outcome | None:
        """An ended answer read from the start: the same deltas every reader gets. None if it
        did not end within ``READ_S`` (it had not, after all)."""
        handle = self.client.handle(request_id)
        deltas: list[str] = []
        try:
            async for batch in handle.batches(timeout=READ_S):
                deltas.extend(e.text for e in batch if e.text)
        except RequestFailed as exc:
            return Outcome.failed(deltas, exc.code, exc.reason)
        except TimeoutError:
            return None
        return Outcome.of(handle.completion, deltas)

    async def sweep(self) -> int:
        """One look at the active responses: finish those that ended (or were lost), drop
        those whose record is gone. Returns how many were finished or dropped."""
        ids = [i.decode() if isinstance(i, bytes) else i
               for i in await self.r.zrange(self.rkeys.active, 0, SWEEP_BATCH - 1)]
        done = 0
        for response_id in ids:
            raw = await self.r.hgetall(self.rkeys.record(response_id))
            if not raw:
                await self.r.zrem(self.rkeys.active, response_id)
                done += 1
                continue
            try:
                rec = _record(response_id, raw)
            except (ValueError, KeyError, TypeError):
                await self.r.zrem(self.rkeys.active, response_id)
                done += 1
                continue
            _, status = await self.ended(rec)
            if status in FINAL:
                await self.r.zrem(self.rkeys.active, response_id)
                done += 1
        return done

