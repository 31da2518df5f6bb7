"""How a model's chat turns are written and read, beside the OpenAI protocol (openai_api): its
tool-call format and reasoning parser (ChatFormats), the prompt with tools through its chat
template (chat_prompt), and its answer read into content, reasoning_content and tool_calls,
whole (assistant_message) or streamed (ChatStream). `req` is an openai_api.ParsedRequest.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from jaxinfer.structured import tool_calls
from jaxinfer.structured.reasoning import ReasoningParser, pick_reasoning_parser


@dataclasses.dataclass(frozen=True)
class ChatFormats:
    """How a model's chat turns are written and read: its tool-call format (tool_calls.FORMATS,
    the model's own where its template shows it, else hermes), the tool-call markers that are
    single tokens of its vocabulary, and whether it thinks in <think>...</think> (templates
    that mention it; then the thinking goes to reasoning_content)."""

    tool_format: str = tool_calls.DEFAULT_FORMAT
    special_markers: tuple = ()
    reasoning: Optional[str] = None  # a reasoning parser's name, None: none

    @classmethod
    def for_tokenizer(cls, tokenizer, tool_format: Optional[str] = None,
                      reasoning: Optional[str] = None) -> "ChatFormats":
        template = getattr(tokenizer, "chat_template", None)
        fmt = tool_calls.pick_format(template, tool_format)
        markers = tuple(m for m in tool_calls.grammar_markers(fmt)
                        if tokenizer is not None and tokenizer.is_added_token(m))
        parser = pick_reasoning_parser(template, reasoning)
        return cls(tool_format=fmt, special_markers=markers,
                   reasoning=None if parser is None else (reasoning or "think"))

    @staticmethod
    def check(tool_format: Optional[str], reasoning: Optional[str]) -> None:
        """ValueError for a tool-call format or reasoning parser name that is not known."""
        tool_calls.pick_format(None, tool_format)
        pick_reasoning_parser(None, reasoning)

    def reasoning_parser(self, prompt: Optional[str]) -> Optional[ReasoningParser]:
        """A fresh parser for one sequence (started when the prompt leaves <think> open)."""
        if self.reasoning is None:
            return None
        return ReasoningParser().for_prompt(prompt or "")


def _with_system(messages: list, text: str) -> list:
    """messages with `text` leading the system message (one is added when there is none)."""
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=text + "\n\n" + messages[0]["content"])
        return [first] + messages[1:]
    return [{"role": "system", "content": text}] + messages


def chat_prompt(tokenizer, req, formats: ChatFormats) -> str:
    """The chat request's prompt: its messages through the model's template, with the tools
    (the template's own way when it takes `tools`, else a system prompt stating the format),
    earlier calls and tool results as the template can render them."""
    template = tokenizer.chat_template
    takes = tool_calls.template_takes_tools(template)
    messages, kwargs = req.messages, {}
    if any("tool_calls" in m or m["role"] == "tool" for m in messages):
        messages = tool_calls.tool_messages_for_template(messages, takes, formats.tool_format)
    if req.tools is not None:
        if takes:
            kwargs["tools"] = [{"type": "function", "function": t} for t in req.tools.tools]
        else:
            messages = _with_system(messages, tool_calls.default_tools_system_prompt(
                req.tools.tools, formats.tool_format))
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)


def assistant_message(req, formats: ChatFormats, prompt: Optional[str],
                      text: str, finish_reason: Optional[str]) -> tuple[dict, Optional[str]]:
    """A chat answer's message and finish_reason: its thinking split into reasoning_content,
    its tool calls (when tools were offered) parsed into tool_calls, finish_reason
    "tool_calls" when it made some."""
    message = {"role": "assistant"}
    parser = formats.reasoning_parser(prompt)
    if parser is not None:
        reasoning, text = parser.split(text)
        message["reasoning_content"] = reasoning
        text = text or ""
    content, calls = (text, []) if req.tools is None else \
        tool_calls.parse_tool_calls(text, formats.tool_format)
    message["content"] = content
    if calls:
        message["tool_calls"] = calls
        if finish_reason == "stop":
            finish_reason = "tool_calls"
    return message, finish_reason


class ChatStream:
    """assistant_message for a stream: each text delta of a chat answer as chunk deltas
    ({"content"}, {"reasoning_content"}, {"tool_calls": [...]}, as OpenAI and vLLM stream
    them); the deltas add up to the whole answer's message."""

    def __init__(self, req, formats: ChatFormats, prompt: Optional[str]):
        self.reasoning = formats.reasoning_parser(prompt)
        self.calls = None if req.tools is None else tool_calls.ToolCallStream(
            formats.tool_format)

    @staticmethod
    def wanted(req, formats: ChatFormats) -> bool:
        return req.messages is not None and (req.tools is not None
                                             or formats.reasoning is not None)

    def add(self, text: str, final: bool = False) -> list[dict]:
        reasoning, content = ("", text) if self.reasoning is None else self.reasoning.add(text)
        if final and self.reasoning is not None:
            more = self.reasoning.finish()
            reasoning, content = reasoning + more[0], content + more[1]
        deltas = [{"reasoning_content": reasoning}] if reasoning else []
        if self.calls is None:
            deltas += [{"content": content}] if content else []
        else:
            deltas += self.calls.add(content) if content else []
            deltas += self.calls.finish() if final else []
        return deltas

    def finish_reason(self, reason: Optional[str]) -> Optional[str]:
        made_calls = self.calls is not None and self.calls.calls > 0
        return "tool_calls" if made_calls and reason == "stop" else reason
