"""The ``shm`` transport: a paged KV pool inside a named POSIX shared-memory segment (the
sender's half: the prefill worker's pool lives in it) and ``ShmTransport``, the receiver's
copy out of it (same shared-memory domain only).

Segment ``<shm_dir>/<prefix>-<worker_id>-<incarnation>`` (mode 0600) holds a page-aligned
header (magic, version, epochs offset, pool offset, random nonce, msgpack metadata: layout
and owner pid/worker/incarnation), then one uint64 **epoch** per block, then the pool
tensor. The magic is written last, so a segment without it is still being created (or its
creator died doing so).

Block epochs let a reader validate a copy without asking the owner (a seqlock per block):
the owner bumps a block's epoch every time its engine hands the block out for new content
(``bump_epochs``, through the engine's ``on_rewrite``, before the step that writes it; a
block that leaves a lease keeps its epoch and its KV, for the prefix cache); a ticket carries the epochs
of its blocks at export; a reader copies, then re-reads the epochs: unchanged means the
blocks were never handed back, so never rewritten, while it copied. This relies on the
owner's epoch store being visible before its later KV stores, and the reader's copy loads
completing before its epoch loads: x86's memory order guarantees both; on weaker orders the
margin is that handed-back blocks are rewritten only by a later prefill step.

Who frees what:
- The owner (``SharedKVPool.create``, the prefill worker) unmaps and unlinks the segment on
  ``close()``. A crashed owner leaves it behind; ``cleanup_segments``, which every worker runs
  periodically, unlinks it once nobody may still copy from it (see there).
- Liveness: the owner holds an ``flock`` on the segment from creation until ``close()``; the
  kernel drops it when the owner dies, whatever its PID namespace, cluster or Redis. The
  metadata says so (``owner_lock``); segments without it come from an earlier pdqueue.
- The segment's mtime is the owner's "keep until": creation time, then (``keep_until``) the
  end of the last lease it exported. After the owner's death a reader may still copy under
  tickets it issued until then (nobody can rewrite those blocks any more).
- An attacher (``SharedKVPool.attach``, the decode worker) maps it read-only and only
  unmaps on ``close()``; unlinking is never its business. Memory of an unlinked segment is
  returned to the system when the last mapping goes.
- Tensors returned by ``.tensor`` view the mapping: after ``close()`` the mapping stays alive
  until the last such tensor is dropped; do not use them after close.

The plain ``os.open``/``mmap`` is used on purpose: ``multiprocessing.shared_memory`` registers
segments with a resource tracker that unlinks them when any attaching process exits.

``ShmTransport`` (receiver): maps the sender's segment read-only once per (segment, nonce)
and keeps the mapping (at most MAX_MAPPINGS, least recently used dropped; mappings whose
segment was unlinked are dropped too, so a departed sender's memory is returned). Check the
ticket's block epochs (LEASE_EXPIRED if the blocks went back to the sender's engine
already) -> copy -> check them again (LEASE_LOST: they went back while we copied; the copy
is discarded) -> a fire-and-forget release over the control channel. No round trip: the
epochs say what the sender would.
Imports torch, msgpack, engine.kv_cache.
"""

from __future__ import annotations

import errno
import fcntl
import hmac
import logging
import mmap
import os
import secrets
import struct
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import msgpack
import numpy as np
import torch

from pdqueue.engine.kv_cache import KVCacheLayout
from pdqueue.procs import pid_alive
from pdqueue.transfer.base import ReceiveContext, Ticket, Transport
from pdqueue.transfer.blocks import copy_blocks, planes
from pdqueue.transfer.errors import FailureCode, TransferError
from pdqueue.transfer.node import DEFAULT_SHM_DIR

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "pdq-kv"
SEGMENT_MAGIC = b"PDQKVSEG"
SEGMENT_VERSION = 2   # 2: block epochs between the metadata and the pool
_HEADER = struct.Struct("<8sIII16sI")   # magic, version, epochs offset, pool offset, nonce, metadata length
_PREFAULT_CHUNK = 64 << 20
MAX_MAPPINGS = 8          # segments a receiver keeps mapped
_SWEEP_EVERY_S = 1.0      # how often it drops mappings of unlinked segments


def segment_name(name_prefix: str, worker_id: str, incarnation: str) -> str:
    name = f"{name_prefix}-{worker_id}-{incarnation}"
    if "/" in name or "\0" in name:
        raise ValueError(f"invalid segment name {name!r}")
    return name


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    name: str
    nonce: str
    epochs_offset: int
    pool_offset: int
    size: int
    layout: KVCacheLayout
    pid: int
    worker_id: str
    incarnation: str
    inode: int
    owner_lock: bool = False   # the owner holds an flock on the segment while it lives


def read_segment_info(path: str) -> SegmentInfo:
    """Parse a segment's header without mapping it. Raises TransferError if unusable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except (FileNotFoundError, PermissionError) as exc:
        raise TransferError(f"cannot open segment {path}: {exc}", FailureCode.SEGMENT_UNAVAILABLE) from None
    try:
        return _parse_header(fd, path)
    finally:
        os.close(fd)


def _parse_header(fd: int, path: str) -> SegmentInfo:
    size = os.fstat(fd).st_size
    head = os.pread(fd, mmap.PAGESIZE, 0)
    if len(head) < _HEADER.size:
        raise TransferError(f"segment {path} is too short for a header", FailureCode.SEGMENT_UNAVAILABLE)
    magic, version, epochs_offset, pool_offset, nonce, meta_len = _HEADER.unpack_from(head)
    if magic != SEGMENT_MAGIC:
        raise TransferError(f"{path} is not a complete pdqueue KV segment", FailureCode.SEGMENT_UNAVAILABLE)
    if version != SEGMENT_VERSION:
        raise TransferError(f"segment {path} has version {version}, expected {SEGMENT_VERSION}",
                            FailureCode.VERSION_MISMATCH)
    if _HEADER.size + meta_len > len(head):
        head = os.pread(fd, _HEADER.size + meta_len, 0)
    try:
        meta = msgpack.unpackb(head[_HEADER.size:_HEADER.size + meta_len], raw=False)
        layout = KVCacheLayout.from_dict(meta["layout"])
        info = SegmentInfo(os.path.basename(path), nonce.hex(), epochs_offset, pool_offset, size, layout,
                           int(meta["pid"]), str(meta["worker_id"]), str(meta["incarnation"]),
                           os.fstat(fd).st_ino, bool(meta.get("owner_lock", False)))
    except Exception as exc:
        raise TransferError(f"segment {path} has a corrupt header: {exc}", FailureCode.SEGMENT_UNAVAILABLE) from None
    if (pool_offset % mmap.PAGESIZE or size < pool_offset + layout.nbytes or epochs_offset % 8
            or not _HEADER.size + meta_len <= epochs_offset <= pool_offset - 8 * layout.num_blocks):
        raise TransferError(f"segment {path} is truncated or misaligned", FailureCode.SEGMENT_UNAVAILABLE)
    return info


class SharedKVPool:
    """A KV pool tensor living in a shared-memory segment (see the module docstring)."""

    def __init__(self, path: str, info: SegmentInfo, mm: mmap.mmap, is_owner: bool, lock_fd: int | None = None):
        self.path = path
        self.info = info
        self.is_owner = is_owner
        self._lock_fd = lock_fd   # owner: open, holding the flock that tells cleaners it lives
        self._mm = mm
        self._view = memoryview(mm)[info.pool_offset:info.pool_offset + info.layout.nbytes]
        # Epochs as numpy: reading a read-only mapping needs no copy and raises no warning.
        self._epochs = np.frombuffer(mm, dtype=np.uint64, count=info.layout.num_blocks, offset=info.epochs_offset)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            self._tensor: torch.Tensor | None = info.layout.allocate(buffer=self._view)

    name = property(lambda self: self.info.name)
    nonce = property(lambda self: self.info.nonce)
    layout = property(lambda self: self.info.layout)

    @property
    def tensor(self) -> torch.Tensor:
        """The pool ``[L, 2, num_blocks, block_size, kv_heads, head_dim]``. Read-only for an
        attacher (the mapping is PROT_READ: writing to it kills the process)."""
        if self._tensor is None:
            raise TransferError(f"segment {self.name} is closed", FailureCode.CLOSED)
        return self._tensor

    @classmethod
    def create(cls, layout: KVCacheLayout, name_prefix: str, worker_id: str, incarnation: str,
               *, shm_dir: str = DEFAULT_SHM_DIR) -> "SharedKVPool":
        """Create, pre-fault and map a new segment. Raises FileExistsError if the name is taken."""
        name = segment_name(name_prefix, worker_id, incarnation)
        path = os.path.join(shm_dir, name)
        meta = msgpack.packb({"layout": layout.to_dict(), "pid": os.getpid(), "worker_id": worker_id,
                              "incarnation": incarnation, "created_at": time.time(), "owner_lock": True},
                             use_bin_type=True)
        epochs_offset = _round_up(_HEADER.size + len(meta), 8)
        pool_offset = _round_up(epochs_offset + 8 * layout.num_blocks, mmap.PAGESIZE)
        size = pool_offset + _round_up(layout.nbytes, mmap.PAGESIZE)
        nonce = secrets.token_bytes(16)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Held until close() or death. A cleaner that holds it for a moment (it found
            # the segment empty, so in creation) only delays us.
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.ftruncate(fd, size)
            _reserve(fd, size, shm_dir)
            inode = os.fstat(fd).st_ino
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            mm[:_HEADER.size] = _HEADER.pack(b"\0" * 8, SEGMENT_VERSION, epochs_offset, pool_offset, nonce,
                                             len(meta))
            mm[_HEADER.size:_HEADER.size + len(meta)] = meta
            _prefault(mm, pool_offset, size)
            mm[:len(SEGMENT_MAGIC)] = SEGMENT_MAGIC
        except BaseException:
            os.unlink(path)
            os.close(fd)
            raise
        info = SegmentInfo(name, nonce.hex(), epochs_offset, pool_offset, size, layout, os.getpid(), worker_id,
                           incarnation, inode, owner_lock=True)
        log.info("created KV segment %s (%.1f MiB)", path, size / 2**20)
        return cls(path, info, mm, is_owner=True, lock_fd=fd)

    @classmethod
    def attach(cls, name: str, expected_nonce: str, *, shm_dir: str = DEFAULT_SHM_DIR) -> "SharedKVPool":
        """Map an existing segment read-only after checking magic, version and nonce."""
        path = os.path.join(shm_dir, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except (FileNotFoundError, PermissionError) as exc:
            raise TransferError(f"cannot open segment {path}: {exc}", FailureCode.SEGMENT_UNAVAILABLE) from None
        try:
            info = _parse_header(fd, path)
            if not hmac.compare_digest(info.nonce, str(expected_nonce or "")):
                raise TransferError(f"segment {path} has another nonce than the ticket's: it was "
                                    "recreated or belongs to another shm domain", FailureCode.NONCE_MISMATCH)
            mm = mmap.mmap(fd, info.size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        return cls(path, info, mm, is_owner=False)

    def epochs_of(self, block_ids) -> list[int]:
        """The current epochs of ``block_ids`` (see the module docstring)."""
        if self._tensor is None:
            raise TransferError(f"segment {self.name} is closed", FailureCode.CLOSED)
        return self._epochs[list(block_ids)].tolist()

    def keep_until(self, t: float) -> None:
        """Owner only: should it die, keep the segment until wall-clock time ``t`` at least
        (call it with the end of a lease before the lease's ticket is published). Stored as
        the segment's mtime, which only grows here; writes through the mapping leave it."""
        if self._lock_fd is None:
            raise PermissionError("only the segment's open owner sets its keep-until time")
        try:
            if t > os.fstat(self._lock_fd).st_mtime:
                os.utime(self._lock_fd, (t, t))
        except OSError as exc:   # never worth failing a publish for: a shorter grace at worst
            log.warning("could not set the keep-until time of %s: %s", self.path, exc)

    def bump_epochs(self, block_ids) -> None:
        """Owner only, before ``block_ids`` go back to its engine: copies of them that a
        reader validates afterwards are refused."""
        if not self.is_owner:
            raise PermissionError("only the segment's owner bumps epochs")
        self._epochs[list(block_ids)] += np.uint64(1)

    def close(self, unlink: bool | None = None) -> None:
        """Unmap (deferred while tensors view it); the owner also unlinks unless unlink=False."""
        if self._tensor is not None:
            self._tensor = None
            self._epochs = None
            try:
                self._view.release()
                self._mm.close()
            except BufferError:
                pass  # tensors still view the mapping: it is unmapped when the last one dies
        if self.is_owner if unlink is None else unlink:
            self.unlink()
        if self._lock_fd is not None:
            os.close(self._lock_fd)   # releases the flock: from now on the segment looks dead
            self._lock_fd = None

    def is_unlinked(self) -> bool:
        """The name no longer leads to this segment (unlinked, or replaced by another)."""
        try:
            return os.stat(self.path).st_ino != self.info.inode
        except FileNotFoundError:
            return True

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> "SharedKVPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _prefault(mm: mmap.mmap, start: int, end: int) -> None:
    """Write zeros over [start, end) in big chunks so that every page is allocated now:
    first-touch writes later would run at a fifth of the warm copy speed."""
    view = memoryview(mm)
    try:
        flat = torch.frombuffer(view[start:end], dtype=torch.uint8)
        for offset in range(0, end - start, _PREFAULT_CHUNK):
            flat[offset:offset + _PREFAULT_CHUNK].zero_()
        del flat
    finally:
        view.release()


def cleanup_segments(alive: Callable[[str, str], bool] | None = None, *, shm_dir: str = DEFAULT_SHM_DIR,
                     name_prefix: str = DEFAULT_PREFIX, grace_s: float = 60.0) -> list[str]:
    """Unlink this shm domain's segments of dead owners that nobody may still copy from.
    Returns the names removed. Processes that still map a removed segment keep their mapping.

    - The owner's flock is held (it lives, in whatever PID namespace or cluster; or it is
      still creating the segment): kept.
    - A segment that records ``owner_lock`` and whose lock is free: its owner is dead.
      Removed once its mtime (the end of its owner's last lease, see ``keep_until``) has
      passed; until then decode workers may still copy out of it under its tickets.
    - A segment of an earlier pdqueue (no ``owner_lock``): removed when ``alive(worker_id,
      incarnation)`` denies (this cluster's registry) *and* its pid is gone; kept when
      ``alive`` is None.
    - An incomplete or unreadable one whose lock is free: removed once its mtime is older
      than ``grace_s`` (its creator died mid-creation).
    """
    removed = []
    try:
        entries = list(os.scandir(shm_dir))
    except FileNotFoundError:
        return removed
    for entry in entries:
        if not entry.name.startswith(name_prefix + "-"):
            continue
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
            fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue  # gone meanwhile, or another user's
        try:
            if _remove_if_dead(fd, entry.path, alive, grace_s):
                removed.append(entry.name)
        except OSError as exc:
            log.warning("could not check KV segment %s: %s", entry.path, exc)
        finally:
            os.close(fd)   # drops our lock, if we took it
    return removed


def _remove_if_dead(fd: int, path: str, alive: Callable[[str, str], bool] | None, grace_s: float) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False   # its owner holds it (or another cleaner, for a moment)
    st = os.fstat(fd)
    now = time.time()
    try:
        info = _parse_header(fd, path)
    except TransferError:
        dead = now - st.st_mtime > grace_s
    else:
        if info.owner_lock:
            dead = now >= st.st_mtime
        else:
            # Dead only if both say so: the registry (this cluster's view; containers that
            # share IPC but not a pid namespace) and the pid (other clusters on this host).
            dead = alive is not None and not alive(info.worker_id, info.incarnation) and not pid_alive(info.pid)
    if not dead:
        return False
    try:
        if os.stat(path).st_ino != st.st_ino:
            return False   # the name now leads elsewhere
        os.unlink(path)
    except (FileNotFoundError, PermissionError):
        return False
    log.info("removed KV segment %s of a dead owner", path)
    return True


def _reserve(fd: int, size: int, shm_dir: str) -> None:
    """Reserve the segment's pages now. A tmpfs too small for it (a container's default 64 MiB
    /dev/shm, a pod's emptyDir) otherwise kills the process with SIGBUS, and no message, when
    the pool is first touched; here it is an OSError that says what to change."""
    def too_small(free: int) -> OSError:
        return OSError(errno.ENOSPC, f"{shm_dir} has {free / 2**20:.0f} MiB free, too little for a "
                                     f"{size / 2**20:.0f} MiB KV segment: give it more room (docker --shm-size, "
                                     "a pod's /dev/shm emptyDir sizeLimit) or lower --kv-cache-mb")

    st = os.statvfs(shm_dir)
    free = st.f_bavail * st.f_frsize
    if size > free:   # checked first: a tmpfs fills RAM page by page before fallocate gives up
        raise too_small(free)
    try:
        os.posix_fallocate(fd, 0, size)   # others may take room meanwhile
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise too_small(free) from None
        # a filesystem without fallocate: the pages come as the pool is touched


# ---- the receiver half: the shm backend (the sender half is the segment above) ----------------

class ShmTransport(Transport):
    name = "shm"

    def __init__(self, ctx: ReceiveContext):
        super().__init__(ctx)
        self.shm_dir = ctx.extra.get("shm_dir", DEFAULT_SHM_DIR)
        self._mappings: OrderedDict[tuple[str, str], SharedKVPool] = OrderedDict()
        self._last_sweep = 0.0

    def can_fetch(self, ticket: Ticket) -> bool:
        return ticket.node == self.ctx.node and bool(ticket.segment) and bool(ticket.nonce)

    def check(self, ticket: Ticket) -> None:
        segment = self._mapping(ticket)
        info = segment.info
        if (info.worker_id, info.incarnation) != (ticket.worker_id, ticket.incarnation):
            raise TransferError(f"segment {info.name} belongs to {info.worker_id}/{info.incarnation}, the ticket "
                                f"to {ticket.worker_id}/{ticket.incarnation}", FailureCode.STALE_INCARNATION)
        if not info.layout.compatible_with(self.ctx.layout) or max(ticket.block_ids) >= info.layout.num_blocks:
            raise TransferError(f"segment {info.name} layout {info.layout} cannot serve the ticket",
                                FailureCode.LAYOUT_MISMATCH)

    def fetch(self, ticket: Ticket, dst_block_ids: list[int], first_block: int = 0) -> int:
        segment = self._mapping(ticket)
        if len(ticket.block_epochs) != len(ticket.block_ids):
            raise TransferError(f"ticket has {len(ticket.block_epochs)} block epochs for {len(ticket.block_ids)} "
                                "blocks", FailureCode.BAD_TICKET)
        src_ids, expected = ticket.block_ids[first_block:], list(ticket.block_epochs[first_block:])
        if segment.epochs_of(src_ids) != expected:
            raise TransferError(f"the blocks of {ticket.request_id!r} went back to {ticket.worker_id}'s engine "
                                "(lease released or expired)", FailureCode.LEASE_EXPIRED)
        copy_blocks(planes(segment.tensor), src_ids, planes(self.ctx.pool), dst_block_ids)
        if segment.epochs_of(src_ids) != expected:
            raise TransferError(f"the blocks of {ticket.request_id!r} went back to {ticket.worker_id}'s engine "
                                "while they were copied", FailureCode.LEASE_LOST)
        self.ctx.control.release_nowait(ticket)
        return len(src_ids) * 2 * self.ctx.layout.num_layers * self.ctx.layout.block_nbytes

    def forget(self, ticket: Ticket) -> None:
        for key in [k for k in self._mappings if k[0] == ticket.segment]:
            self._mappings.pop(key).close()

    def close(self) -> None:
        while self._mappings:
            self._mappings.popitem()[1].close()

    def _mapping(self, ticket: Ticket) -> SharedKVPool:
        now = time.monotonic()
        if now - self._last_sweep > _SWEEP_EVERY_S:
            self._last_sweep = now
            for key in [k for k, seg in self._mappings.items() if seg.is_unlinked()]:
                self._mappings.pop(key).close()
        key = (ticket.segment, ticket.nonce)
        segment = self._mappings.get(key)
        if segment is not None:
            self._mappings.move_to_end(key)
            return segment
        segment = SharedKVPool.attach(ticket.segment, ticket.nonce, shm_dir=self.shm_dir)
        if len(self._mappings) >= MAX_MAPPINGS:
            self._mappings.popitem(last=False)[1].close()
        self._mappings[key] = segment
        log.info("mapped KV segment %s of %s", ticket.segment, ticket.worker_id)
        return segment
