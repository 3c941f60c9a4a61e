"""An OpenAI-compatible HTTP gateway in front of a pdqueue cluster (``pdqueue serve``).

Endpoints:

- ``POST /v1/completions``, ``POST /v1/chat/completions``: streaming (server-sent events,
  ``data: {...}`` then ``data: [DONE]``) and not. A request is one ``AsyncClient.submit``
  (one XADD) and its answer is read from ``out:<id>``; nothing else touches Redis per
  request. The body is parsed by ``pdqueue.openai_compat``.
- ``GET /v1/models``: the models the live workers serve (their heartbeats' ``model`` and
  ``max_model_len``), ``owned_by: "pdqueue"``.
- ``GET /health``: 200 with an empty body while workers of each needed role live (prefill
  and decode, or colocated); 503 otherwise.
- ``GET /metrics``: Prometheus text; vLLM's metric names where the meaning is the same
  (``vllm:e2e_request_latency_seconds``, ``vllm:time_to_first_token_seconds``, ...), with
  ``role="gateway"``.

What the gateway knows about the cluster (live workers, their models, the request
backlog) comes from a background poll every ``poll_s`` (heartbeats, and XINFO GROUPS lag +
pending of the request streams, as ``pdqueue.planner_obs`` reads them), so the answers 503
(no worker), 404 (unknown model) and 429 (backlog over ``max_backlog``; requests sent since
the last poll count too) cost no round trip. 401: ``api_key`` is set and the request's
``Authorization: Bearer`` differs (``/health`` and ``/metrics`` are open). 504: no answer
within ``timeout_s`` (the request also carries it as ``deadline_ms``, so workers drop it).

The ``X-Request-Id`` header becomes the pdqueue request id (a repeated id gets the first
request's answer: pdqueue runs an id once) and every answer carries it back. A client that
disconnects before its answer is complete cancels its request (``cancel:<id>``): the
workers free its KV blocks within ~100 ms.

The gateway holds no state of its own; any number can serve one cluster. Imports redis,
starlette, prometheus_client and pdqueue's client, protocol, keys, planner_obs and
registry (never torch). uvicorn is imported by ``serve`` only.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pdqueue import openai_compat as oai
from pdqueue.client import AsyncClient, RequestFailed
from pdqueue.keys import PREFILL_GROUP, Keys
from pdqueue.openai_compat import OpenAIError
from pdqueue.planner_obs import group_backlog
from pdqueue.protocol import Completion, FinishReason, RequestError
from pdqueue.queue.connection import connect
from pdqueue.queue.registry import list_workers
from pdqueue.queue.streams import request_streams_of

log = logging.getLogger("pdqueue.gateway")

__all__ = ["ClusterView", "Gateway", "GatewayConfig", "build_app", "serve"]

FRESH_S = 0.05   # a view this old is good enough to answer 503/404 without polling again
KEEPALIVE_S = 1.0   # a stream with no token for this long gets an SSE comment
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


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


_DONE = b"data: [DONE]\n\n"


def _failure(exc: RequestFailed) -> OpenAIError:
    return oai.worker_error(exc.code, exc.reason)


def _timeout(timeout_s: float | None) -> OpenAIError:
    return OpenAIError(504, f"no complete answer within {timeout_s:g} s", "timeout_error", code="timeout")


async def _disconnected(receive) -> None:
    """Returns when the client goes away (the body was already read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class _Answer:
    """The ASGI app of one answer: the reply's ``send`` runs against the client's
    disconnect; a client that goes away before the answer is complete (or a connection
    that breaks while it is sent) cancels the pdqueue request (``reply.abandon``)."""

    def __init__(self, reply: "_Reply"):
        self.reply = reply

    async def __call__(self, scope, receive, send) -> None:
        reply = self.reply
        work = asyncio.ensure_future(reply.send(send))
        watch = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():  # the client left (or the server is stopping)
                # Cancel the pdqueue request first: it must not wait for ``work`` to stop.
                await reply.abandon()
                work.cancel()
                try:
                    await work
                except BaseException:
                    pass
            watch.cancel()
        exc = None if work.cancelled() else work.exception()
        if isinstance(exc, OSError):  # the connection broke while sending
            await reply.abandon()
        elif exc is not None:
            reply.end(500)
            raise exc


class Gateway:
    def __init__(self, config: GatewayConfig):
        self.config = config
        self.keys = Keys(config.cluster)
        self.view = ClusterView(config.redis_url, self.keys, config.poll_s)
        self.metrics = Metrics()
        self.client: AsyncClient | None = None
        self._poller: asyncio.Task | None = None
        self._ignored_logged: set[tuple[str, ...]] = set()

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
            raise OpenAIError(503, "the gateway cannot reach the cluster's Redis", "server_error",
                              code="service_unavailable")
        if not view.serving():
            roles = view.roles()
            have = ", ".join(f"{n} {r}" for r, n in sorted(roles.items())) or "none"
            raise OpenAIError(503, f"no workers to serve the request (live workers: {have}; needed: prefill "
                                   f"and decode, or colocated)", "server_error", code="service_unavailable")
        models = view.models()
        name = parsed.model
        if name is None:
            if not models:
                raise OpenAIError(503, "no model is served", "server_error", code="service_unavailable")
            name = sorted(models)[0]
        if name not in models:
            raise OpenAIError(404, f"The model `{name}` does not exist. Served: {', '.join(sorted(models))}.",
                              "invalid_request_error", "model", "model_not_found")
        return name, models[name]

    # ---- endpoints ----------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if self.view.ok and self.view.serving():
            return Response(status_code=200)
        if time.monotonic() - self.view.polled_at >= FRESH_S:   # unhealthy: make sure it still is
            await self.view.refresh()
            if self.view.ok and self.view.serving():
                return Response(status_code=200)
        roles = self.view.roles()
        why = ("cannot reach Redis" if not self.view.ok else
               f"no workers to serve requests (live: {', '.join(f'{n} {r}' for r, n in sorted(roles.items())) or 'none'})")
        return _error(OpenAIError(503, why, "server_error", code="service_unavailable"))

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
        return await self._generate(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    def _count(self, endpoint: str, response: Response) -> Response:
        self.metrics.requests.labels("gateway", endpoint, str(response.status_code)).inc()
        return response

    async def _generate(self, request: Request, kind: str) -> Response:
        arrived = time.perf_counter()
        endpoint = "chat" if kind == "chat" else "completions"
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        headers = {"x-request-id": request_id}
        try:
            if not self._authorized(request):
                raise self._unauthorized()
            try:
                body = json.loads(await request.body())
            except (ValueError, UnicodeDecodeError) as exc:
                raise oai.bad_request(f"the request body is not valid JSON: {exc}") from None
            parsed = oai.parse_chat(body) if kind == "chat" else oai.parse_completion(body)
            if parsed.ignored:
                self._log_ignored(parsed.ignored)
            model, info = await self._admit_fresh(parsed)
            kwargs = parsed.submit_kwargs(default_max_tokens=info["max_model_len"] or None)
            if self.config.timeout_s is not None:
                kwargs["deadline_ms"] = max(1, int(self.config.timeout_s * 1000))
            try:
                handle = await self.client.submit(id=request_id, **kwargs)
            except RequestError as exc:
                if exc.request_id is None:
                    raise oai.bad_request(f"X-Request-Id: {exc.reason}", "X-Request-Id") from None
                raise oai.bad_request(exc.reason) from None
            except (redis.RedisError, OSError) as exc:
                raise OpenAIError(503, f"cannot reach the cluster's Redis: {exc}", "server_error",
                                  code="service_unavailable") from None
        except OpenAIError as exc:
            return self._count(endpoint, _error(exc, headers))
        self.view.sent_since_poll += 1
        answer = _Stream if parsed.stream else _Whole
        self.metrics.in_flight.labels("gateway").inc()
        return answer(self, handle, parsed, model, kind, endpoint, arrived, headers).response()

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

    def routes(self) -> list[Route]:
        return [Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics_endpoint, methods=["GET"])]


class _Reply:
    """One completion request being answered (its handle, timing and accounting)."""

    def __init__(self, gw: Gateway, handle, parsed: oai.Parsed, model: str, kind: str, endpoint: str,
                 arrived: float, headers: dict):
        self.gw, self.handle, self.parsed, self.model, self.kind = gw, handle, parsed, model, kind
        self.endpoint, self.arrived, self.headers = endpoint, arrived, headers
        self.finished = False
        self.ended = False

    def response(self) -> _Answer:
        return _Answer(self)

    async def abandon(self) -> None:
        if not self.finished:
            self.finished = True
            log.info("request %s: the client left before the answer was complete; cancelling it",
                     self.handle.request_id)
            await self.gw.cancel(self.handle.request_id)
        self.end(499)

    def end(self, status: int, completion: Completion | None = None) -> None:
        if self.ended:
            return
        self.ended = True
        m = self.gw.metrics
        m.in_flight.labels("gateway").dec()
        m.requests.labels("gateway", self.endpoint, str(status)).inc()
        if completion is not None:
            m.e2e.labels("gateway", self.model).observe(time.perf_counter() - self.arrived)
            m.finished(self.model, completion)

    @property
    def response_id(self) -> str:
        return oai.new_id(self.kind, self.handle.request_id)

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
            return await self._error(send, _timeout(timeout))
        except RequestFailed as exc:
            self.finished = True
            return await self._error(send, _failure(exc))
        except redis.RedisError as exc:
            self.finished = True
            return await self._error(send, OpenAIError(503, f"lost the cluster's Redis: {exc}", "server_error",
                                                       code="service_unavailable"))
        self.finished = True
        if c.finish_reason is FinishReason.EXPIRED:
            return await self._error(send, _timeout(timeout))
        build = oai.chat_body if self.kind == "chat" else oai.completion_body
        body = build(self.response_id, self.model, c.text, c.finish_reason, c.num_prompt_tokens, len(c.token_ids),
                     cached_tokens=c.cached_tokens)
        response = JSONResponse(body, headers=self.headers)
        await response({"type": "http"}, None, send)
        self.end(200, c)

    async def _error(self, send, exc: OpenAIError) -> None:
        await _error(exc, self.headers)({"type": "http"}, None, send)
        self.end(exc.status)


class _Stream(_Reply):
    async def send(self, send) -> None:
        p, gw, chat = self.parsed, self.gw, self.kind == "chat"
        rid, model, created, usage = self.response_id, self.model, int(time.time()), p.include_usage
        headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        headers += [(k.encode(), v.encode()) for k, v in {**_SSE_HEADERS, **self.headers}.items()]
        await send({"type": "http.response.start", "status": 200, "headers": headers})

        async def emit(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        if chat:
            await emit(_sse(oai.chat_role_chunk(rid, model, created, usage)))
        chunk = oai.chat_chunk if chat else oai.completion_chunk
        metrics, labels = gw.metrics, ("gateway", model)
        last_sent: float | None = None
        completion = None
        try:
            async for batch in self.handle.batches(timeout=gw.config.timeout_s, idle_s=KEEPALIVE_S):
                completion = self.handle.completion
                text = "".join(e.text for e in batch)
                if not text and completion is None:
                    if not batch:   # nothing for KEEPALIVE_S: a comment, which clients skip; a
                        await emit(_KEEPALIVE)   # client that left is found at this write, not the next token
                    continue
                finish = completion.finish_reason if completion is not None else None
                await emit(_sse(chunk(rid, model, created, text, finish, usage)))
                now = time.perf_counter()
                if last_sent is None:
                    metrics.ttft.labels(*labels).observe(now - self.arrived)
                else:
                    metrics.itl.labels(*labels).observe(now - last_sent)
                last_sent = now
        except TimeoutError:
            self.finished = True
            await gw.cancel(self.handle.request_id)
            return await self._fail(emit, send, _timeout(gw.config.timeout_s))
        except RequestFailed as exc:
            self.finished = True
            return await self._fail(emit, send, _failure(exc))
        except redis.RedisError as exc:  # (an OSError is the HTTP connection's: see _Answer)
            self.finished = True
            return await self._fail(emit, send, OpenAIError(503, f"lost the cluster's Redis: {exc}",
                                                            "server_error", code="service_unavailable"))
        self.finished = True
        if usage:
            await emit(_sse(oai.usage_chunk(self.kind, rid, model, created, completion.num_prompt_tokens,
                                            len(completion.token_ids), completion.cached_tokens)))
        await send({"type": "http.response.body", "body": _DONE, "more_body": False})
        self.end(200, completion)

    async def _fail(self, emit, send, exc: OpenAIError) -> None:
        """An error after the stream began: an error event, then [DONE] (as vLLM does)."""
        await emit(_sse(exc.body()))
        await send({"type": "http.response.body", "body": _DONE, "more_body": False})
        self.end(exc.status)


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

    app = Starlette(routes=gw.routes(), lifespan=lifespan)
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


def serve(config: GatewayConfig, sock: socket.socket, log_level: str = "warning") -> None:
    """Serve on ``sock`` until SIGINT/SIGTERM (uvicorn's handlers: stop taking connections,
    let the answers in progress finish for up to 10 s)."""
    import uvicorn

    app = build_app(config)
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level.lower(), access_log=False,
                                           timeout_graceful_shutdown=10, lifespan="on"))
    # uvicorn handles SIGINT/SIGTERM itself, then raises the signal again for the handler
    # that was there before: a no-op, so that a requested stop exits with status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
