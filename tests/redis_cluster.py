"""A real Redis Cluster for tests: 3 masters + 3 replicas of redis-server on free loopback
ports, in a temporary directory, created with ``redis-cli --cluster create`` (a cluster of
masters only, e.g. the TLS one, is joined with CLUSTER ADDSLOTSRANGE and MEET).

``RedisClusterServers().start()`` starts the six nodes (``cluster-enabled yes``,
``appendonly yes`` + ``appendfsync always``, a short ``cluster-node-timeout`` so a killed
master's replica is promoted within about two seconds, ``cluster-require-full-coverage no``
so the other masters keep serving while one slot range fails over), joins them, and waits
until every node reports ``cluster_state:ok`` and agrees on the slot map, and every replica
has finished its first sync (a replica still waiting for it holds no data: a failover then
would lose everything, not the last writes). ``url`` is the
``redis+cluster://`` URL pdqueue takes (every master as a startup node). ``fail_over``
SIGKILLs a master and waits for its replica's promotion. ``stop()`` kills
every node and removes the directory; each node also gets PDEATHSIG, so nothing outlives
the test process.

``unavailable_reason()`` says why a cluster cannot be made here (no redis-server/redis-cli,
or a server without cluster support), for ``pytest.skip``.

Imports the standard library and redis (for the admin calls) only.
"""

from __future__ import annotations

import random
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from pdqueue.queue.redis_server import _pdeathsig, port_is_free

NODE_TIMEOUT_MS = 1000


def unavailable_reason() -> str | None:
    """None if a cluster can be started here, else why not."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if not server or not cli:
        return "Redis Cluster tests need redis-server and redis-cli on PATH (apt-get install redis-server)"
    try:
        version = subprocess.run([server, "--version"], capture_output=True, text=True, timeout=10).stdout
        help_text = subprocess.run([cli, "--cluster", "help"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"redis-server/redis-cli do not run: {exc}"
    if "create" not in (help_text.stdout + help_text.stderr):
        return f"{cli} has no --cluster create (redis-cli >= 5 needed)"
    if "v=" in version:
        major = int(version.split("v=", 1)[1].split(".", 1)[0] or 0)
        if major < 5:
            return f"redis-server {version.strip()} has no cluster support usable here (>= 5 needed)"
    return None


def _ephemeral_low() -> int:
    """The first port the kernel hands out to outgoing connections (Linux; else 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free_ports(n: int) -> list[int]:
    """``n`` ports whose cluster-bus port (port + 10000) is free too, both below the ephemeral
    range: a port in it could be taken as the local port of any outgoing connection between
    this check and the server's bind (seen: "bind: Address already in use" in a full run)."""
    ports: list[int] = []
    top = max(12000, min(_ephemeral_low(), 65536) - 10001)
    while len(ports) < n:
        port = random.randint(10000, top)
        if port in ports or any(abs(port - p) == 10000 for p in ports):
            continue
        if port_is_free(port) and port_is_free(port + 10000):
            ports.append(port)
    return ports


class RedisClusterServers:
    def __init__(self, masters: int = 3, replicas_per_master: int = 1, node_timeout_ms: int = NODE_TIMEOUT_MS,
                 password: str | None = None, tls: dict | None = None):
        """``password``: ``requirepass`` (and ``masterauth``) on every node; ``tls``: the
        files (``server.crt``, ``server.key``, ``ca.crt``, and ``client.crt``/``client.key``,
        which a node presents on the cluster bus) to serve TLS only, the cluster bus and
        replication included (clients need no certificate)."""
        self.masters = masters
        self.replicas = replicas_per_master
        self.node_timeout_ms = node_timeout_ms
        self.password = password
        self.tls = tls
        self.dir: Path | None = None
        self.ports: list[int] = []
        self.procs: dict[int, subprocess.Popen] = {}

    # -- addresses --------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """``redis+cluster://`` (``rediss+cluster://`` with TLS) with the first three nodes
        as startup nodes, and the password if any."""
        auth = f":{self.password}@" if self.password else ""
        scheme = "rediss+cluster" if self.tls else "redis+cluster"
        return f"{scheme}://{auth}" + ",".join(f"127.0.0.1:{p}" for p in self.ports[:3])

    def node(self, port: int) -> redis.Redis:
        """A plain client of one node (CLUSTER and INFO commands)."""
        tls = {"ssl": True, "ssl_ca_certs": self.tls["ca.crt"]} if self.tls else {}
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=5, socket_connect_timeout=2,
                           password=self.password, **tls)

    def live_ports(self) -> list[int]:
        return [p for p, proc in self.procs.items() if proc.poll() is None]

    # -- life cycle -------------------------------------------------------------------------
    def _spawn(self, port: int) -> None:
        node_dir = self.dir / str(port)
        node_dir.mkdir(exist_ok=True)
        if self.tls:
            listen = ["--port", "0", "--tls-port", str(port), "--tls-cluster", "yes", "--tls-replication", "yes",
                      "--tls-cert-file", self.tls["server.crt"], "--tls-key-file", self.tls["server.key"],
                      "--tls-ca-cert-file", self.tls["ca.crt"], "--tls-auth-clients", "no",
                      "--tls-client-cert-file", self.tls["client.crt"], "--tls-client-key-file", self.tls["client.key"]]
        else:
            listen = ["--port", str(port)]
        if self.password:   # a test password: on the command line is good enough here
            listen += ["--requirepass", self.password, "--masterauth", self.password]
        args = [shutil.which("redis-server"), *listen, "--bind", "127.0.0.1",
                "--dir", str(node_dir), "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", str(self.node_timeout_ms),
                "--cluster-require-full-coverage", "no", "--cluster-replica-validity-factor", "0",
                "--appendonly", "yes", "--appendfsync", "always", "--save", "",
                "--repl-diskless-sync-delay", "0",   # the default waits 5 s for more replicas
                "--daemonize", "no", "--logfile", str(node_dir / "redis.log")]
        self.procs[port] = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                            preexec_fn=_pdeathsig, start_new_session=True)

    def start(self, timeout: float = 60.0) -> "RedisClusterServers":
        self.dir = Path(tempfile.mkdtemp(prefix="pdq-rcluster-"))
        try:
            self.ports = _free_ports(self.masters * (1 + self.replicas))
            for port in self.ports:
                self._spawn(port)
            deadline = time.monotonic() + timeout
            for port in self.ports:
                self._wait_ping(port, deadline)
            if self.replicas:
                create = subprocess.run(
                    [shutil.which("redis-cli"), "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                     "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                    capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
                if create.returncode != 0:
                    raise RuntimeError(f"redis-cli --cluster create failed:\n{create.stdout}\n{create.stderr}")
            else:
                self._join_masters()   # what `redis-cli --cluster create` does (its 7.0 hangs over TLS)
            self.wait_ok(timeout=max(1.0, deadline - time.monotonic()))
            self.wait_replicas_synced(timeout=max(1.0, deadline - time.monotonic()))
            return self
        except BaseException:
            self.stop()
            raise

    def _join_masters(self) -> None:
        """Masters only: each takes an equal range of slots and its own config epoch, then
        the first MEETs the others."""
        n = len(self.ports)
        for i, port in enumerate(self.ports):
            with self.node(port) as c:
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * 16384 // n, (i + 1) * 16384 // n - 1)
                c.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
        with self.node(self.ports[0]) as c:
            for port in self.ports[1:]:
                c.execute_command("CLUSTER", "MEET", "127.0.0.1", port)

    def _wait_ping(self, port: int, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.procs[port].poll() is not None:
                raise RuntimeError(f"redis-server on {port} exited:\n{self.log(port)}")
            try:
                with self.node(port) as c:
                    if c.ping():
                        return
            except redis.RedisError:
                time.sleep(0.05)
        raise TimeoutError(f"redis-server on {port} did not answer")

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node says ``cluster_state:ok`` and all agree on each slot's master."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            try:
                states = set()
                maps = set()
                for port in self.live_ports():
                    with self.node(port) as c:
                        states.add(c.execute_command("CLUSTER", "INFO").decode().split("cluster_state:")[1][:2])
                        maps.add(tuple(sorted((int(s[0]), int(s[1]), int(s[2][1])) for s in
                                              c.execute_command("CLUSTER", "SLOTS"))))
                if states == {"ok"} and len(maps) == 1 and sum(e - b + 1 for b, e, _ in next(iter(maps))) == 16384:
                    return
                last = f"states {states}, {len(maps)} slot maps"
            except (redis.RedisError, IndexError) as exc:
                last = repr(exc)
            time.sleep(0.1)
        raise TimeoutError(f"the Redis Cluster did not settle: {last}")

    def wait_replicas_synced(self, timeout: float = 30.0) -> None:
        """Until every live replica's link to its master is up (its first full sync done)."""
        deadline = time.monotonic() + timeout
        waiting: list[int] = []
        while time.monotonic() < deadline:
            waiting = []
            for port in self.live_ports():
                with self.node(port) as c:
                    info = c.info("replication")
                if info["role"] == "slave" and (info.get("master_link_status") != "up"
                                                or info.get("master_sync_in_progress")):
                    waiting.append(port)
            if not waiting:
                return
            time.sleep(0.1)
        raise TimeoutError(f"replicas on {waiting} did not finish their first sync")

    def master_of(self, key: str) -> int:
        """Port of the master serving ``key``'s slot now (asked of a live node)."""
        slot = self.slot(key)
        for port in self.live_ports():
            try:
                with self.node(port) as c:
                    for begin, end, master, *_ in c.execute_command("CLUSTER", "SLOTS"):
                        if int(begin) <= slot <= int(end):
                            return int(master[1])
            except redis.RedisError:
                continue
        raise RuntimeError(f"no live node knows slot {slot}")

    def replicas_of(self, master_port: int) -> list[int]:
        with self.node(master_port) as c:
            lines = c.execute_command("CLUSTER", "NODES").decode().splitlines()
        ids = {line.split()[0]: int(line.split()[1].split(":")[1].split("@")[0]) for line in lines}
        me = next(line.split()[0] for line in lines if "myself" in line.split()[2])
        return [ids[line.split()[0]] for line in lines if line.split()[3] == me]

    def slot(self, key: str) -> int:
        with self.node(self.live_ports()[0]) as c:
            return int(c.execute_command("CLUSTER", "KEYSLOT", key))

    def role(self, port: int) -> str:
        with self.node(port) as c:
            return c.execute_command("ROLE")[0].decode()

    def kill(self, port: int) -> None:
        """SIGKILL one node (a crash: no shutdown, no final fsync beyond appendfsync's)."""
        proc = self.procs[port]
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    def fail_over(self, master: int, replicas: list[int], timeout: float = 30.0) -> float:
        """SIGKILL ``master`` and wait until one of its ``replicas`` is promoted and every live
        node agrees on the slot map again; the seconds from the kill to the promotion."""
        killed_at = time.monotonic()
        self.kill(master)
        deadline = killed_at + timeout
        while not any(self.role(port) == "master" for port in replicas):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no replica of {master} ({replicas}) promoted within {timeout:g} s")
            time.sleep(0.02)
        promoted_s = time.monotonic() - killed_at
        self.wait_ok(timeout)
        return promoted_s

    def log(self, port: int) -> str:
        path = self.dir / str(port) / "redis.log" if self.dir else None
        return path.read_text(errors="replace")[-3000:] if path and path.exists() else ""

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self) -> "RedisClusterServers":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
