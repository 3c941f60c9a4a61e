"""A request's text as it grows: incremental detokenization and stop strings.

Text that might be the start of a stop string is held back until it is known not to be,
so a streamed delta never shows text that the final answer cuts off.

Imports models.tokenizer only.
"""

from __future__ import annotations

from pdqueue.models.tokenizer import IncrementalDetokenizer


class OutputText:
    def __init__(self, tokenizer, stop: tuple[str, ...] = (), prior_ids: list[int] = ()):
        """``prior_ids``: output tokens already streamed by another worker (resumed request).

        They are replayed through ``push`` so that what counts as already shown is exactly
        what that worker showed: text it held back (a possible stop-string start, an
        incomplete character) is still to be shown here.
        """
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stop = tuple(s for s in stop if s)
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self._text = ""
        self._num_emitted = 0
        self.stopped = False
        for token_id in prior_ids:
            self.push(token_id)

    @property
    def text(self) -> str:
        return self._text

    def push(self, token_id: int) -> str:
        """Add a token; returns the text that can be shown now. Sets ``stopped`` on a stop string."""
        if self.stopped:
            return ""
        self._add(self._detok.push(token_id))
        safe = len(self._text) if self.stopped else len(self._text) - self._holdback
        return self._emit(safe)

    def flush(self) -> str:
        """All text not yet shown (call at the end), including text the detokenizer still
        holds back (an incomplete UTF-8 sequence, shown as U+FFFD as ``decode`` does)."""
        if not self.stopped:
            self._add(self._detok.flush())
        return self._emit(len(self._text))

    def _add(self, new_text: str) -> None:
        if not new_text:
            return
        search_from = max(0, len(self._text) - self._holdback)
        self._text += new_text
        for s in self._stop:
            cut = self._text.find(s, search_from)
            if cut != -1:
                self._text = self._text[:cut]
                self.stopped = True

    def _emit(self, upto: int) -> str:
        if upto <= self._num_emitted:
            return ""
        delta = self._text[self._num_emitted:upto]
        self._num_emitted = upto
        return delta
