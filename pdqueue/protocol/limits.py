"""Limits: what a worker takes from one request (the worker's ``--max-*`` options)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

from .requests import DEFAULT_MAX_TOKENS, Request, entry_request_id
from .wire import ErrorCode, RequestError

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
        limit = self.max_output_tokens
        if limit is not None and req.max_tokens is not None and req.max_tokens > limit:
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


    def fit_to_context(self, req: Request, num_prompt_tokens: int, context: int | None) -> Request:
        """After tokenizing: ``req`` with a ``max_tokens`` that fits the model's ``context``
        (None: unknown). ``max_tokens=None`` (up to the context) becomes what the prompt
        leaves of it (at most ``max_output_tokens``); a ``max_tokens`` that, with the prompt,
        is over the context is a ``RequestError`` (``too_long``), as OpenAI and vLLM answer 400,
        rather than a request that decodes to the end of the context."""
        if req.max_tokens is None:
            left = max(1, context - num_prompt_tokens) if context else DEFAULT_MAX_TOKENS
            return replace(req, max_tokens=min(left, self.max_output_tokens or left))
        reason = context_error(num_prompt_tokens, req.max_tokens, context)
        if reason:
            raise RequestError(reason, req.id, ErrorCode.TOO_LONG)
        return req


def context_error(num_prompt_tokens: int | None, max_tokens: int | None, context: int | None) -> str | None:
    """Why a prompt of ``num_prompt_tokens`` (None: not tokenized yet, at least 1) plus
    ``max_tokens`` cannot fit a context of ``context`` tokens (OpenAI's and vLLM's rule:
    prompt + max_tokens <= context), or None (it fits, or nothing is known)."""
    if not context or max_tokens is None:
        return None
    prompt = num_prompt_tokens if num_prompt_tokens is not None else 1
    if prompt + max_tokens <= context:
        return None
    if num_prompt_tokens is None:
        return (f"max_tokens is {max_tokens}, but this model's maximum context length is {context} tokens, "
                f"prompt included: max_tokens must be at most {context - 1}")
    return (f"this model's maximum context length is {context} tokens; the request asks for "
            f"{prompt + max_tokens} tokens ({prompt} in the prompt, {max_tokens} in the completion): lower "
            f"max_tokens or shorten the prompt")


def entry_bytes(fields: Mapping) -> int:
    """The size of a stream entry's field names and values in bytes (UTF-8 for strings)."""
    total = 0
    for name, value in fields.items():
        for part in (name, value):
            total += len(part) if isinstance(part, (bytes, bytearray)) else len(str(part).encode("utf-8", "replace"))
    return total

