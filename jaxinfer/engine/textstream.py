"""Incremental text of one request: detokenization plus stop-string matching.

Stop strings are matched on text, so they are found across token boundaries. Text that could
still turn into a stop string is held back from stream deltas until it is resolved.
"""

from __future__ import annotations

from typing import Sequence


class TextStream:
    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        from jaxinfer.loading.tokenizer import IncrementalDetokenizer

        self._detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self._stop = tuple(stop)
        self._text = ""
        self._emitted = 0
        self.stopped = False
        self.finished = False

    @property
    def text(self) -> str:
        return self._text

    def add(self, token_id: int) -> bool:
        """Appends a token; returns True when a stop string completed (text is cut before it)."""
        if self._detok is None or self.stopped:
            return self.stopped
        # Search only the region a new match could touch: the tail the new text may complete.
        start = max(0, len(self._text) - max((len(s) for s in self._stop), default=0))
        self._text += self._detok.add([token_id])
        hits = [i for i in (self._text.find(s, start) for s in self._stop) if i >= 0]
        if hits:  # the earliest match wins when several stop strings complete at once
            self._text = self._text[:min(hits)]
            self.stopped = True
        return self.stopped

    def finish(self) -> None:
        if self._detok is not None and not self.stopped and not self.finished:
            self._text += self._detok.flush()
        self.finished = True

    def pop_delta(self) -> str:
        """Text that is final since the last call (holding back a possible stop-string prefix)."""
        end = len(self._text)
        if not (self.finished or self.stopped):
            for s in self._stop:
                for k in range(min(len(s) - 1, end - self._emitted), 0, -1):
                    if self._text.endswith(s[:k]):
                        end = min(end, len(self._text) - k)
                        break
        delta = self._text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return delta
