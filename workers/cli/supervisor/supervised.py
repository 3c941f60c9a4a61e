"""What the parts of `up`'s supervisor (``restarts``, ``draining``, ``stopping``) use of the
cluster they supervise: ``Supervised``, which ``workers.cli.local_cluster.LocalCluster``
provides. The parts take it instead of importing ``LocalCluster``, so imports point one way
(local_cluster -> supervisor). Never imports torch."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path
from typing import Protocol

from redis import Redis

from pdqueue.keys import Keys
from pdqueue.queue.redis_server import RedisServer
from workers.cli.supervisor.processes import WorkerProcess


class Supervised(Protocol):
    keys: Keys
    server: RedisServer | None        # the embedded server; None when `up` was given a URL
    workers: list[WorkerProcess]
    gateway: WorkerProcess | None
    gateway_url: str | None
    gateway_socket: socket.socket | None   # the gateway's listening socket, held by `up`
    retired: list[WorkerProcess]      # processes a rolling restart replaced (leaving, or gone)
    state_file: Path | None
    log_dir: Path
    own_log_dir: bool                 # a temporary directory of its own, removed at the stop
    up_server: str                    # "<pid of up>:<pid of the server>" (embedded server), else ""

    @property
    def redis(self) -> Redis: ...

    def processes(self) -> list[WorkerProcess]: ...

    def current_roles(self) -> dict[str, str]: ...

    def forget_heartbeat(self, w: WorkerProcess) -> None: ...

    def write_state(self, path: Path | None = None) -> Path: ...

    def start_worker_process(self, role: str, worker_id: str, log_path: Path) -> subprocess.Popen: ...

    def start_gateway_process(self) -> subprocess.Popen: ...

    def gateway_printed_url(self) -> str | None: ...

    def gateway_accepting(self, pid: int) -> bool: ...

    def close_redis(self) -> None: ...
