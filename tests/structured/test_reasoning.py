"""The <think>...</think> split: whole outputs by hand-written cases (text before the block,
a block cut off by the token limit, a block the prompt opened, markers repeated or partial),
streams split anywhere adding up to the whole text's split (two independent implementations),
and which models get a parser."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.structured.reasoning import ReasoningParser, pick_reasoning_parser

CASES = [
    # (text, started, reasoning, content)
    ("<think>\nStep 1.\nStep 2.\n</think>\n\nThe answer is 4.", False,
     "Step 1.\nStep 2.", "The answer is 4."),
    ("The answer is 4.", False, None, "The answer is 4."),
    ("", False, None, None),
    ("  \n", False, None, None),
    ("<think>\nStill thinking when the tokens ran out", False,
     "Still thinking when the tokens ran out", None),
    ("<think></think>Direct.", False, None, "Direct."),
    ("<think>\n\n</think>\n\n", False, None, None),
    ("Preface\n<think>why</think>\nanswer\n", False, "why", "Prefaceanswer\n"),
    ("  lead <think>r</think>", False, "r", "  lead"),
    ("a</think>b", False, None, "a</think>b"),
    ("<think>r</think>a<think>b</think>c", False, "r", "a<think>b</think>c"),
    ("<thin", False, None, "<thin"),
    ("<think>r</thi", False, "r</thi", None),
    # The prompt opened the block (DeepSeek-R1, Qwen3 thinking templates).
    ("Let me see.\n</think>\n\n42", True, "Let me see.", "42"),
    ("Out of tokens", True, "Out of tokens", None),
    ("</think>42", True, None, "42"),
    ("<think>\nagain\n</think>42", True, "again", "42"),
    ("<thi", True, "<thi", None),
    ("", True, None, None),
]


@pytest.mark.parametrize("text,started,reasoning,content", CASES)
def test_split(text, started, reasoning, content):
    assert ReasoningParser(started=started).split(text) == (reasoning, content)


@pytest.mark.parametrize("text,started,reasoning,content", CASES)
def test_stream_by_character(text, started, reasoning, content):
    assert run_stream(ReasoningParser(started=started), list(text)) == (reasoning, content)


def run_stream(parser, pieces):
    reasoning = content = ""
    for piece in pieces:
        r, c = parser.add(piece)
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    reasoning, content = reasoning + r, content + c
    return reasoning or None, content or None


def split_text(text, cuts):
    bounds = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in zip([0] + bounds, bounds + [len(text)])]


PIECES = st.lists(st.sampled_from(["a", "b", " ", "\n", "<", ">", "/", "think", "<think>",
                                   "</think>", "<thi", "</th", "nk>"]), max_size=14).map("".join)


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(text=PIECES, started=st.booleans(),
       cuts=st.lists(st.integers(0, 60), max_size=10))
def test_stream_equals_split(text, started, cuts):
    parser = ReasoningParser(started=started)
    assert run_stream(parser, split_text(text, cuts)) == parser.split(text)
    # finish() leaves the parser ready for another stream.
    assert run_stream(parser, list(text)) == parser.split(text)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(text=st.lists(st.sampled_from(["x", " ", "\n", "[", "[[", "]]", "]", "[[r]]"]),
                     max_size=12).map("".join),
       cuts=st.lists(st.integers(0, 40), max_size=8))
def test_other_markers(text, cuts):
    parser = ReasoningParser("[[r]]", "[[/r]]")
    assert run_stream(parser, split_text(text, cuts)) == parser.split(text)


def test_stream_holds_back_only_partial_markers_and_whitespace():
    p = ReasoningParser()
    assert p.add("<th") == ("", "")
    assert p.add("ink>\nFirst") == ("First", "")
    assert p.add(" thought\n</th") == (" thought", "")
    assert p.add("ink>\n\nAns") == ("", "Ans")
    assert p.add("wer <b>") == ("", "wer <b>")
    assert p.finish() == ("", "")


def test_for_prompt():
    p = ReasoningParser()
    assert p.for_prompt("<|im_start|>assistant\n<think>\n").started
    assert not p.for_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n").started
    assert not p.for_prompt("<|im_start|>assistant\n").started
    assert p.for_prompt("x<think>a</think>y<think>\n").started
    fresh = p.for_prompt("<think>")
    assert fresh is not p and fresh.split("r</think>c") == ("r", "c")


def test_pick_reasoning_parser():
    qwen3 = "{%- if enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    assert isinstance(pick_reasoning_parser(qwen3), ReasoningParser)
    assert pick_reasoning_parser("{{ messages }}") is None
    assert pick_reasoning_parser(None) is None
    assert isinstance(pick_reasoning_parser(None, "deepseek_r1"), ReasoningParser)
    assert isinstance(pick_reasoning_parser(None, "qwen3"), ReasoningParser)
    assert pick_reasoning_parser(qwen3, "none") is None
    assert pick_reasoning_parser(qwen3) is not pick_reasoning_parser(qwen3)
    with pytest.raises(ValueError, match="deepseek_r1, qwen3, none"):
        pick_reasoning_parser(qwen3, "o1")
    with pytest.raises(ValueError):
        ReasoningParser("", "</think>")
