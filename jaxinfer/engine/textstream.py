"""Incremental text of one request: detokenization plus stop-string matching.

Stop strings are matched on text, so they are found across token boundaries. Text that could
still turn into a stop string is held back from stream deltas until it is resolved.
"""

from __future__ import annotations

from typing import Optional, Sequence


def _prefix_function(s: str) -> list[int]:
    """pi[i]: the length of the longest proper prefix of s[:i + 1] that is also its suffix."""
    pi = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = pi[k - 1]
        if s[i] == s[k]:
            k += 1
        pi[i] = k
    return pi


class StopMatcher:
    """Stop strings found in a text fed piece by piece (Knuth-Morris-Pratt: linear work, so no
    stop string can make a stream quadratic)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self._pi = [_prefix_function(s) for s in self.stops]
        self._state = [0] * len(self.stops)  # per stop: its longest prefix ending the text
        self.fed = 0                         # characters fed so far

    def feed(self, piece: str) -> Optional[int]:
        """Appends `piece` to the text; where the earliest stop string that completes within
        it begins (an index into the whole text), or None."""
        first = None
        for j, s in enumerate(self.stops):
            pi, k = self._pi[j], self._state[j]
            for i, c in enumerate(piece):
                while k and (k == len(s) or c != s[k]):
                    k = pi[k - 1]
                if c == s[k]:
                    k += 1
                if k == len(s):
                    start = self.fed + i + 1 - k
                    first = start if first is None else min(first, start)
                    break
            self._state[j] = k
        self.fed += len(piece)
        return first

    @property
    def held(self) -> int:
        """Characters at the end of the text that may still begin a stop string."""
        return max((k for k in self._state), default=0)


class TextStream:
    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        from jaxinfer.loading.tokenizer import IncrementalDetokenizer

        self._detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self._stops = StopMatcher(stop)
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
        piece = self._detok.add([token_id])
        self._text += piece
        # The earliest match wins when several stop strings complete in one token's text.
        hit = self._stops.feed(piece) if self._stops.stops else None
        if hit is not None:
            self._text = self._text[:hit]
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
            end = max(self._emitted, end - self._stops.held)
        delta = self._text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return delta
