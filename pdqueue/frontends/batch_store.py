"""The gateway's Batch API state, all in Redis (a gateway restart, or another gateway, goes on
where one stopped): uploaded files, batch records, and the output and error lines.

Keys (the cluster's prefix, so one hash slot):

- ``gwfile:<file id>``: an uploaded file's bytes; ``gwfile:<file id>:meta``: its object
  (``bytes``, ``created_at``, ``filename``, ``purpose``) and what the upload checked
  (``lines``, ``sha256``, ``urls``).
- ``gwbatch:<batch id>``: the batch's object as a hash (``status``, the timestamps,
  ``input_file_id``, ``endpoint``, ``metadata`` as JSON); ``gwbatches``: every batch by
  creation time; ``gwbatches:active``: those not ended yet, which runners look at.
- ``gwbatch:<batch id>:out`` / ``:err``: the output lines (status 200 / anything else),
  one list item each: what ``GET /v1/files/<output or error file id>/content`` returns.
- ``gwbatch:<batch id>:lock``: the runner's lease (a random owner, ``PX``).

Everything lives ``RETENTION_S`` after its last change.
"""

from __future__ import annotations

import hashlib
import json
import re
from contextlib import contextmanager
from typing import Iterator

import redis

from pdqueue.frontends.batch_input import MAX_LINE_BYTES, BatchError, InputInfo, raw_lines
from pdqueue.frontends.batch_output import Done, encode_line
from pdqueue.keys import Keys

__all__ = ["BatchKeys", "LeaseLost", "MAX_LINE_BYTES", "RETENTION_S", "RedisInput", "RedisOutput", "check_upload",
           "file_ids_of", "output_file_batch"]

RETENTION_S = 7 * 24 * 3600
READ_CHUNK = 1 << 20            # bytes of a stored file per GETRANGE
LIST_CHUNK = 1000               # output lines per LRANGE
_DERIVED = re.compile(r"^file-(?P<b>batch_[0-9a-f]{1,64})-(?P<kind>output|errors)$")


class BatchKeys:
    def __init__(self, keys: Keys):
        self.prefix = keys.prefix

    def file(self, file_id: str) -> str:
        return f"{self.prefix}gwfile:{file_id}"

    def file_meta(self, file_id: str) -> str:
        return f"{self.prefix}gwfile:{file_id}:meta"

    def batch(self, batch_id: str) -> str:
        return f"{self.prefix}gwbatch:{batch_id}"

    def out(self, batch_id: str) -> str:
        return f"{self.prefix}gwbatch:{batch_id}:out"

    def err(self, batch_id: str) -> str:
        return f"{self.prefix}gwbatch:{batch_id}:err"

    def lock(self, batch_id: str) -> str:
        return f"{self.prefix}gwbatch:{batch_id}:lock"

    @property
    def batches(self) -> str:
        return self.prefix + "gwbatches"

    @property
    def active(self) -> str:
        return self.prefix + "gwbatches:active"


def file_ids_of(batch_id: str) -> tuple[str, str]:
    """The ids of a batch's output and error files."""
    return f"file-{batch_id}-output", f"file-{batch_id}-errors"


def output_file_batch(file_id: str) -> tuple[str, str] | None:
    """(batch id, "output" | "errors") of a batch's output or error file id, else None."""
    m = _DERIVED.match(file_id)
    return None if m is None else (m["b"], m["kind"])


class _RangeReader:
    """A stored file read a piece at a time (GETRANGE), with ``readline(limit)`` as a file's."""

    def __init__(self, r: redis.Redis, key: str, size: int):
        self.r, self.key, self.size = r, key, size
        self.pos, self.buf = 0, b""

    def _more(self) -> bool:
        if self.pos >= self.size:
            return False
        chunk = self.r.getrange(self.key, self.pos, min(self.size, self.pos + READ_CHUNK) - 1)
        if not chunk:
            raise BatchError(f"the input file {self.key} is gone (expired or deleted)")
        self.pos += len(chunk)
        self.buf += chunk
        return True

    def readline(self, limit: int = -1) -> bytes:
        while True:
            end = self.buf.find(b"\n")
            if end >= 0 and (limit < 0 or end < limit):
                line, self.buf = self.buf[:end + 1], self.buf[end + 1:]
                return line
            if 0 <= limit <= len(self.buf):
                line, self.buf = self.buf[:limit], self.buf[limit:]
                return line
            if not self._more():
                line, self.buf = self.buf, b""
                return line


class RedisInput:
    """An uploaded file as a batch's input (``BatchRun``'s ``source``)."""

    def __init__(self, r: redis.Redis, bkeys: BatchKeys, file_id: str):
        self.r, self.bkeys, self.name = r, bkeys, file_id

    def info(self) -> InputInfo:
        meta = self.r.hgetall(self.bkeys.file_meta(self.name))
        if not meta:
            raise BatchError(f"the input file {self.name} is gone (expired or deleted)")
        return InputInfo(meta[b"sha256"].decode(), int(meta[b"lines"]))

    @contextmanager
    def lines(self) -> Iterator[Iterator[tuple[int, bytes | None]]]:
        size = int(self.r.hget(self.bkeys.file_meta(self.name), "bytes") or 0)
        yield raw_lines(_RangeReader(self.r, self.bkeys.file(self.name), size))


class LeaseLost(Exception):
    """The runner's lease on the batch went to another gateway: it must write nothing more."""


# KEYS: the lease, the list; ARGV: owner, line, ttl. A line is written only under the lease,
# so a runner that lost it (paused past its lease) cannot write a line its successor writes.
_WRITE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('RPUSH', KEYS[2], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[3])
return 1
"""


class RedisOutput:
    """A batch's output and error lines in Redis (``BatchRun``'s ``sink``): one RPUSH per
    line, so a line is there whole or not at all, and what is there is what a rerun skips;
    written only while ``owner`` holds the batch's lease (``LeaseLost`` otherwise)."""

    def __init__(self, r: redis.Redis, bkeys: BatchKeys, batch_id: str, owner: str):
        self.r, self.bkeys, self.batch_id, self.owner = r, bkeys, batch_id, owner
        self.name = f"batch {batch_id}'s output"

    def open(self) -> None:
        pass

    def read_done(self, batch_id: str) -> Done:
        done = Done()
        number = 0
        for key in (self.bkeys.out(self.batch_id), self.bkeys.err(self.batch_id)):
            start = 0
            while True:
                items = self.r.lrange(key, start, start + LIST_CHUNK - 1)
                for raw in items:
                    number += 1
                    try:
                        given = json.loads(raw)["id"]
                    except (ValueError, KeyError, TypeError):
                        raise BatchError(f"{self.name}: line {number} is not a batch output line") from None
                    done.add(batch_id, given, self.name, number)
                if len(items) < LIST_CHUNK:
                    break
                start += LIST_CHUNK
        return done

    def write(self, obj: dict) -> None:
        ok = (obj.get("response") or {}).get("status_code") == 200
        key = self.bkeys.out(self.batch_id) if ok else self.bkeys.err(self.batch_id)
        if not self.r.eval(_WRITE, 2, self.bkeys.lock(self.batch_id), key, self.owner, encode_line(obj),
                           RETENTION_S):
            raise LeaseLost(self.batch_id)

    def close(self) -> None:
        pass


def check_upload(data: bytes) -> tuple[InputInfo, list[str], list[str]]:
    """What an upload for the Batch API holds: (its info, the urls its lines use, the
    problems of its first bad lines; none: every line is a request line, custom_ids unique)."""
    from io import BytesIO

    from pdqueue.frontends.batch_input import parse_line

    problems: list[str] = []
    urls: set[str] = set()
    ids: set[str] = set()
    lines = 0
    for number, raw in raw_lines(BytesIO(data)):
        lines += 1
        line = parse_line(number, raw)
        if line.error is not None:
            problems.append(f"{line.error.message} ({line.error.code})")
        elif line.custom_id in ids:
            problems.append(f"line {number}: custom_id {line.custom_id!r:.60} appeared on an earlier line "
                            f"(duplicate_custom_id)")
        else:
            ids.add(line.custom_id)
            urls.add(line.url)
        if len(problems) >= 5:
            break
    return InputInfo(hashlib.sha256(data).hexdigest(), lines), sorted(urls), problems

