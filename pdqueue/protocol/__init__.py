"""Wire types of pdqueue: requests, result entries, and the prefill→decode handoff.

Requests and results are flat Redis stream fields holding UTF-8 strings (numbers in
decimal, lists as JSON arrays, booleans "1"/"0"), so ``redis-cli`` can write a request and
read its answer. The handoff is internal: msgpack with a ``version`` field.

Validation that needs the model (prompt longer than the context, more KV blocks than the
pool, token ids beyond the vocabulary) is the worker's job; everything else is checked
here and reported as a ``RequestError`` with a reason a human can act on.

Imports the standard library only (msgpack when a handoff is encoded or decoded): a
producer needs no torch, the planner nothing but the standard library.

One module per message: ``wire`` (version, enums, errors), ``classes`` (the service classes'
table), ``requests``, ``limits``, ``results``, ``handoff``. The names below are re-exported so that
``from pdqueue.protocol import Request`` keeps working.
"""

from .classes import YIELDING_RANKS, ServiceClass
from .handoff import Handoff, decode_handoff, encode_handoff
from .limits import (
    MAX_ENTRY_BYTES,
    MAX_PROMPT_CHARS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    Limits,
    context_error,
    entry_bytes,
)
from .requests import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    MAX_SEED,
    MAX_TOKENS_CONTEXT,
    REQUEST_FIELDS,
    ROUTING_FIELDS,
    SAMPLING_FIELDS,
    Request,
    entry_id_ms,
    entry_request_id,
    parse_request,
    request_to_fields,
    sampling_error,
    validate_request,
)
from .results import UP_FIELD, Completion, ResultEvent, done_entry, error_entry, parse_result, token_entry, up_server
from .wire import (
    PROTOCOL_VERSION,
    REQUEST_ROLES,
    ROLES,
    ErrorCode,
    FinishReason,
    HandoffError,
    Priority,
    ProtocolError,
    RequestError,
    ResultType,
    Role,
    as_str,
)

__all__ = [
    "PROTOCOL_VERSION", "ResultType", "FinishReason", "Role", "ROLES", "REQUEST_ROLES", "Priority", "ServiceClass",
    "YIELDING_RANKS", "ErrorCode", "ProtocolError", "RequestError", "HandoffError", "as_str",
    "Request", "DEFAULT_MAX_TOKENS", "DEFAULT_TEMPERATURE", "DEFAULT_TOP_P", "DEFAULT_TOP_K", "REQUEST_FIELDS",
    "ROUTING_FIELDS", "MAX_SEED", "validate_request",
    "SAMPLING_FIELDS", "sampling_error", "request_to_fields", "parse_request", "entry_id_ms", "entry_request_id",
    "Limits", "MAX_ENTRY_BYTES", "MAX_PROMPT_CHARS", "MAX_STOP_STRINGS", "MAX_STOP_CHARS", "entry_bytes",
    "context_error", "MAX_TOKENS_CONTEXT",
    "Completion", "ResultEvent", "token_entry", "done_entry", "error_entry", "parse_result", "UP_FIELD", "up_server",
    "Handoff", "encode_handoff", "decode_handoff",
]
