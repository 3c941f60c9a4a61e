"""An OpenAI-compatible HTTP gateway in front of a pdqueue cluster (``pdqueue serve``).

Endpoints:

- ``POST /v1/completions``, ``POST /v1/chat/completions``: streaming (server-sent events,
  ``data: {...}`` then ``data: [DONE]``) and not. A request is one ``AsyncClient.submit``
  (one XADD) and its answer is read from ``out:<id>``; nothing else touches Redis per
  request (a resumable one: also its record, below). The body is parsed by
  ``pdqueue.frontends.openai_compat``.
- ``GET /v1/models``: the models the live workers serve (their heartbeats' ``model`` and
  ``max_model_len``), ``owned_by: "pdqueue"``.
- ``GET /health``: 200 with an empty body while workers of each needed role live (prefill
  and decode, or colocated); 503 otherwise.
- ``GET /v1/requests/{id}``, ``POST /v1/requests/{id}/cancel``: a resumable request's
  answer, read again; its cancel (below).
- ``GET /metrics``: Prometheus text; vLLM's metric names where the meaning is the same
  (``vllm:e2e_request_latency_seconds``, ``vllm:time_to_first_token_seconds``, ...), with
  ``role="gateway"``.

What the gateway knows about the cluster (live workers, their models, the request
backlog) comes from a background poll every ``poll_s`` (heartbeats, and XINFO GROUPS lag +
pending of the request streams, as ``pdqueue.control.observe`` reads them), so the answers 503
(no worker), 404 (unknown model) and 429 (backlog over ``max_backlog``; requests sent since
the last poll count too) cost no round trip. 401: ``api_key`` is set and the request's
``Authorization: Bearer`` differs (``/health`` and ``/metrics`` are open). 504: no answer
within ``timeout_s`` (the request also carries it as ``deadline_ms``, so workers drop it).

Request ids, resuming and the hang-up rule:

- ``X-Request-Id`` becomes the pdqueue request id (a repeated id gets the first request's
  answer: pdqueue runs an id once) and every answer carries it back.
- ``Idempotency-Key`` names the request too (the same value as ``X-Request-Id`` if both are
  sent) and makes it *resumable*: a retry with the same key attaches to the first request
  (its whole answer, not a second generation; a retry with other parameters is a 422), its
  stream's events carry SSE ids, and a client that hangs up does not cancel it: it runs to
  its end (``max_tokens``, ``timeout_s``) and its answer stays in ``out:<id>`` for an hour.
  ``POST /v1/requests/{id}/cancel`` stops it.
- Any other request is cancelled (``cancel:<id>``) when its client hangs up before the
  answer is complete: the workers free its KV blocks within ~100 ms. A hang-up is seen on
  the connection (``http.disconnect``), with nothing written; ``keepalive_s`` adds SSE
  comments while no token comes (off by default: some benchmark clients drop every event
  after a comment).
- SSE ids (resumable and re-attached streams only: plain streams stay ``data:`` lines,
  which the same clients need) are item indexes: token ``i`` is item ``i``, the chat
  role chunk ``-1``, the finish ``n`` (the number of tokens), the usage chunk ``n + 1``,
  ``[DONE]`` the next. An event's id is the last item it carries. A POST with the request's
  id and ``Last-Event-ID: k`` re-attaches (no submit) and sends the items after ``k``;
  ``GET /v1/requests/{id}`` (``?stream=true`` or ``Accept: text/event-stream``: events,
  with ``Last-Event-ID``; else the whole answer) reads a resumable request by its id or its
  response id (``cmpl-<id>``, ``chatcmpl-<id>``). Events of this connection's own failures
  (timeout, lost Redis, a stop) carry no id: a resume goes on after the answer's last event.
- A resumable request's record (``pdq:{NAME}:gw:<id>``: endpoint, model, ``created``,
  ``include_usage``, a hash of its parameters) is what a re-attach on any gateway formats
  the rest of the answer with.

Stopping (``serve``): the first SIGTERM/SIGINT drains (new requests and ``/health`` get 503
with ``Retry-After``, open answers run to their end, then the process exits 0); a second
ends every open answer at once with an error (never a cut connection) and cancels its
request. Unknown routes and methods are OpenAI errors (404, 405) like every other.

What it runs on (``serve``'s ``loop`` and ``http``, ``pdqueue serve --loop/--http``; ``auto``
by default): uvloop and httptools when installed (``pip install 'pdqueue[fast]'``, which
scripts/setup does), else asyncio's own loop and h11; replies from Redis are parsed by
hiredis when installed (``PDQ_REDIS_PARSER``, ``pdqueue.queue.connection``). ``runtime()``
resolves ``auto`` and says which; ``serve`` logs it in one line at the start.

The gateway holds no state of its own; any number can serve one cluster. Imports redis,
starlette, prometheus_client and pdqueue's client, protocol, keys, planner_obs and
registry (never torch). uvicorn is imported by ``serve`` only.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import importlib.metadata
import importlib.util
import json
import logging
import signal
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pdqueue.frontends import openai_compat as oai
from pdqueue.client import AsyncClient, RequestFailed
from pdqueue.keys import OUT_TTL_S, PREFILL_GROUP, SEEN_TTL_S, Keys
from pdqueue.frontends.openai_compat import OpenAIError
from pdqueue.control.observe import group_backlog
from pdqueue.protocol import Completion, FinishReason, RequestError, entry_request_id
from pdqueue.queue.connection import connect, redis_parser
from pdqueue.queue.registry import list_workers
from pdqueue.queue.streams import request_streams_of

log = logging.getLogger("pdqueue.frontends.gateway")

__all__ = ["ClusterView", "Gateway", "GatewayConfig", "Runtime", "build_app", "runtime", "serve"]

FRESH_S = 0.05   # a view this old is good enough to answer 503/404 without polling again
RETRY_AFTER_S = 5   # what a stopping gateway's 503 tells clients to wait (another gateway, or this one restarted)
_KEEPALIVE = b": keep-alive\n\n"
_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
# vLLM's buckets for these histograms (vllm/v1/metrics/loggers.py)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)


@dataclass(frozen=True)
class GatewayConfig:
    redis_url: str
    cluster: str = "default"
    api_key: str | None = None        # None: no authentication
    max_backlog: int | None = None    # None: no 429
    timeout_s: float | None = 600.0   # None: wait for ever
    poll_s: float = 0.25              # how often the cluster view is refreshed
    keepalive_s: float | None = None  # an SSE comment after this long without a token; None: never


# ---- what the gateway knows about the cluster ----------------------------------------------

class ClusterView:
    """Live workers and the request backlog, refreshed by ``run`` every ``poll_s`` in a
    thread (a plain redis-py client: a poll never delays the event loop's requests)."""

    def __init__(self, redis_url: str, keys: Keys, poll_s: float = 0.25):
        self.keys = keys
        self.poll_s = poll_s
        self._r = connect(redis_url, purpose="poll")   # credentials and TLS as every client's
        self.workers: list[dict] = []
        self.backlog = 0
        self.sent_since_poll = 0          # requests this gateway sent after the last poll began
        self.ok = False                   # the last poll reached Redis
        self.polled_at = 0.0

    def poll(self) -> None:
        """One refresh (blocking: call it in a thread)."""
        workers = list_workers(self._r, self.keys)
        backlog = 0
        for stream in request_streams_of(self._r, self.keys):
            lag, pending = group_backlog(self._r, stream, PREFILL_GROUP)
            backlog += lag + pending
        self.workers, self.backlog, self.ok, self.polled_at = workers, backlog, True, time.monotonic()

    async def refresh(self) -> None:
        sent = self.sent_since_poll
        try:
            await asyncio.to_thread(self.poll)
            self.sent_since_poll -= sent  # those are in the backlog just read (or already served)
        except (redis.RedisError, OSError) as exc:
            if self.ok:
                log.warning("cannot read the cluster's state from Redis: %s", exc)
            self.ok = False

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await self.refresh()

    def close(self) -> None:
        self._r.close()

    # ---- derived ---------------------------------------------------------------------------
    def roles(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for w in self.workers:
            role = w.get("role", "")
            counts[role] = counts.get(role, 0) + 1
        return counts

    def serving(self) -> bool:
        """Some worker of each needed role lives: prefill and decode, or colocated."""
        roles = self.roles()
        return roles.get("colocated", 0) > 0 or (roles.get("prefill", 0) > 0 and roles.get("decode", 0) > 0)

    def models(self) -> dict[str, dict]:
        """Served model name -> {"max_model_len", "created"} (from the heartbeats)."""
        out: dict[str, dict] = {}
        for w in self.workers:
            name = w.get("model") or ""
            if not name:
                continue
            entry = out.setdefault(name, {"max_model_len": 0, "created": None})
            if isinstance(w.get("max_model_len"), int) and w["max_model_len"] > 0:
                mml = w["max_model_len"]
                entry["max_model_len"] = mml if not entry["max_model_len"] else min(entry["max_model_len"], mml)
            started = w.get("started_ms")
            if isinstance(started, int) and started > 0:
                created = started // 1000
                entry["created"] = created if entry["created"] is None else min(entry["created"], created)
        return out

    def backlog_now(self) -> int:
        return self.backlog + max(0, self.sent_since_poll)


# ---- metrics -------------------------------------------------------------------------------

class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        labels = ("role", "model_name")
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Time from the request's arrival at the gateway "
                             "to its last byte.", labels, buckets=_E2E_BUCKETS, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time from the request's arrival at the gateway "
                              "to its first token sent (streaming requests).", labels, buckets=_TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between two streamed chunks of an "
                             "answer, at the gateway.", labels, buckets=_ITL_BUCKETS, registry=r)
        self.success = Counter("vllm:request_success", "Requests answered in full, by finish reason.",
                               (*labels, "finished_reason"), registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of the requests answered.", labels,
                                     registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated for the requests answered.",
                                         labels, registry=r)
        self.requests = Counter("pdqueue:gateway_requests", "HTTP requests by endpoint and status code.",
                                ("role", "endpoint", "status"), registry=r)
        self.in_flight = Gauge("pdqueue:gateway_requests_in_flight", "Completion requests being answered.",
                               ("role",), registry=r)
        self.backlog = Gauge("pdqueue:gateway_backlog", "Request backlog of the cluster at the last poll "
                             "(lag + pending of the request streams).", ("role",), registry=r)

    def finished(self, model: str, c: Completion) -> None:
        self.success.labels("gateway", model, oai.finish_reason(c.finish_reason)).inc()
        self.prompt_tokens.labels("gateway", model).inc(c.num_prompt_tokens)
        self.generation_tokens.labels("gateway", model).inc(len(c.token_ids))


# ---- the app -------------------------------------------------------------------------------

def _error(exc: OpenAIError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def _sse(obj: Any, event_id: int | None = None) -> bytes:
    data = b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
    return data if event_id is None else b"id: %d\n" % event_id + data


_DONE = b"data: [DONE]\n\n"
_DRAINING = ("the gateway is stopping: it finishes the answers it has and takes no new request; retry on "
             "another gateway or later")
_STOPPED = "the gateway stopped before the answer was complete; its request is cancelled"


def _failure(exc: RequestFailed) -> OpenAIError:
    return oai.worker_error(exc.code, exc.reason)


def _timeout(timeout_s: float | None) -> OpenAIError:
    return OpenAIError(504, f"no complete answer within {timeout_s:g} s", "timeout_error", code="timeout")


def _unavailable(message: str) -> OpenAIError:
    return OpenAIError(503, message, "server_error", code="service_unavailable")


def _retry_after(headers: dict) -> dict:
    # "close": a client's next try opens a new connection, which a load balancer can send elsewhere.
    return {**headers, "retry-after": str(RETRY_AFTER_S), "connection": "close"}


async def _disconnected(receive) -> None:
    """Returns when the client goes away (the body was already read, or is empty: a GET)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _ended(task: asyncio.Future) -> None:
    """Cancel ``task`` and wait until it has stopped."""
    task.cancel()
    try:
        await task
    except BaseException:
        pass


def _end(event) -> int:
    """The token index after a token event (the client's assembler counts the same way)."""
    return event.index + max(1, len(event.token_ids))


# ---- who a request is, and the record of a resumable one -----------------------------------

@dataclass(frozen=True)
class _Ident:
    """A completion request's id, whether it is resumable (``Idempotency-Key``), and the last
    item its client already has (``Last-Event-ID``; None: a new answer)."""
    request_id: str
    resumable: bool
    after: int | None


def _valid_id(value: str) -> bool:
    return entry_request_id(None, {"id": value}) == value   # pdqueue's rule for request ids


def _named(request: Request) -> str | None:
    return request.headers.get("idempotency-key") or request.headers.get("x-request-id") or None   # "": none


def _ident(request: Request, fallback_id: str) -> _Ident:
    """``OpenAIError`` 400 for an invalid id, two different ids, or a resume without an id."""
    key, xid = request.headers.get("idempotency-key") or None, request.headers.get("x-request-id") or None
    for name, value in (("Idempotency-Key", key), ("X-Request-Id", xid)):
        if value is not None and not _valid_id(value):
            raise oai.bad_request(f"{name}: id must be 1..128 characters of [A-Za-z0-9._:-], got {value[:40]!r}",
                                  name)
    if key is not None and xid is not None and key != xid:
        raise oai.bad_request("X-Request-Id and Idempotency-Key name two different requests: send one, or the "
                              "same value in both", "Idempotency-Key")
    after = _last_event_id(request)
    if after is not None and key is None and xid is None:
        raise oai.bad_request("Last-Event-ID resumes a request: send its Idempotency-Key (or X-Request-Id) with it",
                              "Last-Event-ID")
    return _Ident(key or xid or fallback_id, key is not None, after)


def _last_event_id(request: Request) -> int | None:
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


def _wants_stream(request: Request) -> bool:
    raw = request.query_params.get("stream")
    if raw is None:
        return "text/event-stream" in request.headers.get("accept", "")
    if raw.lower() in ("true", "1", "false", "0"):
        return raw.lower() in ("true", "1")
    raise oai.bad_request(f"stream must be true or false, got {raw[:40]!r}", "stream")


@dataclass(frozen=True)
class _Spec:
    """How an answer is written: the endpoint ("completion" or "chat"), the model's name,
    ``created`` (the same in every event, on every gateway), and the usage chunk."""
    kind: str
    model: str
    created: int
    include_usage: bool


def _params(kind: str, parsed: oai.Parsed) -> str:
    """What makes two requests the same generation (a retry), whatever else differs
    (streaming or not, stream_options)."""
    text = json.dumps([kind, parsed.model, parsed.submit_kwargs()], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


_RESPONSE_PREFIXES = ("chatcmpl-", "cmpl-")   # oai.new_id: the response id of a request id


class Gateway:
    def __init__(self, config: GatewayConfig):
        self.config = config
        self.keys = Keys(config.cluster)
        self.view = ClusterView(config.redis_url, self.keys, config.poll_s)
        self.metrics = Metrics()
        self.client: AsyncClient | None = None
        self._poller: asyncio.Task | None = None
        self._ignored_logged: set[tuple[str, ...]] = set()
        self._records_denied = False
        # Stopping (serve): draining after the first signal, `stopped` set by the second.
        self.draining = False
        self.stopped = asyncio.Event()
        self.open: set[_Reply] = set()   # answers being written
        self._busy = 0                   # requests not answered yet that may become one

    # ---- lifespan ------------------------------------------------------------------------
    async def start(self) -> None:
        # One client per process; its pool holds a connection per answer being read
        # (RedisConfig.max_connections).
        self.client = AsyncClient(self.config.redis_url, self.config.cluster)
        await self.view.refresh()
        self._poller = asyncio.ensure_future(self.view.run())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        if self.client is not None:
            await self.client.aclose()
        self.view.close()

    def stop_requested(self, forced: bool) -> None:
        """A stop signal (the first: drain; a later one, ``forced``: end the open answers now)."""
        if not self.draining:
            self.draining = True
            log.warning("stopping: %d answers open run to their end; new requests get 503 (a second "
                        "SIGTERM/SIGINT ends them now)", len(self.open) + self._busy)
        if forced and not self.stopped.is_set():
            log.warning("stopping now: ending %d open answers with an error and cancelling their requests",
                        len(self.open) + self._busy)
            self.stopped.set()

    def idle(self) -> bool:
        """Draining, and no answer left to write: the process may exit."""
        return self.draining and not self.open and self._busy == 0

    # ---- checks (no I/O) ----------------------------------------------------------------
    def _authorized(self, request: Request) -> bool:
        key = self.config.api_key
        if not key:
            return True
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())

    def _unauthorized(self) -> OpenAIError:
        return OpenAIError(401, "Incorrect API key provided (send it as 'Authorization: Bearer KEY').",
                           "invalid_request_error", code="invalid_api_key")

    async def _admit_fresh(self, parsed: oai.Parsed) -> tuple[str, dict]:
        """``_admit``; a 503 or 404 that a view older than ``FRESH_S`` gives is checked again
        against a new poll first (workers that registered since, as right after ``up``'s
        "ready:"): one round trip, on a path that is otherwise an error."""
        try:
            return self._admit(parsed)
        except OpenAIError as exc:
            if exc.status not in (503, 404) or time.monotonic() - self.view.polled_at < FRESH_S:
                raise
        await self.view.refresh()
        return self._admit(parsed)

    def _admit(self, parsed: oai.Parsed) -> tuple[str, dict]:
        """The model name and its info; OpenAIError 429, 503 or 404 otherwise."""
        view = self.view
        limit = self.config.max_backlog
        if limit is not None and view.backlog_now() > limit:
            raise OpenAIError(429, f"the cluster's request backlog ({view.backlog_now()}) is over the "
                                   f"limit ({limit}); retry later", "rate_limit_error", code="rate_limit_exceeded")
        if not view.ok:
            raise _unavailable("the gateway cannot reach the cluster's Redis")
        if not view.serving():
            roles = view.roles()
            have = ", ".join(f"{n} {r}" for r, n in sorted(roles.items())) or "none"
            raise _unavailable(f"no workers to serve the request (live workers: {have}; needed: prefill "
                               f"and decode, or colocated)")
        models = view.models()
        name = parsed.model
        if name is None:
            if not models:
                raise _unavailable("no model is served")
            name = sorted(models)[0]
        if name not in models:
            raise OpenAIError(404, f"The model `{name}` does not exist. Served: {', '.join(sorted(models))}.",
                              "invalid_request_error", "model", "model_not_found")
        return name, models[name]

    # ---- the records of resumable requests (pdq:{NAME}:gw:<id>) --------------------------
    def _record_key(self, request_id: str) -> str:
        return self.keys.gateway_record(request_id)

    async def _load_record(self, request_id: str) -> tuple[_Spec, str] | None:
        """The spec and parameters of a resumable request sent before (any gateway), or None."""
        try:
            raw = await self.client.redis.get(self._record_key(request_id))
        except redis.ResponseError as exc:   # NOPERM: an ACL that does not grant the records
            self._records_unavailable(exc)
            return None
        except (redis.RedisError, OSError) as exc:
            raise _unavailable(f"cannot reach the cluster's Redis: {exc}") from None
        if raw is None:
            return None
        try:
            data = json.loads(raw)
            return (_Spec(str(data["kind"]), str(data["model"]), int(data["created"]), bool(data["include_usage"])),
                    str(data["params"]))
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("request %s: its record is unreadable (%s); treated as absent", request_id, exc)
            return None

    async def _save_record(self, request_id: str, spec: _Spec, params: str) -> None:
        # It outlives the answer (out:<id> lives an hour after its last write, at the deadline
        # at the latest); with no deadline, as long as pdqueue remembers the id.
        timeout = self.config.timeout_s
        ttl = OUT_TTL_S + int(timeout) + 1 if timeout is not None else SEEN_TTL_S
        record = json.dumps({"kind": spec.kind, "model": spec.model, "created": spec.created,
                             "include_usage": spec.include_usage, "params": params}, separators=(",", ":"))
        try:
            await self.client.redis.set(self._record_key(request_id), record, ex=ttl, nx=True)
        except redis.ResponseError as exc:
            self._records_unavailable(exc)
        except (redis.RedisError, OSError) as exc:   # submitted already: the answer goes on
            log.warning("request %s: could not write its record (%s); a retry runs it once all the same",
                        request_id, exc)

    def _records_unavailable(self, exc: Exception) -> None:
        if not self._records_denied:
            self._records_denied = True
            log.warning("cannot read or write the records of resumable requests (%s): a retried Idempotency-Key "
                        "still runs once (pdqueue runs an id once), but GET /v1/requests/{id} cannot find it; "
                        "allow this user GET and SET on %s", exc, self._record_key("*"))

    async def _has_answer(self, request_id: str) -> bool:
        """Something is in ``out:<id>`` (one non-blocking XREAD: what a producer may run)."""
        try:
            return bool(await self.client.redis.xread({self.keys.out(request_id): "0-0"}, count=1))
        except (redis.RedisError, OSError) as exc:
            raise _unavailable(f"cannot reach the cluster's Redis: {exc}") from None

    async def _check_not_gone(self, request_id: str, spec: _Spec) -> None:
        """404 for a request whose answer expired: its deadline passed and ``out:<id>`` is
        empty (else reading would wait for an answer that will never come)."""
        timeout = self.config.timeout_s
        if timeout is None or time.time() - spec.created <= timeout or await self._has_answer(request_id):
            return
        raise OpenAIError(404, f"request {request_id!r} has no answer any more (an answer is kept for an hour "
                               f"after its last token)", "invalid_request_error", code="request_not_found")

    async def _find(self, given: str) -> tuple[str, tuple[_Spec, str] | None]:
        """A request id, or a response id (``cmpl-<id>``): the request id and its record."""
        if not _valid_id(given):
            raise oai.bad_request(f"request id must be 1..128 characters of [A-Za-z0-9._:-], got {given[:40]!r}",
                                  "request_id")
        candidates = [given] + [given[len(p):] for p in _RESPONSE_PREFIXES if given.startswith(p) and given != p]
        for request_id in candidates:
            record = await self._load_record(request_id)
            if record is not None:
                return request_id, record
        return given, None

    # ---- endpoints ----------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if self.draining:
            return _error(_unavailable(_DRAINING), _retry_after({}))
        if self.view.ok and self.view.serving():
            return Response(status_code=200)
        if time.monotonic() - self.view.polled_at >= FRESH_S:   # unhealthy: make sure it still is
            await self.view.refresh()
            if self.view.ok and self.view.serving():
                return Response(status_code=200)
        roles = self.view.roles()
        why = ("cannot reach Redis" if not self.view.ok else
               f"no workers to serve requests (live: {', '.join(f'{n} {r}' for r, n in sorted(roles.items())) or 'none'})")
        return _error(_unavailable(why))

    async def metrics_endpoint(self, request: Request) -> Response:
        self.metrics.backlog.labels("gateway").set(self.view.backlog)
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        if not self._authorized(request):
            return self._count("models", _error(self._unauthorized()))
        now = int(time.time())
        data = [{"id": name, "object": "model", "created": info["created"] or now, "owned_by": "pdqueue",
                 "root": name, "parent": None, "max_model_len": info["max_model_len"] or None, "permission": []}
                for name, info in sorted(self.view.models().items())]
        return self._count("models", JSONResponse({"object": "list", "data": data}))

    async def completions(self, request: Request) -> Response:
        return await self._answering(request, "completions", lambda h: self._generate(request, "completion", h))

    async def chat_completions(self, request: Request) -> Response:
        return await self._answering(request, "chat", lambda h: self._generate(request, "chat", h))

    async def fetch(self, request: Request) -> Response:
        """``GET /v1/requests/{id}``: a resumable request's answer, from the start or after
        ``Last-Event-ID``; reading it never cancels it."""
        return await self._answering(request, "requests", lambda h: self._fetch(request, h))

    async def cancel_request(self, request: Request) -> Response:
        """``POST /v1/requests/{id}/cancel``: the workers stop the request (a resumable one
        is not stopped by its client hanging up)."""
        headers = {"x-request-id": request.path_params["request_id"]}
        try:
            if not self._authorized(request):
                raise self._unauthorized()
            request_id, _ = await self._find(request.path_params["request_id"])
            headers["x-request-id"] = request_id
            await self.client.cancel(request_id)
        except OpenAIError as exc:
            return self._count("cancel", _error(exc, headers))
        except (redis.RedisError, OSError) as exc:
            return self._count("cancel", _error(_unavailable(f"cannot reach the cluster's Redis: {exc}"), headers))
        log.info("request %s: cancelled by its client", request_id)
        return self._count("cancel", JSONResponse({"id": request_id, "object": "request.cancel", "cancelled": True},
                                                  headers=headers))

    def _count(self, endpoint: str, response: Response) -> Response:
        self.metrics.requests.labels("gateway", endpoint, str(response.status_code)).inc()
        return response

    async def _answering(self, request: Request, endpoint: str, answer) -> Response:
        """What the answering endpoints share: the stop (503 while draining), the key, and
        the count of requests on their way to an answer (the drain waits for them)."""
        headers = {"x-request-id": _named(request) or request.path_params.get("request_id") or uuid.uuid4().hex}
        if self.draining:
            return self._count(endpoint, _error(_unavailable(_DRAINING), _retry_after(headers)))
        self._busy += 1
        try:
            if not self._authorized(request):
                raise self._unauthorized()
            return await answer(headers)
        except OpenAIError as exc:
            return self._count(endpoint, _error(exc, headers))
        finally:
            self._busy -= 1

    async def _generate(self, request: Request, kind: str, headers: dict) -> Response:
        arrived = time.perf_counter()
        endpoint = "chat" if kind == "chat" else "completions"
        ident = _ident(request, headers["x-request-id"])
        headers["x-request-id"] = ident.request_id
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as exc:
            raise oai.bad_request(f"the request body is not valid JSON: {exc}") from None
        parsed = oai.parse_chat(body) if kind == "chat" else oai.parse_completion(body)
        if parsed.ignored:
            self._log_ignored(parsed.ignored)
        params = _params(kind, parsed) if ident.resumable else ""   # only a record holds it
        answer = dict(endpoint=endpoint, arrived=arrived, headers=headers, after=ident.after,
                      cancels=not ident.resumable)
        record = await self._load_record(ident.request_id) if ident.resumable else None
        if record is not None:   # a retry or a resume: attach to the first request
            return await self._attach(ident.request_id, record, params, parsed, answer)
        if ident.after is not None:
            return await self._resume_unrecorded(ident.request_id, kind, parsed, answer)
        model, info = await self._admit_fresh(parsed)
        spec = _Spec(kind, model, int(time.time()), parsed.include_usage)
        handle = await self._submit(ident.request_id, parsed, info)
        if ident.resumable:
            await self._save_record(ident.request_id, spec, params)
        return self._reply(handle, spec, parsed.stream, ids=ident.resumable, attached=False, **answer)

    async def _attach(self, request_id: str, record: tuple[_Spec, str], params: str, parsed: oai.Parsed,
                      answer: dict) -> "_Answer":
        """A resumable request sent before: its answer (after ``Last-Event-ID``), as the
        first gateway wrote it (model, ``created``); no submit."""
        spec, first = record
        if first != params:
            raise OpenAIError(422, f"Idempotency-Key {request_id!r} was first used with other parameters; a retry "
                                   f"must send the same request", "invalid_request_error", "Idempotency-Key",
                              "idempotency_key_reused")
        await self._check_not_gone(request_id, spec)
        spec = _Spec(spec.kind, spec.model, spec.created, parsed.include_usage)
        return self._reply(self.client.handle(request_id), spec, parsed.stream, ids=True, attached=True, **answer)

    async def _resume_unrecorded(self, request_id: str, kind: str, parsed: oai.Parsed, answer: dict) -> "_Answer":
        """``Last-Event-ID`` for a request with no record (an X-Request-Id, or records
        refused by an ACL): the rest of an answer that must be there, written as this body asks."""
        if not await self._has_answer(request_id):
            raise OpenAIError(404, f"request {request_id!r} has no answer to resume", "invalid_request_error",
                              "Last-Event-ID", "request_not_found")
        models = sorted(self.view.models())
        spec = _Spec(kind, parsed.model or (models[0] if models else ""), int(time.time()), parsed.include_usage)
        return self._reply(self.client.handle(request_id), spec, parsed.stream, ids=True, attached=True, **answer)

    async def _fetch(self, request: Request, headers: dict) -> Response:
        arrived = time.perf_counter()
        given = request.path_params["request_id"]
        request_id, record = await self._find(given)
        headers["x-request-id"] = request_id
        stream, after = _wants_stream(request), _last_event_id(request)
        if record is None:
            raise OpenAIError(404, f"no resumable request {given!r}: requests sent with an Idempotency-Key can be "
                                   f"read by id, for an hour after their answer", "invalid_request_error",
                              "request_id", "request_not_found")
        spec, _ = record
        await self._check_not_gone(request_id, spec)
        return self._reply(self.client.handle(request_id), spec, stream, endpoint="requests", arrived=arrived,
                           headers=headers, after=after, ids=True, attached=True, cancels=False)

    async def _submit(self, request_id: str, parsed: oai.Parsed, info: dict):
        kwargs = parsed.submit_kwargs(default_max_tokens=info["max_model_len"] or None)
        if self.config.timeout_s is not None:
            kwargs["deadline_ms"] = max(1, int(self.config.timeout_s * 1000))
        try:
            handle = await self.client.submit(id=request_id, **kwargs)
        except RequestError as exc:
            raise oai.bad_request(exc.reason) from None
        except (redis.RedisError, OSError) as exc:
            raise _unavailable(f"cannot reach the cluster's Redis: {exc}") from None
        self.view.sent_since_poll += 1
        return handle

    def _reply(self, handle, spec: _Spec, stream: bool, **options) -> "_Answer":
        return (_Stream if stream else _Whole)(self, handle, spec, **options).response()

    def _log_ignored(self, names: tuple[str, ...]) -> None:
        # vLLM logs the same line for every such request; once per set of names is enough here.
        if names not in self._ignored_logged and len(self._ignored_logged) < 1000:
            self._ignored_logged.add(names)
            log.warning("The following fields were present in the request but ignored: %s", set(names))

    async def cancel(self, request_id: str) -> None:
        try:
            await self.client.cancel(request_id)
        except (redis.RedisError, OSError) as exc:
            log.warning("request %s: could not cancel (%s)", request_id, exc)

    async def http_error(self, request: Request, exc: HTTPException) -> Response:
        """Starlette's 404 (no route) and 405 (a route, another method), in OpenAI's shape."""
        method, path = request.method, request.url.path
        if exc.status_code == 404:
            served = ", ".join(sorted({r.path for r in self.routes()}))
            error = OpenAIError(404, f"Invalid URL ({method} {path}); this server serves {served}",
                                code="unknown_url")
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            error = OpenAIError(405, f"{method} is not allowed on {path} (allowed: {allowed})",
                                code="method_not_allowed")
        else:
            error = OpenAIError(exc.status_code, str(exc.detail))
        return self._count("other", _error(error, exc.headers))

    def routes(self) -> list[Route]:
        return [Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/requests/{request_id}", self.fetch, methods=["GET"]),
                Route("/v1/requests/{request_id}/cancel", self.cancel_request, methods=["POST"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics_endpoint, methods=["GET"])]


class _Answer:
    """The ASGI app of one answer: the reply's ``send`` runs against the client's
    disconnect and the gateway's forced stop. A client that goes away before the answer is
    complete (or a connection that breaks while it is sent) abandons it (``reply.abandon``:
    a plain request is cancelled); a forced stop ends it with an error (``reply.stop_now``)."""

    def __init__(self, reply: "_Reply"):
        self.reply = reply

    async def __call__(self, scope, receive, send) -> None:
        reply = self.reply
        send = reply.tracking(send)
        work = asyncio.ensure_future(reply.send(send))
        watch = asyncio.ensure_future(_disconnected(receive))
        stop = asyncio.ensure_future(reply.gw.stopped.wait())
        try:
            await asyncio.wait({work, watch, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done() and not watch.done():   # the second stop signal
                await reply.stop_now(work, send)
        finally:
            if not work.done():  # the client left (or this task was cancelled)
                # Abandon (cancel) the pdqueue request first: it must not wait for ``work`` to stop.
                await reply.abandon()
                await _ended(work)
            watch.cancel()
            stop.cancel()
            reply.gw.open.discard(reply)
        exc = None if work.cancelled() else work.exception()
        if isinstance(exc, OSError):  # the connection broke while sending
            await reply.abandon()
        elif exc is not None:
            reply.end(500)
            raise exc


class _Reply:
    """One answer being written (its handle, how it is written, timing and accounting).

    ``after``: the last item the client has (Last-Event-ID; None: none). ``ids``: events
    carry SSE ids. ``attached``: a re-read of a request sent before (no generation metrics).
    ``cancels``: a hang-up cancels the request (plain requests; not resumable ones or reads)."""

    def __init__(self, gw: Gateway, handle, spec: _Spec, *, endpoint: str, arrived: float, headers: dict,
                 after: int | None = None, ids: bool = False, attached: bool = False, cancels: bool = True):
        self.gw, self.handle, self.spec = gw, handle, spec
        self.endpoint, self.arrived, self.headers = endpoint, arrived, headers
        self.after = -2 if after is None else after   # -2: nothing yet (the chat role chunk is item -1)
        self.ids, self.attached, self.cancels = ids, attached, cancels
        self.finished = False   # the answer's outcome is known: nothing to cancel any more
        self.ended = False      # counted
        self.started = False    # the response's first message was sent
        self.complete = False   # and its last
        gw.open.add(self)
        gw.metrics.in_flight.labels("gateway").inc()

    def response(self) -> _Answer:
        return _Answer(self)

    def tracking(self, send):
        """``send``, remembering how far the response got (what a forced stop can still write)."""
        async def tracked(message) -> None:
            await send(message)
            if message["type"] == "http.response.start":
                self.started = True
            elif not message.get("more_body", False):
                self.complete = True
        return tracked

    async def abandon(self) -> None:
        if not self.finished:
            self.finished = True
            if self.cancels:
                log.info("request %s: the client left before the answer was complete; cancelling it",
                         self.handle.request_id)
                await self.gw.cancel(self.handle.request_id)
            else:
                log.info("request %s: the client left before the answer was complete; the request goes on "
                         "(resumable, or a read)", self.handle.request_id)
        self.end(499)

    async def stop_now(self, work: asyncio.Future, send) -> None:
        """The gateway's forced stop: cancel the request, stop the answer, end the response
        with an error (a stream: an error event and [DONE])."""
        self.finished = True
        log.info("request %s: the gateway is stopping now; cancelling it", self.handle.request_id)
        await self.gw.cancel(self.handle.request_id)
        await _ended(work)
        try:
            await self.fail(send, _unavailable(_STOPPED), _retry_after(self.headers))
        except OSError:   # the client left meanwhile
            self.end(499)

    async def fail(self, send, exc: OpenAIError, headers: dict | None = None) -> None:
        """End the response with ``exc``: the JSON error if nothing was sent yet, else (a
        stream) an error event and [DONE], with no id (they are this connection's, not the
        answer's: a resume goes on after the answer's last event)."""
        if not self.complete:
            if not self.started:
                await _error(exc, headers or self.headers)({"type": "http"}, None, send)
            else:
                await send({"type": "http.response.body", "body": _sse(exc.body()), "more_body": True})
                await send({"type": "http.response.body", "body": _DONE, "more_body": False})
        self.end(exc.status)

    def end(self, status: int, completion: Completion | None = None) -> None:
        if self.ended:
            return
        self.ended = True
        m = self.gw.metrics
        m.in_flight.labels("gateway").dec()
        m.requests.labels("gateway", self.endpoint, str(status)).inc()
        if completion is not None and not self.attached:
            m.e2e.labels("gateway", self.spec.model).observe(time.perf_counter() - self.arrived)
            m.finished(self.spec.model, completion)

    @property
    def response_id(self) -> str:
        return oai.new_id(self.spec.kind, self.handle.request_id)

    async def send(self, send) -> None:
        raise NotImplementedError


class _Whole(_Reply):
    async def send(self, send) -> None:
        timeout = self.gw.config.timeout_s
        try:
            c = await self.handle.result(timeout=timeout)
        except TimeoutError:
            self.finished = True
            await self.gw.cancel(self.handle.request_id)
            return await self.fail(send, _timeout(timeout))
        except RequestFailed as exc:
            self.finished = True
            return await self.fail(send, _failure(exc))
        except redis.RedisError as exc:
            self.finished = True
            return await self.fail(send, _unavailable(f"lost the cluster's Redis: {exc}"))
        self.finished = True
        if c.finish_reason is FinishReason.EXPIRED:
            return await self.fail(send, _timeout(timeout))
        spec = self.spec
        build = oai.chat_body if spec.kind == "chat" else oai.completion_body
        body = build(self.response_id, spec.model, c.text, c.finish_reason, c.num_prompt_tokens, len(c.token_ids),
                     created=spec.created, cached_tokens=c.cached_tokens)
        await JSONResponse(body, headers=self.headers)({"type": "http"}, None, send)
        self.end(200, c)


class _Stream(_Reply):
    async def send(self, send) -> None:
        spec, gw, chat = self.spec, self.gw, self.spec.kind == "chat"
        rid, model, created, usage = self.response_id, spec.model, spec.created, spec.include_usage
        headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        headers += [(k.encode(), v.encode()) for k, v in {**_SSE_HEADERS, **self.headers}.items()]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if chat:
            await self._item(send, -1, oai.chat_role_chunk(rid, model, created, usage))
        chunk = oai.chat_chunk if chat else oai.completion_chunk
        metrics, labels = gw.metrics, ("gateway", model)
        last_sent: float | None = None
        completion = None
        read = 0   # tokens read: the index after the last token event
        try:
            async for batch in self.handle.batches(timeout=gw.config.timeout_s, idle_s=gw.config.keepalive_s):
                completion = self.handle.completion
                new = self._unsent(batch)
                read = _end(batch[-1]) if batch else read
                item = read if completion is not None else read - 1   # the finish is item n
                text = "".join(e.text for e in new)
                if item <= self.after or (not text and completion is None):
                    if not batch and completion is None:   # keepalive_s without a token: a comment
                        await send({"type": "http.response.body", "body": _KEEPALIVE, "more_body": True})
                    continue
                finish = completion.finish_reason if completion is not None else None
                await self._item(send, item, chunk(rid, model, created, text, finish, usage))
                if not self.attached:
                    now = time.perf_counter()
                    if last_sent is None:
                        metrics.ttft.labels(*labels).observe(now - self.arrived)
                    else:
                        metrics.itl.labels(*labels).observe(now - last_sent)
                    last_sent = now
        except TimeoutError:
            self.finished = True
            await gw.cancel(self.handle.request_id)
            return await self.fail(send, _timeout(gw.config.timeout_s))
        except RequestFailed as exc:   # the answer's own end: an event of the answer, with its id
            self.finished = True
            error = _failure(exc)
            await self._item(send, read, error.body())
            await self._done(send, read + 1)
            return self.end(error.status)
        except OpenAIError as exc:   # a Last-Event-ID that is not the end of an event
            self.finished = True
            return await self.fail(send, exc)
        except redis.RedisError as exc:  # (an OSError is the HTTP connection's: see _Answer)
            self.finished = True
            return await self.fail(send, _unavailable(f"lost the cluster's Redis: {exc}"))
        self.finished = True
        if usage:
            await self._item(send, read + 1, oai.usage_chunk(spec.kind, rid, model, created,
                                                             completion.num_prompt_tokens,
                                                             len(completion.token_ids), completion.cached_tokens))
        await self._done(send, read + 2 if usage else read + 1)
        self.end(200, completion)

    def _unsent(self, batch: list) -> list:
        """The token events of ``batch`` after ``self.after`` (a resume's); an event that
        holds it but does not end with it is an OpenAIError 400."""
        if self.after < 0:
            return batch
        for e in batch:
            if e.index <= self.after < _end(e) - 1:
                raise oai.bad_request(f"Last-Event-ID {self.after} is inside an event of this stream (tokens "
                                      f"{e.index}..{_end(e) - 1}), not the id of one", "Last-Event-ID")
        return [e for e in batch if _end(e) - 1 > self.after]

    async def _item(self, send, item: int, obj: Any) -> None:
        """One event of the answer, unless the client has it (a resume)."""
        if item > self.after:
            await send({"type": "http.response.body", "body": _sse(obj, item if self.ids else None),
                        "more_body": True})

    async def _done(self, send, item: int) -> None:
        body = b"" if item <= self.after else (b"id: %d\n" % item if self.ids else b"") + _DONE
        await send({"type": "http.response.body", "body": body, "more_body": False})


def build_app(config: GatewayConfig) -> Starlette:
    gw = Gateway(config)

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        await gw.start()
        try:
            yield
        finally:
            await gw.stop()

    app = Starlette(routes=gw.routes(), lifespan=lifespan, exception_handlers={HTTPException: gw.http_error})
    app.state.gateway = gw
    return app


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (0: a free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say so, and
    # the accepted ones inherit it. Without it, Nagle's algorithm held a chunk written right
    # after another until the client's delayed ACK (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


# ---- what the gateway runs on: the event loop, the HTTP parser, the RESP parser --------------

LOOPS = ("auto", "asyncio", "uvloop")
HTTP_PARSERS = ("auto", "h11", "httptools")


@dataclass(frozen=True)
class Runtime:
    loop: str          # "asyncio" or "uvloop" (uvicorn's names)
    http: str          # "h11" or "httptools"
    redis_parser: str  # "hiredis" or "python" (pdqueue.queue.connection.redis_parser)

    @property
    def name(self) -> str:
        """E.g. "uvloop-httptools-hiredis" (``pdqueue bench gateway --variants``' names)."""
        return f"{self.loop}-{self.http}-{self.redis_parser}"

    def describe(self) -> str:
        """One line: each choice with its package's version."""
        loop = f"asyncio (Python {sys.version.split()[0]})" if self.loop == "asyncio" else _versioned(self.loop)
        parser = "redis-py's Python parser" if self.redis_parser == "python" else _versioned("hiredis")
        return f"event loop {loop}, HTTP parser {_versioned(self.http)}, Redis replies parsed by {parser}"


def _versioned(package: str) -> str:
    try:
        return f"{package} {importlib.metadata.version(package)}"
    except importlib.metadata.PackageNotFoundError:
        return package


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def runtime(loop: str = "auto", http: str = "auto") -> Runtime:
    """What ``serve(loop=, http=)`` runs on: ``auto`` is uvloop (not on Windows) and
    httptools when installed, else asyncio and h11. ValueError for an unknown name or one
    asked for by name that is not installed (or, from ``PDQ_REDIS_PARSER``, hiredis)."""
    if loop not in LOOPS:
        raise ValueError(f"loop {loop!r}: expected one of {', '.join(LOOPS)}")
    if http not in HTTP_PARSERS:
        raise ValueError(f"http {http!r}: expected one of {', '.join(HTTP_PARSERS)}")
    has_uvloop = sys.platform != "win32" and _installed("uvloop")
    if loop == "uvloop" and not has_uvloop:
        raise ValueError("loop uvloop: uvloop is not installed (pip install 'pdqueue[fast]'), or use auto/asyncio")
    if http == "httptools" and not _installed("httptools"):
        raise ValueError("http httptools: httptools is not installed (pip install 'pdqueue[fast]'), or use auto/h11")
    if loop == "auto":
        loop = "uvloop" if has_uvloop else "asyncio"
    if http == "auto":
        http = "httptools" if _installed("httptools") else "h11"
    return Runtime(loop, http, redis_parser())


def serve(config: GatewayConfig, sock: socket.socket, log_level: str = "warning", *, loop: str = "auto",
          http: str = "auto") -> None:
    """Serve on ``sock`` until stopped. The stop, which a supervisor (``pdqueue up``) relies on:

    - The first SIGTERM or SIGINT *drains*: the listener stays open; every new completion,
      chat or ``/v1/requests`` request and ``/health`` get 503 with ``Retry-After`` (an
      OpenAI error, code ``service_unavailable``); every open answer runs to its end, with
      no limit but its own ``timeout_s``. When the last has ended, the process exits 0.
    - A second signal ends every open answer now: a stream with an error event (``data:
      {"error": ...}``) and ``data: [DONE]``, a non-streaming request with a JSON 503; their
      pdqueue requests are cancelled (``cancel:<id>``). Then it exits 0. A connection is
      never cut.

    So a supervisor sends SIGTERM to the gateway first and waits for it to exit before it
    stops what the open answers read (the workers, the Redis server), and sends a second
    SIGTERM when its own user insists (a second Ctrl-C).

    ``loop`` (auto, asyncio, uvloop) and ``http`` (auto, h11, httptools): see ``runtime``
    (ValueError for one that is not installed); the choice is logged (info) at the start
    (``pdqueue serve`` prints the same line on stderr)."""
    import uvicorn

    rt = runtime(loop, http)
    log.info("gateway runtime: %s", rt.describe())
    app = build_app(config)
    # timeout_graceful_shutdown bounds only what is left once drained: idle keep-alive
    # connections and requests still being received (no answer of ours is open then).
    # proxy_headers off: nothing here reads the client's address or scheme (uvicorn would
    # scan every request's headers for X-Forwarded-* from 127.0.0.1).
    server = _server(uvicorn.Config(app, log_level=log_level.lower(), access_log=False, loop=rt.loop,
                                    http=rt.http, proxy_headers=False, timeout_graceful_shutdown=5,
                                    lifespan="on"), app.state.gateway)
    # A signal after the server has stopped (a supervisor insisting) must not turn exit 0
    # into death by signal: uvicorn puts back the handlers it found, so these no-ops.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])


def _server(config, gw: Gateway):
    """A uvicorn server whose signals drive ``gw``'s stop instead of uvicorn's own (which
    closes the listener and gives open answers ``timeout_graceful_shutdown``)."""
    import uvicorn

    class Server(uvicorn.Server):
        signals = 0

        def handle_exit(self, sig, frame) -> None:
            self.signals += 1   # acted on in on_tick, on the event loop (every 0.1 s)

        async def on_tick(self, counter: int) -> bool:
            if self.signals:
                gw.stop_requested(forced=self.signals > 1)
                if gw.idle():
                    log.warning("no answer left open: exiting")
                    return True
            return await super().on_tick(counter)

    return Server(config)
