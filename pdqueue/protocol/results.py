"""Results: the entries of ``out:<request_id>`` (done entries are copied to the done stream)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Mapping

from .wire import ErrorCode, FinishReason, ProtocolError, ResultType, _short


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
    handoff_ms: float = 0.0     # first token published -> a decode worker starts copying its KV
    first_step_ms: float = 0.0  # KV in place -> second token published (one decode step)
    ttst_ms: float = 0.0        # enqueue -> second token published; ~= queue + prefill +
                                # handoff + transfer + first_step
    prefill_worker: str = ""
    decode_worker: str = ""
    transfer_path: str = ""     # a transport's name (pdqueue.transfer.registry), "cache", "local", "recompute", "none"
    cached_tokens: int = 0      # prompt tokens served from the prefix cache (not computed)
    kv_reused_tokens: int = 0   # decode: prompt tokens whose KV the decode worker held already (not fetched)
    recomputed_tokens: int = 0  # decode: tokens it prefilled again instead of fetching their KV (prompt +
                                # the output so far, transfer_path "recompute")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


_COMPLETION_FLOATS = ("ttft_ms", "queue_ms", "prefill_ms", "transfer_ms", "decode_ms",
                      "handoff_ms", "first_step_ms", "ttst_ms",
                      "tbt_p50_ms", "tbt_max_ms", "e2e_ms")
_COMPLETION_INTS = ("num_prompt_tokens", "transfer_bytes", "cached_tokens", "kv_reused_tokens",
                    "recomputed_tokens")   # absent: 0
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


UP_FIELD = "up"
"""On the done and error entries written on a ``pdqueue up``'s embedded server (its workers
get ``PDQ_UP_SERVER`` from it): ``"<pid of up>:<pid of its server>"``. That server's answers
die with it, so its reader writes a read receipt (``Keys.read``) once it has read the answer
to its end, and ``up`` keeps the server at its stop until every answer has one."""


def up_server(fields: Mapping) -> tuple[int, int] | None:
    """(pid of ``up``, pid of its server) of an entry's ``UP_FIELD``; None without one."""
    try:
        up, server = _result_text(fields, UP_FIELD, "").split(":")
        return int(up), int(server)
    except (ValueError, ProtocolError):
        return None


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
