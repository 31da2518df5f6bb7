"""SentencePiece-style tokenizers from GGUF metadata (`tokenizer.ggml.model` "llama"): Gemma.

Such a file carries the vocabulary but no merges, so the tokenizer is rebuilt as a `tokenizers`
BPE model with byte fallback whose merges are every split of a token into two vocabulary
tokens, ranked by the token (for Gemma by its index, which follows its merge order where its
scores do not; otherwise by score). Spaces are written "▁" before the merges. This is the
tokenizer HF transformers builds from the same file (tests/data/gemma3_greedy.json).
"""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers

SPACE = "\u2581"


def merges_from_vocab(tokens: list[str], priority: list[float]) -> list[tuple[str, str]]:
    """Merges (left, right) for every split of a token into two vocabulary tokens, best first:
    by the token's priority, then longer left piece, longer right piece, the token's index."""
    ids = {t: i for i, t in enumerate(tokens)}
    rank, left_len, right_len, which, pairs = [], [], [], [], []
    for index, token in enumerate(tokens):
        for j in range(1, len(token)):
            left, right = token[:j], token[j:]
            if left in ids and right in ids:
                rank.append(priority[index])
                left_len.append(j)
                right_len.append(len(token) - j)
                which.append(index)
                pairs.append((left, right))
    # np.lexsort sorts by its last key first.
    order = np.lexsort((np.asarray(which), -np.asarray(right_len), -np.asarray(left_len),
                        -np.asarray(rank, np.float64)))
    return [pairs[i] for i in order]


def spm_backend(meta: dict) -> tuple[_HFTokenizer, list[str]]:
    """The `tokenizers` backend of a "llama" GGUF vocabulary and its (respelled) tokens."""
    tokens = list(meta["tokenizer.ggml.tokens"])
    gemma = str(meta.get("general.architecture", "")).startswith("gemma")
    if gemma:
        # Tokens of two or more spaces are stored as spaces; the merges need them as "▁▁".
        tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        priority = [-float(i) for i in range(len(tokens))]
    else:
        priority = [float(s) for s in meta.get("tokenizer.ggml.scores", [0.0] * len(tokens))]
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else None
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab, merges_from_vocab(tokens, priority), unk_token=unk, fuse_unk=True,
                     byte_fallback=True)
    backend = _HFTokenizer(bpe)
    replace = normalizers.Replace(" ", SPACE)
    # llama.cpp's default for SentencePiece vocabularies is a prefix space; Gemma's files say no.
    if meta.get("tokenizer.ggml.add_space_prefix", not gemma):
        replace = normalizers.Sequence([normalizers.Prepend(SPACE), replace])
    backend.normalizer = replace
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
    return backend, tokens


# Gemma's turn format for Gemma files without a chat template (the base models); no <bos>, as
# encoding adds it.
GEMMA_CHAT_TEMPLATE = (
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set first = messages[0]['content'] | trim + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set first = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\n'"
    " + (first if loop.first else '') + m['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


def default_chat_template(meta: dict):
    """The chat template of a file without one: Gemma's turn format for Gemma files."""
    if str(meta.get("general.architecture", "")).startswith("gemma"):
        return GEMMA_CHAT_TEMPLATE
    return None
