"""Prometheus metrics: what each worker process measures, and what the streams hold.

Three parts, none of which imports torch:

- ``WorkerMetrics(model_name)``: the metrics of one worker process in its own
  ``CollectorRegistry`` (``.registry``), each observed where it happens (workers/*.py). Names
  follow vLLM's where the meaning is the same (``vllm:*``; dashboards and routers built for
  vLLM read them unchanged), with vLLM's ``model_name`` label and a ``role`` label (prefill,
  decode, colocated: the role that observed it; a switch changes it). What only pdqueue
  has is ``pdqueue:*``. prometheus_client appends ``_total`` to counters in the exposition,
  as vLLM's exposition shows (``vllm:prompt_tokens_total``).
- ``StreamCollector(redis, keys)``: the streams' backlog, read when scraped. Cluster-wide,
  so one process should expose it (the gateway, or ``pdqueue metrics-sd``), not every
  worker::

      registry = CollectorRegistry()
      registry.register(StreamCollector(redis_client, Keys("default")))
      port = serve_metrics(registry, "0.0.0.0", 9464)

- ``serve_metrics(registry, host, port, app=None) -> port``: an HTTP server in a daemon
  thread, in Prometheus's text format (``text_app``: why not OpenMetrics);
  ``cluster_app(redis, keys)`` is what ``pdqueue metrics-sd`` serves: ``/metrics`` and
  ``/targets`` (Prometheus ``http_sd`` of the workers' ``metrics`` endpoints).

Who observes what (each number counted once, by the worker where it happens):

======================================  ========================================================
``vllm:request_queue_time_seconds``     prefill/colocated, at intake: entry id time -> read
``vllm:time_to_first_token_seconds``    prefill/colocated, when token 0 is published
``vllm:prompt_tokens``                  prefill/colocated: prompt tokens of what they prefilled
``vllm:generation_tokens``              every role: the tokens it published (prefill: token 0)
``vllm:inter_token_latency_seconds``    decode/colocated: gap to the request's previous token
                                        (decode's first gap starts at prefill's token 0)
``vllm:e2e_request_latency_seconds``,   whoever publishes ``done`` (decode; prefill when token
``vllm:request_success``                0 ends the request; colocated; intake for requests
                                        cancelled or expired before they ran)
``vllm:num_requests_running|waiting``,  every role, from its load each loop iteration (decode:
``vllm:kv_cache_usage_perc``            waiting counts its backlog and fetches too)
======================================  ========================================================

Answers count when their unit goes to the publisher (a unit the publisher later drops is
``pdqueue:failed_units``). Times come from wall clocks (the enqueue time from the stream
entry id, i.e. Redis's clock); a negative difference (skew) counts as 0.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from socketserver import ThreadingMixIn
from typing import Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import redis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from pdqueue.keys import DECODE_GROUP, PREFILL_GROUP, Keys
from pdqueue.protocol import ROLES, as_str
from pdqueue.queue.backlog import group_backlog
from pdqueue.queue.registry import list_workers
from pdqueue.queue.streams import handoff_streams_found, request_streams_of

log = logging.getLogger("pdqueue.telemetry.metrics")

LABELS = ("model_name", "role")

# vLLM's buckets (vllm/v1/metrics/loggers.py), so histograms aggregate with theirs.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# A KV copy: shm ~1 ms for a short prompt, the network up to the fetch timeout.
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _seconds(ms: float) -> float:
    return max(0.0, ms) / 1000.0


class WorkerMetrics:
    """The metrics of one worker process (see the module docstring), in ``self.registry``.
    Methods record for the current role (``activate``); thread-safe (prometheus_client's
    metrics are), so the fetch thread records transfers itself."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        self.role = ""
        # vLLM's
        self.queue_time = Histogram("vllm:request_queue_time_seconds",
                                    "Time from enqueue (the stream entry id) to intake by a worker.",
                                    LABELS, buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Time from enqueue to the first token published.", LABELS,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Time between a token published and the request's previous one.", LABELS,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Time from enqueue to the done entry (any finish reason).", LABELS,
                             buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests in the engine's running batch.", LABELS,
                             registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting",
                             "Requests taken in and waiting to run (decode: also its backlog and KV fetches).",
                             LABELS, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc",
                              "KV-cache usage: used blocks / all blocks (1 means 100 percent).", LABELS,
                              registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of the requests prefilled (prefill, "
                                     "colocated; prefix-cached ones included).",
                                     LABELS, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated and published.", LABELS,
                                         registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.", LABELS, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits",
                                   "Of those, tokens found cached (not computed).", LABELS, registry=r)
        self._prefix_seen = (0, 0)   # the engine's running totals at the last set_load
        self.success = Counter("vllm:request_success", "Requests finished with a done entry, by finish reason.",
                               (*LABELS, "finished_reason"), registry=r)
        # pdqueue's
        self.transfer_bytes = Counter("pdqueue:kv_transfer_bytes", "KV bytes copied in, by path (decode).",
                                      (*LABELS, "path"), registry=r)
        self.transfer_seconds = Histogram("pdqueue:kv_transfer_seconds", "KV copies, by path (decode).",
                                          (*LABELS, "path"), buckets=TRANSFER_BUCKETS, registry=r)
        self.fetch_failures = Counter("pdqueue:kv_fetch_failures",
                                      "KV fetches that failed, by failure code (decode; each is recomputed).",
                                      (*LABELS, "code"), registry=r)
        self.recomputes = Counter("pdqueue:recomputes",
                                  "Handoffs recomputed from the prompt instead of fetched (decode), by cause: "
                                  "fetch_failed, no_ticket (taken over after tokens were published).",
                                  (*LABELS, "cause"), registry=r)
        self.recompute_tokens = Counter("pdqueue:recompute_tokens", "Tokens prefilled again by recomputes (decode).",
                                        LABELS, registry=r)
        self.prompts_placed = Counter("pdqueue:prompts_placed",
                                      "Prompts placed on a decode worker taking prompts (prefill; "
                                      "workers/placement.py).", LABELS, registry=r)
        self.placed_prompt_tokens = Counter("pdqueue:placed_prompt_tokens",
                                            "Prompt tokens of placed prompts prefilled here (decode).",
                                            LABELS, registry=r)
        self.leases_expired = Counter("pdqueue:kv_leases_expired",
                                      "Exported KV leases handed back on expiry, never released (prefill).",
                                      LABELS, registry=r)
        self.leases = Gauge("pdqueue:kv_leases", "Exported KV leases held now (prefill).", LABELS, registry=r)
        self.reclaimed = Counter("pdqueue:entries_reclaimed",
                                 "Input entries taken over: from a dead consumer, a hung one (idle past "
                                 "reclaim_idle_ms), or redelivered to this worker after a Redis error.",
                                 (*LABELS, "group", "cause"), registry=r)
        self.dead_letters = Counter("pdqueue:dead_letters",
                                    "Input entries dead-lettered (copied to the dead stream), by error code.",
                                    (*LABELS, "code"), registry=r)
        self.request_errors = Counter("pdqueue:request_errors",
                                      "Requests answered with an error entry while they ran, by error code.",
                                      (*LABELS, "code"), registry=r)
        self.incompatible_events = Counter(
            "pdqueue:kv_incompatible",
            "The compatibility handshake (workers/compat.py), by event: peer (a worker of another KV or wire kind "
            "seen, routed around: once per peer), rerouted (decode: a handoff of another kind passed on to its "
            "kind's stream, never run here).", (*LABELS, "event"), registry=r)
        self.failed_units = Counter("pdqueue:failed_units",
                                    "Units of answers the publisher failed to write (entries taken in again).",
                                    ("model_name",), registry=r)
        self._gauges = (self.running, self.waiting, self.kv_usage, self.leases)
        self._lock = threading.Lock()

    def _l(self):
        return self.model_name, self.role

    # ---- the role ---------------------------------------------------------------------
    def activate(self, role: str) -> None:
        """The process now serves ``role``: later observations carry it; the gauges of any
        other role go (counters and histograms stay: they are cumulative)."""
        with self._lock:
            self.role = role
            for gauge in self._gauges:
                for other in ROLES:
                    if other != role:
                        try:
                            gauge.remove(self.model_name, other)
                        except KeyError:
                            pass

    def set_load(self, load: dict) -> None:
        """The gauges, from a role's heartbeat load (``running``, ``waiting``, ``backlog``,
        ``fetching``, ``kv_free``, ``kv_total``, ``leases``), and the prefix cache's counters
        from the engine's totals (``prefix_cache_queries``, ``prefix_cache_hits``)."""
        labels = self._l()
        self.running.labels(*labels).set(int(load.get("running") or 0))
        self.waiting.labels(*labels).set(sum(int(load.get(k) or 0) for k in ("waiting", "backlog", "fetching")))
        total, free = load.get("kv_total"), load.get("kv_free")
        if total and free is not None:
            self.kv_usage.labels(*labels).set((int(total) - int(free)) / int(total))
        if "leases" in load:
            self.leases.labels(*labels).set(int(load["leases"]))
        if "prefix_cache_queries" in load:   # the engine's totals: the counters move by what is new
            now = (int(load["prefix_cache_queries"] or 0), int(load.get("prefix_cache_hits") or 0))
            seen = self._prefix_seen if now[0] >= self._prefix_seen[0] else (0, 0)   # a new role's engine
            self.prefix_queries.labels(*labels).inc(now[0] - seen[0])
            self.prefix_hits.labels(*labels).inc(max(0, now[1] - seen[1]))
            self._prefix_seen = now

    # ---- requests ---------------------------------------------------------------------
    def queued(self, ms: float) -> None:
        self.queue_time.labels(*self._l()).observe(_seconds(ms))

    def first_token(self, ttft_ms: float, prompt_tokens: int) -> None:
        labels = self._l()
        self.ttft.labels(*labels).observe(_seconds(ttft_ms))
        self.prompt_tokens.labels(*labels).inc(prompt_tokens)

    def token_gap(self, ms: float) -> None:
        self.itl.labels(*self._l()).observe(_seconds(ms))

    def answered(self, tally) -> None:
        """What a unit of answers (workers/answers.py ``Unit.tally``) carried: tokens, done
        entries (reason, e2e ms), dead letters and errors (codes)."""
        labels = self._l()
        if tally.tokens:
            self.generation_tokens.labels(*labels).inc(tally.tokens)
        for reason, e2e_ms in tally.done:
            self.success.labels(*labels, reason).inc()
            self.e2e.labels(*labels).observe(_seconds(e2e_ms))
        for code in tally.dead:
            self.dead_letters.labels(*labels, code).inc()
        for code in tally.errors:
            self.request_errors.labels(*labels, code).inc()

    # ---- KV ---------------------------------------------------------------------------
    def transferred(self, path: str, nbytes: int, seconds: float) -> None:
        labels = self._l()
        self.transfer_bytes.labels(*labels, path).inc(nbytes)
        self.transfer_seconds.labels(*labels, path).observe(max(0.0, seconds))

    def fetch_failed(self, code: str) -> None:
        self.fetch_failures.labels(*self._l(), code).inc()

    def recomputed(self, cause: str, tokens: int) -> None:
        labels = self._l()
        self.recomputes.labels(*labels, cause).inc()
        self.recompute_tokens.labels(*labels).inc(tokens)

    def placed(self, n: int = 1) -> None:
        self.prompts_placed.labels(*self._l()).inc(n)

    def prefilled_placed(self, tokens: int) -> None:
        self.placed_prompt_tokens.labels(*self._l()).inc(tokens)

    def lease_expired(self, n: int = 1) -> None:
        self.leases_expired.labels(*self._l()).inc(n)

    def incompatible(self, event: str) -> None:
        self.incompatible_events.labels(*self._l(), event).inc()

    # ---- recovery ---------------------------------------------------------------------
    def reclaim(self, group: str, cause: str, n: int) -> None:
        if n:
            self.reclaimed.labels(*self._l(), group, cause).inc(n)

    def unit_failed(self) -> None:
        self.failed_units.labels(self.model_name).inc()


# ---- the streams, read when scraped --------------------------------------------------------

def stream_groups(r: redis.Redis, keys: Keys) -> list[tuple[str, str, int, int, int]]:
    """(stream key, group, length, lag, pending) of the request streams (group ``prefill``)
    and of ``handoff`` and every ``handoff:<node>`` (group ``decode``). Raises redis errors."""
    out = []
    for stream, group in [*((s, PREFILL_GROUP) for s in request_streams_of(r, keys)),
                          *((h, DECODE_GROUP) for h in handoff_streams_found(r, keys))]:
        lag, pending = group_backlog(r, stream, group)
        out.append((stream, group, int(r.xlen(stream)), lag, pending))
    return out


class StreamCollector:
    """A custom collector: the cluster's stream backlog when scraped (module docstring).
    Register it in a ``CollectorRegistry``; a scrape costs a few Redis round trips (SCAN for
    ``handoff:*``, XINFO GROUPS and XLEN per stream, the heartbeats). Series:

    - ``pdqueue:stream_backlog{cluster,stream,group}``: lag + pending, i.e. entries the group
      has not finished;
    - ``pdqueue:stream_lag{...}``: entries not yet delivered to any consumer (the stream
      length when the group does not exist yet);
    - ``pdqueue:stream_pending{...}``: delivered, not yet acknowledged;
    - ``pdqueue:stream_length{cluster,stream}``: XLEN, also of ``done`` and ``dead``;
    - ``pdqueue:workers{cluster,role}``: live heartbeats by role;
    - ``pdqueue:streams_up{cluster}``: 1, or 0 when Redis could not be read (then only this).

    ``stream`` is the key without the ``pdq:{NAME}:`` prefix (``requests``, ``handoff:<node>``).
    """

    def __init__(self, r: redis.Redis, keys: Keys):
        self.r, self.keys = r, keys

    def describe(self) -> list:
        return []   # registering must not read Redis

    def collect(self) -> Iterable:
        cluster = self.keys.cluster
        up = GaugeMetricFamily("pdqueue:streams_up", "1 when the last scrape could read Redis.", labels=["cluster"])
        try:
            rows = stream_groups(self.r, self.keys)
            lengths = {key: int(self.r.xlen(key)) for key in (self.keys.done, self.keys.dead)}
            roles: dict[str, int] = {role: 0 for role in ROLES}
            for w in list_workers(self.r, self.keys):
                role = as_str(w.get("role", ""), "replace")
                roles[role] = roles.get(role, 0) + 1
        except redis.RedisError as exc:
            log.warning("stream metrics: redis unavailable (%s)", exc)
            up.add_metric([cluster], 0)
            yield up
            return
        up.add_metric([cluster], 1)
        yield up
        names = ["cluster", "stream", "group"]
        backlog = GaugeMetricFamily("pdqueue:stream_backlog", "Entries the group has not finished (lag + pending).",
                                    labels=names)
        lag = GaugeMetricFamily("pdqueue:stream_lag", "Entries not yet delivered to the group.", labels=names)
        pending = GaugeMetricFamily("pdqueue:stream_pending", "Entries delivered to the group, not yet acknowledged.",
                                    labels=names)
        length = GaugeMetricFamily("pdqueue:stream_length", "Entries in the stream (XLEN).",
                                   labels=["cluster", "stream"])
        prefix = self.keys.prefix
        for stream, group, n, lag_n, pending_n in rows:
            labels = [cluster, stream[len(prefix):], group]
            backlog.add_metric(labels, lag_n + pending_n)
            lag.add_metric(labels, lag_n)
            pending.add_metric(labels, pending_n)
            length.add_metric(labels[:2], n)
        for stream, n in lengths.items():
            length.add_metric([cluster, stream[len(prefix):]], n)
        workers = GaugeMetricFamily("pdqueue:workers", "Live workers (heartbeats) by role.", labels=["cluster", "role"])
        for role, n in sorted(roles.items()):
            workers.add_metric([cluster, role], n)
        yield from (backlog, lag, pending, length, workers)


# ---- service discovery ------------------------------------------------------------------

def sd_targets(r: redis.Redis, keys: Keys) -> list[dict]:
    """Prometheus HTTP service discovery (``http_sd_configs``): one target group per live
    worker that advertises ``metrics`` (host:port) in its heartbeat. Target labels are
    ``pdqueue_worker`` and ``pdqueue_cluster`` (not ``role``: every series carries its own
    ``role`` label, which a target label of that name would rename)."""
    return [{"targets": [as_str(w["metrics"], "replace")], "labels": {"pdqueue_worker": w["worker_id"],
                                                       "pdqueue_cluster": keys.cluster}}
            for w in list_workers(r, keys) if w.get("metrics")]


def cluster_app(r: redis.Redis, keys: Keys, registry: CollectorRegistry | None = None) -> Callable:
    """A WSGI app: ``/targets`` (``sd_targets`` as JSON), anything else the metrics of
    ``registry`` (default: a new one holding a ``StreamCollector`` for ``keys``)."""
    if registry is None:
        registry = CollectorRegistry()
        registry.register(StreamCollector(r, keys))
    metrics_app = text_app(registry)

    def app(environ, start_response):
        if environ.get("PATH_INFO", "").rstrip("/") == "/targets":
            try:
                body, status = json.dumps(sd_targets(r, keys)).encode(), "200 OK"
            except redis.RedisError as exc:
                body, status = json.dumps({"error": str(exc)}).encode(), "503 Service Unavailable"
            start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        return metrics_app(environ, start_response)

    return app


# ---- serving ----------------------------------------------------------------------------

TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def text_app(registry: CollectorRegistry) -> Callable:
    """A WSGI app answering every request with ``registry`` in the Prometheus text format
    (0.0.4), whatever the Accept header asks. Not OpenMetrics: prometheus_client (0.22 to
    0.26 at least, client_python issue #1177) writes OpenMetrics sample lines with ``:``
    turned into ``_`` (``vllm_request_success_total`` under a ``# TYPE
    vllm:request_success`` line), and Prometheus asks for OpenMetrics first; the text format
    keeps vLLM's names as they are."""
    def app(environ, start_response):
        body = generate_latest(registry)
        start_response("200 OK", [("Content-Type", TEXT_CONTENT_TYPE), ("Content-Length", str(len(body)))])
        return [body]

    return app


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):   # no line per scrape
        pass


_servers: dict[int, _Server] = {}


def serve_metrics(registry: CollectorRegistry | None, host: str = "127.0.0.1", port: int = 0,
                  app: Callable | None = None) -> int:
    """Serve ``registry`` (``/metrics``; any path answers the same) or ``app`` over HTTP from
    a daemon thread; returns the bound port (``port`` 0: any free one). ``host`` ``0.0.0.0``
    (or ``::``) listens on every interface. ``stop_metrics(port)`` stops it. Raises OSError
    when the address cannot be bound."""
    if app is None:
        app = text_app(registry)
    host = "0.0.0.0" if host in ("*", "") else host.strip("[]")
    server_class = _Server6 if ":" in host else _Server
    server = make_server(host, port, app, server_class=server_class, handler_class=_QuietHandler)
    bound = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, name=f"pdq-metrics-{bound}", daemon=True)
    thread.start()
    _servers[bound] = server
    return bound


def stop_metrics(port: int) -> None:
    server = _servers.pop(port, None)
    if server is not None:
        server.shutdown()
        server.server_close()


def advertised(host: str, port: int, advertise_host: str | None = None) -> str:
    """``host:port`` for others to scrape: ``host`` itself, unless it means every interface
    (``0.0.0.0``, ``::``, ``*``): then ``advertise_host``, else the address this machine's
    hostname resolves to (a container's own IP)."""
    if host not in ("0.0.0.0", "::", "*", "", "[::]"):
        shown = host
    elif advertise_host and advertise_host != "auto":
        shown = advertise_host
    else:
        try:
            shown = socket.gethostbyname(socket.gethostname())
        except OSError:
            shown = "127.0.0.1"
    return f"[{shown}]:{port}" if ":" in shown and not shown.startswith("[") else f"{shown}:{port}"


__all__ = ["StreamCollector", "WorkerMetrics", "advertised", "cluster_app", "sd_targets", "serve_metrics",
           "stop_metrics", "stream_groups", "text_app"]
