"""OpenAI Batch files through the queue: the window of ``pdqueue batch INPUT -o OUTPUT`` (and
of the gateway's ``/v1/batches``).

Input lines (``batch_input``) become pdqueue requests through ``openai_compat``, the
functions the gateway uses, so both answer alike; each answer becomes an output line
(``batch_output``). What goes where in the output (OpenAI's split): a line that cannot be
run at all (not JSON, a missing or wrong field, a repeated ``custom_id``): ``response``
null and ``error`` ``{"code", "message"}``; a request the API answers with an HTTP error
(400 invalid body, 404 unknown model, a worker's 400/500): ``response`` with that status
and ``{"error": ...}``; a completion: status 200 and its body.

Exactly once across crashes: request ids come from (batch id, ``custom_id``), lines the
output holds are skipped, requests already in Redis are re-attached to (``batch_resume``).
Bounded memory: the input is read a line at a time, at most ``concurrency`` requests are in
flight, answers are written as they complete; what grows is 16 bytes per ``custom_id``.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pdqueue.client import build_request
from pdqueue.frontends import openai_compat
from pdqueue.frontends.batch_input import (
    MAX_LINE_BYTES,
    URLS,
    BatchError,
    FileInput,
    Line,
    LineError,
    check_batch_id,
    custom_id_hash,
    default_batch_id,
    parse_line,
    request_id,
    scan_input,
)
from pdqueue.frontends.batch_output import Done, FileOutput, output_line
from pdqueue.frontends.batch_resume import place
from pdqueue.frontends.service_classes import BATCH, class_fields
from pdqueue.keys import Keys
from pdqueue.protocol import Completion, FinishReason, ProtocolError, Request, RequestError, ResultType, parse_result
from pdqueue.queue.ledger import batch_ref
from pdqueue.queue.streams import parse_read_reply
from pdqueue.retry import backoff_delay

__all__ = ["BatchError", "BatchRun", "Counts", "DEFAULT_CONCURRENCY", "Done", "LineError", "MAX_LINE_BYTES",
           "URLS", "default_batch_id", "file_run", "output_line", "parse_line", "request_id", "scan_input"]

DEFAULT_CONCURRENCY = 64
READ_BLOCK_MS = 200           # XREAD BLOCK: also how quickly Ctrl-C is noticed
READ_COUNT = 256              # entries per answer stream per XREAD
FILL_MAX_LINES = 2000         # input lines taken per loop turn (answers are read between turns)
MODELS_RECHECK_S = 5.0


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
    """One run over a batch's input (``source``: ``FileInput`` or one with its ``info()`` and
    ``lines()``) into its output (``sink``: ``FileOutput`` or one with ``open``,
    ``read_done``, ``write``, ``close``). ``prepare()`` reads the input once (id, count) and
    the output (what is done); ``run()`` answers the rest and returns the ``Counts``.
    ``stop`` (set by Ctrl-C): stop sending, write what has arrived, return; what was sent
    stays in Redis for the next run. ``on_progress(counts)`` after each written line.
    ``request_fields``: more ``build_request`` arguments for every request (default: those
    of the batch service class)."""

    def __init__(self, r: redis.Redis, keys: Keys, source, sink, *, batch_id: str | None = None,
                 concurrency: int = DEFAULT_CONCURRENCY, stop: threading.Event | None = None,
                 on_progress: Callable[[Counts], None] | None = None, unavailable_after_s: float = 30.0,
                 request_fields: dict | None = None):
        if concurrency < 1:
            raise BatchError("--concurrency must be >= 1")
        self.r, self.keys = r, keys
        self.source, self.sink = source, sink
        self.batch_id = check_batch_id(batch_id) if batch_id is not None else None
        self.concurrency = concurrency
        self.stop = stop or threading.Event()
        self.on_progress = on_progress or (lambda counts: None)
        self.unavailable_after_s = unavailable_after_s
        # more build_request arguments; by default, the batch service class
        self.request_fields = dict(class_fields(BATCH) if request_fields is None else request_fields)
        self.counts = Counts()
        self.interrupted = False
        self.done: Done | None = None
        self.out = None                       # the sink, once open
        self.inflight: dict[str, _Job] = {}   # by answer stream key
        self._ids: set[bytes] = set()         # custom_id hashes met in INPUT
        self._repeats: dict[bytes, int] = {}  # custom_id hash -> repeats met so far
        self._served: tuple[float, dict] = (-1e9, {})

    # -- set-up ---------------------------------------------------------------------------------

    def prepare(self) -> Counts:
        info = self.source.info()
        if self.batch_id is None:
            self.batch_id = default_batch_id(info)
        self.sink.open()
        self.out = self.sink
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
            with self.source.lines() as lines:
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
            raise BatchError(f"cannot read {self.source.name} or write {self.sink.name}: "
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
            parse = openai_compat.parse_chat if URLS[line.url] == "chat" else openai_compat.parse_completion
            parsed = parse(line.body)
            model, context = self._model_of(parsed)
            # Over the context: refused here where it can be told (the worker checks the rest);
            # a chat without max_tokens runs up to the context (max_tokens None), as in the gateway.
            parsed.check_context(context)
            request = build_request(**parsed.submit_kwargs(), **self.request_fields, id=rid,
                                    ref=batch_ref(self.batch_id, line.custom_id))
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
        """Send each job's request, or re-attach to it when Redis already has it."""
        placed, lost = place(self.r, self.keys, self.batch_id, jobs)
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


def file_run(r: redis.Redis, keys: Keys, input_path: str, output_path: str, **options) -> BatchRun:
    """``pdqueue batch INPUT -o OUTPUT``'s run (``options``: ``BatchRun``'s)."""
    if os.path.exists(output_path) and os.path.samefile(input_path, output_path):
        raise BatchError("OUTPUT must not be INPUT")
    return BatchRun(r, keys, FileInput(input_path), FileOutput(output_path), **options)
