"""The process supervisor behind ``pdqueue up``: one Redis server and N prefill + M decode
worker processes on this machine, started together and stopped together.

Lifecycle: ``start_server`` (an embedded redis-server/valkey-server on loopback, port 6379
when it is free, else a free one, with a password (``redis_password``, else a random one);
in its own session, so a terminal's Ctrl-C does not reach it; unless a URL was given) ->
``start_workers`` (``python -m workers worker ROLE``, each in its own session and process
group, logs in ``log_dir``; the URL, password included, goes to them in ``PDQ_REDIS_URL``,
never on a command line, which ``ps`` shows) -> ``write_state`` (a 0600 file per cluster,
``pdqueue.discovery``, with the password, so ``submit``/``status`` in another terminal find
it) -> ``wait_ready`` (all registered by heartbeat) -> ``supervise`` (restarts, below) -> ...
-> ``stop``. ``start_gateway`` adds the OpenAI-compatible gateway (``pdqueue serve``, port
8000 when free): the first process ``stop`` signals and the last it waits for.

Restarts (``supervise``, a thread): a worker or the gateway that exits while `up` is not
stopping starts again under its worker id and in the role it ran (its heartbeat's, so
``--adapt``'s switches hold; its unacknowledged entries are in that role's streams, and
``own_pending`` gives them back), after ``RESTART_BACKOFF_S`` doubling to
``RESTART_BACKOFF_MAX_S``; after ``CRASH_LOOP_RESTARTS`` restarts within
``CRASH_LOOP_WINDOW_S`` it is given up on, and ``failure`` is set when that leaves a role (or
the gateway) with nobody. ``events`` records what happened (also in ``up.log``).

Who stops what, in ``stop``: no more restarts; SIGTERM to the gateway (it takes no new
requests; its open answers run on); then prefill workers get SIGTERM (warm: they finish the
prompts in hand and keep serving their exported KV until the decode side has copied it;
cold when no decode worker is left), then decode workers (warm: running requests finish).
A second ``hurry`` signal repeats SIGTERM (a worker's cold stop) and is forwarded to the
gateway (its second SIGTERM: its open answers fail); stragglers past the grace period get
SIGKILL on their process group. While they stop, ``still_running`` tells who is left and
what each holds (from its heartbeat). With an embedded server, whose queue dies with it,
the workers first answer everything it holds (``drain``: until nothing is left, a second
``hurry``, no running worker for what is left, or no progress for ``DRAIN_STALL_S``), and
what is still unanswered once they are stopped gets an ``error`` entry (code
``unavailable``) on its ``out:<id>`` (``fail_unanswered``), so no client is left waiting on a
server that is gone. Then the gateway's exit (its answers have ended; ``GATEWAY_EXIT_S``),
then the embedded server stops, KV segments of our workers that a killed worker left in
/dev/shm are unlinked, and the state file and a temporary log directory are removed (kept
when a process died, or on ``keep_logs``). Every child also gets PDEATHSIG, so a SIGKILLed
supervisor does not leave workers or the server behind.

Imports redis and pdqueue.queue/keys/protocol/discovery (never torch).
"""

from __future__ import annotations

import glob
import math
import os
import re
import secrets
import shutil
import signal
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
from pdqueue.engine.config import DEFAULT_KV_CACHE_MB
from pdqueue.discovery import read_state, remove_state, running_clusters, state_path, write_state
from pdqueue.keys import DECODE_GROUP, PREFILL_GROUP, Keys
from pdqueue.procs import die_with_parent
from pdqueue.protocol import ErrorCode, entry_request_id, error_entry
from pdqueue.queue.connection import connect
from pdqueue.queue.redis_server import RedisServer, port_is_free
from pdqueue.queue.registry import list_workers
from pdqueue.queue.streams import request_streams_of

# pdqueue.transfer.shm's DEFAULT_PREFIX and node's DEFAULT_SHM_DIR, not imported: importing
# pdqueue.transfer imports torch, which `up` and `status` do without.
SEGMENT_PREFIX = "pdq-kv"
SHM_DIR = "/dev/shm"
# Prefill first (it keeps serving exported KV until the decode side has copied it), decode
# last (it finishes what prefill handed off). With ``--adapt`` roles change: the current
# role is read from each worker's heartbeat.
ROLES_IN_STOP_ORDER = ("prefill", "colocated", "decode")

DEFAULT_REDIS_PORT = 6379  # the embedded server's port when it is free: README's examples work
DEFAULT_GATEWAY_PORT = 8000  # the gateway's port when it is free (README's examples)
STOP_REPORT_INTERVAL_S = 2.0
# Stopping with an embedded server, whose queue dies with it: the workers first answer what
# it holds, until nothing is left or nothing progressed for DRAIN_STALL_S; what is left
# then gets an error entry (ErrorCode.UNAVAILABLE) that its client reads within
# UNANSWERED_READ_S, before the server goes.
DRAIN_STALL_S = 30.0
UNANSWERED_READ_S = 1.0
UNANSWERED_TTL_MS = 60_000
# The gateway is the last door to close: its first SIGTERM makes it take no new requests and
# let its open answers run to their end; once the workers are stopped and every unanswered
# request has its error entry, those answers have ended, so it should exit at once. After
# GATEWAY_EXIT_S more it gets its second SIGTERM (its open answers fail), and SIGKILL 5 s later.
GATEWAY_EXIT_S = 10.0

# Restarts (``supervise``), like compose's ``restart: on-failure`` for every process: one that
# exits while `up` is not stopping starts again under the same worker id (so it takes back
# the entries it held, ``workers/recovery.py`` ``own_pending``), after RESTART_BACKOFF_S,
# doubling per restart up to RESTART_BACKOFF_MAX_S; a process that ran HEALTHY_RUN_S starts
# the doubling over. One that exits again after CRASH_LOOP_RESTARTS restarts within
# CRASH_LOOP_WINDOW_S is in a crash loop: `up` gives up on it.
RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0
HEALTHY_RUN_S = 60.0
CRASH_LOOP_RESTARTS = 5
CRASH_LOOP_WINDOW_S = 60.0
SUPERVISE_EVERY_S = 0.2
ROLES_EVERY_S = 1.0   # how often the supervisor notes each worker's current role (``--adapt``)

Progress = Callable[[str], None]

__all__ = ["LocalCluster", "LocalClusterConfig", "WorkerFailed", "WorkerProcess", "read_state",
           "remove_state", "running_clusters", "state_path", "write_state"]


# ---- the supervisor ----------------------------------------------------------------------

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
    prefill_weights: str = "fp32"     # --weights of the prefill workers (pdqueue.models.quant)
    decode_weights: str = "fp32"      # --weights of the decode (and colocated) workers


class WorkerFailed(RuntimeError):
    """Workers exited before all were ready. ``failed`` lists every one that did;
    ``worker_id``, ``returncode`` and ``log_tail`` are the first one's."""

    def __init__(self, failed: list["WorkerProcess"]):
        first = failed[0]
        if len(failed) == 1:
            message = f"worker {first.worker_id} exited with status {first.proc.returncode} before it was ready"
        else:
            message = (f"{len(failed)} workers exited before they were ready: "
                       + ", ".join(f"{w.worker_id} (status {w.proc.returncode})" for w in failed))
        super().__init__(message)
        self.failed = list(failed)
        self.worker_id = first.worker_id
        self.returncode = first.proc.returncode
        self.log_tail = first.log_tail()


@dataclass(slots=True)
class WorkerProcess:
    role: str             # the role it runs: the one it started in, or (``--adapt``) its heartbeat's
    worker_id: str
    proc: subprocess.Popen
    log_path: Path
    started: float = field(default_factory=time.monotonic)   # when this process started (monotonic)
    # What the supervisor (``LocalCluster.supervise``) keeps:
    restarts: int = 0                 # how many times it was started again
    restart_times: list[float] = field(default_factory=list)  # when (monotonic): the crash-loop window
    backoff: int = 0                  # doublings of the next restart's delay
    restart_at: float | None = None   # dead, to be started again at this time (monotonic)
    gave_up: bool = False             # a crash loop: dead, and not started again
    exits: list[tuple[int | None, float]] = field(default_factory=list)  # (status, seconds run) of each unexpected exit
    back: bool = True                 # this process was seen serving (registered; the gateway: its URL)
    handled_pid: int | None = None    # the process whose exit the supervisor has handled

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def died(self) -> bool:
        """It exited on its own (not stopped by `up`) at least once."""
        return bool(self.exits)

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # its own process group (own session)
        except ProcessLookupError:
            pass

    def log_tail(self, num_lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return ""

    def state(self, now: float | None = None) -> str:
        """What the live view shows for a process that is not running."""
        now = time.monotonic() if now is None else now
        code = self.proc.returncode
        if self.gave_up:
            return f"exited ({code}); crash loop, not restarted"
        if self.restart_at is not None:
            return f"exited ({code}); restart {self.restarts + 1} in {math.ceil(max(0.0, self.restart_at - now))}s"
        return f"exited ({code})"


class LocalCluster:
    """Owns the server (if embedded), the worker processes, their logs and the state file."""

    def __init__(self, config: LocalClusterConfig):
        self.config = config
        self.keys = Keys(config.cluster)
        self.server: RedisServer | None = None
        self.url = config.redis_url
        self.workers: list[WorkerProcess] = []
        self.state_file: Path | None = None
        self._own_log_dir = config.log_dir is None
        self.log_dir = Path(config.log_dir) if config.log_dir else Path(tempfile.mkdtemp(prefix="pdq-up-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._r: redis.Redis | None = None
        self.run_id = secrets.token_hex(2)
        self.gateway: WorkerProcess | None = None   # `pdqueue serve` (``start_gateway``)
        self.gateway_url: str | None = None         # its base URL, e.g. http://127.0.0.1:8000
        self.port_note = ""  # why the embedded server has its port, for `up`'s first line
        self.password = config.redis_password or secrets.token_hex(24)  # the embedded server's
        # The supervisor (``supervise``): its thread, what it reports, why it gave up.
        self._stopping = threading.Event()
        self._stopped = threading.Event()         # every process is stopped: the supervisor thread may end
        self._supervising = threading.Lock()      # held for each round of the supervisor
        self._supervisor: threading.Thread | None = None
        self._on_event: Callable[[dict], None] | None = None
        self._on_failure: Callable[[str], None] | None = None
        self._next_roles = 0.0
        self._events_lock = threading.Lock()
        self.events: list[dict] = []      # {"time": epoch s, "level", "text", "worker_id", "tail"}
        self.failure: str | None = None   # set when a crash loop left a role (or the gateway) with nobody

    # ---- start ---------------------------------------------------------------------------
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
        return env

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
        for role, count in (("prefill", c.num_prefill), ("decode", c.num_decode)):
            for i in range(count):
                self._spawn(role, f"{role}-{i}-{self.run_id}")

    def _spawn(self, role: str, worker_id: str) -> WorkerProcess:
        log_path = self.log_dir / f"{worker_id}.log"
        w = WorkerProcess(role, worker_id, self._start_worker(role, worker_id, log_path), log_path)
        self.workers.append(w)
        return w

    def _start_worker(self, role: str, worker_id: str, log_path: Path) -> subprocess.Popen:
        c = self.config
        cmd = [sys.executable, "-m", "workers", "worker", role,   # the URL: in child_env
               "--cluster", c.cluster, "--model", c.model, "--kv-cache-mb", str(c.kv_cache_mb),
               "--worker-id", worker_id, "--log-level", c.log_level, *c.worker_args]
        if c.switchable:
            cmd.append("--switchable")
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
        return self.config.prefill_weights if role == "prefill" else self.config.decode_weights

    def start_gateway(self, timeout_s: float = 30.0) -> str:
        """Start `pdqueue serve` for this cluster on ``config.gateway_port`` (None: 8000 when
        free, else a free one); returns its URL once it printed it (``RuntimeError`` if it
        exits first). It is the first to get SIGTERM in ``stop`` and the last to exit."""
        ports = [self.config.gateway_port]
        if ports[0] is None:  # 8000 may be taken between the check and the bind: then any port
            ports = [DEFAULT_GATEWAY_PORT, 0] if port_is_free(DEFAULT_GATEWAY_PORT) else [0]
        for attempt, port in enumerate(ports):
            log_path = self.log_dir / "gateway.log"
            self.gateway = WorkerProcess("gateway", "gateway", self._start_gateway_process(port), log_path)
            deadline = time.monotonic() + timeout_s
            while True:
                url = self._gateway_printed_url()
                if url:
                    self.gateway_url = url
                    return self.gateway_url
                proc = self.gateway.proc
                if proc.poll() is not None and attempt + 1 < len(ports):
                    break  # (the port was taken meanwhile) the next one
                if proc.poll() is not None or time.monotonic() > deadline:
                    reason = (f"exited with status {proc.returncode}" if proc.poll() is not None
                              else f"printed no URL within {timeout_s:.0f}s")
                    raise RuntimeError(f"the gateway (pdqueue serve) {reason}: {self.gateway.log_tail(3)}")
                time.sleep(0.05)
        raise AssertionError("unreachable")

    def _start_gateway_process(self, port: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "workers", "serve", "--cluster",   # the URL: in child_env
               self.config.cluster, "--port", str(port), "--log-level", self.config.log_level]
        with open(self.log_dir / "gateway.out", "wb") as out, open(self.log_dir / "gateway.log", "ab") as log:
            return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=log,
                                    env=self.child_env(), start_new_session=True, preexec_fn=die_with_parent)

    def _gateway_printed_url(self) -> str | None:
        try:
            match = re.search(r"(http://\S+)/v1", (self.log_dir / "gateway.out").read_text(errors="replace"))
        except OSError:
            return None
        return match.group(1) if match else None

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

    # ---- supervision: restarts -----------------------------------------------------------
    def supervise(self, on_event: Callable[[dict], None] | None = None,
                  on_failure: Callable[[str], None] | None = None) -> None:
        """From now until ``stop``: start again every worker (and the gateway) that exits,
        under its worker id and in the role it ran (see ``RESTART_BACKOFF_S``), in a thread.
        ``on_event`` gets each event (``events``: exits, restarts, returns, a crash loop) as
        it happens, from that thread; ``on_failure`` the reason when `up` should stop: a
        crash loop left no worker to take a role's work, or no gateway (``failure``)."""
        self._on_event, self._on_failure = on_event, on_failure
        self._supervisor = threading.Thread(target=self._supervise, name="pdq-supervisor", daemon=True)
        self._supervisor.start()

    def _supervise(self) -> None:
        while not self._stopping.wait(SUPERVISE_EVERY_S):
            with self._supervising:
                if self._stopping.is_set():
                    break
                try:
                    self.supervise_once()
                except Exception as exc:  # noqa: BLE001 (the supervisor must go on)
                    self._event(f"supervisor error: {type(exc).__name__}: {exc}", "error")
        # The processes this thread started get PDEATHSIG when it ends (the signal follows
        # the thread that forked, not the process): it lives until ``stop`` has stopped them.
        self._stopped.wait()

    def _processes(self) -> list[WorkerProcess]:
        return self.workers + ([self.gateway] if self.gateway is not None else [])

    def supervise_once(self, now: float | None = None) -> None:
        """One round: note each worker's current role and whether restarted ones are back;
        handle new exits (a restart due later, or a crash loop); start the restarts due."""
        now = time.monotonic() if now is None else now
        if now >= self._next_roles:
            self._next_roles = now + ROLES_EVERY_S
            self._note_heartbeats()
        if self.gateway is not None and not self.gateway.back and self.gateway.alive \
                and self._gateway_printed_url():
            self._came_back(self.gateway)
        for w in self._processes():
            if self._stopping.is_set():
                return
            if w.alive or w.gave_up:
                continue
            if w.handled_pid != w.proc.pid:
                self._exited(w, now)
            elif w.restart_at is not None and now >= w.restart_at:
                self._restart(w, now)

    def _note_heartbeats(self) -> None:
        try:
            beats = {b["worker_id"]: b for b in list_workers(self.redis, self.keys)}
        except (redis.RedisError, OSError):
            return
        switched = False
        for w in self.workers:
            beat = beats.get(w.worker_id)
            if beat is None or not w.alive or beat.get("pid") != w.proc.pid:
                continue  # (an earlier process's heartbeat is removed when it exits)
            if beat.get("role") in ROLES_IN_STOP_ORDER and beat["role"] != w.role:
                w.role, switched = beat["role"], True   # --adapt: a restart comes back in the role it ran
            if not w.back:
                self._came_back(w)
        if switched and self.state_file is not None:
            try:
                self.write_state(self.state_file)   # the roles it lists are the current ones
            except OSError:
                pass

    def _came_back(self, w: WorkerProcess) -> None:
        w.back = True
        self._event(f"{w.worker_id} is back (restart {w.restarts}, pid {w.proc.pid}"
                    f"{'' if w is self.gateway else ', ' + w.role}; serving {_secs(time.monotonic() - w.started)} "
                    f"after its start)", "info", w)

    def _exited(self, w: WorkerProcess, now: float) -> None:
        w.handled_pid = w.proc.pid
        code, ran = w.proc.returncode, now - w.started
        w.exits.append((code, ran))
        if w is not self.gateway:
            self._forget_heartbeat(w)
        if ran >= HEALTHY_RUN_S:
            w.backoff = 0
        recent = [t for t in w.restart_times if now - t < CRASH_LOOP_WINDOW_S]
        what = f"{w.worker_id} exited ({code}) after {_secs(ran)}"
        if len(recent) >= CRASH_LOOP_RESTARTS:
            w.gave_up = True
            self._event(f"{what}: a crash loop ({len(recent)} restarts within {CRASH_LOOP_WINDOW_S:g} s), "
                        f"not restarted again; its log: {w.log_path}", "error", w, tail=w.log_tail())
            why = self.cannot_serve()
            if why:
                self.failure = (f"{w.worker_id} is in a crash loop ({len(recent)} restarts within "
                                f"{CRASH_LOOP_WINDOW_S:g} s) and {why}: stopping (its log: {w.log_path})")
                if self._on_failure is not None:
                    self._on_failure(self.failure)
            else:
                self._event(f"up goes on without {w.worker_id}: {self.serving()} left", "warning", w)
            return
        delay = min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2 ** w.backoff)
        w.backoff += 1
        w.restart_at = now + delay
        self._event(f"{what}; restarting in {delay:g} s (restart {w.restarts + 1})", "warning", w)

    def _restart(self, w: WorkerProcess, now: float) -> None:
        w.restart_at = None
        try:
            with open(w.log_path, "ab") as log:
                log.write(f"\n---- pdqueue up: restart {w.restarts + 1} of {w.worker_id} "
                          f"({time.strftime('%H:%M:%S')}; the last process exited with status "
                          f"{w.proc.returncode}) ----\n".encode())
            if w is self.gateway:
                port = int(self.gateway_url.rsplit(":", 1)[1]) if self.gateway_url else 0
                proc = self._start_gateway_process(port)   # the URL `up` printed stays right
            else:
                proc = self._start_worker(w.role, w.worker_id, w.log_path)
        except OSError as exc:
            w.gave_up = True
            self._event(f"{w.worker_id} could not be started again: {exc}", "error", w)
            return
        w.proc, w.started, w.back = proc, time.monotonic(), False
        w.restarts += 1
        w.restart_times.append(now)
        self._event(f"{w.worker_id} restarted (restart {w.restarts}, pid {proc.pid}"
                    f"{'' if w is self.gateway else ', as ' + w.role})", "info", w)
        if self.state_file is not None:
            try:
                self.write_state(self.state_file)   # its new pid
            except OSError:
                pass

    def _forget_heartbeat(self, w: WorkerProcess) -> None:
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

    def cannot_serve(self) -> str | None:
        """Why the workers not given up on cannot answer every request (None: they can)."""
        if self.gateway is not None and self.gateway.gave_up:
            return "there is no gateway left"
        roles = {w.role for w in self.workers if not w.gave_up}
        if "colocated" in roles or {"prefill", "decode"} <= roles:
            return None
        missing = [r for r in ("prefill", "decode") if r not in roles]
        return f"no {' or '.join(missing)} worker is left"

    def serving(self) -> str:
        counts: dict[str, int] = {}
        for w in self.workers:
            if not w.gave_up:
                counts[w.role] = counts.get(w.role, 0) + 1
        return " + ".join(f"{n} {role}" for role, n in counts.items()) + \
            (" workers" if sum(counts.values()) > 1 else " worker")

    def _event(self, text: str, level: str, w: WorkerProcess | None = None, tail: str = "") -> None:
        event = {"time": time.time(), "level": level, "text": text,
                 "worker_id": w.worker_id if w is not None else "", "tail": tail}
        with self._events_lock:
            self.events.append(event)
            try:
                with open(self.log_dir / "up.log", "a") as log:
                    log.write(f"{time.strftime('%H:%M:%S')} {level}: {text}\n")
                    if tail:
                        log.write("".join(f"    {line}\n" for line in tail.splitlines()))
            except OSError:
                pass
        if self._on_event is not None:
            self._on_event(event)

    # ---- stop ----------------------------------------------------------------------------
    def current_roles(self) -> dict[str, str]:
        """Each worker's role as its heartbeat says (it may have switched); {} when Redis
        cannot tell."""
        if self._r is None:
            return {}
        try:
            return {w["worker_id"]: w.get("role", "") for w in list_workers(self._r, self.keys)}
        except (redis.RedisError, OSError):
            return {}

    def stop(self, grace_s: float = 60.0, hurry: threading.Event | None = None,
             progress: Progress | None = None, keep_logs: bool = False,
             waiting: Progress | None = None) -> dict:
        """Stop everything (see the module docstring); returns what happened:
        ``{"exit_codes": {worker_id: code}, "killed": [...], "segments_removed": [...],
        "died": {worker_id: [status, ...]}, "logs_kept": path or None}``. A temporary log
        directory is removed unless ``keep_logs`` or a process died on its own (``died``:
        its log is what tells why); a kept one gets the embedded server's log too, as
        ``redis-server.log``. ``progress`` gets a line per step; ``waiting`` gets, every
        ``STOP_REPORT_INTERVAL_S`` while workers are still stopping, which ones and what
        they hold (``still_running``).

        Order: no more restarts; SIGTERM to the gateway (it takes no new requests, its open
        answers run on); the drain; the workers by role; an error for each request left
        (embedded server); the gateway's exit (its answers have ended); the server. A
        ``hurry`` (second Ctrl-C) at any point is forwarded to the gateway as its second
        SIGTERM (its open answers fail at once) and stops the workers cold."""
        say = progress or (lambda msg: None)
        hurry = hurry or threading.Event()
        self._stopping.set()
        with self._supervising:   # a round in progress ends; no restart after this
            pass
        for w in self._processes():   # what exited since the supervisor last looked, or unsupervised
            if not w.alive:
                self._note_exit(w)
            if w.restart_at is not None:
                w.restart_at = None
                say(f"{w.worker_id} is not restarted: up is stopping")
        signalled: set[int] = set()   # the processes `up` stopped (the others, dead, died on their own)
        deadline = time.monotonic() + grace_s
        killed: list[str] = []
        gateway = self.gateway if self.gateway is not None and self.gateway.alive else None
        forwarded = threading.Event()
        if gateway is not None:   # first: no new requests; last to exit (its answers end with the workers')
            say("the gateway takes no new requests; its open answers run to their end")
            signalled.add(gateway.proc.pid)
            gateway.signal(signal.SIGTERM)
            threading.Thread(target=self._forward_hurry, args=(gateway, hurry, forwarded, say),
                             name="pdq-gateway-hurry", daemon=True).start()
        try:
            if self.server is not None and not hurry.is_set():
                # The queue dies with the embedded server: answer what it holds first.
                self.drain(hurry, say, waiting)
                deadline = time.monotonic() + grace_s
            roles = self.current_roles()
            for role in ROLES_IN_STOP_ORDER:
                group = [w for w in self.workers if roles.get(w.worker_id, w.role) == role and w.alive]
                if not group:
                    continue
                cold = hurry.is_set()  # already in a hurry: the second SIGTERM follows at once
                how = "cold: at once" if cold else "warm: work in hand finishes"
                if not cold and role == "prefill" and self.server is not None and not self._alive_in("decode", roles):
                    cold, how = True, "cold: no decode worker is left to take its KV"
                say(f"stopping {len(group)} {role} worker{'s' if len(group) > 1 else ''} ({how})")
                for w in group:
                    signalled.add(w.proc.pid)
                    w.signal(signal.SIGTERM)
                killed += self._wait(group, deadline, hurry, say, waiting, cold=cold)
            for w in self.workers:  # any not covered above (another role)
                if w.alive:
                    signalled.add(w.proc.pid)
                    w.signal(signal.SIGKILL)
                    w.proc.wait()
                    killed.append(w.worker_id)
            if self.server is not None:
                failed = self.fail_unanswered()
                if failed:
                    say(f"{_count(failed, 'request', 'requests')} not answered: their clients got an error "
                        f"(code {ErrorCode.UNAVAILABLE.value}: the local cluster stopped)")
                    time.sleep(UNANSWERED_READ_S)   # clients blocked on out:<id> read it before the server goes
            if gateway is not None:
                killed += self._wait_gateway(gateway, hurry, forwarded, say)
        finally:
            forwarded.set()   # (ends the forwarding thread)
        self._stopped.set()   # (the supervisor thread ends: the processes it started are stopped)
        for w in self._processes():
            if w.proc.pid not in signalled:   # it exited before `up` came to stop it
                self._note_exit(w)
        died = {w.worker_id: [code for code, _ in w.exits] for w in self._processes() if w.died}
        keep = keep_logs or bool(died)
        if self.server is not None:
            say("stopping the Redis server")
            if keep and self.server.log_path is not None:
                try:
                    shutil.copyfile(self.server.log_path, self.log_dir / "redis-server.log")
                except OSError:
                    pass
            self.server.stop()
        if self._r is not None:
            self._r.close()
        removed = self.remove_segments()
        if self.state_file is not None:
            remove_state(self.state_file)
        if self._own_log_dir and not keep:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        exit_codes = {w.worker_id: w.proc.returncode for w in self.workers}
        if self.gateway is not None:
            exit_codes["gateway"] = self.gateway.proc.returncode
        return {"exit_codes": exit_codes, "killed": killed, "segments_removed": removed, "died": died,
                "logs_kept": str(self.log_dir) if keep or not self._own_log_dir else None}

    def _note_exit(self, w: WorkerProcess) -> None:
        """Record an exit the supervisor has not seen (it died as `up` began to stop)."""
        if w.proc.poll() is not None and w.handled_pid != w.proc.pid and not w.gave_up:
            w.handled_pid = w.proc.pid
            w.exits.append((w.proc.returncode, time.monotonic() - w.started))
            if w is not self.gateway:
                self._forget_heartbeat(w)

    def _alive_in(self, role: str, roles: dict[str, str]) -> bool:
        return any(w.alive and roles.get(w.worker_id, w.role) == role for w in self.workers)

    def _forward_hurry(self, gateway: WorkerProcess, hurry: threading.Event, done: threading.Event,
                       say: Progress) -> None:
        """The user's second Ctrl-C is the gateway's second SIGTERM: its open answers end
        at once with an error. Repeated every 0.5 s while it runs (two signals close
        together may reach it as one)."""
        while not done.is_set():
            if hurry.wait(0.1):
                break
        if done.is_set() or not gateway.alive:
            return
        say("the gateway fails its open answers and exits (second SIGTERM)")
        while gateway.alive and not done.wait(0.5):
            gateway.signal(signal.SIGTERM)
        if gateway.alive:
            gateway.signal(signal.SIGTERM)

    def _wait_gateway(self, gateway: WorkerProcess, hurry: threading.Event, forwarded: threading.Event,
                      say: Progress) -> list[str]:
        """After the workers: the gateway's open answers have ended (answered, or an error
        entry each), so it exits; after GATEWAY_EXIT_S its second SIGTERM, after 5 s more
        SIGKILL."""
        deadline = time.monotonic() + GATEWAY_EXIT_S
        if gateway.alive:
            say("waiting for the gateway's open answers to end")
        while gateway.alive and time.monotonic() < deadline and not hurry.is_set():
            time.sleep(0.05)
        if gateway.alive and not hurry.is_set():
            say(f"the gateway still has open answers after {GATEWAY_EXIT_S:g} s: its second SIGTERM "
                f"(they end with an error)")
            forwarded.set()   # the forwarding thread stops; this one signals
            gateway.signal(signal.SIGTERM)
        killed = self._wait([gateway], time.monotonic() + 5.0, hurry if hurry.is_set() else threading.Event(),
                            say, cold=True)
        if not gateway.alive and not killed:
            say(f"the gateway stopped (status {gateway.proc.returncode})")
        return killed

    def _wait(self, group: list[WorkerProcess], deadline: float, hurry: threading.Event,
              say: Progress, waiting: Progress | None = None, cold: bool = False) -> list[str]:
        """Wait for ``group`` to exit; on ``hurry`` (or from the start when ``cold``)
        signal again (the cold stop) and allow 5 s more; SIGKILL whoever is left at the
        deadline. Returns the ids killed."""
        hurried = False
        next_report = time.monotonic() + STOP_REPORT_INTERVAL_S
        next_signal = 0.0
        while any(w.alive for w in group) and time.monotonic() < deadline:
            if waiting is not None and time.monotonic() >= next_report:
                next_report = time.monotonic() + STOP_REPORT_INTERVAL_S
                waiting(f"waiting for {self.still_running([w for w in group if w.alive])}")
            if cold or hurry.is_set():
                if not hurried:
                    hurried = True
                    if not cold:
                        say("stopping now (cold)")
                    deadline = min(deadline, time.monotonic() + 5.0)
                # The second SIGTERM is the cold stop; repeated, because two signals sent
                # back to back may reach the process as one (they do not queue).
                if time.monotonic() >= next_signal:
                    next_signal = time.monotonic() + 0.5
                    for w in group:
                        if w.alive:
                            w.signal(signal.SIGTERM)
            time.sleep(0.05)
        killed = []
        for w in group:
            if w.alive:
                say(f"{w.worker_id} did not stop in time: SIGKILL")
                w.signal(signal.SIGKILL)
                w.proc.wait()
                killed.append(w.worker_id)
        return killed

    # -- what the embedded server holds when `up` stops ------------------------------------
    def _work_streams(self) -> list[tuple[str, str]]:
        """(stream, group) of every stream holding requests or handoffs of this cluster. An
        answered entry is deleted (acknowledged and XDELed), so what a stream holds is what is
        still to be answered: waiting to be read, or in a worker's hands."""
        streams = [(s, PREFILL_GROUP) for s in request_streams_of(self.redis, self.keys)]
        handoffs = {k.decode() if isinstance(k, bytes) else k
                    for k in self.redis.scan_iter(match=self.keys.handoff_node("*"), count=200)}
        return streams + [(s, DECODE_GROUP) for s in sorted({self.keys.handoff, *handoffs})]

    def backlog(self) -> tuple[int, int]:
        """(requests waiting to be read, requests in a worker's hands) in this cluster's
        streams; a request counts once where it is (its prompt, then its handoff)."""
        by_group = self.backlog_by_group()
        return sum(w for w, _ in by_group.values()), sum(h for _, h in by_group.values())

    def backlog_by_group(self) -> dict[str, tuple[int, int]]:
        """``backlog`` per consumer group: ``prefill`` (the request streams) and ``decode``
        (the handoff streams)."""
        streams = self._work_streams()
        with self.redis.pipeline(transaction=False) as pipe:
            for stream, group in streams:
                pipe.xlen(stream)
                pipe.xpending(stream, group)
            replies = pipe.execute(raise_on_error=False)
        out = {PREFILL_GROUP: (0, 0), DECODE_GROUP: (0, 0)}
        for (_, group), length, pending in zip(streams, replies[::2], replies[1::2]):
            length = length if isinstance(length, int) else 0
            in_hand = int(pending.get("pending") or 0) if isinstance(pending, dict) else 0
            waiting, held = out[group]
            out[group] = (waiting + max(0, length - in_hand), held + in_hand)
        return out

    def _nobody_for(self, by_group: dict[str, tuple[int, int]]) -> str | None:
        """Work left in a group that no running worker reads (its workers died): e.g. ``2
        requests for a decode worker, and none is running``; None if every group with work
        has a reader."""
        roles = self.current_roles()
        running = {roles.get(w.worker_id, w.role) for w in self.workers if w.alive}
        readers = {PREFILL_GROUP: ("prefill", "colocated"), DECODE_GROUP: ("decode",)}
        for group, (waiting, held) in by_group.items():
            if waiting + held and not running & set(readers[group]):
                return (f"{_count(waiting + held, 'request', 'requests')} for a {group} worker, "
                        f"and none is running")
        return None

    def drain(self, hurry: threading.Event, say: Progress, waiting: Progress | None = None,
              stall_s: float = DRAIN_STALL_S) -> bool:
        """Let the workers answer everything the embedded server holds before they are
        stopped: the queue dies with the server. Ends when nothing is left (True), on
        ``hurry`` (a second Ctrl-C), when no running worker reads what is left (its role's
        workers died: a dead worker does not hold the stop up), or after ``stall_s``
        without progress (neither the backlog nor any worker's KV use changed: a worker
        stuck)."""
        try:
            queued, held = self.backlog()
        except redis.RedisError:
            return False
        if not queued + held:
            return True
        say(f"answering what is left first: {queued} queued, {held} in hand (Ctrl-C again: stop now, "
            f"what is not answered then gets an error)")
        last, since = None, time.monotonic()
        next_report = time.monotonic() + STOP_REPORT_INTERVAL_S
        while not hurry.is_set():
            if not any(w.alive for w in self.workers):
                say("no worker is running: the rest cannot be answered")
                return False
            try:
                by_group = self.backlog_by_group()
                queued = sum(w for w, _ in by_group.values())
                held = sum(h for _, h in by_group.values())
                progress = (queued, held, self._work_signature())
                nobody = self._nobody_for(by_group)
            except redis.RedisError:
                return False
            left = queued + held
            if not left:
                say("everything queued was answered")
                return True
            if nobody:
                say(f"{nobody}: stopping with {left} left")
                return False
            if progress != last:
                last, since = progress, time.monotonic()
            elif time.monotonic() - since > stall_s:
                say(f"no progress for {stall_s:g} s: stopping with {left} left")
                return False
            if waiting is not None and time.monotonic() >= next_report:
                next_report = time.monotonic() + STOP_REPORT_INTERVAL_S
                waiting(f"answering what is left: {queued} queued, {held} in hand (Ctrl-C again: stop now)")
            hurry.wait(0.2)
        return False

    def _work_signature(self) -> tuple:
        """What changes while the workers make progress on long requests that do not finish
        yet: each one's free KV blocks (a decode sequence takes a block every 16 tokens) and
        running count, from the heartbeats."""
        return tuple(sorted((w.get("worker_id", ""), (w.get("load") or {}).get("kv_free"),
                             (w.get("load") or {}).get("running")) for w in list_workers(self.redis, self.keys)))

    def fail_unanswered(self, reason: str = "the local cluster (pdqueue up) stopped before answering") -> int:
        """Once the workers are gone, before the embedded server is: an ``error`` entry on
        ``out:<id>`` of every request still in the streams, so that its client learns at
        once (``RequestFailed``, code ``unavailable``) instead of losing its Redis. Returns
        how many."""
        try:
            ids: set[str] = set()
            for stream, _ in self._work_streams():
                for entry_id, fields in self.redis.xrange(stream):
                    rid = entry_request_id(entry_id, fields)
                    if rid:
                        ids.add(rid)
            with self.redis.pipeline(transaction=False) as pipe:
                for rid in sorted(ids):
                    pipe.xadd(self.keys.out(rid), error_entry(reason, ErrorCode.UNAVAILABLE))
                    pipe.pexpire(self.keys.out(rid), UNANSWERED_TTL_MS)
                pipe.execute()
        except redis.RedisError:
            return 0
        return len(ids)

    def still_running(self, group: list[WorkerProcess] | None = None) -> str:
        """``decode-0-ab12 (3 requests in hand), prefill-0-ab12 (1 KV lease)``: the workers
        of ``group`` (default: all alive) and what they hold: the entries each has taken and
        not yet acknowledged (XPENDING: exact, now) and its KV leases (from its last
        heartbeat, up to a third of the heartbeat TTL old). Without Redis: the ids."""
        group = [w for w in self.workers if w.alive] if group is None else group
        try:
            registered = {w["worker_id"]: w for w in list_workers(self.redis, self.keys)}
            in_hand = self._pending_by_consumer()
        except (redis.RedisError, AssertionError):
            registered, in_hand = {}, {}
        parts = []
        for w in group:
            leases = (registered.get(w.worker_id, {}).get("load") or {}).get("leases")
            held = [_count(in_hand.get(w.worker_id, 0), "request in hand", "requests in hand"),
                    _count(leases if isinstance(leases, int) else 0, "KV lease", "KV leases")]
            held = [h for h in held if h]
            parts.append(w.worker_id + (f" ({', '.join(held)})" if held else ""))
        return ", ".join(parts)

    def _pending_by_consumer(self) -> dict[str, int]:
        """Entries taken and not yet acknowledged, by consumer (worker id), in the request
        streams (prefill group) and the handoff streams (decode group)."""
        with self.redis.pipeline(transaction=False) as pipe:
            for stream, group in self._work_streams():
                pipe.xpending(stream, group)
            replies = pipe.execute(raise_on_error=False)
        counts: dict[str, int] = {}
        for reply in replies:
            if isinstance(reply, dict):  # else: no such stream or group yet
                for consumer in reply.get("consumers") or []:
                    name = consumer["name"]
                    name = name.decode() if isinstance(name, bytes) else name
                    counts[name] = counts.get(name, 0) + int(consumer["pending"])
        return counts

    def segments(self) -> list[str]:
        """KV segments in /dev/shm that belong to our workers."""
        return [p for w in self.workers
                for p in glob.glob(os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}-{w.worker_id}-*"))]

    def remove_segments(self) -> list[str]:
        """Unlink segments of our (now stopped) workers: a killed prefill worker leaves its own."""
        removed = []
        for path in self.segments():
            try:
                os.unlink(path)
                removed.append(os.path.basename(path))
            except FileNotFoundError:
                pass
        return removed


def _count(n: int, one: str, many: str) -> str:
    return "" if n <= 0 else f"{n} {one if n == 1 else many}"


def _secs(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"


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
