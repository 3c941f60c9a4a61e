"""What every `pdqueue` command shares: the user-error type and the group class that turns
usage errors into one red line, the model and engine options and their checks (before
torch is imported), loading a model with progress, and rich console helpers. Imports
nothing of the other command modules: they import this one.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager

import click

from pdqueue.discovery import DEFAULT_URL, SOURCE_DEFAULT, DiscoveryError, Target, resolve
from pdqueue.engine.config import DEFAULT_KV_CACHE_MB, WEIGHT_FORMATS
from pdqueue.protocol import Request, sampling_error

DEFAULT_MODEL = "smollm2"
# Sampling defaults of `generate` (and `submit`): the protocol's request defaults, which
# are also Client.submit's (max_tokens 128, temperature 1.0 as in OpenAI's API).
REQUEST_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Request)}


def check_sampling(ctx, param, value):
    """A sampling option's value, checked by the protocol's one check of its field
    (``sampling_error``: what a worker would refuse is refused here, in the same words)."""
    reason = sampling_error(param.name, value, param.opts[0]) if value is not None else None
    if reason:
        raise click.BadParameter(reason, ctx, param)
    return value


def sampling_options(f):
    """`generate`'s and `submit`'s sampling options: the request's defaults, the protocol's checks."""
    for opt in reversed([
        click.option("--max-tokens", type=int, default=REQUEST_DEFAULTS["max_tokens"], show_default=True,
                     callback=check_sampling),
        click.option("--temperature", type=float, default=REQUEST_DEFAULTS["temperature"], show_default=True,
                     callback=check_sampling, help="0 is greedy."),
        click.option("--top-p", type=float, default=REQUEST_DEFAULTS["top_p"], show_default=True,
                     callback=check_sampling),
        click.option("--top-k", type=int, default=REQUEST_DEFAULTS["top_k"], show_default=True,
                     callback=check_sampling, help="0 is off."),
    ]):
        f = opt(f)
    return f


class UserError(click.ClickException):
    """A mistake the user can fix: one red line, exit status 1, no traceback."""

    def show(self, file=None):
        click.secho(f"error: {self.format_message()}", fg="red", err=True)


def model_option(f):
    return click.option("--model", envvar="PDQ_MODEL", show_envvar=True, default=DEFAULT_MODEL, show_default=True,
                        help="smollm2, tiny, or a path (.gguf file or Hugging Face directory).")(f)


WEIGHTS_HELP = ("Weights of the linear layers: fp32 (as loaded, in --dtype), int8 (per output channel), int4 "
                "(groups of 32, torch's kernel) or q4_1 (the same 4-bit blocks times 8-bit activations, pdqueue's "
                "kernel, built at first use with the system's C compiler: the fastest on CPU, prefill included), "
                "quantized at load, LM head int8; quantized formats need --device cpu --dtype float32 "
                "(pdqueue.models.quant). The KV cache is the same whatever the weights, so prefill and decode "
                "workers may differ.")
weights_option = click.option("--weights", type=click.Choice(WEIGHT_FORMATS), default="fp32", show_default=True,
                              help=WEIGHTS_HELP)


def engine_options(f):
    for opt in reversed([
        click.option("--device", default="cpu", show_default=True, help="torch device (cpu, cuda, cuda:1)."),
        click.option("--dtype", default="float32", show_default=True,
                     type=click.Choice(["float32", "bfloat16", "float16"])),
        click.option("--threads", type=click.IntRange(min=1), default=None,
                     help="torch threads [default: torch's choice]."),
        click.option("--kv-cache-mb", type=click.IntRange(min=1), default=DEFAULT_KV_CACHE_MB, show_default=True,
                     help="KV pool size in MiB (SmolLM2 in float32 needs 360 for one 8192-token sequence)."),
        click.option("--prefix-caching/--no-prefix-caching", default=True, show_default=True,
                     help="Reuse the KV of prompt prefixes already computed (full 16-token blocks)."),
        weights_option,
        click.option("--cuda-graphs/--no-cuda-graphs", default=True, show_default=True,
                     help="With --device cuda: decode steps replay CUDA graphs (captured per batch and context "
                          "size when first needed); ignored on CPU."),
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


def check_engine_config(**kwargs):
    """``EngineConfig(**kwargs)``, its ValueError (e.g. --weights int8 with --dtype bfloat16) as one line."""
    from pdqueue.engine.config import EngineConfig

    try:
        return EngineConfig(**kwargs)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def load(model: str, device: str, dtype: str, weights: str = "fp32"):
    """Load a model with a progress line on stderr (dequantizing takes a while)."""
    import torch  # noqa: F401  (imported here so that `pdqueue --help` stays fast)

    from pdqueue.engine.kv_cache import dtype_from_name
    from pdqueue.models.loader import load_model

    shown = dtype if weights == "fp32" else f"{dtype}, weights {weights}"
    click.secho(f"loading {model} on {device} ({shown}) ...", fg="cyan", err=True)
    started = time.perf_counter()
    with model_errors():
        loaded = load_model(model, device=device, dtype=dtype_from_name(dtype), weights=weights)
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


# ---- where the cluster is ----------------------------------------------------------------

def resolve_target(redis_url: str | None, cluster: str | None) -> Target:
    """``pdqueue.discovery.resolve`` with errors as one line; the source names the option
    or the environment variable the URL came from."""
    from pdqueue.keys import Keys

    try:
        target = resolve(redis_url, cluster)
    except DiscoveryError as exc:
        raise UserError(str(exc)) from None
    if redis_url:
        target = dataclasses.replace(target, source=_source_of("redis_url", "--redis-url", "PDQ_REDIS_URL"))
    try:
        Keys(target.cluster)
    except ValueError as exc:
        raise UserError(f"--cluster: {exc}") from None
    return target


def _source_of(param: str, option: str, envvar: str) -> str:
    ctx = click.get_current_context(silent=True)
    source = ctx.get_parameter_source(param) if ctx is not None else None
    return envvar if source is click.core.ParameterSource.ENVIRONMENT else option


def connect(target: Target):
    """A redis-py client that answered PING; one clear error line otherwise (``redis_failure``)."""
    import redis

    from pdqueue.queue.connection import check_mode
    from pdqueue.queue.connection import connect as redis_connect

    try:
        r = redis_connect(target.url, purpose="admin")
        r.ping()
        check_mode(r, target.url)   # a redis:// URL of a Redis Cluster node: say redis+cluster://
        return r
    except ValueError as exc:   # settings that cannot be used (an unreadable password file, TLS files)
        raise UserError(f"cannot reach Redis at {target.shown_url} ({target.source}): {str(exc).rstrip('.')}") \
            from None
    except (redis.RedisError, OSError) as exc:
        raise redis_failure(exc, target, connected=False) from None


PASSWORD_HELP = ("give it in the URL (--redis-url / PDQ_REDIS_URL redis://:PASSWORD@HOST:PORT/0, or "
                 "redis://USER:PASSWORD@... for an ACL user), or keep it out of `ps` with --redis-password-file FILE "
                 "/ PDQ_REDIS_PASSWORD_FILE or PDQ_REDIS_PASSWORD; for a `pdqueue up` started by another user or "
                 "shell, `pdqueue up --print-url --show-password` there prints its URL with the password "
                 "(`eval \"$(pdqueue up --print-env)\"` sets REDISCLI_AUTH for redis-cli)")


def redis_failure(exc: BaseException, target: Target, connected: bool = True, role: str = "admin") -> UserError:
    """One line for a Redis error met by a command on ``target``: what the server's answer
    means (``pdqueue.queue.connection.classify_error``) and what to do. ``connected``: the
    client had answered PING before (a connection error is then a lost connection);
    ``role``: the `pdqueue acl` role that has what the command needs."""
    from pdqueue.queue.connection import ErrorKind, classify_error, error_text

    at = f"Redis at {target.shown_url} ({target.source})"
    kind, text = classify_error(exc), error_text(exc)
    if kind is ErrorKind.NEEDS_PASSWORD:
        why = ("; no `pdqueue up` of this user is running here, whose state file would give it"
               if target.source == SOURCE_DEFAULT else "")
        return UserError(f"{at} wants a password and none was given (NOAUTH){why}: {PASSWORD_HELP}")
    if kind is ErrorKind.BAD_CREDENTIALS:
        return UserError(f"cannot reach {at}: wrong credentials ({text}); check the user and password "
                         f"(URL, --redis-password-file, PDQ_REDIS_PASSWORD)")
    if kind is ErrorKind.NO_PERMISSION:
        return UserError(f"{at} refused ACL user {_acl_user(target.url)!r}: {text} (this command needs the "
                         f"rights of `pdqueue acl`'s {role} role; docs/security.md)")
    if kind is ErrorKind.UNREACHABLE:
        if connected:
            return UserError(f"lost the connection to Redis at {target.shown_url} ({text})")
        hint = ("; start a local cluster with `pdqueue up`, or pass --redis-url / set PDQ_REDIS_URL"
                if target.source == SOURCE_DEFAULT else "")
        return UserError(f"cannot reach Redis at {target.shown_url} ({target.source}): {text}{hint}")
    return UserError(f"{at} answered with an error: {text}")


def _acl_user(url: str) -> str:
    """The ACL user a connection to ``url`` logs in as: the URL's, else PDQ_REDIS_USERNAME
    (--redis-username), else Redis's ``default``."""
    import os

    from pdqueue.config import ENV_USERNAME, url_credentials

    user, password = url_credentials(url)
    if password is not None:   # a password in the URL brings its user (or none) with it
        return user or "default"
    return user or os.environ.get(ENV_USERNAME) or "default"


def _to_environment(envvar: str, path: bool):
    """An option's callback: its value goes to ``envvar``, where ``pdqueue.config.redis_security``
    (every connection this process makes) and the processes it starts find it."""
    import os

    def callback(ctx, param, value):
        if value:
            os.environ[envvar] = os.path.abspath(value) if path else value
        return value

    return callback


def redis_security_options(f):
    """``--redis-username``, ``--redis-password-file``, ``--redis-ca``, ``--redis-cert``,
    ``--redis-key`` (each with its ``PDQ_REDIS_*`` variable; ``PDQ_REDIS_PASSWORD`` holds a
    password itself). There is no password option: a command line shows in ``ps``."""
    from pdqueue import config as c

    file = click.Path(exists=True, dir_okay=False, readable=True)
    for name, envvar, kind, text in reversed([
        ("--redis-username", c.ENV_USERNAME, None, "Redis ACL user [default: the URL's, else Redis's default user]."),
        ("--redis-password-file", c.ENV_PASSWORD_FILE, file,
         f"File whose first line is the Redis password (or put it in {c.ENV_PASSWORD}); a password in the URL wins."),
        ("--redis-ca", c.ENV_CA, file, "PEM CA certificate(s) that sign a rediss:// server's certificate "
                                       "[default: the system's]."),
        ("--redis-cert", c.ENV_CERT, file, "PEM client certificate, for a rediss:// server that asks for one."),
        ("--redis-key", c.ENV_KEY, file, "PEM private key of --redis-cert."),
    ]):
        f = click.option(name, envvar=envvar, show_envvar=True, default=None, type=kind, help=text,
                         expose_value=False, callback=_to_environment(envvar, kind is not None))(f)
    return f


def target_options(f):
    f = redis_security_options(f)
    f = click.option("--cluster", envvar="PDQ_CLUSTER", show_envvar=True, default=None,
                     help="pdqueue cluster name [default: that of the running `pdqueue up` (several: "
                          "default), else default].")(f)
    return click.option("--redis-url", envvar="PDQ_REDIS_URL", show_envvar=True, default=None,
                        help="Redis of the cluster (redis://[USER:PASSWORD@]HOST:PORT/DB, rediss:// for TLS) "
                             f"[default: the running `pdqueue up` of the cluster, else {DEFAULT_URL}].")(f)


def summary(c) -> str:
    reason = getattr(c.finish_reason, "value", c.finish_reason)
    return (f"[{c.num_tokens} tokens, finish {reason}, TTFT {c.ttft_ms:.0f} ms, TBT p50 {c.tbt_p50_ms:.1f} ms, "
            f"e2e {c.e2e_ms:.0f} ms, KV via {c.transfer_path or '-'}]")


def rich_console(stderr: bool = False):
    """A rich console; into a pipe or file it does not wrap lines (rich's default there is 80 columns)."""
    from rich.console import Console

    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal:
        console.soft_wrap = True
        console.width = max(console.width, 160)
    return console


def print_line(console, markup: str) -> None:
    console.print(markup, highlight=False)
    console.file.flush()


# ---- the planner's settings (`plan`, `up --adapt`) ----------------------------------------

def planner_options(f):
    """The planner's settings, shared by `plan` and `up --adapt`; their defaults are
    ``PlannerConfig``'s (pdqueue/control/decision.py), the one place they are written."""
    from pdqueue.control.decision import MODES, PlannerConfig

    d = PlannerConfig()
    for opt in reversed([
        click.option("--mode", "plan_mode", type=click.Choice(MODES), default=d.mode,
                     show_default=True, help="reactive: SLO breaches and backlog, one step at a time; "
                                             "predictive: demand over measured capacity."),
        click.option("--ttft-slo-ms", type=click.FloatRange(min=1), default=d.ttft_slo_ms, show_default=True,
                     help="Time-to-first-token target (`up` gives it to every worker too: prompts that can no "
                          "longer make it wait behind those that still can)."),
        click.option("--tbt-slo-ms", type=click.FloatRange(min=1), default=d.tbt_slo_ms, show_default=True,
                     help="Target for each request's p90 time between tokens."),
        click.option("--dwell-s", type=click.FloatRange(min=0), default=d.min_dwell_s, show_default=True,
                     help="A worker is not switched again sooner than this."),
        click.option("--cooldown-s", type=click.FloatRange(min=0), default=d.cooldown_s, show_default=True,
                     help="At least this long between decisions that switch someone."),
        click.option("--window-s", type=click.FloatRange(min=1), default=d.window_s, show_default=True,
                     help="Completions older than this are not looked at."),
        click.option("--elastic", is_flag=True,
                     help="Also set each colocated worker's TBT budget (workers on --policy chunked) and move "
                          "running decodes off colocated workers with prompts waiting to decode workers."),
    ]):
        f = opt(f)
    return f


def planner_config(plan_mode, ttft_slo_ms, tbt_slo_ms, dwell_s, cooldown_s, window_s, elastic=False):
    from pdqueue.control.planner import PlannerConfig

    try:
        return PlannerConfig(ttft_slo_ms=ttft_slo_ms, tbt_slo_ms=tbt_slo_ms, mode=plan_mode, min_dwell_s=dwell_s,
                             cooldown_s=cooldown_s, window_s=window_s, elastic=elastic)
    except ValueError as exc:
        raise UserError(f"planner: {exc}") from None


# ---- the KV tiers and pulls of a local cluster's workers (`up`) ------------------------------

def kv_tier_options(f):
    """`worker`'s --kv-host-tier-mb, --kv-disk-dir, --kv-disk-gb and --kv-pull for every worker
    `up` starts (docs/tuning/kv-tiers.md), handed to the command as one ``kv_args`` argument:
    the worker options to pass on (none for a default)."""
    import functools

    from workers.common import KV_PULL

    @functools.wraps(f)
    def command(*args, kv_host_tier_mb, kv_disk_dir, kv_disk_gb, kv_pull, **kwargs):
        kv_args = (("--kv-host-tier-mb", str(kv_host_tier_mb)) if kv_host_tier_mb else ()) + \
            (("--kv-disk-dir", str(kv_disk_dir), "--kv-disk-gb", f"{kv_disk_gb:g}") if kv_disk_dir else ()) + \
            (("--kv-pull", kv_pull) if kv_pull != "auto" else ())
        return f(*args, kv_args=kv_args, **kwargs)

    for opt in reversed([
        click.option("--kv-host-tier-mb", type=click.IntRange(min=0), default=0, show_default=True,
                     help="Each worker's host-memory KV tier, MiB (see `pdqueue worker --help`). 0: none."),
        click.option("--kv-disk-dir", type=click.Path(file_okay=False), default=None,
                     help="The workers' disk KV tier, one directory they share (a prefill worker reads the "
                          "answers a decode worker wrote). Default: none."),
        click.option("--kv-disk-gb", type=click.FloatRange(min=0), default=10.0, show_default=True,
                     help="With --kv-disk-dir: each worker's bound on it."),
        click.option("--kv-pull", type=click.Choice(KV_PULL), default="auto", show_default=True,
                     help="The next turn pulls its history from the worker holding it: auto (when cheaper than "
                          "computing it), always, never."),
    ]):
        command = opt(command)
    return command
