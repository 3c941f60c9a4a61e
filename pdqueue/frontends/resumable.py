"""Who a completion request is, and the record that makes it resumable.

``X-Request-Id`` becomes the pdqueue request id (a repeated id gets the first request's
answer: pdqueue runs an id once). ``Idempotency-Key`` names it too and makes it resumable:
a retry with the same key attaches to the first request (a retry with other parameters is
a 422), its stream's events carry SSE ids, and a client that hangs up does not cancel it.
``Last-Event-ID: k`` re-attaches and sends the items after ``k``.

The record (``pdq:{NAME}:gw:<id>``: endpoint, model, ``created``, ``include_usage``, a
hash of the parameters) is what a re-attach on any gateway formats the rest of the answer
with; it outlives the answer in ``out:<id>``."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass

import redis
from starlette.requests import Request

from pdqueue.frontends import openai_compat as oai
from pdqueue.frontends.http_errors import unavailable
from pdqueue.frontends.openai_compat import OpenAIError
from pdqueue.keys import OUT_TTL_S, SEEN_TTL_S, Keys
from pdqueue.protocol import entry_request_id

log = logging.getLogger("pdqueue.frontends.gateway")

__all__ = ["Ident", "Records", "Spec", "ident", "last_event_id", "named", "params_hash", "valid_id",
           "wants_stream"]

@dataclass(frozen=True)
class Ident:
    """A completion request's id, whether it is resumable (``Idempotency-Key``), and the last
    item its client already has (``Last-Event-ID``; None: a new answer)."""
    request_id: str
    resumable: bool
    after: int | None


def valid_id(value: str) -> bool:
    return entry_request_id(None, {"id": value}) == value   # pdqueue's rule for request ids


def named(request: Request) -> str | None:
    return request.headers.get("idempotency-key") or request.headers.get("x-request-id") or None   # "": none


def ident(request: Request, fallback_id: str) -> Ident:
    """``OpenAIError`` 400 for an invalid id, two different ids, or a resume without an id."""
    key, xid = request.headers.get("idempotency-key") or None, request.headers.get("x-request-id") or None
    for name, value in (("Idempotency-Key", key), ("X-Request-Id", xid)):
        if value is not None and not valid_id(value):
            raise oai.bad_request(f"{name}: id must be 1..128 characters of [A-Za-z0-9._:-], got {value[:40]!r}",
                                  name)
    if key is not None and xid is not None and key != xid:
        raise oai.bad_request("X-Request-Id and Idempotency-Key name two different requests: send one, or the "
                              "same value in both", "Idempotency-Key")
    after = last_event_id(request)
    if after is not None and key is None and xid is None:
        raise oai.bad_request("Last-Event-ID resumes a request: send its Idempotency-Key (or X-Request-Id) with it",
                              "Last-Event-ID")
    return Ident(key or xid or fallback_id, key is not None, after)


def last_event_id(request: Request) -> int | None:
    raw = (request.headers.get("last-event-id") or "").strip()
    if not raw:   # none, or an EventSource that had no event yet
        return None
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < -1:
        raise oai.bad_request(f"Last-Event-ID must be the id of an event of the stream (an integer >= -1), "
                              f"got {raw[:40]!r}", "Last-Event-ID")
    return value


def wants_stream(request: Request) -> bool:
    raw = request.query_params.get("stream")
    if raw is None:
        return "text/event-stream" in request.headers.get("accept", "")
    if raw.lower() in ("true", "1", "false", "0"):
        return raw.lower() in ("true", "1")
    raise oai.bad_request(f"stream must be true or false, got {raw[:40]!r}", "stream")


@dataclass(frozen=True)
class Spec:
    """How an answer is written: the endpoint ("completion" or "chat"), the model's name,
    ``created`` (the same in every event, on every gateway), and the usage chunk."""
    kind: str
    model: str
    created: int
    include_usage: bool


def params_hash(kind: str, parsed: oai.Parsed) -> str:
    """What makes two requests the same generation (a retry), whatever else differs
    (streaming or not, stream_options)."""
    text = json.dumps([kind, parsed.model, parsed.submit_kwargs()], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


_RESPONSE_PREFIXES = ("chatcmpl-", "cmpl-")   # oai.new_id: the response id of a request id



class Records:
    """The records of resumable requests in Redis. ``redis``: the gateway's async client
    (set when it starts); ``timeout_s``: the gateway's request timeout."""

    def __init__(self, keys: Keys, timeout_s: float | None):
        self.keys = keys
        self.timeout_s = timeout_s
        self.redis = None
        self._denied = False

    def key(self, request_id: str) -> str:
        return self.keys.gateway_record(request_id)

    async def load(self, request_id: str) -> tuple[Spec, str] | None:
        """The spec and parameters of a resumable request sent before (any gateway), or None."""
        try:
            raw = await self.redis.get(self.key(request_id))
        except redis.ResponseError as exc:   # NOPERM: an ACL that does not grant the records
            self._unavailable(exc)
            return None
        except (redis.RedisError, OSError) as exc:
            raise unavailable(f"cannot reach the cluster's Redis: {exc}") from None
        if raw is None:
            return None
        try:
            data = json.loads(raw)
            return (Spec(str(data["kind"]), str(data["model"]), int(data["created"]), bool(data["include_usage"])),
                    str(data["params"]))
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("request %s: its record is unreadable (%s); treated as absent", request_id, exc)
            return None

    async def save(self, request_id: str, spec: Spec, params: str) -> None:
        # It outlives the answer (out:<id> lives an hour after its last write, at the deadline
        # at the latest); with no deadline, as long as pdqueue remembers the id.
        timeout = self.timeout_s
        ttl = OUT_TTL_S + int(timeout) + 1 if timeout is not None else SEEN_TTL_S
        record = json.dumps({"kind": spec.kind, "model": spec.model, "created": spec.created,
                             "include_usage": spec.include_usage, "params": params}, separators=(",", ":"))
        try:
            await self.redis.set(self.key(request_id), record, ex=ttl, nx=True)
        except redis.ResponseError as exc:
            self._unavailable(exc)
        except (redis.RedisError, OSError) as exc:   # submitted already: the answer goes on
            log.warning("request %s: could not write its record (%s); a retry runs it once all the same",
                        request_id, exc)

    def _unavailable(self, exc: Exception) -> None:
        if not self._denied:
            self._denied = True
            log.warning("cannot read or write the records of resumable requests (%s): a retried Idempotency-Key "
                        "still runs once (pdqueue runs an id once), but GET /v1/requests/{id} cannot find it; "
                        "allow this user GET and SET on %s", exc, self.key("*"))

    async def has_answer(self, request_id: str) -> bool:
        """Something is in ``out:<id>`` (one non-blocking XREAD: what a producer may run)."""
        try:
            return bool(await self.redis.xread({self.keys.out(request_id): "0-0"}, count=1))
        except (redis.RedisError, OSError) as exc:
            raise unavailable(f"cannot reach the cluster's Redis: {exc}") from None

    async def check_not_gone(self, request_id: str, spec: Spec) -> None:
        """404 for a request whose answer expired: its deadline passed and ``out:<id>`` is
        empty (else reading would wait for an answer that will never come)."""
        timeout = self.timeout_s
        if timeout is None or time.time() - spec.created <= timeout or await self.has_answer(request_id):
            return
        raise OpenAIError(404, f"request {request_id!r} has no answer any more (an answer is kept for an hour "
                               f"after its last token)", "invalid_request_error", code="request_not_found")

    async def find(self, given: str) -> tuple[str, tuple[Spec, str] | None]:
        """A request id, or a response id (``cmpl-<id>``): the request id and its record."""
        if not valid_id(given):
            raise oai.bad_request(f"request id must be 1..128 characters of [A-Za-z0-9._:-], got {given[:40]!r}",
                                  "request_id")
        candidates = [given] + [given[len(p):] for p in _RESPONSE_PREFIXES if given.startswith(p) and given != p]
        for request_id in candidates:
            record = await self.load(request_id)
            if record is not None:
                return request_id, record
        return given, None
