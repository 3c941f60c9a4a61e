"""OpenAI's Responses API on the gateway: ``POST /v1/responses`` (create), ``GET
/v1/responses/{id}`` (retrieve; with ``?stream=true`` its events, from the start or after
``starting_after``), ``POST /v1/responses/{id}/cancel``, ``DELETE /v1/responses/{id}``, ``GET
/v1/responses/{id}/input_items``.

A response is one pdqueue chat request (``resp-<hex>`` for ``resp_<hex>``), sent through the
gateway's chat path (the tenant's rate limit and service class, the model and backlog checks,
the context check, the deadline), its prompt rendered by the workers through the model's chat
template (``responses_compat`` says what the prompt is and why a next turn's starts with this
one's). Its state is in Redis (``responses_store``), its answer in the request's ``out:<id>``
stream, which the workers write whatever happens to the gateway: so a gateway killed mid-stream
loses nothing, and any gateway resumes the stream, numbering the events as the first did.

- ``stream``: server-sent events (``event: <type>`` and ``data: {...}``, each with its
  ``sequence_number``). As on the chat path the stream starts (200, ``response.created``) with the
  answer's first entry, so a request the workers refuse (a prompt over the context) is the same
  JSON 400 as without streaming; after that an error is a ``response.failed`` event. A
  connection's own trouble (the gateway's timeout, a lost Redis, a forced stop) ends it with an
  ``error`` event numbered as the last event sent, after which ``starting_after`` resumes.
- ``store`` (default true): the response is kept (``--responses-ttl-s``) and its client hanging
  up does not cancel it: it runs to its end, to be read or resumed. ``store: false``: nothing is
  kept and a hang-up cancels, as a plain chat request.
- ``background``: the create answers at once (status ``queued``), or streams; the request runs
  on the workers, detached from any connection, and a gateway's sweep (``responses_store``)
  records its end. ``cancel`` stops it (any stored response that has not ended: OpenAI allows
  only background ones); cancelling an ended response returns it as it is.
- Tenants see only their own responses: another tenant's id is a 404, as an unknown one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import redis
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pdqueue.client import RequestFailed
from pdqueue.frontends import http_errors as errs
from pdqueue.frontends import responses_compat as rc
from pdqueue.frontends.answer import Reply
from pdqueue.frontends.openai_compat import OpenAIError, bad_request
from pdqueue.frontends.responses_compat import FINAL, Outcome, Record
from pdqueue.frontends.responses_store import ResponsesStore
from pdqueue.frontends.resumable import Spec, wants_stream

log = logging.getLogger("pdqueue.frontends.gateway")

__all__ = ["ResponseStream", "ResponseWhole", "ResponsesAPI"]

ENDPOINT = "responses"
API = "Responses API"   # how its Redis failures name it
SWEEP_S = 1.0   # how often a gateway looks at the active responses (responses_store.sweep)
_KEEPALIVE = b": keep-alive\n\n"
_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def _sse(event: dict) -> bytes:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


def _starting_after(request: Request) -> int:
    raw = request.query_params.get("starting_after")
    if raw is None or raw == "":
        return -1
    try:
        value = int(raw)
    except ValueError:
        value = -2
    if value < -1:
        raise bad_request(f"starting_after must be the sequence_number of an event (an integer >= 0), got "
                          f"{raw[:40]!r}", "starting_after")
    return value


class ResponseReply(Reply):
    """One response being written (``answer.Reply``: the client's hang-up, the forced stop,
    metrics and the tenant's counts); ``rec``: its record."""

    def __init__(self, api: "ResponsesAPI", handle, rec: Record, *, starting_after: int = -1, **options):
        super().__init__(api.gw, handle, Spec("response", rec.model, rec.created_at, False), endpoint=ENDPOINT,
                         **options)
        self.api, self.rec = api, rec
        self.starting_after = starting_after
        self.last_seq = -1   # the last event of the response written (or skipped: the client had it)

    @property
    def response_id(self) -> str:
        return self.rec.id

    async def stop_now(self, work: asyncio.Future, send) -> None:
        """The forced stop: a stored response is not cancelled (it goes on, to be read or
        resumed elsewhere); its answer here ends with an error."""
        if self.cancels:
            return await super().stop_now(work, send)
        self.finished = True
        work.cancel()
        try:
            await work
        except BaseException:
            pass
        message = "the gateway stopped before the answer was complete; the response goes on: retrieve or resume it"
        try:
            await self.fail(send, errs.unavailable(message), errs.retry_after(self.headers))
        except OSError:
            self.end(499)

    async def fail(self, send, exc: OpenAIError, headers: dict | None = None) -> None:
        """The JSON error if nothing was sent yet, else (a stream) an ``error`` event numbered
        as the last event sent (``starting_after`` it resumes the rest)."""
        if not self.complete:
            if not self.started:
                await errs.error(exc, headers or self.headers)({"type": "http"}, None, send)
            else:
                event = {"type": "error", "sequence_number": max(self.last_seq, 0), "code": exc.code,
                         "message": exc.message, "param": exc.param}
                await send({"type": "http.response.body", "body": _sse(event), "more_body": False})
        self.end(exc.status)

    async def timed_out(self) -> None:
        """The gateway's timeout: a response not stored is cancelled, as a chat request is;
        a stored one is left to its request's deadline (the workers drop it then), so a late
        reader's timeout never stops what it reads."""
        if self.cancels:
            await self.gw.cancel(self.handle.request_id)

    async def refused(self, exc: RequestFailed) -> None:
        """The workers refused the request before its first token (a 400 of the chat path's):
        a response that was never made is not kept."""
        if self.rec.store:
            await self.api.store.delete(self.rec.id)


class ResponseWhole(ResponseReply):
    """The response object once the answer has ended (a foreground, non-streaming create)."""

    async def send(self, send) -> None:
        timeout = self.gw.config.timeout_s
        deltas: list[str] = []
        try:
            async for batch in self.handle.batches(timeout=timeout):
                deltas.extend(e.text for e in batch if e.text)
            completion = self.handle.completion
            outcome = Outcome.of(completion, deltas)
            rec, status = await self.api.store.finish(self.rec, outcome)
        except TimeoutError:
            self.finished = True
            await self.timed_out()
            return await self.fail(send, errs.timeout(timeout))
        except RequestFailed as exc:
            self.finished = True
            error = errs.failure(exc)
            try:
                if error.status < 500 and not deltas:
                    await self.refused(exc)
                else:
                    await self.api.store.finish(self.rec, Outcome.failed(deltas, exc.code, exc.reason))
            except (redis.RedisError, OSError) as lost:
                log.warning("response %s: could not record its failure (%s)", self.rec.id, lost)
            return await self.fail(send, error)
        except redis.RedisError as exc:
            self.finished = True
            return await self.fail(send, errs.unavailable(f"lost the cluster's Redis: {exc}"))
        self.finished = True
        if completion.finish_reason.value == "expired":
            return await self.fail(send, errs.timeout(timeout))
        body = rc.response_object(rec, status, rec.outcome or outcome)
        await JSONResponse(body, headers=self.headers)({"type": "http"}, None, send)
        self.end(200, completion)


class ResponseStream(ResponseReply):
    """The response's events: an ended one's from its record, else as its answer comes
    (``out:<id>`` read from its start, so every read numbers the events alike), those after
    ``starting_after``."""

    async def _start(self, send) -> None:
        if self.started:
            return
        headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        headers += [(k.encode(), v.encode()) for k, v in {**_SSE_HEADERS, **self.headers}.items()]
        await send({"type": "http.response.start", "status": 200, "headers": headers})

    async def _write(self, send, events: list[dict]) -> None:
        body = b""
        for event in events:
            self.last_seq = event["sequence_number"]
            if event["sequence_number"] > self.starting_after:
                body += _sse(event)
        if body:
            await send({"type": "http.response.body", "body": body, "more_body": True})

    async def _close(self, send, events: list[dict], status: int, completion=None) -> None:
        await self._write(send, events)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        self.end(status, completion)

    async def send(self, send) -> None:
        rec, events = self.rec, rc.Events(self.rec)
        if rec.outcome is not None:   # ended: every event is in the record
            self.finished = True
            await self._start(send)
            return await self._close(send, events.replay(rec.status or rec.outcome.status, rec.outcome), 200)
        gw = self.gw
        metrics, labels = gw.metrics, ("gateway", rec.model)
        deltas: list[str] = []
        last_sent: float | None = None
        try:
            async for batch in self.handle.batches(timeout=gw.config.timeout_s, idle_s=gw.config.keepalive_s):
                if not self.started:
                    await self._start(send)
                    await self._write(send, events.opening())
                out = []
                for event in batch:
                    if event.text:
                        deltas.append(event.text)
                        out += events.delta(event.text)
                if out:
                    await self._write(send, out)
                    if not self.attached:
                        now = time.perf_counter()
                        (metrics.ttft if last_sent is None else metrics.itl).labels(*labels).observe(
                            now - (self.arrived if last_sent is None else last_sent))
                        last_sent = now
                elif not batch and self.handle.completion is None:   # keepalive_s without a token
                    await send({"type": "http.response.body", "body": _KEEPALIVE, "more_body": True})
            completion = self.handle.completion
            outcome = Outcome.of(completion, deltas)
            ended, status = await self.api.store.finish(rec, outcome)
        except TimeoutError:
            self.finished = True
            await self.timed_out()
            return await self.fail(send, errs.timeout(gw.config.timeout_s))
        except RequestFailed as exc:
            return await self._failed(send, events, deltas, exc)
        except OpenAIError as exc:
            self.finished = True
            return await self.fail(send, exc)
        except redis.RedisError as exc:   # (an OSError is the HTTP connection's: see answer.Answer)
            self.finished = True
            return await self.fail(send, errs.unavailable(f"lost the cluster's Redis: {exc}"))
        self.finished = True
        await self._start(send)
        if self.last_seq < 0:
            await self._write(send, events.opening())
        outcome = ended.outcome or outcome
        tail = [e for text in outcome.deltas[len(deltas):] for e in events.delta(text)]   # (Outcome.of)
        await self._close(send, tail + events.closing(status, outcome, ended), 200, completion)

    async def _failed(self, send, events: rc.Events, deltas: list[str], exc: RequestFailed) -> None:
        """An error entry: before the stream started, a foreground response's JSON error (as
        on the chat path); else ``response.failed``."""
        self.finished = True
        error = errs.failure(exc)
        try:
            if not self.started and not self.rec.background and not self.attached:
                if error.status < 500:
                    await self.refused(exc)
                else:
                    await self.api.store.finish(self.rec, Outcome.failed(deltas, exc.code, exc.reason))
                return await self.fail(send, error)
            outcome = Outcome.failed(deltas, exc.code, exc.reason)
            ended, status = await self.api.store.finish(self.rec, outcome)
        except (redis.RedisError, OSError) as lost:
            return await self.fail(send, errs.unavailable(f"lost the cluster's Redis: {lost}"))
        await self._start(send)
        if self.last_seq < 0:
            await self._write(send, events.opening())
        await self._close(send, events.closing(status, outcome, ended), error.status)


class ResponsesAPI:
    """The routes and the sweep; ``gw``: the gateway (its checks, submit, counts, client)."""

    def __init__(self, gw):
        self.gw = gw
        self.store = ResponsesStore(gw.keys, gw.config.responses_ttl_s, lambda: gw.client)
        self._sweeper: asyncio.Task | None = None

    def start(self) -> None:
        self._sweeper = asyncio.ensure_future(self._sweeping())

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            try:
                await self._sweeper
            except BaseException:
                pass

    async def _sweeping(self) -> None:
        while True:
            try:
                await self.store.sweep()
            except (redis.RedisError, OSError) as exc:
                log.debug("responses: sweep failed (%s)", exc)
            except Exception:   # noqa: BLE001 -- one bad record must not stop the sweeps
                log.exception("responses: sweep failed")
            await asyncio.sleep(SWEEP_S)

    def routes(self) -> list[Route]:
        return [Route("/v1/responses", self._answering(self.create), methods=["POST"]),
                Route("/v1/responses/{response_id}", self._answering(self.retrieve), methods=["GET"]),
                Route("/v1/responses/{response_id}", self._plain(self.delete), methods=["DELETE"]),
                Route("/v1/responses/{response_id}/cancel", self._plain(self.cancel), methods=["POST"]),
                Route("/v1/responses/{response_id}/input_items", self._plain(self.input_items), methods=["GET"])]

    def _answering(self, handler):
        """Create and retrieve: the gateway's answering path (503 while draining, the key,
        the open count), Redis errors as 503s."""
        async def call(request: Request) -> Response:
            return await self.gw._answering(request, ENDPOINT, lambda headers: self._guarded(handler, request,
                                                                                             headers))
        return call

    async def _guarded(self, handler, request: Request, headers: dict) -> Response:
        try:
            return await handler(request, headers)
        except (redis.RedisError, OSError) as exc:
            raise errs.redis_failure(exc, API) from None

    def _plain(self, handler):
        return errs.tenant_route(self.gw, ENDPOINT, API, handler)

    # ---- create ---------------------------------------------------------------------------------
    async def create(self, request: Request, headers: dict) -> Response:
        arrived = time.perf_counter()
        gw, tenant = self.gw, request.state.tenant
        gw.tenants.admit(tenant)   # RateLimited: the 429 where the request enters
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as exc:
            raise bad_request(f"the request body is not valid JSON: {exc}") from None
        turn = rc.parse_create(body)
        if turn.ignored:
            gw._log_ignored(turn.ignored)
        conversation = list(turn.messages)
        if turn.previous_response_id is not None:
            previous = await self._previous(turn.previous_response_id, tenant.name)
            conversation = previous.continued() + conversation
        parsed = turn.chat(conversation)
        model, info = await gw.admission.admit_fresh(parsed, tenant)
        parsed.check_context(info["max_model_len"] or None)
        now, timeout = time.time(), gw.config.timeout_s
        rec = Record(rc.new_response_id(), tenant.name, int(now), model, turn.background, turn.store, turn.params,
                     turn.items, tuple(conversation), deadline_at=None if timeout is None else now + timeout)
        headers["x-request-id"] = rec.request_id
        if rec.store:
            await self.store.create(rec)
        try:
            handle = await gw._submit(rec.request_id, parsed, info, tenant.tenant.service_class, tenant.name)
        except OpenAIError:
            if rec.store:
                await self.store.delete(rec.id)
            raise
        if rec.background and not turn.stream:
            return gw.count(ENDPOINT, JSONResponse(rc.response_object(rec, "queued"), headers=headers))
        kind = ResponseStream if turn.stream else ResponseWhole
        return kind(self, handle, rec, arrived=arrived, headers=headers, tenant=tenant,
                    cancels=not rec.store).response()

    async def _previous(self, response_id: str, tenant: str) -> Record:
        """The response a turn continues: the tenant's, ended with an output."""
        previous, status = await self.store.ended(await self.store.load(response_id, tenant, "previous_response_id"))
        if status not in FINAL:
            raise bad_request(f"previous response {response_id} is {status}: a turn continues a response that has "
                              f"ended (retrieve it until it has)", "previous_response_id")
        if status == "failed":
            raise bad_request(f"previous response {response_id} failed: there is no output to continue",
                              "previous_response_id")
        return previous

    # ---- the others -------------------------------------------------------------------------------
    async def retrieve(self, request: Request, headers: dict) -> Response:
        arrived = time.perf_counter()
        stream, after = wants_stream(request), _starting_after(request)
        rec = await self.store.load(request.path_params["response_id"], request.state.tenant.name)
        rec, status = await self.store.ended(rec)
        headers["x-request-id"] = rec.request_id
        if not stream:
            return self.gw.count(ENDPOINT, JSONResponse(rc.response_object(rec, status, rec.outcome),
                                                        headers=headers))
        return ResponseStream(self, self.gw.client.handle(rec.request_id), rec, starting_after=after, arrived=arrived,
                              headers=headers, attached=True, cancels=False).response()

    async def cancel(self, request: Request, tenant: str) -> Response:
        rec, status = await self.store.ended(await self.store.load(request.path_params["response_id"], tenant))
        if status in FINAL:   # ended: as it is (cancelling twice answers the same)
            return JSONResponse(rc.response_object(rec, status, rec.outcome))
        await self.store.mark_cancelled(rec.id)
        await self.gw.client.cancel(rec.request_id)
        log.info("response %s: cancelled by its client", rec.id)
        return JSONResponse(rc.response_object(rec, "cancelled"))

    async def delete(self, request: Request, tenant: str) -> Response:
        rec = await self.store.load(request.path_params["response_id"], tenant)
        if rec.status is None:   # still running: nobody will read it now
            await self.gw.client.cancel(rec.request_id)
        await self.store.delete(rec.id)
        return JSONResponse({"id": rec.id, "object": "response", "deleted": True})

    async def input_items(self, request: Request, tenant: str) -> Response:
        rec = await self.store.load(request.path_params["response_id"], tenant)
        query = request.query_params
        try:
            limit = int(query.get("limit", "20"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 100:
            raise bad_request("limit must be an integer in 1..100", "limit")
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request(f"order must be 'asc' or 'desc', got {order[:20]!r}", "order")
        return JSONResponse(rc.input_items_page(rec, query.get("after"), limit, order))

