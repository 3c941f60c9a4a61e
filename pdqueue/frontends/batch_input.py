"""A batch's input: the ids of its requests and the parsing of its lines.

A line is ``{"custom_id", "method": "POST", "url", "body"}`` (``url`` one of ``URLS``).
Each request's id comes from the batch id and the ``custom_id``
(``batch:<batch id>:<sha256(custom_id)[:32]>``), so any run of the same batch, after any
crash, finds the requests an earlier run sent. The default batch id is the SHA-256 of the
input (its first 16 hex digits): an edited file never re-attaches to the answers of other
requests that share a ``custom_id``. A line is read whole only up to ``MAX_LINE_BYTES``.
"""

from __future__ import annotations

import hashlib
import json
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

__all__ = ["BatchError", "FileInput", "InputInfo", "Line", "LineError", "MAX_LINE_BYTES", "URLS",
           "check_batch_id", "custom_id_hash", "default_batch_id", "line_id", "parse_line", "raw_lines",
           "request_id", "scan_input"]

URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
MAX_LINE_BYTES = 4 << 20      # a longer input line is an error line (and is never held in memory)

_BATCH_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


class BatchError(Exception):
    """The batch cannot go on (unreadable files, OUTPUT of another batch, Redis gone for
    good); one line for the user. What was written to OUTPUT stays and a rerun resumes."""


@dataclass(frozen=True, slots=True)
class LineError:
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class Line:
    """One non-blank input line: its fields, or why it is not a request line."""
    number: int
    custom_id: str | None = None
    url: str = ""
    body: Any = None
    error: LineError | None = None


# ---- ids ------------------------------------------------------------------------------------

def check_batch_id(batch_id: str) -> str:
    if not isinstance(batch_id, str) or not _BATCH_ID.match(batch_id):
        raise BatchError(f"--batch-id must be 1..64 characters of [A-Za-z0-9._-], got {batch_id!r}")
    return batch_id


def custom_id_hash(custom_id: str) -> str:
    return hashlib.sha256(custom_id.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def request_id(batch_id: str, custom_id: str, attempt: int = 1) -> str:
    """The pdqueue request id of ``custom_id`` in batch ``batch_id`` (``attempt`` > 1: the
    answer of the earlier ids expired unread)."""
    rid = f"batch:{batch_id}:{custom_id_hash(custom_id)}"
    return rid if attempt == 1 else f"{rid}.{attempt}"


def line_id(batch_id: str, tail: str) -> str:
    return f"batch_req_{batch_id}_{tail}"



@dataclass(frozen=True, slots=True)
class InputInfo:
    sha256: str
    lines: int      # non-blank lines


def raw_lines(f) -> Iterator[tuple[int, bytes | None]]:
    """(line number, bytes) of each non-blank line; bytes None for a line longer than
    MAX_LINE_BYTES (read past in pieces, never held whole)."""
    number = 0
    while True:
        raw = f.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        number += 1
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            while raw and not raw.endswith(b"\n"):
                raw = f.readline(1 << 20)
            yield number, None
        elif raw.strip():
            yield number, raw


def scan_input(path: str) -> InputInfo:
    """One pass over INPUT: its SHA-256 and its number of non-blank lines."""
    digest, lines, nonblank = hashlib.sha256(), 0, False
    try:
        with open(path, "rb") as f:
            while True:
                raw = f.readline(1 << 20)   # a long line comes in pieces
                if not raw:
                    break
                digest.update(raw)
                nonblank = nonblank or bool(raw.strip())
                if raw.endswith(b"\n"):
                    lines += nonblank
                    nonblank = False
            lines += nonblank   # a last line without a newline
    except OSError as exc:
        raise BatchError(f"cannot read {path}: {exc.strerror or exc}") from None
    return InputInfo(digest.hexdigest(), lines)


def default_batch_id(info: InputInfo) -> str:
    return info.sha256[:16]


def parse_line(number: int, raw: bytes | None) -> Line:
    """An input line as a ``Line``: its fields, or the ``LineError`` that answers it."""
    if raw is None:
        return Line(number, error=LineError("line_too_long", f"line {number} is longer than {MAX_LINE_BYTES} bytes"))
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        return Line(number, error=LineError("invalid_json_line", f"line {number} is not valid JSON: {exc}"))
    if not isinstance(obj, dict):
        return Line(number, error=LineError("invalid_json_line",
                                            f"line {number} must be a JSON object, got {type(obj).__name__}"))
    custom_id = obj.get("custom_id")
    if custom_id is None:
        return Line(number, error=LineError("missing_required_parameter", f"line {number} has no custom_id"))
    if not isinstance(custom_id, str) or not custom_id:
        return Line(number, error=LineError(
            "invalid_custom_id", f"line {number}: custom_id must be a non-empty string, got {custom_id!r:.60}"))

    def bad(code: str, message: str) -> Line:
        return Line(number, custom_id, error=LineError(code, f"line {number}: {message}"))

    for name in ("method", "url", "body"):
        if name not in obj:
            return bad("missing_required_parameter", f"missing {name!r}")
    method, url, body = obj["method"], obj["url"], obj["body"]
    if not isinstance(method, str) or method.upper() != "POST":
        return bad("invalid_method", f"method must be POST, got {method!r:.60}")
    if url not in URLS:
        return bad("invalid_url", f"url must be one of {', '.join(URLS)}, got {url!r:.80}")
    if not isinstance(body, dict):
        return bad("invalid_body", f"body must be a JSON object, got {type(body).__name__}")
    return Line(number, custom_id, url, body)



class FileInput:
    """INPUT, a local file: ``info()`` reads it once (SHA-256, lines), ``lines()`` again."""

    def __init__(self, path: str):
        self.path = self.name = path

    def info(self) -> InputInfo:
        return scan_input(self.path)

    @contextmanager
    def lines(self) -> Iterator[Iterator[tuple[int, bytes | None]]]:
        with open(self.path, "rb") as f:
            yield raw_lines(f)
