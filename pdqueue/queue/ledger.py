"""The usage ledger: one record per request, written exactly once with its final answer.

A record (``Record``) says who asked (``tenant``, the producer's ``ref``: a Batch API line's
batch id and ``custom_id``, a gateway's ``Idempotency-Key``), what ran it (``model``, the
service ``class``, the workers) and what it cost, in tokens:

| field               | what                                                                  |
|---------------------|-----------------------------------------------------------------------|
| ``prompt_tokens``   | the prompt, tokenized (0 when refused before it was)                  |
| ``cached_tokens``   | of those, served from the prefill worker's prefix cache               |
| ``pulled_tokens``   | of those, pulled from a KV tier (not built yet: 0)                    |
| ``computed_tokens`` | of those, prefilled: prompt - cached - pulled                         |
| ``recomputed_tokens``| prefilled again by a decode worker that recomputed instead of fetching|
|                     | the KV (prompt + the output so far: a fetch failed, a resume)         |
| ``output_tokens``   | the tokens the client received: a ``done``'s token ids; an error's    |
|                     | index (the tokens published before it); 0 for a refusal               |
| ``outcome``         | the finish reason (stop, length, cancelled, expired) or error code    |

``prompt_tokens``, ``output_tokens`` and ``cached_tokens`` are what the gateway answers as
``usage.prompt_tokens``, ``completion_tokens`` and ``prompt_tokens_details.cached_tokens``:
all come from the one ``Completion`` (``record_of``).

Exactly once. Every final answer of a worker finishes its input entry through
``ownership.ack_and_write`` (workers/answers.py): one Lua script acknowledges the entry and,
only if it was still pending, writes the answer, here with the record beside it, so the
``done`` and its record both survive a Redis failover (asynchronous replication) or
neither does. The record's write carries a guard, ``usage:<id>`` (``Keys.usage_guard``),
``SET NX`` in the same script: a second final answer for the same request id (a copy the
client sent again after a failover lost ``seen:<id>``, but not the first run) adds no second
record. The guard lives as long as intake remembers an id (``SEEN_TTL_S``; the retention
when shorter): a request sent again under the same id after that runs again, its client
receives its tokens again, and so it is recorded again. Retries, migrations, recomputes
and a worker's crash write nothing: only the final answer does. A request that is refused
as a duplicate (another entry holds its id) has no record of its own.

The ``usage`` stream (``Keys.usage``) is append-only; each write trims it (``XADD MINID ~``)
to the records of the last ``retention_s()``: ``PDQ_USAGE_RETENTION_S`` in the workers'
environment, by default ``keys.USAGE_RETENTION_S`` (7 days). What that costs in Redis
memory, and copying the records out (``pdqueue usage --requests --json --since``):
docs/operations/usage.md.

Reading: ``read`` (a time window, paged XRANGE), ``totals`` (per tenant, model and class, or
any of them). Imports pdqueue.protocol and pdqueue.keys only, and redis through the client
it is given.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from typing import Iterable, Iterator, Mapping

from pdqueue.keys import SEEN_TTL_S, USAGE_RETENTION_S, Keys
from pdqueue.protocol import Completion, Request, ServiceClass, as_str
from pdqueue.queue.ownership import Write

__all__ = ["COUNTS", "GROUPINGS", "RETENTION_ENV", "Record", "batch_ref", "failed_record", "idempotency_ref",
           "labels_of", "read", "record_of", "record_write", "retention_s", "totals"]

RETENTION_ENV = "PDQ_USAGE_RETENTION_S"
COUNTS = ("prompt_tokens", "cached_tokens", "pulled_tokens", "computed_tokens", "recomputed_tokens",
          "output_tokens")
"""The token counts of a record, which ``totals`` sums."""
GROUPINGS = ("tenant", "model", "class")
"""What ``totals`` may group by (``class``: the record's ``service_class``)."""
BATCH_REF, IDEMPOTENCY_REF = "batch:", "idempotency-key:"
PAGE = 1000   # records per XRANGE


@dataclass(frozen=True, slots=True)
class Record:
    """One request's usage (the module docstring's table). ``at_ms``: when it was written
    (its entry id's ms; 0 before)."""

    request_id: str
    outcome: str
    tenant: str = ""
    ref: str = ""
    model: str = ""
    service_class: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    pulled_tokens: int = 0
    computed_tokens: int = 0
    recomputed_tokens: int = 0
    output_tokens: int = 0
    prefill_worker: str = ""
    decode_worker: str = ""
    at_ms: int = 0

    @property
    def batch_id(self) -> str:
        """The batch a Batch API (or ``pdqueue batch``) line belongs to, from ``ref``; "" else."""
        return self.ref[len(BATCH_REF):].split(":", 1)[0] if self.ref.startswith(BATCH_REF) else ""

    @property
    def custom_id(self) -> str:
        """A batch line's ``custom_id``, from ``ref``; "" else."""
        parts = self.ref[len(BATCH_REF):].split(":", 1) if self.ref.startswith(BATCH_REF) else []
        return parts[1] if len(parts) == 2 else ""

    @property
    def idempotency_key(self) -> str:
        """The gateway's ``Idempotency-Key`` it was sent with (also its request id); "" else."""
        return self.ref[len(IDEMPOTENCY_REF):] if self.ref.startswith(IDEMPOTENCY_REF) else ""

    def to_fields(self) -> dict[str, str]:
        """The ``usage`` stream entry's fields (``at_ms`` is its id)."""
        out = {"id": self.request_id, "outcome": self.outcome, "tenant": self.tenant, "ref": self.ref,
               "model": self.model, "class": self.service_class}
        out.update({name: str(int(getattr(self, name))) for name in COUNTS})
        out.update(prefill_worker=self.prefill_worker, decode_worker=self.decode_worker)
        return out

    @classmethod
    def from_entry(cls, entry_id, fields: Mapping) -> Record:
        """A ``usage`` entry back into a record (absent fields: "" and 0)."""
        text = {as_str(k): as_str(v, "replace") for k, v in fields.items()}
        counts = {name: _int(text.get(name, "0")) for name in COUNTS}
        return cls(request_id=text.get("id", ""), outcome=text.get("outcome", ""), tenant=text.get("tenant", ""),
                   ref=text.get("ref", ""), model=text.get("model", ""), service_class=text.get("class", ""),
                   prefill_worker=text.get("prefill_worker", ""), decode_worker=text.get("decode_worker", ""),
                   at_ms=_int(as_str(entry_id).split("-")[0]), **counts)

    def as_json(self) -> dict:
        """A JSON object of the record, with its ref's parts named."""
        out = asdict(self)
        out["class"] = out.pop("service_class")
        out.update(batch_id=self.batch_id, custom_id=self.custom_id, idempotency_key=self.idempotency_key)
        return out


def _int(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        return 0


# ---- labels: what a request says of itself ----------------------------------------------------

def batch_ref(batch_id: str, custom_id: str, most: int = 1024) -> str:
    """The ``ref`` of a batch line (``batch:<batch id>:<custom_id>``; batch ids have no ``:``),
    cut to ``most`` characters (a request's ``ref`` is at most ``MAX_REF_CHARS``)."""
    return f"{BATCH_REF}{batch_id}:{custom_id}"[:most]


def idempotency_ref(key: str) -> str:
    """The ``ref`` of a request a gateway was sent with an ``Idempotency-Key`` (none: "")."""
    return f"{IDEMPOTENCY_REF}{key}" if key else ""


def labels_of(request: Request | None = None, fields: Mapping | None = None) -> dict[str, str]:
    """``tenant``, ``ref`` and ``service_class`` of a parsed request, else of an entry's raw
    fields (an entry refused before it parsed: best effort, "" where unreadable)."""
    if request is not None:
        return {"tenant": request.tenant, "ref": request.ref, "service_class": request.cls.value}
    text = {as_str(key, "replace"): as_str(value, "replace") for key, value in (fields or {}).items()}
    # a request entry's class: its field, else its priority's (a handoff entry's fields say none)
    cls = text.get("class", "") or ("" if "data" in text else ServiceClass.of(None, text.get("priority", "")).value)
    return {"tenant": text.get("tenant", "")[:256], "ref": text.get("ref", "")[:1024], "service_class": cls[:32]}


# ---- records: from an answer -------------------------------------------------------------------

def record_of(c: Completion, request: Request | None, model: str, pulled_tokens: int = 0) -> Record:
    """The record of a request answered with ``done`` (``c``), labelled by its ``request``."""
    computed = max(0, c.num_prompt_tokens - c.cached_tokens - pulled_tokens)
    return Record(request_id=c.request_id, outcome=getattr(c.finish_reason, "value", str(c.finish_reason)),
                  model=model, prompt_tokens=c.num_prompt_tokens, cached_tokens=c.cached_tokens,
                  pulled_tokens=pulled_tokens, computed_tokens=computed, recomputed_tokens=c.recomputed_tokens,
                  output_tokens=len(c.token_ids), prefill_worker=c.prefill_worker, decode_worker=c.decode_worker,
                  **labels_of(request))


def failed_record(request_id: str, code, model: str, *, output_tokens: int = 0, prompt_tokens: int = 0,
                  request: Request | None = None, fields: Mapping | None = None, worker: str = "") -> Record:
    """The record of a request answered with an error (``code``): ``output_tokens`` the tokens
    published before it (the error entry's index), the prompt when it was tokenized."""
    return Record(request_id=request_id, outcome=getattr(code, "value", str(code)), model=model,
                  prompt_tokens=prompt_tokens, computed_tokens=prompt_tokens, output_tokens=output_tokens,
                  prefill_worker=worker, decode_worker=worker, **labels_of(request, fields))


# ---- writing: beside the answer, once ----------------------------------------------------------

def retention_s(environ: Mapping[str, str] = os.environ) -> int:
    """How long records are kept (``PDQ_USAGE_RETENTION_S``; default ``USAGE_RETENTION_S``).
    ValueError for a value that is not a whole number of seconds >= 60."""
    raw = environ.get(RETENTION_ENV, "").strip()
    if not raw:
        return USAGE_RETENTION_S
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 60:
        raise ValueError(f"{RETENTION_ENV} must be a whole number of seconds >= 60, got {raw!r}")
    return value


def record_write(keys: Keys, record: Record, retention: int, now_ms: float | None = None) -> Write:
    """The record's write for ``ack_and_write``, beside the answer: XADD to ``usage``
    (trimmed to ``retention`` seconds) only if ``SET usage:<id> NX`` succeeds."""
    now = time.time() * 1000 if now_ms is None else now_ms
    return Write(keys.usage, record.to_fields(), min_id_ms=max(1, int(now - retention * 1000)),
                 guard=keys.usage_guard(record.request_id), guard_ttl_ms=min(retention, SEEN_TTL_S) * 1000)


# ---- reading -------------------------------------------------------------------------------------

def read(r, keys: Keys, since_ms: int | None = None, until_ms: int | None = None) -> Iterator[Record]:
    """The records written in [since_ms, until_ms] (unix ms; None: open), oldest first, read
    ``PAGE`` at a time."""
    start = "-" if since_ms is None else f"{max(0, int(since_ms))}-0"
    end = "+" if until_ms is None else f"{max(0, int(until_ms))}-{2**64 - 1}"
    while True:
        page = r.xrange(keys.usage, start, end, count=PAGE)
        for entry_id, fields in page:
            yield Record.from_entry(entry_id, fields)
        if len(page) < PAGE:
            return
        last = as_str(page[-1][0])
        start = "(" + last


def totals(records: Iterable[Record], by: Iterable[str] = GROUPINGS) -> list[dict]:
    """The records summed per group (``by``: some of ``GROUPINGS``, in that order; none: one
    group, present even with no record), each ``{<grouping>: value, "requests": n, <count>:
    sum, ...}``, sorted by group."""
    by = tuple(by)
    unknown = [b for b in by if b not in GROUPINGS]
    if unknown:
        raise ValueError(f"cannot group by {unknown[0]!r}; by one of {', '.join(GROUPINGS)}")
    groups: dict[tuple, dict] = {}
    for rec in records:
        values = tuple(rec.service_class if b == "class" else getattr(rec, b) for b in by)
        row = groups.setdefault(values, {**dict(zip(by, values)), "requests": 0, **{n: 0 for n in COUNTS}})
        row["requests"] += 1
        for name in COUNTS:
            row[name] += getattr(rec, name)
    if not by and not groups:
        return [{"requests": 0, **{name: 0 for name in COUNTS}}]
    return [groups[k] for k in sorted(groups)]

