"""What the benchmark clients run against (``client_bench``): ``Stack``, a Redis server, one
prefill and one decode worker and a gateway started here, and ``PrefillStall``, which holds
the prefill worker so that every request's TTFT is over a second. Imports the standard
library at the top; redis and pdqueue.keys/queue in the functions that need them; never
workers (they are subprocesses)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


# -- a TTFT over a second, deterministically ----------------------------------------------------

class PrefillStall:
    """SIGSTOP the prefill worker (its process group ``pgid``) until ``count`` requests were
    added to the cluster's request streams since (entries after each stream's last id at the
    start: what an earlier load left there does not count), then ``hold_s`` more, then
    SIGCONT: every request of the load gets its first token ``hold_s`` or more after it was
    queued. ``max_wait_s`` bounds the wait for the load (a client that sent fewer);
    leaving the ``with`` block always resumes the worker. The worker must outlive the stall
    in the registry (``--heartbeat-ttl-s`` well above ``max_wait_s`` + ``hold_s``)."""

    def __init__(self, pgid: int, redis_url: str, cluster: str, count: int, hold_s: float = 1.5,
                 max_wait_s: float = 120.0):
        self.pgid, self.redis_url, self.cluster, self.count = pgid, redis_url, cluster, count
        self.hold_s, self.max_wait_s = hold_s, max_wait_s
        self._since: dict[str, str] = {}     # each request stream's last entry id at the start
        self.queued: int | None = None       # requests seen when the hold began
        self.waited_s: float | None = None   # from the stop to the hold
        self._resumed = threading.Event()
        self._thread: threading.Thread | None = None

    def _streams(self) -> tuple[str, ...]:
        from pdqueue.keys import Keys
        from pdqueue.queue.streams import request_streams

        return request_streams(Keys(self.cluster))

    @staticmethod
    def _last_id(r, stream: str) -> str:
        newest = r.xrevrange(stream, count=1)
        return newest[0][0].decode() if newest else "0-0"

    def queued_now(self, r) -> int:
        """Requests added since the stall began."""
        return sum(len(r.xrange(s, min="(" + self._since[s], max="+")) for s in self._streams())

    def __enter__(self) -> "PrefillStall":
        import redis

        r = redis.Redis.from_url(self.redis_url)
        self._since = {s: self._last_id(r, s) for s in self._streams()}
        os.killpg(self.pgid, signal.SIGSTOP)
        start = time.monotonic()

        def hold():
            try:
                while time.monotonic() - start < self.max_wait_s and not self._resumed.is_set():
                    self.queued = self.queued_now(r)
                    if self.queued >= self.count:
                        break
                    time.sleep(0.05)
                self.waited_s = time.monotonic() - start
                self._resumed.wait(self.hold_s)
            finally:
                self.resume()
                r.close()

        self._thread = threading.Thread(target=hold, name="pdq-prefill-stall", daemon=True)
        self._thread.start()
        return self

    def resume(self) -> None:
        self._resumed.set()
        try:
            os.killpg(self.pgid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    def __exit__(self, *exc) -> None:
        self.resume()
        if self._thread is not None:
            self._thread.join(10)


# -- the bench (scripts/bench-clients run) --------------------------------------------------------

class Stack:
    """What ``main`` benches against when no ``--url`` is given, all on this machine: a
    Redis server, one prefill and one decode worker (``python -m workers worker``, one
    torch thread each; the prefill worker's heartbeat lives long enough for a
    ``PrefillStall``; both with ``worker_args``) and one gateway (``python -m workers serve``
    on a free port, with ``gateway_args``). Logs in ``log_dir``; ``stop`` ends them in that order's reverse."""

    def __init__(self, model: str, log_dir: Path, gateway_args: list[str], worker_args: list[str] = (),
                 kv_cache_mb: int = 512, cluster: str = "bench-clients"):
        from pdqueue.queue.redis_server import RedisServer

        self.log_dir, self.cluster, self.procs = log_dir, cluster, {}
        log_dir.mkdir(parents=True, exist_ok=True)
        self.server = RedisServer().start()
        self.redis_url = self.server.url
        env = {k: v for k, v in os.environ.items() if not k.startswith("PDQ_") or k == "PDQ_CACHE_DIR"}
        self.env = {**env, "PYTHONUNBUFFERED": "1"}
        try:
            for role, extra in (("prefill", ["--heartbeat-ttl-s", "600"]), ("decode", [])):
                self._spawn(role, ["worker", role, "--model", model, "--redis-url", self.redis_url, "--cluster",
                                   cluster, "--threads", "1", "--kv-cache-mb", str(kv_cache_mb), *worker_args,
                                   *extra])
            self._wait(self._registered, 600, "the workers to register")
            self._spawn("gateway", ["serve", "--redis-url", self.redis_url, "--cluster", cluster, "--port", "0",
                                    *gateway_args])
            self.url = self._wait(self._gateway_url, 60, "the gateway's URL")
            self._wait(self._healthy, 60, "the gateway's /health")
        except BaseException:
            self.stop()
            raise

    def _spawn(self, name: str, args: list[str]) -> None:
        with open(self.log_dir / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen([sys.executable, "-m", "workers", *args], stdout=log,
                                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                                                env=self.env, start_new_session=True)

    def _wait(self, predicate, timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
        while True:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                tail = (self.log_dir / f"{dead[0]}.log").read_text(errors="replace")[-3000:]
                code = self.procs[dead[0]].returncode
                raise RuntimeError(f"{dead[0]} exited with {code} waiting for {what}:\n{tail}")
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
            time.sleep(0.1)

    def _registered(self) -> bool:
        from pdqueue.keys import Keys
        from pdqueue.queue.connection import connect
        from pdqueue.queue.registry import list_workers

        r = connect(self.redis_url)
        try:
            return {w.get("role") for w in list_workers(r, Keys(self.cluster))} >= {"prefill", "decode"}
        finally:
            r.close()

    def _gateway_url(self) -> str | None:
        match = re.search(r"(http://\S+)/v1", (self.log_dir / "gateway.log").read_text(errors="replace"))
        return match and match.group(1)

    def _healthy(self) -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                return resp.status == 200
        except OSError:
            return False

    @property
    def prefill_pgid(self) -> int:
        return self.procs["prefill"].pid   # start_new_session: its own process group

    def stop(self) -> None:
        for name in ("gateway", "decode", "prefill"):   # the gateway first: it answers what is open
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            try:
                os.killpg(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            except ProcessLookupError:
                pass
        self.server.stop()
