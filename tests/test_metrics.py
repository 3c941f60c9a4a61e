"""Prometheus metrics (pdqueue/telemetry/metrics.py) on real parts: a real Redis, real worker processes
whose /metrics is fetched over HTTP and parsed with prometheus_client's parser, and a real
Prometheus server (Debian's `prometheus` package) scraping a running worker.

The counters must move by exactly what was sent: every request, token and byte is counted
once, by the worker where it happened, and the numbers agree with the completions the
client received."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest
import redis
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from pdqueue.client import Client
from pdqueue.keys import DECODE_GROUP, PREFILL_GROUP, Keys
from pdqueue.queue.registry import Heartbeat
from pdqueue.queue.streams import ensure_group, read_group
from pdqueue.telemetry.metrics import StreamCollector, cluster_app, serve_metrics, stop_metrics
from tests.cluster import ROOT, Cluster
from tests.helpers import wait_for

KEYS = Keys()


# ---- reading /metrics ------------------------------------------------------------------------

def scrape(address: str) -> list[tuple[str, dict, float]]:
    """Every sample of http://ADDRESS/metrics: (name, labels, value)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return [(s.name, dict(s.labels), s.value) for family in text_string_to_metric_families(text)
            for s in family.samples]


def total(samples, name: str, **labels) -> float:
    """The sum of the samples named ``name`` whose labels include ``labels``."""
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == w for k, w in labels.items()))


def names(samples) -> set[str]:
    return {n for n, _, _ in samples}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the stream collector ----------------------------------------------------------------------

def test_stream_collector_reports_backlog_lag_and_pending_per_group(r):
    ensure_group(r, KEYS.requests, PREFILL_GROUP)
    for i in range(5):
        r.xadd(KEYS.requests, {"id": f"q{i}", "prompt": "hi"})
    taken = read_group(r, PREFILL_GROUP, "c1", [KEYS.requests], count=2)
    r.xack(KEYS.requests, PREFILL_GROUP, taken[0][1])          # 3 undelivered, 1 pending
    ensure_group(r, KEYS.handoff, DECODE_GROUP)                 # exists, empty
    for i in range(2):
        r.xadd(KEYS.handoff_node("nodeA"), {"x": str(i)})       # no group yet: lag = length
    for i in range(3):
        r.xadd(KEYS.done, {"type": "done"})
    r.xadd(KEYS.dead, {"reason": "x"})
    beat = Heartbeat(r, KEYS, "decode-x", role="decode")
    beat.update(metrics="127.0.0.1:1234")
    beat.beat()
    Heartbeat(r, KEYS, "prefill-y", role="prefill").beat()     # no metrics endpoint

    registry = CollectorRegistry()
    registry.register(StreamCollector(r, KEYS))
    port = serve_metrics(registry, "127.0.0.1", 0)
    try:
        s = scrape(f"127.0.0.1:{port}")
        # Asked for OpenMetrics first (as Prometheus asks), the names keep their colons.
        openmetrics = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={
            "Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"})
        with urllib.request.urlopen(openmetrics, timeout=10) as resp:
            raw = resp.read().decode()
    finally:
        stop_metrics(port)
    assert "\npdqueue:stream_backlog{" in raw and "pdqueue_stream_backlog" not in raw
    req = {"cluster": "default", "stream": "requests", "group": "prefill"}
    assert total(s, "pdqueue:streams_up") == 1
    assert total(s, "pdqueue:stream_lag", **req) == 3
    assert total(s, "pdqueue:stream_pending", **req) == 1
    assert total(s, "pdqueue:stream_backlog", **req) == 4
    assert total(s, "pdqueue:stream_backlog", stream="requests:high") == 0
    node = {"stream": "handoff:nodeA", "group": "decode"}
    assert total(s, "pdqueue:stream_lag", **node) == 2 and total(s, "pdqueue:stream_backlog", **node) == 2
    assert [v for n, lab, v in s if n == "pdqueue:stream_backlog" and lab["stream"] == "handoff"] == [0]
    assert total(s, "pdqueue:stream_length", stream="requests") == 5
    assert total(s, "pdqueue:stream_length", stream="done") == 3
    assert total(s, "pdqueue:stream_length", stream="dead") == 1
    assert total(s, "pdqueue:workers", role="decode") == 1 and total(s, "pdqueue:workers", role="prefill") == 1
    assert total(s, "pdqueue:workers", role="colocated") == 0

    # http_sd: the workers that advertise an endpoint, labelled without `role`.
    port = serve_metrics(None, "127.0.0.1", 0, app=cluster_app(r, KEYS))
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/targets", timeout=10) as resp:
            targets = json.loads(resp.read())
        streams = scrape(f"127.0.0.1:{port}")
    finally:
        stop_metrics(port)
    assert targets == [{"targets": ["127.0.0.1:1234"],
                        "labels": {"pdqueue_worker": "decode-x", "pdqueue_cluster": "default"}}]
    assert total(streams, "pdqueue:stream_backlog", **req) == 4


@pytest.mark.processes
def test_the_metrics_module_imports_no_torch():
    """The gateway and `pdqueue metrics-sd` import it: no torch, no model code."""
    code = ("import sys, pdqueue.telemetry.metrics, workers.cli.metrics; "
            "print(sorted({'torch', 'pdqueue.models'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_stream_collector_says_when_redis_is_unreachable():
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    gone = redis.Redis(port=free_port(), socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    registry = CollectorRegistry()
    registry.register(StreamCollector(gone, KEYS))
    port = serve_metrics(registry, "127.0.0.1", 0)
    try:
        s = scrape(f"127.0.0.1:{port}")
    finally:
        stop_metrics(port)
    assert total(s, "pdqueue:streams_up") == 0
    assert "pdqueue:stream_backlog" not in names(s)


# ---- worker processes ------------------------------------------------------------------------

def endpoint(cluster: Cluster, name: str) -> str:
    address = cluster.workers()[name].get("metrics")
    assert address and address.startswith("127.0.0.1:"), cluster.workers()[name]
    return address


def test_every_worker_counts_what_it_did_exactly_once(cluster, r):
    """1 prefill + 1 decode (KV over the TCP data wire: the sender refuses an expired lease,
    whereas an shm copy of blocks kept intact in the prefix cache stands). Two requests whose
    leases expire while the decode worker is stopped (SIGSTOP) are recomputed; the others'
    KV is fetched; one entry is dead-lettered. Each worker's counters equal what the client
    received."""
    cluster.start("prefill", "--lease-s", "1.5", worker_id="prefill", wait=False)
    cluster.start("decode", "--transfer", "tcp", worker_id="decode", wait=False)
    cluster.wait_registered("prefill")
    cluster.wait_registered("decode")
    pre, dec = endpoint(cluster, "prefill"), endpoint(cluster, "decode")
    assert pre != dec
    client = Client(cluster.redis_url, cluster.cluster)
    params = dict(temperature=0.0, seed=0, ignore_eos=True)

    cluster.signal("decode", signal.SIGSTOP)
    try:
        early = [client.submit(f"early {i}", max_tokens=4, **params) for i in range(2)]
        wait_for(lambda: total(scrape(pre), "pdqueue:kv_leases_expired_total") >= 2, timeout=30,
                 what="the prefill worker's leases to expire")
    finally:
        cluster.signal("decode", signal.SIGCONT)
    handles = early + [client.submit("the quick brown fox " * (i + 1), max_tokens=3 + i, **params)
                       for i in range(6)]
    r.xadd(KEYS.requests, {"id": "bad1", "prompt": "x", "bogus": "1"})   # an unknown field: dead-lettered
    results = [h.result(timeout=90) for h in handles]
    n = len(results)
    tokens = sum(len(c.token_ids) for c in results)
    assert all(c.finish_reason.value == "length" for c in results)
    assert {c.transfer_path for c in results[:2]} == {"recompute"}
    recomputed = [c for c in results if c.transfer_path == "recompute"]
    fetched = [c for c in results if c.transfer_path == "tcp"]
    assert len(recomputed) + len(fetched) == n, [c.transfer_path for c in results]

    def settled():
        p, d = scrape(pre), scrape(dec)
        idle = all(total(s, g) == 0 for s in (p, d) for g in ("vllm:num_requests_running",
                                                                 "vllm:num_requests_waiting"))
        done = total(d, "vllm:request_success_total") == n and total(p, "pdqueue:dead_letters_total") == 1
        return (p, d) if idle and done else None

    p, d = wait_for(settled, timeout=30, what="both workers' metrics to settle")
    tiny = {"model_name": "tiny"}
    # prefill: intake, the first token, the prompts it prefilled, the dead letter
    assert total(p, "vllm:request_queue_time_seconds_count", role="prefill", **tiny) == n
    assert total(p, "vllm:time_to_first_token_seconds_count", role="prefill", **tiny) == n
    assert total(p, "vllm:prompt_tokens_total", role="prefill", **tiny) == sum(c.num_prompt_tokens for c in results)
    assert total(p, "vllm:generation_tokens_total", role="prefill") == n         # token 0 of each
    assert total(p, "vllm:request_success_total") == 0                          # none ended at token 0
    assert total(p, "pdqueue:dead_letters_total", role="prefill", code="bad_request") == 1
    assert total(p, "pdqueue:kv_leases_expired_total", role="prefill") >= 2
    # the prefix cache: every prompt token looked up, and the shared "the quick brown fox"
    # prefixes found (each done entry says how many of its prompt's tokens were)
    assert total(p, "vllm:prefix_cache_queries_total", role="prefill") == sum(c.num_prompt_tokens for c in results)
    assert total(p, "vllm:prefix_cache_hits_total", role="prefill") == sum(c.cached_tokens for c in results) > 0
    assert "pdqueue:kv_transfer_bytes_total" not in names(p)
    # decode: the rest of the tokens, the gaps between them, the answers, the KV
    assert total(d, "vllm:request_success_total", role="decode", finished_reason="length", **tiny) == n
    assert total(d, "vllm:e2e_request_latency_seconds_count", role="decode") == n
    assert total(d, "vllm:generation_tokens_total", role="decode") == tokens - n
    assert total(d, "vllm:inter_token_latency_seconds_count", role="decode") == tokens - n
    assert total(d, "vllm:time_to_first_token_seconds_count") == 0              # prefill published token 0
    assert total(d, "vllm:prompt_tokens_total") == 0
    assert total(d, "pdqueue:kv_transfer_seconds_count", role="decode", path="tcp") == len(fetched)
    assert total(d, "pdqueue:kv_transfer_bytes_total", role="decode", path="tcp") == \
        sum(c.transfer_bytes for c in fetched) > 0
    assert total(d, "pdqueue:kv_transfer_bytes_total") == total(d, "pdqueue:kv_transfer_bytes_total", path="tcp")
    assert total(d, "pdqueue:kv_fetch_failures_total") == len(recomputed) >= 2
    assert total(d, "pdqueue:kv_fetch_failures_total", code="lease_expired") >= 2
    assert total(d, "pdqueue:recomputes_total", cause="fetch_failed") == len(recomputed)
    assert total(d, "pdqueue:recompute_tokens_total") == sum(c.num_prompt_tokens + 1 for c in recomputed)
    # together: every token the client received, counted once
    assert total(p, "vllm:generation_tokens_total") + total(d, "vllm:generation_tokens_total") == tokens
    for s in (p, d):
        assert 0 <= total(s, "vllm:kv_cache_usage_perc") <= 1
        assert total(s, "pdqueue:entries_reclaimed_total") == 0

    # `pdqueue status` shows where each worker's metrics are
    from workers.cli import status_view

    snapshot = status_view.collect(cluster.r, cluster.keys)
    shown = {w["worker_id"]: w["metrics"] for w in snapshot["workers"]}
    assert shown == {cluster.id("prefill"): pre, cluster.id("decode"): dec}
    # and the prefix cache's hit rate, from the same totals (once the next heartbeat carries them)
    want = round(100.0 * total(p, "vllm:prefix_cache_hits_total") / total(p, "vllm:prefix_cache_queries_total"), 1)
    assert want > 0

    def hit_pct():
        rows = status_view.collect(cluster.r, cluster.keys)["workers"]
        return {w["worker_id"]: w["prefix_hit_pct"] for w in rows}[cluster.id("prefill")]

    wait_for(lambda: hit_pct() == want, timeout=30, what=f"status to show the prefill worker's {want}% cache hits")


@pytest.mark.processes
def test_a_metrics_port_in_use_is_refused_before_the_model_loads(redis_url):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        started = time.monotonic()
        result = subprocess.run([sys.executable, "-m", "workers", "worker", "decode", "--model", "tiny",
                                 "--redis-url", redis_url, "--metrics-port", str(port)],
                                capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 1, result.stderr
    assert f"error: --metrics-port {port}: cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr and "loading" not in result.stderr
    assert time.monotonic() - started < 30


# ---- a real Prometheus server --------------------------------------------------------------------

PROMETHEUS = shutil.which("prometheus")


def prom_query(base: str, query: str) -> list[dict]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.mark.skipif(PROMETHEUS is None, reason="the prometheus binary is not installed "
                                               "(Debian: apt-get install prometheus; .ci/run does)")
def test_prometheus_scrapes_a_running_worker(cluster, r, tmp_path):
    """Prometheus scrapes a colocated worker twice: at the address its heartbeat gives (a
    static config) and as compose's deploy/prometheus.yml finds it, through `http_sd` from
    ``cluster_app`` (the app of `pdqueue metrics-sd`), which also serves the stream backlog.
    Its query API returns the series."""
    cluster.start("colocated", worker_id="colo")
    address = endpoint(cluster, "colo")
    sd_port = serve_metrics(None, "127.0.0.1", 0, app=cluster_app(r, KEYS))
    web = f"127.0.0.1:{free_port()}"
    shipped = (ROOT / "deploy" / "prometheus.yml").read_text()
    assert "metrics-sd:9464" in shipped and "scrape_interval: 5s" in shipped and "refresh_interval: 10s" in shipped
    config = tmp_path / "prometheus.yml"
    fast = {"metrics-sd:9464": f"127.0.0.1:{sd_port}", "scrape_interval: 5s": "scrape_interval: 1s",
            "scrape_timeout: 4s": "scrape_timeout: 1s", "refresh_interval: 10s": "refresh_interval: 1s"}
    for old, new in fast.items():
        shipped = shipped.replace(old, new)
    config.write_text(shipped + f"""
  - job_name: static
    static_configs:
      - targets: ["{address}"]
""")
    log = open(tmp_path / "prometheus.log", "wb")
    prom = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address={web}"], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://{web}"
    try:
        client = Client(cluster.redis_url, cluster.cluster)
        results = [client.submit(f"count me {i}", max_tokens=5, temperature=0.0, seed=0, ignore_eos=True)
                   .result(timeout=60) for i in range(3)]
        tokens = sum(len(c.token_ids) for c in results)

        def scraped(query: str, value: float):
            try:
                series = prom_query(base, query)
            except OSError:   # not listening yet
                return None
            return series if series and all(float(s["value"][1]) == value for s in series) else None

        for job in ("static", "pdqueue-workers"):
            series = wait_for(lambda: scraped(f'vllm:request_success_total{{job="{job}"}}', 3), timeout=45,
                              what=f"Prometheus ({job}) to scrape 3 successes", interval=0.5)
            labels = series[0]["metric"]
            assert labels["role"] == "colocated" and labels["model_name"] == "tiny"
            assert labels["finished_reason"] == "length" and labels["instance"] == address
            wait_for(lambda: scraped(f'vllm:generation_tokens_total{{job="{job}"}}', tokens), timeout=20,
                     what=f"Prometheus ({job}) to scrape {tokens} tokens", interval=0.5)
        sd = prom_query(base, 'vllm:generation_tokens_total{job="pdqueue-workers"}')[0]["metric"]
        assert sd["pdqueue_worker"] == cluster.id("colo") and sd["pdqueue_cluster"] == "default"
        assert "exported_role" not in sd
        assert wait_for(lambda: scraped('vllm:time_to_first_token_seconds_count{job="static"}', 3), timeout=20,
                        what="TTFT of 3 requests", interval=0.5)
        backlog = wait_for(lambda: scraped('pdqueue:stream_backlog{job="pdqueue-streams",stream="requests"}', 0),
                           timeout=20, what="the stream backlog", interval=0.5)
        assert backlog[0]["metric"]["group"] == "prefill"
        assert wait_for(lambda: scraped('pdqueue:workers{job="pdqueue-streams",role="colocated"}', 1), timeout=20,
                        what="the live worker count", interval=0.5)
    finally:
        prom.terminate()
        try:
            prom.wait(15)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait()
        log.close()
        stop_metrics(sd_port)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (Debian: apt-get install "
                                                             "prometheus; .ci/run does)")
def test_the_shipped_prometheus_config_is_valid(tmp_path):
    ok = subprocess.run(["promtool", "check", "config", str(ROOT / "deploy" / "prometheus.yml")],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    broken = tmp_path / "broken.yml"
    broken.write_text((ROOT / "deploy" / "prometheus.yml").read_text().replace("http_sd_configs", "http_sd_config"))
    assert subprocess.run(["promtool", "check", "config", str(broken)], capture_output=True, timeout=60).returncode
