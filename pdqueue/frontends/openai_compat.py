"""OpenAI's completions and chat completions API, as pure functions: parse a request body
into pdqueue submit arguments, build response bodies and stream chunks, and the error
shape. No I/O, no clock of its own (``created`` is passed in or read once per call).

Used by the HTTP gateway (``pdqueue serve``, ``pdqueue/frontends/gateway.py``) and by ``pdqueue
batch``. The rules follow vLLM's OpenAI server, so clients see the answers they know:

- Fields this server does not know are ignored; ``Parsed.ignored`` names them (vLLM logs
  "The following fields were present in the request but ignored: ...").
- Fields it knows but cannot honour (``n`` > 1, ``logprobs``, ``echo``, ``best_of`` > 1,
  ``suffix``, penalties other than neutral, ``logit_bias``, ``tools``, a ``response_format``
  other than text) are a 400 with a message naming the field, never silently dropped.
- ``max_tokens`` (or ``max_completion_tokens``) absent: 16 for completions (OpenAI's and
  vLLM's default); for chat, ``None``, meaning "up to the context" (sent as such: the worker
  that tokenizes the prompt gives it what the prompt leaves of the context). A prompt plus
  ``max_tokens`` over the model's context is a 400 (OpenAI's and vLLM's rule), from the
  gateway where it can tell (``max_tokens`` alone over it, or token ids), else from the worker.
- vLLM's extra sampling fields ``top_k`` (``-1`` or ``0``: off) and ``ignore_eos`` work.

Finish reasons: pdqueue ``stop`` -> ``stop``, ``length`` -> ``length``; ``cancelled`` and
``expired`` -> ``abort`` (vLLM's word for a request ended by the server).

Errors: ``OpenAIError(status, message, type, param, code).body()`` is
``{"error": {"message", "type", "param", "code"}}``, OpenAI's shape.

Standard library only, and pdqueue.protocol's context rule (``context_error``) and its check
of each sampling field (``sampling_error``: the values this API takes are the wire's).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable

from pdqueue.protocol.limits import context_error
from pdqueue.protocol.requests import MAX_SEED, sampling_error

__all__ = ["COMPLETION_MAX_TOKENS_DEFAULT", "MAX_SEED", "OpenAIError", "Parsed", "bad_request", "chat_body",
           "chat_chunk", "chat_role_chunk", "completion_body", "completion_chunk", "finish_reason", "new_id",
           "parse_chat", "parse_completion", "sse", "usage", "usage_chunk", "worker_error"]

COMPLETION_MAX_TOKENS_DEFAULT = 16   # OpenAI's documented default for /v1/completions, and vLLM's
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class OpenAIError(Exception):
    """An HTTP error in OpenAI's shape. ``type``: ``invalid_request_error`` (400, 401, 404),
    ``rate_limit_error`` (429), ``server_error`` (500, 503), ``timeout_error`` (504)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


def worker_error(code: str | None, reason: str) -> OpenAIError:
    """A pdqueue ``error`` entry (``RequestFailed.code``/``.reason``) as an HTTP error: the
    request's fault (``bad_request``, ``too_long``) is a 400, a deadline that passed before
    the first token (``deadline_exceeded``) a 504 as the gateway's own timeout is, no worker
    within the gateway's capacity wait (``no_capacity``) a 503, anything else a 500."""
    if code in ("bad_request", "too_long"):
        return bad_request(reason, code=code)
    if code == "deadline_exceeded":
        return OpenAIError(504, f"the deadline passed: {reason}", "timeout_error", code=code)
    if code == "no_capacity":   # the gateway's own (frontends/capacity.py): no worker came in time
        return OpenAIError(503, reason, "server_error", code="service_unavailable")
    return OpenAIError(500, f"the request failed: {reason}", "server_error", code=code)


@dataclass(frozen=True)
class Parsed:
    """A validated request. ``submit_kwargs()`` gives the arguments of
    ``Client.submit``/``AsyncClient.submit``."""

    kind: str                                   # "completion" or "chat"
    model: str | None                           # None: the server's (only) model
    prompt: str | None = None                   # completion text, or a chat's single user message
    prompt_ids: tuple[int, ...] | None = None   # completion token ids
    messages: tuple[dict, ...] | None = None    # chat: [{"role", "content"}], content as text
    max_tokens: int | None = None               # None (chat only): up to the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    ignored: tuple[str, ...] = field(default=())  # unknown fields (to log)

    @property
    def chat(self) -> bool:
        return self.kind == "chat"

    def check_context(self, context: int | None) -> None:
        """A 400 (code ``too_long``) before anything is queued when the prompt plus
        ``max_tokens`` cannot fit the model's ``context`` (None: unknown), as far as can be
        told without tokenizing: ``max_tokens`` alone, or token ids (the worker counts a
        text prompt's tokens and refuses it the same way)."""
        prompt_tokens = len(self.prompt_ids) if self.prompt_ids is not None else None
        too_long = context_error(prompt_tokens, self.max_tokens, context)
        if too_long:
            raise bad_request(too_long, "max_tokens", "too_long")

    def submit_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``Client.submit``. An absent chat ``max_tokens`` is
        ``max_tokens=None``: up to the model's context; an absent completion one is 16.

        A chat of one user message goes as ``prompt`` + ``chat=True`` (every worker speaks
        that); any other conversation as ``messages`` (the template is applied to all of it)."""
        kwargs: dict[str, Any] = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                      seed=self.seed, stop=self.stop)
        if self.ignore_eos:
            kwargs["ignore_eos"] = True
        if self.max_tokens is not None or self.kind == "chat":
            kwargs["max_tokens"] = self.max_tokens
        if self.kind == "chat":
            kwargs["chat"] = True
            if self.messages is not None:
                kwargs["messages"] = [dict(m) for m in self.messages]
            else:
                kwargs["prompt"] = self.prompt
        elif self.prompt_ids is not None:
            kwargs["prompt_ids"] = list(self.prompt_ids)
        else:
            kwargs["prompt"] = self.prompt
        return kwargs


# ---- request parsing ------------------------------------------------------------------------

_COMMON = frozenset({"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
                     "stream_options", "n", "presence_penalty", "frequency_penalty", "repetition_penalty",
                     "logit_bias", "user", "ignore_eos", "logprobs", "best_of", "min_tokens",
                     "metadata", "store", "service_tier"})
_COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix"}
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                          "parallel_tool_calls", "functions", "function_call", "response_format",
                          "modalities", "audio", "prediction", "reasoning_effort", "web_search_options"}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _check_body(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _common(body: dict, chat: bool) -> dict[str, Any]:
    """The sampling and streaming fields both endpoints share, validated."""
    out: dict[str, Any] = {}
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(f"model must be a string, got {_short(model)}", "model")
    out["model"] = model or None

    n = body.get("n")
    if n is not None and n != 1:
        if not _is_int(n) or n < 1:
            raise bad_request(f"n must be an integer >= 1, got {_short(n)}", "n")
        raise bad_request(f"n={n} is not supported: this server returns one choice per request (n=1); "
                          "send the request several times with different seeds instead", "n")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise bad_request(f"best_of={_short(best_of)} is not supported (only 1)", "best_of")

    def checked(field: str, value: Any, name: str | None = None) -> Any:
        reason = sampling_error(field, value, name)
        if reason:
            raise bad_request(reason, name or field)
        return value

    names = ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",)
    max_tokens = None
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        checked("max_tokens", value, name)
        max_tokens = value if max_tokens is None else min(max_tokens, value)
    out["max_tokens"] = max_tokens if (chat or max_tokens is not None) else COMPLETION_MAX_TOKENS_DEFAULT

    for name in ("temperature", "top_p"):
        if body.get(name) is not None:
            out[name] = float(checked(name, body[name]))
    top_k = body.get("top_k")
    if top_k is not None:   # vLLM's -1 is off, as 0 is
        out["top_k"] = checked("top_k", 0 if top_k == -1 and _is_int(top_k) else top_k)
    if body.get("seed") is not None:
        out["seed"] = checked("seed", body["seed"])

    stop = body.get("stop")
    if stop is None:
        out["stop"] = ()
    elif isinstance(stop, str):
        if not stop:
            raise bad_request("stop must not be an empty string", "stop")
        out["stop"] = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) and s for s in stop):
        out["stop"] = tuple(stop)
    else:
        raise bad_request(f"stop must be a string or a list of non-empty strings, got {_short(stop)}", "stop")

    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise bad_request(f"ignore_eos must be a boolean, got {_short(ignore_eos)}", "ignore_eos")
    out["ignore_eos"] = bool(ignore_eos)

    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request(f"stream must be a boolean, got {_short(stream)}", "stream")
    out["stream"] = bool(stream)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad_request("Stream options can only be defined when `stream=True`.", "stream_options")
        if not isinstance(options, dict):
            raise bad_request(f"stream_options must be an object, got {_short(options)}", "stream_options")
        value = options.get("include_usage")
        if value is not None and not isinstance(value, bool):
            raise bad_request(f"stream_options.include_usage must be a boolean, got {_short(value)}",
                              "stream_options")
        include_usage = bool(value)
    out["include_usage"] = include_usage

    # Known fields that would change the answer: only their neutral values are accepted.
    for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1),
                          ("min_tokens", 0)):
        value = body.get(name)
        if value is not None and value != neutral:
            raise bad_request(f"{name}={_short(value)} is not supported (only {neutral})", name)
    if body.get("logit_bias"):
        raise bad_request("logit_bias is not supported", "logit_bias")
    logprobs = body.get("logprobs")
    if logprobs is not None and logprobs is not False:
        raise bad_request("logprobs are not supported", "logprobs")
    return out


def _ignored(body: dict, known: frozenset) -> tuple[str, ...]:
    return tuple(sorted(k for k in body if k not in known))


def parse_completion(body: Any) -> Parsed:
    """A ``/v1/completions`` body; ``OpenAIError`` (400) when it is invalid or asks for
    what this server does not do."""
    body = _check_body(body)
    common = _common(body, chat=False)
    if body.get("echo"):
        raise bad_request("echo is not supported", "echo")
    if body.get("suffix") is not None:
        raise bad_request("suffix is not supported", "suffix")
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("prompt is required", "prompt")
    prompt, prompt_ids = body["prompt"], None
    if isinstance(prompt, list):
        if prompt and all(_is_int(t) for t in prompt):
            prompt_ids, prompt = tuple(prompt), None
        elif len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        elif len(prompt) == 1 and isinstance(prompt[0], list) and prompt[0] and all(_is_int(t) for t in prompt[0]):
            prompt_ids, prompt = tuple(prompt[0]), None
        elif len(prompt) > 1:
            raise bad_request(f"a list of {len(prompt)} prompts is not supported: send one prompt per request",
                              "prompt")
        else:
            raise bad_request("prompt must be a string, a list of token ids, or a list of one of those", "prompt")
    if prompt_ids is not None:
        if any(t < 0 for t in prompt_ids):
            raise bad_request("prompt token ids must be >= 0", "prompt")
    elif not isinstance(prompt, str):
        raise bad_request(f"prompt must be a string or a list of token ids, got {_short(prompt)}", "prompt")
    elif not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    return Parsed(kind="completion", prompt=prompt, prompt_ids=prompt_ids,
                  ignored=_ignored(body, _COMPLETION_FIELDS), **common)


def _content_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(f"messages[{i}].content: only text parts are supported, got {_short(kind)}",
                                  "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts, got {_short(content)}",
                      "messages")


def parse_chat(body: Any) -> Parsed:
    """A ``/v1/chat/completions`` body; ``OpenAIError`` (400) otherwise."""
    body = _check_body(body)
    common = _common(body, chat=True)
    if body.get("tools") or body.get("functions"):
        raise bad_request("tool calling is not supported", "tools")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad_request("response_format is not supported (only {\"type\": \"text\"})", "response_format")
    if body.get("top_logprobs"):
        raise bad_request("logprobs are not supported", "top_logprobs")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty list of {\"role\", \"content\"} objects", "messages")
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object, got {_short(m)}", "messages")
        role = m.get("role")
        if role not in _ROLES:
            raise bad_request(f"messages[{i}].role {_short(role)} is not supported "
                              f"(system, developer, user, assistant)", "messages")
        if m.get("tool_calls"):
            raise bad_request(f"messages[{i}]: tool calls are not supported", "messages")
        messages.append({"role": _ROLES[role], "content": _content_text(m.get("content"), i)})
    single_user = len(messages) == 1 and messages[0]["role"] == "user"
    return Parsed(kind="chat", prompt=messages[0]["content"] if single_user else None,
                  messages=None if single_user else tuple(messages),
                  ignored=_ignored(body, _CHAT_FIELDS), **common)


# ---- responses ------------------------------------------------------------------------------

def new_id(kind: str, request_id: str | None = None) -> str:
    """``cmpl-<request id>`` / ``chatcmpl-<request id>`` (a random one without an id)."""
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{request_id or uuid.uuid4().hex}"


def finish_reason(reason: Any) -> str:
    """pdqueue's finish reason (a ``FinishReason`` or its value) as OpenAI's."""
    value = getattr(reason, "value", reason)
    return value if value in ("stop", "length") else "abort"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's ``usage``; ``prompt_tokens_details.cached_tokens``: the prompt tokens a
    prefix cache served (pdqueue's ``done`` field ``cached_tokens``), as OpenAI and vLLM
    report them."""
    return {"prompt_tokens": int(prompt_tokens), "completion_tokens": int(completion_tokens),
            "total_tokens": int(prompt_tokens) + int(completion_tokens),
            "prompt_tokens_details": {"cached_tokens": int(cached_tokens)}}


def _now(created: int | None) -> int:
    return int(time.time()) if created is None else int(created)


def completion_body(id: str, model: str, text: str, finish: Any, prompt_tokens: int, completion_tokens: int,
                    created: int | None = None, cached_tokens: int = 0) -> dict:
    """The non-streaming ``/v1/completions`` answer."""
    return {"id": id, "object": "text_completion", "created": _now(created), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason(finish)}],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def chat_body(id: str, model: str, text: str, finish: Any, prompt_tokens: int, completion_tokens: int,
              created: int | None = None, cached_tokens: int = 0) -> dict:
    """The non-streaming ``/v1/chat/completions`` answer."""
    return {"id": id, "object": "chat.completion", "created": _now(created), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish_reason(finish)}],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def completion_chunk(id: str, model: str, created: int, text: str, finish: Any = None,
                     include_usage: bool = False) -> dict:
    """A streamed ``/v1/completions`` chunk; ``finish`` on the last one. With
    ``include_usage`` every chunk but the usage one carries ``"usage": null`` (OpenAI's shape)."""
    chunk = {"id": id, "object": "text_completion", "created": created, "model": model,
             "choices": [{"index": 0, "text": text, "logprobs": None,
                          "finish_reason": None if finish is None else finish_reason(finish)}]}
    if include_usage:
        chunk["usage"] = None
    return chunk


def chat_role_chunk(id: str, model: str, created: int, include_usage: bool = False) -> dict:
    """The first streamed chat chunk: ``delta = {"role": "assistant", "content": ""}``."""
    return _chat_chunk(id, model, created, {"role": "assistant", "content": ""}, None, include_usage)


def chat_chunk(id: str, model: str, created: int, text: str, finish: Any = None,
               include_usage: bool = False) -> dict:
    """A streamed chat content chunk; ``finish`` on the last one (its delta may be empty)."""
    return _chat_chunk(id, model, created, {"content": text} if text or finish is None else {}, finish,
                       include_usage)


def _chat_chunk(id, model, created, delta, finish, include_usage) -> dict:
    chunk = {"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [{"index": 0, "delta": delta, "logprobs": None,
                          "finish_reason": None if finish is None else finish_reason(finish)}]}
    if include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(kind: str, id: str, model: str, created: int, prompt_tokens: int, completion_tokens: int,
                cached_tokens: int = 0) -> dict:
    """The last chunk of a stream with ``stream_options.include_usage``: empty ``choices``."""
    return {"id": id, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def sse(chunks: Iterable[dict]) -> Iterable[str]:
    """Server-sent events of ``chunks``, ending with ``data: [DONE]``."""
    import json

    for chunk in chunks:
        yield f"data: {json.dumps(chunk, ensure_ascii=False, separators=(',', ':'))}\n\n"
    yield "data: [DONE]\n\n"
