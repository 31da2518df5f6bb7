"""Golden data for SmolLM2 under jaxinfer's CPU default numerics, from HF transformers.

A sibling of make_goldens.py (same environment and conventions; see tests/data/README.md).
Not imported by the test suite. The numerics definition it reproduces is the one `LLM(model)`
runs on CPU with dtype left None (bf16 weights, float32 activations):

  - every weight, norm weights and the embedding table included, rounded to bfloat16 (round to
    nearest even) from the float32 values HF dequantizes the GGUF to;
  - the input of every matrix product (the q/k/v/o, gate/up/down projections and the tied
    output head) rounded to bfloat16; the products of those bf16 values summed in float32;
  - keys (after RoPE) and values rounded to bfloat16, as the bf16 KV cache stores them; the
    queries, scores, softmax and the weighted sum of values in float32;
  - everything else (embedding lookup, RMSNorm, RoPE, SiLU * up, residual adds, logits) in
    float32.

Greedy decoding is run without a KV cache: step t is one forward over the prompt and the t
tokens before it, and its token is the argmax of the last position's logits (so no cache path
of HF's is involved; the rounding of keys and values is the same either way).

The definition fixes each value only up to float32 summation order, and a bf16 rounding
amplifies that: a value within the summation difference of a rounding boundary rounds to the
other neighbour. To measure how far that moves the results, the same definition is run a
second way, every linear's products summed in float64 (then rounded to float32) and the
greedy steps teacher-forced (one forward over prompt + greedy tokens): the `float64_sums_*`
entries. Plain float32 (HF's float32 eager model) is stored for scale.

    python tests/data/make_bf16_goldens.py \
        --gguf ~/.cache/jaxinfer/models/SmolLM2-135M-Instruct.Q4_1.gguf --out tests/data

Reads the prompts (names and token ids) from <out>/smollm2_greedy.json and writes
<out>/smollm2_bf16_greedy.json; ~2 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_goldens import EOS_ID, MAX_NEW_TOKENS, SEED, sha256_of, write_json  # noqa: E402

TOP_LOGPROBS = 20  # jaxinfer's MAX_LOGPROBS: what one generated token can report
ATTENTION = "eager_bf16_kv"
SUMS = {"float64": False}   # the emulated linears sum their products in float64 while True


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


def eager_bf16_kv(module, query, key, value, attention_mask, **kwargs):
    """HF's eager attention over keys and values rounded to bf16 (the KV cache's dtype)."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    return eager_attention_forward(module, query, bf16(key), bf16(value), attention_mask,
                                   **kwargs)


def load(gguf: str, emulate_bf16: bool):
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    # A new attention name needs its mask kind too (eager's additive float mask; without it
    # transformers builds another kind of mask, which eager attention would add as numbers).
    AttentionInterface.register(ATTENTION, eager_bf16_kv)
    AttentionMaskInterface.register(ATTENTION, eager_mask)
    gdir, gname = os.path.split(os.path.abspath(gguf))
    model = AutoModelForCausalLM.from_pretrained(
        gdir, gguf_file=gname, dtype=torch.float32,
        attn_implementation=ATTENTION if emulate_bf16 else "eager").eval()
    assert type(model).__name__ == "LlamaForCausalLM", type(model)
    if emulate_bf16:
        with torch.no_grad():
            for p in model.parameters():   # tied embedding/head: one tensor, rounded once
                p.copy_(bf16(p))
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.register_forward_pre_hook(lambda mod, args: (bf16(args[0]),) + args[1:])
                m.forward = types.MethodType(linear_forward, m)
    return model


def linear_forward(self, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear's forward, or with SUMS["float64"] its products summed in float64."""
    if not SUMS["float64"]:
        return torch.nn.functional.linear(x, self.weight, self.bias)
    bias = None if self.bias is None else self.bias.double()
    return torch.nn.functional.linear(x.double(), self.weight.double(), bias).float()


def last_logits(model, ids: list[int]) -> torch.Tensor:
    x = torch.tensor([ids], dtype=torch.long)
    with torch.no_grad():
        return model(input_ids=x, attention_mask=torch.ones_like(x)).logits[0, -1].double()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    with open(os.path.join(args.out, "smollm2_greedy.json"), encoding="utf-8") as f:
        prompts = [(c["name"], c["prompt_ids"]) for c in json.load(f)["cases"]]

    model = load(args.gguf, emulate_bf16=True)
    reference = load(args.gguf, emulate_bf16=False)   # float32: the size of bf16's effect
    cases = []
    for name, ids in prompts:
        new, margins, step_logprobs = [], [], []
        first = None
        while len(new) < MAX_NEW_TOKENS and EOS_ID not in new:
            logits = last_logits(model, ids + new)
            logprobs = logits - torch.logsumexp(logits, -1)
            top = torch.topk(logits, TOP_LOGPROBS)
            if first is None:
                first = (top, logprobs)
            token = int(top.indices[0])
            assert token == int(logits.argmax())
            new.append(token)
            margins.append(round(float(top.values[0] - top.values[1]), 5))
            step_logprobs.append(round(float(logprobs[token]), 6))
        (top, logprobs) = first
        f32 = last_logits(reference, ids)
        f32_logprobs = f32 - torch.logsumexp(f32, -1)
        SUMS["float64"] = True
        x = torch.tensor([ids + new[:-1]], dtype=torch.long)
        with torch.no_grad():
            forced = model(input_ids=x, attention_mask=torch.ones_like(x)).logits[0].double()
        SUMS["float64"] = False
        forced = forced[len(ids) - 1:] - torch.logsumexp(forced[len(ids) - 1:], -1, True)
        cases.append({
            "name": name,
            "prompt_ids": ids,
            "greedy_ids": new,
            "greedy_step_margins": margins,
            "greedy_step_logprobs": step_logprobs,
            "last_top_logprobs": {"ids": top.indices.tolist(),
                                  "values": [round(float(logprobs[i]), 6)
                                             for i in top.indices]},
            "float64_sums_last_top_logprobs": [round(float(forced[0, i]), 6)
                                               for i in top.indices],
            "float64_sums_step_logprobs": [round(float(forced[t, token]), 6)
                                           for t, token in enumerate(new)],
            "float32_last_top_logprobs": [round(float(f32_logprobs[i]), 6)
                                          for i in top.indices],
        })
        spread = max(abs(a - b) for a, b in zip(
            cases[-1]["float64_sums_last_top_logprobs"] + cases[-1]["float64_sums_step_logprobs"],
            cases[-1]["last_top_logprobs"]["values"] + step_logprobs))
        print(f"[bf16] {name}: {len(new)} new, min margin {min(margins):.4f}, float64 sums "
              f"vs the golden {spread:.4f}, float32 vs bf16 on the top {TOP_LOGPROBS}: "
              f"{float((f32_logprobs - logprobs)[top.indices].abs().max()):.4f}", flush=True)
    write_json(os.path.join(args.out, "smollm2_bf16_greedy.json"), {
        "model_file": os.path.basename(args.gguf),
        "model_sha256": sha256_of(args.gguf),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "numerics": "bf16 weights (all, rounded from HF's float32 dequantization), bf16 "
                    "inputs to every matrix product, bf16 keys (after RoPE) and values, "
                    "float32 everywhere else (tests/data/make_bf16_goldens.py)",
        "max_new_tokens": MAX_NEW_TOKENS,
        "eos_token_id": EOS_ID,
        "note": "greedy_ids: new tokens only, ending with eos 2 where it was produced; step t's "
                "margin is its top1 - top2 logit and its logprob the chosen token's "
                "log-softmax. last_top_logprobs: the top 20 log-probabilities at the last "
                "prompt position. float64_sums_*: the same log-probabilities (the top 20 ids; "
                "each step's chosen token) under the same numerics with every linear's "
                "products summed in float64 and the steps teacher-forced: how far summation "
                "order alone moves them. float32_last_top_logprobs: the top 20 ids under plain "
                "float32 (HF's float32 eager model), for scale.",
        "cases": cases,
    })


if __name__ == "__main__":
    main()
