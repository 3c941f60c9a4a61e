"""The process supervisor behind ``pdqueue up``: one Redis server and N prefill + M decode
worker processes on this machine, started together and stopped together.

Lifecycle: ``start_server`` (an embedded redis-server/valkey-server on a private loopback
port, unless a URL was given) -> ``write_state`` (so ``submit``/``status`` in another
terminal find the cluster) -> ``start_workers`` (``python -m workers.cli worker ROLE``,
each in its own session and process group, logs in ``log_dir``) -> ``wait_ready`` (all
registered by heartbeat) -> ... -> ``stop``.

Who stops what, in ``stop``: prefill workers get SIGTERM first (warm: they finish the
prompts in hand and keep serving their exported KV until the decode side has copied it),
then decode workers (warm: running requests finish). A second ``hurry`` signal repeats
SIGTERM (a worker's cold stop); stragglers past the grace period get SIGKILL on their
process group. Then the embedded server stops, KV segments of our workers that a killed
worker left in /dev/shm are unlinked, and the state file and a temporary log directory
are removed. Every child also gets PDEATHSIG, so a SIGKILLed supervisor does not leave
workers or the server behind.

Imports redis and pdqueue.queue/keys/procs (never torch).
"""

from __future__ import annotations

import glob
import json
import os
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

from pdqueue.keys import Keys
from pdqueue.procs import pid_alive
from pdqueue.queue.redis_server import RedisServer
from pdqueue.queue.registry import list_workers

# pdqueue.transfer.shm's DEFAULT_PREFIX and node's DEFAULT_SHM_DIR, not imported: importing
# pdqueue.transfer imports torch, which `up` and `status` do without.
SEGMENT_PREFIX = "pdq-kv"
SHM_DIR = "/dev/shm"
ROLES_IN_STOP_ORDER = ("prefill", "decode")

Progress = Callable[[str], None]


# ---- the state file: how `submit` and `status` find a running `up` ---------------------

def state_path() -> Path:
    """``$XDG_RUNTIME_DIR/pdqueue/up.json``, else ``~/.cache/pdqueue/up.json``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    root = Path(runtime) / "pdqueue" if runtime else Path.home() / ".cache" / "pdqueue"
    return root / "up.json"


def read_state(path: Path | None = None) -> dict | None:
    """The running local cluster's state (url, cluster, pid, ...), or None if there is none
    (no file, unreadable, or its ``up`` process is gone)."""
    path = path or state_path()
    try:
        state = json.loads(path.read_text())
        pid = int(state["pid"])
        state["url"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return state if pid_alive(pid) else None


def write_state(state: dict, path: Path | None = None) -> Path:
    """Write atomically (mode 0600): readers see the old file or the new one."""
    path = path or state_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(state, f, indent=2)
    os.replace(tmp, path)
    return path


def remove_state(path: Path | None = None, pid: int | None = None) -> None:
    """Remove the state file if it is ours (written by ``pid``, default this process)."""
    path = path or state_path()
    pid = os.getpid() if pid is None else pid
    try:
        if json.loads(path.read_text()).get("pid") == pid:
            path.unlink()
    except (OSError, ValueError):
        pass


# ---- the supervisor ----------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class LocalClusterConfig:
    num_prefill: int = 1
    num_decode: int = 1
    model: str = "smollm2"
    cluster: str = "default"
    redis_url: str | None = None      # None: start an embedded server
    redis_port: int | None = None     # the embedded server's port (default: a free one)
    threads: int | None = None        # torch threads per worker
    kv_cache_mb: int = 256
    log_dir: Path | None = None       # None: a temporary directory, removed by stop()
    log_level: str = "INFO"
    worker_args: tuple[str, ...] = field(default_factory=tuple)


class WorkerFailed(RuntimeError):
    def __init__(self, worker_id: str, returncode: int, log_tail: str):
        super().__init__(f"worker {worker_id} exited with status {returncode} before it was ready")
        self.worker_id = worker_id
        self.returncode = returncode
        self.log_tail = log_tail


@dataclass(slots=True)
class WorkerProcess:
    role: str
    worker_id: str
    proc: subprocess.Popen
    log_path: Path

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

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


def _child_setup() -> None:  # between fork and exec: die with the supervisor
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


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

    # ---- start ---------------------------------------------------------------------------
    def start_server(self) -> str:
        """Start the embedded server unless a URL was given; returns the URL to use."""
        if self.url is None:
            self.server = RedisServer(port=self.config.redis_port).start()
            self.url = self.server.url
        self._r = redis.Redis.from_url(self.url, socket_timeout=5, socket_connect_timeout=3)
        return self.url

    @property
    def redis(self) -> redis.Redis:
        assert self._r is not None, "start_server() first"
        return self._r

    def write_state(self, path: Path | None = None) -> Path:
        state = {"url": self.url, "cluster": self.config.cluster, "pid": os.getpid(),
                 "server_pid": self.server.pid if self.server else None, "model": self.config.model,
                 "started_ms": int(time.time() * 1000), "log_dir": str(self.log_dir),
                 "workers": [{"role": w.role, "worker_id": w.worker_id, "pid": w.proc.pid}
                             for w in self.workers]}
        self.state_file = write_state(state, path)
        return self.state_file

    def start_workers(self) -> None:
        c = self.config
        for role, count in (("prefill", c.num_prefill), ("decode", c.num_decode)):
            for i in range(count):
                self._spawn(role, f"{role}-{i}-{self.run_id}")

    def _spawn(self, role: str, worker_id: str) -> WorkerProcess:
        c = self.config
        cmd = [sys.executable, "-m", "workers", "worker", role, "--redis-url", self.url,
               "--cluster", c.cluster, "--model", c.model, "--kv-cache-mb", str(c.kv_cache_mb),
               "--worker-id", worker_id, "--log-level", c.log_level, *c.worker_args]
        if c.threads:
            cmd += ["--threads", str(c.threads)]
        log_path = self.log_dir / f"{worker_id}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True,
                                    preexec_fn=_child_setup)
        w = WorkerProcess(role, worker_id, proc, log_path)
        self.workers.append(w)
        return w

    def registered(self) -> set[str]:
        """Ids of our workers that have registered (their heartbeat hash exists)."""
        ours = {w.worker_id for w in self.workers}
        return {w["worker_id"] for w in list_workers(self.redis, self.keys)} & ours

    def exited(self) -> list[WorkerProcess]:
        return [w for w in self.workers if not w.alive]

    def wait_ready(self, timeout_s: float, progress: Callable[[int, int], None] | None = None,
                   cancel: threading.Event | None = None) -> bool:
        """Block until every worker has registered (True), ``cancel`` is set (False), a
        worker exits (``WorkerFailed``) or ``timeout_s`` passes (``TimeoutError``)."""
        deadline = time.monotonic() + timeout_s
        total = len(self.workers)
        while True:
            for w in self.exited():
                raise WorkerFailed(w.worker_id, w.proc.returncode, w.log_tail())
            done = len(self.registered())
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

    # ---- stop ----------------------------------------------------------------------------
    def stop(self, grace_s: float = 60.0, hurry: threading.Event | None = None,
             progress: Progress | None = None, keep_logs: bool = False) -> dict:
        """Stop everything (see the module docstring); returns what happened:
        ``{"exit_codes": {worker_id: code}, "killed": [...], "segments_removed": [...]}``.
        A temporary log directory is removed unless ``keep_logs``."""
        say = progress or (lambda msg: None)
        hurry = hurry or threading.Event()
        deadline = time.monotonic() + grace_s
        killed: list[str] = []
        for role in ROLES_IN_STOP_ORDER:
            group = [w for w in self.workers if w.role == role and w.alive]
            if not group:
                continue
            say(f"stopping {len(group)} {role} worker{'s' if len(group) > 1 else ''} (warm: work in hand finishes)")
            for w in group:
                w.signal(signal.SIGTERM)
            killed += self._wait(group, deadline, hurry, say)
        for w in self.workers:  # any not covered above (another role)
            if w.alive:
                w.signal(signal.SIGKILL)
                w.proc.wait()
                killed.append(w.worker_id)
        if self.server is not None:
            say("stopping the Redis server")
            self.server.stop()
        if self._r is not None:
            self._r.close()
        removed = self.remove_segments()
        if self.state_file is not None:
            remove_state(self.state_file)
        if self._own_log_dir and not keep_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        return {"exit_codes": {w.worker_id: w.proc.returncode for w in self.workers}, "killed": killed,
                "segments_removed": removed}

    def _wait(self, group: list[WorkerProcess], deadline: float, hurry: threading.Event,
              say: Progress) -> list[str]:
        """Wait for ``group`` to exit; on ``hurry`` signal again (cold stop) and allow 5 s
        more; SIGKILL whoever is left at the deadline. Returns the ids killed."""
        hurried = False
        while any(w.alive for w in group) and time.monotonic() < deadline:
            if hurry.is_set() and not hurried:
                hurried = True
                say("stopping now (cold)")
                for w in group:
                    if w.alive:
                        w.signal(signal.SIGTERM)
                deadline = min(deadline, time.monotonic() + 5.0)
            time.sleep(0.05)
        killed = []
        for w in group:
            if w.alive:
                say(f"{w.worker_id} did not stop in time: SIGKILL")
                w.signal(signal.SIGKILL)
                w.proc.wait()
                killed.append(w.worker_id)
        return killed

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
