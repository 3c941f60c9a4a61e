"""The `pdqueue` command: click commands that parse options, build config and call into
the library or the worker modules. Defaults come from the environment (PDQ_REDIS_URL,
PDQ_CLUSTER, PDQ_MODEL). User errors print one red line on stderr and exit 1.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import sys
import time
from contextlib import contextmanager

import click

from pdqueue.engine.config import DEFAULT_KV_CACHE_MB
from pdqueue.protocol import MAX_SEED, Request

DEFAULT_MODEL = "smollm2"
# Sampling defaults of `generate` (and `submit`): the protocol's request defaults, which
# are also Client.submit's (max_tokens 128, temperature 1.0 as in OpenAI's API).
REQUEST_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Request)}


class UserError(click.ClickException):
    """A mistake the user can fix: one red line, exit status 1, no traceback."""

    def show(self, file=None):
        click.secho(f"error: {self.format_message()}", fg="red", err=True)


def model_option(f):
    return click.option("--model", envvar="PDQ_MODEL", show_envvar=True, default=DEFAULT_MODEL, show_default=True,
                        help="smollm2, tiny, or a path (.gguf file or Hugging Face directory).")(f)


def engine_options(f):
    for opt in reversed([
        click.option("--device", default="cpu", show_default=True, help="torch device (cpu, cuda, cuda:1)."),
        click.option("--dtype", default="float32", show_default=True,
                     type=click.Choice(["float32", "bfloat16", "float16"])),
        click.option("--threads", type=click.IntRange(min=1), default=None,
                     help="torch threads [default: torch's choice]."),
        click.option("--kv-cache-mb", type=click.IntRange(min=1), default=DEFAULT_KV_CACHE_MB, show_default=True,
                     help="KV pool size in MiB (SmolLM2 in float32 needs 360 for one 8192-token sequence)."),
    ]):
        f = opt(f)
    return f


@contextmanager
def model_errors():
    """A model that cannot be used becomes one line (``--model X: why``)."""
    from pdqueue.models.source import ModelSourceError

    try:
        yield
    except ModelSourceError as exc:
        raise UserError(f"--model {exc.name}: {exc.reason}") from None
    except (FileNotFoundError, ValueError, NotImplementedError) as exc:
        raise UserError(str(exc)) from None


def check_model(model: str) -> None:
    """Fail in milliseconds, before torch is imported or anything started, when ``model``
    names no usable model (pdqueue.models.source reads a few bytes, without torch)."""
    from pdqueue.models.source import resolve_model_path

    with model_errors():
        resolve_model_path(model)


def check_kv_pool(model: str, config) -> None:
    """Before loading the weights: an error when the pool cannot hold one KV block, a
    warning when it cannot hold one sequence of the model's whole context."""
    from pdqueue.models.loader import model_config_for

    with model_errors():
        model_config = model_config_for(model)
    try:
        shortfall = config.pool_shortfall(model_config)
    except ValueError as exc:
        raise UserError(f"--kv-cache-mb: {exc}") from None
    if shortfall:
        click.secho(f"warning: --kv-cache-mb: {shortfall}", fg="yellow", err=True)


def load(model: str, device: str, dtype: str):
    """Load a model with a progress line on stderr (dequantizing takes a while)."""
    import torch  # noqa: F401  (imported here so that `pdqueue --help` stays fast)

    from pdqueue.engine.kv_cache import dtype_from_name
    from pdqueue.models.loader import load_model

    click.secho(f"loading {model} on {device} ({dtype}) ...", fg="cyan", err=True)
    started = time.perf_counter()
    with model_errors():
        loaded = load_model(model, device=device, dtype=dtype_from_name(dtype))
    click.secho(f"loaded in {time.perf_counter() - started:.1f}s", fg="cyan", err=True)
    return loaded


def check_device(device: str) -> None:
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device}: no CUDA device is available on this machine")


class Group(click.Group):
    """Usage errors (a bad option, a missing argument) as one red line and exit status 1,
    like every other user error, instead of click's usage block and status 2."""

    group_class = type  # subgroups (``bench``) are of this class too

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.exceptions.NoArgsIsHelpError:
            raise
        except click.UsageError as exc:
            raise _usage_error(exc) from None

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.exceptions.NoArgsIsHelpError:
            raise
        except click.UsageError as exc:
            raise _usage_error(exc) from None


def _usage_error(exc: click.UsageError) -> UserError:
    where = f" (see: {exc.ctx.command_path} --help)" if exc.ctx is not None else ""
    return UserError(f"{exc.format_message()}{where}")


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="pdqueue")
def cli():
    """pdqueue: LLM serving with prefill and decode disaggregated over Redis Streams."""


@cli.command()
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


@cli.group()
def bench():
    """Benchmarks: they compare against baselines measured in the same run."""


@bench.command("engine")
@model_option
@engine_options
@click.option("--prompt-lens", default="128,512,2048", show_default=True)
@click.option("--batch-sizes", default="1,8,32", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_engine(model, device, dtype, threads, kv_cache_mb, prompt_lens, batch_sizes, as_json):
    """Prefill tokens/s and decode ms/step beside the memory-bandwidth bound."""
    from pdqueue.engine.config import EngineConfig

    check_model(model)
    lens, sizes = positive_ints("--prompt-lens", prompt_lens), positive_ints("--batch-sizes", batch_sizes)
    config = EngineConfig(model=model, device=device, dtype=dtype, num_threads=threads, kv_cache_mb=kv_cache_mb)
    check_device(device)
    check_kv_pool(model, config)
    from pdqueue.bench import engine_bench

    loaded = load(model, device, dtype)
    result = engine_bench.run(loaded, config, lens, sizes,
                              progress=lambda m: click.secho(m, fg="cyan", err=True))
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(f"model {result['model']}  {result['device']} {result['dtype']}  threads {result['threads']}")
    click.echo(f"weights {result['weight_bytes'] / 2**20:.0f} MiB; copy {result['copy_gb_s']:.2f} GB/s, "
               f"read {result['read_gb_s']:.2f} GB/s")
    click.echo(f"bandwidth bound per decode step: {result['bound_ms_copy']:.1f} ms (copy), "
               f"{result['bound_ms_read']:.1f} ms (read)")
    for n, v in result["prefill_tok_s"].items():
        click.echo(f"prefill {n:>5} tokens: {v:8.0f} tok/s")
    for b, v in result["decode_ms"].items():
        click.echo(f"decode batch {b:>3}: {v:8.1f} ms/step  ({b / v * 1e3:.0f} tok/s)")
    for k, v in result["ratios"].items():
        click.echo(f"{k}: {v:.2f}x")


def positive_ints(option: str, text: str) -> tuple[int, ...]:
    """A comma-separated list of integers >= 1."""
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise UserError(f"{option} takes comma-separated integers, got {text!r}") from None
    if not all(v >= 1 for v in values):
        raise UserError(f"{option}: every value must be >= 1, got {text!r}")
    return values


ROLES = ("prefill", "decode", "colocated")


@cli.command()
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
@click.option("--log-level", default="INFO", show_default=True)
def worker(role, redis_url, cluster, model, device, dtype, threads, kv_cache_mb, policy, max_num_seqs,
           max_batched_tokens, transfer, bind, data_port, advertise_host, lease_s, fetch_timeout_s, heartbeat_ttl_s,
           reclaim_idle_ms, worker_id, burst, log_level):
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
                          reclaim_idle_ms=reclaim_idle_ms, worker_id=worker_id, burst=burst)
    loaded = load(model, device, dtype)
    if role == "prefill":
        from workers.prefill import PrefillWorker as Worker
    elif role == "decode":
        from workers.decode import DecodeWorker as Worker
    else:
        from workers.colocated import ColocatedWorker as Worker
    w = Worker(config, loaded)
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

    try:
        redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3).ping()
    except (redis.ConnectionError, redis.TimeoutError, ValueError) as exc:
        raise UserError(f"cannot reach Redis at {url}: {exc}") from None


def _register_more() -> None:
    from workers import cli_bench, cli_cluster
    from workers.cli_server import redis_server

    cli_cluster.register(cli)
    cli_bench.register(bench)
    cli.add_command(redis_server)


_register_more()


def main():
    try:
        cli(prog_name="pdqueue")
    except KeyboardInterrupt:  # Ctrl-C before a command installed its own handler
        click.secho("interrupted", fg="red", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
