"""`pdqueue worker` processes for tests, forked from a process that imported torch once.

A worker's start is mostly `import torch` (~1.5 of its ~2.3 CPU-seconds with the tiny
model), and the suite starts a few hundred workers on CI's two cores. Here each xdist process
keeps one multiprocessing *forkserver* that has imported torch and the CLI; a worker is a
fork of it that runs the same `pdqueue worker` command line through the CLI's `main()`, in
its own session, with its own environment, working directory and log file: a real process,
signalled, killed and reaped as before (`Forked` has the `subprocess.Popen` methods the
tests use). Only its /proc cmdline differs (the forkserver's), so a test that looks workers
up by command line starts them with ``fork=False`` (`Cluster.start`), and
``PDQ_TEST_FORK_WORKERS=0`` turns this off for a whole run.

The forkserver only imports: it runs no torch op, so no OpenMP pool exists when it forks.
`import torch` leaves one idle native thread, which a fork does not copy; PyTorch's own
DataLoader forks from processes that have run far more of torch than this.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time

PRELOAD = ["torch", "workers.cli", "pdqueue.models", "pdqueue.engine", "pdqueue.transfer"]
_context = None


def enabled() -> bool:
    return os.environ.get("PDQ_TEST_FORK_WORKERS", "1") != "0"


def _ctx():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _run(argv: list[str], env: dict, cwd: str, log_path: str) -> None:
    """In the fork: become what `python -m workers <argv>` would be, then run it."""
    os.setsid()
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.argv = ["pdqueue", *argv]
    from workers.cli import main

    main()


class Forked:
    """The part of ``subprocess.Popen`` tests use, for a worker forked by the forkserver."""

    def __init__(self, argv: list[str], env: dict, cwd: str, log_path: str):
        self.args = argv
        with open(log_path, "ab"):   # there when this returns, as with Popen (tests read it at once)
            pass
        self._process = _ctx().Process(target=_run, args=(argv, env, cwd, log_path), daemon=True)
        self._process.start()
        self.pid = self._process.pid
        self.returncode: int | None = None
        # As with Popen(start_new_session=True): its process group exists when this returns
        # (Cluster.signal is a killpg; one sent before the fork's setsid found no group).
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if os.getpgid(self.pid) == self.pid:
                    break
            except ProcessLookupError:   # gone already (reaped by the forkserver)
                break
            time.sleep(0.001)

    def poll(self) -> int | None:
        if self.returncode is None and not self._process.is_alive():
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
