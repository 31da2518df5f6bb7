"""GGUF loading of the Qwen3, Qwen3-MoE and Mixtral families: the tiny HF checkpoints of
tests/data/tiny_models written as GGUF files with llama.cpp's tensor names and metadata
(convert_hf_to_gguf's Qwen3Model / Qwen3MoeModel: no Q/K permutation, experts stacked as
ffn_{gate,up,down}_exps; its MixtralModel: architecture "llama" with llama.expert_count, Q and
K permuted for interleaved RoPE as for Llama, the same stacked experts), loaded back and run
against transformers' logits (golden.npz; float32, 1e-4). Gemma 3's GGUF path is checked on
the real file (tests/models/test_gemma3_real.py)."""

import json
import os

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

from jaxinfer.loading.gguf import load_gguf
from jaxinfer.models import get_model, sequence_logits

TINY = os.path.join(os.path.dirname(__file__), "..", "data", "tiny_models")
VT = gguf.GGUFValueType
NAMES = {"input_layernorm.weight": "attn_norm.weight",
         "post_attention_layernorm.weight": "ffn_norm.weight",
         "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
         "self_attn.v_proj.weight": "attn_v.weight",
         "self_attn.o_proj.weight": "attn_output.weight",
         "self_attn.q_norm.weight": "attn_q_norm.weight",
         "self_attn.k_norm.weight": "attn_k_norm.weight",
         "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
         "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
         "block_sparse_moe.gate.weight": "ffn_gate_inp.weight"}
# Per family: GGUF architecture, the HF expert names (gate, up, down) and where they sit.
EXPERTS = {"qwen3_moe": ("mlp.experts.{e}.", ("gate_proj", "up_proj", "down_proj")),
           "mixtral": ("block_sparse_moe.experts.{e}.", ("w1", "w3", "w2"))}


def interleave_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """An HF Q or K projection [n_heads * hd, D] with each head's rows reordered from halves
    (x[:hd/2], x[hd/2:]) to interleaved pairs: llama.cpp's layout for interleaved RoPE, row
    2j of a head being HF's row j and row 2j + 1 HF's row hd/2 + j."""
    out_dim = w.shape[0]
    hd = out_dim // n_heads
    return w.reshape(n_heads, 2, hd // 2, -1).swapaxes(1, 2).reshape(out_dim, -1)


def write_gguf(name: str, path: str) -> None:
    src = os.path.join(TINY, name)
    with open(os.path.join(src, "config.json")) as f:
        hf = json.load(f)
    t = safetensors.numpy.load_file(os.path.join(src, "model.safetensors"))
    arch = {"qwen3": "qwen3", "qwen3_moe": "qwen3moe", "mixtral": "llama"}[name]
    w = gguf.GGUFWriter(path, arch)
    meta = {"block_count": hf["num_hidden_layers"], "context_length": 512,
            "embedding_length": hf["hidden_size"], "feed_forward_length":
            hf["intermediate_size"], "attention.head_count": hf["num_attention_heads"],
            "attention.head_count_kv": hf["num_key_value_heads"],
            "attention.key_length": hf["head_dim"], "attention.value_length": hf["head_dim"]}
    if name in EXPERTS:
        meta.update({"expert_count": hf["num_local_experts"],
                     "expert_used_count": hf["num_experts_per_tok"]})
    if name == "qwen3_moe":
        meta["expert_feed_forward_length"] = hf["moe_intermediate_size"]
    for key, value in meta.items():
        w.add_key_value(f"{arch}.{key}", value, VT.UINT32)
    w.add_key_value(f"{arch}.rope.freq_base", 1e6, VT.FLOAT32)
    w.add_key_value(f"{arch}.attention.layer_norm_rms_epsilon", hf["rms_norm_eps"], VT.FLOAT32)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"<t{i}>" for i in range(hf["vocab_size"])])
    out = {"token_embd.weight": t["model.embed_tokens.weight"],
           "output_norm.weight": t["model.norm.weight"], "output.weight": t["lm_head.weight"]}
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({f"blk.{i}.{g}": t[p + n] for n, g in NAMES.items() if p + n in t})
        if arch == "llama":
            for g, heads in (("attn_q", hf["num_attention_heads"]),
                             ("attn_k", hf["num_key_value_heads"])):
                out[f"blk.{i}.{g}.weight"] = interleave_qk(out[f"blk.{i}.{g}.weight"], heads)
        if name in EXPERTS:
            where, theirs = EXPERTS[name]
            for ours, hf_name in zip(("gate", "up", "down"), theirs):
                out[f"blk.{i}.ffn_{ours}_exps.weight"] = np.stack(
                    [t[f"{p}{where.format(e=e)}{hf_name}.weight"]
                     for e in range(hf["num_local_experts"])])
    for tname, arr in out.items():
        w.add_tensor(tname, np.ascontiguousarray(arr, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "mixtral"])
def test_gguf_family_matches_transformers(tmp_path, name):
    path = str(tmp_path / f"{name}.gguf")
    write_gguf(name, path)
    cfg, weights, _ = load_gguf(path)
    params = get_model(cfg.architecture).params_from_weights(cfg, weights)
    golden = np.load(os.path.join(TINY, name, "golden.npz"))
    logits = np.asarray(sequence_logits(params, cfg, jnp.asarray(golden["input_ids"])))
    np.testing.assert_allclose(logits, golden["logits"], rtol=0, atol=1e-4)
    assert cfg.architecture == name.replace("qwen3_moe", "qwen3moe")
    assert cfg.qk_norm == (name != "mixtral")
    assert (cfg.num_experts, cfg.ffn_dim) == {"qwen3": (0, 128), "qwen3_moe": (16, 32),
                                              "mixtral": (8, 128)}[name]
