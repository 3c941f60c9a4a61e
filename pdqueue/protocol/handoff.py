"""The handoff: prefill -> decode, internal, msgpack with a ``version`` field.

A handoff stream entry has the fields ``id`` (the request id, for operators), ``data`` (the
msgpack body) and, from senders that know the compatibility handshake, ``compat``: the
sender's key (protocol/compat.py), which a decode worker reads before ``data`` to leave
alone what it must not run (workers/compat.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

from .compat import COMPAT_FIELD, compat_key
from .requests import Request, parse_request, request_to_fields
from .wire import PROTOCOL_VERSION, HandoffError, RequestError


@dataclass(frozen=True, slots=True)
class Handoff:
    """What a decode worker needs to continue a request a prefill worker started. Frozen: a
    decode worker that resumes or recomputes one makes a new one (``dataclasses.replace``).

    ``ticket`` (opaque here, see ``transfer/``) names where the KV lives and until when it
    is leased; None means no KV is offered and the receiver recomputes from
    ``prompt_ids + output_ids``. ``output_ids`` holds every token generated so far, all
    already published on ``out:<id>`` at indexes 0..n-1: at least the first, except in a
    *prompt handoff* (no ticket, no output): a prefill worker placed the whole prompt on a
    decode worker that prefills it beside its decodes (``workers/placement.py``).
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
    # The sender's model and KV layout (``LLMEngine.kv_identity``) and its transfer wire version
    # (``pdqueue.transfer.base.TRANSFER_VERSION``; its ticket carries it too): with the
    # handoff's own version, its compatibility key (``compat``). A decode worker of another key
    # never runs it: it passes it on to the stream of its key (workers/compat.py). "" and 0
    # (older senders): compatible with every decode worker, as before.
    kv_identity: str = ""
    model: str = ""                  # the sender's model name, for messages
    transfer_version: int = 0

    @property
    def prompt_only(self) -> bool:
        """A prompt handoff: nothing computed yet, the receiver prefills the prompt."""
        return not self.output_ids

    @property
    def compat(self) -> str:
        """The sender's compatibility key (protocol/compat.py), "" when it did not say."""
        return compat_key(self.kv_identity, self.transfer_version) if self.kv_identity and self.transfer_version else ""


_HANDOFF_TIMES = ("enqueued_ms", "prefill_start_ms", "prefill_end_ms", "first_token_ms")


def encode_handoff(h: Handoff) -> dict[str, bytes]:
    """Fields of a handoff stream entry: ``id`` (the request id, for operators), ``data``
    (msgpack) and, when the sender said it, ``compat`` (its key)."""
    import msgpack  # here, so that the planner can import the contract's roles without it
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
        "kv_identity": h.kv_identity,
        "model": h.model,
        "transfer_version": int(h.transfer_version),
    }
    for name in _HANDOFF_TIMES:
        body[name] = float(getattr(h, name))
    fields = {"id": h.request.id.encode(), "data": msgpack.packb(body, use_bin_type=True)}
    if h.compat:
        fields[COMPAT_FIELD] = h.compat.encode()
    return fields


def decode_handoff(fields: Mapping) -> Handoff:
    """Inverse of ``encode_handoff``; ``HandoffError`` if malformed or of another version."""
    import msgpack
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
    identity, model = body.get("kv_identity", ""), body.get("model", "")   # absent from older senders
    if not isinstance(identity, str) or not isinstance(model, str):
        raise HandoffError("handoff kv_identity and model must be strings")
    wire = body.get("transfer_version", 0)   # absent from older senders: 0
    if type(wire) is not int or wire < 0:
        raise HandoffError("handoff transfer_version must be a non-negative integer")
    ticket = body.get("ticket")
    if ticket is not None and not isinstance(ticket, dict):
        raise HandoffError("handoff ticket must be a map or nil")
    times = {}
    for name in _HANDOFF_TIMES:
        value = body.get(name, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise HandoffError(f"handoff {name} must be a number")
        times[name] = float(value)
    # A ticket names KV computed for at least the first token; only a prompt handoff has none.
    return Handoff(request=request, prompt_ids=ids("prompt_ids", True),
                   output_ids=ids("output_ids", ticket is not None), seed=seed, ticket=ticket,
                   prefill_worker=worker, attempt=attempt, cached_tokens=cached, kv_identity=identity, model=model,
                   transfer_version=wire, **times)
