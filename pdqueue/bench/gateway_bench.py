"""`pdqueue bench gateway`: what the OpenAI-compatible gateway adds, against pdqueue's own
client, in the same run, on the same workers.

1. Latency. The same greedy requests (same prompt, ``max_tokens``, ``ignore_eos``), one at
   a time, alternating: through the gateway, streamed (``POST /v1/completions``, SSE, over
   one keep-alive HTTP connection), then through ``pdqueue.Client`` (``text_stream``).
   TTFT is the time from sending the request to the first text it shows (the gateway sends
   a chunk when there is text; the client's first non-empty delta: so both wait for the
   same token); ITL, the gaps between the later texts. Each request runs alone, on
   identical batches, so the difference is the gateway's (HTTP, JSON, SSE, one more
   process hop) plus noise; the order alternates to spread drift over both.
2. Throughput. ``concurrency`` closed-loop clients send one-token requests for
   ``duration_s``: through the gateway (non-streaming HTTP, a connection each), then
   through one ``AsyncClient``. Equal rates mean the workers, not the gateway, are the
   limit; the gateway's CPU time per request is reported from /proc.

The HTTP clients are minimal (http.client, asyncio streams): the load generator shares the
cores with the gateway, so a heavy client would make the gateway look slower than it is.

3. Variants (``compare``, ``bench gateway --variants``): one gateway per configuration (event
   loop, HTTP parser, Redis parser: ``Variant``) on the same workers, measured in
   ``rounds`` alternating rounds. A round's latency phase interleaves every gateway and the
   client request by request (each path first as often as the others), so each variant's
   added TTFT is against client requests of the same moments; its throughput phase runs
   each gateway, then the client, for ``duration_s`` each (the order reversed every other
   round). Each round is reported, then per variant the median of the rounds and their
   spread (max - min): a difference smaller than the spread is noise.

Imports redis and pdqueue.client (never torch).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import time
from dataclasses import dataclass
from urllib.parse import urlparse

from pdqueue.bench.stats import summary

LOOPS = ("auto", "asyncio", "uvloop")                    # pdqueue serve --loop
HTTP_PARSERS = ("auto", "h11", "httptools")              # --http
REDIS_PARSERS = ("auto", "hiredis", "python")            # --redis-parser (PDQ_REDIS_PARSER)

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


@dataclass(frozen=True)
class Settings:
    pairs: int = 40              # latency: requests per path (alternating)
    max_tokens: int = 16
    concurrency: int = 32        # throughput: closed-loop clients
    duration_s: float = 5.0      # throughput: per path
    warmup: int = 3


@dataclass(frozen=True)
class Variant:
    """One gateway configuration: ``LOOP-HTTP[-REDISPARSER]``, e.g. ``asyncio-h11``,
    ``uvloop-httptools-hiredis`` (the Redis parser defaults to auto)."""
    loop: str
    http: str
    redis_parser: str = "auto"

    @classmethod
    def parse(cls, text: str) -> "Variant":
        parts = text.strip().lower().split("-")
        if len(parts) not in (2, 3):
            raise ValueError(f"variant {text!r}: expected LOOP-HTTP or LOOP-HTTP-REDISPARSER, e.g. asyncio-h11 or "
                             f"uvloop-httptools-hiredis")
        for value, allowed, what in zip(parts, (LOOPS, HTTP_PARSERS, REDIS_PARSERS),
                                        ("event loop", "HTTP parser", "Redis parser")):
            if value not in allowed:
                raise ValueError(f"variant {text!r}: {what} {value!r} is not one of {', '.join(allowed)}")
        return cls(*parts)

    @property
    def name(self) -> str:
        return f"{self.loop}-{self.http}" + ("" if self.redis_parser == "auto" else f"-{self.redis_parser}")

    def serve_args(self) -> list[str]:
        """``pdqueue serve`` options of this variant."""
        return ["--loop", self.loop, "--http", self.http, "--redis-parser", self.redis_parser]


def parse_variants(text: str) -> list[Variant]:
    """``--variants``: comma-separated, at least one, no repeats (ValueError)."""
    variants = [Variant.parse(v) for v in text.split(",") if v.strip()]
    if not variants:
        raise ValueError("no variant given (e.g. asyncio-h11,uvloop-httptools)")
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise ValueError(f"a variant is named twice: {', '.join(names)}")
    return variants


def _gateway_stream(conn: http.client.HTTPConnection, body: bytes) -> tuple[float, list[float]]:
    """One streamed completion; (TTFT s, times of the later chunks relative to the send)."""
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"gateway answered {resp.status}: {resp.read()[:300]!r}")
    times = []
    while True:
        line = resp.readline()
        if not line:
            raise RuntimeError("the gateway's stream ended before [DONE]")
        if line.startswith(b"data: [DONE]"):
            resp.read()
            break
        if line.startswith(b"data: "):
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                times.append(time.perf_counter() - t0)
    return times[0], times


def _client_stream(client, **kwargs) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    handle = client.submit(**kwargs)
    times = [time.perf_counter() - t0 for _ in handle.text_stream(timeout=120)]
    return times[0], times


def wait_healthy(gateway_url: str, timeout_s: float = 30.0) -> None:
    """Until the gateway's /health says 200 (its view of the workers is polled)."""
    u = urlparse(gateway_url)
    deadline = time.monotonic() + timeout_s
    while True:
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=5)
        try:
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        finally:
            conn.close()
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateway at {gateway_url} is not healthy after {timeout_s:g} s")
        time.sleep(0.1)


def latency(client, gateway_url: str, settings: Settings, progress=lambda msg: None) -> dict:
    """One gateway against the client (``latency_paths`` with one gateway, named "gateway")."""
    out = latency_paths(client, {"gateway": gateway_url}, settings, progress)
    added = out.pop("added")["gateway"]
    out["ttft_p50_added_ms"], out["itl_p50_added_ms"] = added["ttft_p50_ms"], added["itl_p50_ms"]
    return out


def latency_paths(client, gateway_urls: dict[str, str], settings: Settings, progress=lambda msg: None) -> dict:
    """``settings.pairs`` streamed requests through each gateway and through the client,
    interleaved: cycle ``c`` sends one request on each path, the paths' order rotated by
    ``c`` (two paths: g c c g g c ...). Returns each path's TTFT and ITL summaries (the
    gateways' names, and "client") and ``added``: each gateway's p50s minus the client's."""
    conns = {}
    for name, url in gateway_urls.items():
        wait_healthy(url)
        u = urlparse(url)
        conns[name] = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    params = dict(max_tokens=settings.max_tokens, temperature=0.0, ignore_eos=True)
    body_stream = json.dumps({"prompt": PROMPT, "stream": True, **params}).encode()
    paths = [*conns, "client"]

    def one(path: str) -> tuple[float, list[float]]:
        if path == "client":
            return _client_stream(client, prompt=PROMPT, **params)
        return _gateway_stream(conns[path], body_stream)

    for _ in range(settings.warmup):
        for path in paths:
            one(path)
    runs: dict[str, list] = {path: [] for path in paths}
    total, sent = len(paths) * settings.pairs, 0
    for cycle in range(settings.pairs):
        k = cycle % len(paths)
        for path in paths[k:] + paths[:k]:
            runs[path].append(one(path))
            sent += 1
            if sent % 20 == 0:
                progress(f"latency: {sent}/{total} requests")
    for conn in conns.values():
        conn.close()
    out: dict = {}
    for path, results in runs.items():
        ttft = [r[0] * 1000 for r in results]
        itl = [(b - a) * 1000 for _, times in results for a, b in zip(times, times[1:])]
        out[path] = {"ttft_ms": summary(ttft), "itl_ms": summary(itl), "requests": len(results)}
    base = out["client"]
    out["added"] = {name: {"ttft_p50_ms": out[name]["ttft_ms"]["p50"] - base["ttft_ms"]["p50"],
                           "itl_p50_ms": out[name]["itl_ms"]["p50"] - base["itl_ms"]["p50"]} for name in conns}
    return out


async def _http_loop(host: str, port: int, body: bytes, stop_at: float, counts: list) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    request = (f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
               f"content-length: {len(body)}\r\n\r\n").encode() + body
    try:
        while time.perf_counter() < stop_at:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            await reader.readexactly(length)
            counts[0 if status == 200 else 1] += 1
    finally:
        writer.close()


async def _client_loop(client, stop_at: float, counts: list) -> None:
    while time.perf_counter() < stop_at:
        handle = await client.submit(PROMPT, max_tokens=1, temperature=0.0)
        await handle.result(timeout=60)
        counts[0] += 1


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def gateway_throughput(gateway_url: str, gateway_pid: int | None, settings: Settings) -> dict:
    """``settings.concurrency`` closed-loop HTTP clients for ``duration_s``: req/s, failed
    answers, and the gateway's CPU ms per answered request (from /proc; None without a pid)."""
    u = urlparse(gateway_url)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 1, "temperature": 0}).encode()

    async def run():
        counts = [0, 0]
        stop_at = time.perf_counter() + settings.duration_s
        await asyncio.gather(*(_http_loop(u.hostname, u.port, body, stop_at, counts)
                               for _ in range(settings.concurrency)))
        return counts

    cpu0 = _cpu_s(gateway_pid) if gateway_pid else None
    t0 = time.perf_counter()
    ok, failed = asyncio.run(run())
    elapsed = time.perf_counter() - t0
    cpu = (_cpu_s(gateway_pid) - cpu0) if gateway_pid else None
    return {"req_s": ok / elapsed, "failed": failed,
            "cpu_ms_per_request": (cpu * 1000 / ok) if cpu is not None and ok else None}


def client_throughput(redis_url: str, cluster: str, settings: Settings) -> float:
    """The same load through one ``AsyncClient``: req/s."""
    from pdqueue.client import AsyncClient

    async def run():
        counts = [0]
        async with AsyncClient(redis_url, cluster) as client:
            stop_at = time.perf_counter() + settings.duration_s
            await asyncio.gather(*(_client_loop(client, stop_at, counts) for _ in range(settings.concurrency)))
        return counts

    t0 = time.perf_counter()
    (ok,) = asyncio.run(run())
    return ok / (time.perf_counter() - t0)


def throughput(redis_url: str, cluster: str, gateway_url: str, gateway_pid: int | None, settings: Settings,
               progress=lambda msg: None) -> dict:
    g = gateway_throughput(gateway_url, gateway_pid, settings)
    progress(f"throughput: gateway {g['req_s']:.0f} req/s")
    client_req_s = client_throughput(redis_url, cluster, settings)
    progress(f"throughput: client {client_req_s:.0f} req/s")
    return {"concurrency": settings.concurrency, "gateway_req_s": g["req_s"], "gateway_failed": g["failed"],
            "client_req_s": client_req_s, "gateway_cpu_ms_per_request": g["cpu_ms_per_request"]}


# ---- variants: one gateway per configuration, alternating rounds ---------------------------

_FIGURES = ("ttft_p50_added_ms", "itl_p50_added_ms", "gateway_req_s", "req_s_vs_client", "gateway_cpu_ms_per_request")


def compare(client, redis_url: str, cluster: str, gateways: dict[str, tuple[str, int | None]], settings: Settings,
            rounds: int = 3, progress=lambda msg: None) -> dict:
    """``gateways``: variant name -> (URL, pid). Each round: the latency phase
    (``latency_paths``, every gateway and the client interleaved), then each gateway's
    throughput and the client's (reversed order in odd rounds). Returns the rounds and,
    per variant, each figure's median, min, max and spread over the rounds."""
    names = list(gateways)
    out_rounds = []
    for r in range(rounds):
        progress(f"round {r + 1}/{rounds}: latency")
        lat = latency_paths(client, {n: gateways[n][0] for n in names}, settings, progress)
        order = names + ["client"] if r % 2 == 0 else ["client"] + names[::-1]
        thr: dict = {}
        for name in order:
            if name == "client":
                thr[name] = {"req_s": client_throughput(redis_url, cluster, settings)}
            else:
                thr[name] = gateway_throughput(*gateways[name], settings)
            progress(f"round {r + 1}/{rounds}: throughput {name} {thr[name]['req_s']:.0f} req/s")
        figures = {}
        for name in names:
            figures[name] = {"ttft_p50_ms": lat[name]["ttft_ms"]["p50"], "itl_p50_ms": lat[name]["itl_ms"]["p50"],
                             "ttft_p50_added_ms": lat["added"][name]["ttft_p50_ms"],
                             "itl_p50_added_ms": lat["added"][name]["itl_p50_ms"],
                             "gateway_req_s": thr[name]["req_s"], "gateway_failed": thr[name]["failed"],
                             "req_s_vs_client": thr[name]["req_s"] / thr["client"]["req_s"]
                             if thr["client"]["req_s"] else None,
                             "gateway_cpu_ms_per_request": thr[name]["cpu_ms_per_request"]}
        figures["client"] = {"ttft_p50_ms": lat["client"]["ttft_ms"]["p50"],
                             "itl_p50_ms": lat["client"]["itl_ms"]["p50"], "req_s": thr["client"]["req_s"]}
        out_rounds.append({"round": r + 1, "throughput_order": order, "figures": figures})
    summary_ = {}
    for name in names:
        summary_[name] = {}
        for key in _FIGURES:
            values = sorted(v for v in (rd["figures"][name][key] for rd in out_rounds) if v is not None)
            if not values:
                summary_[name][key] = None
                continue
            mid = len(values) // 2
            median = values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
            summary_[name][key] = {"median": median, "min": values[0], "max": values[-1],
                                   "spread": values[-1] - values[0]}
    return {"concurrency": settings.concurrency, "rounds": out_rounds, "summary": summary_}


def format_compare(result: dict) -> str:
    cmp, s = result["compare"], result["settings"]
    names = list(cmp["summary"])
    width = max(12, *(len(n) for n in names)) + 2
    lines = [f"gateway variants vs pdqueue.Client, {result['model']}: {len(cmp['rounds'])} alternating rounds; per "
             f"round {s['pairs']} streamed requests per path (max_tokens {s['max_tokens']}, one at a time, "
             f"interleaved), then {s['concurrency']} closed-loop clients for {s['duration_s']:g} s per path "
             f"(1-token requests)"]
    for name, desc in result.get("runtimes", {}).items():
        lines.append(f"  {name}: {desc}")
    lines.append(f"{'round':<7}{'variant':<{width}}{'TTFT p50':>9}{'added':>8}{'ITL p50':>9}{'added':>8}"
                 f"{'req/s':>8}{'x client':>9}{'CPU ms/req':>11}   (ms)")
    for rd in cmp["rounds"]:
        f = rd["figures"]
        for name in names:
            v = f[name]
            cpu = v["gateway_cpu_ms_per_request"]
            ratio = v["req_s_vs_client"]
            lines.append(f"{rd['round']:<7}{name:<{width}}{v['ttft_p50_ms']:>9.2f}{v['ttft_p50_added_ms']:>+8.2f}"
                         f"{v['itl_p50_ms']:>9.2f}{v['itl_p50_added_ms']:>+8.2f}{v['gateway_req_s']:>8.0f}"
                         f"{(f'{ratio:.2f}' if ratio is not None else '-'):>9}"
                         f"{(f'{cpu:.2f}' if cpu is not None else '-'):>11}"
                         + (f"  ({v['gateway_failed']} failed)" if v["gateway_failed"] else ""))
        c = f["client"]
        lines.append(f"{rd['round']:<7}{'client':<{width}}{c['ttft_p50_ms']:>9.2f}{'':>8}{c['itl_p50_ms']:>9.2f}"
                     f"{'':>8}{c['req_s']:>8.0f}")
    lines.append("median of the rounds [spread: max - min]:")
    lines.append(f"{'variant':<{width}}{'TTFT added':>17}{'ITL added':>17}{'req/s':>15}{'x client':>15}"
                 f"{'CPU ms/req':>15}")

    def cell(fig, fmt: str) -> str:
        if fig is None:
            return f"{'-':>15}"
        return f"{format(fig['median'], fmt)} [{format(fig['spread'], fmt.lstrip('+'))}]".rjust(15)

    for name in names:
        sm = cmp["summary"][name]
        lines.append(f"{name:<{width}}"
                     f"{cell(sm['ttft_p50_added_ms'], '+.2f'):>17}{cell(sm['itl_p50_added_ms'], '+.2f'):>17}"
                     f"{cell(sm['gateway_req_s'], '.0f')}{cell(sm['req_s_vs_client'], '.2f')}"
                     f"{cell(sm['gateway_cpu_ms_per_request'], '.2f')}")
    return "\n".join(lines)


def format_table(result: dict) -> str:
    lat, thr = result["latency"], result["throughput"]
    lines = [f"gateway vs pdqueue.Client, {result['model']} ({lat['gateway']['requests']} requests each, "
             f"max_tokens {result['settings']['max_tokens']}, one at a time, alternating)"]
    if result.get("runtime"):
        lines.append(f"gateway: {result['runtime']}")
    lines += [
              f"{'path':<10}{'TTFT p50':>10}{'p90':>9}{'ITL p50':>10}{'p90':>9}   (ms)"]
    for path in ("gateway", "client"):
        t, i = lat[path]["ttft_ms"], lat[path]["itl_ms"]
        lines.append(f"{path:<10}{t['p50']:>10.2f}{t['p90']:>9.2f}{i['p50']:>10.2f}{i['p90']:>9.2f}")
    lines.append(f"added by the gateway: TTFT p50 {lat['ttft_p50_added_ms']:+.2f} ms, "
                 f"ITL p50 {lat['itl_p50_added_ms']:+.2f} ms")
    cpu = thr["gateway_cpu_ms_per_request"]
    lines.append(f"throughput ({thr['concurrency']} closed-loop clients, 1-token requests): gateway "
                 f"{thr['gateway_req_s']:.0f} req/s ({thr['gateway_failed']} failed"
                 f"{f', {cpu:.2f} ms gateway CPU per request' if cpu is not None else ''}), "
                 f"client {thr['client_req_s']:.0f} req/s")
    return "\n".join(lines)
