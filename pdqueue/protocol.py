"""Wire types of pdqueue: requests, result entries, and the prefill→decode handoff.

Requests and results are flat Redis stream fields holding UTF-8 strings (numbers in
decimal, lists as JSON arrays, booleans "1"/"0"), so ``redis-cli`` can write a request and
read its answer. The handoff is internal: msgpack with a ``version`` field.

Validation that needs the model (prompt longer than the context, more KV blocks than the
pool, token ids beyond the vocabulary) is the worker's job; everything else is checked
here and reported as a ``RequestError`` with a reason a human can act on.

Imports the standard library and msgpack only (a producer must not need torch).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from enum import Enum
from typing import Any, Mapping

import msgpack

PROTOCOL_VERSION = 1
# Change log (bump on any incompatible change to request/result fields or the handoff):
#   1  first version: request fields id, prompt, prompt_ids, max_tokens, temperature,
#      top_p, top_k, seed, stop, deadline_ms, priority, chat; result entries token/done/
#      error; handoff msgpack {version, request, prompt_ids, output_ids, seed, ticket,
#      prefill_worker, enqueued_ms, prefill_start_ms, prefill_end_ms, first_token_ms,
#      attempt}.
#      Later additions, all optional (older workers reject them as unknown fields):
#      request field ignore_eos; done fields handoff_ms, first_step_ms, ttst_ms;
#      request field messages (a conversation, the chat template applied to it);
#      done field cached_tokens (prompt tokens served from the prefix cache; 0 if absent);
#      handoff key cached_tokens (the same, carried to the decode worker; 0 if absent).


class ResultType(str, Enum):
    TOKEN = "token"
    DONE = "done"
    ERROR = "error"


class FinishReason(str, Enum):
    STOP = "stop"            # end-of-sequence token or a stop string (as OpenAI reports both)
    LENGTH = "length"        # max_tokens reached
    CANCELLED = "cancelled"  # cancel:<id> was set
    EXPIRED = "expired"      # deadline_ms passed
    ERROR = "error"


class Priority(str, Enum):
    NORMAL = "normal"
    HIGH = "high"


class ErrorCode(str, Enum):
    BAD_REQUEST = "bad_request"  # malformed fields
    TOO_LONG = "too_long"        # prompt (+ max_tokens) does not fit the model or the KV pool
    DUPLICATE = "duplicate"      # a request with this id was already taken
    INTERNAL = "internal"        # a worker bug or an unrecoverable failure
    UNAVAILABLE = "unavailable"  # the cluster stopped before answering (`pdqueue up` with its own server)


class ProtocolError(ValueError):
    """A malformed wire message."""


class RequestError(ProtocolError):
    """A request that cannot be run. ``request_id`` names the answer stream to put the
    error on; it is None when the id itself is unusable (the error then only goes to the
    dead-letter stream)."""

    def __init__(self, reason: str, request_id: str | None = None,
                 code: str | ErrorCode = ErrorCode.BAD_REQUEST):
        super().__init__(reason)
        self.reason = reason
        self.request_id = request_id
        self.code = ErrorCode(code).value if isinstance(code, ErrorCode) else str(code)


class HandoffError(ProtocolError):
    """A malformed handoff entry, or one of a protocol version this worker does not speak."""


# ---------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Request:
    id: str
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                   # 0 = off
    seed: int | None = None          # None: the prefill worker picks one (see Handoff.seed)
    stop: tuple[str, ...] = ()
    deadline_ms: int | None = None   # expires this many ms after enqueued_ms
    priority: Priority = Priority.NORMAL
    chat: bool = False               # apply the model's chat template to ``prompt``
    ignore_eos: bool = False         # generate max_tokens even past end-of-sequence (benchmarks)
    messages: tuple[dict, ...] | None = None  # [{"role", "content"}]: the chat template is applied to them
    enqueued_ms: int = 0             # unix ms, from the stream entry id (0 if unknown)

    def __post_init__(self) -> None:
        # Accept lists and plain strings from Python callers; validate_request judges values.
        if isinstance(self.prompt_ids, list):
            object.__setattr__(self, "prompt_ids", tuple(self.prompt_ids))
        if isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.messages, list):
            object.__setattr__(self, "messages", tuple(self.messages))
        if isinstance(self.priority, str) and not isinstance(self.priority, Priority) \
                and self.priority in ("normal", "high"):
            object.__setattr__(self, "priority", Priority(self.priority))

    @property
    def deadline_at_ms(self) -> int | None:
        """Unix ms after which the request expires, or None."""
        if self.deadline_ms is None:
            return None
        return self.enqueued_ms + self.deadline_ms

    def expired(self, now_ms: float) -> bool:
        at = self.deadline_at_ms
        return at is not None and now_ms > at


REQUEST_FIELDS = ("id", "prompt", "prompt_ids", "max_tokens", "temperature", "top_p",
                  "top_k", "seed", "stop", "deadline_ms", "priority", "chat", "ignore_eos", "messages")
# Set by a worker that routes a request to a peer (workers/routing.py): who moved it, and
# when the producer enqueued it (the id of the moved entry is newer; deadlines and TTFT
# count from the original enqueue).
ROUTING_FIELDS = ("routed_from", "enqueued_ms")
_KNOWN_FIELDS = frozenset(REQUEST_FIELDS + ROUTING_FIELDS)
_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_INT = re.compile(r"^[+-]?[0-9]{1,30}$")
_FLOAT = re.compile(r"^[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]{1,4})?$")
_ENTRY_ID = re.compile(r"^([0-9]+)-[0-9]+$")
MAX_SEED = 2**63 - 1


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def validate_request(req: Request) -> None:
    """Raise ``RequestError`` if ``req`` breaks a rule that needs no model."""
    rid = req.id if isinstance(req.id, str) and _ID.match(req.id) else None
    if rid is None:
        raise RequestError(f"id must be 1..128 characters of [A-Za-z0-9._:-], got {_short(req.id)}")

    def fail(reason: str) -> None:
        raise RequestError(reason, rid)

    given = [name for name in ("prompt", "prompt_ids", "messages") if getattr(req, name) is not None]
    if not given:
        fail("request needs 'prompt' or 'prompt_ids' (or 'messages')")
    if len(given) > 1:
        fail(f"request has both {' and '.join(repr(g) for g in given)}; give exactly one")
    if req.messages is not None and (
            not isinstance(req.messages, (tuple, list)) or not req.messages
            or not all(isinstance(m, dict) and set(m) == {"role", "content"} and isinstance(m["role"], str)
                       and m["role"] and isinstance(m["content"], str) for m in req.messages)):
        fail('messages must be a non-empty list of {"role": str, "content": str} objects')
    if req.prompt is not None:
        if not isinstance(req.prompt, str):
            fail(f"prompt must be a string, got {type(req.prompt).__name__}")
        if req.prompt == "" and not req.chat:
            fail("prompt is empty")
    if req.prompt_ids is not None:
        if not isinstance(req.prompt_ids, (tuple, list)) or not all(
                type(t) is int and t >= 0 for t in req.prompt_ids):
            fail("prompt_ids must be a list of non-negative integers")
        if len(req.prompt_ids) == 0:
            fail("prompt_ids is empty")
    if req.chat and req.prompt_ids is not None:
        fail("chat=1 needs 'prompt' (the user message) or 'messages', not 'prompt_ids'")
    if type(req.max_tokens) is not int or req.max_tokens < 1:
        fail(f"max_tokens must be an integer >= 1, got {_short(req.max_tokens)}")
    if not isinstance(req.temperature, (int, float)) or not math.isfinite(req.temperature) \
            or req.temperature < 0:
        fail(f"temperature must be a finite number >= 0, got {_short(req.temperature)}")
    if not isinstance(req.top_p, (int, float)) or not (0 < req.top_p <= 1):
        fail(f"top_p must be in (0, 1], got {_short(req.top_p)}")
    if type(req.top_k) is not int or req.top_k < 0:
        fail(f"top_k must be an integer >= 0 (0 = off), got {_short(req.top_k)}")
    if req.seed is not None and (type(req.seed) is not int or not 0 <= req.seed <= MAX_SEED):
        fail(f"seed must be an integer in [0, 2**63), got {_short(req.seed)}")
    if not isinstance(req.stop, (tuple, list)) or not all(
            isinstance(s, str) and s for s in req.stop):
        fail("stop must be a list of non-empty strings")
    if req.deadline_ms is not None and (type(req.deadline_ms) is not int or req.deadline_ms < 1):
        fail(f"deadline_ms must be an integer >= 1, got {_short(req.deadline_ms)}")
    if not isinstance(req.priority, Priority):
        fail(f"priority must be 'normal' or 'high', got {_short(req.priority)}")
    if not isinstance(req.chat, bool):
        fail(f"chat must be a boolean, got {_short(req.chat)}")
    if not isinstance(req.ignore_eos, bool):
        fail(f"ignore_eos must be a boolean, got {_short(req.ignore_eos)}")


# ---------------------------------------------------------------------------------------
# Limits: what a worker takes from one request (the worker's --max-* options)
# ---------------------------------------------------------------------------------------

MAX_ENTRY_BYTES = 1 << 20
"""A request entry's size (field names and values, in bytes) a worker takes by default."""
MAX_PROMPT_CHARS = 1 << 18
"""Characters of ``prompt`` (or of all ``messages``' contents) a worker takes by default."""
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
"""Stop strings per request, and characters per stop string, a worker takes by default."""


@dataclass(frozen=True, slots=True)
class Limits:
    """What a worker accepts from one request; anything over a limit is answered with an
    ``error`` entry (code ``too_long`` for sizes, ``bad_request`` for parameters) and a
    dead-letter copy, like any invalid request. None: no limit of its own (the prompt and
    the output are still bounded by the model's context and the KV pool)."""

    max_entry_bytes: int = MAX_ENTRY_BYTES
    max_prompt_chars: int = MAX_PROMPT_CHARS
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_chars: int = MAX_STOP_CHARS

    def __post_init__(self) -> None:
        for name in ("max_entry_bytes", "max_prompt_chars", "max_prompt_tokens", "max_output_tokens",
                     "max_stop_strings", "max_stop_chars"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < (0 if name == "max_stop_strings" else 1)):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def check_entry(self, entry_id: str | bytes | None, fields: Mapping) -> None:
        """Before the entry is parsed: its size (``RequestError``, ``too_long``)."""
        size = entry_bytes(fields)
        if size > self.max_entry_bytes:
            raise RequestError(f"the request entry has {size} bytes; this worker takes at most "
                               f"{self.max_entry_bytes} (--max-entry-bytes)", entry_request_id(entry_id, fields),
                               ErrorCode.TOO_LONG)

    def check_request(self, req: Request) -> None:
        """A parsed request: prompt characters, max_tokens, stop strings (``RequestError``)."""
        if req.prompt is not None:
            chars = len(req.prompt)
        elif req.messages is not None:
            chars = sum(len(m.get("content", "")) + len(m.get("role", "")) for m in req.messages)
        else:
            chars = 0
        if chars > self.max_prompt_chars:
            raise RequestError(f"the prompt has {chars} characters; this worker takes at most "
                               f"{self.max_prompt_chars} (--max-prompt-chars)", req.id, ErrorCode.TOO_LONG)
        if req.prompt_ids is not None:
            self.check_prompt_tokens(req.id, len(req.prompt_ids))
        if self.max_output_tokens is not None and req.max_tokens > self.max_output_tokens:
            raise RequestError(f"max_tokens {req.max_tokens} is over this worker's limit of "
                               f"{self.max_output_tokens} (--max-output-tokens)", req.id)
        if len(req.stop) > self.max_stop_strings:
            raise RequestError(f"stop has {len(req.stop)} strings; this worker takes at most "
                               f"{self.max_stop_strings} (--max-stop-strings)", req.id)
        longest = max((len(s) for s in req.stop), default=0)
        if longest > self.max_stop_chars:
            raise RequestError(f"a stop string has {longest} characters; this worker takes at most "
                               f"{self.max_stop_chars} (--max-stop-chars)", req.id)

    def check_prompt_tokens(self, request_id: str, num_tokens: int) -> None:
        """After tokenizing (the chat template included): ``RequestError``, ``too_long``."""
        if self.max_prompt_tokens is not None and num_tokens > self.max_prompt_tokens:
            raise RequestError(f"the prompt has {num_tokens} tokens; this worker takes at most "
                               f"{self.max_prompt_tokens} (--max-prompt-tokens)", request_id, ErrorCode.TOO_LONG)


def entry_bytes(fields: Mapping) -> int:
    """The size of a stream entry's field names and values in bytes (UTF-8 for strings)."""
    total = 0
    for name, value in fields.items():
        for part in (name, value):
            total += len(part) if isinstance(part, (bytes, bytearray)) else len(str(part).encode("utf-8", "replace"))
    return total


def entry_request_id(entry_id: str | bytes | None, fields: Mapping) -> str | None:
    """The request id an entry's answer would go to (its ``id`` field, else the entry id),
    without parsing the rest; None when it is not a usable id."""
    raw = fields.get(b"id", fields.get("id")) if isinstance(fields, Mapping) else None
    if raw is None:
        raw = entry_id
    if isinstance(raw, (bytes, bytearray)):
        try:
            raw = bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            return None
    return raw if isinstance(raw, str) and _ID.match(raw) else None


def request_to_fields(req: Request) -> dict[str, str]:
    """Flat string fields for XADD; defaults and Nones are left out."""
    fields = {"id": req.id}
    if req.prompt is not None:
        fields["prompt"] = req.prompt
    if req.prompt_ids is not None:
        fields["prompt_ids"] = json.dumps(list(req.prompt_ids), separators=(",", ":"))
    if req.max_tokens != 128:
        fields["max_tokens"] = str(req.max_tokens)
    if req.temperature != 1.0:
        fields["temperature"] = repr(float(req.temperature))
    if req.top_p != 1.0:
        fields["top_p"] = repr(float(req.top_p))
    if req.top_k != 0:
        fields["top_k"] = str(req.top_k)
    if req.seed is not None:
        fields["seed"] = str(req.seed)
    if req.stop:
        fields["stop"] = json.dumps(list(req.stop), ensure_ascii=False)
    if req.deadline_ms is not None:
        fields["deadline_ms"] = str(req.deadline_ms)
    if req.priority != Priority.NORMAL:
        fields["priority"] = Priority(req.priority).value
    if req.chat:
        fields["chat"] = "1"
    if req.ignore_eos:
        fields["ignore_eos"] = "1"
    if req.messages is not None:
        fields["messages"] = json.dumps(list(req.messages), ensure_ascii=False, separators=(",", ":"))
    return fields


def _text(value: Any, what: str, rid: str | None = None) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(f"{what} is not valid UTF-8", rid) from None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise RequestError(f"{what} has unsupported type {type(value).__name__}", rid)


def entry_id_ms(entry_id: str | bytes | None) -> int:
    """The millisecond part of a stream entry id ("1700000000000-0" -> 1700000000000)."""
    if isinstance(entry_id, bytes):
        entry_id = entry_id.decode("ascii", "replace")
    m = _ENTRY_ID.match(entry_id or "")
    return int(m.group(1)) if m else 0


def parse_request(entry_id: str | bytes | None,
                  fields: Mapping[bytes | str, bytes | str]) -> Request:
    """Turn a request stream entry into a ``Request``; raise ``RequestError`` otherwise.

    A request without an ``id`` field takes the stream entry id as its id.
    """
    eid = _text(entry_id, "stream entry id") if entry_id is not None else None
    if not isinstance(fields, Mapping):
        raise RequestError(f"request fields must be a mapping, got {type(fields).__name__}", eid)
    # The id first, so that any later problem can be answered on out:<id>.
    raw_id = fields.get(b"id", fields.get("id"))
    if raw_id is not None:
        rid = _text(raw_id, "field 'id'")
        if not _ID.match(rid):
            raise RequestError(
                f"id must be 1..128 characters of [A-Za-z0-9._:-], got {_short(rid)}")
    elif eid:
        rid = eid
    else:
        raise RequestError("request has no 'id' field and no stream entry id")
    named: dict[str, Any] = {}
    for key, value in fields.items():
        named[_text(key, "a field name", rid)] = value

    def fail(reason: str):
        raise RequestError(reason, rid)

    unknown = sorted(set(named) - _KNOWN_FIELDS)
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        fail(f"unknown field {_short(unknown[0])}{more}; known fields: {', '.join(REQUEST_FIELDS)}")
    text = {name: _text(value, f"field {name!r}", rid) for name, value in named.items()}

    def integer(name: str) -> int | None:
        if name not in text:
            return None
        value = text[name].strip()
        if not _INT.match(value):
            fail(f"{name} must be an integer, got {_short(text[name])}")
        return int(value)

    def number(name: str) -> float | None:
        if name not in text:
            return None
        value = text[name].strip()
        if not _FLOAT.match(value) or not math.isfinite(float(value)):
            fail(f"{name} must be a finite decimal number, got {_short(text[name])}")
        return float(value)

    def json_list(name: str, example: str) -> list | None:
        if name not in text:
            return None
        try:
            value = json.loads(text[name])
        except (ValueError, RecursionError):
            fail(f"{name} is not valid JSON (expected an array like {example}): {_short(text[name])}")
        if not isinstance(value, list):
            fail(f"{name} must be a JSON array like {example}, got {_short(text[name])}")
        return value

    prompt_ids = json_list("prompt_ids", "[12, 5, 9]")
    if prompt_ids is not None and not all(type(t) is int and t >= 0 for t in prompt_ids):
        fail("prompt_ids must be a JSON array of non-negative integers")
    messages = json_list("messages", '[{"role": "user", "content": "Hi"}]')
    stop = json_list("stop", '["\\n\\n"]')
    if stop is not None and not all(isinstance(s, str) for s in stop):
        fail("stop must be a JSON array of strings")

    priority = Priority.NORMAL
    if "priority" in text:
        try:
            priority = Priority(text["priority"].strip().lower())
        except ValueError:
            fail(f"priority must be 'normal' or 'high', got {_short(text['priority'])}")
    def flag(name: str) -> bool:
        if name not in text:
            return False
        value = text[name].strip().lower()
        if value not in ("1", "0", "true", "false"):
            fail(f"{name} must be 1 or 0, got {_short(text[name])}")
        return value in ("1", "true")

    chat, ignore_eos = flag("chat"), flag("ignore_eos")

    defaults = Request(id=rid)
    max_tokens, temperature = integer("max_tokens"), number("temperature")
    top_p, top_k = number("top_p"), integer("top_k")
    req = Request(
        id=rid,
        prompt=text.get("prompt"),
        prompt_ids=tuple(prompt_ids) if prompt_ids is not None else None,
        max_tokens=defaults.max_tokens if max_tokens is None else max_tokens,
        temperature=defaults.temperature if temperature is None else temperature,
        top_p=defaults.top_p if top_p is None else top_p,
        top_k=defaults.top_k if top_k is None else top_k,
        seed=integer("seed"),
        stop=tuple(stop) if stop is not None else (),
        deadline_ms=integer("deadline_ms"),
        priority=priority,
        chat=chat,
        ignore_eos=ignore_eos,
        messages=tuple(messages) if messages is not None else None,
        enqueued_ms=integer("enqueued_ms") if "enqueued_ms" in text else entry_id_ms(eid),
    )
    validate_request(req)
    return req


# ---------------------------------------------------------------------------------------
# Results (entries of out:<request_id>; done entries are copied to the done stream)
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Completion:
    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    num_prompt_tokens: int = 0
    ttft_ms: float = 0.0        # enqueue -> first token published
    queue_ms: float = 0.0       # enqueue -> prefill start
    prefill_ms: float = 0.0
    transfer_ms: float = 0.0    # KV fetch on the decode side
    transfer_bytes: int = 0
    decode_ms: float = 0.0
    tbt_p50_ms: float = 0.0     # time between tokens, median and max
    tbt_max_ms: float = 0.0
    e2e_ms: float = 0.0         # enqueue -> done
    handoff_ms: float = 0.0     # first token published -> handoff taken by a decode worker
    first_step_ms: float = 0.0  # KV in place -> second token published (one decode step)
    ttst_ms: float = 0.0        # enqueue -> second token published; ~= queue + prefill +
                                # handoff + transfer + first_step
    prefill_worker: str = ""
    decode_worker: str = ""
    transfer_path: str = ""     # "shm", "tcp", "zmq", "nixl", "cache", "local", "recompute", "none"
    cached_tokens: int = 0      # prompt tokens served from the prefix cache (not computed)
    kv_reused_tokens: int = 0   # decode: prompt tokens whose KV the decode worker held already (not fetched)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


_COMPLETION_FLOATS = ("ttft_ms", "queue_ms", "prefill_ms", "transfer_ms", "decode_ms",
                      "handoff_ms", "first_step_ms", "ttst_ms",
                      "tbt_p50_ms", "tbt_max_ms", "e2e_ms")
_COMPLETION_INTS = ("num_prompt_tokens", "transfer_bytes", "cached_tokens", "kv_reused_tokens")   # absent: 0
_COMPLETION_STRS = ("prefill_worker", "decode_worker", "transfer_path")


@dataclass(frozen=True, slots=True)
class ResultEvent:
    type: ResultType
    entry_id: str = ""
    index: int | None = None         # token: position of token_ids[0] in the output
    token_ids: tuple[int, ...] = ()
    text: str = ""                   # token: the text delta; done: the whole text
    completion: Completion | None = None
    reason: str | None = None        # error only
    code: str | None = None          # error only


def _ids_json(ids) -> str:
    return json.dumps([int(t) for t in ids], separators=(",", ":"))


def _ms(value: float) -> str:
    value = float(value)
    return format(value, ".3f") if math.isfinite(value) else "0"


def token_entry(index: int, token_ids, text: str) -> dict[str, str]:
    """A token entry: ``token_ids`` are output tokens ``index, index+1, ...``; ``text`` the
    text they add (possibly empty while a UTF-8 sequence is incomplete). A retried worker
    republishes the same ``index``; clients de-duplicate on it."""
    return {"type": ResultType.TOKEN.value, "index": str(int(index)),
            "token_ids": _ids_json(token_ids), "text": text}


def done_entry(c: Completion) -> dict[str, str]:
    fields = {"type": ResultType.DONE.value, "id": c.request_id, "text": c.text,
              "token_ids": _ids_json(c.token_ids),
              "finish_reason": FinishReason(c.finish_reason).value}
    for name in _COMPLETION_INTS:
        fields[name] = str(int(getattr(c, name)))
    for name in _COMPLETION_FLOATS:
        fields[name] = _ms(getattr(c, name))
    for name in _COMPLETION_STRS:
        fields[name] = getattr(c, name)
    return fields


def error_entry(reason: str, code: str | ErrorCode = ErrorCode.INTERNAL,
                index: int | None = None) -> dict[str, str]:
    """An error entry; ``index`` is the number of tokens already published, if any."""
    fields = {"type": ResultType.ERROR.value, "reason": reason,
              "code": code.value if isinstance(code, ErrorCode) else str(code)}
    if index is not None:
        fields["index"] = str(int(index))
    return fields


def _result_text(fields: Mapping, name: str, default: str | None = None) -> str:
    for key in (name, name.encode()):
        if key in fields:
            value = fields[key]
            if isinstance(value, (bytes, bytearray)):
                try:
                    return bytes(value).decode("utf-8")
                except UnicodeDecodeError:
                    raise ProtocolError(f"result field {name!r} is not valid UTF-8") from None
            return str(value)
    if default is None:
        raise ProtocolError(f"result entry has no {name!r} field")
    return default


def _result_ids(fields: Mapping, name: str) -> tuple[int, ...]:
    try:
        ids = json.loads(_result_text(fields, name, "[]"))
    except ValueError:
        raise ProtocolError(f"result field {name!r} is not a JSON array") from None
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise ProtocolError(f"result field {name!r} must be a JSON array of integers")
    return tuple(ids)


def _result_number(fields: Mapping, name: str, kind):
    raw = _result_text(fields, name, "0")
    try:
        return kind(raw)
    except ValueError:
        raise ProtocolError(f"result field {name!r} is not a number: {_short(raw)}") from None


def parse_result(entry_id: str | bytes, fields: Mapping) -> ResultEvent:
    """Turn an ``out:<id>`` (or ``done``) entry into a ``ResultEvent``; ``ProtocolError``
    if it is malformed."""
    eid = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    try:
        rtype = ResultType(_result_text(fields, "type"))
    except ValueError:
        raise ProtocolError(f"unknown result type {_short(_result_text(fields, 'type'))}") from None
    if rtype is ResultType.TOKEN:
        return ResultEvent(rtype, eid, index=_result_number(fields, "index", int),
                           token_ids=_result_ids(fields, "token_ids"),
                           text=_result_text(fields, "text", ""))
    if rtype is ResultType.ERROR:
        index = _result_text(fields, "index", "")
        return ResultEvent(rtype, eid, index=int(index) if index.isdigit() else None,
                           reason=_result_text(fields, "reason", "unknown error"),
                           code=_result_text(fields, "code", ErrorCode.INTERNAL.value))
    try:
        finish = FinishReason(_result_text(fields, "finish_reason"))
    except ValueError:
        raise ProtocolError("done entry has an unknown finish_reason") from None
    values: dict[str, Any] = {name: _result_number(fields, name, float) for name in _COMPLETION_FLOATS}
    values.update({name: _result_number(fields, name, int) for name in _COMPLETION_INTS})
    values.update({name: _result_text(fields, name, "") for name in _COMPLETION_STRS})
    completion = Completion(request_id=_result_text(fields, "id", ""),
                            text=_result_text(fields, "text", ""),
                            token_ids=_result_ids(fields, "token_ids"),
                            finish_reason=finish, **values)
    return ResultEvent(rtype, eid, token_ids=completion.token_ids, text=completion.text,
                       completion=completion)


# ---------------------------------------------------------------------------------------
# Handoff (prefill -> decode; internal, msgpack)
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Handoff:
    """What a decode worker needs to continue a request a prefill worker started. Frozen: a
    decode worker that resumes or recomputes one makes a new one (``dataclasses.replace``).

    ``ticket`` (opaque here, see ``transfer/``) names where the KV lives and until when it
    is leased; None means no KV is offered and the receiver recomputes from
    ``prompt_ids + output_ids``. ``output_ids`` holds every token generated so far (at
    least the first), all already published on ``out:<id>`` at indexes 0..n-1.
    """

    request: Request
    prompt_ids: list[int]
    output_ids: list[int]
    seed: int                        # the effective seed (the request's, or one the prefill chose)
    ticket: dict | None
    prefill_worker: str
    enqueued_ms: float = 0.0         # unix epoch ms
    prefill_start_ms: float = 0.0
    prefill_end_ms: float = 0.0
    first_token_ms: float = 0.0
    attempt: int = 0                 # how many times the request was recomputed
    cached_tokens: int = 0           # prompt tokens the prefill worker's prefix cache served


_HANDOFF_TIMES = ("enqueued_ms", "prefill_start_ms", "prefill_end_ms", "first_token_ms")


def encode_handoff(h: Handoff) -> dict[str, bytes]:
    """Fields of a handoff stream entry: ``id`` (the request id, for operators) and
    ``data`` (msgpack)."""
    body = {
        "version": PROTOCOL_VERSION,
        "request": request_to_fields(h.request),
        "request_enqueued_ms": int(h.request.enqueued_ms),
        "prompt_ids": [int(t) for t in h.prompt_ids],
        "output_ids": [int(t) for t in h.output_ids],
        "seed": int(h.seed),
        "ticket": h.ticket,
        "prefill_worker": h.prefill_worker,
        "attempt": int(h.attempt),
        "cached_tokens": int(h.cached_tokens),
    }
    for name in _HANDOFF_TIMES:
        body[name] = float(getattr(h, name))
    return {"id": h.request.id.encode(), "data": msgpack.packb(body, use_bin_type=True)}


def decode_handoff(fields: Mapping) -> Handoff:
    """Inverse of ``encode_handoff``; ``HandoffError`` if malformed or of another version."""
    raw = fields.get(b"data", fields.get("data"))
    if raw is None:
        raise HandoffError("handoff entry has no 'data' field")
    try:
        body = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise HandoffError(f"handoff data is not valid msgpack: {exc}") from None
    if not isinstance(body, dict):
        raise HandoffError("handoff data is not a map")
    version = body.get("version")
    if version != PROTOCOL_VERSION:
        raise HandoffError(
            f"handoff version {version!r} is not supported (this worker speaks {PROTOCOL_VERSION})")

    def ids(name: str, nonempty: bool = False) -> list[int]:
        value = body.get(name)
        if not isinstance(value, list) or not all(type(t) is int and t >= 0 for t in value):
            raise HandoffError(f"handoff {name} must be a list of non-negative integers")
        if nonempty and not value:
            raise HandoffError(f"handoff {name} is empty")
        return value

    try:
        request = parse_request(None, body.get("request"))
    except RequestError as exc:
        raise HandoffError(f"handoff request is invalid: {exc.reason}") from None
    request = dataclasses.replace(request, enqueued_ms=int(body.get("request_enqueued_ms") or 0))
    seed, attempt, worker = body.get("seed"), body.get("attempt", 0), body.get("prefill_worker")
    cached = body.get("cached_tokens", 0)   # absent from older prefill workers: 0
    if type(seed) is not int or type(attempt) is not int or attempt < 0 or type(cached) is not int or cached < 0:
        raise HandoffError("handoff seed, attempt and cached_tokens must be integers")
    if not isinstance(worker, str):
        raise HandoffError("handoff prefill_worker must be a string")
    ticket = body.get("ticket")
    if ticket is not None and not isinstance(ticket, dict):
        raise HandoffError("handoff ticket must be a map or nil")
    times = {}
    for name in _HANDOFF_TIMES:
        value = body.get(name, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise HandoffError(f"handoff {name} must be a number")
        times[name] = float(value)
    return Handoff(request=request, prompt_ids=ids("prompt_ids", True),
                   output_ids=ids("output_ids", True), seed=seed, ticket=ticket,
                   prefill_worker=worker, attempt=attempt, cached_tokens=cached, **times)
