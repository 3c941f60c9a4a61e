"""OpenAI Batch files through the queue: the logic of ``pdqueue batch INPUT -o OUTPUT``.

INPUT has one ``{"custom_id", "method": "POST", "url", "body"}`` object per line (``url``
``/v1/chat/completions`` or ``/v1/completions``); OUTPUT gets one
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`` per
input line, in the order answers complete (as OpenAI's output files: match on
``custom_id``). The body becomes a pdqueue request and the answer a response body through
``pdqueue.frontends.openai_compat``, the functions the HTTP gateway uses, so both answer alike.

What goes where in OUTPUT (OpenAI's split):

- a line that cannot be run as a request at all (not JSON, a missing or wrong field, a
  bad ``method`` or ``url``, a repeated ``custom_id``): ``response`` null, ``error``
  ``{"code", "message"}``;
- a request the API answers with an HTTP error, as the gateway does (an invalid body: 400;
  a model the live workers do not serve: 404; a worker's ``bad_request``/``too_long``: 400
  with that code; another worker failure: 500): ``response`` with that status and
  ``{"error": {...}}`` as its body, ``error`` null, as OpenAI writes them;
- a completion: ``response`` with status 200 and the completion body.

**Exactly once, across crashes.** Each request's id is derived from the batch id and the
``custom_id`` (``batch:<batch id>:<sha256(custom_id)[:32]>``), so a rerun of the same
command finds what the last run left:

- lines already in OUTPUT are skipped (their ``id`` field, ``batch_req_<batch id>_<tail>``,
  says which input line each answers; only those keys are kept in memory);
- a request already in Redis is re-attached to, never sent again: ``out:<id>`` exists
  (running or finished), or ``seen:<id>`` names its entry and that entry is still in the
  request stream (queued or running). The submit writes ``seen:<id>`` (the idempotency key
  intake checks; its value is the entry id, which lets intake run that very entry) and
  the entry in one script, so there is no moment when a request is queued but not marked;
- a request whose answer is gone (``seen:<id>`` set, its entry finished, ``out:<id>``
  expired: OUT_TTL_S after its last write) is computed again under ``<id>.2`` (then
  ``.3``...), the only case where work is redone, since nothing of it is left.

The default batch id is the SHA-256 of INPUT's content (its first 16 hex digits): the same
file gives the same id wherever it lies, and an edited file, or another one at the same
path, never re-attaches to the answers of different requests that share a ``custom_id``.
OUTPUT's lines name their batch, so resuming into the OUTPUT of another batch is refused
with the id to pass (``--batch-id``) to resume that one.

**Bounded memory.** INPUT is read a line at a time (a line longer than
``MAX_LINE_BYTES`` is an error line, never held); at most ``concurrency`` requests are in
flight; answers are appended to OUTPUT as they complete (written and flushed line by line,
fsynced at least every second and at the end, so a crash loses at most the requests in
flight, and those are re-attached). What grows with the file: 16 bytes per ``custom_id``
(to find duplicates) and per line already in OUTPUT.

Imports redis and pdqueue's client/protocol/keys/openai_compat; no click, no torch.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pdqueue.frontends import openai_compat
from pdqueue.client import build_request
from pdqueue.keys import SEEN_TTL_S, Keys
from pdqueue.protocol import (Completion, FinishReason, Priority, ProtocolError, Request, RequestError,
                              ResultType, parse_result, request_to_fields)
from pdqueue.queue.streams import parse_read_reply
from pdqueue.retry import backoff_delay

__all__ = ["BatchError", "BatchRun", "Counts", "DEFAULT_CONCURRENCY", "LineError", "MAX_LINE_BYTES", "URLS",
           "default_batch_id", "output_line", "parse_line", "request_id", "scan_input"]

URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
DEFAULT_CONCURRENCY = 64
MAX_LINE_BYTES = 4 << 20      # a longer input line is an error line (and is never held in memory)
MAX_ATTEMPTS = 5              # ids <id>, <id>.2 ... <id>.5 when answers expired before they were read
FSYNC_EVERY_S = 1.0
READ_BLOCK_MS = 200           # XREAD BLOCK: also how quickly Ctrl-C is noticed
READ_COUNT = 256              # entries per answer stream per XREAD
FILL_MAX_LINES = 2000         # input lines taken per loop turn (answers are read between turns)

_BATCH_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_TAIL = re.compile(r"^(?:(?P<h>[0-9a-f]{32})(?:\.dup(?P<k>[1-9][0-9]*))?|line(?P<n>[1-9][0-9]*))$")
_ENTRY_ID = re.compile(r"^[0-9]+-[0-9]+$")
_LINE_ID = re.compile(rb'^\{"id":\s*"(batch_req_[A-Za-z0-9._-]+)"[,}]')

MODELS_RECHECK_S = 5.0


# XADD + SET seen:<id> in one step. KEYS: request stream, seen key; ARGV: ttl, field, value, ...
# Returns {1, entry id} when queued, {0, the entry id already holding the id} otherwise.
_SUBMIT = """
local cur = redis.call('GET', KEYS[2])
if cur then return {0, cur} end
local eid = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 2))
redis.call('SET', KEYS[2], eid, 'EX', tonumber(ARGV[1]))
return {1, eid}
"""


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


def _line_id(batch_id: str, tail: str) -> str:
    return f"batch_req_{batch_id}_{tail}"


# ---- input ----------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class InputInfo:
    sha256: str
    lines: int      # non-blank lines


def _raw_lines(f) -> Iterator[tuple[int, bytes | None]]:
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
        return Line(number, error=LineError("invalid_custom_id",
                                            f"line {number}: custom_id must be a non-empty string, got {custom_id!r:.60}"))

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


# ---- output ---------------------------------------------------------------------------------

def output_line(batch_id: str, tail: str, custom_id: str | None, response: dict | None = None,
                error: LineError | None = None) -> dict:
    return {"id": _line_id(batch_id, tail), "custom_id": custom_id, "response": response,
            "error": None if error is None else {"code": error.code, "message": error.message}}


def _encode(obj: dict) -> bytes:
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


class _Output:
    """OUTPUT, locked against a second run, appended to a line at a time."""

    def __init__(self, path: str):
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise BatchError(f"cannot open {path}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise BatchError(f"{path} is being written by another `pdqueue batch`; wait for it or stop it") from None
        self.last_sync = time.monotonic()
        self.dirty = False

    def read_done(self, batch_id: str) -> Done:
        """The keys of the lines OUTPUT holds; an incomplete last line (a crash while it was
        written) is cut off."""
        done = Done()
        prefix = f"batch_req_{batch_id}_"
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
                    ours = _encode({"id": _line_id(batch_id, "")})[:-3]
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
                    line_id = m.group(1).decode("ascii")
                else:
                    try:
                        line_id = json.loads(raw)["id"]
                    except (ValueError, KeyError, TypeError):
                        raise BatchError(f"{self.path}: line {number} is not a batch output line; "
                                         f"choose another output file") from None
                if not isinstance(line_id, str) or not line_id.startswith("batch_req_"):
                    raise BatchError(f"{self.path}: line {number} is not a `pdqueue batch` output line "
                                     f"(id {line_id!r:.60}); choose another output file")
                m = _TAIL.match(line_id[len(prefix):]) if line_id.startswith(prefix) else None
                if m is None:
                    other = line_id[len("batch_req_"):].rpartition("_")[0] or "?"
                    raise BatchError(f"{self.path} holds answers of batch {other!r}, not of this input's "
                                     f"batch {batch_id!r}: resume that one with --batch-id {other}, or choose "
                                     f"another output file")
                done.lines += 1
                if m["n"]:
                    done.numbers.add(int(m["n"]))
                elif m["k"]:
                    done.duplicates.add((bytes.fromhex(m["h"]), int(m["k"])))
                else:
                    done.answered.add(bytes.fromhex(m["h"]))
        if done.dropped_partial:
            os.ftruncate(self.fd, good_end)
        return done

    def write(self, obj: dict) -> None:
        data = memoryview(_encode(obj))
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


# ---- the run --------------------------------------------------------------------------------

@dataclass(slots=True)
class Counts:
    """What this run did so far. ``todo``: the input lines not in OUTPUT at the start."""
    todo: int = 0
    answered: int = 0     # status 200 written
    errors: int = 0       # error lines and error statuses written
    skipped: int = 0      # already in OUTPUT
    in_flight: int = 0    # in Redis, not yet answered
    submitted: int = 0    # sent this run
    reattached: int = 0   # found in Redis, not sent again
    recomputed: int = 0   # answers expired unread: sent again under <id>.N

    @property
    def written(self) -> int:
        return self.answered + self.errors


@dataclass(slots=True)
class _Job:
    number: int
    custom_id: str
    tail: str
    parsed: openai_compat.Parsed
    model: str            # the name the answer carries
    request: Request      # with the id of the current attempt
    attempt: int = 1
    last_id: str = "0-0"


class BatchRun:
    """One run over INPUT. ``prepare()`` reads INPUT once (id, count) and OUTPUT (what is
    done); ``run()`` answers the rest and returns the ``Counts``. ``stop`` (set by Ctrl-C):
    stop sending, write what has arrived, return; what was sent stays in Redis for the next
    run. ``on_progress(counts)`` after each written line."""

    def __init__(self, r: redis.Redis, keys: Keys, input_path: str, output_path: str, *,
                 batch_id: str | None = None, concurrency: int = DEFAULT_CONCURRENCY,
                 stop: threading.Event | None = None, on_progress: Callable[[Counts], None] | None = None,
                 unavailable_after_s: float = 30.0):
        if concurrency < 1:
            raise BatchError("--concurrency must be >= 1")
        self.r, self.keys = r, keys
        self.input_path, self.output_path = input_path, output_path
        self.batch_id = check_batch_id(batch_id) if batch_id is not None else None
        self.concurrency = concurrency
        self.stop = stop or threading.Event()
        self.on_progress = on_progress or (lambda counts: None)
        self.unavailable_after_s = unavailable_after_s
        self.counts = Counts()
        self.interrupted = False
        self.done: Done | None = None
        self.out: _Output | None = None
        self.inflight: dict[str, _Job] = {}   # by answer stream key
        self._ids: set[bytes] = set()         # custom_id hashes met in INPUT
        self._repeats: dict[bytes, int] = {}  # custom_id hash -> repeats met so far
        self._served: tuple[float, dict] = (-1e9, {})

    # -- set-up ---------------------------------------------------------------------------------

    def prepare(self) -> Counts:
        if os.path.exists(self.output_path) and os.path.samefile(self.input_path, self.output_path):
            raise BatchError("OUTPUT must not be INPUT")
        info = scan_input(self.input_path)
        if self.batch_id is None:
            self.batch_id = default_batch_id(info)
        self.out = _Output(self.output_path)
        try:
            self.done = self.out.read_done(self.batch_id)
        except BaseException:
            self.out.close()
            raise
        self.counts.todo = max(0, info.lines - self.done.lines)
        return self.counts

    def close(self) -> None:
        if self.out is not None:
            self.out.close()

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> Counts:
        if self.done is None:
            self.prepare()
        finished = False
        try:
            with open(self.input_path, "rb") as f:
                lines = _raw_lines(f)
                exhausted = False
                while not self.stop.is_set():
                    if not exhausted and len(self.inflight) < self.concurrency:
                        exhausted = self._fill(lines)
                    if not self.inflight:
                        if exhausted:
                            finished = True
                            break
                        continue
                    self._redis(self._read)
        except _Stopped:
            pass
        except OSError as exc:
            raise BatchError(f"cannot read {self.input_path} or write {self.output_path}: "
                             f"{exc.strerror or exc}") from None
        finally:
            self.interrupted = not finished
            self.counts.in_flight = len(self.inflight)
            self.close()
        return self.counts

    def _fill(self, lines: Iterator) -> bool:
        """Take input lines until the window is full: answer those that need no request, send
        (or re-attach) the others. True when INPUT is exhausted."""
        jobs: list[_Job] = []
        room = self.concurrency - len(self.inflight)
        exhausted = False
        for _ in range(FILL_MAX_LINES):
            if len(jobs) >= room or self.stop.is_set():
                break
            item = next(lines, None)
            if item is None:
                exhausted = True
                break
            job = self._take(parse_line(*item))
            if job is not None:
                jobs.append(job)
        if jobs and not self.stop.is_set():   # after Ctrl-C nothing more is sent
            self._redis(lambda: self._place(jobs))
        return exhausted

    def _take(self, line: Line) -> _Job | None:
        """A job for ``line``, or None when it is answered here (an error) or already in OUTPUT."""
        done = self.done
        if line.custom_id is None:
            if line.number in done.numbers:
                self._skip()
            else:
                self._write(output_line(self.batch_id, f"line{line.number}", None, error=line.error), ok=False)
            return None
        tail = custom_id_hash(line.custom_id)
        key = bytes.fromhex(tail)
        if key in self._ids:
            k = self._repeats.get(key, 0) + 1
            self._repeats[key] = k
            if (key, k) in done.duplicates:
                self._skip()
            else:
                error = LineError("duplicate_custom_id", f"line {line.number}: custom_id {line.custom_id!r:.80} "
                                                         f"appeared on an earlier line; only the first is run")
                self._write(output_line(self.batch_id, f"{tail}.dup{k}", line.custom_id, error=error), ok=False)
            return None
        self._ids.add(key)
        if key in done.answered:
            self._skip()
            return None
        if line.error is not None:
            self._write(output_line(self.batch_id, tail, line.custom_id, error=line.error), ok=False)
            return None
        rid = request_id(self.batch_id, line.custom_id)
        try:
            parsed = (openai_compat.parse_chat if URLS[line.url] == "chat" else openai_compat.parse_completion)(line.body)
            model, context = self._model_of(parsed)
            # A chat without max_tokens runs up to the context, as in the gateway.
            request = build_request(**parsed.submit_kwargs(default_max_tokens=context), id=rid)
        except openai_compat.OpenAIError as exc:
            self._write_http_error(tail, line.custom_id, None, exc)
            return None
        except RequestError as exc:
            self._write_http_error(tail, line.custom_id, None, openai_compat.bad_request(exc.reason))
            return None
        except TypeError as exc:  # a submit argument this client does not know yet
            self._write_http_error(tail, line.custom_id, None, openai_compat.bad_request(str(exc)))
            return None
        return _Job(line.number, line.custom_id, tail, parsed, model, request)

    # -- Redis: send or re-attach ---------------------------------------------------------------

    def _place(self, jobs: list[_Job]) -> None:
        """Send each job's request, or re-attach to it when Redis already has it (idempotent:
        run again after a lost connection, it re-attaches to what the first try sent)."""
        placed: list[tuple[_Job, str]] = []   # (job, "submitted" | "reattached")
        lost: list[_Job] = []
        pending = list(jobs)
        while pending:
            keys = self.keys
            pipe = self.r.pipeline(transaction=True)
            for job in pending:
                pipe.exists(keys.out(job.request.id))
                pipe.get(keys.seen(job.request.id))
            state = pipe.execute()
            fresh, queued = [], []
            for i, job in enumerate(pending):
                has_out, seen = state[2 * i], state[2 * i + 1]
                if has_out:
                    placed.append((job, "reattached"))
                elif seen is None:
                    fresh.append(job)
                else:
                    queued.append((job, seen.decode() if isinstance(seen, bytes) else str(seen)))
            if fresh:
                pipe = self.r.pipeline(transaction=False)
                for job in fresh:
                    req = job.request
                    stream = keys.requests_high if req.priority is Priority.HIGH else keys.requests
                    args = [SEEN_TTL_S]
                    for name, value in request_to_fields(req).items():
                        args += [name, value]
                    # EVAL, not a registered script's EVALSHA: redis-py's cluster pipelines
                    # refuse EVALSHA, and a replica promoted at a failover has no script cache.
                    pipe.eval(_SUBMIT, 2, stream, keys.seen(req.id), *args)
                for job, (took, entry) in zip(fresh, pipe.execute()):
                    if took:
                        placed.append((job, "submitted"))
                    else:  # someone sent it between the two round trips
                        queued.append((job, entry.decode() if isinstance(entry, bytes) else str(entry)))
            pending = []
            if queued:
                # Still queued or running: its entry is in a request stream (finishing deletes
                # the entry and writes out:<id> in one transaction, so one of the two is seen).
                pipe = self.r.pipeline(transaction=True)
                for job, entry in queued:
                    entry = entry if _ENTRY_ID.match(entry) else "0-0"
                    pipe.xrange(keys.requests, entry, entry, count=1)
                    pipe.xrange(keys.requests_high, entry, entry, count=1)
                    pipe.exists(keys.out(job.request.id))
                state = pipe.execute()
                for i, (job, entry) in enumerate(queued):
                    if _ENTRY_ID.match(entry) and (state[3 * i] or state[3 * i + 1]) or state[3 * i + 2]:
                        placed.append((job, "reattached"))
                    elif job.attempt < MAX_ATTEMPTS:   # answered, but the answer expired unread
                        job.attempt += 1
                        job.request = _with_id(job.request, request_id(self.batch_id, job.custom_id, job.attempt))
                        pending.append(job)
                    else:
                        lost.append(job)
        for job, how in placed:
            self.inflight[self.keys.out(job.request.id)] = job
            if how == "submitted":
                self.counts.submitted += 1
                if job.attempt > 1:
                    self.counts.recomputed += 1
            else:
                self.counts.reattached += 1
        for job in lost:
            self._write_http_error(job.tail, job.custom_id, job.request.id, openai_compat.OpenAIError(
                500, f"the answers of requests {request_id(self.batch_id, job.custom_id)} .. {job.request.id} "
                     f"expired before this batch read them", "server_error"))
        self.counts.in_flight = len(self.inflight)

    # -- Redis: answers -------------------------------------------------------------------------

    def _read(self) -> None:
        streams = {key: job.last_id for key, job in self.inflight.items()}
        reply = self.r.xread(streams, count=READ_COUNT, block=READ_BLOCK_MS)
        for key, entry_id, fields in parse_read_reply(reply):
            job = self.inflight.get(key)
            if job is None:
                continue   # answered earlier in this reply
            job.last_id = entry_id
            try:
                event = parse_result(entry_id, fields)
            except ProtocolError as exc:
                self._finish(key, job, error=openai_compat.OpenAIError(
                    500, f"malformed result entry {entry_id}: {exc}", "server_error"))
                continue
            if event.type is ResultType.DONE:
                self._finish(key, job, completion=event.completion)
            elif event.type is ResultType.ERROR:
                self._finish(key, job, error=openai_compat.worker_error(event.code, event.reason or ""))

    def _finish(self, key: str, job: _Job, completion: Completion | None = None,
                error: openai_compat.OpenAIError | None = None) -> None:
        del self.inflight[key]
        self.counts.in_flight = len(self.inflight)
        if error is None and completion.finish_reason is FinishReason.EXPIRED:   # as the gateway answers it
            error = openai_compat.OpenAIError(504, "the request expired before it was answered", "timeout_error",
                                              code="timeout")
        if error is not None:
            self._write_http_error(job.tail, job.custom_id, job.request.id, error)
            return
        build = openai_compat.chat_body if job.parsed.chat else openai_compat.completion_body
        body = build(openai_compat.new_id(job.parsed.kind, job.request.id), job.model, completion.text,
                     completion.finish_reason, completion.num_prompt_tokens, completion.num_tokens,
                     cached_tokens=completion.cached_tokens)
        self._write(output_line(self.batch_id, job.tail, job.custom_id,
                                {"status_code": 200, "request_id": job.request.id, "body": body}), ok=True)

    def _redis(self, step: Callable[[], None]) -> None:
        """Run ``step`` (idempotent), retrying a lost connection with capped backoff for
        ``unavailable_after_s``; Ctrl-C during an outage stops at once."""
        since, attempt = None, 0
        while True:
            try:
                return step()
            except (RedisConnectionError, RedisTimeoutError) as exc:
                now = time.monotonic()
                since = now if since is None else since
                if now - since >= self.unavailable_after_s:
                    raise BatchError(f"lost the connection to Redis for {now - since:.0f}s "
                                     f"({str(exc).rstrip('.')}); what is written stays, rerun to resume") from None
                if self.stop.wait(backoff_delay(attempt, 0.05, 2.0)):
                    raise _Stopped() from None
                attempt += 1
            except redis.RedisError as exc:
                raise BatchError(f"Redis refused a command: {exc}") from None

    # -- what the workers tell -------------------------------------------------------------------

    def _models(self) -> dict[str, int | None]:
        """The models the live workers serve -> their smallest ``max_model_len`` (None when
        not reported), as the gateway reads them; re-read every few seconds."""
        checked, models = self._served
        if time.monotonic() - checked >= MODELS_RECHECK_S:
            from pdqueue.queue.registry import list_workers

            try:
                workers = list_workers(self.r, self.keys)
            except redis.RedisError:
                workers = []
            models = {}
            for w in workers:
                name, mml = w.get("model") or "", w.get("max_model_len")
                if not name:
                    continue
                mml = mml if isinstance(mml, int) and mml > 0 else None
                known = models.get(name)
                models[name] = mml if known is None else (known if mml is None else min(known, mml))
            self._served = (time.monotonic(), models)
        return models

    def _model_of(self, parsed: openai_compat.Parsed) -> tuple[str, int | None]:
        """The model name a request answers with and its context, as the gateway resolves
        them: the body's ``model`` (a 404 when the live workers serve others), else the
        served one. With no worker up yet, the body's name is taken as it is (the requests
        wait in the queue)."""
        models = self._models()
        if parsed.model is None:
            name = sorted(models)[0] if models else "pdqueue"
        else:
            name = parsed.model
            if models and name not in models:
                raise openai_compat.OpenAIError(
                    404, f"The model `{name}` does not exist. Served: {', '.join(sorted(models))}.",
                    "invalid_request_error", "model", "model_not_found")
        return name, models.get(name)

    # -- writing --------------------------------------------------------------------------------

    def _write_http_error(self, tail: str, custom_id: str, rid: str | None, exc: openai_compat.OpenAIError) -> None:
        self._write(output_line(self.batch_id, tail, custom_id,
                                {"status_code": exc.status, "request_id": rid, "body": exc.body()}), ok=False)

    def _write(self, obj: dict, ok: bool) -> None:
        self.out.write(obj)
        if ok:
            self.counts.answered += 1
        else:
            self.counts.errors += 1
        self.on_progress(self.counts)

    def _skip(self) -> None:
        self.counts.skipped += 1


class _Stopped(Exception):
    pass


def _with_id(req: Request, rid: str) -> Request:
    import dataclasses

    return dataclasses.replace(req, id=rid)
