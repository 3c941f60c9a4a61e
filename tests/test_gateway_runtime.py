"""What the gateway runs on (issue 23): `pdqueue.frontends.runtime.runtime` (the event loop and HTTP
parser `pdqueue serve --loop/--http` choose), `PDQ_REDIS_PARSER` (redis-py's reply parser,
per process), and `pdqueue bench gateway --variants` (their names, the rounds and their
summary), without starting a process: the gateway's own runs on each are in
tests/test_gateway.py (the stop tests)."""

from __future__ import annotations

import asyncio

import pytest
import redis

import pdqueue.frontends.runtime as gateway_runtime
from pdqueue.bench import gateway_bench as gb
from pdqueue.queue import connection
from pdqueue.queue.connection import PARSER_ENV, async_client_from_url, client_from_url, redis_parser

HIREDIS = bool(redis.utils.HIREDIS_AVAILABLE)


# ---- the event loop and the HTTP parser --------------------------------------------------------

def test_auto_is_uvloop_and_httptools_when_installed_else_asyncio_and_h11(monkeypatch):
    monkeypatch.setattr(gateway_runtime, "_installed", lambda module: True)
    monkeypatch.setattr(gateway_runtime.sys, "platform", "linux")
    rt = gateway_runtime.runtime()
    assert (rt.loop, rt.http) == ("uvloop", "httptools")
    monkeypatch.setattr(gateway_runtime, "_installed", lambda module: False)
    rt = gateway_runtime.runtime()
    assert (rt.loop, rt.http) == ("asyncio", "h11")
    assert rt.describe().startswith("event loop asyncio (Python ") and "HTTP parser h11" in rt.describe()


def test_a_loop_or_parser_named_but_not_installed_is_an_error(monkeypatch):
    monkeypatch.setattr(gateway_runtime, "_installed", lambda module: module not in ("uvloop", "httptools"))
    with pytest.raises(ValueError, match=r"uvloop is not installed \(pip install 'pdqueue\[fast\]'\)"):
        gateway_runtime.runtime("uvloop")
    with pytest.raises(ValueError, match="httptools is not installed"):
        gateway_runtime.runtime("auto", "httptools")
    assert gateway_runtime.runtime("asyncio", "h11").name.startswith("asyncio-h11-")
    with pytest.raises(ValueError, match="expected one of auto, asyncio, uvloop"):
        gateway_runtime.runtime("trio")
    with pytest.raises(ValueError, match="expected one of auto, h11, httptools"):
        gateway_runtime.runtime("auto", "h2")


def test_uvloop_is_never_auto_on_windows(monkeypatch):
    monkeypatch.setattr(gateway_runtime, "_installed", lambda module: True)
    monkeypatch.setattr(gateway_runtime.sys, "platform", "win32")
    assert gateway_runtime.runtime().loop == "asyncio"


# ---- the Redis reply parser ----------------------------------------------------------------------

def _parsers(url: str) -> tuple[str, str]:
    """The parser classes of a sync and an asyncio connection made now."""
    sync = client_from_url(url).connection_pool.make_connection()

    async def make():
        return async_client_from_url(url).connection_pool.make_connection()

    return type(sync._parser).__name__, type(asyncio.run(make())._parser).__name__


def test_redis_parser_auto_is_redis_pys_choice(monkeypatch):
    monkeypatch.delenv(PARSER_ENV, raising=False)
    assert redis_parser() == ("hiredis" if HIREDIS else "python")
    sync, asynchronous = _parsers("redis://127.0.0.1:1")
    assert ("Hiredis" in sync and "Hiredis" in asynchronous) == HIREDIS


def test_python_parser_by_env_and_hiredis_required_when_named(monkeypatch):
    monkeypatch.setenv(PARSER_ENV, "python")
    assert redis_parser() == "python"
    sync, asynchronous = _parsers("redis://127.0.0.1:1")
    assert "Hiredis" not in sync and "Hiredis" not in asynchronous
    monkeypatch.setenv(PARSER_ENV, "hiredis")
    monkeypatch.setattr(connection.redis.utils, "HIREDIS_AVAILABLE", False)
    with pytest.raises(ValueError, match=r"hiredis \(>= 3.2\) is not installed"):
        redis_parser()
    monkeypatch.setenv(PARSER_ENV, "fast")
    with pytest.raises(ValueError, match="expected one of auto, hiredis, python"):
        redis_parser()


def test_both_parsers_read_the_same_stream_entries(redis_url, monkeypatch):
    """An XADD read back by XREAD, sync and asyncio, gives the same entries whichever parser
    is asked for (RESP3 maps and bulk strings through the Python parser too)."""
    fields = {"text": "héllo\r\nworld", "token_ids": "[1,2,3]", "empty": ""}
    got = {}
    for parser in ("python", "auto"):
        monkeypatch.setenv(PARSER_ENV, parser)
        r = client_from_url(redis_url)
        entry = r.xadd("parsers", fields, id="1-1")
        sync = r.xread({"parsers": "0-0"})

        async def read():
            a = async_client_from_url(redis_url)
            try:
                return await a.xread({"parsers": "0-0"}, count=10, block=100)
            finally:
                await a.aclose()

        got[parser] = (sync, asyncio.run(read()))
        r.delete("parsers")
        r.close()
        assert entry
    assert got["python"] == got["auto"]
    assert "(b'1-1', {b'text': b'h\\xc3\\xa9llo\\r\\nworld'" in repr(got["python"][0])
    assert repr(got["python"][0]) == repr(got["python"][1])   # sync and asyncio alike


# ---- bench gateway --variants ----------------------------------------------------------------------

def test_variant_names():
    assert gb.Variant.parse("asyncio-h11") == gb.Variant("asyncio", "h11", "auto")
    v = gb.Variant.parse("uvloop-httptools-hiredis")
    assert v.name == "uvloop-httptools-hiredis"
    assert v.serve_args() == ["--loop", "uvloop", "--http", "httptools", "--redis-parser", "hiredis"]
    assert [x.name for x in gb.parse_variants("asyncio-h11-python, uvloop-httptools")] == [
        "asyncio-h11-python", "uvloop-httptools"]
    for bad, why in (("asyncio", "expected LOOP-HTTP"), ("trio-h11", "event loop 'trio'"),
                     ("asyncio-h2", "HTTP parser 'h2'"), ("asyncio-h11-resp", "Redis parser 'resp'"),
                     ("asyncio-h11,asyncio-h11", "named twice"), (" , ", "no variant")):
        with pytest.raises(ValueError, match=why):
            gb.parse_variants(bad)


def test_compare_alternates_the_order_and_summarizes_the_rounds(monkeypatch):
    """Every round measures each variant and the client; the throughput order is reversed
    every other round; the summary is each figure's median and spread over the rounds."""
    calls = []
    ttft = {"a": [5.0, 7.0, 6.0], "b": [3.0, 3.5, 2.5]}

    def fake_latency(client, urls, settings, progress):
        r = sum(1 for c in calls if c == "latency")
        calls.append("latency")
        out = {name: {"ttft_ms": {"p50": ttft[name][r]}, "itl_ms": {"p50": 1.0}} for name in urls}
        out["client"] = {"ttft_ms": {"p50": 2.0}, "itl_ms": {"p50": 1.0}}
        out["added"] = {name: {"ttft_p50_ms": out[name]["ttft_ms"]["p50"] - 2.0, "itl_p50_ms": 0.0} for name in urls}
        return out

    def fake_gateway(url, pid, settings):
        calls.append(url)
        return {"req_s": 100.0 if url == "a" else 200.0, "failed": 0, "cpu_ms_per_request": 1.0}

    def fake_client(redis_url, cluster, settings):
        calls.append("client")
        return 250.0

    monkeypatch.setattr(gb, "latency_paths", fake_latency)
    monkeypatch.setattr(gb, "gateway_throughput", fake_gateway)
    monkeypatch.setattr(gb, "client_throughput", fake_client)
    settings = gb.Settings(pairs=2, duration_s=0.5)
    cmp = gb.compare(None, "redis://x", "c", {"a": ("a", 1), "b": ("b", 2)}, settings, rounds=3)
    assert calls == ["latency", "a", "b", "client", "latency", "client", "b", "a", "latency", "a", "b", "client"]
    assert [rd["throughput_order"] for rd in cmp["rounds"]][:2] == [["a", "b", "client"], ["client", "b", "a"]]
    a = cmp["summary"]["a"]
    assert a["ttft_p50_added_ms"] == {"median": 4.0, "min": 3.0, "max": 5.0, "spread": 2.0}
    assert cmp["summary"]["b"]["req_s_vs_client"]["median"] == pytest.approx(0.8)
    table = gb.format_compare({"model": "tiny", "settings": {"pairs": 2, "max_tokens": 16, "concurrency": 32,
                                                             "duration_s": 0.5},
                               "runtimes": {"a": "event loop asyncio", "b": "event loop uvloop"}, "compare": cmp})
    lines = table.splitlines()
    assert "3 alternating rounds" in lines[0] and lines[1] == "  a: event loop asyncio"
    assert sum(line.startswith("1      ") for line in lines) == 3   # a, b, client
    assert lines[-2].split()[:2] == ["a", "+4.00"] and lines[-1].split()[:3] == ["b", "+1.00", "[1.00]"]


@pytest.mark.processes
def test_bench_gateway_variants_runs_one_gateway_each(tmp_path):
    """`pdqueue bench gateway --variants`, one short round: each variant's gateway answered
    (none failed) on what it was asked to run on, with the client's figures beside."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-m", "workers", "bench", "gateway", "--variants",
                           "asyncio-h11-python,auto-auto", "--rounds", "1", "--pairs", "2", "--max-tokens", "4",
                           "--concurrency", "2", "--duration", "0.5", "--json"],
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["variants"] == ["asyncio-h11-python", "auto-auto"]
    assert result["runtimes"]["asyncio-h11-python"].startswith("event loop asyncio")
    assert "Python parser" in result["runtimes"]["asyncio-h11-python"]
    (rd,) = result["compare"]["rounds"]
    for name in result["variants"]:
        f = rd["figures"][name]
        assert f["gateway_failed"] == 0 and f["gateway_req_s"] > 0 and f["ttft_p50_ms"] > 0
    assert rd["figures"]["client"]["req_s"] > 0
    assert set(result["compare"]["summary"]) == set(result["variants"])
