"""Small things every worker module uses: the configuration, identities, stopping on
signals, periodic timers. (Retrying Redis with capped backoff is ``pdqueue.retry.Backoff``.)

A first SIGTERM/SIGINT asks for a warm stop (finish what is in hand, take nothing new); a
second one asks for a cold stop (leave now; unfinished work stays pending in Redis and is
reclaimed by another worker).
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import threading
import time
from dataclasses import MISSING, dataclass, field, fields

from pdqueue.engine.config import EngineConfig
from pdqueue.protocol import Limits
from pdqueue.transfer import registry as transports

log = logging.getLogger("pdqueue.worker")

TRANSFERS = transports.modes()                       # --transfer: auto or a transport (pdqueue.transfer.registry)
ROUTING_MODES = ("cache", "off")                      # --routing (workers/routing.py)
PLACEMENTS = ("auto", "always", "off")                # --placement (workers/placement.py)
DECODE_HERE = ("auto", "off")                         # --decode-here (workers/prefill.py)
KV_FORMATS = ("native", "fp16", "int8")               # --kv-wire-format, --kv-tier-format (engine/kv_codec.py)
KV_PULL = ("auto", "always", "never")                 # --kv-pull (workers/kv_pull.py, workers/kv_holds.py)


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    redis_url: str = "redis://127.0.0.1:6379/0"
    cluster: str = "default"
    engine: EngineConfig = field(default_factory=EngineConfig)
    routing: str = "cache"          # cache | off: send requests to the worker caching their prefix (workers/routing.py)
    transfer: str = "auto"          # auto or a transport (TRANSFERS): how KV reaches the decode side
    bind: str = "tcp://127.0.0.1:*"  # the prefill worker's KV server (zmq ROUTER)
    data_port: int | None = 0       # its TCP data server on the same host (0: any free port; None: none)
    advertise: str | None = None    # the KV server address put in tickets (":*": the bound port)
    lease_s: float = 30.0           # exported KV is held at most this long for the decode side
    fetch_timeout_s: float = 10.0
    max_batch_requests: int = 16    # requests read per XREADGROUP
    reclaim_idle_ms: int = 15000    # a live but silent consumer's entries idle this long are taken over
    max_step_s: float = 120.0       # a loop iteration running longer is stuck: its entries are no longer kept
    heartbeat_ttl_s: float = 10.0   # a worker silent this long is dead: its entries are taken at once
    redis_gone_exit_s: float = 300.0  # Redis unreachable this long: the worker exits, freeing its memory (0: never)
    max_attempts: int = 3           # recompute attempts before a request is failed
    migrate: bool = True            # decode: a warm stop or switch moves running requests to a peer (migration.py)
    take_prompts: bool = False      # decode: prefill the short prompts prefill workers place here (placement.py)
    placement: str = "auto"         # prefill: auto | always | off: place short prompts on decode workers (placement.py)
    decode_here: str = "off"        # prefill: auto: decode a request here when no decode worker has room (prefill.py)
    worker_id: str | None = None
    burst: bool = False             # exit when there is nothing left to do (tests, batch jobs)
    switchable: bool = False        # takes role switches from control:<id> (pdqueue.control.commands)
    kv_auth: bool = True            # authenticate the KV channels, sign tickets (docs/security.md)
    kv_secret_file: str | None = None   # the cluster's KV secret(s), hex; else PDQ_KV_SECRET, else Redis
    kv_secret: str | None = field(default=None, repr=False)   # the secret(s) once resolved (hex, comma-separated)
    metrics_port: int | None = None  # Prometheus /metrics on this port (0: any free one; None: not served)
    metrics_host: str = "127.0.0.1"  # ... bound on this host (0.0.0.0: every interface)
    metrics_advertise: str | None = None  # the host put in the heartbeat when bound to 0.0.0.0 (None: resolved)
    limits: Limits = field(default_factory=Limits)  # what intake takes from one request (--max-* options)
    # KV that outlives the pool (pdqueue/engine/kv_tiers.py, workers/kv_pool.py): a host-memory tier
    # of this many MiB (0: none) and a disk tier of kv_disk_gb in kv_disk_dir (None: none).
    kv_host_tier_mb: int = 0
    kv_disk_dir: str | None = None
    kv_disk_gb: float = 10.0
    # How KV is encoded (pdqueue/engine/kv_codec.py: native, fp16, int8) in those tiers, and on the
    # network wires when this worker fetches (the TCP data wire, ZeroMQ; shm and NIXL copy native).
    kv_tier_format: str = "native"
    kv_wire_format: str = "native"
    # The next turn pulls the last turn's KV from the worker holding it (workers/kv_pull.py) when
    # cheaper than computing it (auto), always, or never; never also holds nothing (workers/kv_holds.py).
    kv_pull: str = "auto"

    def __post_init__(self) -> None:
        """A bad value is a ValueError naming the field, here rather than deep in a role."""
        def bad(name: str, why: str) -> None:
            raise ValueError(f"WorkerConfig.{name}: {why}, got {getattr(self, name)!r}")

        if not isinstance(self.engine, EngineConfig):
            bad("engine", "must be an EngineConfig")
        if not isinstance(self.limits, Limits):
            bad("limits", "must be a Limits")
        if not self.cluster:
            bad("cluster", "must not be empty")
        if self.routing not in ROUTING_MODES:
            bad("routing", f"must be one of {', '.join(ROUTING_MODES)}")
        if self.transfer not in TRANSFERS:
            bad("transfer", f"must be one of {', '.join(TRANSFERS)}")
        if self.placement not in PLACEMENTS:
            bad("placement", f"must be one of {', '.join(PLACEMENTS)}")
        if self.decode_here not in DECODE_HERE:
            bad("decode_here", f"must be one of {', '.join(DECODE_HERE)}")
        if self.kv_pull not in KV_PULL:
            bad("kv_pull", f"must be one of {', '.join(KV_PULL)}")
        for name in ("data_port", "metrics_port"):
            port = getattr(self, name)
            if port is not None and not (isinstance(port, int) and 0 <= port <= 65535):
                bad(name, "must be None or a port in 0-65535")
        for name in ("lease_s", "fetch_timeout_s", "max_step_s", "heartbeat_ttl_s"):
            if not getattr(self, name) > 0:
                bad(name, "must be > 0 seconds")
        if not self.redis_gone_exit_s >= 0:
            bad("redis_gone_exit_s", "must be >= 0 seconds (0: never)")
        if not (isinstance(self.reclaim_idle_ms, int) and self.reclaim_idle_ms >= 100):
            bad("reclaim_idle_ms", "must be an integer >= 100")
        if not (isinstance(self.kv_host_tier_mb, int) and self.kv_host_tier_mb >= 0):
            bad("kv_host_tier_mb", "must be an integer >= 0")
        if not self.kv_disk_gb >= 0:
            bad("kv_disk_gb", "must be >= 0")
        for name in ("kv_tier_format", "kv_wire_format"):
            if getattr(self, name) not in KV_FORMATS:
                bad(name, f"must be one of {', '.join(KV_FORMATS)}")
        for name in ("max_batch_requests", "max_attempts"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                bad(name, "must be an integer >= 1")


def config_default(name: str, config: type = WorkerConfig):
    """The default of a field of ``config`` (a dataclass): what the CLI's options show, so
    that a default is written once."""
    for f in fields(config):
        if f.name == name:
            if f.default is MISSING:
                raise ValueError(f"{config.__name__}.{name} has no plain default")
            return f.default
    raise AttributeError(f"{config.__name__} has no field {name!r}")


KV_SECRET_ENV = "PDQ_KV_SECRET"


def kv_secrets(config: WorkerConfig, r=None, keys=None) -> tuple[list, str]:
    """The cluster's KV secret(s) (the first signs) and where they came from, first found of:
    ``config.kv_secret`` (already resolved), ``--kv-secret-file``, ``PDQ_KV_SECRET`` (hex),
    the Redis key ``keys.kv_secret`` (created once with SET NX by the first worker: Redis is
    then the trust root). ValueError or OSError when the one given is unusable."""
    from pdqueue.transfer.auth import generate_secret, parse_secrets, read_secret_file, secret_file_too_open

    if config.kv_secret:
        return parse_secrets(config.kv_secret, "the configured KV secret"), "the configuration"
    if config.kv_secret_file:
        if secret_file_too_open(config.kv_secret_file):
            log.warning("KV secret file %s can be read by other users (chmod 600 it)", config.kv_secret_file)
        return read_secret_file(config.kv_secret_file), f"file {config.kv_secret_file}"
    if os.environ.get(KV_SECRET_ENV):
        return parse_secrets(os.environ[KV_SECRET_ENV], KV_SECRET_ENV), KV_SECRET_ENV
    if r is None or keys is None:
        raise ValueError("no KV secret: give --kv-secret-file or PDQ_KV_SECRET, or a Redis connection")
    r.set(keys.kv_secret, generate_secret().hex(), nx=True)
    value = r.get(keys.kv_secret)
    if value is None:
        raise ValueError(f"Redis key {keys.kv_secret} vanished right after SET NX")
    return parse_secrets(value, f"Redis key {keys.kv_secret}"), f"Redis key {keys.kv_secret}"


def kv_auth_for(config: WorkerConfig, r=None, keys=None):
    """The ``KVAuth`` a role gives its KV sender or receiver, or None with ``--kv-auth off``
    (logged as a warning)."""
    if not config.kv_auth:
        log.warning("KV channel authentication is OFF (--kv-auth off): anyone who can reach this worker's "
                    "KV endpoints can fetch KV, and tickets are not checked")
        return None
    from pdqueue.transfer.auth import KVAuth

    secrets_, _source = kv_secrets(config, r, keys)
    return KVAuth(secrets_, config.cluster)


def new_worker_id(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"


def new_incarnation() -> str:
    return secrets.token_hex(8)


class StopFlag:
    """Set by signals: ``warm`` after the first, ``cold`` after the second."""

    def __init__(self):
        self.warm = threading.Event()
        self.cold = threading.Event()

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.warm.is_set():
            log.warning("second signal: stopping now")
            self.cold.set()
        else:
            log.warning("signal %s: finishing work in hand, then stopping (again to stop now)", signum)
            self.warm.set()


def now_ms() -> float:
    return time.time() * 1000.0


class Every:
    """A timer for periodic chores: ``due()`` is True at most once per ``seconds``."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._last = float("-inf")

    def due(self, force: bool = False) -> bool:
        now = time.monotonic()
        if not force and now - self._last < self.seconds:
            return False
        self._last = now
        return True


def tbt_stats(times_ms: list[float]) -> tuple[float, float]:
    """Median and largest gap between consecutive token times."""
    gaps = sorted(b - a for a, b in zip(times_ms, times_ms[1:]))
    if not gaps:
        return 0.0, 0.0
    return gaps[len(gaps) // 2], gaps[-1]


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
