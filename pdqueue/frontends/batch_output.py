"""A batch's output: one ``{"id", "custom_id", "response", "error"}`` line per input line, in
the order answers complete (match on ``custom_id``, as in OpenAI's output files).

Each line's ``id`` (``batch_req_<batch id>_<tail>``) says which input line it answers, so
a rerun skips what the output already holds (only those keys are kept in memory) and
refuses the output of another batch. ``FileOutput`` is a local file, locked against a
second run, written and flushed a line at a time and fsynced at least every second.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import time
from dataclasses import dataclass, field

from pdqueue.frontends.batch_input import MAX_LINE_BYTES, BatchError, LineError, line_id

__all__ = ["Done", "FileOutput", "encode_line", "output_line"]

FSYNC_EVERY_S = 1.0
_TAIL = re.compile(r"^(?:(?P<h>[0-9a-f]{32})(?:\.dup(?P<k>[1-9][0-9]*))?|line(?P<n>[1-9][0-9]*))$")
_LINE_ID = re.compile(rb'^\{"id":\s*"(batch_req_[A-Za-z0-9._-]+)"[,}]')


def output_line(batch_id: str, tail: str, custom_id: str | None, response: dict | None = None,
                error: LineError | None = None) -> dict:
    return {"id": line_id(batch_id, tail), "custom_id": custom_id, "response": response,
            "error": None if error is None else {"code": error.code, "message": error.message}}


def encode_line(obj: dict) -> bytes:
    try:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n"
    except UnicodeEncodeError:  # a lone surrogate from a \ud800 escape: keep it escaped
        return json.dumps(obj, separators=(",", ":")).encode("ascii") + b"\n"


@dataclass(slots=True)
class Done:
    """What OUTPUT already answers: keys of input lines, never the lines themselves."""
    answered: set = field(default_factory=set)     # custom_id hashes (16 bytes): first occurrences
    duplicates: set = field(default_factory=set)   # (hash, k): the k-th repeat of a custom_id
    numbers: set = field(default_factory=set)      # line numbers of lines without a custom_id
    lines: int = 0
    dropped_partial: bool = False


    def add(self, batch_id: str, line_id: str, where: str, number: int) -> None:
        """Count the output line ``line_id`` (line ``number`` of ``where``); BatchError for a
        line of another batch or not a batch line at all."""
        if not isinstance(line_id, str) or not line_id.startswith("batch_req_"):
            raise BatchError(f"{where}: line {number} is not a `pdqueue batch` output line "
                             f"(id {line_id!r:.60}); choose another output file")
        prefix = f"batch_req_{batch_id}_"
        m = _TAIL.match(line_id[len(prefix):]) if line_id.startswith(prefix) else None
        if m is None:
            other = line_id[len("batch_req_"):].rpartition("_")[0] or "?"
            raise BatchError(f"{where} holds answers of batch {other!r}, not of this input's "
                             f"batch {batch_id!r}: resume that one with --batch-id {other}, or choose "
                             f"another output file")
        self.lines += 1
        if m["n"]:
            self.numbers.add(int(m["n"]))
        elif m["k"]:
            self.duplicates.add((bytes.fromhex(m["h"]), int(m["k"])))
        else:
            self.answered.add(bytes.fromhex(m["h"]))


class FileOutput:
    """OUTPUT, a local file, locked against a second run (``open``), appended to a line at a time."""

    def __init__(self, path: str):
        self.path = self.name = path
        self.fd = -1
        self.dirty = False
        self.last_sync = time.monotonic()

    def open(self) -> None:
        path = self.path
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise BatchError(f"cannot open {path}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            self.fd = -1
            raise BatchError(f"{path} is being written by another `pdqueue batch`; wait for it or stop it") from None
        self.last_sync = time.monotonic()

    def read_done(self, batch_id: str) -> Done:
        """The keys of the lines OUTPUT holds; an incomplete last line (a crash while it was
        written) is cut off."""
        done = Done()
        good_end = 0
        with open(self.path, "rb") as f:
            number = 0
            while True:
                raw = f.readline(MAX_LINE_BYTES * 2)
                if not raw:
                    break
                number += 1
                if not raw.endswith(b"\n"):
                    # A crash while the last line was written leaves the start of one of ours;
                    # anything else is not ours to cut.
                    ours = encode_line({"id": line_id(batch_id, "")})[:-3]
                    if f.read(1) or not (raw.startswith(ours) or ours.startswith(raw)):
                        raise BatchError(f"{self.path}: line {number} is not a batch output line; "
                                         f"choose another output file")
                    done.dropped_partial = True
                    break
                good_end += len(raw)
                if not raw.strip():
                    continue
                m = _LINE_ID.match(raw)   # our lines start with their id: no need to parse the rest
                if m is not None:
                    given = m.group(1).decode("ascii")
                else:
                    try:
                        given = json.loads(raw)["id"]
                    except (ValueError, KeyError, TypeError):
                        raise BatchError(f"{self.path}: line {number} is not a batch output line; "
                                         f"choose another output file") from None
                done.add(batch_id, given, self.path, number)
        if done.dropped_partial:
            os.ftruncate(self.fd, good_end)
        return done

    def write(self, obj: dict) -> None:
        data = memoryview(encode_line(obj))
        while data:
            data = data[os.write(self.fd, data):]
        self.dirty = True
        if time.monotonic() - self.last_sync >= FSYNC_EVERY_S:
            self.sync()

    def sync(self) -> None:
        if self.dirty:
            os.fsync(self.fd)
            self.dirty = False
        self.last_sync = time.monotonic()

    def close(self) -> None:
        if self.fd < 0:
            return
        try:
            self.sync()
        finally:
            os.close(self.fd)  # releases the lock
            self.fd = -1

