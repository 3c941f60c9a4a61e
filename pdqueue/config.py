"""The client's Redis settings (``RedisConfig``), and the one place where Redis credentials
and TLS settings are resolved (``redis_security``, which ``queue.connection.connect``
applies too) and URLs are shown without their password (``redact_url``).

Credentials and TLS (docs/security.md), first found wins:

- user and password: those in the URL (``redis://user:pass@host``) when it has a password;
  else the URL's user, else ``username``/``PDQ_REDIS_USERNAME``; the password from
  ``password``, ``password_file``, ``PDQ_REDIS_PASSWORD_FILE`` (its first line), then
  ``PDQ_REDIS_PASSWORD``. A file or the environment keeps the password out of ``ps``.
- TLS (``rediss://`` URLs only): ``ca``/``PDQ_REDIS_CA`` (PEM CA bundle that signs the
  server's certificate; default: the system's), ``cert``/``PDQ_REDIS_CERT`` and
  ``key``/``PDQ_REDIS_KEY`` (a client certificate, for servers with ``tls-auth-clients``).
  The server's certificate and host name are always checked (``?ssl_check_hostname=false``
  in the URL turns the name check off). TLS settings with a ``redis://`` URL are an error,
  never a silent plaintext connection. A Redis Cluster's ``redis+cluster://`` and
  ``rediss+cluster://`` URLs (``pdqueue.queue.connection``) follow the same rules.

The command-line options (``--redis-username``, ``--redis-password-file``, ``--redis-ca``,
``--redis-cert``, ``--redis-key``) set these environment variables, so every connection a
command makes, and the processes it starts, use them.

Imports nothing heavy: a producer builds this without torch or redis being imported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping
from urllib.parse import parse_qsl, quote, unquote, urlsplit, urlunsplit

ENV_USERNAME = "PDQ_REDIS_USERNAME"
ENV_PASSWORD = "PDQ_REDIS_PASSWORD"
ENV_PASSWORD_FILE = "PDQ_REDIS_PASSWORD_FILE"
ENV_CA = "PDQ_REDIS_CA"
ENV_CERT = "PDQ_REDIS_CERT"
ENV_KEY = "PDQ_REDIS_KEY"
CREDENTIAL_ENV = (ENV_USERNAME, ENV_PASSWORD, ENV_PASSWORD_FILE)
TLS_ENV = (ENV_CA, ENV_CERT, ENV_KEY)
SECURITY_ENV = CREDENTIAL_ENV + TLS_ENV
"""Every environment variable ``redis_security`` reads."""


# ---- URLs ----------------------------------------------------------------------------------

def url_credentials(url: str) -> tuple[str | None, str | None]:
    """(user, password) written in ``url``'s authority (or ``?password=``), unquoted."""
    try:
        parts = urlsplit(url)
        user, password = parts.username, parts.password
    except ValueError:
        return None, None
    for name, value in parse_qsl(parts.query):
        if name == "password" and value:
            password = value
        elif name == "username" and value:
            user = value
    return (unquote(user) if user else None), (unquote(password) if password else None)


def url_has_password(url: str) -> bool:
    return url_credentials(url)[1] is not None


def redact_url(url: str) -> str:
    """``url`` without its password (``redis://user:secret@host:6379/0`` ->
    ``redis://user@host:6379/0``): what every message, log line and banner shows."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable Redis URL>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}@{hostport}" if user else hostport
    query = "&".join(p for p in parts.query.split("&") if p and not p.lower().startswith("password="))
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def strip_credentials(url: str) -> str:
    """``url`` without user and password (to compare two URLs of one server)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def with_password(url: str, password: str, username: str | None = None) -> str:
    """``url`` with ``password`` (and ``username``, else the URL's own user) in it."""
    parts = urlsplit(url)
    user = username if username is not None else (unquote(parts.username) if parts.username else "")
    hostport = parts.netloc.rpartition("@")[2]
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{hostport}"
    return urlunsplit(parts._replace(netloc=netloc))


# ---- credentials and TLS -------------------------------------------------------------------

def _setting(value: str | None, env: Mapping[str, str], name: str) -> tuple[str | None, str]:
    """(value, where it came from): the explicit value, else the environment's (empty: unset)."""
    if value:
        return value, "the configuration"
    if env.get(name):
        return env[name], name
    return None, ""


def read_password_file(path: str, what: str = ENV_PASSWORD_FILE) -> str:
    """The first line of ``path`` (ValueError naming ``what`` if unreadable or empty)."""
    try:
        with open(path, encoding="utf-8") as f:
            line = f.readline().rstrip("\r\n")
    except OSError as exc:
        raise ValueError(f"{what} {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{what} {path}: not UTF-8 text") from None
    if not line:
        raise ValueError(f"{what} {path}: the file is empty")
    return line


def configured_password(password: str | None = None, password_file: str | None = None,
                        environ: Mapping[str, str] | None = None) -> str | None:
    """The password the settings give (not the URL's): ``password``, ``password_file``,
    ``PDQ_REDIS_PASSWORD_FILE``, ``PDQ_REDIS_PASSWORD``; None if none."""
    env = os.environ if environ is None else environ
    if password:
        return password
    path, source = _setting(password_file, env, ENV_PASSWORD_FILE)
    if path:
        return read_password_file(path, source if source != "the configuration" else "password_file")
    return env.get(ENV_PASSWORD) or None


def redis_security(url: str, *, username: str | None = None, password: str | None = None,
                   password_file: str | None = None, ca: str | None = None, cert: str | None = None,
                   key: str | None = None, environ: Mapping[str, str] | None = None) -> dict:
    """Keyword arguments for ``redis.Redis.from_url(url, ...)`` (and ``redis.asyncio``'s)
    with the credentials and TLS settings for ``url`` (the module docstring gives the
    order). ValueError when a setting cannot be used (an unreadable file, TLS settings with
    a ``redis://`` URL)."""
    env = os.environ if environ is None else environ
    kwargs: dict = {}
    url_user, url_password = url_credentials(url)
    if url_password is None:  # a password in the URL brings its user (or none) with it
        secret = configured_password(password, password_file, env)
        user = url_user or _setting(username, env, ENV_USERNAME)[0]
        if secret is not None:
            kwargs["password"] = secret
            if user:
                kwargs["username"] = user
        elif user and not url_user:
            kwargs["username"] = user
    scheme = url.split("://", 1)[0].lower()
    scheme = {"rediss+cluster": "rediss", "redis+cluster": "redis"}.get(scheme, scheme)  # a Redis Cluster's
    tls = {name: _setting(value, env, env_name) for name, value, env_name in
           (("ssl_ca_certs", ca, ENV_CA), ("ssl_certfile", cert, ENV_CERT), ("ssl_keyfile", key, ENV_KEY))}
    given = {name: value for name, (value, _) in tls.items() if value}
    if given and scheme != "rediss":
        sources = ", ".join(source for _, source in tls.values() if source)
        raise ValueError(f"TLS settings ({sources}) need a rediss:// URL, not {redact_url(url)}")
    for name, path in given.items():
        if not os.path.isfile(path):
            raise ValueError(f"{tls[name][1]} {path}: no such file")
    if "ssl_keyfile" in given and "ssl_certfile" not in given:
        raise ValueError(f"{tls['ssl_keyfile'][1]} is set without a client certificate ({ENV_CERT})")
    if scheme == "rediss":
        kwargs["ssl_check_hostname"] = True   # the URL's ?ssl_check_hostname=false wins (from_url)
        kwargs.update(given)
    return kwargs


# ---- the client's settings -----------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class RedisConfig:
    """How to reach Redis. Blocking reads (XREAD/XREADGROUP BLOCK) must block for less
    than ``socket_timeout_s``; the queue helpers keep them at ``max_block_ms``.

    Credentials and TLS: in ``url``, else these fields, else the ``PDQ_REDIS_*``
    environment variables (module docstring); ``redis_kwargs`` applies them. ``url`` may
    name a Redis Cluster (``redis+cluster://h1:7000,h2:7001``; the clients are made by
    ``pdqueue.queue.connection.client_from_url``); ``max_connections`` is then per node."""

    url: str = "redis://127.0.0.1:6379/0"
    socket_timeout_s: float | None = 30.0
    socket_connect_timeout_s: float = 5.0
    health_check_interval_s: int = 30
    max_block_ms: int = 2000
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 2.0
    unavailable_after_s: float | None = 30.0
    """The client's streams retry a lost connection (a Redis restart is survived) and raise
    ``pdqueue.client.RedisUnavailable`` once it has failed for this long (None: retry until
    the caller's timeout)."""
    submit_retry_s: float = 30.0
    """``submit``/``submit_many`` resend the same request (same id) after a lost connection,
    a timeout or a server still loading (LOADING, BUSY), for up to this long from the
    submit's start, then raise ``pdqueue.client.RedisUnavailable`` (0: one attempt). A copy
    that did reach Redis is run once all the same: workers run a request id once
    (``seen:<id>``)."""
    lost_check_s: float | None = 10.0
    """A stream read that has had no answer for this long asks Redis whether it still knows
    the request (queued, taken or answered: one pipelined round trip), and sends it again,
    same id, if not: a failover or a restart without persistence lost it
    (``pdqueue.client_outage.LostCheck``). None: never asked."""
    max_connections: int = 10_000
    """The connection pool's cap. Every stream being read holds one connection while its
    XREAD blocks, so an ``AsyncClient`` (or a gateway) with N requests in flight needs N;
    redis-py's default of 100 made the 101st concurrent submit fail with "Too many
    connections"."""
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    password_file: str | None = None
    ssl_ca: str | None = None
    ssl_cert: str | None = None
    ssl_key: str | None = None

    def redis_kwargs(self) -> dict:
        """Keyword arguments for ``redis.Redis.from_url(self.url, **kwargs)`` (or
        ``redis.asyncio.Redis.from_url``): timeouts, pool size, credentials and TLS."""
        return {
            "socket_timeout": self.socket_timeout_s,
            "socket_connect_timeout": self.socket_connect_timeout_s,
            "health_check_interval": self.health_check_interval_s,
            "max_connections": self.max_connections,
            **redis_security(self.url, username=self.username, password=self.password,
                             password_file=self.password_file, ca=self.ssl_ca, cert=self.ssl_cert,
                             key=self.ssl_key),
        }
