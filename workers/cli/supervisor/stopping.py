"""`up`'s stop, in order: no more restarts; SIGTERM to the gateway (it takes no new requests;
its open answers run on); with an embedded server, the drain (``draining``); then prefill
workers get SIGTERM (warm: they finish the prompts in hand and keep serving their exported
KV until the decode side has copied it; cold when no decode worker is left), then decode
workers (warm: running requests finish); an error entry for each request left; the
gateway's exit (``GATEWAY_EXIT_S``); the embedded server, once the answers it holds were
read (``WorkLeft.wait_read``, at most ``answer_grace_s``); KV segments a killed worker left in
/dev/shm; the state file and a temporary log directory (kept when a process died, or on
``keep_logs``). A second ``hurry`` signal repeats SIGTERM (a worker's cold stop) and is
forwarded to the gateway (its second SIGTERM: its open answers fail); stragglers past the
grace period get SIGKILL on their process group. A rolling restart under way ends first
(``rolling.Rolling.abort``: a replacement not ready yet is stopped); an old process it had
told to leave is waited for with its role (a gateway handing over gets SIGTERM with the
gateway). Never imports torch.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import threading
import time
from typing import Any, Protocol

from pdqueue.discovery import remove_state
from pdqueue.protocol import ErrorCode, Role
from workers.cli.supervisor.draining import STOP_REPORT_INTERVAL_S, UNANSWERED_READ_S, WorkLeft
from workers.cli.supervisor.processes import Progress, WorkerProcess, count_of
from workers.cli.supervisor.restarts import ROLES_IN_STOP_ORDER, Restarts
from workers.cli.supervisor.rolling import Rolling
from workers.cli.supervisor.supervised import Supervised

# pdqueue.transfer.shm's DEFAULT_PREFIX and node's DEFAULT_SHM_DIR, not imported: importing
# pdqueue.transfer imports torch, which `up` and `status` do without.
SEGMENT_PREFIX = "pdq-kv"
SHM_DIR = "/dev/shm"
# The gateway is the last door to close: its first SIGTERM makes it take no new requests and
# let its open answers run to their end; once the workers are stopped and every unanswered
# request has its error entry, those answers have ended, so it should exit at once. After
# GATEWAY_EXIT_S more it gets its second SIGTERM (its open answers fail), and SIGKILL 5 s later.
GATEWAY_EXIT_S = 10.0


class Stoppable(Supervised, Protocol):
    """The cluster ``Stopping`` stops: with its supervisor thread, its rolling restarts and
    its streams' backlog."""
    restarts: Restarts
    rolling: Rolling
    work_left: WorkLeft
    config: Any   # LocalClusterConfig (its answer_grace_s)


class Stopping:
    """One stop of a ``LocalCluster`` (``LocalCluster.stop``)."""

    def __init__(self, cluster: Stoppable):
        self.cluster = cluster

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
        say, waiting = self._logged(progress), self._logged(waiting) if waiting is not None else None
        hurry = hurry or threading.Event()
        self.cluster.restarts.halt()   # a round in progress ends; no restart after this
        self.cluster.rolling.abort()   # a rolling restart ends; its old process leaving is waited for below
        leaving = [w for w in self.cluster.retired if w.alive]   # (already told to leave: not signalled again)
        for w in self.cluster.processes():   # what exited since the supervisor last looked, or unsupervised
            if not w.alive:
                self._note_exit(w)
            if w.restart_at is not None:
                w.restart_at = None
                say(f"{w.worker_id} is not restarted: up is stopping")
        signalled: set[int] = set()   # the processes `up` stopped (the others, dead, died on their own)
        deadline = time.monotonic() + grace_s
        killed: list[str] = []
        gateway = self.cluster.gateway if self.cluster.gateway is not None and self.cluster.gateway.alive else None
        forwarded = threading.Event()
        if gateway is not None:   # first: no new requests; last to exit (its answers end with the workers')
            say("the gateway takes no new requests; its open answers run to their end")
            signalled.add(gateway.proc.pid)
            gateway.signal(signal.SIGTERM)
            threading.Thread(target=self._forward_hurry, args=(gateway, hurry, forwarded, say),
                             name="pdq-gateway-hurry", daemon=True).start()
        for old in leaving:   # a gateway handing over: its open connections drain as the gateway's
            if old.role == "gateway":
                signalled.add(old.proc.pid)
                old.signal(signal.SIGTERM)
        try:
            if self.cluster.server is not None and not hurry.is_set():
                # The queue dies with the embedded server: answer what it holds first.
                self.cluster.work_left.drain(hurry, say, waiting)
                deadline = time.monotonic() + grace_s
            roles = self.cluster.current_roles()
            for role in ROLES_IN_STOP_ORDER:
                group = [w for w in self.cluster.workers + leaving
                         if roles.get(w.worker_id, w.role) == role and w.alive]
                if not group:
                    continue
                cold = hurry.is_set()  # already in a hurry: the second SIGTERM follows at once
                how = "cold: at once" if cold else "warm: work in hand finishes"
                if (not cold and role == Role.PREFILL and self.cluster.server is not None
                        and not self._alive_in(Role.DECODE, roles)):
                    cold, how = True, "cold: no decode worker is left to take its KV"
                say(f"stopping {len(group)} {role} worker{'s' if len(group) > 1 else ''} ({how})")
                for w in group:
                    if not any(w is x for x in leaving):
                        signalled.add(w.proc.pid)
                        w.signal(signal.SIGTERM)
                killed += self._wait(group, deadline, hurry, say, waiting, cold=cold)
            for w in self.cluster.workers:  # any not covered above (another role)
                if w.alive:
                    signalled.add(w.proc.pid)
                    w.signal(signal.SIGKILL)
                    w.proc.wait()
                    killed.append(w.worker_id)
            if self.cluster.server is not None:
                failed = self.cluster.work_left.fail_unanswered()
                if failed:
                    say(f"{count_of(failed, 'request', 'requests')} not answered: their clients got an error "
                        f"(code {ErrorCode.UNAVAILABLE.value}: the local cluster stopped)")
                    time.sleep(UNANSWERED_READ_S)   # clients blocked on out:<id> read it before the server goes
            if gateway is not None:
                killed += self._wait_gateway(gateway, hurry, forwarded, say)
            killed += self._wait([w for w in leaving if w.role == "gateway"], time.monotonic() + 5.0, hurry, say,
                                 cold=True)
        finally:
            forwarded.set()   # (ends the forwarding thread)
        self.cluster.restarts.release()   # (the supervisor thread ends: the processes it started are stopped)
        for w in self.cluster.processes():
            if w.proc.pid not in signalled:   # it exited before `up` came to stop it
                self._note_exit(w)
        died = {w.worker_id: [code for code, _ in w.exits] for w in self.cluster.processes() if w.died}
        keep = keep_logs or bool(died)
        if self.cluster.server is not None:
            if not hurry.is_set():   # its answers die with it: until they are read (or a grace)
                self.cluster.work_left.wait_read(self.cluster.config.answer_grace_s, hurry, say, waiting)
            say("stopping the Redis server")
            if keep and self.cluster.server.log_path is not None:
                try:
                    shutil.copyfile(self.cluster.server.log_path, self.cluster.log_dir / "redis-server.log")
                except OSError:
                    pass
            self.cluster.server.stop()
        self.cluster.close_redis()
        if self.cluster.gateway_socket is not None:   # (every gateway has exited)
            self.cluster.gateway_socket.close()
        removed = self.remove_segments()
        if self.cluster.state_file is not None:
            remove_state(self.cluster.state_file)
        if self.cluster.own_log_dir and not keep:
            shutil.rmtree(self.cluster.log_dir, ignore_errors=True)
        exit_codes = {w.worker_id: w.proc.returncode for w in self.cluster.workers}
        if self.cluster.gateway is not None:
            exit_codes["gateway"] = self.cluster.gateway.proc.returncode
        return {"exit_codes": exit_codes, "killed": killed, "segments_removed": removed, "died": died,
                "logs_kept": str(self.cluster.log_dir) if keep or not self.cluster.own_log_dir else None}

    def _logged(self, progress: Progress | None) -> Progress:
        """``progress``, each line also in ``up.log`` (a kept log directory tells the whole stop)."""
        def say(msg: str) -> None:
            self.cluster.restarts.log(msg)
            if progress is not None:
                progress(msg)
        return say

    def _note_exit(self, w: WorkerProcess) -> None:
        """Record an exit the supervisor has not seen (it died as `up` began to stop)."""
        if w.proc.poll() is not None and w.handled_pid != w.proc.pid and not w.gave_up:
            w.handled_pid = w.proc.pid
            w.exits.append((w.proc.returncode, time.monotonic() - w.started))
            if w is not self.cluster.gateway:
                self.cluster.forget_heartbeat(w)

    def _alive_in(self, role: str, roles: dict[str, str]) -> bool:
        return any(w.alive and roles.get(w.worker_id, w.role) == role for w in self.cluster.workers)

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
                waiting(f"waiting for {self.cluster.work_left.still_running([w for w in group if w.alive])}")
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

    def segments(self) -> list[str]:
        """KV segments in /dev/shm that belong to our workers."""
        return [p for w in self.cluster.workers + self.cluster.retired
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
