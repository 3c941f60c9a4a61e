"""The processes `up` supervises (``WorkerProcess``: a worker or the gateway, its restarts
and exits) and ``WorkerFailed``, a start that failed. Standard library only."""

from __future__ import annotations

import math
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

Progress = Callable[[str], None]


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



def count_of(n: int, one: str, many: str) -> str:
    return "" if n <= 0 else f"{n} {one if n == 1 else many}"


def secs(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
