"""Stream deltas against the engine's stop-string semantics: text grows piece by piece until a
stop string completes (the text is cut where the earliest one begins) or the request ends; at
every update the deltas sent so far are a prefix of the final text, hold back exactly the
longest tail that may still begin a stop string (found here by brute force), and add up to the
final text at the end."""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer import openai_api as oa
from jaxinfer.serve.streaming import Deltas


@dataclasses.dataclass
class Seq:
    """The fields of a RequestOutput that Deltas reads."""

    text: str
    token_ids: range
    finish_reason: Optional[str] = None
    logprobs: Optional[list] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def held_by_brute_force(text: str, stops: list[str]) -> int:
    """The longest tail of `text` that is a proper prefix of a stop string."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def run_stream(pieces: list[str], stops: list[str]):
    """Feeds `pieces` as the engine would; (deltas sent, final text, and per update: characters
    sent so far, the text then, whether it was finished). Deltas only append, so every partial
    send is a prefix of the final one."""
    body = {"prompt": "x", "stream": True, "stop": stops}
    req = oa.parse_request(oa.COMPLETIONS, body, max_n=1)
    deltas = Deltas(req, None, response_id="cmpl-1", created=0, model="m")
    text, sent, trace, longest = "", "", [], max(map(len, stops))
    for i, piece in enumerate(pieces):
        text += piece
        # A stop string that completes now ends within the new piece.
        tail = max(0, len(text) - len(piece) - longest + 1)
        hits = [h for h in (text.find(s, tail) for s in stops) if h >= 0]
        finish = None
        if hits:
            text, finish = text[:min(hits)], "stop"
        elif i == len(pieces) - 1:
            finish = "length"
        for chunk in deltas.update(Seq(text, range(i + 1), finish)):
            sent += chunk["choices"][0]["text"]
        trace.append((len(sent), text if len(text) <= 1000 else None, finish))
        if finish:
            break
    return sent, text, trace


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(pieces=st.lists(st.text("ab", max_size=4), min_size=1, max_size=30),
       stops=st.lists(st.text("ab", min_size=1, max_size=6), min_size=1, max_size=4))
def test_deltas_hold_back_exactly_the_possible_stop_prefix(pieces, stops):
    sent, final, trace = run_stream(pieces, stops)
    assert sent == final
    for chars, text, finish in trace:
        if finish is None:
            assert chars == len(text) - held_by_brute_force(text, stops)


def test_a_long_repetitive_stop_string():
    """The 1,024-byte stop "aaa...ab" against 20,020 characters of runs of a's broken by "c",
    arriving one at a time: each run stays held back (it could still become the stop) until a
    "c" resolves it, and the whole stream takes a small fraction of a second (each update
    feeds the matcher one character; it never rescans the text or the stop)."""
    stop, block = "a" * 1023 + "b", "a" * 1000 + "c"
    t0 = time.perf_counter()
    sent, final, trace = run_stream(list(block * 20), [stop])
    assert time.perf_counter() - t0 < 5.0
    assert sent == final == block * 20
    assert [chars for chars, _, _ in trace[:-1]] == [n - n % 1001 for n in range(1, 20_020)]
