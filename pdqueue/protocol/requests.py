"""Requests: the ``Request`` type, its checks, and its stream fields (both ways)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

from .classes import ServiceClass
from .wire import Priority, RequestError, _short

# A request's defaults, the one place they are written (the client, the CLI and the
# engine's SamplingParams take them from here). A producer's ``Request`` holds them and
# ``request_to_fields`` writes them out like any other value: a worker applies them only to
# a field that is absent (an older producer, or one writing the stream itself), so a
# request's meaning never depends on which side's defaults are newer.
DEFAULT_MAX_TOKENS = 128
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_TOP_K = 0   # 0 = off
MAX_TENANT_CHARS = 256   # a request's usage labels (``tenant``, ``ref``) are at most this long
MAX_REF_CHARS = 1024
MAX_TOKENS_CONTEXT = "context"
"""The wire value of ``max_tokens=None``: up to the model's context (what the prompt leaves
of it; OpenAI's chat without ``max_tokens``). The worker that tokenizes the prompt sets it."""
MAX_SEED = 2**63 - 1
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed")
"""The fields ``sampling_error`` checks: always written by ``request_to_fields`` (the seed when set)."""


def _is_int(value: Any) -> bool:
    return type(value) is int


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# field: (accepts, what it must be)
_SAMPLING_RULES = {
    "max_tokens": (lambda v: v is None or _is_int(v) and v >= 1, "an integer >= 1"),   # None: up to the context
    "temperature": (lambda v: _is_number(v) and v >= 0, "a finite number >= 0"),
    "top_p": (lambda v: _is_number(v) and 0 < v <= 1, "in (0, 1]"),
    "top_k": (lambda v: _is_int(v) and v >= 0, "an integer >= 0 (0 = off)"),
    "seed": (lambda v: v is None or _is_int(v) and 0 <= v <= MAX_SEED, "an integer in [0, 2**63)"),
}


def sampling_error(name: str, value: Any, label: str | None = None) -> str | None:
    """Why ``value`` cannot be the sampling field ``name`` (``SAMPLING_FIELDS``), or None:
    the one check of each, which ``validate_request``, the engine's ``SamplingParams``, the
    OpenAI front end and the CLI's options all apply. ``label``: the name the message uses
    (an API's own, e.g. ``max_completion_tokens``)."""
    accepts, rule = _SAMPLING_RULES[name]
    return None if accepts(value) else f"{label or name} must be {rule}, got {_short(value)}"


@dataclass(frozen=True, slots=True)
class Request:
    id: str
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    max_tokens: int | None = DEFAULT_MAX_TOKENS   # None: up to the model's context (MAX_TOKENS_CONTEXT)
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    top_k: int = DEFAULT_TOP_K
    seed: int | None = None          # None: the prefill worker picks one (see Handoff.seed)
    stop: tuple[str, ...] = ()
    deadline_ms: int | None = None   # expires this many ms after enqueued_ms
    priority: Priority = Priority.NORMAL
    chat: bool = False               # apply the model's chat template to ``prompt``
    ignore_eos: bool = False         # generate max_tokens even past end-of-sequence (benchmarks)
    messages: tuple[dict, ...] | None = None  # [{"role", "content"}]: the chat template is applied to them
    enqueued_ms: int = 0             # unix ms, from the stream entry id (0 if unknown)
    service_class: ServiceClass | None = None  # wire field ``class``; None: from ``priority``
    # Usage labels (pdqueue/queue/ledger.py): carried prefill -> handoff -> decode into the
    # request's usage record; absent on the wire: "".
    tenant: str = ""                 # who is billed: the gateway's tenant, or the producer's own name
    ref: str = ""                    # the producer's name for it ("batch:<batch id>:<custom_id>",
                                     # "idempotency-key:<key>"): the record names it

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
        if isinstance(self.service_class, str) and not isinstance(self.service_class, ServiceClass) \
                and self.service_class in ServiceClass.names():
            object.__setattr__(self, "service_class", ServiceClass(self.service_class))

    @property
    def cls(self) -> ServiceClass:
        """The class it is admitted in: its own, else the one its priority names (high: interactive)."""
        return ServiceClass.of(self.service_class, self.priority)

    @property
    def rank(self) -> int:
        """Its class's place in the admission order (``ServiceClass.rank``, 0 first)."""
        return self.cls.rank

    @property
    def background(self) -> bool:
        """Its class yields (``ServiceClass.yields``): it runs in the capacity the others leave."""
        return self.cls.yields

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
                  "top_k", "seed", "stop", "deadline_ms", "priority", "chat", "ignore_eos", "messages", "class",
                  "tenant", "ref")
# Set by a worker that routes a request to a peer (workers/routing.py): who moved it, and
# when the producer enqueued it (the id of the moved entry is newer; deadlines and TTFT
# count from the original enqueue).
ROUTING_FIELDS = ("routed_from", "enqueued_ms")
_KNOWN_FIELDS = frozenset(REQUEST_FIELDS + ROUTING_FIELDS)
_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_INT = re.compile(r"^[+-]?[0-9]{1,30}$")
_FLOAT = re.compile(r"^[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]{1,4})?$")
_ENTRY_ID = re.compile(r"^([0-9]+)-[0-9]+$")


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
    for name in SAMPLING_FIELDS:
        reason = sampling_error(name, getattr(req, name))
        if reason:
            fail(reason)
    if not isinstance(req.stop, (tuple, list)) or not all(
            isinstance(s, str) and s for s in req.stop):
        fail("stop must be a list of non-empty strings")
    if req.deadline_ms is not None and (type(req.deadline_ms) is not int or req.deadline_ms < 1):
        fail(f"deadline_ms must be an integer >= 1, got {_short(req.deadline_ms)}")
    if not isinstance(req.priority, Priority):
        fail(f"priority must be 'normal' or 'high', got {_short(req.priority)}")
    if req.service_class is not None and not isinstance(req.service_class, ServiceClass):
        fail(f"class must be one of {', '.join(ServiceClass.names())}, got {_short(req.service_class)}")
    if not isinstance(req.chat, bool):
        fail(f"chat must be a boolean, got {_short(req.chat)}")
    if not isinstance(req.ignore_eos, bool):
        fail(f"ignore_eos must be a boolean, got {_short(req.ignore_eos)}")
    for name, most in (("tenant", MAX_TENANT_CHARS), ("ref", MAX_REF_CHARS)):
        value = getattr(req, name)
        if not isinstance(value, str) or len(value) > most:
            fail(f"{name} must be a string of at most {most} characters, got {_short(value)}")


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
    """Flat string fields for XADD. The sampling fields are always written, defaults
    included (what the producer meant, whatever a worker's defaults); other fields at
    their default, and Nones, are left out."""
    fields = {"id": req.id}
    if req.prompt is not None:
        fields["prompt"] = req.prompt
    if req.prompt_ids is not None:
        fields["prompt_ids"] = json.dumps(list(req.prompt_ids), separators=(",", ":"))
    fields["max_tokens"] = MAX_TOKENS_CONTEXT if req.max_tokens is None else str(req.max_tokens)
    fields["temperature"] = repr(float(req.temperature))
    fields["top_p"] = repr(float(req.top_p))
    fields["top_k"] = str(req.top_k)
    if req.seed is not None:
        fields["seed"] = str(req.seed)
    if req.stop:
        fields["stop"] = json.dumps(list(req.stop), ensure_ascii=False)
    if req.deadline_ms is not None:
        fields["deadline_ms"] = str(req.deadline_ms)
    if req.priority != Priority.NORMAL:
        fields["priority"] = Priority(req.priority).value
    if req.service_class is not None:
        fields["class"] = ServiceClass(req.service_class).value
    if req.chat:
        fields["chat"] = "1"
    if req.ignore_eos:
        fields["ignore_eos"] = "1"
    if req.tenant:
        fields["tenant"] = req.tenant
    if req.ref:
        fields["ref"] = req.ref
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
    service_class = None
    if "class" in text:
        try:
            service_class = ServiceClass(text["class"].strip().lower())
        except ValueError:
            fail(f"class must be one of {', '.join(ServiceClass.names())}, got {_short(text['class'])}")

    def flag(name: str) -> bool:
        if name not in text:
            return False
        value = text[name].strip().lower()
        if value not in ("1", "0", "true", "false"):
            fail(f"{name} must be 1 or 0, got {_short(text[name])}")
        return value in ("1", "true")

    chat, ignore_eos = flag("chat"), flag("ignore_eos")

    defaults = Request(id=rid)
    to_context = text.get("max_tokens", "").strip().lower() == MAX_TOKENS_CONTEXT
    max_tokens, temperature = None if to_context else integer("max_tokens"), number("temperature")
    top_p, top_k = number("top_p"), integer("top_k")
    req = Request(
        id=rid,
        prompt=text.get("prompt"),
        prompt_ids=tuple(prompt_ids) if prompt_ids is not None else None,
        max_tokens=None if to_context else defaults.max_tokens if max_tokens is None else max_tokens,
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
        service_class=service_class,
        tenant=text.get("tenant", ""),
        ref=text.get("ref", ""),
    )
    validate_request(req)
    return req

