"""StopMatcher against a brute-force reference (str.find and endswith over the whole text),
over generated texts from a small alphabet, where stop strings overlap and repeat."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.engine.textstream import StopMatcher

_ALPHABET = "ab\u00e9\U0001f600"  # repeats, overlaps and characters of several UTF-8 lengths


def _reference_hit(text: str, stops) -> int | None:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def _reference_held(text: str, stops) -> int:
    return max((k for s in stops for k in range(len(s)) if k and text.endswith(s[:k])),
               default=0)


@settings(max_examples=400, deadline=None)
@given(stops=st.lists(st.text(_ALPHABET, min_size=1, max_size=6), min_size=1, max_size=4),
       pieces=st.lists(st.text(_ALPHABET, max_size=5), max_size=12))
def test_stop_matcher_equals_brute_force(stops, pieces):
    m, text = StopMatcher(stops), ""
    for piece in pieces:
        text += piece
        hit = m.feed(piece)
        assert hit == _reference_hit(text, stops), (text, stops)
        if hit is not None:  # the engine cuts the text here and feeds nothing more
            return
        assert m.held == _reference_held(text, stops), (text, stops)


def test_stop_matcher_is_linear_in_a_repetitive_text():
    """A 1,024-character stop string of one repeated letter against 20,000 of that letter, fed
    a character at a time: the quadratic search this replaced compared ~1e10 characters."""
    stop = "a" * 1023 + "b"
    m = StopMatcher([stop])
    t0 = time.perf_counter()
    for _ in range(20_000):
        assert m.feed("a") is None
    assert m.held == 1023
    assert m.feed("b") == 20_000 - 1023
    assert time.perf_counter() - t0 < 5.0  # about 0.05 s; a bound, not a benchmark
