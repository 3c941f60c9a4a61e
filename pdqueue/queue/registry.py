"""Worker registration by heartbeat: who is alive, where to reach it, how loaded it is.

Each worker keeps a hash ``worker:<id>`` with a TTL (``Heartbeat``): fields ``role``,
``node``, ``incarnation``, ``endpoints`` (JSON), ``load`` (JSON), ``model``, ``pid``,
``host``, ``started_ms``, ``beat_ms``, ``max_model_len`` (the context, in tokens),
``weights`` (``fp32``, ``int8`` or ``int4``: how its linear layers are held), ``compat``
(JSON: the compatibility record of its KV and wires, ``pdqueue.protocol.compat``; absent
from older workers, which are then compatible with every other), and
what role switching needs (``pdqueue.control.commands``): ``role_epoch``, ``switchable`` (0/1),
``role_since_ms`` and ``switching_to`` (the role an accepted switch goes to; empty
otherwise). The whole hash is rewritten and its TTL renewed every ``ttl_s / 3`` seconds
(or ``interval_s``, where readers need a fresher load: a decode worker taking placed prompts),
so a worker that dies (or loses Redis for longer than the TTL) simply disappears, and one
that comes back re-registers in full. Nobody trusts a
worker to report its own death; ``remove()`` on a clean stop only makes it quicker.

``incarnation`` is random per process start: tickets name it, and a ticket from an
earlier incarnation of the same worker id is rejected (DESIGN, principle 3).

Imports redis and pdqueue.keys/retry only.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

import redis

from pdqueue.keys import HEARTBEAT_TTL_S, Keys
from pdqueue.retry import backoff_delay

log = logging.getLogger(__name__)

_TOP_LEVEL = ("role", "node", "endpoints", "model", "role_epoch", "switchable", "role_since_ms", "switching_to",
              "max_model_len", "metrics",   # metrics: host:port of its Prometheus endpoint (pdqueue.telemetry.metrics)
              "weights",    # weights: fp32, int8 or int4 (pdqueue.models.quant)
              "compat")     # compat: the compatibility record (pdqueue.protocol.compat.Compat.record)
_JSON_FIELDS = ("endpoints", "load", "compat")
_INT_FIELDS = ("pid", "started_ms", "beat_ms", "role_epoch", "switchable", "role_since_ms", "max_model_len")
_RETRY_INITIAL_S = 0.05


def _now_ms() -> int:
    return int(time.time() * 1000)


class Heartbeat:
    """Keeps ``worker:<worker_id>`` alive from a daemon thread until ``stop()``.

    ``update(**fields)`` changes what the next beat writes: ``role``, ``node``,
    ``endpoints``, ``model``, ``role_epoch``, ``switchable``, ``role_since_ms``,
    ``switching_to`` and the other top-level fields (``compat``, ...) replace those
    fields; ``load`` (a dict) replaces the whole load dict; any other name is merged into
    it (e.g. ``update(running=3, kv_free=120)``).
    """

    def __init__(self, r: redis.Redis, keys: Keys, worker_id: str, *, role: str, node: str = "",
                 endpoints: dict | None = None, load: dict | None = None, model: str = "",
                 incarnation: str | None = None, ttl_s: float = HEARTBEAT_TTL_S,
                 backoff_max_s: float = 2.0, interval_s: float | None = None):
        self._r = r
        self.key = keys.worker(worker_id)
        self.worker_id = worker_id
        self.incarnation = incarnation or uuid.uuid4().hex
        self.ttl_s = ttl_s
        self.interval_s = ttl_s / 3 if interval_s is None else min(interval_s, ttl_s / 3)
        self._backoff_max_s = backoff_max_s
        self._lock = threading.Lock()
        # One beat at a time: a later snapshot is never overwritten by an earlier one.
        self._write_lock = threading.Lock()
        self._info: dict[str, Any] = {
            "role": role, "node": node, "incarnation": self.incarnation,
            "endpoints": dict(endpoints or {}), "load": dict(load or {}), "model": model,
            "pid": os.getpid(), "host": socket.gethostname(), "started_ms": _now_ms(),
        }
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"pdq-heartbeat-{worker_id}",
                                        daemon=True)
        self.beats = 0
        self.failures = 0

    def start(self) -> "Heartbeat":
        """Write the first beat synchronously (so the worker is visible on return; raises if
        Redis is unreachable), then keep beating in the background."""
        self.beat()
        self._thread.start()
        return self

    def update(self, **fields: Any) -> None:
        with self._lock:
            for name, value in fields.items():
                if name == "load":
                    self._info["load"] = dict(value)
                elif name in _TOP_LEVEL:
                    self._info[name] = value
                else:
                    self._info["load"][name] = value

    @property
    def info(self) -> dict[str, Any]:
        with self._lock:
            return json.loads(json.dumps(self._info))

    def beat(self) -> None:
        """One beat: rewrite the hash and renew its TTL in one transaction. From any thread
        (a worker beats at once when its role changes)."""
        with self._write_lock:
            with self._lock:
                mapping = {name: json.dumps(value, separators=(",", ":")) if name in _JSON_FIELDS
                           else str(int(value)) if isinstance(value, bool)   # "1"/"0", read back as ints
                           else str(value) for name, value in self._info.items()}
            mapping["beat_ms"] = str(_now_ms())
            with self._r.pipeline(transaction=True) as pipe:
                pipe.hset(self.key, mapping=mapping)
                pipe.pexpire(self.key, max(1, int(self.ttl_s * 1000)))
                pipe.execute()
            self.beats += 1

    def _run(self) -> None:
        interval = self.interval_s
        delay = interval
        while not self._stop.wait(delay):
            try:
                self.beat()
                if self.failures:
                    log.info("heartbeat %s: redis reachable again", self.worker_id)
                self.failures = 0
                delay = interval
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                self.failures += 1
                if self.failures == 1:
                    log.warning("heartbeat %s: redis unavailable (%s); retrying", self.worker_id, exc)
                # never slower than the beat itself, so a TTL is not missed for waiting
                delay = backoff_delay(self.failures, _RETRY_INITIAL_S,
                                      min(interval, self._backoff_max_s))
            except Exception:
                log.exception("heartbeat %s: beat failed", self.worker_id)
                delay = interval

    def stop(self, remove: bool = True) -> None:
        """Stop beating; with ``remove`` delete the hash now (else it expires by TTL)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._backoff_max_s + 5)
        if remove:
            self.remove()

    def remove(self) -> None:
        try:
            self._r.delete(self.key)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("heartbeat %s: could not remove registration (%s); it will expire",
                        self.worker_id, exc)

    def __enter__(self) -> "Heartbeat":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _decode_worker(keys: Keys, key: Any, raw: dict) -> dict[str, Any]:
    info: dict[str, Any] = {}
    for name, value in raw.items():
        name = name.decode() if isinstance(name, bytes) else name
        value = value.decode(errors="replace") if isinstance(value, bytes) else value
        if name in _JSON_FIELDS:
            try:
                value = json.loads(value)
            except ValueError:
                value = {}
        elif name in _INT_FIELDS:
            flag = {"true": 1, "yes": 1, "on": 1, "false": 0, "no": 0, "off": 0}.get(value.strip().lower())
            try:
                value = flag if flag is not None else int(value)   # any client may write the hash
            except ValueError:
                value = 0
        info[name] = value
    info["worker_id"] = keys.worker_id_of(key)
    return info


def list_workers(r: redis.Redis, keys: Keys, role: str | None = None) -> list[dict[str, Any]]:
    """Every live worker of the cluster (SCAN, then one pipelined HGETALL), sorted by id.
    Each dict has the hash's fields (endpoints/load parsed from JSON) plus ``worker_id``."""
    found = sorted(set(r.scan_iter(match=keys.workers_pattern, count=500)))
    if not found:
        return []
    with r.pipeline(transaction=False) as pipe:
        for key in found:
            pipe.hgetall(key)
        hashes = pipe.execute()
    workers = [_decode_worker(keys, key, raw) for key, raw in zip(found, hashes) if raw]
    return [w for w in workers if role is None or w.get("role") == role]
