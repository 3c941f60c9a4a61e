"""`pdqueue bench serve`'s client side: one request sent and its tokens' arrival recorded
(``Record``), through pdqueue's ``AsyncClient`` or an OpenAI-compatible server
(``OpenAIClient``), and a request list sent at its arrival times (``run_requests``).
Imports the standard library and pdqueue's protocol; the client is passed in."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Callable

from pdqueue.bench.serve_load import Planned
from pdqueue.bench.serve_modes import BenchError
from pdqueue.protocol import entry_id_ms


@dataclass(slots=True)
class Record:
    planned: Planned
    submitted: float = 0.0                          # perf_counter
    token_times: list[float] = field(default_factory=list)
    token_entry_ms: list[int] = field(default_factory=list)
    finished: float | None = None
    completion: object | None = None
    error: str | None = None
    http_status: int | None = None                  # an OpenAI server's refusal (429, 503, ...)


async def send_one(client, planned: Planned, seed: int, record: Record, timeout_s: float | None = None) -> Record:
    """Send one request and record its tokens' arrival; an error or ``timeout_s`` (from the
    submission) is recorded, never raised."""
    if isinstance(client, OpenAIClient):
        return await client.one(planned, seed, record, timeout_s)
    record.submitted = time.perf_counter()
    try:
        handle = await client.submit(prompt_ids=planned.prompt_ids, max_tokens=planned.max_tokens,
                                     temperature=0.0, seed=seed, ignore_eos=True)
        async for event in handle.stream(timeout=timeout_s):
            now = time.perf_counter()
            for _ in event.token_ids or (0,):
                record.token_times.append(now)
                record.token_entry_ms.append(entry_id_ms(event.entry_id))
        record.finished = time.perf_counter()
        record.completion = handle.completion
    except Exception as exc:   # a failed request is a result, not a crash of the bench
        record.error = f"{type(exc).__name__}: {exc}"
    return record


@dataclass(frozen=True, slots=True)
class HttpCompletion:
    """What an OpenAI-compatible server tells of a finished request: no worker timings
    (NaN), so the queue-overhead figures are left out for it."""
    num_tokens: int
    prefill_ms: float = math.nan
    queue_ms: float = math.nan
    transfer_ms: float = 0.0
    transfer_path: str = ""


class OpenAIClient:
    """The load sent to an OpenAI-compatible server (pdqueue's gateway, vLLM, SGLang, ...):
    ``POST /v1/completions``, streamed, the prompt as token ids, greedy, with vLLM's
    ``ignore_eos`` and the request's seed; one HTTP/1.1 connection per request, spoken with
    asyncio streams (no HTTP library to install). Each SSE chunk's arrival is recorded once:
    a server that puts several tokens in one chunk (pdqueue's gateway sends what one read of
    ``out:<id>`` brought) shows fewer, longer gaps than it has tokens."""

    def __init__(self, url: str, model: str | None, api_key: str | None, tenant_keys: dict[str, str] | None = None):
        """``tenant_keys``: a request whose ``Planned.tenant`` is named here is sent with that
        key (a tenants run); the others with ``api_key``."""
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise BenchError(f"--openai-url {url!r}: expected http://HOST[:PORT]")
        self.url, self.host, self.port = url.rstrip("/"), parts.hostname, parts.port or 80
        self.base = parts.path.rstrip("/")
        self.auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        self.tenant_auth = {name: f"Authorization: Bearer {key}\r\n" for name, key in (tenant_keys or {}).items()}
        self.model = model

    async def __aenter__(self) -> "OpenAIClient":
        if self.model is None:
            import json

            try:
                status, body = await self._request("GET", "/v1/models")
                if status != 200:
                    raise RuntimeError(f"HTTP {status}: {body[:200]!r}")
                self.model = json.loads(body)["data"][0]["id"]
            except Exception as exc:
                raise BenchError(f"{self.url}/v1/models: {exc}") from None
        return self

    async def __aexit__(self, *exc) -> None:
        pass

    async def _open(self, method: str, path: str, body: bytes = b"", auth: str | None = None):
        reader, writer = await asyncio.open_connection(self.host, self.port)
        auth = self.auth if auth is None else auth
        head = (f"{method} {self.base}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{auth}"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n")
        writer.write(head.encode() + body)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        chunked = False
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.strip().lower() == "transfer-encoding" and "chunked" in value.lower():
                chunked = True
        return reader, writer, status, chunked

    @staticmethod
    async def _body(reader, chunked: bool):
        """The response body, piece by piece as it arrives."""
        if not chunked:
            while data := await reader.read(65536):
                yield data
            return
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                return
            yield await reader.readexactly(size)
            await reader.readexactly(2)

    async def _request(self, method: str, path: str) -> tuple[int, bytes]:
        reader, writer, status, chunked = await self._open(method, path)
        try:
            return status, b"".join([piece async for piece in self._body(reader, chunked)])
        finally:
            writer.close()

    async def one(self, planned: Planned, seed: int, record: Record, timeout_s: float | None) -> Record:
        import json

        body = json.dumps({"model": self.model, "prompt": list(planned.prompt_ids), "max_tokens": planned.max_tokens,
                           "temperature": 0, "seed": seed, "ignore_eos": True, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()

        async def stream() -> int:
            tokens, buffer = 0, b""
            reader, writer, status, chunked = await self._open("POST", "/v1/completions", body,
                                                               self.tenant_auth.get(planned.tenant))
            try:
                if status != 200:
                    record.http_status = status
                    error = b"".join([piece async for piece in self._body(reader, chunked)])
                    raise RuntimeError(f"HTTP {status}: {error[:200]!r}")
                async for piece in self._body(reader, chunked):
                    buffer += piece
                    while b"\n\n" in buffer:
                        event, buffer = buffer.split(b"\n\n", 1)
                        if not event.startswith(b"data: ") or event == b"data: [DONE]":
                            continue
                        chunk = json.loads(event[6:])
                        if chunk.get("choices"):
                            record.token_times.append(time.perf_counter())
                        if chunk.get("usage"):
                            tokens = int(chunk["usage"]["completion_tokens"])
            finally:
                writer.close()
            return tokens or len(record.token_times)

        record.submitted = time.perf_counter()
        try:
            tokens = await asyncio.wait_for(stream(), timeout_s)
            record.finished = time.perf_counter()
            record.completion = HttpCompletion(tokens)
        except Exception as exc:   # a failed request is a result, not a crash of the bench
            record.error = f"{type(exc).__name__}: {exc}"
        return record


async def run_requests(client, plan: list[Planned], drain_timeout_s: float,
                       on_done: Callable[[], None] = lambda: None,
                       log: Callable[[str], None] = lambda _m: None, stall_s: float = 60.0) -> list[Record]:
    """Submit ``plan`` at its arrival times; wait for every answer (at most
    ``drain_timeout_s`` after the last arrival, and each request at most ``drain_timeout_s``
    after its own submission); unfinished ones keep ``finished`` None. If nothing is
    submitted or answered for ``stall_s``, ``log`` gets a report of what is waiting where."""
    start = time.perf_counter()
    records = [Record(p) for p in plan]
    tasks: list[asyncio.Task] = []
    watchdog = asyncio.create_task(_watch_stalls(records, tasks, stall_s, log))
    try:
        for i, (planned, record) in enumerate(zip(plan, records)):
            delay = start + planned.at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(send_one(client, planned, i, record, drain_timeout_s))
            task.add_done_callback(lambda _t: on_done())
            tasks.append(task)
        _, pending = await asyncio.wait(tasks, timeout=drain_timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
    finally:
        watchdog.cancel()
        await asyncio.gather(watchdog, return_exceptions=True)
    for record in records:
        if record.finished is None and record.error is None:
            record.error = f"unfinished after {drain_timeout_s:.0f}s"
    return records


async def _watch_stalls(records: list[Record], tasks: list[asyncio.Task], stall_s: float,
                        log: Callable[[str], None]) -> None:
    """Report a run that stopped moving: how many requests are submitted, answered and
    waiting, and where the waiting ones are suspended (their coroutine stacks)."""
    last = None
    while True:
        await asyncio.sleep(stall_s)
        state = (len(tasks), sum(t.done() for t in tasks))
        if state == last:
            waiting = [t for t in tasks if not t.done()]
            where: dict[str, int] = {}
            for t in waiting[:50]:
                frames = t.get_stack(limit=8)
                key = " <- ".join(f"{f.f_code.co_name}:{f.f_lineno}" for f in reversed(frames)) or "?"
                where[key] = where.get(key, 0) + 1
            no_token = sum(1 for r in records[:len(tasks)] if r.submitted and not r.token_times)
            log(f"stalled for {stall_s:.0f}s: {state[0]}/{len(records)} submitted, {state[1]} answered, "
                f"{len(waiting)} waiting ({no_token} without a first token); suspended at: "
                + "; ".join(f"{n}x {k}" for k, n in where.items()))
        last = state


