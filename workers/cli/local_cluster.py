"""The process supervisor behind ``pdqueue up``: one Redis server and N prefill + M decode
worker processes on this machine, started together and stopped together.

Lifecycle: ``start_server`` (an embedded redis-server/valkey-server on loopback, port 6379
when it is free, else a free one, with a password (``redis_password``, else a random one);
in its own session, so a terminal's Ctrl-C does not reach it; unless a URL was given) ->
``start_workers`` (``python -m workers worker ROLE``, each in its own session and process
group, logs in ``log_dir``; the URL, password included, goes to them in ``PDQ_REDIS_URL``,
never on a command line, which ``ps`` shows; ``PDQ_UP_SERVER`` marks their answers as held by
the embedded server, whose stop waits until they are read) -> ``write_state`` (a 0600 file per cluster,
``pdqueue.discovery``, with the password, so ``submit``/``status`` in another terminal find
it) -> ``wait_ready`` (all registered by heartbeat) -> ``supervise`` (restarts:
``workers.cli.supervisor.restarts``; the rolling restarts `pdqueue restart` asks for:
``supervisor.rolling``) -> ... -> ``stop`` (``workers.cli.supervisor.stopping``,
with the drain of the embedded server's queue in ``supervisor.draining``). ``start_gateway``
adds the OpenAI-compatible gateway (``pdqueue serve``, port 8000 when free), on a listening
socket `up` binds and keeps, so that a restarted or replacing gateway serves the same one
(``pdqueue.frontends.runtime``): the first process ``stop`` signals and the last it waits for.
Every child gets PDEATHSIG (``pdqueue.procs.die_with_parent``), so a SIGKILLed supervisor does not leave workers or the
server behind.

Imports redis and pdqueue.queue/keys/protocol/discovery (never torch).
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import redis

# The state files (how `submit` and `status` find a running `up`) live in pdqueue.discovery,
# which Client() reads too; imported here so that older imports keep working.
from pdqueue.config import SECURITY_ENV, redact_url, url_credentials
from pdqueue.discovery import read_state, remove_state, running_clusters, state_path, write_state
from pdqueue.engine.config import DEFAULT_KV_CACHE_MB
from pdqueue.frontends.runtime import bind
from pdqueue.keys import Keys
from pdqueue.procs import die_with_parent
from pdqueue.protocol import Role
from pdqueue.queue.connection import connect
from pdqueue.queue.redis_server import RedisServer, port_is_free
from pdqueue.queue.registry import list_workers
from workers.cli.supervisor.draining import WorkLeft
from workers.cli.supervisor.processes import Progress, WorkerFailed, WorkerProcess
from workers.cli.supervisor.restarts import CRASH_LOOP_RESTARTS, CRASH_LOOP_WINDOW_S, RESTART_BACKOFF_S, Restarts
from workers.cli.supervisor.rolling import Rolling
from workers.cli.supervisor.stopping import Stopping

DEFAULT_REDIS_PORT = 6379  # the embedded server's port when it is free: README's examples work
DEFAULT_GATEWAY_PORT = 8000  # the gateway's port when it is free (README's examples)

__all__ = ["CRASH_LOOP_RESTARTS", "CRASH_LOOP_WINDOW_S", "LocalCluster", "LocalClusterConfig", "WorkerFailed",
           "WorkerProcess", "read_state", "remove_state", "running_clusters", "state_path", "write_state"]


@dataclass(frozen=True, slots=True)
class LocalClusterConfig:
    num_prefill: int = 1
    num_decode: int = 1
    model: str = "smollm2"
    cluster: str = "default"
    redis_url: str | None = None      # None: start an embedded server
    redis_port: int | None = None     # the embedded server's port (default: 6379 if free, else a free one)
    redis_password: str | None = field(default=None, repr=False)  # the embedded server's (None: a random one)
    threads: int | None = None        # torch threads per worker
    kv_cache_mb: int = DEFAULT_KV_CACHE_MB
    log_dir: Path | None = None       # None: a temporary directory, removed by stop()
    log_level: str = "INFO"
    worker_args: tuple[str, ...] = field(default_factory=tuple)
    switchable: bool = False          # workers take role switches (``up --adapt``)
    gateway_port: int | None = None   # ``start_gateway``: None = 8000 if free, else a free one
    gateway_tenants: str | None = None   # ``start_gateway``: its --tenants FILE (None: the environment's PDQ_TENANTS)
    prefill_weights: str = "fp32"     # --weights of the prefill workers (pdqueue.models.quant)
    decode_weights: str = "fp32"      # --weights of the decode (and colocated) workers
    prefill_args: tuple[str, ...] = field(default_factory=tuple)  # more options of the prefill workers
    decode_args: tuple[str, ...] = field(default_factory=tuple)   # ... of the decode (and colocated) workers
    kv_wire_format: str = "native"    # the workers' --kv-wire-format (engine/kv_codec.py; network paths only)
    # The first restart's delay, doubled per restart (up --restart-backoff-s).
    restart_backoff_s: float = RESTART_BACKOFF_S
    # At the stop, the embedded server waits this long at most for answers no client has read yet
    # (``up --answer-grace-s``, default ``draining.ANSWER_GRACE_S``; 0: it stops at once).
    answer_grace_s: float = 0.0



class LocalCluster:
    """Owns the server (if embedded), the worker processes, their logs and the state file;
    ``restarts`` (the supervisor thread) and ``work_left`` (the streams' backlog) are its parts."""

    def __init__(self, config: LocalClusterConfig):
        self.config = config
        self.keys = Keys(config.cluster)
        self.server: RedisServer | None = None
        self.url = config.redis_url
        self.workers: list[WorkerProcess] = []
        self.state_file: Path | None = None
        self.own_log_dir = config.log_dir is None
        self.log_dir = Path(config.log_dir) if config.log_dir else Path(tempfile.mkdtemp(prefix="pdq-up-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._r: redis.Redis | None = None
        self.run_id = secrets.token_hex(2)
        self.gateway: WorkerProcess | None = None   # `pdqueue serve` (``start_gateway``)
        self.gateway_url: str | None = None         # its base URL, e.g. http://127.0.0.1:8000
        self.gateway_socket: socket.socket | None = None   # its listening socket, `up`'s (``start_gateway``)
        self.retired: list[WorkerProcess] = []      # processes a rolling restart replaced (``supervisor.rolling``)
        self.port_note = ""  # why the embedded server has its port, for `up`'s first line
        self.password = config.redis_password or secrets.token_hex(24)  # the embedded server's
        self.restarts = Restarts(self, config.restart_backoff_s)
        self.rolling = Rolling(self, lambda text, level, tail: self.restarts.event(text, level, tail=tail))
        self.restarts.each_round.append(self.rolling.tick)   # `pdqueue restart`, in the supervisor thread
        self.work_left = WorkLeft(self)

    @property
    def events(self) -> list[dict]:
        """What the supervisor saw: exits, restarts, returns, a crash loop."""
        return self.restarts.events

    @property
    def failure(self) -> str | None:
        """Why `up` should stop: a crash loop left a role (or the gateway) with nobody."""
        return self.restarts.failure

    def start_server(self) -> str:
        """Start the embedded server unless a URL was given; returns the URL to use. Its
        port: ``redis_port``, else 6379 (Redis's own, which README's examples and
        ``Client()`` use) when nothing listens there, else a free one; ``port_note`` says which."""
        if self.url is None:
            port = self.config.redis_port
            if port:
                self.port_note = "port set by --redis-port"
                self.server = RedisServer(port=port, password=self.password).start()
            else:
                self.server = self._start_on_default_port()
            self.url = self.server.url
        self._r = connect(self.url, purpose="supervisor")
        return self.url

    def _start_on_default_port(self) -> RedisServer:
        if port_is_free(DEFAULT_REDIS_PORT, RedisServer.host):
            server = RedisServer(port=DEFAULT_REDIS_PORT, password=self.password)
            try:
                server.start()
                self.port_note = f"the default port {DEFAULT_REDIS_PORT}"
                return server
            except RuntimeError:  # taken in the meantime
                server.stop()
        self.port_note = f"port {DEFAULT_REDIS_PORT} is taken, so a free one"
        return RedisServer(password=self.password).start()

    @property
    def shown_url(self) -> str:
        """The URL without its password (banners, messages)."""
        return redact_url(self.url or "")

    def child_env(self) -> dict[str, str]:
        """The environment of the workers and the gateway: the URL (with its password) in
        ``PDQ_REDIS_URL``. With the embedded server the URL says everything: the caller's
        ``PDQ_REDIS_*`` credentials and TLS settings (meant for other servers) are dropped."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PDQ_REDIS_URL": self.url}
        if self.server is not None:
            for name in SECURITY_ENV:
                env.pop(name, None)
            env["PDQ_UP_SERVER"] = self.up_server   # the answers say whose server holds them
        return env

    @property
    def up_server(self) -> str:
        """``"<pid of up>:<pid of its server>"`` (``pdqueue.protocol.UP_FIELD``)."""
        return f"{os.getpid()}:{self.server.pid}" if self.server is not None else ""

    @property
    def redis(self) -> redis.Redis:
        assert self._r is not None, "start_server() first"
        return self._r

    def write_state(self, path: Path | None = None) -> Path:
        """The state file of this cluster (``pdqueue.discovery.state_path(cluster)``)."""
        state = {"url": redact_url(self.url), "cluster": self.config.cluster, "pid": os.getpid(),
                 "server_pid": self.server.pid if self.server else None, "model": self.config.model,
                 "started_ms": int(time.time() * 1000), "log_dir": str(self.log_dir),
                 "workers": [{"role": w.role, "worker_id": w.worker_id, "pid": w.proc.pid}
                             for w in self.workers], "gateway_url": self.gateway_url,
                 "gateway_pid": self.gateway.proc.pid if self.gateway is not None else None}
        password = url_credentials(self.url)[1]
        if password:  # (the file is 0600) how `submit`, `status` and Client() get in
            state["password"] = password
        self.state_file = write_state(state, path or state_path(self.config.cluster))
        return self.state_file

    def start_workers(self) -> None:
        c = self.config
        for role, count in ((Role.PREFILL.value, c.num_prefill), (Role.DECODE.value, c.num_decode)):
            for i in range(count):
                self.spawn(role, f"{role}-{i}-{self.run_id}")

    def spawn(self, role: str, worker_id: str) -> WorkerProcess:
        log_path = self.log_dir / f"{worker_id}.log"
        w = WorkerProcess(role, worker_id, self.start_worker_process(role, worker_id, log_path), log_path)
        self.workers.append(w)
        return w

    def start_worker_process(self, role: str, worker_id: str, log_path: Path) -> subprocess.Popen:
        c = self.config
        cmd = [sys.executable, "-m", "workers", "worker", role,   # the URL: in child_env
               "--cluster", c.cluster, "--model", c.model, "--kv-cache-mb", str(c.kv_cache_mb),
               "--worker-id", worker_id, "--log-level", c.log_level, *c.worker_args,
               *(c.prefill_args if role == Role.PREFILL else c.decode_args)]
        if c.switchable:
            cmd.append("--switchable")
        if c.kv_wire_format != "native":
            cmd += ["--kv-wire-format", c.kv_wire_format]
        weights = self.weights_of(role)
        if weights != "fp32":   # a worker keeps its weights across role switches
            cmd += ["--weights", weights]
        if c.threads:
            cmd += ["--threads", str(c.threads)]
        with open(log_path, "ab") as log:
            return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=self.child_env(), start_new_session=True, preexec_fn=die_with_parent)

    def weights_of(self, role: str) -> str:
        """The --weights of a worker started in ``role`` (a switch keeps them)."""
        return self.config.prefill_weights if role == Role.PREFILL else self.config.decode_weights

    def start_gateway(self, timeout_s: float = 30.0) -> str:
        """Bind the gateway's port (``config.gateway_port``; None: 8000 when free, else a free
        one) and start `pdqueue serve` for this cluster on that socket; returns its URL once
        it printed it (``RuntimeError`` if it exits first, or the port cannot be bound). `up`
        keeps the socket: every gateway process it starts (a restart, a rolling restart's
        replacement) serves the same one (``pdqueue.frontends.runtime``), so the port is never
        closed while `up` runs. The gateway is the first to get SIGTERM in ``stop`` and the
        last to exit."""
        port = self.config.gateway_port
        try:
            self.gateway_socket = bind("127.0.0.1", DEFAULT_GATEWAY_PORT if port is None else port)
        except OSError as exc:
            if port is not None:
                raise RuntimeError(f"cannot listen on 127.0.0.1:{port} ({exc.strerror})") from None
            self.gateway_socket = bind("127.0.0.1", 0)   # 8000 is taken: a free one
        self.gateway = WorkerProcess("gateway", "gateway", self.start_gateway_process(), self.log_dir / "gateway.log")
        deadline = time.monotonic() + timeout_s
        while True:
            url = self.gateway_printed_url()
            if url:
                self.gateway_url = url
                return self.gateway_url
            proc = self.gateway.proc
            if proc.poll() is not None or time.monotonic() > deadline:
                reason = (f"exited with status {proc.returncode}" if proc.poll() is not None
                          else f"printed no URL within {timeout_s:.0f}s")
                raise RuntimeError(f"the gateway (pdqueue serve) {reason}: {self.gateway.log_tail(3)}")
            time.sleep(0.05)

    def start_gateway_process(self) -> subprocess.Popen:
        """A `pdqueue serve` on `up`'s gateway socket (``--fd``); its stdout in gateway.out."""
        assert self.gateway_socket is not None, "start_gateway() first"
        fd = self.gateway_socket.fileno()
        cmd = [sys.executable, "-m", "workers", "serve", "--cluster",   # the URL: in child_env
               self.config.cluster, "--fd", str(fd), "--log-level", self.config.log_level]
        if self.config.gateway_tenants:
            cmd += ["--tenants", self.config.gateway_tenants]
        with open(self.log_dir / "gateway.out", "wb") as out, open(self.log_dir / "gateway.log", "ab") as log:
            return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=log, pass_fds=(fd,),
                                    env=self.child_env(), start_new_session=True, preexec_fn=die_with_parent)

    def gateway_printed_url(self) -> str | None:
        try:
            match = re.search(r"(http://\S+)/v1", (self.log_dir / "gateway.out").read_text(errors="replace"))
        except OSError:
            return None
        return match.group(1) if match else None

    def gateway_accepting(self, pid: int) -> bool:
        """Whether the gateway process ``pid`` (the last one started) said it accepts."""
        try:
            return f"accepting connections (pid {pid})" in (self.log_dir / "gateway.out").read_text(errors="replace")
        except OSError:
            return False

    def registered(self) -> set[str]:
        """Ids of our workers that have registered (their heartbeat hash exists)."""
        ours = {w.worker_id for w in self.workers}
        return {w["worker_id"] for w in list_workers(self.redis, self.keys)} & ours

    def exited(self) -> list[WorkerProcess]:
        return [w for w in self.workers if not w.alive]

    def wait_ready(self, timeout_s: float, progress: Callable[[int, int], None] | None = None,
                   cancel: threading.Event | None = None, failure_grace_s: float = 5.0) -> bool:
        """Block until every worker has registered (True), ``cancel`` is set (False), a
        worker exits (``WorkerFailed``) or ``timeout_s`` passes (``TimeoutError``).

        After a first worker exits, the others get up to ``failure_grace_s`` to register or
        exit too (a bad model fails them all, a little apart), so that ``WorkerFailed``
        names every worker that failed, not only the quickest. A worker that exits after it
        registered did start: it is not a start failure but a crash, which ``supervise``
        restarts once it runs."""
        deadline = time.monotonic() + timeout_s
        total = len(self.workers)
        ever: set[str] = set()   # registered at some point
        while True:
            ever |= self.registered()
            if any(w.worker_id not in ever for w in self.exited()):
                self._raise_failed(failure_grace_s, cancel)
            done = len(ever)
            if progress:
                progress(done, total)
            if done == total:
                return True
            if time.monotonic() > deadline:
                raise TimeoutError(f"{total - done} of {total} workers did not register within {timeout_s:.0f}s "
                                   f"(logs: {self.log_dir})")
            if cancel is not None and cancel.wait(0.1):
                return False
            if cancel is None:
                time.sleep(0.1)

    def _raise_failed(self, grace_s: float, cancel: threading.Event | None) -> None:
        until = time.monotonic() + grace_s
        while time.monotonic() < until and not (cancel is not None and cancel.is_set()):
            try:
                settled = len(self.registered() | {w.worker_id for w in self.exited()}) == len(self.workers)
            except redis.RedisError:
                settled = False
            if settled:
                break
            time.sleep(0.1)
        raise WorkerFailed(self.exited())

    def supervise(self, on_event: Callable[[dict], None] | None = None,
                  on_failure: Callable[[str], None] | None = None) -> None:
        """From now until ``stop``: start again every worker (and the gateway) that exits
        (``workers.cli.supervisor.restarts``), in a thread. ``on_event`` gets each event as
        it happens, from that thread; ``on_failure`` the reason when `up` should stop."""
        self.restarts.start(on_event, on_failure)

    def stop(self, grace_s: float = 60.0, hurry: threading.Event | None = None,
             progress: Progress | None = None, keep_logs: bool = False,
             waiting: Progress | None = None) -> dict:
        """Stop everything (``workers.cli.supervisor.stopping``); returns what happened:
        ``{"exit_codes": {worker_id: code}, "killed": [...], "segments_removed": [...],
        "died": {worker_id: [status, ...]}, "logs_kept": path or None}``."""
        return Stopping(self).stop(grace_s, hurry, progress, keep_logs, waiting)

    def processes(self) -> list[WorkerProcess]:
        return self.workers + ([self.gateway] if self.gateway is not None else [])

    def current_roles(self) -> dict[str, str]:
        """Each worker's role as its heartbeat says (it may have switched); {} when Redis
        cannot tell."""
        if self._r is None:
            return {}
        try:
            return {w["worker_id"]: w.get("role", "") for w in list_workers(self._r, self.keys)}
        except (redis.RedisError, OSError):
            return {}

    def forget_heartbeat(self, w: WorkerProcess) -> None:
        """A worker that exited cannot be alive: its heartbeat goes now, not at its TTL, so
        other workers of its role take over its entries at once (recovery: a consumer whose
        heartbeat is gone is dead) and views show it as gone."""
        try:
            key = self.keys.worker(w.worker_id)
            pid = self.redis.hget(key, "pid")
            if pid is not None and int(pid) == w.proc.pid:
                self.redis.delete(key)
        except (redis.RedisError, OSError, ValueError):
            pass

    def close_redis(self) -> None:
        if self._r is not None:
            self._r.close()


def quantizes_at_load(model: str, weights: str) -> bool:
    """Whether a worker loading ``model`` with ``weights`` will quantize them (SmolLM2 in
    int4 took 10 s in `up`, against 2.7 s in float32, on 2 busy cores) rather than read
    them from the quantized-weights cache (``pdqueue.models.quant_cache``): no cached copy
    of this model (its fingerprint) in this format made by this torch (the recipe version
    is not checked: it needs torch). Reads the cache's entry.json files; never imports
    torch. ``tiny`` is quantized at every load, in milliseconds: False."""
    import importlib.metadata
    import json

    from pdqueue.models import cache
    from pdqueue.models.source import ModelSourceError, resolve_model_path

    if weights == "fp32":
        return False
    try:
        path = resolve_model_path(model)
        if path is None:
            return False
        fingerprint = cache.directory_fingerprint(path) if path.is_dir() else cache.source_digest(path)
        torch_version = importlib.metadata.version("torch")
    except (ModelSourceError, OSError, importlib.metadata.PackageNotFoundError):
        return False
    for manifest in cache.models_dir().glob("quant-*/entry.json"):
        try:
            made = json.loads(manifest.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(made, dict) and (made.get("fingerprint"), made.get("weights"), made.get("torch")) \
                == (fingerprint, weights, torch_version):
            return False
    return True
