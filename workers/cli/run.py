"""`pdqueue generate` (the colocated engine in this process, without Redis: the reference)
and `pdqueue worker ROLE` (one worker process): options parsed and checked before torch is
imported, config built, the engine or the worker run.
"""

from __future__ import annotations

import secrets
import sys
import time

import click

from pdqueue.protocol import MAX_SEED
from workers.cli.common import (REQUEST_DEFAULTS, UserError, check_device, check_kv_pool, check_model,
                                engine_options, load, model_option)


@click.command()
@click.argument("prompt")
@model_option
@click.option("--max-tokens", type=click.IntRange(min=1), default=REQUEST_DEFAULTS["max_tokens"], show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=REQUEST_DEFAULTS["temperature"],
              show_default=True, help="0 is greedy.")
@click.option("--top-p", type=click.FloatRange(min=0, min_open=True, max=1), default=REQUEST_DEFAULTS["top_p"],
              show_default=True)
@click.option("--top-k", type=click.IntRange(min=0), default=REQUEST_DEFAULTS["top_k"], show_default=True,
              help="0 is off.")
@click.option("--seed", type=click.IntRange(min=0, max=MAX_SEED), default=None,
              help="Sampling seed [default: random; the seed used is printed on stderr].")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--chat", is_flag=True, help="Apply the model's chat template to PROMPT.")
@engine_options
def generate(prompt, model, max_tokens, temperature, top_p, top_k, seed, stop, chat, device, dtype,
             threads, kv_cache_mb):
    """Generate in this process with the colocated engine, streaming tokens (the reference)."""
    from pdqueue.engine.config import EngineConfig

    check_model(model)
    config = EngineConfig(model=model, device=device, dtype=dtype, num_threads=threads, kv_cache_mb=kv_cache_mb)
    check_device(device)
    check_kv_pool(model, config)
    if seed is None:
        seed = secrets.randbits(63)  # as a prefill worker picks one for a request without a seed
    from pdqueue.engine.llm_engine import LLMEngine
    from pdqueue.engine.sampling import SamplingParams

    loaded = load(model, device, dtype)
    engine = LLMEngine(loaded, config)
    tok = loaded.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    prompt_ids = tok.encode(text)
    reason = engine.check_prompt(len(prompt_ids))
    if reason:
        raise UserError(reason)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=seed, stop=tuple(stop))
    started = time.perf_counter()
    outputs = []

    def show(out):
        outputs.append(out)
        click.echo(out.text, nl=False)
        sys.stdout.flush()

    engine.generate([prompt_ids], params, on_output=show)
    click.echo()
    elapsed = time.perf_counter() - started
    reason = outputs[-1].finish_reason if outputs else "?"
    click.secho(f"[{len(outputs)} tokens in {elapsed:.2f}s, {len(outputs) / elapsed:.1f} tok/s, "
                f"finish: {reason}, seed {seed}]", fg="cyan", err=True)


ROLES = ("prefill", "decode", "colocated")


@click.command()
@click.argument("role", type=click.Choice(ROLES))
@click.option("--redis-url", envvar="PDQ_REDIS_URL", show_envvar=True, default="redis://127.0.0.1:6379/0",
              show_default=True)
@click.option("--cluster", envvar="PDQ_CLUSTER", show_envvar=True, default="default", show_default=True)
@model_option
@engine_options
@click.option("--policy", type=click.Choice(["prefill_first", "chunked"]), default="prefill_first",
              show_default=True, help="Colocated scheduling policy.")
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--max-batched-tokens", type=click.IntRange(min=1), default=2048, show_default=True)
@click.option("--transfer", type=click.Choice(["auto", "shm", "tcp", "zmq"]), default="auto", show_default=True,
              help="How KV reaches the decode side (auto: shm on the same node, else the TCP data wire, "
                   "else zmq).")
@click.option("--bind", default="tcp://127.0.0.1:*", show_default=True,
              help="Prefill: KV server (ZeroMQ) bind address.")
@click.option("--data-port", type=click.IntRange(min=-1, max=65535), default=0, show_default=True,
              help="Prefill: port of the TCP data server for KV on the --bind host (0: any free port; "
                   "-1: none, decode workers on other nodes then use ZeroMQ).")
@click.option("--advertise-host", envvar="PDQ_ADVERTISE_HOST", show_envvar=True, default=None,
              help="Prefill: the host decode workers reach the KV server at (tickets carry it with the "
                   "bound port); 'auto' is the address this machine's hostname resolves to (a container's "
                   "own IP). Default: the bound host, or 'auto' when binding 0.0.0.0 or *.")
@click.option("--lease-s", type=click.FloatRange(min=0.1), default=30.0, show_default=True)
@click.option("--fetch-timeout-s", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
              help="Decode: give up on a silent prefill peer after this long (then recompute).")
@click.option("--heartbeat-ttl-s", type=click.FloatRange(min=0.5), default=10.0, show_default=True,
              help="A worker silent this long is dead; its work is taken over at once.")
@click.option("--reclaim-idle-ms", type=click.IntRange(min=100), default=15000, show_default=True,
              help="Work of a live but hung worker is taken over after this idle time.")
@click.option("--worker-id", default=None, help="Consumer name (a restart with the same id resumes its work).")
@click.option("--burst", is_flag=True, help="Exit when there is nothing left to do.")
@click.option("--switchable", is_flag=True,
              help="Take role switches (pdqueue.control, e.g. from a planner): ROLE is the first role; the "
                   "worker changes role in place, the model staying loaded. Without it, switch commands are "
                   "refused.")
@click.option("--log-level", default="INFO", show_default=True)
def worker(role, redis_url, cluster, model, device, dtype, threads, kv_cache_mb, policy, max_num_seqs,
           max_batched_tokens, transfer, bind, data_port, advertise_host, lease_s, fetch_timeout_s, heartbeat_ttl_s,
           reclaim_idle_ms, worker_id, burst, switchable, log_level):
    """Run one worker process. The first SIGTERM drains, a second one stops now."""
    from pdqueue.engine.config import EngineConfig
    from workers.common import WorkerConfig, setup_logging

    setup_logging(log_level)
    check_model(model)
    engine = EngineConfig(model=model, device=device, dtype=dtype, num_threads=threads, kv_cache_mb=kv_cache_mb,
                          policy=policy, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched_tokens)
    check_device(device)
    check_redis(redis_url)
    check_kv_pool(model, engine)
    config = WorkerConfig(redis_url=redis_url, cluster=cluster, engine=engine, transfer=transfer, bind=bind,
                          data_port=None if data_port < 0 else data_port,
                          advertise=advertised_endpoint(bind, advertise_host),
                          lease_s=lease_s, fetch_timeout_s=fetch_timeout_s, heartbeat_ttl_s=heartbeat_ttl_s,
                          reclaim_idle_ms=reclaim_idle_ms, worker_id=worker_id, burst=burst, switchable=switchable)
    loaded = load(model, device, dtype)
    from workers.shell import make_worker

    w = make_worker(role, config, loaded)
    w.stop.install()
    w.run()


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


def check_redis(url: str) -> None:
    """Fail with one clear line when Redis is not reachable."""
    import redis

    from pdqueue.queue.connection import connect

    try:
        connect(url, purpose="check").ping()
    except (redis.ConnectionError, redis.TimeoutError, ValueError) as exc:
        raise UserError(f"cannot reach Redis at {url}: {exc}") from None
