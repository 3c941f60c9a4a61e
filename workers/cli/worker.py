"""`pdqueue worker ROLE`: one worker process. Options parsed and checked before torch is
imported (the model, the device, the KV pool, Redis, the metrics port, the KV secret), the
``WorkerConfig`` built, the model loaded and the worker run.
"""

from __future__ import annotations

import sys

import click

from pdqueue.engine.config import EngineConfig
from pdqueue.protocol import ROLES
from pdqueue.transfer import registry as transports
from workers.cli.common import (
    UserError,
    check_device,
    check_engine_config,
    check_kv_pool,
    check_model,
    engine_options,
    load,
    model_option,
    redis_security_options,
)
from workers.common import (
    DECODE_HERE,
    KV_FORMATS,
    KV_PULL,
    PLACEMENTS,
    ROUTING_MODES,
    TRANSFERS,
    WorkerConfig,
    config_default,
)


def limit_options(f):
    """The ``--max-*`` options (``pdqueue.protocol.Limits``), handed to the command as one
    ``limits`` argument."""
    import functools

    from pdqueue import protocol as p

    names = ("max_entry_bytes", "max_prompt_chars", "max_prompt_tokens", "max_output_tokens", "max_stop_strings",
             "max_stop_chars")

    @functools.wraps(f)
    def command(*args, **kwargs):
        return f(*args, limits=p.Limits(**{name: kwargs.pop(name) for name in names}), **kwargs)

    for opt in reversed([
        click.option("--max-entry-bytes", type=click.IntRange(min=1), default=p.MAX_ENTRY_BYTES, show_default=True,
                     help="Prefill, colocated: a request entry larger than this (field names and values) is refused "
                          "(error too_long, dead-lettered) before it is parsed."),
        click.option("--max-prompt-chars", type=click.IntRange(min=1), default=p.MAX_PROMPT_CHARS, show_default=True,
                     help="Prefill, colocated: longest prompt (or messages' contents) in characters, checked before "
                          "tokenizing."),
        click.option("--max-prompt-tokens", type=click.IntRange(min=1), default=None,
                     help="Prefill, colocated: longest prompt in tokens [default: the model's context and KV pool]."),
        click.option("--max-output-tokens", type=click.IntRange(min=1), default=None,
                     help="Prefill, colocated: largest max_tokens a request may ask for [default: none; the output "
                          "still ends at the model's context]."),
        click.option("--max-stop-strings", type=click.IntRange(min=0), default=p.MAX_STOP_STRINGS, show_default=True,
                     help="Prefill, colocated: most stop strings in one request."),
        click.option("--max-stop-chars", type=click.IntRange(min=1), default=p.MAX_STOP_CHARS, show_default=True,
                     help="Prefill, colocated: longest stop string in characters."),
    ]):
        command = opt(command)
    return command


@click.command()
@click.argument("role", type=click.Choice(ROLES))
@click.option("--redis-url", envvar="PDQ_REDIS_URL", show_envvar=True, default=config_default("redis_url"),
              show_default=True, help="redis://[USER:PASSWORD@]HOST:PORT/DB (rediss:// for TLS); a password is "
                                      "better kept out of `ps`: --redis-password-file or PDQ_REDIS_PASSWORD.")
@redis_security_options
@click.option("--cluster", envvar="PDQ_CLUSTER", show_envvar=True, default=config_default("cluster"), show_default=True)
@model_option
@engine_options
@click.option("--policy", type=click.Choice(["prefill_first", "chunked"]), default="prefill_first",
              show_default=True, help="Colocated scheduling policy.")
@click.option("--tbt-slo-ms", type=click.FloatRange(min=0, min_open=True), default=None,
              help="With --policy chunked: the inter-token gap (p90 of each request's) to keep while prompts "
                   "are prefilled beside running decodes; a step then takes only the prompt tokens that fit, "
                   "or what fits in 1.5 targets while every running request can still afford a slow gap (the "
                   "engine's scheduler). Default: none (chunks fill --max-batched-tokens).")
@click.option("--ttft-slo-ms", type=click.FloatRange(min=0, min_open=True), default=None,
              help="A TTFT target: prompts whose first token can no longer come within it of their request's "
                   "enqueue time wait behind those that still can, and the worker keeps reading the request "
                   "streams past them (up to --max-batch-requests of them held). Default: none (arrival order).")
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=config_default("max_num_seqs", EngineConfig),
              show_default=True)
@click.option("--max-batched-tokens", type=click.IntRange(min=1),
              default=config_default("max_num_batched_tokens", EngineConfig), show_default=True)
@click.option("--transfer", type=click.Choice(TRANSFERS), default=config_default("transfer"),
              show_default=True,
              help=transports.help_text())
@click.option("--routing", type=click.Choice(ROUTING_MODES), envvar="PDQ_ROUTING", show_envvar=True,
              default=config_default("routing"), show_default=True,
              help="Prefill, colocated: cache-aware routing (cache: a request goes to the worker that caches the "
                   "longest part of its prompt unless that worker is much busier; off: first come, first served).")
@click.option("--bind", default=config_default("bind"), show_default=True,
              help="Prefill: KV server (ZeroMQ) bind address.")
@click.option("--data-port", type=click.IntRange(min=-1, max=65535), default=0, show_default=True,
              help="Prefill: port of the TCP data server for KV on the --bind host (0: any free port; "
                   "-1: none, decode workers on other nodes then use ZeroMQ).")
@click.option("--advertise-host", envvar="PDQ_ADVERTISE_HOST", show_envvar=True, default=None,
              help="Prefill: the host decode workers reach the KV server at (tickets carry it with the "
                   "bound port); 'auto' is the address this machine's hostname resolves to (a container's "
                   "own IP). Default: the bound host, or 'auto' when binding 0.0.0.0 or *.")
@click.option("--lease-s", type=click.FloatRange(min=0.1), default=config_default("lease_s"), show_default=True)
@click.option("--fetch-timeout-s", type=click.FloatRange(min=0.1), default=config_default("fetch_timeout_s"),
              show_default=True,
              help="Decode: give up on a silent prefill peer after this long (then recompute).")
@click.option("--heartbeat-ttl-s", type=click.FloatRange(min=0.5), default=config_default("heartbeat_ttl_s"),
              show_default=True,
              help="A worker silent this long is dead; its work is taken over at once.")
@click.option("--reclaim-idle-ms", type=click.IntRange(min=100), default=config_default("reclaim_idle_ms"),
              show_default=True,
              help="Work of a live but hung worker is taken over after this idle time.")
@click.option("--max-step-s", type=click.FloatRange(min=0.1), default=config_default("max_step_s"),
              show_default=True,
              help="A worker loop iteration (an engine step) running longer than this is taken for stuck: its "
                   "work is then taken over --reclaim-idle-ms later. Shorter steps keep their work however long "
                   "they take.")
@click.option("--redis-gone-exit-s", type=click.FloatRange(min=0), default=config_default("redis_gone_exit_s"),
              show_default=True,
              help="Exit (status 75) once Redis has been unreachable this long, freeing the KV pool and its "
                   "shared memory; what the worker held stays pending in Redis for the next worker. Outages shorter "
                   "than this (a Redis restart, a failover) are ridden out. 0: retry for ever.")
@click.option("--migrate/--no-migrate", default=config_default("migrate"), show_default=True,
              help="Decode, colocated: on a warm stop or a role switch, hand the running requests to a decode worker "
                   "with their KV and tokens so far (they go on token for token), instead of finishing them here. "
                   "Only while such a worker takes work; otherwise they finish here.")
@click.option("--take-prompts/--no-take-prompts", default=config_default("take_prompts"), show_default=True,
              help="Decode: also prefill short prompts that prefill workers place here when this worker would "
                   "give their first token sooner (workers/placement.py), in the share of each step the TBT "
                   "budget leaves (use with --policy chunked --tbt-slo-ms).")
@click.option("--placement", type=click.Choice(PLACEMENTS), default=config_default("placement"), show_default=True,
              help="Prefill: where short prompts are prefilled. auto: on a decode worker started with "
                   "--take-prompts when its first token would come sooner there (by both workers' measured step "
                   "costs); always: there whenever it has a free slot; off: here.")
@click.option("--decode-here", type=click.Choice(DECODE_HERE), default=config_default("decode_here"), show_default=True,
              help="Prefill: auto decodes a request in this worker, after its first token, when every live decode "
                   "worker is full (no free slot or KV); off always hands it over (it waits for room).")
@click.option("--worker-id", default=None, help="Consumer name (a restart with the same id resumes its work).")
@click.option("--burst", is_flag=True, help="Exit when there is nothing left to do.")
@click.option("--switchable", is_flag=True,
              help="Take role switches (pdqueue.control.commands, e.g. from a planner): ROLE is the first role; the "
                   "worker changes role in place, the model staying loaded. Without it, switch commands are "
                   "refused.")
@click.option("--kv-auth", type=click.Choice(["on", "off"]), envvar="PDQ_KV_AUTH", show_envvar=True, default="on",
              show_default=True,
              help="Authenticate the KV channels (TCP data wire, ZeroMQ) with the cluster secret and sign "
                   "tickets (docs/security.md). Off: anyone who reaches the KV ports can fetch KV (a warning).")
@click.option("--kv-secret-file", envvar="PDQ_KV_SECRET_FILE", show_envvar=True, default=None,
              type=click.Path(dir_okay=False),
              help="The cluster's KV secret: hex (e.g. `openssl rand -hex 32`), several for a rotation (the first "
                   "signs). Default: env PDQ_KV_SECRET (hex), else the Redis key pdq:{CLUSTER}:kv_secret, created "
                   "by the first worker (Redis is then the trust root).")
@click.option("--metrics-port", envvar="PDQ_METRICS_PORT", show_envvar=True, type=click.IntRange(min=0, max=65535),
              default=0, show_default=True,
              help="Prometheus /metrics on this port (0: any free port); the heartbeat advertises it as `metrics`.")
@click.option("--metrics-host", envvar="PDQ_METRICS_HOST", show_envvar=True, default=None,
              help="Host the metrics server binds [default: the --bind host]; 0.0.0.0 listens on every interface "
                   "and advertises --advertise-host, else this machine's address.")
@click.option("--no-metrics", is_flag=True, help="Serve no metrics endpoint.")
@click.option("--kv-host-tier-mb", type=click.IntRange(min=0), default=config_default("kv_host_tier_mb"),
              show_default=True,
              help="A host-memory tier under the prefix cache, this many MiB: a cached KV block evicted from the "
                   "pool is copied there, and a later request with that prefix (a conversation's next turn) "
                   "copies it back instead of computing it again. 0: none.")
@click.option("--kv-disk-dir", type=click.Path(file_okay=False), default=None,
              help="A disk tier under the host tier (or the pool): a file per KV block under DIR/<prefix root>/, "
                   "read again by a worker restarted with the same DIR (a clean stop writes the pool's cached "
                   "blocks there). Another model, weights, dtype or block size never matches. Default: none.")
@click.option("--kv-disk-gb", type=click.FloatRange(min=0), default=config_default("kv_disk_gb"), show_default=True,
              help="With --kv-disk-dir: the disk tier's bound (least recently used files go first).")
@click.option("--kv-tier-format", type=click.Choice(KV_FORMATS), envvar="PDQ_KV_TIER_FORMAT", show_envvar=True,
              default=config_default("kv_tier_format"), show_default=True,
              help="How the KV tiers store blocks: native (the pool's dtype, exact), fp16 (half the bytes of a "
                   "float32 pool), int8 (K scaled per channel, V per token: 0.28 of float32's). A disk file "
                   "records its format; one of another format is read as what it is. What each costs in tokens: "
                   "pdqueue bench quality.")
@click.option("--kv-wire-format", type=click.Choice(KV_FORMATS), envvar="PDQ_KV_WIRE_FORMAT", show_envvar=True,
              default=config_default("kv_wire_format"), show_default=True,
              help="Decode: the format this worker asks KV in over the network paths (the TCP data wire, "
                   "ZeroMQ): native, fp16 (half the bytes of a float32 pool), int8 (0.28 of them). Senders "
                   "encode what is asked (an older one sends native, read as such); shm on one node copies "
                   "native (encoding costs more than it saves there), nixl reads native.")
@click.option("--kv-pull", type=click.Choice(KV_PULL), default=config_default("kv_pull"), show_default=True,
              help="A conversation's next turn pulls the history another worker holds (the last turn's KV, kept "
                   "exported a while by the worker that decoded it) instead of computing it: auto when the "
                   "measured pull is cheaper than the compute, always, or never (never: this worker also keeps "
                   "no finished request's KV exported for others).")
@limit_options
@click.option("--log-level", default="INFO", show_default=True)
def worker(role, redis_url, cluster, model, device, dtype, threads, kv_cache_mb, prefix_caching, weights, cuda_graphs,
           policy, tbt_slo_ms, ttft_slo_ms, max_num_seqs, max_batched_tokens, transfer, routing, bind, data_port,
           advertise_host, lease_s, fetch_timeout_s, heartbeat_ttl_s, reclaim_idle_ms, max_step_s, redis_gone_exit_s,
           migrate, take_prompts, placement, decode_here, worker_id, burst, switchable, kv_auth, kv_secret_file,
           metrics_port, metrics_host, no_metrics, kv_host_tier_mb, kv_disk_dir, kv_disk_gb, kv_tier_format,
           kv_wire_format, kv_pull, limits, log_level):
    """Run one worker process. The first SIGTERM drains, a second one stops now."""
    from workers.common import setup_logging

    setup_logging(log_level)
    check_model(model)
    engine = check_engine_config(model=model, device=device, dtype=dtype, num_threads=threads,
                                 kv_cache_mb=kv_cache_mb, policy=policy, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max_batched_tokens, prefix_caching=prefix_caching,
                                 cuda_graphs=cuda_graphs, weights=weights, tbt_slo_ms=tbt_slo_ms,
                                 ttft_slo_ms=ttft_slo_ms)
    check_device(device)
    check_transfer(transfer)
    check_kv_formats(engine, transfer, kv_tier_format, kv_wire_format, bool(kv_host_tier_mb or kv_disk_dir))
    check_redis(redis_url)
    check_kv_pool(model, engine)
    config = WorkerConfig(redis_url=redis_url, cluster=cluster, engine=engine, transfer=transfer, routing=routing,
                          bind=bind,
                          data_port=None if data_port < 0 else data_port,
                          advertise=advertised_endpoint(bind, advertise_host),
                          lease_s=lease_s, fetch_timeout_s=fetch_timeout_s, heartbeat_ttl_s=heartbeat_ttl_s,
                          reclaim_idle_ms=reclaim_idle_ms, max_step_s=max_step_s,
                          redis_gone_exit_s=redis_gone_exit_s, migrate=migrate, take_prompts=take_prompts,
                          placement=placement, decode_here=decode_here,
                          worker_id=worker_id, burst=burst, switchable=switchable,
                          metrics_port=None if no_metrics else metrics_port,
                          metrics_host=metrics_host or bind_host(bind), metrics_advertise=advertise_host,
                          limits=limits, kv_host_tier_mb=kv_host_tier_mb, kv_disk_dir=kv_disk_dir,
                          kv_disk_gb=kv_disk_gb, kv_tier_format=kv_tier_format, kv_wire_format=kv_wire_format,
                          kv_pull=kv_pull)
    if config.metrics_port:
        check_port_free(config.metrics_host, config.metrics_port, "--metrics-port")
    config = with_kv_auth(config, kv_auth, kv_secret_file)
    loaded = load(model, device, dtype, weights)
    from workers.shell import EXIT_REDIS_GONE, RedisGone, make_worker

    w = make_worker(role, config, loaded)
    w.stop.install()
    try:
        w.run()
    except RedisGone:   # logged, everything closed: the status tells a supervisor why
        exit_now(EXIT_REDIS_GONE)
    exit_now(0)


def exit_now(code: int) -> None:
    """End a worker process that has closed everything it owns (its streams' entries, KV
    segment, ports, heartbeat): the other threads are joined and the atexit handlers run
    (logging's flush among them), as at a normal exit, but the interpreter's teardown with
    torch loaded is skipped: it was the larger part of every warm stop, and frees nothing the
    operating system would not."""
    import atexit
    import os
    import threading

    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def bind_host(bind: str) -> str:
    """The host of a ``tcp://HOST:PORT`` bind address (``*``: 0.0.0.0), the metrics server's
    default host; 127.0.0.1 for any other scheme."""
    scheme, _, rest = bind.partition("://")
    host = rest.rpartition(":")[0].strip("[]")
    if scheme != "tcp" or not host:
        return "127.0.0.1"
    return "0.0.0.0" if host == "*" else host


def check_port_free(host: str, port: int, option: str) -> None:
    """Fail with one line, before the model loads, when ``host:port`` cannot be bound."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise UserError(f"{option} {port}: cannot listen on {host}:{port} ({exc.strerror})") from None


def with_kv_auth(config, kv_auth: str, secret_file: str | None):
    """``config`` with the KV channel's settings, the secret resolved now (before the model
    loads: one line when it is unusable) and where it came from logged."""
    import dataclasses
    import logging

    import redis

    from pdqueue.keys import Keys
    from pdqueue.queue.connection import connect
    from workers.common import kv_secrets

    if kv_auth == "off":
        return dataclasses.replace(config, kv_auth=False)   # each role warns when it starts
    config = dataclasses.replace(config, kv_auth=True, kv_secret_file=secret_file)
    r = connect(config.redis_url, purpose="check")
    try:
        keys, source = kv_secrets(config, r, Keys(config.cluster))
    except OSError as exc:
        raise UserError(f"--kv-secret-file {secret_file}: {exc.strerror or exc}") from None
    except (ValueError, redis.RedisError) as exc:
        raise UserError(f"KV secret: {exc}") from None
    finally:
        r.close()
    logging.getLogger("pdqueue.worker").info("KV channels authenticated: cluster %s, secret from %s",
                                             config.cluster, source)
    return dataclasses.replace(config, kv_secret=",".join(k.hex() for k in keys))


def advertised_endpoint(bind: str, host: str | None) -> str | None:
    """The KV address for tickets: ``tcp://HOST:*`` (the sender fills in the bound port), or
    None to advertise the bound address itself."""
    import socket

    scheme, _, rest = bind.partition("://")
    bind_host, _, port = rest.rpartition(":")
    if scheme != "tcp" or (host is None and bind_host not in ("0.0.0.0", "*", "[::]", "::")):
        return None
    if host in (None, "auto"):
        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError as exc:
            raise UserError(f"--advertise-host auto: cannot resolve this machine's hostname ({exc})") from None
    return f"tcp://{host}:{port}"


def check_transfer(transfer: str) -> None:
    """A transport that cannot run here (--transfer nixl without NIXL, pdqueue[rdma]): say so at
    start, not at the first handoff."""
    missing = transports.missing(transfer)
    if missing:
        raise UserError(f"--transfer {transfer}: {missing}")


def check_kv_formats(engine, transfer: str, tier_format: str, wire_format: str, has_tier: bool) -> None:
    """KV formats that cannot apply here, refused at start with one line: fp16 of a pool
    that is 16-bit already (it would stay as it is), a wire format with a transport that
    moves native KV only, a tier format without a tier."""
    for option, fmt in (("--kv-tier-format", tier_format), ("--kv-wire-format", wire_format)):
        if fmt == "fp16" and engine.dtype in ("float16", "bfloat16"):
            raise UserError(f"{option} fp16: the KV pool is {engine.dtype} already (16 bits): it would stay as it "
                            "is; use native or int8")
    if wire_format != "native" and transfer != transports.AUTO and not transports.encodes(transfer):
        raise UserError(f"--kv-wire-format {wire_format}: --transfer {transfer} moves native KV only (formats apply "
                        "to the tcp and zmq paths; auto uses them off this node)")
    if tier_format != "native" and not has_tier:
        raise UserError(f"--kv-tier-format {tier_format}: there is no KV tier to store in (--kv-host-tier-mb, "
                        "--kv-disk-dir)")


def check_redis(url: str) -> None:
    """Fail with one clear line when Redis is not reachable."""
    import redis

    from pdqueue.config import redact_url
    from pdqueue.queue.connection import check_mode, connect

    try:
        r = connect(url, purpose="check")
        r.ping()
        check_mode(r, url)   # a redis:// URL of a Redis Cluster node: say redis+cluster://
    except (redis.RedisError, ValueError, OSError) as exc:   # a wrong password or a missing right too
        raise UserError(f"cannot reach Redis at {redact_url(url)}: {str(exc).rstrip('.')}") from None
