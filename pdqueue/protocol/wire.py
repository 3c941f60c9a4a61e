"""The protocol's version and change log, its enums and its errors."""

from __future__ import annotations

from enum import Enum
from typing import Any

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
#      handoff key cached_tokens (the same, carried to the decode worker; 0 if absent);
#      request field class (interactive/standard/batch, issue 27; absent: from priority) and
#      error code deadline_exceeded (a request with a class whose deadline passed unstarted);
#      request fields tenant and ref (usage labels for the ledger, issue 42; absent: "") and
#      done field recomputed_tokens (0 if absent).
#      Handoff key transfer_version and the handoff entry's field compat (the compatibility
#      handshake, issue 42: protocol/compat.py; this version is part of its key): absent, the
#      sender is compatible with every decode worker, as before.
#      Producers write max_tokens, temperature, top_p and top_k even at their defaults (the
#      request means what its producer meant whatever a worker's defaults); an absent field
#      still means the default, so older producers' entries read as before.


class ResultType(str, Enum):
    TOKEN = "token"
    DONE = "done"
    ERROR = "error"


class FinishReason(str, Enum):
    STOP = "stop"            # end-of-sequence token or a stop string (as OpenAI reports both)
    LENGTH = "length"        # max_tokens (or the model's context) reached
    CANCELLED = "cancelled"  # cancel:<id> was set
    EXPIRED = "expired"      # deadline_ms passed
    ERROR = "error"

    # Formats as its value, as the engine's plain strings did ("finish: stop").
    __str__ = str.__str__
    __format__ = str.__format__


class Role(str, Enum):
    """What a worker does: prefill (reads the request streams, hands off), decode (reads
    the handoff stream), colocated (both in one engine)."""
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


ROLES = tuple(role.value for role in Role)
# The roles that read the request streams (the prefill group's consumers).
REQUEST_ROLES = (Role.PREFILL.value, Role.COLOCATED.value)


class Priority(str, Enum):
    NORMAL = "normal"
    HIGH = "high"


class ErrorCode(str, Enum):
    BAD_REQUEST = "bad_request"  # malformed fields
    TOO_LONG = "too_long"        # prompt (+ max_tokens) does not fit the model or the KV pool
    DUPLICATE = "duplicate"      # a request with this id was already taken
    INTERNAL = "internal"        # a worker bug or an unrecoverable failure
    DEADLINE_EXCEEDED = "deadline_exceeded"  # a request with a class whose deadline passed before it ran
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


def _short(value: Any, limit: int = 40) -> str:
    """A value for an error message, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def as_str(value: Any, errors: str = "strict") -> str:
    """A Redis reply value as text: bytes decoded as UTF-8 (``errors`` as in
    ``bytes.decode``), anything else through ``str``."""
    if isinstance(value, (bytes, bytearray)):
        return value.decode("utf-8", errors)
    return str(value)
