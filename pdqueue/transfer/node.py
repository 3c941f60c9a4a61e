"""The shared-memory domain id ("node") of this process.

It is the content of ``<shm_dir>/pdq-node-id``, a random hex id written once by whichever
process comes first. Processes that can map each other's segments read the same file and
so the same id; a container with a private /dev/shm reads (or writes) another. The file is
never removed: it belongs to the shm domain, not to a process. ``PDQ_NODE_ID`` overrides.
Imports the standard library only.
"""

from __future__ import annotations

import os
import secrets
import time

NODE_FILE = "pdq-node-id"
DEFAULT_SHM_DIR = "/dev/shm"


def node_id(shm_dir: str = DEFAULT_SHM_DIR) -> str:
    """This process's shared-memory domain id, creating it on first use."""
    override = os.environ.get("PDQ_NODE_ID")
    if override:
        return override
    path = os.path.join(shm_dir, NODE_FILE)
    for _ in range(100):
        existing = _read(path)
        if existing:
            return existing
        new_id = secrets.token_hex(16)
        if _publish(path, new_id):
            return new_id
        time.sleep(0.01)  # lost a create race to a writer that has not written yet
    raise RuntimeError(f"{path} exists but stays empty; remove it if no process is creating it")


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def _publish(path: str, new_id: str) -> bool:
    """Write the id under a private name, then link it into place: readers never see a
    half-written file, and O_EXCL semantics (link fails if the name exists) pick one winner."""
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, (new_id + "\n").encode("ascii"))
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError:
        # a filesystem without hard links: create the name itself exclusively
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, (new_id + "\n").encode("ascii"))
        finally:
            os.close(fd)
        return True
    finally:
        os.unlink(tmp)
