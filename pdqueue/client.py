"""The producer side: submit requests, stream their tokens, cancel them.

``Client`` (redis-py) and ``AsyncClient`` (redis.asyncio) have the same surface::

    client = Client()    # the running `pdqueue up`, PDQ_REDIS_URL, or redis://127.0.0.1:6379/0
    handle = client.submit("Once upon a time", max_tokens=32, temperature=0)
    for delta in handle.text_stream():
        print(delta, end="")
    completion = handle.result()

A request is one XADD to ``requests`` (or ``requests:high``). A submit that meets a lost
connection, a timeout or a server still loading its data (LOADING, BUSY: a Redis restart)
sends the same request, same id, again with capped backoff, for ``submit_retry_s``
(``RedisConfig.submit_retry_s``, 30 s) from its start, then raises ``RedisUnavailable``
naming the request ids and how long it tried. A resend whose first try did reach Redis
queues a second entry with the same id: the workers' intake runs an id once (``seen:<id>``,
SET NX to the first entry's id; the other entry is dead-lettered as a duplicate, nothing
on ``out:<id>``), so the request is answered once. Its answer is read with XREAD BLOCK from
``out:<id>``, continuing from the last entry seen, reconnecting with capped backoff if
Redis goes away; a connection that keeps failing for ``RedisConfig.unavailable_after_s``
(30 s) raises ``RedisUnavailable``. Token entries carry their index: one a retried worker
publishes twice is yielded once. A request Redis itself lost before any answer (a failover to
a replica the write had not reached, a restart without persistence) is found by a check after
``RedisConfig.lost_check_s`` (10 s) without an answer (what it reads tells nothing of other
requests), and sent again, same id (``client_outage.LostCheck``).

Without a URL, ``Client()`` finds the cluster with ``pdqueue.discovery.resolve``.

Imports redis, msgpack and pdqueue's keys/protocol/config/retry/discovery/queue.streams,
queue.connection, client_outage (the retries' mechanics) and client_assembly (entries into
events); never torch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
import uuid
from typing import AsyncIterator, Iterator, Sequence

import redis
import redis.asyncio
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pdqueue.client_assembly import Assembler, RequestFailed
from pdqueue.client_outage import EmbeddedServer, LostCheck, ReadOutage, RedisUnavailable, Submitting, transient
from pdqueue.config import RedisConfig
from pdqueue.discovery import DEFAULT_CLUSTER, resolve
from pdqueue.keys import CANCEL_TTL_S, OUT_TTL_S, Keys
from pdqueue.protocol import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    Completion,
    Priority,
    Request,
    RequestError,
    ResultEvent,
    ResultType,
    as_str,
    request_to_fields,
    up_server,
    validate_request,
)
from pdqueue.queue.connection import async_client_from_url, client_from_url, raise_dropped_cancellation
from pdqueue.queue.streams import parse_read_reply
from pdqueue.retry import backoff_delay

log = logging.getLogger(__name__)

__all__ = ["AsyncClient", "AsyncRequestHandle", "Client", "RedisUnavailable", "RequestError",
           "RequestFailed", "RequestHandle"]

_READ_COUNT = 256


def _settings(redis_url: str | None, cluster: str | None, config: RedisConfig | None,
              have_client: bool) -> tuple[RedisConfig, str, EmbeddedServer | None]:
    """The config and the cluster of a client, and the ``pdqueue up`` server it names (None:
    another). The URL: ``redis_url``, else the config's, else (no client given either)
    ``pdqueue.discovery.resolve``; the cluster: ``cluster``, else resolved for that URL. A
    URL without credentials that names a running ``pdqueue up``'s server gets that server's
    password (``resolve``), unless the config or the environment gives one."""
    if redis_url is not None:
        config = dataclasses.replace(config, url=redis_url) if config is not None else RedisConfig(url=redis_url)
    if config is not None:
        target = resolve(config.url, cluster, credentials=True if config.password or config.password_file else None)
        if target.url != config.url:
            config = dataclasses.replace(config, url=target.url)
        return config, target.cluster, _embedded(target)
    if have_client:  # its URL is its own: only PDQ_CLUSTER can name the cluster
        return RedisConfig(), cluster or os.environ.get("PDQ_CLUSTER") or DEFAULT_CLUSTER, None
    target = resolve(None, cluster)
    return RedisConfig(url=target.url), target.cluster, _embedded(target)


def _embedded(target) -> EmbeddedServer | None:
    return EmbeddedServer(target.cluster, target.up_pid, target.server_pid) if target.server_pid else None


def build_request(prompt: str | None = None, *, prompt_ids: Sequence[int] | None = None,
                  max_tokens: int | None = DEFAULT_MAX_TOKENS, temperature: float = DEFAULT_TEMPERATURE,
                  top_p: float = DEFAULT_TOP_P,
                  top_k: int = DEFAULT_TOP_K, seed: int | None = None, stop: str | Sequence[str] = (),
                  deadline_ms: int | None = None, priority: str | Priority = Priority.NORMAL,
                  chat: bool = False, ignore_eos: bool = False, id: str | None = None,
                  messages: Sequence[dict] | None = None, service_class: str | None = None,
                  tenant: str = "", ref: str = "") -> Request:
    """A validated ``Request`` (``RequestError`` otherwise); a random id if none is given.
    ``service_class``: interactive, standard or batch (None: from ``priority``). ``tenant``
    and ``ref``: the labels of its usage record (pdqueue/queue/ledger.py)."""
    request_id = id if id is not None else uuid.uuid4().hex
    try:
        priority = Priority(priority)
    except ValueError:
        raise RequestError(f"priority must be 'normal' or 'high', got {priority!r}", request_id) from None
    req = Request(id=request_id, prompt=prompt,
                  prompt_ids=tuple(prompt_ids) if prompt_ids is not None else None,
                  max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                  seed=seed, stop=(stop,) if isinstance(stop, str) else tuple(stop),
                  deadline_ms=deadline_ms, priority=priority, chat=chat, ignore_eos=ignore_eos,
                  messages=tuple(dict(m) for m in messages) if messages is not None else None,
                  service_class=service_class, tenant=tenant, ref=ref)
    validate_request(req)
    return req


def _remaining_s(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


def _block_ms(deadline: float | None, max_block_ms: int) -> int:
    remaining = _remaining_s(deadline)
    if remaining is None:
        return max_block_ms
    if remaining <= 0:
        raise TimeoutError("timed out waiting for the result")
    return max(1, min(max_block_ms, int(remaining * 1000)))  # never 0: BLOCK 0 is forever


def _backoff_s(failures: int, deadline: float | None, initial_s: float, max_s: float) -> float:
    """The reconnect delay, never past ``deadline`` (the caller's timeout stays exact)."""
    delay = backoff_delay(failures, initial_s, max_s)
    remaining = _remaining_s(deadline)
    return delay if remaining is None else max(0.0, min(delay, remaining))


class _Reading:
    """One ``stream`` call's state, shared by the sync and asyncio loops (which differ only
    in how they wait): the deadline, the backoff after lost connections, the outage clock,
    the assembler and the handle's lost-request check."""

    def __init__(self, handle, timeout: float | None):
        client = handle.client
        self.asm = handle._asm
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.max_block_ms = client.max_block_ms
        self.backoff = (client.backoff_initial_s, client.backoff_max_s)
        self.failures = 0
        self.outage = ReadOutage(handle.request_id, client.unavailable_after_s, client.embedded)
        self.handle = handle
        self.up: tuple[int, int] | None = None   # (pid of `up`, of its server): its last entry's

    def receipt(self):
        """(key, value) of the read receipt to write once the answer was read to its end,
        when its last entry came from a ``pdqueue up``'s embedded server (``up_server``);
        else None. The client then knows that server too (``EmbeddedServer``)."""
        client, up = self.handle.client, self.up
        if up is None:
            return None
        if client.embedded is None:
            client.embedded = EmbeddedServer(client.keys.cluster, *up)
        return client.keys.read(self.handle.request_id), "1"

    @property
    def done(self) -> bool:
        return self.asm.completion is not None

    def block_ms(self) -> int:
        """How long the next XREAD may block (``TimeoutError`` past the deadline)."""
        return _block_ms(self.deadline, self.max_block_ms)

    @property
    def lost(self) -> LostCheck | None:
        return self.handle._lost

    def lost_check_due(self) -> bool:
        """Time to ask whether Redis still knows the request (``LostCheck``)."""
        return self.lost is not None and self.lost.due(answered=self.asm.last_id != "0-0")

    def lost_by_redis(self, replies) -> bool:
        """From the replies of the check's pipeline: whether Redis lost the request (send
        it again: ``sent_again``). A refused check (an ACL without its reads) is turned off
        for the handle, with a warning."""
        try:
            return self.lost.lost(replies)
        except redis.ResponseError as exc:
            log.warning("request %s: cannot check whether Redis still has it (%s); not checked again",
                        self.asm.request_id, exc)
            self.handle._lost = None
            return False

    def sent_again(self, entry_id) -> None:
        self.lost.sent_again(entry_id)
        self.handle.entry_id = self.lost.entry_id

    def read_failed(self, exc: BaseException) -> float:
        """A lost connection: how long to wait before reading again (``RedisUnavailable``
        once Redis has been gone too long)."""
        self.outage.failed(exc)
        delay = _backoff_s(self.failures, self.deadline, *self.backoff)
        self.failures += 1
        return delay

    def events(self, reply) -> Iterator[ResultEvent]:
        """The token events of an XREAD reply, in order, up to the completion."""
        self.failures = 0
        self.outage.ok()
        if reply and self.lost is not None:
            self.lost.heard()
        for _, entry_id, fields in parse_read_reply(reply):
            self.up = up_server(fields) or self.up
            for event in self.asm.feed(entry_id, fields):
                if event.type is ResultType.TOKEN:
                    yield event
            if self.done:
                return


class _Handle:
    """What both handles hold: the request's ids, its answer's key and what was read of it."""

    def __init__(self, client: "Client | AsyncClient", request_id: str, entry_id: str | None = None,
                 sent: tuple[str, dict] | None = None):
        """``sent``: the stream and fields this client sent the request with (it is sent
        again should Redis lose it); None for a handle on a request sent elsewhere."""
        self.client = client
        self.request_id = request_id
        self.entry_id = entry_id
        self.key = client.keys.out(request_id)
        self._asm = Assembler(request_id)
        self._lost = (LostCheck(client.keys, request_id, sent[0], sent[1], entry_id, client.lost_check_s)
                      if sent is not None and entry_id is not None and client.lost_check_s is not None else None)

    @property
    def completion(self) -> Completion | None:
        return self._asm.completion


class RequestHandle(_Handle):
    """One submitted request. ``stream``/``text_stream``/``result`` read its answer; they
    share one read position, so each token is yielded once across them."""

    def stream(self, timeout: float | None = None) -> Iterator[ResultEvent]:
        """Yield token events in index order until done (the generator returns the
        ``Completion``). Raises ``RequestFailed`` on an error entry, ``TimeoutError`` if
        not done within ``timeout`` seconds."""
        reading = _Reading(self, timeout)
        r = self.client.redis
        try:
            while not reading.done:
                try:
                    if reading.lost_check_due():
                        self._check_lost(reading)
                    reply = r.xread({self.key: self._asm.last_id}, count=_READ_COUNT, block=reading.block_ms())
                except (RedisConnectionError, RedisTimeoutError) as exc:
                    time.sleep(reading.read_failed(exc))
                    continue
                yield from reading.events(reply)
        except RequestFailed:
            self._read_to_end(reading)
            raise
        self._read_to_end(reading)
        return self._asm.completion

    def _read_to_end(self, reading: _Reading) -> None:
        """The read receipt (``_Reading.receipt``); best effort: without it, `up` only waits longer."""
        receipt = reading.receipt()
        if receipt is not None:
            try:
                self.client.redis.set(*receipt, ex=OUT_TTL_S)
            except redis.RedisError:
                pass

    def _check_lost(self, reading: _Reading) -> None:
        r = self.client.redis
        with r.pipeline(transaction=False) as pipe:
            reading.lost.queue(pipe)
            replies = pipe.execute(raise_on_error=False)
        if reading.lost_by_redis(replies):
            reading.sent_again(r.xadd(reading.lost.stream, reading.lost.fields))

    def text_stream(self, timeout: float | None = None) -> Iterator[str]:
        """Yield the text deltas (non-empty) as they arrive."""
        for event in self.stream(timeout):
            if event.text:
                yield event.text

    def result(self, timeout: float | None = None) -> Completion:
        """Wait for the completion; ``TimeoutError``, ``RequestFailed``."""
        for _ in self.stream(timeout):
            pass
        return self._asm.completion

    def cancel(self) -> None:
        self.client.cancel(self.request_id)


class _Settled:
    """What ``Client`` and ``AsyncClient`` share: their settings, and where a request goes."""

    def _settle(self, redis_url, cluster, config, redis_client, cancel_ttl_s, make_client,
                submit_retry_s) -> None:
        config, cluster, self.embedded = _settings(redis_url, cluster, config, redis_client is not None)
        self.url = config.url if redis_client is None or redis_url is not None else None
        self.keys = Keys(cluster)
        self._own_redis = redis_client is None
        self.redis = redis_client or make_client(config.url, **config.redis_kwargs())
        self.max_block_ms = config.max_block_ms
        self.backoff_initial_s = config.backoff_initial_s
        self.backoff_max_s = config.backoff_max_s
        self.unavailable_after_s = config.unavailable_after_s
        self.submit_retry_s = config.submit_retry_s if submit_retry_s is None else submit_retry_s
        self.lost_check_s = config.lost_check_s
        self.cancel_ttl_s = cancel_ttl_s

    def _stream_of(self, req: Request) -> str:
        return self.keys.request_stream_for(req.cls)


class Client(_Settled):
    """``Client()`` finds the cluster itself (see the module docstring); an explicit
    ``redis_url`` (or ``config.url``, or ``redis_client``) and ``cluster`` win."""

    def __init__(self, redis_url: str | None = None, cluster: str | None = None, *,
                 redis_client: redis.Redis | None = None, config: RedisConfig | None = None,
                 cancel_ttl_s: int = CANCEL_TTL_S, submit_retry_s: float | None = None):
        """``submit_retry_s``: how long a submit sends its request again while Redis is away or
        loading (None: ``config.submit_retry_s``, 30 s; 0: one attempt)."""
        self._settle(redis_url, cluster, config, redis_client, cancel_ttl_s, client_from_url, submit_retry_s)

    def _send(self, request_ids: Sequence[str], send):
        """``send()``, sent again on transient failures (``Submitting``)."""
        submitting = Submitting(self, request_ids)
        while True:
            try:
                result = send()
            except redis.RedisError as exc:
                if not transient(exc):
                    raise
                time.sleep(submitting.failed(exc))
                continue
            submitting.sent()
            return result

    def submit(self, prompt: str | None = None, *, prompt_ids: Sequence[int] | None = None,
               max_tokens: int | None = DEFAULT_MAX_TOKENS, temperature: float = DEFAULT_TEMPERATURE,
               top_p: float = DEFAULT_TOP_P,
               top_k: int = DEFAULT_TOP_K, seed: int | None = None, stop: str | Sequence[str] = (),
               deadline_ms: int | None = None, priority: str | Priority = Priority.NORMAL,
               chat: bool = False, ignore_eos: bool = False, id: str | None = None,
               messages: Sequence[dict] | None = None, service_class: str | None = None,
               tenant: str = "", ref: str = "") -> RequestHandle:
        """Queue one request; ``RequestError`` if it is invalid (nothing is sent then).
        ``max_tokens=None``: up to the model's context. A prompt plus ``max_tokens`` over the
        context is refused by the worker that tokenizes it, before any decoding: the handle
        raises ``RequestFailed`` (code ``too_long``, the sizes in its reason).
        ``id`` defaults to a random uuid; ``priority="high"`` goes to ``requests:high``;
        ``tenant`` and ``ref`` label its usage record.
        A lost connection or a loading server is retried with the same id for
        ``submit_retry_s``, then ``RedisUnavailable`` (module docstring)."""
        req = build_request(prompt, prompt_ids=prompt_ids, max_tokens=max_tokens,
                            temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                            stop=stop, deadline_ms=deadline_ms, priority=priority, chat=chat,
                            ignore_eos=ignore_eos, id=id, messages=messages,
                            service_class=service_class, tenant=tenant, ref=ref)
        stream, fields = self._stream_of(req), request_to_fields(req)
        entry_id = self._send([req.id], lambda: self.redis.xadd(stream, fields))
        return RequestHandle(self, req.id, as_str(entry_id), (stream, fields))

    def submit_many(self, requests: Sequence[dict]) -> list[RequestHandle]:
        """Queue many requests in one pipelined round trip; all are validated first. Retried
        as ``submit`` is, all of them again (each id still runs once)."""
        reqs = [build_request(**spec) for spec in requests]

        sent = [(self._stream_of(req), request_to_fields(req)) for req in reqs]

        def send():
            with self.redis.pipeline(transaction=False) as pipe:
                for stream, fields in sent:
                    pipe.xadd(stream, fields)
                return pipe.execute()

        entry_ids = self._send([req.id for req in reqs], send)
        return [RequestHandle(self, req.id, as_str(eid), how)
                for req, eid, how in zip(reqs, entry_ids, sent)]

    def handle(self, request_id: str) -> RequestHandle:
        """A handle for a request submitted elsewhere (reads its answer from the start)."""
        return RequestHandle(self, request_id)

    def cancel(self, request_id: str) -> None:
        """Ask workers to stop the request; it finishes with finish_reason "cancelled"."""
        self.redis.set(self.keys.cancel(request_id), "1", ex=self.cancel_ttl_s)

    def close(self) -> None:
        if self._own_redis:
            self.redis.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncRequestHandle(_Handle):
    """``RequestHandle`` for asyncio. ``stream`` is an async generator; the completion is
    then in ``handle.completion``."""

    async def stream(self, timeout: float | None = None) -> AsyncIterator[ResultEvent]:
        reading = _Reading(self, timeout)
        r = self.client.redis
        try:
            while not reading.done:
                raise_dropped_cancellation()   # (before a read that may block for long, too)
                try:
                    if reading.lost_check_due():
                        await self._check_lost(reading)
                    reply = await r.xread({self.key: self._asm.last_id}, count=_READ_COUNT,
                                          block=reading.block_ms())
                except (RedisConnectionError, RedisTimeoutError) as exc:
                    await asyncio.sleep(reading.read_failed(exc))
                    continue
                raise_dropped_cancellation()
                for event in reading.events(reply):
                    yield event
        except RequestFailed:
            await self._read_to_end(reading)
            raise
        await self._read_to_end(reading)

    async def _read_to_end(self, reading: _Reading) -> None:
        """See ``RequestHandle._read_to_end``."""
        receipt = reading.receipt()
        if receipt is not None:
            try:
                await self.client.redis.set(*receipt, ex=OUT_TTL_S)
            except redis.RedisError:
                pass

    async def batches(self, timeout: float | None = None,
                      idle_s: float | None = None) -> AsyncIterator[list[ResultEvent]]:
        """``stream``, one list per read: the token events that arrived together. After the
        list that holds the last token, ``completion`` is already set (the done entry comes
        in the same read as the last token), so a caller can mark that token as the last.
        A list may be empty when the done entry came alone; with ``idle_s``, also when
        nothing came for that long (a tick: the gateway tells its client it is still there,
        and so finds out soon when the client is not). An error entry raises
        ``RequestFailed`` after the tokens before it were yielded."""
        reading = _Reading(self, timeout)
        r = self.client.redis
        idle_ms = max(1, int(idle_s * 1000)) if idle_s is not None else None
        while not reading.done:
            raise_dropped_cancellation()
            block = reading.block_ms() if idle_ms is None else min(reading.block_ms(), idle_ms)
            try:
                if reading.lost_check_due():
                    await self._check_lost(reading)
                reply = await r.xread({self.key: self._asm.last_id}, count=_READ_COUNT, block=block)
            except (RedisConnectionError, RedisTimeoutError) as exc:
                await asyncio.sleep(reading.read_failed(exc))
                continue
            raise_dropped_cancellation()
            batch: list[ResultEvent] = []
            try:
                batch.extend(reading.events(reply))
            except RequestFailed:
                await self._read_to_end(reading)
                if batch:
                    yield batch
                raise
            if reading.done:
                await self._read_to_end(reading)
            if batch or reading.done or idle_ms is not None:
                yield batch

    async def _check_lost(self, reading: _Reading) -> None:
        """See ``RequestHandle._check_lost``."""
        r = self.client.redis
        async with r.pipeline(transaction=False) as pipe:
            reading.lost.queue(pipe)
            replies = await pipe.execute(raise_on_error=False)
        if reading.lost_by_redis(replies):
            reading.sent_again(await r.xadd(reading.lost.stream, reading.lost.fields))

    async def text_stream(self, timeout: float | None = None) -> AsyncIterator[str]:
        async for event in self.stream(timeout):
            if event.text:
                yield event.text

    async def result(self, timeout: float | None = None) -> Completion:
        async for _ in self.stream(timeout):
            pass
        return self._asm.completion

    async def cancel(self) -> None:
        await self.client.cancel(self.request_id)


class AsyncClient(_Settled):
    """See ``Client``."""

    def __init__(self, redis_url: str | None = None, cluster: str | None = None, *,
                 redis_client: redis.asyncio.Redis | None = None,
                 config: RedisConfig | None = None, cancel_ttl_s: int = CANCEL_TTL_S,
                 submit_retry_s: float | None = None):
        self._settle(redis_url, cluster, config, redis_client, cancel_ttl_s, async_client_from_url,
                     submit_retry_s)

    async def _send(self, request_ids: Sequence[str], send):
        """See ``Client._send``; ``send`` is a coroutine function."""
        submitting = Submitting(self, request_ids)
        while True:
            try:
                result = await send()
            except redis.RedisError as exc:
                if not transient(exc):
                    raise
                raise_dropped_cancellation()   # (a cancelled submit is not sent again)
                await asyncio.sleep(submitting.failed(exc))
                continue
            submitting.sent()
            return result

    async def submit(self, prompt: str | None = None, *, prompt_ids: Sequence[int] | None = None,
                     max_tokens: int | None = DEFAULT_MAX_TOKENS, temperature: float = DEFAULT_TEMPERATURE,
                     top_p: float = DEFAULT_TOP_P,
                     top_k: int = DEFAULT_TOP_K, seed: int | None = None, stop: str | Sequence[str] = (),
                     deadline_ms: int | None = None, priority: str | Priority = Priority.NORMAL,
                     chat: bool = False, ignore_eos: bool = False,
                     id: str | None = None, messages: Sequence[dict] | None = None,
                     service_class: str | None = None, tenant: str = "", ref: str = "") -> AsyncRequestHandle:
        """See ``Client.submit``."""
        req = build_request(prompt, prompt_ids=prompt_ids, max_tokens=max_tokens,
                            temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                            stop=stop, deadline_ms=deadline_ms, priority=priority, chat=chat,
                            ignore_eos=ignore_eos, id=id, messages=messages,
                            service_class=service_class, tenant=tenant, ref=ref)
        stream, fields = self._stream_of(req), request_to_fields(req)
        entry_id = await self._send([req.id], lambda: self.redis.xadd(stream, fields))
        return AsyncRequestHandle(self, req.id, as_str(entry_id), (stream, fields))

    async def submit_many(self, requests: Sequence[dict]) -> list[AsyncRequestHandle]:
        reqs = [build_request(**spec) for spec in requests]

        sent = [(self._stream_of(req), request_to_fields(req)) for req in reqs]

        async def send():
            async with self.redis.pipeline(transaction=False) as pipe:
                for stream, fields in sent:
                    pipe.xadd(stream, fields)
                return await pipe.execute()

        entry_ids = await self._send([req.id for req in reqs], send)
        return [AsyncRequestHandle(self, req.id, as_str(eid), how)
                for req, eid, how in zip(reqs, entry_ids, sent)]

    def handle(self, request_id: str) -> AsyncRequestHandle:
        return AsyncRequestHandle(self, request_id)

    async def cancel(self, request_id: str) -> None:
        await self.redis.set(self.keys.cancel(request_id), "1", ex=self.cancel_ttl_s)

    async def aclose(self) -> None:
        if self._own_redis:
            await self.redis.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
