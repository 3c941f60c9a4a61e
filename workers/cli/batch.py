"""`pdqueue batch INPUT -o OUTPUT`: an OpenAI Batch file answered through the queue.

The logic (ids, resume, the in-flight window, the output lines) is ``pdqueue.frontends.batch``; this
module parses the options, draws the progress bar (on a terminal only), turns Ctrl-C into
a clean stop and prints the summary. It imports no torch.
"""

from __future__ import annotations

import shlex
import signal
import sys
import threading

import click

from workers.cli.common import UserError, connect, print_line, resolve_target, rich_console, target_options


@click.command()
@click.argument("input_path", metavar="INPUT", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", "output_path", required=True, type=click.Path(dir_okay=False),
              help="Answers, one JSON line per input line, appended as they complete. Lines already there "
                   "are not answered again.")
@target_options
@click.option("--batch-id", default=None,
              help="Names this batch's requests in Redis (1-64 of [A-Za-z0-9._-]) [default: the first 16 hex "
                   "digits of INPUT's SHA-256]. Pass the one the interrupted run printed to resume after "
                   "editing INPUT.")
@click.option("--concurrency", type=click.IntRange(min=1, max=4096), default=64, show_default=True,
              help="Requests in flight at most.")
def batch(input_path, output_path, redis_url, cluster, batch_id, concurrency):
    """Answer an OpenAI Batch file: INPUT has one {"custom_id", "method", "url", "body"} per
    line (url /v1/chat/completions or /v1/completions); OUTPUT gets one {"id", "custom_id",
    "response", "error"} per line. Run the same command again after a crash or Ctrl-C: lines
    already in OUTPUT are skipped, requests still in Redis are re-attached to, not sent again."""
    from pdqueue.frontends.batch import BatchError, file_run
    from pdqueue.keys import Keys
    from pdqueue.protocol import Role
    from pdqueue.queue.registry import list_workers

    target = resolve_target(redis_url, cluster)
    r = connect(target)
    keys = Keys(target.cluster)
    err = rich_console(stderr=True)
    stop = threading.Event()
    progress = _Progress(err)
    try:
        run = file_run(r, keys, input_path, output_path, batch_id=batch_id, concurrency=concurrency, stop=stop,
                       on_progress=progress.update)
        counts = run.prepare()
    except BatchError as exc:
        raise UserError(str(exc)) from None
    if run.done.dropped_partial:
        print_line(err, f"[yellow]{output_path}: removed an incomplete last line (an earlier run was stopped "
                        f"while writing it)[/]")
    roles = {w.get("role") for w in list_workers(r, keys)}
    if counts.todo and Role.COLOCATED not in roles and not {Role.PREFILL, Role.DECODE} <= roles:
        missing = Role.PREFILL.value if Role.PREFILL not in roles else Role.DECODE.value
        print_line(err, f"[yellow]warning: cluster {target.cluster!r} at {target.shown_url} has no {missing} worker; "
                        f"requests wait in the queue[/]")

    def on_signal(signum, frame):
        if stop.is_set():          # a second Ctrl-C: stop now (OUTPUT is still flushed and closed)
            raise KeyboardInterrupt
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        progress.start(run.batch_id, counts.todo)
        counts = run.run()
    except BatchError as exc:
        raise UserError(str(exc)) from None
    except KeyboardInterrupt:
        run.interrupted = True
        counts.in_flight = len(run.inflight)
    finally:
        progress.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    extra = [f"{counts.reattached} re-attached"] if counts.reattached else []
    if counts.recomputed:
        extra.append(f"{counts.recomputed} sent again (their answers had expired unread)")
    print_line(err, f"batch {run.batch_id}: {counts.answered} answered, {counts.errors} errors, "
                    f"{counts.skipped} skipped (already in {output_path})"
                    + (f"; {', '.join(extra)}" if extra else ""))
    if run.interrupted:
        args = sys.argv[1:] if sys.argv[1:2] == ["batch"] else ["batch", input_path, "-o", output_path]
        if batch_id is None:
            args += ["--batch-id", run.batch_id]
        click.secho(f"interrupted: {counts.in_flight} requests left running in Redis; resume with: "
                    f"pdqueue {shlex.join(args)}", fg="yellow", err=True)
        sys.exit(130)


class _Progress:
    """A rich progress bar (lines written, rate, ETA) on a terminal; nothing otherwise."""

    def __init__(self, console):
        self.console = console
        self.bar = None
        self.task = None

    def start(self, batch_id: str, total: int) -> None:
        if not self.console.is_terminal:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            ProgressColumn,
            TextColumn,
            TimeRemainingColumn,
        )
        from rich.text import Text

        class Rate(ProgressColumn):
            def render(self, task):
                speed = task.finished_speed or task.speed
                return Text(f"{speed:.1f} lines/s" if speed else "- lines/s", style="progress.data.speed")

        self.bar = Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                            MofNCompleteColumn(), Rate(), TimeRemainingColumn(), TextColumn("{task.fields[errors]}"),
                            console=self.console)
        self.task = self.bar.add_task(f"batch {batch_id}", total=total or None, errors="")
        self.bar.start()

    def update(self, counts) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=counts.written,
                            errors=f"[red]{counts.errors} errors[/]" if counts.errors else "")

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
