"""Hosts made of Linux network namespaces, for multi-host tests and benchmarks.

``Net(["redis", "prefill", "decode"])`` makes one network namespace per host, each with its
own address on a private subnet (``10.213.0.0/24``, host *i* is ``10.213.0.(i+1)``), joined
by veth pairs to a bridge that lives in a namespace of its own (the "switch"). Nothing is
added to the machine's own network: no interface, address or route outside the namespaces,
so no packet of a test can leave them (the namespaces have no default route either).

Each host also has its own ``/dev/shm``: a tmpfs mounted once per host under the net's work
directory and bound over ``/dev/shm`` in a private mount namespace for every process started
on that host (``Net.wrap``/``Net.popen``). Processes of one host therefore share one
shared-memory domain (one pdqueue node id), and processes of two hosts never do.

Faults: ``Net.iptables(host, ...)`` runs iptables inside a host's namespace (rules vanish with
it), ``Net.link(host, up)`` takes a host's interface down and up, and ``python -m
tests.netns proxy`` is a small TCP proxy that adds delay (and optionally a rate limit) to a
path, since the ``netem`` qdisc is not available on every kernel.

``Net.close()`` always cleans up, whatever state it is in: every process it started (and any
other process left in its namespaces) is killed, the namespaces are deleted (which removes
the veths, the bridge and their iptables rules), the tmpfs mounts are unmounted and the work
directory removed. It also runs at exit (atexit) if the caller forgot.

``unavailable()`` says why namespaces cannot be made here (not root, no ``ip``, no
iptables, or the kernel refuses), or returns None.

Standard library only (the proxy too), so scripts and tests can run it anywhere.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SUBNET = "10.213.0"          # inside our own namespaces only; the switch is not connected to the machine
PREFIX_LEN = 24
SHM_SIZE = "256m"
IPTABLES = "iptables"


def unavailable() -> str | None:
    """Why network-namespace hosts cannot be made here, or None."""
    if os.name != "posix" or not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs and mounts)"
    for tool in ("ip", "unshare", "mount", IPTABLES):
        if not shutil.which(tool):
            hint = " (apt-get install -y iptables)" if tool == IPTABLES else ""
            return f"needs the `{tool}` command{hint}"
    name = f"pdqprobe{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    try:
        rule = subprocess.run(["ip", "netns", "exec", name, IPTABLES, "-A", "INPUT", "-m", "statistic", "--mode",
                               "random", "--probability", "0.5", "-j", "DROP"], capture_output=True, text=True)
        if rule.returncode != 0:
            return f"iptables does not work inside a network namespace: {rule.stderr.strip()}"
        mnt = subprocess.run(["ip", "netns", "exec", name, "unshare", "--mount", "--propagation", "private", "sh",
                              "-c", "mount -t tmpfs tmpfs /dev/shm"], capture_output=True, text=True)
        if mnt.returncode != 0:
            return f"cannot mount a private /dev/shm: {mnt.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


class Net:
    """Hosts on one bridge (see the module docstring). Use as a context manager, or call
    ``close()``; ``start()`` cleans up after itself if it fails half-way."""

    def __init__(self, hosts: list[str], workdir: str | os.PathLike | None = None, shm_size: str = SHM_SIZE):
        self.shm_size = shm_size                        # each host's /dev/shm (a prefill pool must fit)
        self.tag = secrets.token_hex(3)
        self.hosts = list(hosts)
        self.prefix = f"pdqt{self.tag}"                 # every namespace's name starts with it
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix=f"{self.prefix}-"))
        self.procs: list[subprocess.Popen] = []
        self._made: list[str] = []                      # namespaces made so far
        self._mounts: list[Path] = []
        self._closed = False
        atexit.register(self.close)

    # -- names -----------------------------------------------------------------------------
    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def addr(self, host: str) -> str:
        return f"{SUBNET}.{self.hosts.index(host) + 1}"

    def shm_dir(self, host: str) -> Path:
        """The host's /dev/shm as seen from outside (its tmpfs)."""
        return self.workdir / f"shm-{host}"

    # -- making and unmaking ------------------------------------------------------------------
    def start(self) -> "Net":
        try:
            self._add_ns(self.switch)
            _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
            for i, host in enumerate(self.hosts):
                ns = self.ns(host)
                self._add_ns(ns)
                port = f"v{i}"   # the switch's end, named in the switch's own namespace
                _sh("ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _sh("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
                _sh("ip", "-n", ns, "addr", "add", f"{self.addr(host)}/{PREFIX_LEN}", "dev", "eth0")
                _sh("ip", "-n", ns, "link", "set", "eth0", "up")
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
                shm = self.shm_dir(host)
                shm.mkdir(parents=True, exist_ok=True)
                _sh("mount", "-t", "tmpfs", "-o", f"size={self.shm_size},mode=1777", "tmpfs", str(shm))
                self._mounts.append(shm)
        except BaseException:
            self.close()
            raise
        return self

    def _add_ns(self, name: str) -> None:
        _sh("ip", "netns", "add", name)
        self._made.append(name)

    def close(self) -> None:
        """Kill every process of the net, delete its namespaces, unmount its tmpfs mounts.
        Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for ns in self._made:   # anything else still inside (a child that left its group)
            pids = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for ns in reversed(self._made):
            for _ in range(50):   # a namespace whose last process is still exiting may refuse for a moment
                if _sh("ip", "netns", "del", ns, check=False).returncode == 0 or ns not in self.list_ours():
                    break
                time.sleep(0.1)
        for shm in self._mounts:
            _sh("umount", "-l", str(shm), check=False)
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        atexit.unregister(self.close)

    def list_ours(self) -> list[str]:
        """This net's namespaces that exist now (empty after ``close``)."""
        names = [line.split()[0] for line in _sh("ip", "netns", "list", check=False).stdout.splitlines() if line]
        return [n for n in names if n.startswith(f"{self.prefix}-")]

    def __enter__(self) -> "Net":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- processes ------------------------------------------------------------------------------
    def wrap(self, host: str, cmd: list[str] | str) -> list[str]:
        """``cmd`` as run on ``host``: its network namespace and its /dev/shm. ``cmd`` may be
        a list, or a ``sh -c`` string (``{cmd}`` in ``tests.cluster.Cluster.start``'s prefix)."""
        inner = cmd if isinstance(cmd, str) else shlex.join(cmd)
        return ["ip", "netns", "exec", self.ns(host), "unshare", "--mount", "--propagation", "private", "sh", "-c",
                f"mount --bind {shlex.quote(str(self.shm_dir(host)))} /dev/shm && exec {inner}"]

    def prefix_for(self, host: str) -> list[str]:
        """A ``prefix`` for ``tests.cluster.Cluster.start`` (its last item formats ``{cmd}``)."""
        return self.wrap(host, "{cmd}")

    def popen(self, host: str, cmd: list[str], **kwargs) -> subprocess.Popen:
        """Start ``cmd`` on ``host`` in its own process group; killed by ``close``."""
        proc = subprocess.Popen(self.wrap(host, cmd), start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def adopt(self, proc: subprocess.Popen) -> subprocess.Popen:
        """Have ``close`` kill ``proc`` too (a process started by other means, e.g. Cluster)."""
        self.procs.append(proc)
        return proc

    def exec(self, host: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run a short command in ``host``'s network namespace (no private /dev/shm)."""
        return _sh("ip", "netns", "exec", self.ns(host), *cmd, check=check)

    # -- faults --------------------------------------------------------------------------------
    def iptables(self, host: str, *args: str) -> None:
        self.exec(host, IPTABLES, "-w", *args)

    def flush(self, host: str) -> None:
        """Remove every iptables rule of ``host``'s filter table."""
        self.iptables(host, "-F")

    def cut(self, host: str, peer: str, probability: float | None = None) -> None:
        """On ``host``, drop every packet from and to ``peer`` (with ``probability``: that
        share of them, at random)."""
        match = [] if probability is None else ["-m", "statistic", "--mode", "random", "--probability",
                                                f"{probability:.4f}"]
        self.iptables(host, "-A", "INPUT", "-s", self.addr(peer), *match, "-j", "DROP")
        self.iptables(host, "-A", "OUTPUT", "-d", self.addr(peer), *match, "-j", "DROP")

    def link(self, host: str, up: bool) -> None:
        """Take ``host``'s only interface down (cut from every other host) or up again."""
        _sh("ip", "-n", self.ns(host), "link", "set", "eth0", "up" if up else "down")

    def can_connect(self, host: str, peer: str, port: int, timeout_s: float = 1.0) -> bool:
        code = (f"import socket; socket.create_connection(({self.addr(peer)!r}, {port}), "
                f"timeout={timeout_s}).close()")
        return self.exec(host, sys.executable, "-c", code, check=False).returncode == 0


def wait_port(net: Net, host: str, peer: str, port: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not net.can_connect(host, peer, port):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{peer}:{port} not reachable from {host} after {timeout_s:g}s")
        time.sleep(0.1)


# -- a TCP proxy that delays (and optionally throttles) ------------------------------------------

class _Pipe:
    """One direction of a proxied connection: bytes read from ``src`` are written to ``dst``
    ``delay_s`` later (order kept), at most ``rate`` bytes/s when set."""

    def __init__(self, src: socket.socket, dst: socket.socket, delay_s: float, rate: float | None, stats: dict,
                 key: str):
        self.src, self.dst, self.delay_s, self.rate, self.stats, self.key = src, dst, delay_s, rate, stats, key
        self.queue: collections.deque = collections.deque()
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._write, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data = self.src.recv(65536)
            except OSError:
                data = b""
            with self.cond:
                self.queue.append((time.monotonic() + self.delay_s, data))
                self.cond.notify()
            if not data:
                return

    def _write(self) -> None:
        while True:
            with self.cond:
                while not self.queue:
                    self.cond.wait()
                due, data = self.queue.popleft()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                if not data:
                    self.dst.shutdown(socket.SHUT_WR)
                    return
                if self.rate:
                    for i in range(0, len(data), 4096):
                        chunk = data[i:i + 4096]
                        self.dst.sendall(chunk)
                        self.stats[self.key] += len(chunk)
                        time.sleep(len(chunk) / self.rate)
                else:
                    self.dst.sendall(data)
                    self.stats[self.key] += len(data)
            except OSError:
                for s in (self.src, self.dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                return


def proxy_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.netns proxy",
                                description="Forward LISTEN_HOST:PORT to TO_HOST:PORT for each --port, adding "
                                            "--delay-ms one way (each direction) and optionally a rate limit.")
    p.add_argument("--listen", required=True, help="host to listen on")
    p.add_argument("--to", required=True, help="host to forward to (same port)")
    p.add_argument("--port", type=int, action="append", required=True)
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--rate-kbps", type=float, default=0.0, help="KiB/s per direction and connection (0: no limit)")
    p.add_argument("--stats", default=None, help="file to write byte counts to (JSON), every 50 ms")
    args = p.parse_args(argv)
    stats = collections.Counter()
    rate = args.rate_kbps * 1024 or None

    def serve(port: int) -> None:
        listener = socket.create_server((args.listen, port), reuse_port=False)
        while True:
            client, _ = listener.accept()
            try:
                upstream = socket.create_connection((args.to, port), timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            stats["connections"] += 1
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _Pipe(client, upstream, args.delay_ms / 1000, rate, stats, "to_server")
            _Pipe(upstream, client, args.delay_ms / 1000, rate, stats, "to_client")

    for port in args.port:
        threading.Thread(target=serve, args=(port,), daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    print("proxy ready", flush=True)
    while True:
        time.sleep(0.05)
        if args.stats:
            tmp = args.stats + ".tmp"
            with open(tmp, "w") as f:
                json.dump(dict(stats), f)
            os.replace(tmp, args.stats)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "proxy":
        proxy_main(sys.argv[2:])
    else:
        sys.exit("usage: python -m tests.netns proxy --listen HOST --to HOST --port N [--delay-ms MS]")
