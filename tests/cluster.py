"""Real worker processes for tests: started with the `pdqueue worker` command, found in
the registry, stopped with SIGTERM (killed if they do not stop), logs kept for failures."""

from __future__ import annotations

import glob
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from pdqueue.keys import Keys
from pdqueue.queue.connection import connect
from pdqueue.queue.registry import list_workers
from tests import forked

ROOT = Path(__file__).resolve().parent.parent


class Cluster:
    def __init__(self, redis_url: str, log_dir: Path, model: str = "tiny", cluster: str = "default"):
        self.redis_url = redis_url
        self.log_dir = Path(log_dir)
        self.model = model
        self.cluster = cluster
        self.procs: dict[str, subprocess.Popen | forked.Forked] = {}  # by short name
        # Worker ids carry a per-cluster tag: other test runs on this host (sharing /dev/shm)
        # must never be mistaken for ours.
        self.tag = secrets.token_hex(3)
        self.r = connect(redis_url)   # a redis+cluster:// URL too (tests/test_redis_cluster.py)
        self.keys = Keys(cluster)

    def start(self, role: str, *args: str, worker_id: str | None = None, prefix: list[str] | None = None,
              env: dict | None = None, wait: bool = True, fork: bool = True) -> str:
        """``fork``: forked from the test process's forkserver (tests/forked.py: the same
        command line without paying `import torch` again); False (or a ``prefix``): a
        `python -m workers` process of its own."""
        name = worker_id or f"{role}-{len(self.procs)}"
        argv = ["worker", role, "--model", self.model, "--redis-url", self.redis_url, "--cluster", self.cluster,
                "--worker-id", self.id(name), "--threads", "1", "--kv-cache-mb", "16", *args]
        env = {**os.environ, **(env or {})}
        log_path = self.log_dir / f"{name}.log"
        if fork and not prefix and forked.enabled():
            self.procs[name] = forked.Forked(argv, env, str(ROOT), str(log_path))
        else:
            cmd = [sys.executable, "-m", "workers", *argv]
            if prefix:  # e.g. ["unshare", "--mount", "sh", "-c", "mount ... && exec {cmd}"]
                cmd = [*prefix[:-1], prefix[-1].format(cmd=" ".join(_quote(c) for c in cmd))]
            with open(log_path, "ab") as log:
                self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                                    start_new_session=True)
        if wait:
            self.wait_registered(name)
        return name

    def start_together(self, *specs: tuple) -> list[str]:
        """Start several workers at once and wait until all have registered (their starts,
        mostly `import torch`, overlap instead of running one after another). Each spec is
        ``(role, *args)`` or ``(role, *args, {"worker_id": ..., ...})``: ``start``'s arguments."""
        names = []
        for spec in specs:
            kw = spec[-1] if spec and isinstance(spec[-1], dict) else {}
            args = spec[:-1] if kw else spec
            names.append(self.start(*args, **kw, wait=False))
        for name in names:
            self.wait_registered(name)
        return names

    def id(self, name: str) -> str:
        """The real worker id (consumer name) of the worker started as ``name``."""
        return f"{name}-{self.tag}"

    def wait_registered(self, worker_id: str, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for w in list_workers(self.r, self.keys):
                if w["worker_id"] == self.id(worker_id):
                    return w
            proc = self.procs[worker_id]
            if proc.poll() is not None:
                raise RuntimeError(f"worker {worker_id} exited with {proc.returncode}:\n{self.log(worker_id)}")
            time.sleep(0.05)
        raise TimeoutError(f"worker {worker_id} did not register:\n{self.log(worker_id)}")

    def workers(self) -> dict[str, dict]:
        """Live workers by short name."""
        return {w["worker_id"].removesuffix(f"-{self.tag}"): w for w in list_workers(self.r, self.keys)}

    def dead_segments(self) -> list[str]:
        """This cluster's segments whose owner process is gone (leaked, until cleaned up)."""
        return [p for p in self.segments() if not owner_alive(p)]

    def segments(self, names=None) -> list[str]:
        """This cluster's KV segments in /dev/shm (of the named workers, default all)."""
        names = list(self.procs) if names is None else list(names)
        return [p for p in glob.glob("/dev/shm/pdq-kv-*") if any(f"-{self.id(n)}-" in p for n in names)]

    def log(self, worker_id: str) -> str:
        return (self.log_dir / f"{worker_id}.log").read_text(errors="replace")[-4000:]

    def signal(self, worker_id: str, sig: int) -> None:
        os.killpg(self.procs[worker_id].pid, sig)

    def stop(self, worker_id: str, timeout: float = 30.0, signalled: bool = False) -> int:
        """SIGTERM (a warm stop), then wait; SIGKILL after ``timeout``."""
        proc = self.procs[worker_id]
        if proc.poll() is None:
            if not signalled:
                self.signal(worker_id, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.signal(worker_id, signal.SIGKILL)
                proc.wait()
        return proc.returncode

    def kill_all(self) -> None:
        """SIGKILL whatever still runs (a failed test's cleanup: a warm stop may wait on a
        Redis that is gone)."""
        self._signal_running(signal.SIGKILL)
        for proc in self.procs.values():
            proc.wait()

    def stop_and_check(self, *, killed_ok: bool = False) -> None:
        """Stop every worker; nothing may be left behind: every exit status 0 and no KV
        segment. ``killed_ok``: the test killed workers on purpose, so only those that exited
        cleanly must have removed their segments."""
        codes = self.stop_all()
        if killed_ok:
            assert not self.segments([w for w, p in self.procs.items() if p.returncode == 0])
            return
        leftover = self.segments()
        assert not leftover, f"segments left behind: {leftover}"
        assert all(code == 0 for code in codes.values()), {w: (code, self.log(w)) for w, code in codes.items()}

    def stop_all(self) -> dict[str, int]:
        self._signal_running(signal.SIGTERM)
        return {wid: self.stop(wid, signalled=True) for wid in list(self.procs)}

    def _signal_running(self, sig: int) -> None:
        for wid, proc in self.procs.items():
            if proc.poll() is None:
                try:
                    self.signal(wid, sig)
                except ProcessLookupError:
                    pass


def owner_alive(segment_path: str) -> bool:
    from pdqueue.transfer.errors import TransferError
    from pdqueue.transfer.shm import pid_alive, read_segment_info

    try:
        return pid_alive(read_segment_info(segment_path).pid)
    except (FileNotFoundError, TransferError):
        # Removed between the listing and this read (read_segment_info raises TransferError
        # for a missing file): gone, so not leaked. One still there but unreadable is leaked.
        return not os.path.exists(segment_path)


def _quote(s: str) -> str:
    import shlex

    return shlex.quote(s)
