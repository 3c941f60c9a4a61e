"""What the gateway runs on (``pdqueue serve --loop/--http``, ``auto`` by default): uvloop and
httptools when installed (``pip install 'pdqueue[fast]'``), else asyncio's loop and h11;
Redis replies parsed by hiredis when installed (``PDQ_REDIS_PARSER``,
``pdqueue.queue.connection``). And the listening socket: ``bind``, or ``inherited`` (a
supervisor's), and ``Handover``, how a gateway gives that socket up to its replacement.

A port handed over without refusing a connection: ``pdqueue up`` binds the gateway's port
itself and gives every gateway process it starts the same listening socket (``pdqueue serve
--fd``). One socket, one accept queue: while two gateways run, either accepts the next
connection; when the old one stops accepting, the connections waiting in the queue are the
new one's. (Two sockets bound with ``SO_REUSEPORT`` would each have their own queue, and
the connections waiting in the one that closes are reset unless ``net.ipv4.tcp_migrate_req``
is set.) A crashed gateway's port is the same: connections wait in the queue, not refused,
until the restarted one accepts them.

``Handover`` is the old gateway's side, on SIGUSR1 (``HANDOVER_SIGNAL``): it stops accepting
(its copy of the socket is closed; the socket lives on in the others), lets go of its
batches, and serves on: every open answer runs to its end, a request that arrives on a
connection it already had is answered too (not a 503: that is SIGTERM's drain), each
answer with ``Connection: close`` so that the client's next request opens a connection,
which the new gateway accepts. It exits once no connection is left (an idle keep-alive
connection is closed by its keep-alive timeout, as at any time; closing it earlier could
meet a request the client is sending on it). ``Handover.ready`` (printed by ``pdqueue
serve`` as ``accepting connections (pid N)``) tells the supervisor the new one accepts.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass
from typing import Callable

from pdqueue.queue.connection import redis_parser

__all__ = ["HANDOVER_SIGNAL", "HTTP_PARSERS", "LOOPS", "Handover", "Runtime", "bind", "inherited", "runtime"]

log = logging.getLogger("pdqueue.frontends.gateway")

HANDOVER_SIGNAL = signal.SIGUSR1   # stop accepting, answer what comes on open connections, exit

LOOPS = ("auto", "asyncio", "uvloop")
HTTP_PARSERS = ("auto", "h11", "httptools")


@dataclass(frozen=True)
class Runtime:
    loop: str          # "asyncio" or "uvloop" (uvicorn's names)
    http: str          # "h11" or "httptools"
    redis_parser: str  # "hiredis" or "python" (pdqueue.queue.connection.redis_parser)

    @property
    def name(self) -> str:
        """E.g. "uvloop-httptools-hiredis" (``pdqueue bench gateway --variants``' names)."""
        return f"{self.loop}-{self.http}-{self.redis_parser}"

    def describe(self) -> str:
        """One line: each choice with its package's version."""
        loop = f"asyncio (Python {sys.version.split()[0]})" if self.loop == "asyncio" else _versioned(self.loop)
        parser = "redis-py's Python parser" if self.redis_parser == "python" else _versioned("hiredis")
        return f"event loop {loop}, HTTP parser {_versioned(self.http)}, Redis replies parsed by {parser}"


def _versioned(package: str) -> str:
    try:
        return f"{package} {importlib.metadata.version(package)}"
    except importlib.metadata.PackageNotFoundError:
        return package


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def runtime(loop: str = "auto", http: str = "auto") -> Runtime:
    """What ``serve(loop=, http=)`` runs on: ``auto`` is uvloop (not on Windows) and
    httptools when installed, else asyncio and h11. ValueError for an unknown name or one
    asked for by name that is not installed (or, from ``PDQ_REDIS_PARSER``, hiredis)."""
    if loop not in LOOPS:
        raise ValueError(f"loop {loop!r}: expected one of {', '.join(LOOPS)}")
    if http not in HTTP_PARSERS:
        raise ValueError(f"http {http!r}: expected one of {', '.join(HTTP_PARSERS)}")
    has_uvloop = sys.platform != "win32" and _installed("uvloop")
    if loop == "uvloop" and not has_uvloop:
        raise ValueError("loop uvloop: uvloop is not installed (pip install 'pdqueue[fast]'), or use auto/asyncio")
    if http == "httptools" and not _installed("httptools"):
        raise ValueError("http httptools: httptools is not installed (pip install 'pdqueue[fast]'), or use auto/h11")
    if loop == "auto":
        loop = "uvloop" if has_uvloop else "asyncio"
    if http == "auto":
        http = "httptools" if _installed("httptools") else "h11"
    return Runtime(loop, http, redis_parser())


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (0: a free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say so, and
    # the accepted ones inherit it. Without it, Nagle's algorithm held a chunk written right
    # after another until the client's delayed ACK (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock



def inherited(fd: int) -> socket.socket:
    """The listening socket a supervisor passed as file descriptor ``fd`` (``pdqueue serve
    --fd``); OSError when ``fd`` is not a listening TCP socket."""
    sock = socket.socket(fileno=fd)   # family and type read from the descriptor
    try:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6) \
                or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            raise OSError(f"file descriptor {fd} is not a listening TCP socket")
    except OSError:
        sock.detach()   # (not ours to close)
        raise
    return sock


class Handover:
    """The gateway's side of a rolling restart (see the module docstring). Install it before
    the server runs (the signal's default action would kill the process); wrap the app with
    ``app``; call ``tick`` from the server's ``on_tick``."""

    def __init__(self, app, on_ready: Callable[[], None] | None = None):
        self.on_ready = on_ready
        self.requested = False
        self.started = False   # the listeners are closed
        self.ready = False     # the server accepts (``on_ready`` was called)
        signal.signal(HANDOVER_SIGNAL, self._requested)

        async def wrapped(scope, receive, send):
            """``app``; once handing over, each answer closes its connection. (A function, not
            a method: uvicorn takes a coroutine function for an ASGI 3 app.)"""
            if not self.started or scope["type"] != "http":
                return await app(scope, receive, send)

            async def closing(message):
                if message["type"] == "http.response.start":
                    headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"connection"]
                    message = {**message, "headers": [*headers, (b"connection", b"close")]}
                await send(message)

            return await app(scope, receive, closing)

        self.app = wrapped

    def _requested(self, signum, frame) -> None:
        self.requested = True   # acted on in tick, on the event loop

    def tick(self, server, let_go: Callable[[], None], answering: bool) -> bool:
        """One tick of uvicorn's ``server`` (every 0.1 s): announce readiness once it
        accepts; on the signal, stop accepting and ``let_go`` (the batches); True when it
        may exit: handing over, no answer of ours open (``answering``) and no connection left."""
        if server.started and not self.ready:
            self.ready = True
            if self.on_ready is not None:
                self.on_ready()
        if not self.requested:
            return False
        if not self.started:
            self.started = True
            for listener in server.servers:
                listener.close()   # this process's copy; the others keep accepting
            let_go()
            for connection in list(server.server_state.connections):
                cycle = getattr(connection, "cycle", None)
                # An answer whose headers are not out yet says "Connection: close" and closes it.
                # One already streaming keeps its connection: closing it after the last byte,
                # unannounced, races the client's next request on it (a broken pipe); that
                # request gets "Connection: close" from ``wrapped`` instead.
                if cycle is not None and not cycle.response_complete and not cycle.response_started:
                    cycle.keep_alive = False
            log.warning("handing over (pid %d): not accepting; %d connections open are served to their end",
                        os.getpid(), len(server.server_state.connections))
        return not answering and not server.server_state.connections
