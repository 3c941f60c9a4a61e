"""How a reader turns a request's ``out:<id>`` entries into events (``Assembler``), and
``RequestFailed``, raised for an error entry. ``pdqueue.client``'s handles hold one
``Assembler`` each; what a stream promises (index order, each token once, no gap) is kept
here.

Imports pdqueue's protocol only.
"""

from __future__ import annotations

import logging

from pdqueue.protocol import Completion, ProtocolError, ResultEvent, ResultType, parse_result

log = logging.getLogger("pdqueue.client")


class RequestFailed(Exception):
    """The worker answered the request with an error entry."""

    def __init__(self, reason: str, code: str, request_id: str = ""):
        super().__init__(f"{code}: {reason}")
        self.reason = reason
        self.code = code
        self.request_id = request_id


class Assembler:
    """Turns ``out:<id>`` entries into events, in index order: drops repeated token indexes
    (a retried worker's), holds the tokens after a gap until the gap fills (a retried worker
    publishes the missing ones again) or the completion comes, which then supplies the
    missing tokens and their text (entries a Redis failover lost); raises on error entries;
    remembers the completion."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.last_id = "0-0"
        self.next_index = 0
        self.text_len = 0   # characters of text yielded so far
        self.held: dict[int, ResultEvent] = {}   # token events past a gap, by index
        self.completion: Completion | None = None

    def feed(self, entry_id: str, fields: dict) -> list[ResultEvent]:
        """The events this entry releases, in order (none, or several once a gap fills)."""
        self.last_id = entry_id
        try:
            event = parse_result(entry_id, fields)
        except ProtocolError as exc:
            raise RequestFailed(f"malformed result entry {entry_id}: {exc}", "internal",
                                self.request_id) from None
        if event.type is ResultType.TOKEN:
            start, end = event.index, event.index + max(1, len(event.token_ids))
            if start < self.next_index:
                if end > self.next_index:
                    log.warning("request %s: token entry %d..%d overlaps tokens already yielded",
                                self.request_id, start, end)
                return []  # a retried worker's repeat
            if start > self.next_index:
                if not self.held:
                    log.warning("request %s: tokens %d..%d missing from the stream; the later ones wait for "
                                "them or for the completion", self.request_id, self.next_index, start)
                self.held.setdefault(start, event)
                return []
            released = [self._yield(event)]
            while self.next_index in self.held:
                released.append(self._yield(self.held.pop(self.next_index)))
            self.held = {i: e for i, e in self.held.items() if i >= self.next_index}
            return released
        if event.type is ResultType.ERROR:
            raise RequestFailed(event.reason or "", event.code or "internal", self.request_id)
        self.completion = event.completion
        missing = self._missing(event.completion, entry_id)
        return [missing, event] if missing is not None else [event]

    def _yield(self, event: ResultEvent) -> ResultEvent:
        self.next_index = event.index + max(1, len(event.token_ids))
        self.text_len += len(event.text)
        return event

    def _missing(self, completion: Completion, entry_id: str) -> ResultEvent | None:
        """The tokens the stream lost, from the completion (which holds every token)."""
        ids = completion.token_ids[self.next_index:]
        if not ids:
            return None
        log.warning("request %s: tokens %d..%d taken from the completion (their entries were lost)",
                    self.request_id, self.next_index, len(completion.token_ids))
        event = ResultEvent(ResultType.TOKEN, entry_id, index=self.next_index, token_ids=tuple(ids),
                            text=completion.text[self.text_len:])
        self.held.clear()
        return self._yield(event)
