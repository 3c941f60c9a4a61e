"""`pdqueue bench transfer`: KV transfer end to end, beside the limits measured in the same run.

A spawned child plays the prefill side: its pool lives in a ``SharedKVPool`` served by a
``KVSender``; it also serves the same bytes over a raw TCP socket, over gRPC (a generic
handler and a bytes message: what one would write without pdqueue) and through Redis
(pickle, SET). This process plays the decode side: for every size it times, from the
ticket (or request) to the blocks in its own pool,
- ``memcpy``: a plain torch copy of the same number of bytes in one process (the shm limit);
- ``shm``, ``tcp`` and ``zmq``: ``KVReceiver.fetch`` forced to each path (tcp: ZeroMQ's
  fallback's sibling, the TCP data wire that auto mode prefers across hosts), with
  authentication as workers run by default (a cluster secret: signed tickets, authenticated
  channels); ``shm_noauth``, ``tcp_noauth`` and ``zmq_noauth``: the same without it (a second
  sender on the same pool, as ``--kv-auth off``), so that the cost of authentication is
  measured in the same rounds (``auth``: on/off per path at 512 tokens and above, and the
  time to open a connection, handshake included);
- ``raw_socket``: ``sendall`` / ``recv_into`` of the bytes straight into the pool (the limit
  of the network paths);
- ``nixl`` (where NIXL is installed: pdqueue[rdma]; elsewhere skipped, with one line saying
  why and ``skipped`` in the JSON, as for grpc and redis_pickle): ``KVReceiver.fetch`` forced to the nixl
  path (an ``acquire`` over the authenticated ZeroMQ channel, one NIXL READ of the blocks
  straight into the pool, a release), against the authenticated sender, which also runs a
  NIXL agent; the UCX transports it used are read from UCX's own log (``UCX_LOG_LEVEL=info``
  into a file per process) and reported in ``nixl_transports``;
- ``grpc``: gather + ``tobytes`` on the sender, one unary call, ``frombuffer`` + scatter;
- ``redis_pickle``: pickle + SET on the sender, GET + unpickle + scatter here.
Each path gets warm-up runs (the first one is checked bit for bit), then the repeats run
in rounds over all paths so that noise from other processes hits them alike (every other
round in reverse order, so each authenticated path and its unauthenticated twin alternate
which goes first); the median counts. Both processes run torch with one thread, like a
worker started with ``--threads 1``.

Who frees what: the child owns its segment (unlinked on close, and on exit by the parent's
``finally``); the parent owns the Redis server it starts. Imports torch, zmq, redis; grpc
when installed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import threading
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import Callable

import msgpack
import torch

from pdqueue.bench.stats import median
from pdqueue.engine.kv_cache import KVCacheLayout
from pdqueue.transfer import KVAuth, KVReceiver, KVSender, SharedKVPool, Ticket, generate_secret, node_id
from pdqueue.transfer.blocks import copy_blocks, planes
from pdqueue.transfer.nixl import nixl_missing
from pdqueue.transfer.tcp import DataClient
from pdqueue.transfer.zmq import ControlClient

PATHS = ("memcpy", "shm", "shm_noauth", "tcp", "tcp_noauth", "zmq", "zmq_noauth", "nixl", "raw_socket", "grpc",
         "redis_pickle")
AUTH_PATHS = ("shm", "tcp", "zmq")   # each also runs as <path>_noauth
AUTH_FROM_TOKENS = 512               # the auth summary covers these sizes and above
CONNECT_REPEATS = 20                 # fresh connections timed per wire, with and without authentication
BENCH_CLUSTER = "bench"
SMOLLM2 = dict(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype="float32")   # 45 KiB/token
SYNTHETIC = dict(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128, dtype="float32")  # 256 KiB/token
FULL_CASES = {"smollm2": (128, 256, 512, 1024, 2048, 4096), "synthetic": (256, 512, 1024)}   # up to 189/256 MiB
QUICK_CASES = {"smollm2": (128, 512)}
RATIO_AT = ("smollm2", 512)
TARGETS = {"shm_vs_memcpy": 0.8, "zmq_vs_raw_socket": 0.8, "zmq_vs_grpc": 3.0, "tcp_vs_raw_socket": 0.8,
           "nixl_vs_raw_socket": 0.8,
           "shm_auth_vs_noauth": 0.95, "tcp_auth_vs_noauth": 0.95, "zmq_auth_vs_noauth": 0.95}
_GRPC_METHOD = "/pdq.bench.KV/Fetch"
_GRPC_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


def grpc_available() -> bool:
    try:
        import grpc  # noqa: F401
    except ImportError:
        return False
    return True


# -- the prefill side (child process) ----------------------------------------------------

def _peer_main(conn, cfg: dict) -> None:
    torch.set_num_threads(1)
    layout = KVCacheLayout.from_dict(cfg["layout"])
    pool = SharedKVPool.create(layout, cfg["prefix"], cfg["worker_id"], uuid.uuid4().hex[:12])
    try:
        torch.manual_seed(0)
        pool.tensor.uniform_(-1, 1)
        src_planes = planes(pool.tensor)
        auth = KVAuth(bytes.fromhex(cfg["secret"]), BENCH_CLUSTER)
        senders = {True: KVSender.for_shared_pool(pool, cfg["node"], lease_s=120, auth=auth,
                                                  transfer="nixl" if cfg["nixl"] else "auto"),
                   False: KVSender.for_shared_pool(pool, cfg["node"], lease_s=120)}   # as with --kv-auth off
        listener = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=_serve_raw, args=(listener, pool.tensor), daemon=True).start()
        grpc_server, grpc_port = _start_grpc(src_planes) if cfg["grpc"] else (None, None)
        r = None
        if cfg["redis_url"]:
            import redis
            r = redis.Redis.from_url(cfg["redis_url"])
        conn.send({"segment": pool.name, "nonce": pool.nonce,
                   "endpoints": {authed: (s.endpoint, s.data_endpoint) for authed, s in senders.items()},
                   "raw_port": listener.getsockname()[1], "grpc_port": grpc_port})
        while True:
            cmd, *args = conn.recv()
            if cmd == "export":
                sender = senders[args[0]]
                _wait_for_blocks(sender)   # the previous fetch's release is fire-and-forget
                conn.send(sender.export(*args[1:]).to_dict())
            elif cmd == "redis_put":
                key, ids = args
                r.set(key, pickle.dumps(src_planes[:, ids]))
                conn.send("ok")
            elif cmd == "close":
                break
        for sender in senders.values():
            sender.close()
        if grpc_server is not None:
            grpc_server.stop(0)
    finally:
        pool.close()
        conn.send("closed")


def _wait_for_blocks(sender: KVSender) -> None:
    """Hand back released leases, so that the same blocks can be exported again (the engine
    would free them and allocate them to the next request)."""
    deadline = time.monotonic() + 10
    while len(sender.leases) and time.monotonic() < deadline:
        sender.poll_freeable()
        if len(sender.leases):
            time.sleep(0.0005)


def _serve_raw(listener: socket.socket, pool: torch.Tensor) -> None:
    src = memoryview(pool.view(-1).view(torch.uint8).numpy())
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        head = conn.recv(8, socket.MSG_WAITALL)
        if len(head) < 8:
            return
        conn.sendall(src[:int.from_bytes(head, "little")])


def _start_grpc(src_planes: torch.Tensor):
    """The naive way: gather the blocks into a tensor, ``tobytes``, one bytes message."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    def fetch(request: bytes, context) -> bytes:
        return src_planes[:, msgpack.unpackb(request)].numpy().tobytes()

    handler = grpc.method_handlers_generic_handler(
        "pdq.bench.KV", {"Fetch": grpc.unary_unary_rpc_method_handler(fetch)})
    server = grpc.server(ThreadPoolExecutor(max_workers=1), options=_GRPC_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


class Peer:
    """The prefill-side child process (see the module docstring)."""

    def __init__(self, layout: KVCacheLayout, node: str, redis_url: str | None, use_grpc: bool, secret: bytes,
                 use_nixl: bool = False):
        cfg = {"layout": layout.to_dict(), "prefix": f"pdq-kv-bench{uuid.uuid4().hex[:6]}",
               "worker_id": "bench-prefill", "node": node, "redis_url": redis_url, "grpc": use_grpc,
               "secret": secret.hex(), "nixl": use_nixl}
        self.use_nixl = use_nixl
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_peer_main, args=(child, cfg), daemon=True)
        self.proc.start()
        self.info = self.call_timeout(None, 120)

    def call_timeout(self, cmd, timeout: float):
        if cmd is not None:
            self.conn.send(cmd)
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.2):
            if not self.proc.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"transfer bench child did not answer {cmd and cmd[0]!r} "
                                   f"(exit code {self.proc.exitcode})")
        reply = self.conn.recv()
        if reply == "closed" and (cmd is None or cmd[0] != "close"):
            raise RuntimeError("transfer bench child failed (see its traceback above)")
        return reply

    def call(self, *cmd):
        return self.call_timeout(cmd, 120)

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.call("close")
        finally:
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()


# -- the decode side (this process) ------------------------------------------------------

@dataclass
class Case:
    layout_name: str
    num_tokens: int
    layout: KVCacheLayout

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.layout.block_size)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * 2 * self.layout.num_layers * self.layout.block_nbytes


class DecodeSide:
    """Everything this process needs for one layout: pool, receivers, sockets, channels."""

    def __init__(self, peer: Peer, layout: KVCacheLayout, node: str, redis_url: str | None, auth: KVAuth):
        self.peer, self.layout, self.auth = peer, layout, auth
        self.pool = layout.allocate()
        self.pool.fill_(0)   # touch every page now, not inside a timed run
        self.planes = planes(self.pool)
        self.flat = self.pool.view(-1).view(torch.uint8)
        self.receivers = {m: KVReceiver(self.pool, layout, node, mode=m, timeout_s=60, auth=auth) for m in AUTH_PATHS}
        self.receivers.update({f"{m}_noauth": KVReceiver(self.pool, layout, node, mode=m, timeout_s=60)
                               for m in AUTH_PATHS})
        if peer.use_nixl:
            self.receivers["nixl"] = KVReceiver(self.pool, layout, node, mode="nixl", timeout_s=60, auth=auth)
        self.source = SharedKVPool.attach(peer.info["segment"], peer.info["nonce"])   # for checks only
        self.raw = socket.create_connection(("127.0.0.1", peer.info["raw_port"]))
        self.raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.grpc_channel = self.grpc_fetch = None
        if peer.info["grpc_port"]:
            import grpc
            self.grpc_channel = grpc.insecure_channel(f"127.0.0.1:{peer.info['grpc_port']}", options=_GRPC_OPTIONS)
            self.grpc_fetch = self.grpc_channel.unary_unary(_GRPC_METHOD)
        self.redis = None
        if redis_url:
            import redis
            self.redis = redis.Redis.from_url(redis_url)
        self.memcpy_src = self.memcpy_dst = None
        self._seq = 0

    def close(self) -> None:
        for receiver in self.receivers.values():
            receiver.close()
        self.raw.close()
        if self.grpc_channel is not None:
            self.grpc_channel.close()
        if self.redis is not None:
            self.redis.close()
        self.source.close()

    def runner(self, path: str, case: Case) -> Callable[[], float] | None:
        """A function that runs ``path`` once for ``case`` and returns its seconds; None if
        the path is unavailable."""
        ids = list(range(case.num_blocks))
        if path == "memcpy":
            if self.memcpy_src is None or self.memcpy_src.numel() < case.nbytes:
                self.memcpy_src = torch.ones(case.nbytes, dtype=torch.uint8)
                self.memcpy_dst = torch.zeros(case.nbytes, dtype=torch.uint8)
            src, dst = self.memcpy_src[:case.nbytes], self.memcpy_dst[:case.nbytes]
            return lambda: _timed(lambda: dst.copy_(src))
        if path == "nixl" and path not in self.receivers:
            return None   # NIXL is not installed here (``run`` said so and put it in ``skipped``)
        if path in self.receivers:
            receiver, authed = self.receivers[path], not path.endswith("_noauth")

            def fetch() -> float:
                self._seq += 1
                ticket = Ticket.from_dict(self.peer.call("export", authed, f"r{self._seq}", ids, case.num_tokens))
                return _timed(lambda: receiver.fetch(ticket, ids))
            return fetch
        if path == "raw_socket":
            view = memoryview(self.flat.numpy())[:case.nbytes]
            return lambda: _timed(lambda: _raw_fetch(self.raw, view))
        if path == "grpc":
            if self.grpc_fetch is None:
                return None
            request = msgpack.packb(ids)
            return lambda: _timed(lambda: self._scatter(self.grpc_fetch(request), ids))
        if path == "redis_pickle":
            if self.redis is None:
                return None

            def via_redis() -> float:
                self._seq += 1
                key = f"pdq-bench:kv:{self._seq}"
                started = time.perf_counter()
                self.peer.call("redis_put", key, ids)
                copy_blocks(pickle.loads(self.redis.get(key)), range(len(ids)), self.planes, ids)
                seconds = time.perf_counter() - started
                self.redis.delete(key)
                return seconds
            return via_redis
        raise ValueError(f"unknown path {path!r}")

    def _scatter(self, payload: bytes, ids: list[int]) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            src = torch.frombuffer(payload, dtype=self.layout.torch_dtype).view(self.planes.shape[0], len(ids), -1)
        copy_blocks(src, range(len(ids)), self.planes, ids)

    def connect_ms(self) -> dict:
        """Median ms to open a fresh connection to the sender, per wire, with authentication
        (TCP connect + handshake; a ZeroMQ DEALER + handshake) and without (the bare
        connect; a ZeroMQ connect returns at once, the first request pays the rest)."""
        endpoints = self.peer.info["endpoints"]
        out = {}
        for authed in (True, False):
            auth = self.auth if authed else None
            zmq_endpoint, data_endpoint = endpoints[authed]
            tcp_s, zmq_s = [], []
            for _ in range(CONNECT_REPEATS):
                client = DataClient(10, auth)
                tcp_s.append(_timed(lambda: client.connect(data_endpoint)))
                client.close()
                control = ControlClient(10, auth)
                zmq_s.append(_timed(lambda: control.open(zmq_endpoint)))
                control.close()
            suffix = "" if authed else "_noauth"
            out[f"tcp{suffix}"], out[f"zmq{suffix}"] = median(tcp_s) * 1e3, median(zmq_s) * 1e3
        return out

    def clear(self, case: Case) -> None:
        self.planes[:, :case.num_blocks].zero_()

    def check(self, path: str, case: Case) -> None:
        """The bytes that arrived are the sender's (memcpy moves other bytes: nothing to check)."""
        if path == "memcpy":
            return
        if path == "raw_socket":
            ok = torch.equal(self.flat[:case.nbytes], self.source.tensor.view(-1).view(torch.uint8)[:case.nbytes])
        else:
            n = case.num_blocks
            ok = torch.equal(self.planes[:, :n], planes(self.source.tensor)[:, :n])
        if not ok:
            raise AssertionError(f"{path} delivered wrong bytes for {case.layout_name} {case.num_tokens} tokens")


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _raw_fetch(sock: socket.socket, view: memoryview) -> None:
    sock.sendall(len(view).to_bytes(8, "little"))
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("raw socket peer closed")
        got += n


def run(quick: bool = False, repeats: int | None = None, warmup: int | None = None,
        progress: Callable[[str], None] = print) -> dict:
    """Run every case through every path; returns the result object (see ``--json``)."""
    from pdqueue.queue.redis_server import RedisServer

    torch.set_num_threads(1)
    cases_by_layout = QUICK_CASES if quick else FULL_CASES
    repeats = repeats or (3 if quick else 7)
    warmup = warmup or (1 if quick else 2)
    notes: list[str] = []
    skipped: dict[str, str] = {}   # path -> why it was not run (the JSON's ``skipped``)

    def skip(path: str, why: str) -> None:
        skipped[path] = why
        notes.append(f"the {path} path was skipped: {why}")
        progress(f"skipping the {path} path: {why}")

    use_grpc = grpc_available()
    if not use_grpc:
        skip("grpc", "grpcio is not installed; install it with `pip install 'pdqueue[bench]'`")
    server = None
    try:
        server = RedisServer(extra_args=("--proto-max-bulk-len", "1gb")).start()
    except (FileNotFoundError, RuntimeError) as exc:
        skip("redis_pickle", f"no Redis server ({exc})")
    node = node_id()
    secret = generate_secret()
    results, connect = [], []
    missing = nixl_missing()
    use_nixl = missing is None
    if not use_nixl:
        skip("nixl", missing)
    ucx_log = UcxLog() if use_nixl else None
    try:
        for layout_name, token_counts in cases_by_layout.items():
            dims = SMOLLM2 if layout_name == "smollm2" else SYNTHETIC
            max_blocks = -(-max(token_counts) // dims["block_size"])
            layout = KVCacheLayout(num_blocks=max_blocks, **dims)
            progress(f"{layout_name}: starting the prefill-side process ({layout.nbytes / 2**20:.0f} MiB pool)")
            peer = Peer(layout, node, server.url if server else None, use_grpc, secret, use_nixl)
            side = None
            try:
                side = DecodeSide(peer, layout, node, server.url if server else None, KVAuth(secret, BENCH_CLUSTER))
                for num_tokens in token_counts:
                    case = Case(layout_name, num_tokens, layout)
                    progress(f"{layout_name} {num_tokens} tokens ({case.nbytes / 2**20:.1f} MiB)")
                    results.append(_run_case(side, case, repeats, warmup))
                connect.append(side.connect_ms())
            finally:
                if side is not None:
                    side.close()
                peer.close()
    finally:
        if server is not None:
            server.stop()
        transports = ucx_log.close() if ucx_log is not None else None
    result = _result(results, quick, repeats, warmup, notes, connect)
    result["skipped"] = skipped
    result["nixl_transports"] = transports
    return result


class UcxLog:
    """UCX's info log (the lanes it chose per peer: ``rma_am(tcp/lo) am(tcp/lo cma/memory)``,
    ``rma(rc_mlx5/mlx5_0:1)`` over RDMA ...) into a file per process while the bench runs, for
    ``nixl_transports``: the environment is set before any UCX context exists (this process
    and the spawned child read it at their first NIXL agent) and restored by ``close``."""

    KEYS = ("UCX_LOG_LEVEL", "UCX_LOG_FILE")

    def __init__(self):
        import tempfile

        self.dir = tempfile.mkdtemp(prefix="pdq-bench-ucx-")
        self.saved = {k: os.environ.get(k) for k in self.KEYS}
        os.environ["UCX_LOG_LEVEL"] = "info"
        os.environ["UCX_LOG_FILE"] = os.path.join(self.dir, "ucx.%p.log")

    def close(self) -> list[str]:
        """The distinct lane configurations UCX logged (``cfg#`` lines, one per peer kind)."""
        import re
        import shutil

        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        found: list[str] = []
        for name in sorted(os.listdir(self.dir)):
            with open(os.path.join(self.dir, name), errors="replace") as f:
                for line in f:
                    m = re.search(r"(intra-node|inter-node|self) cfg#\d+ (.*)$", line)
                    if m and f"{m.group(1)}: {m.group(2).strip()}" not in found:
                        found.append(f"{m.group(1)}: {m.group(2).strip()}")
        shutil.rmtree(self.dir, ignore_errors=True)
        return found


def _run_case(side: DecodeSide, case: Case, repeats: int, warmup: int) -> dict:
    runners = {p: side.runner(p, case) for p in PATHS}
    runners = {p: fn for p, fn in runners.items() if fn is not None}
    for path, fn in runners.items():
        side.clear(case)
        fn()
        side.check(path, case)
        for _ in range(warmup - 1):
            fn()
    seconds: dict[str, list[float]] = {p: [] for p in runners}
    for round_ in range(repeats):
        order = list(runners) if round_ % 2 == 0 else list(reversed(runners))   # on/off twins alternate
        for path in order:
            seconds[path].append(runners[path]())
    row = {"layout": case.layout_name, "tokens": case.num_tokens, "bytes": case.nbytes, "paths": {}}
    for path, values in seconds.items():
        s = median(values)
        row["paths"][path] = {"ms": s * 1e3, "gb_s": case.nbytes / s / 1e9, "ms_all": [v * 1e3 for v in values]}
    return row


def ratios_of(row: dict) -> dict:
    p = row["paths"]

    def ratio(a: str, b: str):
        return p[a]["gb_s"] / p[b]["gb_s"] if a in p and b in p else None

    return {"shm_vs_memcpy": ratio("shm", "memcpy"), "zmq_vs_raw_socket": ratio("zmq", "raw_socket"),
            **{f"{m}_auth_vs_noauth": ratio(m, f"{m}_noauth") for m in AUTH_PATHS},
            "zmq_vs_grpc": ratio("zmq", "grpc"), "tcp_vs_raw_socket": ratio("tcp", "raw_socket"),
            "tcp_vs_grpc": ratio("tcp", "grpc"), "tcp_vs_zmq": ratio("tcp", "zmq"), "shm_vs_grpc": ratio("shm", "grpc"),
            "nixl_vs_raw_socket": ratio("nixl", "raw_socket"), "nixl_vs_tcp": ratio("nixl", "tcp"),
            "zmq_vs_redis_pickle": ratio("zmq", "redis_pickle"), "shm_vs_zmq": ratio("shm", "zmq")}


def _result(rows: list[dict], quick: bool, repeats: int, warmup: int, notes: list[str],
            connect: list[dict] | None = None) -> dict:
    at = next(r for r in rows if (r["layout"], r["tokens"]) == RATIO_AT)
    for row in rows:
        row["ratios"] = ratios_of(row)
    return {
        "bench": "transfer", "quick": quick, "repeats": repeats, "warmup": warmup,
        "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "layouts": {"smollm2": SMOLLM2, "synthetic": SYNTHETIC},
        "ratios_at": {"layout": RATIO_AT[0], "tokens": RATIO_AT[1], "bytes": at["bytes"]},
        "ratios": at["ratios"], "targets": TARGETS, "sizes": rows, "notes": notes,
        "auth": auth_summary(rows, connect or []),
    }


def auth_summary(rows: list[dict], connect: list[dict]) -> dict:
    """Authentication on vs off: per path, the on/off throughput ratio of every size of at
    least AUTH_FROM_TOKENS tokens and their median; the same ratio taken round by round
    (``paired``: off ms / on ms of the same round, whose two runs were adjacent in time, so
    slow drifts of the machine's load cancel out), median over every such round; and the
    median ms to open a connection (handshake included when on), over the layouts run."""
    big = [r for r in rows if r["tokens"] >= AUTH_FROM_TOKENS]
    ratios = {m: [r["ratios"][f"{m}_auth_vs_noauth"] for r in big
                  if r["ratios"].get(f"{m}_auth_vs_noauth") is not None] for m in AUTH_PATHS}
    paired = {m: [off / on for r in big if m in r["paths"] and f"{m}_noauth" in r["paths"]
                  for on, off in zip(r["paths"][m]["ms_all"], r["paths"][f"{m}_noauth"]["ms_all"])]
              for m in AUTH_PATHS}
    return {"from_tokens": AUTH_FROM_TOKENS,
            "ratios": {m: values for m, values in ratios.items()},
            "median_ratio": {m: median(values) if values else None for m, values in ratios.items()},
            "paired_ratio": {m: median(values) if values else None for m, values in paired.items()},
            "connect_ms": {k: median([c[k] for c in connect]) for k in (connect[0] if connect else {})}}


def missed_targets(result: dict) -> list[str]:
    """Names of the ratios below their target (a ratio that could not be measured is not
    counted as missed)."""
    return [name for name, target in result["targets"].items()
            if result["ratios"].get(name) is not None and result["ratios"][name] < target]


def format_table(result: dict) -> str:
    paths = [p for p in PATHS if any(p in r["paths"] for r in result["sizes"]) and not p.endswith("_noauth")]
    lines = ["GB/s (median ms) per path; end to end: ticket/request -> blocks in the receiving pool",
             f"{'layout':<10}{'tokens':>7}{'MiB':>8}  " + "".join(f"{p:>20}" for p in paths)]
    for row in result["sizes"]:
        cells = []
        for p in paths:
            v = row["paths"].get(p)
            cells.append(f"{v['gb_s']:7.2f} ({v['ms']:8.2f})" if v else f"{'-':>20}")
        lines.append(f"{row['layout']:<10}{row['tokens']:>7}{row['bytes'] / 2**20:>8.1f}  "
                     + "".join(f"{c:>20}" for c in cells))
    at = result["ratios_at"]
    lines.append(f"ratios at {at['layout']} {at['tokens']} tokens ({at['bytes'] / 2**20:.1f} MiB):")
    for name, value in result["ratios"].items():
        target = result["targets"].get(name)
        verdict = "" if target is None or value is None else (
            f"  (target >= {target}x: {'met' if value >= target else 'NOT met'})")
        lines.append(f"  {name:<22} " + ("n/a" if value is None else f"{value:.2f}x") + verdict)
    auth = result.get("auth")
    if auth:
        lines.append(f"authentication on vs off (GB/s on / off = ratio; target >= 0.95x), "
                     f"sizes of {auth['from_tokens']} tokens and above:")
        for row in result["sizes"]:
            if row["tokens"] < auth["from_tokens"]:
                continue
            cells = []
            for m in AUTH_PATHS:
                on, off = row["paths"].get(m), row["paths"].get(f"{m}_noauth")
                cells.append(f"{m} {on['gb_s']:.2f}/{off['gb_s']:.2f} = {on['gb_s'] / off['gb_s']:.2f}x"
                             if on and off else f"{m} -")
            lines.append(f"  {row['layout']:<10}{row['tokens']:>6}  " + "   ".join(cells))
        lines.append("  median ratio: " + "   ".join(
            f"{m} " + ("n/a" if v is None else f"{v:.2f}x") for m, v in auth["median_ratio"].items()))
        lines.append("  paired, round by round: " + "   ".join(
            f"{m} " + ("n/a" if v is None else f"{v:.2f}x") for m, v in auth["paired_ratio"].items()))
        if auth["connect_ms"]:
            c = auth["connect_ms"]
            lines.append(f"  opening a connection (median ms): tcp {c['tcp']:.2f} with the handshake, "
                         f"{c['tcp_noauth']:.2f} without; zmq {c['zmq']:.2f} with, {c['zmq_noauth']:.2f} without "
                         "(once per sender and receiver pair)")
    big = [r for r in result["sizes"] if r["tokens"] >= AUTH_FROM_TOKENS and "nixl" in r["paths"]
           and "raw_socket" in r["paths"]]
    if big:
        lines.append("nixl vs raw_socket (target >= 0.8x), 512 tokens and above: " + "   ".join(
            f"{r['layout']} {r['tokens']} {r['paths']['nixl']['gb_s'] / r['paths']['raw_socket']['gb_s']:.2f}x"
            for r in big))
    if result.get("nixl_transports"):
        lines.append("nixl: UCX lanes used (from UCX's log): " + "; ".join(result["nixl_transports"]))
    lines.extend(f"note: {n}" for n in result["notes"])
    return "\n".join(lines)
