"""Intake: a ``requests`` stream entry becomes an engine request, or an answer.

In this order (prefill and colocated workers):

0. the entry's size against ``Limits.max_entry_bytes`` (before anything is parsed; the
   dead-letter copy of an oversized entry keeps the first ``DEAD_VALUE_BYTES`` of each value);
1. ``parse_request`` parses the entry (an entry deleted while pending is only acknowledged);
2. one pipelined round trip (``streams.claim_request``): ``seen:<id>`` is set to the entry
   id unless another entry holds the id (then this one is a duplicate: dead-lettered, and
   nothing on ``out:<id>``, which belongs to the first), and ``cancel:<id>`` is read;
3. an expired deadline answers an error ``deadline_exceeded`` when the request names a
   service class (field ``class``), else (old producers) finishes it as ``done``/``expired``;
   a cancel finishes it as ``done``/``cancelled``;
4. the request's limits (``Limits``: prompt characters, max_tokens, stop strings), then
   the prompt is tokenized (with the chat template when asked) and its tokens counted
   against ``max_prompt_tokens``;
5. ``engine.check_prompt``: context and KV pool sizes; then the prompt plus ``max_tokens``
   against the context (``Limits.fit_to_context``: over it is ``too_long``; ``max_tokens``
   None, up to the context, becomes what the prompt leaves of it);
5b. routing (workers/routing.py): a request from ``requests`` whose prefix a peer caches
   much more of moves to that peer's own stream (exactly once, by script) and ends here;
6. the seed is the request's, or a random 63-bit one;
6b. placement (workers/placement.py, prefill workers): a short online prompt that would get
   its first token sooner on a decode worker taking prompts goes there as a prompt handoff
   (the entry is finished with it, as with a prefill's handoff) and ends here;
6c. the pull (workers/kv_pull.py): history a peer holds (the last turn's KV, kept by the
   worker that decoded it) is pulled into the engine's tier when that is cheaper than
   computing it; any failure leaves it to be computed;
7. ``engine.add_request``.

Anything that cannot run is answered (``error`` + ``dead``) in the caller's unit, and the
worker goes on. A Redis error is not the request's fault: it propagates, the entry stays
pending, and it is taken in again (``Recovery``).
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field

import redis

from pdqueue.engine.sampling import SamplingParams
from pdqueue.keys import Keys
from pdqueue.protocol import (
    Completion,
    ErrorCode,
    FinishReason,
    Handoff,
    Limits,
    Request,
    RequestError,
    encode_handoff,
    parse_request,
)
from pdqueue.queue import streams
from workers.answers import Unit
from workers.common import now_ms
from workers.compat import sender_fields

log = logging.getLogger("pdqueue.worker")

DEAD_VALUE_BYTES = 1024
"""An oversized entry's dead-letter copy keeps this many bytes of each value."""


@dataclass(slots=True)
class Admitted:
    """A request taken from ``requests`` and running in the engine."""
    stream: str
    entry_id: str
    request: Request
    prompt_ids: list[int]
    params: SamplingParams
    read_ms: float
    token_times_ms: list[float] = field(default_factory=list)


class Intake:
    def __init__(self, r: redis.Redis, keys: Keys, worker_id: str, loaded, limits: Limits | None = None,
                 router=None, placer=None, metrics=None, puller=None):
        """``router``: a workers.routing.Router, asked after tokenizing whether a peer that
        caches more of the prompt should run it instead; ``placer``: a workers.placement.
        Placement, asked whether a decode worker should prefill it; ``puller``: a
        workers.kv_pull.KVPull, asked to pull the history a peer holds."""
        self.r, self.keys, self.worker_id, self.router, self.placer = r, keys, worker_id, router, placer
        self.puller = puller
        self.metrics = metrics
        self.limits = limits or Limits()
        self.tokenizer = loaded.tokenizer
        self.vocab_size = loaded.config.vocab_size

    def take(self, engine, stream: str, entry_id: str, fields: dict | None, unit: Unit) -> Admitted | None:
        """Admit one request entry into ``engine`` (returned), or answer it in ``unit``."""
        read_ms = now_ms()
        try:
            if fields is None:  # deleted while pending
                unit.ack(stream, entry_id)
                return None
            try:
                self.limits.check_entry(entry_id, fields)
            except RequestError as exc:
                unit.reject(stream, entry_id, _cut(fields), exc.request_id, exc.reason, exc.code)
                return None
            req = parse_request(entry_id, fields)
            may_run, cancelled = streams.claim_request(self.r, self.keys, req.id, entry_id)   # one round trip
            if not may_run:
                unit.reject(stream, entry_id, fields, None,
                            f"request id {req.id!r} was already taken by another entry", ErrorCode.DUPLICATE)
                return None
            if req.expired(read_ms):
                if req.service_class is not None:   # a producer that names a class is told it came too late
                    raise RequestError(f"deadline passed {read_ms - req.deadline_at_ms:.0f} ms before it could start",
                                       req.id, ErrorCode.DEADLINE_EXCEEDED)
                self.finish_early(unit, stream, entry_id, req, FinishReason.EXPIRED)
                return None
            if cancelled:
                self.finish_early(unit, stream, entry_id, req, FinishReason.CANCELLED)
                return None
            self.limits.check_request(req)
            prompt_ids = self.tokenize(req)
            self.limits.check_prompt_tokens(req.id, len(prompt_ids))
            reason = engine.check_prompt(len(prompt_ids))
            if reason:
                raise RequestError(reason, req.id, ErrorCode.TOO_LONG)
            # prompt + max_tokens over the context: refused (400), not decoded to its end
            req = self.limits.fit_to_context(req, len(prompt_ids), getattr(engine, "max_model_len", None))
            if self.router is not None:
                moved = self.router.route(stream, entry_id, fields, req.id, prompt_ids, req.enqueued_ms)
                if moved is not None:   # 1: a peer caching more of it runs it; -1: already finished elsewhere
                    return None
            seed = req.seed if req.seed is not None else secrets.randbits(63)
            if self.placer is not None and not req.background:
                target = self.placer.place(engine, len(prompt_ids))
                if target is not None:
                    handoff = Handoff(request=req, prompt_ids=prompt_ids, output_ids=[], seed=seed, ticket=None,
                                      prefill_worker=self.worker_id, enqueued_ms=req.enqueued_ms,
                                      prefill_start_ms=read_ms, **sender_fields(engine))
                    unit.handoff(stream, entry_id, req.id, target, encode_handoff(handoff))
                    if self.metrics is not None:
                        self.metrics.placed()
                    return None
            if self.puller is not None:
                self.puller.pull(engine, prompt_ids)
            params = SamplingParams.for_request(req, seed)
            engine.add_request(req.id, prompt_ids, params, rank=req.rank,
                               deadline_ms=req.deadline_at_ms, enqueued_ms=req.enqueued_ms)
            return Admitted(stream, entry_id, req, prompt_ids, params, read_ms)
        except RequestError as exc:
            unit.reject(stream, entry_id, fields, exc.request_id, exc.reason, exc.code)
        except (redis.ConnectionError, redis.TimeoutError):
            raise  # not the request's fault: it stays pending and is taken in again
        except Exception as exc:  # a bug must not kill the worker or lose the entry's answer
            log.exception("intake of %s failed", entry_id)
            unit.reject(stream, entry_id, fields, None, f"internal error: {exc}", ErrorCode.INTERNAL)
        return None

    def finish_early(self, unit: Unit, stream: str, entry_id: str, req: Request, reason: FinishReason) -> None:
        c = Completion(req.id, "", (), reason, e2e_ms=max(0.0, now_ms() - req.enqueued_ms),
                       prefill_worker=self.worker_id)
        unit.done(stream, entry_id, c, req)

    def tokenize(self, req: Request) -> list[int]:
        if req.prompt_ids is not None:
            ids = list(req.prompt_ids)
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise RequestError(f"prompt_ids has token id {bad[0]}; the vocabulary has {self.vocab_size} ids",
                                   req.id)
        elif req.messages is not None:
            ids = self.tokenizer.encode_chat([dict(m) for m in req.messages])
        elif req.chat:
            ids = self.tokenizer.encode_chat([{"role": "user", "content": req.prompt}])
        else:
            ids = self.tokenizer.encode(req.prompt)
        if not ids:
            raise RequestError("the prompt is empty (no tokens)", req.id)
        return ids


def _cut(fields: dict, max_fields: int = 64) -> dict:
    """An oversized entry's dead letter: its first ``max_fields`` fields, names and values cut
    to ``DEAD_VALUE_BYTES``."""
    def cut(part) -> bytes:
        return (part if isinstance(part, (bytes, bytearray)) else str(part).encode())[:DEAD_VALUE_BYTES]

    return {cut(name): cut(value) for name, value in list(fields.items())[:max_fields]}
