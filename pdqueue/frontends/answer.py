"""The answer of one completion request, as an ASGI app: a whole JSON body (``Whole``) or
server-sent events (``Stream``), written against the client's hang-up (a plain request is
cancelled, a resumable one goes on) and the gateway's forced stop (an error, never a cut
connection).

SSE ids (resumable and re-attached streams only) are item indexes: token ``i`` is item
``i``, the chat role chunk ``-1``, the finish ``n`` (the number of tokens), the usage chunk
``n + 1``, ``[DONE]`` the next; an event's id is the last item it carries. Events of this
connection's own failures (timeout, lost Redis, a stop) carry no id, so a resume goes on
after the answer's last event."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

import redis
from starlette.responses import JSONResponse

from pdqueue.client import RequestFailed
from pdqueue.frontends import http_errors as errs
from pdqueue.frontends import openai_compat as oai
from pdqueue.frontends.gateway_metrics import GatewayMetrics
from pdqueue.frontends.openai_compat import OpenAIError
from pdqueue.frontends.resumable import Spec
from pdqueue.protocol import Completion, FinishReason

if TYPE_CHECKING:
    from pdqueue.frontends.drain import Drain

log = logging.getLogger("pdqueue.frontends.gateway")

__all__ = ["Answer", "Reply", "Stream", "Whole", "reply"]

_KEEPALIVE = b": keep-alive\n\n"
_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
_DONE = b"data: [DONE]\n\n"


def _sse(obj: Any, event_id: int | None = None) -> bytes:
    data = b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
    return data if event_id is None else b"id: %d\n" % event_id + data


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



class Answer:
    """The ASGI app of one answer: the reply's ``send`` runs against the client's
    disconnect and the gateway's forced stop. A client that goes away before the answer is
    complete (or a connection that breaks while it is sent) abandons it (``reply.abandon``:
    a plain request is cancelled); a forced stop ends it with an error (``reply.stop_now``)."""

    def __init__(self, reply: "Reply"):
        self.reply = reply

    async def __call__(self, scope, receive, send) -> None:
        reply = self.reply
        send = reply.tracking(send)
        work = asyncio.ensure_future(reply.send(send))
        watch = asyncio.ensure_future(_disconnected(receive))
        stop = asyncio.ensure_future(reply.gw.drain.stopped.wait())
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
            reply.gw.drain.open.discard(reply)
        exc = None if work.cancelled() else work.exception()
        if isinstance(exc, OSError):  # the connection broke while sending
            await reply.abandon()
        elif exc is not None:
            reply.end(500)
            raise exc


class HostConfig(Protocol):
    """The settings an answer reads (``gateway.GatewayConfig``'s)."""

    @property
    def timeout_s(self) -> float | None: ...
    @property
    def keepalive_s(self) -> float | None: ...


class Host(Protocol):
    """What an answer needs of the app that holds it (``gateway.Gateway``, which imports
    this module): its settings and metrics, its stop (``drain``: the set of open answers, the
    forced stop), and cancelling a request."""

    config: HostConfig
    metrics: GatewayMetrics
    drain: Drain

    async def cancel(self, request_id: str) -> None: ...


class Reply:
    """One answer being written (its handle, how it is written, timing and accounting).

    ``after``: the last item the client has (Last-Event-ID; None: none). ``ids``: events
    carry SSE ids. ``attached``: a re-read of a request sent before (no generation metrics).
    ``cancels``: a hang-up cancels the request (plain requests; not resumable ones or reads)."""

    def __init__(self, gw: Host, handle, spec: Spec, *, endpoint: str, arrived: float, headers: dict,
                 after: int | None = None, ids: bool = False, attached: bool = False, cancels: bool = True,
                 tenant=None):
        self.gw, self.handle, self.spec = gw, handle, spec
        self.endpoint, self.arrived, self.headers = endpoint, arrived, headers
        self.after = -2 if after is None else after   # -2: nothing yet (the chat role chunk is item -1)
        self.ids, self.attached, self.cancels = ids, attached, cancels
        self.finished = False   # the answer's outcome is known: nothing to cancel any more
        self.ended = False      # counted
        self.started = False    # the response's first message was sent
        self.complete = False   # and its last
        self.tenant = tenant    # tenants.TenantState: its open count and tokens (None: not counted)
        if tenant is not None:
            tenant.started()
        gw.drain.open.add(self)
        gw.metrics.in_flight.labels("gateway").inc()

    def response(self) -> Answer:
        return Answer(self)

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
            await self.fail(send, errs.unavailable(errs.STOPPED), errs.retry_after(self.headers))
        except OSError:   # the client left meanwhile
            self.end(499)

    async def fail(self, send, exc: OpenAIError, headers: dict | None = None) -> None:
        """End the response with ``exc``: the JSON error if nothing was sent yet, else (a
        stream) an error event and [DONE], with no id (they are this connection's, not the
        answer's: a resume goes on after the answer's last event)."""
        if not self.complete:
            if not self.started:
                if headers is None and exc.status == 503:   # try again later (and maybe elsewhere)
                    headers = errs.retry_after(self.headers)
                await errs.error(exc, headers or self.headers)({"type": "http"}, None, send)
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
        counted = completion is not None and not self.attached
        if counted:
            m.e2e.labels("gateway", self.spec.model).observe(time.perf_counter() - self.arrived)
            m.finished(self.spec.model, completion)
        if self.tenant is not None:
            self.tenant.finished(status, completion.num_prompt_tokens if counted else 0,
                                 len(completion.token_ids) if counted else 0)

    @property
    def response_id(self) -> str:
        return oai.new_id(self.spec.kind, self.handle.request_id)

    async def send(self, send) -> None:
        raise NotImplementedError


class Whole(Reply):
    async def send(self, send) -> None:
        timeout = self.gw.config.timeout_s
        try:
            c = await self.handle.result(timeout=timeout)
        except TimeoutError:
            self.finished = True
            await self.gw.cancel(self.handle.request_id)
            return await self.fail(send, errs.timeout(timeout))
        except RequestFailed as exc:
            self.finished = True
            return await self.fail(send, errs.failure(exc))
        except redis.RedisError as exc:
            self.finished = True
            return await self.fail(send, errs.unavailable(f"lost the cluster's Redis: {exc}"))
        self.finished = True
        if c.finish_reason is FinishReason.EXPIRED:
            return await self.fail(send, errs.timeout(timeout))
        spec = self.spec
        build = oai.chat_body if spec.kind == "chat" else oai.completion_body
        body = build(self.response_id, spec.model, c.text, c.finish_reason, c.num_prompt_tokens, len(c.token_ids),
                     created=spec.created, cached_tokens=c.cached_tokens)
        await JSONResponse(body, headers=self.headers)({"type": "http"}, None, send)
        self.end(200, c)


class Stream(Reply):
    """Server-sent events. The response starts (200, the chat role chunk) with the answer's
    first entry, or its first keep-alive tick: an answer that fails before its first token
    (a prompt over the context, a bad parameter the worker found) is the same JSON error,
    status included (400), as without streaming, not a 200 and an error event."""

    async def _start(self, send) -> None:
        if self.started:
            return
        spec = self.spec
        headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        headers += [(k.encode(), v.encode()) for k, v in {**_SSE_HEADERS, **self.headers}.items()]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if spec.kind == "chat":
            await self._item(send, -1, oai.chat_role_chunk(self.response_id, spec.model, spec.created,
                                                            spec.include_usage))

    async def send(self, send) -> None:
        spec, gw, chat = self.spec, self.gw, self.spec.kind == "chat"
        rid, model, created, usage = self.response_id, spec.model, spec.created, spec.include_usage
        chunk = oai.chat_chunk if chat else oai.completion_chunk
        metrics, labels = gw.metrics, ("gateway", model)
        last_sent: float | None = None
        completion = None
        read = 0   # tokens read: the index after the last token event
        try:
            async for batch in self.handle.batches(timeout=gw.config.timeout_s, idle_s=gw.config.keepalive_s):
                await self._start(send)
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
            return await self.fail(send, errs.timeout(gw.config.timeout_s))
        except RequestFailed as exc:   # the answer's own end: an event of the answer, with its id
            self.finished = True
            error = errs.failure(exc)
            if not self.started:   # refused before its first entry: the error, as without streaming
                return await self.fail(send, error)
            await self._item(send, read, error.body())
            await self._done(send, read + 1)
            return self.end(error.status)
        except OpenAIError as exc:   # a Last-Event-ID that is not the end of an event
            self.finished = True
            return await self.fail(send, exc)
        except redis.RedisError as exc:  # (an OSError is the HTTP connection's: see Answer)
            self.finished = True
            return await self.fail(send, errs.unavailable(f"lost the cluster's Redis: {exc}"))
        self.finished = True
        await self._start(send)
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



def reply(gw: Host, handle, spec: Spec, stream: bool, **options) -> Answer:
    """The ASGI app that writes ``handle``'s answer (``options``: ``Reply``'s)."""
    return (Stream if stream else Whole)(gw, handle, spec, **options).response()
