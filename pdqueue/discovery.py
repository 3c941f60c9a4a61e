"""Where a pdqueue cluster is: the state files of running ``pdqueue up``s, and ``resolve``.

Each ``pdqueue up`` writes a state file per cluster, ``up-<cluster>.json`` in
``$XDG_RUNTIME_DIR/pdqueue/`` (else ``~/.cache/pdqueue/``), mode 0600, with its Redis URL
(without a password), the password of its embedded server (``password``), cluster name,
pid and workers. ``resolve`` turns "what the caller said" into a ``Target``, whose URL
carries that password: a URL given without credentials that names a running ``up``'s
server gets it too. Show ``Target.shown_url``, never ``url``:

- the URL: the ``redis_url`` argument, else ``$PDQ_REDIS_URL``, else the URL of the
  running ``up`` of the cluster, else ``redis://127.0.0.1:6379/0``;
- the cluster: the ``cluster`` argument, else ``$PDQ_CLUSTER``, else the running ``up``'s
  cluster (one of them is up: that one; several: ``default`` if it is one of them, else
  ``DiscoveryError``), else ``default``. With a URL given, only the ``up``s serving that URL
  count.
- the password: one given explicitly (in the URL, or ``PDQ_REDIS_PASSWORD`` /
  ``PDQ_REDIS_PASSWORD_FILE``, which ``--redis-password-file`` sets, or the caller's
  ``credentials``) always wins: a wrong one is refused by the server as wrong, never
  replaced by the state file's. Only without one does the ``up``'s password go in the URL.

A ``Target`` on an ``up``'s embedded server carries the pids of that ``up`` and of its
server (``up_pid``, ``server_pid``): a client whose server process is gone knows that its
server is gone for good (``pdqueue.client_outage.EmbeddedServer``).

``Client()`` and ``AsyncClient()`` without a URL, and ``pdqueue submit``/``status``, use it.

Imports the standard library and pdqueue.procs/config only (never redis or torch).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from pdqueue.config import ENV_PASSWORD, ENV_PASSWORD_FILE, redact_url, strip_credentials, with_password
from pdqueue.procs import pid_alive

__all__ = ["DEFAULT_CLUSTER", "DEFAULT_URL", "DiscoveryError", "Target", "read_state", "remove_state",
           "resolve", "running_clusters", "state_dir", "state_path", "state_url", "write_state"]

DEFAULT_URL = "redis://127.0.0.1:6379/0"
DEFAULT_CLUSTER = "default"
SOURCE_ARGUMENT = "the redis_url argument"
SOURCE_ENV = "PDQ_REDIS_URL"
SOURCE_DEFAULT = "the default URL"


class DiscoveryError(LookupError):
    """The cluster to use is ambiguous (several local clusters are up and none was named)."""


@dataclass(frozen=True, slots=True)
class Target:
    url: str     # to connect with: it may hold a password (``shown_url`` for messages)
    cluster: str
    source: str  # how the URL was found, for messages
    up_pid: int | None = None       # the `pdqueue up` whose embedded server the URL names
    server_pid: int | None = None   # that server's process

    @property
    def shown_url(self) -> str:
        """The URL without its password, for messages, banners and ``status``."""
        return redact_url(self.url)


# ---- the state files ---------------------------------------------------------------------

def state_dir() -> Path:
    """``$XDG_RUNTIME_DIR/pdqueue``, else ``~/.cache/pdqueue``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "pdqueue" if runtime else Path.home() / ".cache" / "pdqueue"


def state_path(cluster: str = DEFAULT_CLUSTER) -> Path:
    """The state file of the local cluster named ``cluster``: ``state_dir()/up-<cluster>.json``."""
    return state_dir() / f"up-{cluster}.json"


def read_state(path: Path | str | None = None, *, cluster: str | None = None) -> dict | None:
    """The state (url, cluster, pid, ...) in ``path`` (default: the file of ``cluster``,
    default ``default``), or None if there is none: no file, unreadable, or its ``up``
    process is gone."""
    path = Path(path) if path is not None else state_path(cluster or DEFAULT_CLUSTER)
    try:
        state = json.loads(path.read_text())
        pid = int(state["pid"])
        state["url"], state["cluster"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return state if pid_alive(pid) else None


def running_clusters() -> list[dict]:
    """The states of every running local cluster, sorted by cluster name."""
    try:
        paths = sorted(state_dir().glob("up-*.json"))
    except OSError:
        return []
    states = (read_state(p) for p in paths)
    return sorted((s for s in states if s is not None), key=lambda s: str(s["cluster"]))


def write_state(state: dict, path: Path | None = None) -> Path:
    """Write atomically (mode 0600): readers see the old file or the new one. The default
    path is the file of ``state["cluster"]``."""
    path = path or state_path(state.get("cluster") or DEFAULT_CLUSTER)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(state, f, indent=2)
    os.replace(tmp, path)
    return path


def remove_state(path: Path | None = None, pid: int | None = None, *, cluster: str | None = None) -> None:
    """Remove the state file if it is ours (written by ``pid``, default this process)."""
    path = path or state_path(cluster or DEFAULT_CLUSTER)
    pid = os.getpid() if pid is None else pid
    try:
        if json.loads(path.read_text()).get("pid") == pid:
            path.unlink()
    except (OSError, ValueError, AttributeError):
        pass


# ---- resolve -----------------------------------------------------------------------------

def state_url(state: dict) -> str:
    """The URL to connect to a running ``up`` with: its ``url`` plus its ``password``."""
    url = str(state["url"])
    return with_password(url, str(state["password"])) if state.get("password") else url


def _describe(state: dict) -> str:
    return f"the local cluster {state['cluster']!r} of `pdqueue up` (pid {state['pid']})"


def _pick(states: list[dict], what: str) -> dict | None:
    """One running cluster among ``states``: the only one, else ``default``; None if there
    is none; ``DiscoveryError`` if several and none is ``default``."""
    if not states:
        return None
    if len(states) == 1:
        return states[0]
    for state in states:
        if state["cluster"] == DEFAULT_CLUSTER:
            return state
    names = ", ".join(f"{s['cluster']} ({redact_url(str(s['url']))})" for s in states)
    raise DiscoveryError(f"several local clusters are up{what}: {names}; "
                         "name one with --cluster or PDQ_CLUSTER")


def _explicit_credentials(given: bool | None) -> bool:
    """Whether the caller named a password of its own (``given``; None: the environment's
    ``PDQ_REDIS_PASSWORD`` / ``PDQ_REDIS_PASSWORD_FILE``, which the CLI options set)."""
    if given is not None:
        return given
    return bool(os.environ.get(ENV_PASSWORD) or os.environ.get(ENV_PASSWORD_FILE))


def _target(url: str, cluster: str, source: str, state: dict | None) -> Target:
    if state is None or not state.get("server_pid"):
        return Target(url, cluster, source)
    return Target(url, cluster, source, up_pid=int(state["pid"]), server_pid=int(state["server_pid"]))


def resolve(redis_url: str | None = None, cluster: str | None = None, credentials: bool | None = None) -> Target:
    """Where to send requests: see the module docstring for the order. ``credentials``:
    whether the caller has a password of its own (None: whether the environment gives
    one); the state file's is then not used. Raises ``DiscoveryError`` only when several
    local clusters are up and neither a cluster nor ``PDQ_CLUSTER`` says which."""
    url, source = redis_url, SOURCE_ARGUMENT
    if not url and os.environ.get("PDQ_REDIS_URL"):
        url, source = os.environ["PDQ_REDIS_URL"], SOURCE_ENV
    cluster = cluster or os.environ.get("PDQ_CLUSTER") or None
    running = running_clusters()
    own_password = _explicit_credentials(credentials)
    if url:  # the URL is known; the cluster is the named one, else that of an `up` serving it
        serving = [s for s in running if strip_credentials(str(s["url"])) == strip_credentials(url)]
        if cluster is None:
            state = _pick(serving, f" at {redact_url(url)}")
            cluster = state["cluster"] if state else DEFAULT_CLUSTER
        if serving and strip_credentials(url) == url and not own_password:  # none given: that `up`'s
            url = state_url(serving[0])
        return _target(url, cluster, source, serving[0] if serving else None)
    if cluster is not None:
        state = next((s for s in running if s["cluster"] == cluster), None)
    else:
        state = _pick(running, "")
        cluster = state["cluster"] if state else DEFAULT_CLUSTER
    if state is None:
        return Target(DEFAULT_URL, cluster, SOURCE_DEFAULT)
    return _target(str(state["url"]) if own_password else state_url(state), cluster, _describe(state), state)
