"""Text <-> token ids, chat templates and streaming detokenization. A GGUF tokenizer is rebuilt
from its metadata with the `tokenizers` library to encode as llama.cpp and the original HF
tokenizer do; an HF directory's tokenizer.json is read directly.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), by the `tokenizer.ggml.pre` value.
# GPT-2's word regex is what ByteLevel(use_regex=True) applies by itself.
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

_PRE_GPT2 = ("default", "gpt2", "mpt", "olmo", "jais", "trillion")
# llama.cpp first isolates every \p{N} code point, then applies the GPT-2 regex to the rest.
_PRE_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                         "minerva")
_PRE_LLAMA3 = ("llama-bpe", "llama3", "dbrx", "smaug-bpe")
_PRE_QWEN2 = ("qwen2", "stablelm2")
SUPPORTED_PRE = _PRE_GPT2 + _PRE_DIGITS_THEN_GPT2 + _PRE_LLAMA3 + _PRE_QWEN2

# Token texts that llama.cpp treats as end of generation whatever the metadata says.
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<|return|>", "<|call|>",
})

_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 3, 4


def _byte_level_pre_tokenizer(pre: str):
    if pre in _PRE_GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _PRE_DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre in _PRE_LLAMA3 or pre in _PRE_QWEN2:
        regex = _LLAMA3_REGEX if pre in _PRE_LLAMA3 else _QWEN2_REGEX
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    raise ValueError(f"unsupported tokenizer.ggml.pre {pre!r}; supported: {SUPPORTED_PRE}")


def _byte_level_respell(tokens: list[str], types: list[int]) -> list[str]:
    """Normal tokens stored in raw text re-spelled in GPT-2's byte alphabet, as their merges
    spell them."""
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    byte_to_char = None
    out = list(tokens)
    for i, (tok, kind) in enumerate(zip(tokens, types)):
        if kind == _TOKEN_NORMAL and not set(tok) <= alphabet:
            if byte_to_char is None:
                byte_to_char = _gpt2_byte_to_char()
            out[i] = "".join(byte_to_char[b] for b in tok.encode("utf-8"))
    return out


def _gpt2_byte_to_char() -> dict[int, str]:
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1))
                 + list(range(0xAE, 0xFF + 1)))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json spells special tokens either as a string or as an AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


class Tokenizer:
    """A byte-level BPE tokenizer plus the model's special tokens and chat template."""

    def __init__(self, backend: _HFTokenizer, *, bos_token_id: int | None,
                 eos_token_ids: Sequence[int], add_bos: bool, add_eos: bool = False,
                 chat_template: str | None = None, special_ids: frozenset[int] = frozenset()):
        self._tok = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        self.eos_token_id: int | None = self.eos_token_ids[0] if self.eos_token_ids else None
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.chat_template = chat_template
        self.special_ids = frozenset(special_ids)
        self._compiled_template = None

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> Tokenizer:
        kind = meta.get("tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise ValueError(f"unsupported tokenizer.ggml.model {kind!r}; supported: 'gpt2' "
                             "(byte-level BPE), 'llama' (SentencePiece-style BPE)")
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        types = list(meta.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens))
        template = meta.get("tokenizer.chat_template")
        if kind == "llama":  # jaxinfer.loading.spm
            from jaxinfer.loading.spm import default_chat_template, spm_backend
            backend, tokens = spm_backend(meta)
            template = template or default_chat_template(meta)
        else:
            pre = meta.get("tokenizer.ggml.pre", "default")
            tokens = _byte_level_respell(tokens, types)
            # Merges are "left right"; byte-level pieces never contain a literal space.
            merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
            vocab = {tok: i for i, tok in enumerate(tokens)}
            bpe = models.BPE(vocab, merges, ignore_merges=pre in _PRE_LLAMA3)
            backend = _HFTokenizer(bpe)
            backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
            backend.decoder = decoders.ByteLevel()

        # Control tokens are matched in text and dropped by skip_special_tokens; user-defined
        # ones are matched too but, as in llama.cpp, always rendered when decoding.
        control = [i for i, t in enumerate(types) if t == _TOKEN_CONTROL]
        user = [i for i, t in enumerate(types) if t == _TOKEN_USER_DEFINED]
        backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                    for i in control])
        backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])
        _check_ids(backend, tokens, control + user)

        def opt_id(key):
            v = meta.get(f"tokenizer.ggml.{key}")
            return int(v) if v is not None and 0 <= int(v) < len(tokens) else None

        eos = opt_id("eos_token_id")
        eog = [i for i in (eos, opt_id("eot_token_id"), opt_id("eom_token_id")) if i is not None]
        eog += [i for i in control + user if tokens[i] in _EOG_TEXTS]
        return cls(backend, bos_token_id=opt_id("bos_token_id"), eos_token_ids=eog,
                   add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                   add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
                   chat_template=template, special_ids=frozenset(control))

    @classmethod
    def from_hf_dir(cls, path: str) -> Tokenizer:
        backend = _HFTokenizer.from_file(os.path.join(path, "tokenizer.json"))
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        gen = _read_json(os.path.join(path, "generation_config.json"))

        def token_id(value):
            text = _token_content(value)
            return backend.token_to_id(text) if text else None

        bos = token_id(config.get("bos_token"))
        eog = [token_id(config.get("eos_token"))]
        gen_eos = gen.get("eos_token_id")
        eog += gen_eos if isinstance(gen_eos, list) else [gen_eos]
        eog = [int(i) for i in eog if i is not None]

        if "add_bos_token" in config:
            add_bos = bool(config["add_bos_token"])
        else:
            # No explicit flag: the tokenizer.json post-processor decides (Llama-3 adds BOS).
            probe = backend.encode("", add_special_tokens=True).ids
            add_bos = bos is not None and probe[:1] == [bos]

        template = config.get("chat_template")
        if isinstance(template, list):  # named templates; "default" is the chat one
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_path = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.exists(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()

        special = frozenset(i for i, tok in backend.get_added_tokens_decoder().items()
                            if tok.special)
        return cls(backend, bos_token_id=bos, eos_token_ids=eog, add_bos=add_bos,
                   add_eos=bool(config.get("add_eos_token", False)), chat_template=template,
                   special_ids=special)

    # -- encoding / decoding --------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        if self.add_eos and self.eos_token_id is not None:
            ids = ids + [self.eos_token_id]
        return ids

    @functools.cached_property
    def max_chars_per_token(self) -> int | None:
        """The most characters of input text one token can stand for (its spelling's length),
        or None where a normalizer may shorten the text first."""
        if self._tok.normalizer is not None:
            return None
        return max(len(t) for t in self._tok.get_vocab(with_added_tokens=True))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def is_added_token(self, text: str) -> bool:
        """Whether `text` is one added token of the vocabulary (special or not)."""
        return any(t.content == text for t in self._tok.get_added_tokens_decoder().values())

    def backend_json(self) -> str:
        """The `tokenizers` tokenizer as its JSON (what llguidance builds its view from)."""
        return self._tok.to_str()

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    def _text_of(self, token_id: int | None) -> str:
        return "" if token_id is None else (self._tok.id_to_token(token_id) or "")

    # -- chat -----------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; pass a raw prompt instead")
        if self._compiled_template is None:
            self._compiled_template = _compile_template(self.chat_template)
        variables = {
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self._text_of(self.bos_token_id),
            "eos_token": self._text_of(self.eos_token_id),
            # Templates test `tools`/`documents` for truthiness; HF always defines them.
            "tools": None,
            "documents": None,
        }
        variables.update(kwargs)
        return self._compiled_template.render(**variables)


def _check_ids(backend: _HFTokenizer, tokens: list[str], ids: list[int]) -> None:
    # Adding a token whose text is already in the vocabulary reuses that id; a duplicate text
    # elsewhere in the vocabulary would silently give a different one.
    for i in ids:
        got = backend.token_to_id(tokens[i])
        if got != i:
            raise ValueError(
                f"special token {tokens[i]!r} has id {i} in the file but maps to {got}")


def _compile_template(source: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # HF's filter: unlike jinja's built-in it does not HTML-escape and keeps non-ASCII text.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


class IncrementalDetokenizer:
    """Token ids -> text deltas that never split a UTF-8 character (`DecodeStream`), plus
    `flush`: all deltas and flush() equal `tokenizer.decode(ids)`."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._stream = decoders.DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._emitted = 0  # characters of text given out so far

    def add(self, ids: int | Sequence[int]) -> str:
        ids = [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]
        self._ids.extend(ids)
        text = self._stream.step(self._tokenizer._tok, ids) if ids else None
        if text is None:
            return ""
        self._emitted += len(text)
        return text

    def flush(self) -> str:
        """Whatever is still held back (an incomplete last character as U+FFFD)."""
        text = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip)
        tail = text[self._emitted:]
        self._emitted = len(text)
        return tail
