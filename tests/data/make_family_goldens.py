"""Golden data for the Qwen3, Mixtral, Qwen3-MoE and Gemma 3 families, from HF transformers.

A sibling of make_goldens.py (same environment, same conventions; see tests/data/README.md):
torch, CPU, float32, eager attention, fixed seeds. Not imported by the test suite.

    python tests/data/make_family_goldens.py --out tests/data \
        [--gemma-gguf ~/.cache/jaxinfer/models/gemma-3-270m-q4_k_m.gguf]

Outputs (under --out):
    tiny_models/{qwen3,mixtral,qwen3_moe,gemma3}/  tiny random HF checkpoints + golden.npz
        (input_ids, logits, greedy_ids, greedy_prompt_len as make_goldens.py's tiny models;
        the MoE ones also moe_input [48, 64] and moe_output [48, 64]: layer 0's sparse MoE
        block of HF applied to a random input)
    gemma3_greedy.json      (with --gemma-gguf) Gemma 3 270M: prompt ids, 32 greedy tokens,
                            last-position logits (top 64 and logsumexp), tokenizer ids
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import numpy as np
import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_goldens import COMMON, GEN_PROMPT, SEQ_LEN, SEED, sha256_of, tiny_golden, write_json  # noqa: E402

GEMMA_NEW_TOKENS = 32


def tiny_specs():
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, MixtralConfig,
                              MixtralForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    return {
        "qwen3": (Qwen3ForCausalLM, Qwen3Config(
            **COMMON, tie_word_embeddings=False, attention_bias=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
        "mixtral": (MixtralForCausalLM, MixtralConfig(
            **COMMON, tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2,
            sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
        "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(
            **{**COMMON, "intermediate_size": 96}, tie_word_embeddings=False, num_experts=16,
            num_experts_per_tok=4, moe_intermediate_size=32, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=[],
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
        # Three layers: two local (window 8, base 10,000), one global (base 1e6); a score
        # scale (query_pre_attn_scalar 24) other than head_dim ** -0.5.
        "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig(
            **{**COMMON, "num_hidden_layers": 3, "rms_norm_eps": 1e-6},
            sliding_window=8, query_pre_attn_scalar=24, hidden_activation="gelu_pytorch_tanh",
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default",
                                                   "rope_theta": 10000.0}})),
    }


def moe_block(model, name):
    layer = model.model.layers[0]
    return layer.block_sparse_moe if hasattr(layer, "block_sparse_moe") else layer.mlp


def make_tiny(out_dir: str, checks: dict) -> None:
    base = os.path.join(out_dir, "tiny_models")
    for i, (name, (cls, cfg)) in enumerate(tiny_specs().items()):
        torch.manual_seed(SEED + 50 + i)
        cfg._attn_implementation = "eager"
        model = cls(cfg).to(torch.float32).eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "norm" in pname:  # HF initialises norms to 1 (Gemma: 0); randomise them
                    p.uniform_(0.5, 1.5) if name != "gemma3" else p.uniform_(-0.5, 0.5)
        g = torch.Generator().manual_seed(SEED + 150 + i)
        input_ids = torch.randint(3, COMMON["vocab_size"], (1, SEQ_LEN), generator=g)
        logits, greedy, tf_ok = tiny_golden(model, input_ids)
        extra = {}
        if name in ("mixtral", "qwen3_moe"):
            x = torch.randn(1, SEQ_LEN, cfg.hidden_size, generator=g)
            with torch.no_grad():
                y = moe_block(model, name)(x)
            extra = {"moe_input": x[0].numpy(), "moe_output": y[0].float().numpy()}
        mdir = os.path.join(base, name)
        if os.path.isdir(mdir):
            shutil.rmtree(mdir)
        model.save_pretrained(mdir, safe_serialization=True)
        np.savez(os.path.join(mdir, "golden.npz"), input_ids=input_ids.numpy().astype(np.int32),
                 logits=logits.astype(np.float32), greedy_ids=greedy,
                 greedy_prompt_len=np.int32(GEN_PROMPT), **extra)
        re = cls.from_pretrained(mdir, dtype=torch.float32, attn_implementation="eager").eval()
        with torch.no_grad():
            l2 = re(input_ids=input_ids).logits.float().numpy()
        checks[name] = {"generate_matches_no_cache_argmax": tf_ok,
                        "logits_std": float(logits.std()),
                        "reload_max_abs_diff": float(np.abs(l2 - logits).max()),
                        "files": sorted(os.listdir(mdir))}
        print(f"[tiny] {name}: {checks[name]}", flush=True)


GEMMA_PROMPTS = [
    ("plain", "The capital of France is"),
    ("story", "Once upon a time, in a small village nestled between two mountains, there lived"),
    ("code", "def fibonacci(n):\n"),
    ("list", "Shopping list:\n- apples\n- bread\n- milk\n-"),
    ("arithmetic", "1 + 1 = 2\n2 + 3 = 5\n7 + 8 ="),
    ("science", "Photosynthesis is the process by which plants"),
    ("unicode", "Café, naïve façade — 日本語のテキスト 🎉 means"),
    ("question", "Question: What is the boiling point of water at sea level?\nAnswer:"),
    ("history", "The Roman Empire was founded in"),
    ("whitespace", "Line one.\n\n\n    Line two   after     many   spaces.\n"),
    ("one_token", "Hello"),
    ("turn", "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"),
]

TOKENIZER_TEXTS = ["", " ", "Hello", "Hello, world!", "  two leading spaces", "a  b   c",
                   "\n\n\n", "tab\tand\nnewline", "12345 3.14159", "café naïve", "日本語のテキスト",
                   "👩‍💻🎉", "<start_of_turn>user\nHi<end_of_turn>", "def f(x):\n    return x\n",
                   "Привет, мир!"]


def make_gemma(gguf: str, out_dir: str, checks: dict) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gdir, gname = os.path.split(os.path.abspath(gguf))
    tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
    model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    cases = []
    for name, prompt in GEMMA_PROMPTS:
        ids = list(tok(prompt)["input_ids"])  # add_bos: starts with <bos> = 2
        x = torch.tensor([ids])
        with torch.no_grad():
            logits = model(input_ids=x).logits[0, -1].double()
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x),
                                 do_sample=False, max_new_tokens=GEMMA_NEW_TOKENS,
                                 min_new_tokens=GEMMA_NEW_TOKENS, eos_token_id=None,
                                 pad_token_id=0, return_dict_in_generate=True,
                                 output_logits=True)
        new = out.sequences[0, len(ids):].tolist()
        margins = [float(torch.topk(s[0].double(), 2).values.diff().abs()) for s in out.logits]
        top = torch.topk(logits, 64)
        cases.append({"name": name, "prompt": prompt, "prompt_ids": ids, "greedy_ids": new,
                      "greedy_text": tok.decode(new), "greedy_step_margins":
                      [round(m, 5) for m in margins],
                      "last_logits_top64": {"ids": top.indices.tolist(),
                                            "values": [float(v) for v in top.values]},
                      "last_logits_logsumexp": float(torch.logsumexp(logits, -1))})
        print(f"[gemma3] {name}: {len(ids)} ids, min margin {min(margins):.4f}", flush=True)
    texts = [{"text": t, "ids": list(tok(t, add_special_tokens=False)["input_ids"])}
             for t in TOKENIZER_TEXTS]
    write_json(os.path.join(out_dir, "gemma3_greedy.json"), {
        "model_file": gname, "model_sha256": sha256_of(gguf),
        "transformers_version": transformers.__version__, "torch_version": torch.__version__,
        "dtype": "float32", "attn_implementation": "eager", "max_new_tokens": GEMMA_NEW_TOKENS,
        "note": "prompt_ids include <bos> (2): the GGUF says add_bos_token. greedy_ids: exactly "
                "32 new tokens (min_new_tokens, no EOS stop). last_logits_*: the last prompt "
                "position of a plain forward. tokenizer: ids without special tokens.",
        "cases": cases, "tokenizer": texts})
    checks["gemma3_config"] = model.config.to_dict()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--gemma-gguf", default=None)
    args = ap.parse_args()
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    checks = {"transformers_version": transformers.__version__,
              "torch_version": torch.__version__}
    make_tiny(args.out, checks)
    if args.gemma_gguf:
        make_gemma(args.gemma_gguf, args.out, checks)
    print(json.dumps(checks, indent=1, default=str)[:3000])


if __name__ == "__main__":
    main()
