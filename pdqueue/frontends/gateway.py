"""The OpenAI-compatible HTTP gateway in front of a pdqueue cluster (``pdqueue serve``): the
Starlette app, its routes, and the process's stop (``serve``). Its parts: ``admission``
(admission.py: the checks before a submit) and ``drain`` (drain.py: the stop's state).

Endpoints: ``POST /v1/completions`` and ``/v1/chat/completions`` (streaming or not; one
``AsyncClient.submit`` per request, its answer read from ``out:<id>``: ``answer.py``),
``GET /v1/models`` (what the live workers serve), ``GET /health`` (200 while workers of
each needed role live), ``GET /v1/requests/{id}`` and ``POST /v1/requests/{id}/cancel``
(resumable requests: ``resumable.py``), ``/v1/responses`` (OpenAI's Responses API, its
state in Redis: ``responses.py``), ``GET /metrics`` (Prometheus: ``gateway_metrics.py``).

404 (unknown model) and 429 (backlog over ``max_backlog``) are answered (``Admission``) from
``ClusterView``, polled in the background, at no round trip. No worker to take a request is no reason to refuse
it: it waits in the queue up to ``capacity_wait_s`` (``capacity.py``), then 503 + Retry-After.
401: ``api_key`` is set and ``Authorization: Bearer`` differs (``/health``, ``/metrics`` are open). 504: no answer
within ``timeout_s`` (sent as ``deadline_ms`` too, so workers drop it). A client that hangs
up cancels a plain request (``cancel:<id>``); ``keepalive_s`` adds SSE comments while no
token comes (off by default: some benchmark clients drop every event after a comment).

Stopping (``serve``): the first SIGTERM/SIGINT drains (new requests and ``/health`` get 503
with ``Retry-After``, open answers run to their end, then exit 0); a second ends every open
answer with an error (never a cut connection) and cancels its request.

The gateway holds no state of its own; any number can serve one cluster. Never imports
torch; uvicorn only in ``serve``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import time
import uuid
from dataclasses import dataclass

import redis
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pdqueue.client import AsyncClient
from pdqueue.frontends import http_errors as errs
from pdqueue.frontends import openai_compat as oai
from pdqueue.frontends import resumable as res
from pdqueue.frontends.admission import FRESH_S, Admission
from pdqueue.frontends.answer import Answer, reply
from pdqueue.frontends.batch_api import BatchAPI
from pdqueue.frontends.batch_runner import BatchRunner
from pdqueue.frontends.capacity import waiting_for_capacity
from pdqueue.frontends.cluster_view import ClusterView
from pdqueue.frontends.drain import Drain
from pdqueue.frontends.gateway_metrics import GatewayMetrics
from pdqueue.frontends.openai_compat import OpenAIError
from pdqueue.frontends.responses import ResponsesAPI
from pdqueue.frontends.responses_store import DEFAULT_TTL_S as RESPONSES_TTL_S
from pdqueue.frontends.runtime import Handover, Runtime, bind, runtime
from pdqueue.frontends.service_classes import class_fields
from pdqueue.frontends.tenants import RateLimited, Tenant, Tenants, load_tenants
from pdqueue.keys import Keys
from pdqueue.protocol import RequestError
from pdqueue.protocol.requests import MAX_TENANT_CHARS
from pdqueue.queue.ledger import idempotency_ref

log = logging.getLogger("pdqueue.frontends.gateway")

__all__ = ["ClusterView", "Gateway", "GatewayConfig", "Runtime", "bind", "build_app", "runtime", "serve"]


@dataclass(frozen=True)
class GatewayConfig:
    redis_url: str
    cluster: str = "default"
    api_key: str | None = None        # None: no authentication
    max_backlog: int | None = None    # None: no 429
    timeout_s: float | None = 600.0   # None: wait for ever
    poll_s: float = 0.25              # how often the cluster view is refreshed
    keepalive_s: float | None = None  # an SSE comment after this long without a token; None: never
    tenants: tuple[Tenant, ...] = ()  # API keys -> tenants (tenants.py); none: api_key is tenant "default"
    batch_lease_s: float = 10.0       # a killed gateway's batches are taken over after this
    batch_concurrency: int = 64       # requests in flight per batch
    responses_ttl_s: int = RESPONSES_TTL_S   # a stored response (/v1/responses) lives this long after its last write
    capacity_wait_s: float = 30.0     # no worker can take a request: it waits this long in the queue, then 503



class Gateway:
    def __init__(self, config: GatewayConfig):
        self.config = config
        self.keys = Keys(config.cluster)
        self.view = ClusterView(config.redis_url, self.keys, config.poll_s)
        self.metrics = GatewayMetrics()
        self.tenants = Tenants(list(config.tenants) or load_tenants(None, config.api_key), self.metrics)
        self.admission = Admission(config, self.view, self.tenants)   # 401, 429, 503, 404 (admission.py)
        self.client: AsyncClient | None = None
        self._poller: asyncio.Task | None = None
        self._ignored_logged: set[tuple[str, ...]] = set()
        self.records = res.Records(self.keys, config.timeout_s)
        self.batch_api = BatchAPI(self)
        self.responses = ResponsesAPI(self)
        self.batches: BatchRunner | None = None   # the batches this gateway runs (from start)
        self._batch_task: asyncio.Task | None = None
        self.drain = Drain()   # the process's stop (serve): draining, stopped, the answers open (drain.py)

    # ---- lifespan ------------------------------------------------------------------------
    async def start(self) -> None:
        # One client per process; its pool holds a connection per answer being read
        # (RedisConfig.max_connections).
        self.client = AsyncClient(self.config.redis_url, self.config.cluster)
        self.records.redis = self.client.redis
        await self.view.refresh()
        self._poller = asyncio.ensure_future(self.view.run())
        self.batches = BatchRunner(self.config.redis_url, self.keys, self.client.redis, self.cancel,
                                   lease_s=self.config.batch_lease_s, concurrency=self.config.batch_concurrency)
        self._batch_task = asyncio.ensure_future(self.batches.run())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        if self.batches is not None:
            await self.batches.stop()
        if self.client is not None:
            await self.client.aclose()
        self.view.close()

    # ---- endpoints ----------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if self.drain.draining:
            return errs.error(errs.unavailable(errs.DRAINING), errs.retry_after({}))
        if self.view.ok and self.view.serving():
            return Response(status_code=200)
        if time.monotonic() - self.view.polled_at >= FRESH_S:   # unhealthy: make sure it still is
            await self.view.refresh()
            if self.view.ok and self.view.serving():
                return Response(status_code=200)
        live = self.view.live_roles()
        why = "cannot reach Redis" if not self.view.ok else f"no workers to serve requests (live: {live})"
        return errs.error(errs.unavailable(why))

    async def metrics_endpoint(self, request: Request) -> Response:
        self.metrics.backlog.labels("gateway").set(self.view.backlog)
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        try:
            self.admission.tenant_of(request)
        except OpenAIError as exc:
            return self.count("models", errs.error(exc))
        now = int(time.time())
        data = [{"id": name, "object": "model", "created": info["created"] or now, "owned_by": "pdqueue",
                 "root": name, "parent": None, "max_model_len": info["max_model_len"] or None, "permission": []}
                for name, info in sorted(self.view.models().items())]
        return self.count("models", JSONResponse({"object": "list", "data": data}))

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
            self.admission.tenant_of(request)
            request_id, _ = await self.records.find(request.path_params["request_id"])
            headers["x-request-id"] = request_id
            await self.client.cancel(request_id)
        except OpenAIError as exc:
            return self.count("cancel", errs.error(exc, headers))
        except (redis.RedisError, OSError) as exc:
            unavailable = errs.unavailable(f"cannot reach the cluster's Redis: {exc}")
            return self.count("cancel", errs.error(unavailable, headers))
        log.info("request %s: cancelled by its client", request_id)
        return self.count("cancel", JSONResponse({"id": request_id, "object": "request.cancel", "cancelled": True},
                                                  headers=headers))

    def count(self, endpoint: str, response: Response) -> Response:
        self.metrics.requests.labels("gateway", endpoint, str(response.status_code)).inc()
        return response

    async def _answering(self, request: Request, endpoint: str, answer) -> Response:
        """What the answering endpoints share: the stop (503 while draining), the key, and
        the count of requests on their way to an answer (the drain waits for them)."""
        headers = {"x-request-id": res.named(request) or request.path_params.get("request_id") or uuid.uuid4().hex}
        if self.drain.draining:
            return self.count(endpoint, errs.error(errs.unavailable(errs.DRAINING), errs.retry_after(headers)))
        self.drain.busy += 1
        try:
            self.admission.tenant_of(request)
            return await answer(headers)
        except RateLimited as exc:
            return self.count(endpoint, errs.error(exc.error, {**headers, "retry-after": str(exc.retry_after)}))
        except OpenAIError as exc:
            return self.count(endpoint, errs.error(exc, headers))
        finally:
            self.drain.busy -= 1

    async def _generate(self, request: Request, kind: str, headers: dict) -> Response:
        arrived = time.perf_counter()
        tenant = request.state.tenant
        self.tenants.admit(tenant)   # RateLimited: the 429 where the request enters
        endpoint = "chat" if kind == "chat" else "completions"
        ident = res.ident(request, headers["x-request-id"])
        headers["x-request-id"] = ident.request_id
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as exc:
            raise oai.bad_request(f"the request body is not valid JSON: {exc}") from None
        parsed = oai.parse_chat(body) if kind == "chat" else oai.parse_completion(body)
        if parsed.ignored:
            self._log_ignored(parsed.ignored)
        params = res.params_hash(kind, parsed) if ident.resumable else ""   # only a record holds it
        answer = dict(endpoint=endpoint, arrived=arrived, headers=headers, after=ident.after,
                      cancels=not ident.resumable, tenant=tenant)
        record = await self.records.load(ident.request_id) if ident.resumable else None
        if record is not None:   # a retry or a resume: attach to the first request
            return await self._attach(ident.request_id, record, params, parsed, answer)
        if ident.after is not None:
            return await self._resume_unrecorded(ident.request_id, kind, parsed, answer)
        model, info = await self.admission.admit_fresh(parsed, tenant)
        spec = res.Spec(kind, model, int(time.time()), parsed.include_usage)
        handle = await self._submit(ident.request_id, parsed, info, tenant.tenant.service_class, tenant.name,
                                    ident.resumable)
        if ident.resumable:
            await self.records.save(ident.request_id, spec, params)
        return self._reply(handle, spec, parsed.stream, ids=ident.resumable, attached=False, **answer)

    async def _attach(self, request_id: str, record: tuple[res.Spec, str], params: str, parsed: oai.Parsed,
                      answer: dict) -> Answer:
        """A resumable request sent before: its answer (after ``Last-Event-ID``), as the
        first gateway wrote it (model, ``created``); no submit."""
        spec, first = record
        if first != params:
            raise OpenAIError(422, f"Idempotency-Key {request_id!r} was first used with other parameters; a retry "
                                   f"must send the same request", "invalid_request_error", "Idempotency-Key",
                              "idempotency_key_reused")
        await self.records.check_not_gone(request_id, spec)
        spec = res.Spec(spec.kind, spec.model, spec.created, parsed.include_usage)
        return self._reply(self.client.handle(request_id), spec, parsed.stream, ids=True, attached=True, **answer)

    async def _resume_unrecorded(self, request_id: str, kind: str, parsed: oai.Parsed, answer: dict) -> Answer:
        """``Last-Event-ID`` for a request with no record (an X-Request-Id, or records
        refused by an ACL): the rest of an answer that must be there, written as this body asks."""
        if not await self.records.has_answer(request_id):
            raise OpenAIError(404, f"request {request_id!r} has no answer to resume", "invalid_request_error",
                              "Last-Event-ID", "request_not_found")
        models = sorted(self.view.models())
        spec = res.Spec(kind, parsed.model or (models[0] if models else ""), int(time.time()), parsed.include_usage)
        return self._reply(self.client.handle(request_id), spec, parsed.stream, ids=True, attached=True, **answer)

    async def _fetch(self, request: Request, headers: dict) -> Response:
        arrived = time.perf_counter()
        given = request.path_params["request_id"]
        request_id, record = await self.records.find(given)
        headers["x-request-id"] = request_id
        stream, after = res.wants_stream(request), res.last_event_id(request)
        if record is None:
            raise OpenAIError(404, f"no resumable request {given!r}: requests sent with an Idempotency-Key can be "
                                   f"read by id, for an hour after their answer", "invalid_request_error",
                              "request_id", "request_not_found")
        spec, _ = record
        await self.records.check_not_gone(request_id, spec)
        return self._reply(self.client.handle(request_id), spec, stream, endpoint="requests", arrived=arrived,
                           headers=headers, after=after, ids=True, attached=True, cancels=False)

    async def _submit(self, request_id: str, parsed: oai.Parsed, info: dict, service_class: str, tenant="",
                      keyed=False):
        parsed.check_context(info["max_model_len"] or None)   # (the worker checks text prompts)
        kwargs = {**parsed.submit_kwargs(), **class_fields(service_class), "tenant": tenant[:MAX_TENANT_CHARS]}
        kwargs["ref"] = idempotency_ref(request_id if keyed else "")   # the usage record's labels (queue/ledger.py)
        if self.config.timeout_s is not None:
            kwargs["deadline_ms"] = max(1, int(self.config.timeout_s * 1000))
        try:
            handle = await self.client.submit(id=request_id, **kwargs)
        except RequestError as exc:
            raise oai.bad_request(exc.reason) from None
        except (redis.RedisError, OSError) as exc:
            raise errs.unavailable(f"cannot reach the cluster's Redis: {exc}") from None
        self.view.sent_since_poll += 1
        return waiting_for_capacity(handle, self.view, self.cancel, self.config)

    def _reply(self, handle, spec: res.Spec, stream: bool, **options) -> Answer:
        return reply(self, handle, spec, stream, **options)

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
        error = errs.routing_error(request.method, request.url.path, exc, sorted({r.path for r in self.routes()}))
        return self.count("other", errs.error(error, exc.headers))

    def routes(self) -> list[Route]:
        return [Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/requests/{request_id}", self.fetch, methods=["GET"]),
                Route("/v1/requests/{request_id}/cancel", self.cancel_request, methods=["POST"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics_endpoint, methods=["GET"]),
                *self.batch_api.routes(), *self.responses.routes()]



def build_app(config: GatewayConfig) -> Starlette:
    gw = Gateway(config)

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        await gw.start()
        gw.responses.start()   # the sweep of the responses not ended (responses_store)
        try:
            yield
        finally:
            await gw.responses.stop()
            await gw.stop()

    app = Starlette(routes=gw.routes(), lifespan=lifespan, exception_handlers={HTTPException: gw.http_error})
    app.state.gateway = gw
    return app



def serve(config: GatewayConfig, sock: socket.socket, log_level: str = "warning", *, loop: str = "auto",
          http: str = "auto", on_ready=None) -> None:
    """Serve on ``sock`` until stopped. The stop, which a supervisor (``pdqueue up``) relies on:

    - The first SIGTERM or SIGINT *drains*: the listener stays open; every new completion,
      chat or ``/v1/requests`` request and ``/health`` get 503 with ``Retry-After`` (an
      OpenAI error, code ``service_unavailable``); every open answer runs to its end, with
      no limit but its own ``timeout_s``. When the last has ended, the process exits 0.
    - A second signal ends every open answer now: a stream with an error event (``data:
      {"error": ...}``) and ``data: [DONE]``, a non-streaming request with a JSON 503; their
      pdqueue requests are cancelled (``cancel:<id>``). Then it exits 0. A connection is
      never cut.
    - The batches it runs (``/v1/batches``) are let go at the first signal: another
      gateway, or this one restarted, takes them over where they stopped.

    So a supervisor sends SIGTERM to the gateway first and waits for it to exit before it
    stops what the open answers read (the workers, the Redis server), and sends a second
    SIGTERM when its own user insists (a second Ctrl-C).

    ``loop`` (auto, asyncio, uvloop) and ``http`` (auto, h11, httptools): see ``runtime``
    (ValueError for one that is not installed); the choice is logged (info) at the start
    (``pdqueue serve`` prints the same line on stderr). SIGUSR1 hands the socket over to
    another gateway (``runtime.Handover``: ``on_ready`` is called once it accepts)."""
    import uvicorn

    rt = runtime(loop, http)
    log.info("gateway runtime: %s", rt.describe())
    app = build_app(config)
    handover = Handover(app, on_ready)
    # timeout_graceful_shutdown bounds only what is left once drained: idle keep-alive
    # connections and requests still being received (no answer of ours is open then).
    # proxy_headers off: nothing here reads the client's address or scheme (uvicorn would
    # scan every request's headers for X-Forwarded-* from 127.0.0.1).
    server = _server(uvicorn.Config(handover.app, log_level=log_level.lower(), access_log=False, loop=rt.loop,
                                    http=rt.http, proxy_headers=False, timeout_graceful_shutdown=5,
                                    lifespan="on"), app.state.gateway, handover)
    # A signal after the server has stopped (a supervisor insisting) must not turn exit 0
    # into death by signal: uvicorn puts back the handlers it found, so these no-ops.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])


def _server(config, gw: Gateway, handover: Handover):
    """A uvicorn server whose signals drive ``gw``'s stop instead of uvicorn's own (which
    closes the listener and gives open answers ``timeout_graceful_shutdown``)."""
    import uvicorn

    class Server(uvicorn.Server):
        signals = 0

        def handle_exit(self, sig, frame) -> None:
            self.signals += 1   # acted on in on_tick, on the event loop (every 0.1 s)

        async def on_tick(self, counter: int) -> bool:
            if self.signals:
                gw.drain.request(forced=self.signals > 1, batches=gw.batches)
                if gw.drain.idle(gw.batches):
                    log.warning("no answer left open: exiting")
                    return True
            elif handover.tick(self, lambda: gw.batches.let_go() if gw.batches else None,
                               bool(gw.drain.open or gw.drain.busy)):
                log.warning("handed over: no connection left open: exiting")
                return True
            return await super().on_tick(counter)

    return Server(config)
