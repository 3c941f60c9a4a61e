"""KV that outlives the pool: a bounded host-memory tier and a bounded disk tier under the
prefix cache (block_manager.py), so that the next turn of a conversation finds the KV of the
last one (prompt and generated tokens) after the pool had to give its blocks to others.

- *Keys.* An entry is the KV of one full block (``pool[:, :, block]``: every layer, K and V)
  named by its prefix-cache hash, the chain over every token before it and its own, started
  from the engine's prefix root (``engine_prefix_root``: the model, its config and weights'
  fingerprint, the weights' dtype and format, the KV dtype, the block size). Equal keys under
  one root mean equal KV, exactly as in the pool.
- *Host tier* (``HostTier``): a dict of block payloads (host tensors) in LRU order, bounded in
  bytes. A named block evicted from the pool is copied in (``KVTiers.spill``); its least
  recently used entries go to the disk tier when there is one, else are dropped.
- *Disk tier* (``DiskTier``): one file per block, named by the hash, under a directory per
  prefix root (``<dir>/<root hex>/``): another model, weights, dtype or block size reads
  another directory, so it never matches. A file holds a header (magic, the hash, the
  pool's dtype, the payload's format, the block's shape, a blake2b of the payload) then the
  payload; it is written to a
  temporary name and renamed (a reader sees a whole file or none). Bounded in bytes, least
  recently used first by mtime (a hit touches its file). A file that is short, corrupt or of
  another shape is a miss (and removed), never an error. The files outlive the process: a
  worker restarted with the same ``--kv-disk-dir`` serves them (``KVTiers.flush`` writes the
  pool's and the host tier's named blocks there at a clean stop).
- *Across workers of a node.* Workers may share a disk directory: a file another one wrote
  is found by its name (``DiskTier.__contains__``). A decode worker writes a finished
  sequence's answer blocks there at once (``write_finished``, ``persist``), so the next
  turn's prefill worker on this node, which holds the prompt's blocks, computes only the
  new tokens.
- *Hits* (``KVTiers.fetch``): the leading run of a chain's hashes found in a tier; the
  payloads are read (disk hits promoted to the host tier) before any pool block is handed
  out, and the block manager copies each into a fresh block (``load``), names it and counts
  its tokens as cached: the sequence computes only the rest.
- *Formats* (``--kv-tier-format``: ``KVTiers(kv_format=)``, engine.kv_codec). Payloads are
  stored ``native`` (the pool's dtype, bit for bit), ``fp16`` (float16 of a float32 pool:
  half the bytes) or ``int8`` (K scaled per channel, V per token, engine.kv_codec: 0.28 of float32's bytes),
  encoded when a block is spilled or written and decoded when it is loaded. A payload says
  its own format (its dtype: ``payload_format``), and a disk file's header names its format:
  a file of another format than this tier's (written by another worker on the directory, or
  before a restart with another ``--kv-tier-format``) is decoded as what it is, the KV that
  worker kept; a header of a format this build does not know, or whose size does not match
  its format, is a miss. Files of the first version (no format in the header) are native.
- *Leases.* An entry being read or copied is held (``HostTier.lease``): eviction passes over
  held entries, so nothing in use goes. A payload, once fetched, is the caller's object:
  the store never writes into a payload, it only drops its reference.
- *Failures.* Every failure of a tier is a miss: the block is computed again, as without
  the tier. A write that fails (disk full, read-only) is logged once and skipped.

Imports torch only.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path

import torch

from pdqueue.engine.kv_codec import FORMATS, FP16, INT8, NATIVE, KVCodec

log = logging.getLogger("pdqueue.engine")

_MAGIC_V1 = b"PDQKV1\0\0"   # files without a format (native): still read
_HEADER_V1 = struct.Struct("<8s16s16s6Q16s")   # magic, hash, dtype name, shape (5 dims + 0), payload blake2b
_MAGIC = b"PDQKV2\0\0"
_HEADER = struct.Struct("<8s16s16s16s6Q16s")   # magic, hash, pool dtype, format, shape (5 dims + 0), blake2b
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def payload_format(payload: torch.Tensor, pool_dtype: torch.dtype) -> str:
    """The format of a block payload (engine.kv_codec's ``encode_block``): int8 payloads are
    bytes, fp16 ones float16 (of a float32 or bfloat16 pool), native ones the pool's dtype."""
    if payload.dtype == torch.uint8:
        return INT8
    return NATIVE if payload.dtype == pool_dtype else FP16


def _payload_bytes(payload: torch.Tensor) -> bytes:
    flat = payload.contiguous().view(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def leading_run(has, hashes) -> int:
    """How many of ``hashes`` (a chain, in order) ``has`` finds, from the first on: a tier's
    ``leading`` (KVTiers, and the staged tier a pull puts on top of it, workers/kv_pull.py)."""
    n = 0
    for h in hashes:
        if not has(h):
            break
        n += 1
    return n


class HostTier:
    """Block payloads (host tensors) by hash, least recently used first, at most
    ``capacity_bytes`` (held entries may exceed it until released). ``overflow(hash,
    payload)``: where an evicted entry goes (the disk tier), or None."""

    def __init__(self, capacity_bytes: int, overflow=None):
        self.capacity = capacity_bytes
        self.overflow = overflow
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._held: dict[bytes, int] = {}
        self.nbytes = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, h: bytes) -> bool:
        return h in self._entries

    def keys(self) -> list[bytes]:
        return list(self._entries)

    def get(self, h: bytes) -> torch.Tensor | None:
        payload = self._entries.get(h)
        if payload is not None:
            self._entries.move_to_end(h)
        return payload

    def put(self, h: bytes, payload: torch.Tensor) -> None:
        size = payload.numel() * payload.element_size()
        if size > self.capacity:
            if self.overflow is not None:
                self.overflow(h, payload)
            return
        old = self._entries.pop(h, None)
        if old is not None:
            self.nbytes -= old.numel() * old.element_size()
        self._entries[h] = payload
        self.nbytes += size
        self._evict()

    @contextmanager
    def lease(self, hashes):
        """Hold ``hashes``' entries (never evicted meanwhile)."""
        hashes = list(hashes)
        for h in hashes:
            self._held[h] = self._held.get(h, 0) + 1
        try:
            yield
        finally:
            for h in hashes:
                n = self._held.pop(h) - 1
                if n:
                    self._held[h] = n
            self._evict()

    def _evict(self) -> None:
        if self.nbytes <= self.capacity:
            return
        for h in list(self._entries):
            if self.nbytes <= self.capacity:
                break
            if h in self._held:
                continue
            payload = self._entries.pop(h)
            self.nbytes -= payload.numel() * payload.element_size()
            self.evicted += 1
            if self.overflow is not None:
                self.overflow(h, payload)


class DiskTier:
    """Block payloads in files under ``directory / root.hex()``, at most ``capacity_bytes``
    of them (see the module docstring). ``shape``/``dtype``: a payload's."""

    def __init__(self, directory: str | Path, root: bytes, capacity_bytes: int, shape, dtype: str,
                 kv_format: str = NATIVE):
        self.dir = Path(directory) / root.hex()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity_bytes
        self.shape = tuple(shape)
        self.dtype = dtype
        # One codec per format: a file is read in the format its header names, whatever this tier writes.
        self.codecs = {name: KVCodec(name, _DTYPES[dtype], *self.shape[2:]) for name in FORMATS}
        self.format = self.codecs[kv_format].format
        self.payload_nbytes = self._payload_nbytes(self.format)
        self.file_nbytes = _HEADER.size + self.payload_nbytes   # this tier's files (the bound counts these)
        self._max_file_nbytes = _HEADER.size + max(self._payload_nbytes(name) for name in FORMATS)
        self._names: OrderedDict[bytes, None] = OrderedDict()   # by mtime, oldest first
        self.misses = self.corrupt = self.written = self.evicted = 0
        self._warned = False
        found = []
        for path in self.dir.iterdir():
            if path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)   # a write cut short by a crash
                continue
            try:
                found.append((path.stat().st_mtime_ns, bytes.fromhex(path.name)))
            except (ValueError, OSError):
                continue
        for _, h in sorted(found):
            self._names[h] = None
        self._evict()

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, h: bytes) -> bool:
        """In this store, or written since by another worker sharing the directory."""
        if h in self._names:
            return True
        if self.path(h).exists():
            self._names[h] = None
            self._evict()
            return h in self._names
        return False

    @property
    def nbytes(self) -> int:
        return len(self._names) * self.file_nbytes

    def path(self, h: bytes) -> Path:
        return self.dir / h.hex()

    def _payload_nbytes(self, name: str) -> int:
        return 2 * self.shape[0] * self.codecs[name].unit_nbytes

    def _payload_shape(self, name: str) -> tuple[int, ...]:
        return (2 * self.shape[0], self.codecs[name].unit_nbytes) if name == INT8 else self.shape

    def put(self, h: bytes, payload: torch.Tensor) -> None:
        fmt = payload_format(payload, _DTYPES[self.dtype])
        if h in self._names or tuple(payload.shape) != self._payload_shape(fmt) or self.file_nbytes > self.capacity:
            return
        data = _payload_bytes(payload)
        dims = list(self.shape) + [0] * (6 - len(self.shape))
        header = _HEADER.pack(_MAGIC, h, self.dtype.encode(), fmt.encode(), *dims,
                              hashlib.blake2b(data, digest_size=16).digest())
        final = self.path(h)
        tmp = final.with_name(final.name + f".{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(data)
            os.replace(tmp, final)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if not self._warned:
                self._warned = True
                log.warning("KV disk tier: cannot write %s (%s); blocks that do not fit the host tier are dropped",
                            self.dir, exc)
            return
        self._names[h] = None
        self.written += 1
        self._evict()

    def get(self, h: bytes) -> torch.Tensor | None:
        """The payload of ``h``, or None (absent, short, corrupt: then removed)."""
        if h not in self._names:
            return None
        path = self.path(h)
        try:
            with open(path, "rb") as f:
                raw = f.read(self._max_file_nbytes + 1)
        except OSError:
            self._drop(h)
            self.misses += 1
            return None
        payload = self._parse(h, raw)
        if payload is None:
            self.corrupt += 1
            self._drop(h)
            return None
        self._names.move_to_end(h)
        try:
            os.utime(path)
        except OSError:
            pass
        return payload

    def _parse(self, h: bytes, raw: bytes) -> torch.Tensor | None:
        """A file's payload in the format its header names (a version-1 file: native), or
        None: short, corrupt, of another block or dtype, or of a format this build does not know."""
        if raw[:len(_MAGIC)] == _MAGIC_V1 and len(raw) >= _HEADER_V1.size:
            header, (_magic, name, dtype, *rest) = _HEADER_V1, _HEADER_V1.unpack_from(raw)
            fmt = NATIVE
        elif raw[:len(_MAGIC)] == _MAGIC and len(raw) >= _HEADER.size:
            header, (_magic, name, dtype, fmt, *rest) = _HEADER, _HEADER.unpack_from(raw)
            fmt = fmt.rstrip(b"\0").decode(errors="replace")
        else:
            return None
        dims, digest = tuple(d for d in rest[:6] if d), rest[6]
        data = raw[header.size:]
        if (fmt not in FORMATS or self.codecs[fmt].format != fmt or name != h
                or dtype.rstrip(b"\0").decode(errors="replace") != self.dtype
                or dims != self.shape or len(data) != self._payload_nbytes(fmt)
                or hashlib.blake2b(data, digest_size=16).digest() != digest):
            return None
        stored = torch.uint8 if fmt == INT8 else torch.float16 if fmt == FP16 else _DTYPES[self.dtype]
        return torch.frombuffer(bytearray(data), dtype=stored).view(self._payload_shape(fmt))

    def _drop(self, h: bytes) -> None:
        self._names.pop(h, None)
        self.path(h).unlink(missing_ok=True)

    def _evict(self) -> None:
        while self._names and self.nbytes > self.capacity:
            h, _ = self._names.popitem(last=False)
            self.path(h).unlink(missing_ok=True)
            self.evicted += 1


class KVTiers:
    """The tiers under one engine's pool: what the block manager calls (``spill``, ``has``,
    ``fetch``, ``load``). ``host_bytes``: the host tier's bound (0: none); ``disk_dir`` and
    ``disk_bytes``: the disk tier's (None or 0: none). ``bind(pool, root)`` before use (a
    worker binds the tiers to each role's engine in turn: the host tier's entries stay valid
    across roles when the root is the same, and are dropped when it is not)."""

    def __init__(self, host_bytes: int = 0, disk_dir: str | Path | None = None, disk_bytes: int = 0,
                 kv_format: str = NATIVE):
        self.kv_format = kv_format   # how payloads are stored (engine.kv_codec): native, fp16, int8
        self.codec: KVCodec | None = None
        self.host_bytes = host_bytes
        self.disk_dir = disk_dir
        self.disk_bytes = disk_bytes if disk_dir else 0
        self.pool: torch.Tensor | None = None
        self.root: bytes = b""
        self.host: HostTier | None = None
        self.disk: DiskTier | None = None
        self.spilled = self.loaded = 0
        # Write a finished sequence's answer blocks to the disk tier at once (a decode worker:
        # the next turn's prompt repeats them, and its prefill worker on this node reads them).
        self.write_finished = False

    @property
    def enabled(self) -> bool:
        return bool(self.host_bytes or self.disk_bytes)

    def bind(self, pool: torch.Tensor, root: bytes) -> None:
        shape = (pool.shape[0], pool.shape[1], *pool.shape[3:])
        dtype = next(name for name, value in _DTYPES.items() if value == pool.dtype)
        same = self.root == root and self.pool is not None and tuple(self.pool.shape) == tuple(pool.shape) \
            and self.pool.dtype == pool.dtype
        self.pool = pool
        if same:
            return
        self.root = root
        self.codec = KVCodec(self.kv_format, pool.dtype, *pool.shape[3:])
        self.disk = (DiskTier(self.disk_dir, root, self.disk_bytes, shape, dtype, self.kv_format)
                     if self.disk_bytes else None)
        overflow = self.disk.put if self.disk is not None else None
        self.host = HostTier(self.host_bytes, overflow=overflow) if self.host_bytes else None

    def has(self, h: bytes) -> bool:
        return (self.host is not None and h in self.host) or (self.disk is not None and h in self.disk)

    def leading(self, hashes) -> int:
        """How many of ``hashes`` (a chain, in order) a tier holds, from the first on."""
        return leading_run(self.has, hashes)

    def spill(self, h: bytes, block_id: int) -> None:
        """The pool's block ``block_id``, named ``h``, is about to be reused: keep a copy."""
        if self.has(h):
            if self.host is not None:
                self.host.get(h)   # most recently used again
            return
        payload = self.codec.encode_block(self.pool, block_id)
        self.spilled += 1
        if self.host is not None:
            self.host.put(h, payload)
        elif self.disk is not None:
            self.disk.put(h, payload)

    def fetch(self, hashes) -> list[torch.Tensor]:
        """The payloads of the leading run of ``hashes`` a tier holds (a read that fails ends
        the run there)."""
        hashes = list(hashes)
        out: list[torch.Tensor] = []
        lease = self.host.lease(hashes) if self.host is not None else _nothing()
        with lease:
            for h in hashes:
                payload = self.host.get(h) if self.host is not None else None
                if payload is None and self.disk is not None:
                    payload = self.disk.get(h)
                    if payload is not None and self.host is not None:
                        self.host.put(h, payload)
                if payload is None:
                    break
                out.append(payload)
        return out

    def load(self, block_id: int, payload: torch.Tensor) -> None:
        """Copy a fetched payload (of any format: it decodes as what it is) into the pool's
        block ``block_id``."""
        self.codec.decode_block(payload, self.pool, block_id)
        self.loaded += 1

    def persist(self, named) -> None:
        """Write the pool's blocks ``named`` ((hash, block id) pairs) to the disk tier now."""
        if self.disk is None:
            return
        for h, block_id in named:
            if h not in self.disk:
                self.disk.put(h, self.codec.encode_block(self.pool, block_id))

    def flush(self, named) -> int:
        """Clean stop: write the host tier's entries, then the pool's named blocks (``named``:
        (hash, block id) pairs, least recently used first) to the disk tier, so the most
        recently used are written last and kept longest.
        Returns how many were written."""
        if self.disk is None or self.pool is None:
            return 0
        before = self.disk.written
        if self.host is not None:
            for h in self.host.keys():
                payload = self.host.get(h)
                if payload is not None:
                    self.disk.put(h, payload)
        for h, block_id in named:
            if h not in self.disk:
                self.disk.put(h, self.codec.encode_block(self.pool, block_id))
        return self.disk.written - before

    def stats(self) -> dict:
        return {"kv_tier_spilled": self.spilled, "kv_tier_loaded": self.loaded,
                "kv_host_tier_blocks": len(self.host) if self.host is not None else 0,
                "kv_disk_tier_blocks": len(self.disk) if self.disk is not None else 0}


@contextmanager
def _nothing():
    yield


def attach(tiers: KVTiers | None, engine) -> None:
    """Put ``tiers`` under ``engine``'s pool (an LLMEngine with prefix caching on; else, or
    with ``tiers`` None or disabled, nothing)."""
    if tiers is None or not tiers.enabled or not engine.block_manager.enable_caching:
        return
    tiers.bind(engine.kv_cache, engine.block_manager.root)
    engine.block_manager.tier = tiers
