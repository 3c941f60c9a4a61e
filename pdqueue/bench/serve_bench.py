"""`pdqueue bench serve`: serving under Poisson load, disaggregated against colocated.

For each mode it starts fresh worker processes on this machine's cores (through a
``Launcher`` that the CLI provides, so that pdqueue never imports workers), all against one
Redis server started here:
- ``disagg``: 1 prefill + 1 decode worker;
- ``colocated-prefill-first``: 2 colocated workers, whole prompts before decodes;
- ``colocated-chunked``: 2 colocated workers, decodes first and prompt chunks of at most
  ``chunk_tokens`` per step.
Every worker runs torch with one thread. A load generator on ``AsyncClient`` then sends, per
rate, the same seeded request list (Poisson arrivals; a mix of short chat prompts and long
documents, seeded prompt and output lengths, random token ids, greedy, ``ignore_eos``) and
records each token's arrival time on the client. After warm-up requests (not counted):
- TTFT: submit -> first token seen by the client; TBT: every gap between consecutive tokens
  seen by the client (``tbt_server_ms``: the same from the ``out:`` entry ids, i.e. when the
  worker's XADD ran, in whole ms); e2e: submit -> done;
- the handoff gap ``gap01_ms``: token 0 -> token 1 on the client (in disagg mode token 0
  comes from the prefill worker and token 1 from the decode worker, so this is the decode
  side taking the request over), ``ttst_ms``: submit -> second token, and
  ``tbt_after_first_ms``: the gaps after token 1 (the steady decode step, for comparison);
- throughput: output tokens / (first submit -> last completion);
- goodput: arrival rate x the fraction of requests with TTFT <= the TTFT SLO and the p90
  of their own gaps <= the TBT SLO (DistServe's attainment); unfinished requests fail both;
- queue overhead: client TTFT - the worker's prefill time (``Completion.prefill_ms``: from
  taking the request to its first token), i.e. the time spent in Redis and in queues. Under
  load it includes waiting for a busy worker; ``idle_overhead_ms`` measures it alone, with
  ``probes`` one-token requests sent one at a time to idle workers before the first rate.
Imports redis (asyncio), rich, pdqueue's client; never torch.
"""

from __future__ import annotations

import asyncio
import math
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from pdqueue.bench.stats import gaps, meets_slo, summary
from pdqueue.protocol import entry_id_ms

MODES = ("disagg", "colocated-prefill-first", "colocated-chunked", "adaptive",
         "prefix-off", "prefix-blind", "prefix-aware", "disagg-int8", "disagg-int4",
         "colocated-chunked-int4", "colocated-slo", "colocated-slo-int4")
DEFAULT_MODES = MODES[:3]
# The prefix-caching comparison (``--workload prefix``): 2 prefill + 1 decode workers with
# caching off, caching on with cache-blind routing, and caching with cache-aware routing.
PREFIX_MODES = MODES[4:7]
# Precision per role (issue 17): 1 prefill worker in float32 + 1 decode worker with quantized
# weights (``--weights``), against ``disagg`` (both float32).
_VOCAB = {"tiny": 264, "smollm2": 49152}


class BenchError(RuntimeError):
    """The bench cannot run (no Redis server, a worker did not start)."""


@dataclass(frozen=True, slots=True)
class Workload:
    short_prompt: tuple[int, int]      # token counts, inclusive ranges (uniform)
    short_output: tuple[int, int]
    long_prompt: tuple[int, int]
    long_output: tuple[int, int]
    long_fraction: float = 0.25
    vocab_size: int = 256

    def ranges(self, kind: str) -> tuple[tuple[int, int], tuple[int, int]]:
        """(prompt, output) length ranges of a "short" or "long" request."""
        return (self.long_prompt, self.long_output) if kind == "long" else (self.short_prompt, self.short_output)


@dataclass(frozen=True, slots=True)
class Phase:
    """A stretch of the load: ``duration_s`` of Poisson arrivals at ``rate`` with this share of
    long documents. A phased run sends its phases back to back, once per mode."""
    name: str
    long_fraction: float
    rate: float
    duration_s: float


# The two regimes measured on a 2-core machine with SmolLM2: mostly chat favours 1 prefill +
# 1 decode; half documents saturate one prefill worker, where 2 colocated workers win.
PHASE_KINDS = {"chat": (0.1, 2.0), "docs": (0.5, 1.0)}


def parse_phases(text: str, phase_s: float) -> tuple[Phase, ...]:
    """``chat,docs,chat`` (kinds of ``PHASE_KINDS``, each ``phase_s`` long), or explicit
    ``name:long_fraction:rate:seconds`` items."""
    phases = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        parts = item.split(":")
        if len(parts) == 1 and item in PHASE_KINDS:
            phases.append(Phase(item, *PHASE_KINDS[item], phase_s))
        elif len(parts) == 4:
            try:
                phases.append(Phase(parts[0], float(parts[1]), float(parts[2]), float(parts[3])))
            except ValueError:
                raise ValueError(f"phase {item!r}: expected name:long_fraction:rate:seconds") from None
        else:
            raise ValueError(f"phase {item!r}: expected one of {sorted(PHASE_KINDS)} or name:long_fraction:rate:seconds")
    for ph in phases:
        if not (0 <= ph.long_fraction <= 1 and ph.rate > 0 and ph.duration_s > 0):
            raise ValueError(f"phase {ph.name!r}: long_fraction in [0, 1], rate and seconds > 0")
    return tuple(phases)


@dataclass(frozen=True, slots=True)
class Settings:
    model: str
    workload: Workload
    slo_ttft_ms: float
    slo_tbt_ms: float
    modes: tuple[str, ...] = DEFAULT_MODES
    rates: tuple[float, ...] = (0.5, 1.0, 2.0)
    num_requests: int | None = 24      # per rate; None: rate x duration_s
    duration_s: float | None = None
    seed: int = 0
    warmup: int = 2
    probes: int = 10                   # one at a time, for the idle queue overhead
    chunk_tokens: int = 256            # colocated-chunked: token budget per step
    kv_cache_mb: int = 256
    drain_timeout_s: float = 180.0     # after the last arrival, unfinished requests are failed
    phases: tuple[Phase, ...] = ()     # a load that changes (instead of ``rates``)
    plan_mode: str = "reactive"        # the adaptive mode's planner
    plan_dwell_s: float = 15.0
    plan_cooldown_s: float = 8.0
    plan_window_s: float = 20.0
    workload_kind: str = "mixed"       # mixed: short chat and long documents; prefix: shared system prompts
                                       # and multi-turn conversations (plan_prefix_requests)
    openai_url: str | None = None      # drive this OpenAI-compatible server instead of starting workers
    openai_model: str | None = None    # its model (default: the first of GET /v1/models)
    api_key: str | None = None

    @classmethod
    def for_model(cls, model: str, *, long_fraction: float = 0.25, slo_ttft_ms: float | None = None,
                  slo_tbt_ms: float | None = None, num_requests: int | None = None,
                  duration_s: float | None = None, **kw) -> "Settings":
        """Defaults sized for one thread per worker on this class of CPU: SmolLM2 prefills
        ~250 tokens/s and decodes one step in ~50 ms (batch 1) to ~140 ms (batch 8)."""
        if model == "tiny":
            workload = Workload((8, 32), (16, 48), (384, 768), (8, 16), long_fraction, _VOCAB["tiny"])
            ttft, tbt = 250.0, 50.0
        else:
            workload = Workload((16, 64), (16, 48), (256, 512), (8, 16), long_fraction, _VOCAB.get(model, 256))
            ttft, tbt = 4000.0, 250.0
        if num_requests is None and duration_s is None:
            num_requests = 24
        kw = {k: tuple(v) if isinstance(v, list) else v for k, v in kw.items()}
        return cls(model=model, workload=workload, slo_ttft_ms=slo_ttft_ms or ttft, slo_tbt_ms=slo_tbt_ms or tbt,
                   num_requests=num_requests, duration_s=duration_s, **kw)

    def requests_at(self, rate: float) -> int:
        return self.num_requests or max(1, round(rate * self.duration_s))


def mode_workers(mode: str, settings: Settings) -> list[tuple[str, tuple[str, ...]]]:
    """(role, extra worker options) of each process of ``mode``."""
    if mode == "disagg":
        return [("prefill", ()), ("decode", ())]
    if mode == "colocated-prefill-first":
        return [("colocated", ("--policy", "prefill_first"))] * 2
    if mode.startswith(("colocated-chunked", "colocated-slo")):
        # -slo: the chunked policy under the TBT budget of the bench's own TBT SLO (scheduler.py);
        # -int4: int4 weights (a colocated worker takes the decode side's --weights)
        extra = ("--policy", "chunked", "--max-batched-tokens", str(settings.chunk_tokens))
        if mode.startswith("colocated-slo"):
            extra += ("--tbt-slo-ms", f"{settings.slo_tbt_ms:g}")
        if mode.endswith("-int4"):
            extra += ("--weights", "int4")
        elif mode not in ("colocated-chunked", "colocated-slo"):
            raise ValueError(f"unknown mode {mode!r}")
        return [("colocated", extra)] * 2
    if mode == "adaptive":  # starts as 1 + 1; the planner moves them (pdqueue.control.adapter)
        return [("prefill", ("--switchable",)), ("decode", ("--switchable",))]
    if mode in ("disagg-int8", "disagg-int4"):
        return [("prefill", ()), ("decode", ("--weights", mode.rpartition("-")[2]))]
    if mode.startswith("prefix-"):   # (decode workers take --routing and ignore it)
        extra = {"prefix-off": ("--no-prefix-caching",), "prefix-blind": ("--routing", "off"),
                 "prefix-aware": ("--routing", "cache")}[mode]
        return [("prefill", extra)] * 2 + [("decode", extra)]
    raise ValueError(f"unknown mode {mode!r}")


class Running(Protocol):
    def stop(self) -> None: ...


class Launcher(Protocol):
    def __call__(self, workers: list[tuple[str, tuple[str, ...]]], *, model: str, redis_url: str, cluster: str,
                 kv_cache_mb: int, log_dir: Path) -> Running:
        """Start the worker processes (one torch thread each) and return once all have
        registered; raise ``BenchError`` if one fails."""


# -- the request list -------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Planned:
    at_s: float            # arrival, seconds after the rate's start
    kind: str              # "short" | "long"
    prompt_ids: tuple[int, ...]
    max_tokens: int
    phase: int = -1        # index into Settings.phases, in a phased run


def plan_requests(settings: Settings, rate: float, count: int, salt: int = 0) -> list[Planned]:
    """The seeded request list of one rate: the same for every mode."""
    w = settings.workload
    rng = random.Random(f"{settings.seed}/{rate}/{salt}")
    at, out = 0.0, []
    for _ in range(count):
        kind = "long" if rng.random() < w.long_fraction else "short"
        prompt_range, output_range = w.ranges(kind)
        prompt = tuple(rng.randrange(3, w.vocab_size) for _ in range(rng.randint(*prompt_range)))
        out.append(Planned(at, kind, prompt, rng.randint(*output_range)))
        at += rng.expovariate(rate)
    return out


# The prefix workload: ``SYSTEM_PROMPTS`` system prompts of ``SYSTEM_LEN`` tokens, and
# ``CONVERSATIONS`` conversations, each on one system prompt; each arrival (Poisson) is the
# next turn of a conversation picked at random, which resends the whole conversation so far
# (system prompt, then user and assistant turns) plus a new user turn. The assistant turns
# are synthetic (the planned list is fixed before any answer exists): what matters is that
# turn k+1 repeats turn k's prompt, as chat clients do.
SYSTEM_PROMPTS, SYSTEM_LEN, CONVERSATIONS = 8, (400, 600), 12
USER_LEN, ASSISTANT_LEN, MAX_TURNS = (40, 120), (32, 96), 6


def plan_prefix_requests(settings: Settings, rate: float, count: int, salt: int = 0) -> list[Planned]:
    """The seeded request list of the prefix workload at one rate (the same for every mode)."""
    w = settings.workload
    rng = random.Random(f"{settings.seed}/prefix/{rate}/{salt}")

    def toks(bounds) -> list[int]:
        return [rng.randrange(3, w.vocab_size) for _ in range(rng.randint(*bounds))]

    systems = [toks(SYSTEM_LEN) for _ in range(SYSTEM_PROMPTS)]
    history = [list(systems[i % SYSTEM_PROMPTS]) for i in range(CONVERSATIONS)]
    turns = [0] * CONVERSATIONS
    at, out = 0.0, []
    for _ in range(count):
        c = rng.randrange(CONVERSATIONS)
        if turns[c] == MAX_TURNS:   # a finished conversation starts over on its system prompt
            history[c], turns[c] = list(systems[c % SYSTEM_PROMPTS]), 0
        history[c] += toks(USER_LEN)
        out.append(Planned(at, "long" if turns[c] else "short", tuple(history[c]), rng.randint(*w.short_output)))
        history[c] += toks(ASSISTANT_LEN)
        turns[c] += 1
        at += rng.expovariate(rate)
    return out


def plan_phases(settings: Settings) -> list[Planned]:
    """The seeded request list of a phased run: each phase's Poisson arrivals over its
    duration, its own share of documents, one after the other (the same for every mode)."""
    w, out, start = settings.workload, [], 0.0
    for index, ph in enumerate(settings.phases):
        rng = random.Random(f"{settings.seed}/phase{index}/{ph.name}")
        at = rng.expovariate(ph.rate)
        while at < ph.duration_s:
            kind = "long" if rng.random() < ph.long_fraction else "short"
            prompt_range, output_range = w.ranges(kind)
            prompt = tuple(rng.randrange(3, w.vocab_size) for _ in range(rng.randint(*prompt_range)))
            out.append(Planned(start + at, kind, prompt, rng.randint(*output_range), index))
            at += rng.expovariate(ph.rate)
        start += ph.duration_s
    return out


def warmup_requests(settings: Settings) -> list[Planned]:
    """``settings.warmup`` requests at once, long and short in turn (mid-range lengths)."""
    w, out = settings.workload, []
    for i in range(settings.warmup):
        kind = "long" if i % 2 == 0 else "short"
        prompt_range, output_range = w.ranges(kind)
        num_prompt = sum(prompt_range) // 2
        out.append(Planned(0.0, kind, tuple(3 + (i * 7919 + j) % (w.vocab_size - 3) for j in range(num_prompt)),
                           sum(output_range) // 2))
    return out


# -- one request, on the client -----------------------------------------------------------

@dataclass(slots=True)
class Record:
    planned: Planned
    submitted: float = 0.0                          # perf_counter
    token_times: list[float] = field(default_factory=list)
    token_entry_ms: list[int] = field(default_factory=list)
    finished: float | None = None
    completion: object | None = None
    error: str | None = None


async def _one(client, planned: Planned, seed: int, record: Record, timeout_s: float | None = None) -> Record:
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

    def __init__(self, url: str, model: str | None, api_key: str | None):
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise BenchError(f"--openai-url {url!r}: expected http://HOST[:PORT]")
        self.url, self.host, self.port = url.rstrip("/"), parts.hostname, parts.port or 80
        self.base = parts.path.rstrip("/")
        self.auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
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

    async def _open(self, method: str, path: str, body: bytes = b""):
        reader, writer = await asyncio.open_connection(self.host, self.port)
        head = (f"{method} {self.base}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{self.auth}"
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
            reader, writer, status, chunked = await self._open("POST", "/v1/completions", body)
            try:
                if status != 200:
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
            task = asyncio.create_task(_one(client, planned, i, record, drain_timeout_s))
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


def metrics(records: list[Record], rate: float, settings: Settings) -> tuple[dict, dict]:
    """(figures of one mode at one rate, raw values for the plots)."""
    ok = [r for r in records if r.finished is not None and r.token_times]
    ttft = [(r.token_times[0] - r.submitted) * 1e3 for r in ok]
    per_request_gaps = [[g * 1e3 for g in gaps(r.token_times)] for r in ok]
    tbt = [g for request in per_request_gaps for g in request]
    tbt_server = [g for r in ok for g in gaps(r.token_entry_ms)]
    met = sum(meets_slo(t, g, settings.slo_ttft_ms, settings.slo_tbt_ms) for t, g in zip(ttft, per_request_gaps))
    span = (max(r.finished for r in ok) - min(r.submitted for r in records)) if ok else math.inf
    prefill_ms = [r.completion.prefill_ms for r in ok]   # NaN from an OpenAI server: left out below
    second = [r for r in ok if len(r.token_times) > 1]
    gap01 = [(r.token_times[1] - r.token_times[0]) * 1e3 for r in second]
    steady = [g for r in second for g in gaps(r.token_times[1:])]
    figures = {
        "requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "ttft_ms": summary(ttft), "tbt_ms": summary(tbt), "tbt_server_ms": summary(tbt_server),
        "e2e_ms": summary((r.finished - r.submitted) * 1e3 for r in ok),
        "gap01_ms": summary(gap01), "ttst_ms": summary((r.token_times[1] - r.submitted) * 1e3 for r in second),
        "tbt_after_first_ms": summary(g * 1e3 for g in steady),
        "ttft_long_ms": summary(t for t, r in zip(ttft, ok) if r.planned.kind == "long"),
        "ttft_short_ms": summary(t for t, r in zip(ttft, ok) if r.planned.kind == "short"),
        "throughput_tok_s": sum(len(r.token_times) for r in ok) / span,
        "slo_attainment": met / len(records) if records else 0.0,
        "goodput_rps": rate * met / len(records) if records else 0.0,
        "queue_overhead_ms": summary(t - p for t, p in zip(ttft, prefill_ms) if not math.isnan(p)),
        "queue_ms": summary(r.completion.queue_ms for r in ok if not math.isnan(r.completion.queue_ms)),
        "prefill_ms": summary(p for p in prefill_ms if not math.isnan(p)),
        "transfer_ms": summary(r.completion.transfer_ms for r in ok if r.completion.transfer_path not in ("", "local")),
    }
    prompt_tokens = sum(len(r.planned.prompt_ids) for r in ok)
    cached = sum(getattr(r.completion, "cached_tokens", 0) or 0 for r in ok)
    reused = sum(getattr(r.completion, "kv_reused_tokens", 0) or 0 for r in ok)
    figures["prefix_cache_hit_rate"] = cached / prompt_tokens if prompt_tokens else 0.0      # prefill side
    figures["decode_kv_reuse_rate"] = reused / prompt_tokens if prompt_tokens else 0.0      # KV not fetched
    figures["tbt_p99_over_p50"] = figures["tbt_ms"]["p99"] / figures["tbt_ms"]["p50"] if tbt else None
    return figures, {"ttft_ms": ttft, "tbt_ms": tbt}


# -- the whole bench ------------------------------------------------------------------------

def run(settings: Settings, launcher: Launcher, progress: Callable[[str], None] = print,
        log_dir: Path | None = None, on_mode: Callable[[dict], None] | None = None) -> dict:
    """Every mode at every rate; returns the result object (see ``--json``). ``on_mode``
    gets the result so far after each mode (a later mode that fails loses nothing)."""
    if settings.openai_url:
        return _run_openai(settings, progress, on_mode)
    import redis

    from pdqueue.queue.redis_server import RedisServer

    try:
        server = RedisServer().start()
    except (FileNotFoundError, RuntimeError) as exc:
        raise BenchError(f"cannot start a Redis server: {exc}") from None
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="pdq-bench-serve-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    result = {"bench": "serve", "model": settings.model, "rates": list(settings.rates),
              "slo": {"ttft_ms": settings.slo_ttft_ms, "tbt_ms": settings.slo_tbt_ms},
              "workload": _workload_dict(settings), "log_dir": str(log_dir), "modes": {}, "raw": {}}
    try:
        for index, mode in enumerate(settings.modes):
            with redis.Redis.from_url(server.url) as r:
                r.flushall()
            progress(f"{mode}: starting {len(mode_workers(mode, settings))} workers ({settings.model})")
            running = launcher(mode_workers(mode, settings), model=settings.model, redis_url=server.url,
                               cluster=f"bench{index}", kv_cache_mb=settings.kv_cache_mb, log_dir=log_dir / mode)
            try:
                by_rate, raw = asyncio.run(_run_mode(settings, mode, server.url, f"bench{index}", progress))
            finally:
                progress(f"{mode}: stopping workers")
                running.stop()
            result["modes"][mode] = _pool_rates(by_rate, raw, settings)
            result["raw"][mode] = raw
            if on_mode is not None:
                on_mode(result)
    finally:
        server.stop()
    if settings.phases:
        result["rates"] = []
        result["phases"] = [{"name": p.name, "long_fraction": p.long_fraction, "rate": p.rate,
                             "duration_s": p.duration_s} for p in settings.phases]
        result["claim"] = phase_claim(result)
    else:
        result["claim"] = claim(result)
    return result


def _run_openai(settings: Settings, progress, on_mode) -> dict:
    """The same load against an OpenAI-compatible server that is already running: one mode,
    ``openai``, its figures from the client side only."""
    result = {"bench": "serve", "model": settings.model, "rates": list(settings.rates), "target": settings.openai_url,
              "slo": {"ttft_ms": settings.slo_ttft_ms, "tbt_ms": settings.slo_tbt_ms},
              "workload": _workload_dict(settings), "modes": {}, "raw": {}}
    by_rate, raw = asyncio.run(_run_mode(settings, "openai", "", "", progress))
    result["modes"]["openai"] = _pool_rates(by_rate, raw, settings)
    result["raw"]["openai"] = raw
    if on_mode is not None:
        on_mode(result)
    if settings.phases:
        result["rates"] = []
        result["phases"] = [{"name": p.name, "long_fraction": p.long_fraction, "rate": p.rate,
                             "duration_s": p.duration_s} for p in settings.phases]
    result["claim"] = {}
    return result


async def _run_mode(settings: Settings, mode: str, url: str, cluster: str, progress) -> tuple[dict, dict]:
    by_rate, raw = {}, {}
    adapting = _start_adapting(settings, url, cluster) if mode == "adaptive" else None
    try:
        return await _measure_mode(settings, mode, url, cluster, progress, by_rate, raw)
    finally:
        if adapting is not None:
            adapting.set()


def _start_adapting(settings: Settings, url: str, cluster: str):
    """The planner of the adaptive mode, in a thread of this process, until the returned
    event is set."""
    import threading

    from pdqueue.control.adapter import Adapter
    from pdqueue.keys import Keys
    from pdqueue.control.planner import PlannerConfig
    from pdqueue.queue.connection import connect

    config = PlannerConfig(ttft_slo_ms=settings.slo_ttft_ms, tbt_slo_ms=settings.slo_tbt_ms, mode=settings.plan_mode,
                           min_dwell_s=settings.plan_dwell_s, cooldown_s=settings.plan_cooldown_s,
                           window_s=settings.plan_window_s, move_timeout_s=60.0)
    adapter = Adapter(connect(url, purpose="supervisor"), Keys(cluster), config, name="bench-serve")
    done = threading.Event()
    threading.Thread(target=adapter.run, args=(done, 1.0), name="pdq-planner", daemon=True).start()
    return done


async def _measure_mode(settings: Settings, mode: str, url: str, cluster: str, progress, by_rate: dict,
                        raw: dict) -> tuple[dict, dict]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from pdqueue.client import AsyncClient

    target = OpenAIClient(settings.openai_url, settings.openai_model, settings.api_key) if mode == "openai" \
        else AsyncClient(url, cluster)
    async with target as client:
        if settings.warmup:
            progress(f"{mode}: {settings.warmup} warm-up requests")
            await run_requests(client, warmup_requests(settings), settings.drain_timeout_s)
        idle = []
        for i in range(settings.probes):
            planned = Planned(0.0, "probe", tuple(3 + (i + j) % 200 for j in range(24)), 1)
            record = await _one(client, planned, i, Record(planned), settings.drain_timeout_s)
            if record.finished is not None and record.token_times and not math.isnan(record.completion.prefill_ms):
                idle.append((record.token_times[0] - record.submitted) * 1e3 - record.completion.prefill_ms)
        by_rate["idle_overhead_ms"] = summary(idle)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=Console(stderr=True)) as bar:
            if settings.phases:
                plan = plan_phases(settings)
                task = bar.add_task(f"{mode}: {'/'.join(p.name for p in settings.phases)}", total=len(plan))
                timeline: list[dict] = []
                sampler = asyncio.create_task(_sample_timeline(url, cluster, timeline) if url else asyncio.sleep(0))
                try:
                    records = await run_requests(client, plan, settings.drain_timeout_s,
                                                 on_done=lambda: bar.advance(task), log=progress)
                finally:
                    sampler.cancel()
                    await asyncio.gather(sampler, return_exceptions=True)
                by_rate["phases"], raw["phases"] = phase_metrics(records, settings), {"timeline": timeline}
                by_rate["phases"]["records"] = records
                return by_rate, raw
            for rate in settings.rates:
                planner = plan_prefix_requests if settings.workload_kind == "prefix" else plan_requests
                plan = planner(settings, rate, settings.requests_at(rate))
                task = bar.add_task(f"{mode} @ {rate:g} req/s", total=len(plan))
                records = await run_requests(client, plan, settings.drain_timeout_s,
                                             on_done=lambda: bar.advance(task), log=progress)
                by_rate[_key(rate)], raw[_key(rate)] = metrics(records, rate, settings)
                by_rate[_key(rate)]["records"] = records
    return by_rate, raw


def phase_metrics(records: list[Record], settings: Settings) -> dict:
    """Figures per phase (goodput at the phase's rate) and over the whole run (requests that
    met both SLOs per second of arrivals)."""
    out = {"by_phase": []}
    for index, ph in enumerate(settings.phases):
        figures, _ = metrics([r for r in records if r.planned.phase == index], ph.rate, settings)
        out["by_phase"].append({"name": ph.name, "long_fraction": ph.long_fraction, "rate": ph.rate,
                                "duration_s": ph.duration_s, **figures})
    total_s = sum(ph.duration_s for ph in settings.phases)
    overall, _ = metrics(records, len(records) / total_s if total_s else 0.0, settings)
    out["overall"] = overall
    return out


async def _sample_timeline(url: str, cluster: str, timeline: list[dict], every_s: float = 0.5) -> None:
    """Every ``every_s``: each worker's role and the request and handoff backlogs (acked
    entries are deleted, so a stream's length is what is still to be done), and the
    planner's decision (``plan``) whenever its reason changed."""
    import redis.asyncio

    from pdqueue.keys import Keys

    keys = Keys(cluster)
    start = time.perf_counter()
    r = redis.asyncio.Redis.from_url(url, decode_responses=True)
    last_reason = None
    try:
        while True:
            try:
                worker_keys = [k async for k in r.scan_iter(match=keys.worker("*"), count=200)]
                roles = {}
                for k in worker_keys:
                    role = await r.hget(k, "role")
                    if role:
                        roles[k.rsplit(":", 1)[-1]] = role
                requests = sum([await r.xlen(s) for s in keys.request_streams])
                handoff_keys = [k async for k in r.scan_iter(match=keys.handoff + "*", count=200)]
                handoffs = sum([await r.xlen(k) for k in handoff_keys])
                sample = {"t": round(time.perf_counter() - start, 2), "roles": roles,
                          "request_backlog": requests, "handoff_backlog": handoffs}
                plan = await r.hmget(keys.plan, "action", "reason")
                gist = plan[1] and plan[1].split(":")[0]   # e.g. "hold 1P+1D, healthy" (no figures)
                if gist and gist != last_reason:   # the adaptive mode's planner said something new
                    last_reason = gist
                    sample["plan"] = {"action": plan[0], "reason": plan[1]}
                timeline.append(sample)
            except redis.RedisError:
                pass
            await asyncio.sleep(every_s)
    finally:
        await r.aclose()


def _key(rate: float) -> str:
    return f"{rate:g}"


def _pool_rates(by_rate: dict, raw: dict, settings: Settings) -> dict:
    """Mode-level figures pool the requests of every rate; ``by_rate`` keeps each rate. A
    phased run's figures are its overall ones, with ``by_phase``."""
    idle = by_rate.pop("idle_overhead_ms")
    if "phases" in by_rate:
        phases = by_rate.pop("phases")
        phases.pop("records")
        return {**phases["overall"], "by_phase": phases["by_phase"], "idle_overhead_ms": idle, "by_rate": {}}
    records = [r for figures in by_rate.values() for r in figures.pop("records")]
    mean_rate = sum(settings.rates) / len(settings.rates)
    pooled, _ = metrics(records, mean_rate, settings)
    pooled["goodput_rps"] = sum(f["goodput_rps"] for f in by_rate.values()) / len(by_rate)
    pooled["idle_overhead_ms"] = idle
    pooled["by_rate"] = by_rate
    return pooled


def claim(result: dict) -> dict:
    """The seeds' claim, per rate: disaggregation keeps p99 TBT near its p50 while colocated
    p99 TBT grows with the prefills in its batches. "holds": disagg's p99/p50 is below 2 and
    below every colocated mode's; "partly": below every colocated mode's but not below 2."""
    out = {}
    for rate in map(_key, result["rates"]):
        ratios = {m: result["modes"][m]["by_rate"][rate]["tbt_p99_over_p50"] for m in result["modes"]}
        entry = {f"{m}_tbt_p99_over_p50": v for m, v in ratios.items()}
        d = ratios.get("disagg")
        others = [v for m, v in ratios.items() if m != "disagg" and v is not None]
        if d is not None and others:
            entry["verdict"] = ("holds" if d < 2.0 else "partly") if all(d < v for v in others) else "does not hold"
        entry.update(prefix_claim(result, rate))
        out[rate] = entry
    return out


def prefix_claim(result: dict, rate: str) -> dict:
    """Issue 15's targets where the prefix modes ran: caching alone (cache-blind) at least 2x
    lower TTFT p50 than caching off; cache-aware routing at least 1.5x lower than cache-blind."""
    modes = result["modes"]
    p50 = {m: modes[m]["by_rate"][rate]["ttft_ms"]["p50"] for m in PREFIX_MODES if m in modes}
    out = {f"{m}_hit_rate": modes[m]["by_rate"][rate]["prefix_cache_hit_rate"] for m in p50}
    if p50.get("prefix-off") and p50.get("prefix-blind"):
        out["caching_ttft_p50_speedup"] = p50["prefix-off"] / p50["prefix-blind"]
        out["caching_target_2x"] = out["caching_ttft_p50_speedup"] >= 2.0
    if p50.get("prefix-blind") and p50.get("prefix-aware"):
        out["routing_ttft_p50_speedup"] = p50["prefix-blind"] / p50["prefix-aware"]
        out["routing_target_1_5x"] = out["routing_ttft_p50_speedup"] >= 1.5
    return out


def _workload_dict(settings: Settings) -> dict:
    w = settings.workload
    return {"short_prompt": w.short_prompt, "short_output": w.short_output, "long_prompt": w.long_prompt,
            "long_output": w.long_output, "long_fraction": w.long_fraction, "seed": settings.seed,
            "requests_per_rate": {_key(r): settings.requests_at(r) for r in settings.rates},
            "warmup": settings.warmup, "chunk_tokens": settings.chunk_tokens, "threads_per_worker": 1,
            "sampling": "greedy, ignore_eos", "kind": settings.workload_kind,
            **({"system_prompts": SYSTEM_PROMPTS, "system_len": SYSTEM_LEN, "conversations": CONVERSATIONS,
                "user_len": USER_LEN, "assistant_len": ASSISTANT_LEN, "max_turns": MAX_TURNS}
               if settings.workload_kind == "prefix" else {})}


def phase_claim(result: dict) -> dict:
    """The adaptive mode's targets (where it ran): in every phase at least 0.9x the best
    fixed mode's goodput for that phase, and over the whole run at least 1.2x the best
    single fixed mode's."""
    modes = result["modes"]
    if "adaptive" not in modes or len(modes) < 2:
        return {}
    fixed = {m: f for m, f in modes.items() if m != "adaptive"}
    out = {"by_phase": []}
    for index, ph in enumerate(result["phases"]):
        best_mode = max(fixed, key=lambda m: fixed[m]["by_phase"][index]["goodput_rps"])
        best = fixed[best_mode]["by_phase"][index]["goodput_rps"]
        got = modes["adaptive"]["by_phase"][index]["goodput_rps"]
        out["by_phase"].append({"phase": ph["name"], "best_fixed": best_mode, "best_fixed_goodput": best,
                                "adaptive_goodput": got, "ratio": got / best if best else None,
                                "met": got >= 0.9 * best})
    best_mode = max(fixed, key=lambda m: fixed[m]["goodput_rps"])
    best, got = fixed[best_mode]["goodput_rps"], modes["adaptive"]["goodput_rps"]
    out["overall"] = {"best_fixed": best_mode, "best_fixed_goodput": best, "adaptive_goodput": got,
                      "ratio": got / best if best else None, "met": got >= 1.2 * best}
    return out


def format_phase_table(result: dict) -> str:
    slo = result["slo"]
    lines = [f"model {result['model']}; SLO: TTFT <= {slo['ttft_ms']:g} ms, p90 TBT <= {slo['tbt_ms']:g} ms; "
             f"phases " + ", ".join(f"{p['name']} ({p['long_fraction']:.0%} documents, {p['rate']:g} req/s, "
                                      f"{p['duration_s']:g} s)" for p in result["phases"]),
             f"{'mode':<25}{'phase':>8}{'done':>8}  {'TTFT p50/p99 ms':>16}  {'tok0->1 p50/p99':>16}"
             f"  {'TBT p50/p99 ms':>15}{'goodput':>9}{'attain':>8}"]
    for mode, pooled in result["modes"].items():
        for f in pooled["by_phase"] + [dict(pooled, name="all")]:
            t, g, b = f["ttft_ms"], f["gap01_ms"], f["tbt_ms"]
            lines.append(f"{mode:<25}{f['name']:>8}{f['completed']:>4}/{f['requests']:<3}  "
                         f"{t['p50']:>7.0f} {t['p99']:>7.0f}  {g['p50']:>7.0f} {g['p99']:>7.0f}  "
                         f"{b['p50']:>6.0f} {b['p99']:>7.0f}{f['goodput_rps']:>9.2f}{f['slo_attainment']:>8.0%}")
    c = result.get("claim") or {}
    for entry in c.get("by_phase", []):
        lines.append(f"adaptive in {entry['phase']}: {entry['adaptive_goodput']:.2f} req/s against the best fixed "
                     f"({entry['best_fixed']}) {entry['best_fixed_goodput']:.2f}: "
                     f"{(entry['ratio'] or 0):.2f}x (target >= 0.9x: {'met' if entry['met'] else 'NOT met'})")
    if "overall" in c:
        o = c["overall"]
        lines.append(f"adaptive overall: {o['adaptive_goodput']:.2f} req/s against the best fixed ({o['best_fixed']}) "
                     f"{o['best_fixed_goodput']:.2f}: {(o['ratio'] or 0):.2f}x (target >= 1.2x: "
                     f"{'met' if o['met'] else 'NOT met'})")
    return "\n".join(lines)


def format_table(result: dict) -> str:
    if result.get("phases"):
        return format_phase_table(result)
    slo = result["slo"]
    lines = [f"model {result['model']}; SLO: TTFT <= {slo['ttft_ms']:g} ms, p90 TBT <= {slo['tbt_ms']:g} ms; "
             f"workload {result['workload']}",
             f"{'mode':<25}{'rate':>6}{'done':>6}  {'TTFT p50/p90/p99 ms':>24}  {'TBT p50/p90/p99 ms':>22}"
             f"{'tok/s':>8}{'goodput':>9}{'attain':>8}  {'queue ovh p50/p99':>18}  {'tok0->1 p50/p99':>16}"
             f"  {'TTST p50/p99':>14}"]
    for mode, pooled in result["modes"].items():
        for rate, f in pooled["by_rate"].items():
            t, b, q, g, s2 = f["ttft_ms"], f["tbt_ms"], f["queue_overhead_ms"], f["gap01_ms"], f["ttst_ms"]
            lines.append(f"{mode:<25}{rate:>6}{f['completed']:>3}/{f['requests']:<2}  "
                         f"{t['p50']:>7.0f} {t['p90']:>7.0f} {t['p99']:>7.0f}  "
                         f"{b['p50']:>6.0f} {b['p90']:>6.0f} {b['p99']:>7.0f}"
                         f"{f['throughput_tok_s']:>8.1f}{f['goodput_rps']:>9.2f}{f['slo_attainment']:>8.0%}  "
                         f"{q['p50']:>8.1f} {q['p99']:>8.1f}  {g['p50']:>7.0f} {g['p99']:>7.0f}"
                         f"  {s2['p50']:>6.0f} {s2['p99']:>6.0f}")
    for rate, entry in result["claim"].items():
        ratios = ", ".join(f"{k.removesuffix('_tbt_p99_over_p50')} {v:.1f}x" for k, v in entry.items()
                           if k != "verdict" and v is not None)
        lines.append(f"claim at {rate} req/s (TBT p99/p50: {ratios}): {entry.get('verdict', 'n/a')}")
    idle = {m: p["idle_overhead_ms"] for m, p in result["modes"].items()}
    lines.append("queue overhead with idle workers (client TTFT - prefill_ms), p50/p99 ms: "
                 + ", ".join(f"{m} {v['p50']:.1f}/{v['p99']:.1f}" for m, v in idle.items()))
    return "\n".join(lines)
