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

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


@dataclass(frozen=True)
class Settings:
    pairs: int = 40              # latency: requests per path (alternating)
    max_tokens: int = 16
    concurrency: int = 32        # throughput: closed-loop clients
    duration_s: float = 5.0      # throughput: per path
    warmup: int = 3


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
    wait_healthy(gateway_url)
    u = urlparse(gateway_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    params = dict(max_tokens=settings.max_tokens, temperature=0.0, ignore_eos=True)
    body_stream = json.dumps({"prompt": PROMPT, "stream": True, **params}).encode()
    for _ in range(settings.warmup):
        _gateway_stream(conn, body_stream)
        _client_stream(client, prompt=PROMPT, **params)
    runs = {"gateway": [], "client": []}
    for i in range(2 * settings.pairs):
        path = ("gateway", "client")[(i + i // 2) % 2]  # g c c g g c c g ...: each goes first half the time
        if path == "gateway":
            runs[path].append(_gateway_stream(conn, body_stream))
        else:
            runs[path].append(_client_stream(client, prompt=PROMPT, **params))
        if (i + 1) % 20 == 0:
            progress(f"latency: {i + 1}/{2 * settings.pairs} requests")
    conn.close()
    out = {}
    for path, results in runs.items():
        ttft = [r[0] * 1000 for r in results]
        itl = [(b - a) * 1000 for _, times in results for a, b in zip(times, times[1:])]
        out[path] = {"ttft_ms": summary(ttft), "itl_ms": summary(itl), "requests": len(results)}
    out["ttft_p50_added_ms"] = out["gateway"]["ttft_ms"]["p50"] - out["client"]["ttft_ms"]["p50"]
    out["itl_p50_added_ms"] = out["gateway"]["itl_ms"]["p50"] - out["client"]["itl_ms"]["p50"]
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


def throughput(redis_url: str, cluster: str, gateway_url: str, gateway_pid: int | None, settings: Settings,
               progress=lambda msg: None) -> dict:
    from pdqueue.client import AsyncClient

    u = urlparse(gateway_url)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 1, "temperature": 0}).encode()

    async def via_gateway():
        counts = [0, 0]
        stop_at = time.perf_counter() + settings.duration_s
        await asyncio.gather(*(_http_loop(u.hostname, u.port, body, stop_at, counts)
                               for _ in range(settings.concurrency)))
        return counts

    async def via_client():
        counts = [0]
        async with AsyncClient(redis_url, cluster) as client:
            stop_at = time.perf_counter() + settings.duration_s
            await asyncio.gather(*(_client_loop(client, stop_at, counts) for _ in range(settings.concurrency)))
        return counts

    cpu0 = _cpu_s(gateway_pid) if gateway_pid else None
    t0 = time.perf_counter()
    ok, failed = asyncio.run(via_gateway())
    gateway_s = time.perf_counter() - t0
    cpu = (_cpu_s(gateway_pid) - cpu0) if gateway_pid else None
    progress(f"throughput: gateway {ok / gateway_s:.0f} req/s")
    t0 = time.perf_counter()
    (client_ok,) = asyncio.run(via_client())
    client_s = time.perf_counter() - t0
    progress(f"throughput: client {client_ok / client_s:.0f} req/s")
    return {"concurrency": settings.concurrency, "gateway_req_s": ok / gateway_s, "gateway_failed": failed,
            "client_req_s": client_ok / client_s,
            "gateway_cpu_ms_per_request": (cpu * 1000 / ok) if cpu is not None and ok else None}


def format_table(result: dict) -> str:
    lat, thr = result["latency"], result["throughput"]
    lines = [f"gateway vs pdqueue.Client, {result['model']} ({lat['gateway']['requests']} requests each, "
             f"max_tokens {result['settings']['max_tokens']}, one at a time, alternating)",
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
