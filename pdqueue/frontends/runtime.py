"""What the gateway runs on (``pdqueue serve --loop/--http``, ``auto`` by default): uvloop and
httptools when installed (``pip install 'pdqueue[fast]'``), else asyncio's loop and h11;
Redis replies parsed by hiredis when installed (``PDQ_REDIS_PARSER``,
``pdqueue.queue.connection``). And the listening socket."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import socket
import sys
from dataclasses import dataclass

from pdqueue.queue.connection import redis_parser

__all__ = ["HTTP_PARSERS", "LOOPS", "Runtime", "bind", "runtime"]

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

