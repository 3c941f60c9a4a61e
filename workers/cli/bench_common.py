"""What the `pdqueue bench` commands share: progress lines on stderr, ``--out`` files, and the
parsing of comma-separated options."""

from __future__ import annotations

import json
from pathlib import Path

import click

from workers.cli.common import UserError


def progress(message: str) -> None:
    click.secho(message, fg="cyan", err=True)


def write_out(out: str | None, name: str, result: dict, plot) -> None:
    """``<out>/<name>.json`` and the plots; a note on stderr when matplotlib is missing."""
    if not out:
        return
    from pdqueue.bench import plots

    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    if plot is None:
        progress(f"wrote {directory / name}.json")
        return
    if not plots.available():
        progress(f"wrote {directory / name}.json; matplotlib is not installed, so no plots "
                  "(pip install 'pdqueue[bench]')")
        return
    written = plot(result, directory)
    progress(f"wrote {directory / name}.json and " + ", ".join(str(p) for p in written))


def csv_values(text: str, cast, option: str) -> list:

    try:
        values = [cast(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{option} takes a comma-separated list, got {text!r}") from None
    if not values:
        raise UserError(f"{option} is empty")
    return values


def positive_ints(option: str, text: str) -> tuple[int, ...]:
    """A comma-separated list of integers >= 1."""
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise UserError(f"{option} takes comma-separated integers, got {text!r}") from None
    if not all(v >= 1 for v in values):
        raise UserError(f"{option}: every value must be >= 1, got {text!r}")
    return values
