"""Generate golden reference data for jaxinfer tests from an independent implementation.

Reference: Hugging Face transformers + PyTorch, CPU, float32, eager attention.
This script is NOT imported by the test-suite; it needs torch/transformers, which are not
project dependencies. See tests/data/README.md for the exact environment and invocation.

    python make_goldens.py --gguf /path/to/SmolLM2-135M-Instruct.Q4_1.gguf --out tests/data

Outputs (under --out):
    smollm2_greedy.json                 prompts, prompt ids, greedy continuations, last-position logits summary
    smollm2_tokenizer.json              tokenizer ids for many texts + chat-template renderings
    smollm2_tokenizer/tokenizer.json.gz the HF tokenizer built from the GGUF, saved with save_pretrained
    smollm2_tokenizer/tokenizer_config.json (+ chat_template.jinja if written)
    tiny_models/<name>/                 tiny random HF checkpoints + golden.npz
    checks.json                         results of the consistency checks run while generating

The bf16-weight goldens of jaxinfer's CPU default (smollm2_bf16_greedy.json) come from the
sibling make_bf16_goldens.py, run after this script (it reads smollm2_greedy.json's prompts):

    python make_bf16_goldens.py --gguf /path/to/SmolLM2-135M-Instruct.Q4_1.gguf --out tests/data
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import shutil
import tempfile

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, pre_tokenizers

SEED = 1234
MAX_NEW_TOKENS = 24
EOS_ID = 2


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=1)
        f.write("\n")


# --------------------------------------------------------------------------------------------
# SmolLM2 tokenizer
# --------------------------------------------------------------------------------------------

LONG_PARAGRAPH = (
    "The printing press, developed by Johannes Gutenberg around 1440, transformed the way "
    "information spread across Europe. Before its invention, books were copied by hand, a slow "
    "and expensive process that kept literacy confined to a small elite. With movable metal type, "
    "a single workshop could produce hundreds of identical pages in a day. Within fifty years, "
    "presses had been established in more than two hundred cities, and millions of volumes were "
    "in circulation. Scholars could compare texts, scientists could share observations, and "
    "reformers could reach audiences far beyond their own towns. Historians often describe this "
    "shift as one of the most important turning points of the modern era, because it made "
    "knowledge cheaper, faster to distribute, and harder to suppress."
)

TOKENIZER_TEXTS = [
    "",
    " ",
    "Hello",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "café naïve façade résumé",
    "日本語のテキスト",
    "中文分词测试，包括标点。",
    "한국어 문장입니다",
    "👩‍💻🎉",
    "I ❤️ emoji 😀👍🏽 and flags 🇫🇷",
    "مرحبا بالعالم",
    "Привет, мир! Как дела?",
    "Ελληνικά γράμματα",
    "def add(a, b):\n    return a + b\n",
    "class Foo:\n    def __init__(self):\n        self.x = {\"k\": [1, 2, 3]}\n",
    "if (x) {\n\treturn y;\n}",
    '{"name": "SmolLM2", "params": 135000000, "tags": ["small", "llm"], "ok": true}',
    "a  b   c",
    "\n\n\n",
    "   leading",
    "trailing   ",
    "\t\tx",
    "line1\r\nline2\r\n",
    "mixed \t \n  whitespace\n\n  end",
    "12345",
    "3.14159",
    "1,000,000",
    "2024-01-01",
    "x = 12 + 345 * 6789",
    "data = [\n    1,\n    22,\n    333,\n]",
    "\t7\n 8",
    "  1  22   333",
    "١٢٣ ٤٥",
    "don't I'm we'll they're it's",
    "DON'T I'M WE'LL",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text before<|endoftext|>text after",
    "<|im_start|><|im_end|><|im_start|>",
    "<filename>main.py<file_sep>",
    "https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct?x=1&y=2",
    "user@example.com",
    "~!@#$%^&*()_+-=[]{}|;':\",./<>?",
    "Ünïcödé ÀÉÎÕÜ ßæøå",
    LONG_PARAGRAPH,
]

CHAT_CASES = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"}], "add_generation_prompt": True},
    {
        "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Name three primary colors."},
        ],
        "add_generation_prompt": True,
    },
    {
        "messages": [
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello! How can I help you today?"},
            {"role": "user", "content": "Tell me a joke about cats."},
        ],
        "add_generation_prompt": True,
    },
    {
        "messages": [
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "Good morning"},
            {"role": "assistant", "content": "Bonjour"},
        ],
        "add_generation_prompt": False,
    },
    {
        "messages": [{"role": "user", "content": "Écris « café » en 日本語 🎉\nwith two lines"}],
        "add_generation_prompt": True,
    },
]


def digits_variant(backend: Tokenizer) -> Tokenizer:
    """Same vocab/merges, but the pre-tokenizer of the original SmolLM2 tokenizer.json
    (Digits(individual_digits=True) then ByteLevel), which is also what llama.cpp does for
    tokenizer.ggml.pre == "smollm" (a "\\p{N}" split before the GPT-2 regex)."""
    alt = Tokenizer.from_str(backend.to_str())
    alt.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    return alt


def encode(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def make_tokenizer_goldens(tok, out_dir: str, checks: dict) -> Tokenizer:
    backend = tok.backend_tokenizer
    alt = digits_variant(backend)
    checks["tokenizer_class"] = type(tok).__name__
    checks["pre_tokenizer"] = str(backend.pre_tokenizer)
    checks["normalizer"] = str(backend.normalizer)
    checks["decoder"] = str(backend.decoder)
    checks["post_processor"] = str(backend.post_processor)
    checks["bos"] = [tok.bos_token, tok.bos_token_id]
    checks["eos"] = [tok.eos_token, tok.eos_token_id]
    checks["add_bos_token"] = getattr(tok, "add_bos_token", None)
    checks["len_tokenizer"] = len(tok)
    checks["ids_with_add_special_tokens_true_equal"] = all(
        list(tok(t)["input_ids"]) == encode(tok, t) for t in TOKENIZER_TEXTS
    )

    cases = []
    differing = []
    for text in TOKENIZER_TEXTS:
        ids = encode(tok, text)
        alt_ids = alt.encode(text, add_special_tokens=False).ids
        case = {"text": text, "ids": ids}
        if alt_ids != ids:
            case["ids_digits_pretokenizer"] = alt_ids
            differing.append(text)
        # decode round trip (informational)
        case["decode_roundtrip"] = tok.decode(ids, skip_special_tokens=False) == text
        cases.append(case)
    checks["texts_where_digits_pretokenizer_differs"] = differing

    chats = []
    for c in CHAT_CASES:
        rendered = tok.apply_chat_template(
            c["messages"], tokenize=False, add_generation_prompt=c["add_generation_prompt"]
        )
        ids = encode(tok, rendered)
        via_template = tok.apply_chat_template(
            c["messages"], tokenize=True, add_generation_prompt=c["add_generation_prompt"]
        )
        if not isinstance(via_template, list):  # BatchEncoding in newer versions
            via_template = list(via_template["input_ids"])
        assert via_template == ids, (via_template, ids)
        chats.append(
            {
                "messages": c["messages"],
                "add_generation_prompt": c["add_generation_prompt"],
                "rendered": rendered,
                "ids": ids,
            }
        )

    write_json(
        os.path.join(out_dir, "smollm2_tokenizer.json"),
        {
            "transformers_version": transformers.__version__,
            "pre_tokenizer": str(backend.pre_tokenizer),
            "note": "ids: HF tokenizer built from the GGUF, add_special_tokens=False. "
            "ids_digits_pretokenizer (only when different): same vocab/merges with the "
            "Digits(individual_digits=True)+ByteLevel pre-tokenizer of the original "
            "SmolLM2 tokenizer.json.",
            "cases": cases,
            "chat": chats,
        },
    )

    # Save the tokenizer (tokenizer.json gzipped, tokenizer_config.json as is).
    tdir = os.path.join(out_dir, "smollm2_tokenizer")
    os.makedirs(tdir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        checks["tokenizer_saved_files"] = sorted(os.listdir(tmp))
        with open(os.path.join(tmp, "tokenizer.json"), "rb") as src:
            data = src.read()
        # mtime=0 and no filename -> byte-identical output across runs
        with open(os.path.join(tdir, "tokenizer.json.gz"), "wb") as raw:
            with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as gz:
                gz.write(data)
        for name in ("tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
            p = os.path.join(tmp, name)
            if os.path.exists(p):
                shutil.copy(p, os.path.join(tdir, name))
        reloaded = Tokenizer.from_file(os.path.join(tmp, "tokenizer.json"))
    checks["saved_tokenizer_json_pre_tokenizer"] = str(reloaded.pre_tokenizer)
    checks["saved_tokenizer_json_reproduces_ids"] = all(
        reloaded.encode(c["text"], add_special_tokens=False).ids == c["ids"] for c in cases
    ) and all(reloaded.encode(c["rendered"], add_special_tokens=False).ids == c["ids"] for c in chats)
    return alt


# --------------------------------------------------------------------------------------------
# SmolLM2 greedy generation
# --------------------------------------------------------------------------------------------

GREEDY_PROMPTS = [
    ("plain", "The capital of France is"),
    ("story", "Once upon a time, in a small village nestled between two mountains, there lived"),
    ("code", "def fibonacci(n):\n"),
    ("code_class", "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"),
    ("chat", [{"role": "user", "content": "What is the tallest mountain in the world?"}]),
    ("chat_short", [
        {"role": "system", "content": "Reply with a single word."},
        {"role": "user", "content": "What color is the sky on a clear day?"},
    ]),
    ("chat_eos_hi", [{"role": "user", "content": "Hi"}]),
    ("chat_eos_math", [{"role": "user", "content": "What is 2+2?"}]),
    # Copies its input: n-gram speculation drafts the text and the end-of-turn token after it.
    ("chat_repeat", [{"role": "user", "content": "Repeat exactly: The cat sat on the mat."}]),
    ("unicode", "Café, naïve façade — 日本語のテキスト 🎉👩‍💻 means"),
    ("arithmetic", "1 + 1 = 2\n2 + 3 = 5\n7 + 8 ="),
    ("list", "Shopping list:\n- apples\n- bread\n- milk\n-"),
    ("long", LONG_PARAGRAPH + " In summary,"),
    ("one_token", "Hello"),
    ("whitespace", "Line one.\n\n\n    Line two   after     many   spaces.\n\n\n"),
]


def make_greedy_goldens(model, tok, alt: Tokenizer, gguf: str, out_dir: str, checks: dict) -> None:
    cases = []
    teacher_forced_ok = []
    for name, prompt in GREEDY_PROMPTS:
        case = {"name": name}
        if isinstance(prompt, list):
            case["messages"] = prompt
            prompt = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        ids = encode(tok, prompt)
        if name == "one_token":
            assert len(ids) == 1, ids
        x = torch.tensor([ids], dtype=torch.long)
        mask = torch.ones_like(x)  # explicit: pad id == eos id == 2 appears inside chat prompts
        with torch.no_grad():
            logits = model(input_ids=x, attention_mask=mask).logits[0, -1].double()
            out = model.generate(
                input_ids=x,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=MAX_NEW_TOKENS,
                eos_token_id=EOS_ID,
                pad_token_id=EOS_ID,
                return_dict_in_generate=True,
                output_logits=True,
            )
        new = out.sequences[0, len(ids):].tolist()
        # Per-step top1 - top2 logit margin (how close greedy was to a tie).
        margins = []
        for step_logits in out.logits:
            top2 = torch.topk(step_logits[0].double(), 2).values
            margins.append(float(top2[0] - top2[1]))
        # Independent check: one full (no KV cache) forward over prompt+generated; argmax at each
        # position must reproduce the next generated token.
        full = torch.tensor([ids + new], dtype=torch.long)
        with torch.no_grad():
            fl = model(input_ids=full, attention_mask=torch.ones_like(full)).logits[0]
        am = fl[len(ids) - 1 : len(ids) - 1 + len(new)].argmax(-1).tolist()
        teacher_forced_ok.append(am == new)
        top = torch.topk(logits, 10)
        case.update(
            {
                "prompt": prompt,
                "prompt_ids": ids,
                "prompt_ids_equal_with_digits_pretokenizer": alt.encode(prompt, add_special_tokens=False).ids == ids,
                "greedy_ids": new,
                "greedy_text": tok.decode(new, skip_special_tokens=False),
                "hit_eos": EOS_ID in new,
                "greedy_step_margins": [round(m, 5) for m in margins],
                "last_logits_top10": {
                    "ids": top.indices.tolist(),
                    "values": [float(v) for v in top.values.float()],
                },
                "last_logits_logsumexp": float(torch.logsumexp(logits, -1)),
            }
        )
        cases.append(case)
        print(f"[greedy] {name}: {len(ids)} prompt ids, {len(new)} new, eos={EOS_ID in new}, "
              f"min margin={min(margins):.4f}", flush=True)
    checks["greedy_teacher_forced_argmax_matches_generate"] = dict(
        zip([n for n, _ in GREEDY_PROMPTS], teacher_forced_ok)
    )
    write_json(
        os.path.join(out_dir, "smollm2_greedy.json"),
        {
            "model_file": os.path.basename(gguf),
            "model_sha256": sha256_of(gguf),
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "dtype": "float32",
            "attn_implementation": "eager",
            "max_new_tokens": MAX_NEW_TOKENS,
            "eos_token_id": EOS_ID,
            "note": "prompt_ids carry no BOS (GGUF add_bos_token=false). greedy_ids are the new "
            "tokens only; generation stops at (and includes) eos 2. last_logits_* are over the "
            "full-vocab logits at the last prompt position (plain forward, no sampling processors).",
            "cases": cases,
        },
    )


def check_dequant(model, gguf: str, checks: dict) -> None:
    """Compare HF's dequantized weights with gguf-py's dequantization for a few tensors."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(gguf)
    tensors = {t.name: t for t in reader.tensors}
    sd = model.state_dict()
    cfg = model.config
    res = {}

    def deq(name):
        t = tensors[name]
        arr = dequantize(t.data, t.tensor_type)
        return np.asarray(arr, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)]), t.tensor_type.name

    def unpermute(w, n_head):  # inverse of llama.cpp convert's q/k permutation
        return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    pairs = [
        ("token_embd.weight", "model.embed_tokens.weight", None),
        ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", None),
        ("blk.7.ffn_gate.weight", "model.layers.7.mlp.gate_proj.weight", None),
        ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight", None),
        ("blk.3.attn_q.weight", "model.layers.3.self_attn.q_proj.weight", cfg.num_attention_heads),
        ("blk.3.attn_k.weight", "model.layers.3.self_attn.k_proj.weight", cfg.num_key_value_heads),
        ("blk.29.attn_v.weight", "model.layers.29.self_attn.v_proj.weight", None),
    ]
    for g, h, nh in pairs:
        w, qt = deq(g)
        if nh is not None:
            w = unpermute(w, nh)
        hw = sd[h].float().numpy()
        res[g] = {"type": qt, "max_abs_diff": float(np.abs(w - hw).max()) if w.shape == hw.shape else f"shape {w.shape} vs {hw.shape}"}
    checks["dequant_vs_gguf_py"] = res
    checks["gguf_tensor_types"] = sorted({t.tensor_type.name for t in reader.tensors})


# --------------------------------------------------------------------------------------------
# Tiny models
# --------------------------------------------------------------------------------------------

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
SEQ_LEN = 48
GEN_PROMPT = 8
GEN_NEW = 20


def tiny_specs():
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                              Qwen2Config, Qwen2ForCausalLM)

    return {
        "llama": (LlamaForCausalLM, LlamaConfig(
            **COMMON, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
        "llama3_rope": (LlamaForCausalLM, LlamaConfig(
            **COMMON, tie_word_embeddings=True,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64})),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config(
            **COMMON, tie_word_embeddings=False, use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
        "mistral_sw": (MistralForCausalLM, MistralConfig(
            **COMMON, tie_word_embeddings=False, sliding_window=8,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    }


def tiny_golden(model, input_ids: torch.Tensor):
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits
        prompt = input_ids[:, :GEN_PROMPT]
        out = model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=GEN_NEW,
            min_new_tokens=GEN_NEW,  # random weights: never stop early on token 2
            eos_token_id=None,
            pad_token_id=0,
        )
        new = out[:, GEN_PROMPT:]
        # no-cache check: full forward over prompt+generated must argmax to the same tokens
        fl = model(input_ids=out, attention_mask=torch.ones_like(out)).logits
        tf = fl[:, GEN_PROMPT - 1 : -1].argmax(-1)
    assert new.shape[1] == GEN_NEW, new.shape
    return logits.float().numpy(), new.numpy().astype(np.int32), bool(torch.equal(tf, new))


def make_tiny_models(out_dir: str, checks: dict) -> None:
    base = os.path.join(out_dir, "tiny_models")
    tchecks = {}
    for i, (name, (cls, cfg)) in enumerate(tiny_specs().items()):
        torch.manual_seed(SEED + i)
        cfg._attn_implementation = "eager"
        model = cls(cfg).to(torch.float32).eval()
        # HF initialises RMSNorm weights to 1 and linear biases to 0; randomise them so that a
        # loader which drops/swaps norm weights or q/k/v biases cannot pass by accident.
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "norm" in pname:
                    p.uniform_(0.5, 1.5)
                elif pname.endswith(".bias"):
                    p.normal_(0.0, cfg.initializer_range)
        g = torch.Generator().manual_seed(SEED + 100 + i)
        input_ids = torch.randint(3, COMMON["vocab_size"], (1, SEQ_LEN), generator=g)
        logits, greedy, tf_ok = tiny_golden(model, input_ids)
        info = {"generate_matches_no_cache_argmax": tf_ok,
                "logits_std": float(logits.std()),
                "n_params": sum(p.numel() for p in model.parameters())}

        if name == "mistral_sw":
            # 1) the window changes the result
            ref = cls(cfg.__class__(**{**cfg.to_dict(), "sliding_window": None}))
            ref.config._attn_implementation = "eager"
            ref.load_state_dict(model.state_dict())
            ref.eval()
            with torch.no_grad():
                l_full = ref(input_ids=input_ids).logits.float().numpy()
                att = model(input_ids=input_ids, output_attentions=True).attentions[0][0]  # [H, T, T]
            diff = np.abs(l_full - logits).max(axis=-1)[0]  # per position
            info["max_abs_logit_diff_vs_no_window"] = float(diff.max())
            info["positions_equal_to_no_window"] = [int(p) for p in np.nonzero(diff == 0)[0]]
            # 2) which keys receive non-zero attention
            nz = (att > 0).any(0)  # [T, T]
            keys = [np.nonzero(nz[q].numpy())[0] for q in range(SEQ_LEN)]
            info["attended_keys_for_query_20"] = [int(k) for k in keys[20]]
            info["window_rule_kv_gt_q_minus_8"] = all(
                list(keys[q]) == list(range(max(0, q - 7), q + 1)) for q in range(SEQ_LEN)
            )

        if name == "llama3_rope":
            # the llama3 frequency rescaling really changes the result vs plain rope at the same theta
            plain = cls(cfg.__class__(**{**cfg.to_dict(), "rope_parameters": {
                "rope_type": "default", "rope_theta": cfg.rope_parameters["rope_theta"]}}))
            plain.config._attn_implementation = "eager"
            plain.load_state_dict(model.state_dict())
            plain.eval()
            with torch.no_grad():
                l_plain = plain(input_ids=input_ids).logits.float().numpy()
                inv = model.model.rotary_emb.inv_freq.double().numpy()
                inv_plain = plain.model.rotary_emb.inv_freq.double().numpy()
            info["max_abs_logit_diff_vs_default_rope"] = float(np.abs(l_plain - logits).max())
            info["inv_freq"] = [float(v) for v in inv]
            info["inv_freq_default_rope"] = [float(v) for v in inv_plain]

        mdir = os.path.join(base, name)
        if os.path.isdir(mdir):
            shutil.rmtree(mdir)
        model.save_pretrained(mdir, safe_serialization=True)
        np.savez(os.path.join(mdir, "golden.npz"),
                 input_ids=input_ids.numpy().astype(np.int32),
                 logits=logits.astype(np.float32),
                 greedy_ids=greedy,
                 greedy_prompt_len=np.int32(GEN_PROMPT))

        # reload check: saved checkpoint reproduces the logits
        re = cls.from_pretrained(mdir, dtype=torch.float32, attn_implementation="eager").eval()
        with torch.no_grad():
            l2 = re(input_ids=input_ids).logits.float().numpy()
        info["reload_max_abs_diff"] = float(np.abs(l2 - logits).max())

        if name == "llama":
            sdir = os.path.join(base, "llama_sharded")
            if os.path.isdir(sdir):
                shutil.rmtree(sdir)
            model.save_pretrained(sdir, safe_serialization=True, max_shard_size="200KB")
            shutil.copy(os.path.join(mdir, "golden.npz"), os.path.join(sdir, "golden.npz"))
            re = cls.from_pretrained(sdir, dtype=torch.float32, attn_implementation="eager").eval()
            with torch.no_grad():
                l3 = re(input_ids=input_ids).logits.float().numpy()
            tchecks["llama_sharded"] = {
                "files": sorted(os.listdir(sdir)),
                "reload_max_abs_diff": float(np.abs(l3 - logits).max()),
            }
        info["files"] = sorted(os.listdir(mdir))
        tchecks[name] = info
        print(f"[tiny] {name}: {info}", flush=True)
    checks["tiny_models"] = tchecks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip-smollm", action="store_true", help="only build the tiny models")
    args = ap.parse_args()

    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    os.makedirs(args.out, exist_ok=True)
    checks = {"transformers_version": transformers.__version__, "torch_version": torch.__version__}

    make_tiny_models(args.out, checks)

    if not args.skip_smollm:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        gdir, gname = os.path.split(os.path.abspath(args.gguf))
        tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
        alt = make_tokenizer_goldens(tok, args.out, checks)
        model = AutoModelForCausalLM.from_pretrained(
            gdir, gguf_file=gname, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        checks["smollm2_config"] = {
            k: getattr(model.config, k, None)
            for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                      "head_dim", "intermediate_size", "vocab_size", "rms_norm_eps", "rope_parameters",
                      "tie_word_embeddings", "max_position_embeddings", "bos_token_id", "eos_token_id",
                      "pad_token_id")
        }
        check_dequant(model, args.gguf, checks)
        make_greedy_goldens(model, tok, alt, args.gguf, args.out, checks)

    write_json(os.path.join(args.out, "checks.json"), checks)
    print(json.dumps(checks, indent=1, ensure_ascii=False, default=str))


if __name__ == "__main__":
    main()
