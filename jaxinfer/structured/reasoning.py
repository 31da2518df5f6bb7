"""Reasoning models' `<think>...</think>` block, split out of the answer as `reasoning_content`.

Models distilled from DeepSeek-R1, Qwen3 and the like write their chain of thought between
<think> and </think> before the answer. OpenAI-compatible servers (vLLM, DeepSeek's API) return
it apart from the answer, in the message's (or delta's) `reasoning_content`, so clients show the
answer alone. The split is on the decoded text, for whole outputs (`split`) and streams
(`add`/`finish`, which hold back only what may be part of a marker or whitespace next to one);
a stream's pieces always concatenate to what `split` gives for the whole text.

Rules: text before <think> is content; a missing </think> means everything after <think> is
reasoning (the model ran out of tokens while thinking); after </think> everything is content,
later markers included. When the prompt already opened the block (DeepSeek-R1's and Qwen3's
templates end the generation prompt with "<think>\\n"), the parser starts inside it
(`started=True`, or `for_prompt`). Whitespace next to a marker is dropped, and a part that is
empty or only whitespace is None.

The parser is off by default: `pick_reasoning_parser` turns it on for templates that mention
<think>, or when asked by name.
"""

from __future__ import annotations

from typing import Optional

PARSERS = ("deepseek_r1", "qwen3", "none")


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """Splits a reasoning block delimited by `start` and `end` from the answer.

    split(text) is stateless; add/finish keep the state of one stream, so use a parser per
    request (`for_prompt` makes one).
    """

    def __init__(self, start: str = "<think>", end: str = "</think>", started: bool = False):
        if not start or not end:
            raise ValueError("the reasoning markers must not be empty")
        self.start = start
        self.end = end
        self.started = started
        self._reset()

    def _reset(self) -> None:
        self._state = "reasoning" if self.started else "before"
        self._buf = ""
        self._held = ""          # whitespace not yet known to be kept
        self._begun = False      # the current part has had non-space text

    def for_prompt(self, prompt: str) -> "ReasoningParser":
        """A fresh parser for the output of `prompt`: started when the prompt leaves a block
        open (its last start marker after its last end marker)."""
        opened = prompt.rfind(self.start)
        return ReasoningParser(self.start, self.end,
                               started=opened >= 0 and prompt.rfind(self.end) < opened)

    # -------------------------------------------------------------- whole text

    def _strip_reasoning(self, text: str) -> str:
        # A start marker written again at the top of a block the prompt opened is not reasoning.
        while True:
            text = text.lstrip()
            if not text.startswith(self.start):
                return text.rstrip()
            text = text[len(self.start):]

    def split(self, text: str) -> tuple:
        """(reasoning, content) of a whole output; either is None when empty or only
        whitespace."""
        before = ""
        if not self.started:
            i = text.find(self.start)
            if i < 0:
                return None, (text if text.strip() else None)
            before, text = text[:i].rstrip(), text[i + len(self.start):]
        j = text.find(self.end)
        if j < 0:
            reasoning, after = text, ""
        else:
            reasoning, after = text[:j], text[j + len(self.end):].lstrip()
        reasoning = self._strip_reasoning(reasoning)
        content = before + after
        return (reasoning or None), (content if content.strip() else None)

    # -------------------------------------------------------------- streaming

    def add(self, delta: str) -> tuple:
        """(reasoning_delta, content_delta) for the next piece of output; "" where a part has
        nothing new."""
        self._buf += delta
        return self._run(final=False)

    def finish(self) -> tuple:
        """What the stream held back, as (reasoning_delta, content_delta); the parser is then
        ready for a new stream."""
        out = self._run(final=True)
        self._reset()
        return out

    def _emit(self, text: str, drop_leading: bool) -> str:
        """`text` of the current part with its trailing whitespace held; leading whitespace of
        the part dropped when `drop_leading`."""
        body = text.rstrip()
        if not body:
            self._held += text
            return ""
        head = self._held + body
        if not self._begun and drop_leading:
            head = head.lstrip()
        self._begun = True
        self._held = text[len(body):]
        return head

    def _run(self, final: bool) -> tuple:
        reasoning, content = [], []
        while True:
            buf = self._buf
            if self._state == "before":
                i = buf.find(self.start)
                if i >= 0:
                    content.append(self._emit(buf[:i], drop_leading=False))
                    self._buf = buf[i + len(self.start):]
                    self._state, self._held, self._begun = "reasoning", "", False
                    continue
                keep = 0 if final else partial_suffix(buf, self.start)
                content.append(self._emit(buf[:len(buf) - keep], drop_leading=False))
                self._buf = buf[len(buf) - keep:]
                if final:
                    content.append(self._held if self._begun else "")
                    self._buf = ""
                break
            if self._state == "reasoning":
                if not self._begun:
                    rest = buf.lstrip()
                    if rest.startswith(self.start):
                        self._buf = rest[len(self.start):]
                        continue
                    self._buf = buf = rest
                    if not rest or (not final and self.start.startswith(rest)):
                        break
                j = buf.find(self.end)
                if j >= 0:
                    reasoning.append(self._emit(buf[:j], drop_leading=True))
                    self._buf = buf[j + len(self.end):]
                    self._state, self._held, self._begun = "content", "", False
                    continue
                keep = 0 if final else partial_suffix(buf, self.end)
                reasoning.append(self._emit(buf[:len(buf) - keep], drop_leading=True))
                self._buf = buf[len(buf) - keep:]
                if final:
                    self._buf = ""  # trailing whitespace of an unfinished block is dropped
                break
            # content: after the block, everything is the answer
            content.append(self._emit(buf, drop_leading=True))
            self._buf = ""
            if final:
                content.append(self._held if self._begun else "")
            break
        return "".join(reasoning), "".join(content)


def pick_reasoning_parser(chat_template: Optional[str],
                          override: Optional[str] = None) -> Optional[ReasoningParser]:
    """The reasoning parser for a model, or None for no split: by name when `override` is given
    ("deepseek_r1" and "qwen3" split <think>...</think>, "none" turns it off), else a <think>
    parser when the chat template mentions <think>. A new parser each call."""
    if override is not None:
        if override not in PARSERS:
            raise ValueError(f"unknown reasoning parser {override!r}; expected one of "
                             f"{', '.join(PARSERS)}")
        return None if override == "none" else ReasoningParser()
    if chat_template and "<think>" in chat_template:
        return ReasoningParser()
    return None
