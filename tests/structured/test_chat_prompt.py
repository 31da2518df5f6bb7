"""The chat prompt with tools (openai_api.chat_prompt) and each model's chat formats
(openai_api.ChatFormats), on SmolLM2's tokenizer with its own template and with templates of
the other shapes: one that renders `tools` itself (as Qwen's and Llama 3.1's do), one that
mentions <think>, one of Llama 3's with <|python_tag|>."""

from __future__ import annotations

import gzip
import json
import os

import pytest

from jaxinfer import openai_api as oa

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "smollm2_tokenizer")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
# Renders `tools` and earlier calls itself, as Qwen2.5's and Qwen3's templates do.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "</tools><|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>"
    "{%- endfor %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")


def _tokenizer(template=None, added=()):
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HF

    from jaxinfer.loading.tokenizer import Tokenizer

    backend = HF.from_str(gzip.open(os.path.join(DATA, "tokenizer.json.gz")).read().decode())
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    if template is None:
        with open(os.path.join(DATA, "chat_template.jinja")) as f:
            template = f.read()
    return Tokenizer(backend, bos_token_id=1, eos_token_ids=[2], add_bos=False,
                     chat_template=template)


def _request(body):
    return oa.parse_request(oa.CHAT, dict({"messages": [{"role": "user", "content": "Hi?"}]},
                                          **body))


def test_a_template_without_tools_gets_the_default_system_prompt():
    tok = _tokenizer()
    formats = oa.ChatFormats.for_tokenizer(tok)
    assert formats == oa.ChatFormats("hermes", (), None)
    prompt = oa.chat_prompt(tok, _request({"tools": TOOLS}), formats)
    assert prompt.startswith("<|im_start|>system\n# Tools")
    assert '"name": "get_weather"' in prompt and "<tool_call>" in prompt
    assert "SmolLM" not in prompt  # the template's own default system turn is replaced
    # tool_choice none: the tools are not offered.
    plain = oa.chat_prompt(tok, _request({"tools": TOOLS, "tool_choice": "none"}), formats)
    assert "get_weather" not in plain and plain == oa.chat_prompt(tok, _request({}), formats)


def test_a_template_that_takes_tools_renders_them_itself():
    tok = _tokenizer(TOOLS_TEMPLATE)
    formats = oa.ChatFormats.for_tokenizer(tok)
    history = {"messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}], "tools": TOOLS}
    prompt = oa.chat_prompt(tok, oa.parse_request(oa.CHAT, history), formats)
    assert prompt.startswith("<|im_start|>system\n<tools>{")
    assert json.loads(prompt.split("<tools>")[1].split("</tools>")[0]) == TOOLS[0]
    # The earlier call reaches the template with its arguments parsed, as HF passes them.
    call = prompt.split("<tool_call>")[1].split("</tool_call>")[0]
    assert json.loads(call) == {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert "-3 C" in prompt and "# Tools" not in prompt


@pytest.mark.parametrize("template, tool_format, reasoning", [
    ("{{ '<think>' }}{% for m in messages %}{{ m.content }}{% endfor %}", "hermes", "think"),
    ("<|start_header_id|>ipython<|end_header_id|>{{ '<|python_tag|>' }}", "llama3_json", None),
])
def test_formats_follow_the_template(template, tool_format, reasoning):
    formats = oa.ChatFormats.for_tokenizer(_tokenizer(template))
    assert (formats.tool_format, formats.reasoning) == (tool_format, reasoning)


def test_overrides_and_single_token_markers():
    tok = _tokenizer(added=("<tool_call>", "</tool_call>"))
    formats = oa.ChatFormats.for_tokenizer(tok, "hermes", "qwen3")
    assert formats.special_markers == ("<tool_call>", "</tool_call>")
    assert formats.reasoning == "qwen3"
    assert oa.ChatFormats.for_tokenizer(tok, reasoning="none").reasoning is None
    with pytest.raises(ValueError, match="hermes"):
        oa.ChatFormats.check("xml", None)
    with pytest.raises(ValueError, match="reasoning"):
        oa.ChatFormats.check(None, "o1")
