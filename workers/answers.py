"""The one way a worker answers: a ``Unit`` of Redis writes, run as one MULTI/EXEC.

Two kinds of op go into a unit:

- ``token``: a plain XADD to ``out:<id>`` (a ``Write``). Token entries carry their index
  and clients drop repeats, so writing one twice is harmless.
- every other answer *finishes an input entry* (a request, a handoff): the outcome (a
  handoff, ``done``, ``error``, a dead-letter copy, or nothing) is written by
  ``ack_and_write`` (pdqueue/queue/ownership.py), which acknowledges the entry and performs
  the writes only if the XACK removed it from the group's pending list, i.e. nobody
  finished it before (a worker that hung while another took its entry over and answered
  writes nothing when it wakes). So an entry gets exactly one outcome, whoever finishes
  first, at intake (an expired, cancelled, duplicate or invalid request: the entry is
  pending since we just read it) as at the end of the work.

Every final answer of a request (``done``, ``error``, a refusal other than a duplicate's)
carries its usage record (pdqueue/queue/ledger.py) in the same script, guarded by
``usage:<id>``: one record per request id, whatever retries, migrations, recomputes and
crashes came before, and it survives a failover exactly when the answer does. The roles
hand the ``Request`` to ``done``/``error`` for its labels (tenant, ref, class); the unit
knows the worker's model.

Every TTL is in milliseconds (``Write(key, fields, ttl_ms=, maxlen=)``). A unit that fails
on the publisher thread reaches the worker through the publisher's ``on_error`` (see
``WorkerShell``): the ``Finish`` ops name their request ids.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Mapping

from pdqueue import keys as K
from pdqueue.keys import Keys
from pdqueue.protocol import (
    UP_FIELD,
    Completion,
    ErrorCode,
    Request,
    done_entry,
    error_entry,
    request_to_fields,
    token_entry,
)
from pdqueue.queue import ledger
from pdqueue.queue.ownership import Write, ack_and_write
from pdqueue.queue.streams import dead_record

log = logging.getLogger("pdqueue.worker")

OUT_TTL_MS = K.OUT_TTL_S * 1000  # out:<id> lives this long after its last entry
# Under `pdqueue up` with its embedded server, "<pid of up>:<pid of the server>": every done and
# error entry carries it (UP_FIELD), so that its reader writes a read receipt (pdqueue.client).
UP_SERVER = {UP_FIELD: os.environ["PDQ_UP_SERVER"]} if os.environ.get("PDQ_UP_SERVER") else {}


def _retention_s() -> int:
    try:
        return ledger.retention_s()
    except ValueError as exc:
        log.error("%s; keeping usage records the default %d s", exc, K.USAGE_RETENTION_S)
        return K.USAGE_RETENTION_S


USAGE_RETENTION_S = _retention_s()   # PDQ_USAGE_RETENTION_S, read once per process


def _last(fields: dict) -> dict:
    """A done or error entry of ``out:<id>``, marked as `up`'s (``UP_SERVER``)."""
    return {**fields, **UP_SERVER} if UP_SERVER else fields


@dataclass(frozen=True, slots=True)
class Finish:
    """Op: acknowledge ``entry_id`` of ``stream`` in ``group`` and, only if it was still
    pending (nobody finished it before), perform ``writes`` (``ack_and_write``)."""

    stream: str
    group: str
    entry_id: str
    writes: tuple[Write, ...]
    request_id: str | None = None   # for logs, when a unit fails

    def __call__(self, pipe) -> None:
        ack_and_write(pipe, self.stream, self.group, self.entry_id, list(self.writes))


@dataclass(slots=True)
class Tally:
    """What a unit answers, for the metrics (pdqueue/telemetry/metrics.py ``WorkerMetrics.answered``):
    tokens published, done entries as (finish reason, e2e ms), dead-letter and error codes."""

    tokens: int = 0
    done: list = field(default_factory=list)
    dead: list = field(default_factory=list)
    errors: list = field(default_factory=list)


class Unit:
    """The answers of one moment of a worker (a step, an intake batch), written together.
    ``ShellView.unit()`` (the shell as a role sees it) makes one and submits it to the publisher."""

    def __init__(self, keys: Keys, worker_id: str, group: str, model: str = ""):
        self.keys, self.worker_id, self.group, self.model = keys, worker_id, group, model
        self.ops: list = []
        self.tally = Tally()   # what the metrics count once the unit goes to the publisher

    def __bool__(self) -> bool:
        return bool(self.ops)

    # -- the stream of tokens ----------------------------------------------------------
    def token(self, request_id: str, index: int, token_id: int, text: str) -> None:
        self.ops.append(Write(self.keys.out(request_id), token_entry(index, [token_id], text), ttl_ms=OUT_TTL_MS))
        self.tally.tokens += 1

    # -- outcomes: each finishes one input entry, once -----------------------------------
    def finish(self, stream: str, entry_id: str, writes: list[Write], request_id: str | None = None) -> None:
        """The one way an input entry is acknowledged (with ``writes``, possibly none)."""
        self.ops.append(Finish(stream, self.group, entry_id, tuple(writes), request_id))

    def ack(self, stream: str, entry_id: str, request_id: str | None = None) -> None:
        """Finish an entry with nothing to write (deleted while pending, a duplicate of
        work in hand, already answered by another worker)."""
        self.finish(stream, entry_id, [], request_id)

    def done(self, stream: str, entry_id: str, c: Completion, request: Request | None = None) -> None:
        """``done`` on ``out:<id>``, its copy on the ``done`` stream, its usage record
        (labelled by ``request``)."""
        fields = _last(done_entry(c))
        self.tally.done.append((getattr(c.finish_reason, "value", str(c.finish_reason)), c.e2e_ms))
        self.finish(stream, entry_id, [Write(self.keys.out(c.request_id), fields, ttl_ms=OUT_TTL_MS),
                                       Write(self.keys.done, fields, maxlen=K.DONE_MAXLEN),
                                       self._usage(ledger.record_of(c, request, self.model))], c.request_id)

    def error(self, stream: str, entry_id: str, request_id: str, reason: str, code,
              index: int | None = None, request: Request | None = None, prompt_tokens: int = 0) -> None:
        """``error`` on ``out:<id>`` (a request that failed while it ran), its usage record:
        the ``index`` tokens the client received before it."""
        writes = [Write(self.keys.out(request_id), _last(error_entry(reason, code, index)), ttl_ms=OUT_TTL_MS),
                  self._usage(ledger.failed_record(request_id, code, self.model, output_tokens=index or 0,
                                                   prompt_tokens=prompt_tokens, request=request,
                                                   worker=self.worker_id))]
        self.tally.errors.append(getattr(code, "value", str(code)))
        self.finish(stream, entry_id, writes, request_id)

    def _usage(self, record: ledger.Record) -> Write:
        return ledger.record_write(self.keys, record, USAGE_RETENTION_S)

    def handoff(self, stream: str, entry_id: str, request_id: str, handoff_stream: str,
                fields: Mapping) -> None:
        """The request goes on to a decode worker (prefill)."""
        self.finish(stream, entry_id, [Write(handoff_stream, fields)], request_id)

    def reject(self, stream: str, entry_id: str, fields: Mapping | None, request_id: str | None,
               reason: str, code, request: Request | None = None) -> None:
        """An entry that cannot run: ``error`` on ``out:<id>`` and a usage record with no
        tokens (when the id is usable and the entry is no duplicate: ``out:`` and the record
        belong to the first entry), a copy on ``dead``."""
        code = getattr(code, "value", code)
        log.info("rejected %s (%s): %s", request_id or entry_id, code, reason)
        writes = []
        if request_id and code != ErrorCode.DUPLICATE.value:
            writes.append(Write(self.keys.out(request_id), _last(error_entry(reason, code)), ttl_ms=OUT_TTL_MS))
            writes.append(self._usage(ledger.failed_record(request_id, code, self.model, request=request,
                                                           fields=fields, worker=self.worker_id)))
        writes.append(Write(self.keys.dead, dead_record(fields or {}, reason, stream, entry_id, code=code,
                                                        worker=self.worker_id), maxlen=K.DEAD_MAXLEN))
        self.tally.dead.append(code)
        self.finish(stream, entry_id, writes, request_id)

    def deadline_exceeded(self, stream: str, entry_id: str, request: Request, now_ms: int, where: str) -> None:
        """A classed request whose deadline passed before its first token, refused with
        ``deadline_exceeded`` (``RequestRole.refuse_late``; a placed prompt on a decode worker,
        ``DecodeRole.answer_expired``). ``where``: the worker it waited on, for the reason."""
        self.reject(stream, entry_id, request_to_fields(request), request.id,
                    f"deadline passed before the first token ({now_ms - request.deadline_at_ms:.0f} ms ago; {where})",
                    ErrorCode.DEADLINE_EXCEEDED, request)


def request_ids(ops) -> list[str]:
    """The request ids whose entries the ``Finish`` ops of a unit would have answered."""
    return [op.request_id or op.entry_id for op in ops if isinstance(op, Finish)]
