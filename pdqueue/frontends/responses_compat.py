"""OpenAI's Responses API (``/v1/responses``) as pure functions and types: a create body
parsed into a ``Turn``, a stored response (``Record``) and how it ended (``Outcome``), the
response object, its input items, and the streamed events with their ``sequence_number``.
No I/O, no clock of its own (times are passed in).

A turn is a chat: its input items become chat messages (``{"role", "content"}``; ``developer``
is ``system``), and the prompt a worker renders through the model's chat template is
``instructions`` (a system message, this turn's only: OpenAI does not carry instructions over
``previous_response_id``), then the conversation so far (the previous response's conversation,
its output as an assistant message), then this turn's messages. So a turn's prompt starts with
the previous turn's prompt and output, token for token wherever the template renders an
assistant turn as the generated text followed by its end-of-turn token (what a prefix cache, or
a KV tier, can reuse), and a turn's greedy answer is a chat completion's over the same messages.

Sampling goes through ``openai_compat.parse_chat`` (the chat path's checks and defaults):
``max_output_tokens`` is the chat's ``max_tokens`` (absent: up to the context), ``temperature``,
``top_p``, and vLLM's ``top_k``, ``seed``, ``ignore_eos``. Fields this server does not know are
ignored (``Turn.ignored``, logged); fields it knows but cannot honour (``tools``, a ``text.format``
other than text, ``truncation: auto``, ``conversation``, ``prompt``, logprobs) are a 400.

The streamed events are a function of the stored response and the answer's token events, so
every gateway, every read and every resume numbers them alike: ``response.created`` (0),
``response.in_progress`` (1); then, before the first text or the end, ``response.output_item.added``
and ``response.content_part.added``; one ``response.output_text.delta`` per token event that
brings text; at the end ``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done`` and the terminal event: ``response.completed``,
``response.incomplete`` (``max_output_tokens`` reached, or, its response's status
``cancelled``, cancelled: OpenAI's streams name no ``response.cancelled`` event, and the
``openai`` package parses this one), or ``response.failed`` (which follows the deltas directly).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from pdqueue.frontends import openai_compat as oai
from pdqueue.frontends.openai_compat import OpenAIError, bad_request

__all__ = ["Events", "FINAL", "Outcome", "Record", "Turn", "input_items_page", "new_response_id", "not_found",
           "parse_create", "response_object", "valid_response_id"]

FINAL = ("completed", "incomplete", "cancelled", "failed")
_ID = re.compile(r"^resp_[0-9a-f]{32}$")
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_KNOWN = frozenset({
    "model", "input", "instructions", "previous_response_id", "store", "stream", "background", "max_output_tokens",
    "temperature", "top_p", "top_k", "seed", "ignore_eos", "metadata", "user", "text", "tools", "tool_choice",
    "parallel_tool_calls", "truncation", "include", "reasoning", "service_tier", "stream_options",
    "safety_identifier", "prompt_cache_key", "max_tool_calls", "top_logprobs", "conversation", "prompt"})
_TEXT_PARTS = ("input_text", "output_text", "text")


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def valid_response_id(response_id: str) -> bool:
    return bool(_ID.match(response_id))


def request_id_of(response_id: str) -> str:
    """The pdqueue request id of a response (``resp-<hex>``: request ids take no ``_``)."""
    return "resp-" + response_id[len("resp_"):]


def not_found(response_id: str, param: str = "response_id") -> OpenAIError:
    return OpenAIError(404, f"Response with id {response_id[:80]!r} not found.", "invalid_request_error", param,
                       "response_not_found")


# ---- the create body ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Turn:
    """A validated ``POST /v1/responses`` body."""

    items: tuple[dict, ...]          # this turn's input items as stored (ids given)
    messages: tuple[dict, ...]       # the same as chat messages
    instructions: str | None
    previous_response_id: str | None
    store: bool
    background: bool
    stream: bool
    sampling: dict                   # chat body fields: model, max_tokens, temperature, top_p, ...
    params: dict                     # what the response object echoes
    ignored: tuple[str, ...] = field(default=())

    def chat(self, conversation: list[dict]) -> oai.Parsed:
        """The chat request of this turn after ``conversation`` (which ends with this turn's
        messages): instructions first."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return oai.parse_chat({**self.sampling, "messages": system + list(conversation)})


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
                raise bad_request(f"{where}.content: only text parts are supported (input_text, output_text), got "
                                  f"{_short(kind)}", "input")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"{where}.content must be a string or a list of text parts, got {_short(content)}", "input")


def _input(raw: Any) -> tuple[tuple[dict, ...], tuple[dict, ...]]:
    """(the input items as stored, the chat messages they are)."""
    if isinstance(raw, str):
        raw = [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise bad_request("input must be a string or a non-empty list of messages ({\"role\", \"content\"})", "input")
    items, messages = [], []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object, got {_short(item)}", "input")
        kind = item.get("type", "message")
        if kind != "message":
            raise bad_request(f"{where}: items of type {_short(kind)} are not supported (only messages: no tools, "
                              f"no item references)", "input")
        role = item.get("role")
        if role not in _ROLES:
            raise bad_request(f"{where}.role {_short(role)} is not supported (user, system, developer, assistant)",
                              "input")
        text = _content(item.get("content"), where)
        part = "output_text" if role == "assistant" else "input_text"
        stored = {"id": item["id"] if isinstance(item.get("id"), str) else f"msg_{uuid.uuid4().hex}",
                  "type": "message", "role": role, "status": "completed",
                  "content": [{"type": part, "text": text, **({"annotations": []} if role == "assistant" else {})}]}
        items.append(stored)
        messages.append({"role": _ROLES[role], "content": text})
    return tuple(items), tuple(messages)


def _refuse_unsupported(body: dict) -> None:
    if body.get("tools"):
        raise bad_request("tools are not supported", "tools")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise bad_request("tool_choice is not supported (no tools)", "tool_choice")
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if body.get("text") is not None and not isinstance(body.get("text"), dict):
        raise bad_request(f"text must be an object, got {_short(body.get('text'))}", "text")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad_request("text.format is not supported (only {\"type\": \"text\"})", "text.format")
    if body.get("truncation") not in (None, "disabled"):
        raise bad_request("truncation 'auto' is not supported (only 'disabled': a conversation over the context "
                          "is a 400)", "truncation")
    for name in ("conversation", "prompt"):
        if body.get(name) is not None:
            raise bad_request(f"{name} is not supported (use input and previous_response_id)", name)
    if body.get("top_logprobs"):
        raise bad_request("logprobs are not supported", "top_logprobs")


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean, got {_short(value)}", name)
    return value


def parse_create(body: Any) -> Turn:
    """A ``POST /v1/responses`` body; ``OpenAIError`` (400) when it is invalid or asks for
    what this server does not do."""
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    _refuse_unsupported(body)
    if "input" not in body:
        raise bad_request("input is required", "input")
    items, messages = _input(body["input"])
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request(f"instructions must be a string, got {_short(instructions)}", "instructions")
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise bad_request(f"previous_response_id must be a string, got {_short(previous)}", "previous_response_id")
    store, background, stream = _flag(body, "store", True), _flag(body, "background", False), _flag(body, "stream",
                                                                                                      False)
    if background and not store:
        raise bad_request("background responses must be stored: store=false cannot be background", "background")
    max_output = body.get("max_output_tokens")
    if max_output is not None and (not isinstance(max_output, int) or isinstance(max_output, bool) or max_output < 1):
        raise bad_request(f"max_output_tokens must be an integer >= 1, got {_short(max_output)}", "max_output_tokens")
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and
                                     all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise bad_request("metadata must be an object of at most 16 string values", "metadata")
    sampling = {name: body[name] for name in ("model", "temperature", "top_p", "top_k", "seed", "ignore_eos")
                if body.get(name) is not None}
    if max_output is not None:
        sampling["max_tokens"] = max_output
    turn = Turn(items, messages, instructions or None, previous or None, store, background, stream, sampling,
                {"instructions": instructions, "max_output_tokens": max_output, "metadata": metadata or {},
                 "previous_response_id": previous or None, "user": body.get("user"),
                 "temperature": float(body.get("temperature", 1.0)) if _number(body.get("temperature")) else 1.0,
                 "top_p": float(body.get("top_p", 1.0)) if _number(body.get("top_p")) else 1.0},
                tuple(sorted(k for k in body if k not in _KNOWN)))
    turn.chat(list(messages))   # the sampling's 400s now, before anything is read or written
    return turn


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ---- a stored response ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Outcome:
    """How a response's answer ended: the text, the deltas the stream had (one per token event
    with text: what a replay sends again), the finish (``stop``, ``length``, ``cancelled``,
    ``expired`` or ``error``), the counts, and an error (``code``, ``message``) for a failure."""

    text: str
    deltas: tuple[str, ...]
    finish: str
    prompt_tokens: int = 0
    output_ids: tuple[int, ...] = ()
    cached_tokens: int = 0
    error: dict | None = None

    @classmethod
    def of(cls, completion, deltas: list[str]) -> "Outcome":
        """From a pdqueue ``Completion``. The text the token events held back (the end of an
        incomplete UTF-8 sequence, flushed when the answer stops early) is one delta more, so
        the deltas always make the text."""
        finish = getattr(completion.finish_reason, "value", completion.finish_reason)
        said = "".join(deltas)
        if completion.text != said and completion.text.startswith(said):
            deltas = [*deltas, completion.text[len(said):]]
        error = ({"code": "server_error", "message": "the request's deadline (the gateway's --timeout) passed before "
                                                    "its answer was complete"} if finish == "expired" else None)
        return cls(completion.text, tuple(deltas), finish, completion.num_prompt_tokens,
                   tuple(completion.token_ids), completion.cached_tokens, error)

    @classmethod
    def failed(cls, deltas: list[str], code: str | None, message: str) -> "Outcome":
        """From a pdqueue error entry (``code``: its code; None: the gateway's own)."""
        kind = "invalid_prompt" if code in ("bad_request", "too_long") else "server_error"
        return cls("".join(deltas), tuple(deltas), "error",
                   error={"code": kind, "message": f"{code}: {message}" if code else message})

    @property
    def status(self) -> str:
        if self.error is not None:
            return "failed"
        return {"stop": "completed", "length": "incomplete"}.get(self.finish, "cancelled")

    def to_json(self) -> dict:
        return {"text": self.text, "deltas": list(self.deltas), "finish": self.finish,
                "prompt_tokens": self.prompt_tokens, "output_ids": list(self.output_ids),
                "cached_tokens": self.cached_tokens, "error": self.error}

    @classmethod
    def from_json(cls, data: dict) -> "Outcome":
        return cls(str(data["text"]), tuple(data["deltas"]), str(data["finish"]), int(data["prompt_tokens"]),
                   tuple(data["output_ids"]), int(data["cached_tokens"]), data.get("error"))


@dataclass(frozen=True)
class Record:
    """A stored response (``responses_store``): who made it, what it asked, its conversation
    (every message of its prompt but the instructions: the chain a next turn continues), and,
    once it ended, its status and ``Outcome``."""

    id: str
    tenant: str
    created_at: int
    model: str
    background: bool
    store: bool
    params: dict
    items: tuple[dict, ...]
    conversation: tuple[dict, ...]
    status: str | None = None        # final only: FINAL
    outcome: Outcome | None = None
    completed_at: int | None = None
    deadline_at: float | None = None  # its request's deadline (the creating gateway's --timeout); None: none

    @property
    def request_id(self) -> str:
        return request_id_of(self.id)

    def continued(self) -> list[dict]:
        """The conversation a next turn continues: this one's, then its output."""
        text = self.outcome.text if self.outcome is not None else ""
        return [*self.conversation, {"role": "assistant", "content": text}]


def _message(response_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"id": "msg_" + response_id[len("resp_"):], "type": "message", "role": "assistant", "status": status,
            "content": content}


def _usage(outcome: Outcome) -> dict:
    out = len(outcome.output_ids)
    return {"input_tokens": outcome.prompt_tokens, "input_tokens_details": {"cached_tokens": outcome.cached_tokens},
            "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": outcome.prompt_tokens + out}


def response_object(rec: Record, status: str, outcome: Outcome | None = None) -> dict:
    """The ``response`` object in ``status``; with ``outcome``, its output and usage."""
    p = rec.params
    output: list[dict] = []
    if outcome is not None and (outcome.error is None or outcome.text):
        output = [_message(rec.id, outcome.text, "completed" if status == "completed" else "incomplete")]
    return {"id": rec.id, "object": "response", "created_at": rec.created_at, "status": status,
            "background": rec.background, "error": outcome.error if outcome is not None else None,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete" else None),
            "instructions": p.get("instructions"), "max_output_tokens": p.get("max_output_tokens"),
            "max_tool_calls": None, "metadata": p.get("metadata") or {}, "model": rec.model, "output": output,
            "parallel_tool_calls": True, "previous_response_id": p.get("previous_response_id"),
            "reasoning": {"effort": None, "summary": None}, "service_tier": "default", "store": rec.store,
            "temperature": p.get("temperature", 1.0), "text": {"format": {"type": "text"}}, "tool_choice": "auto",
            "tools": [], "top_logprobs": 0, "top_p": p.get("top_p", 1.0), "truncation": "disabled",
            "usage": _usage(outcome) if outcome is not None and outcome.error is None else None,
            "user": p.get("user"), "completed_at": rec.completed_at if status in FINAL else None}


def input_items_page(rec: Record, after: str | None, limit: int, order: str) -> dict:
    """``GET /v1/responses/{id}/input_items``: this turn's input items, a page of them."""
    items = list(rec.items) if order == "asc" else list(reversed(rec.items))
    if after is not None:
        ids = [i["id"] for i in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


# ---- the streamed events ---------------------------------------------------------------------------

class Events:
    """A response's events in order, each with its ``sequence_number`` (see the module
    docstring); the caller writes those after the client's ``starting_after``."""

    def __init__(self, rec: Record):
        self.rec = rec
        self.seq = -1
        self.item_open = False
        self.texts: list[str] = []

    def _event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq, **fields}

    def opening(self) -> list[dict]:
        rec = self.rec
        first = "queued" if rec.background else "in_progress"
        return [self._event("response.created", response=response_object(rec, first)),
                self._event("response.in_progress", response=response_object(rec, "in_progress"))]

    def _open_item(self) -> list[dict]:
        if self.item_open:
            return []
        self.item_open = True
        message = _message(self.rec.id, None, "in_progress")
        return [self._event("response.output_item.added", output_index=0, item=message),
                self._event("response.content_part.added", item_id=message["id"], output_index=0, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    def delta(self, text: str) -> list[dict]:
        """The events of one token event's text (none for an empty one)."""
        if not text:
            return []
        self.texts.append(text)
        return [*self._open_item(),
                self._event("response.output_text.delta", item_id=_message(self.rec.id, None, "")["id"],
                            output_index=0, content_index=0, delta=text, logprobs=[])]

    def closing(self, status: str, outcome: Outcome, ended: Record | None = None) -> list[dict]:
        """The end: the item's done events (not for a failure) and the terminal event, whose
        response is ``ended`` (the record as it ended; None: the one given)."""
        rec = ended or self.rec
        final = response_object(rec, status, outcome)
        if status == "failed":
            return [self._event("response.failed", response=final)]
        events = self._open_item()
        message = _message(rec.id, outcome.text, "completed" if status == "completed" else "incomplete")
        part = message["content"][0]
        events += [self._event("response.output_text.done", item_id=message["id"], output_index=0, content_index=0,
                               text=outcome.text, logprobs=[]),
                   self._event("response.content_part.done", item_id=message["id"], output_index=0, content_index=0,
                               part=part),
                   self._event("response.output_item.done", output_index=0, item=message),
                   self._event("response.completed" if status == "completed" else "response.incomplete",
                               response=final)]
        return events

    def replay(self, status: str, outcome: Outcome) -> list[dict]:
        """Every event of an ended response, from its record."""
        events = self.opening()
        for text in outcome.deltas:
            events += self.delta(text)
        return events + self.closing(status, outcome)
