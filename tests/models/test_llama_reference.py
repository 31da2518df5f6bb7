"""The model against an independent numpy forward and against HF transformers goldens.

The numpy reference reads the GGUF with the gguf package directly and keeps Q/K in the file's
permuted layout with interleaved RoPE (llama.cpp's convention), while jaxinfer un-permutes and
uses half-rotation RoPE: agreement checks the permutation handling as well as the math.
Tolerance: float32, max abs logit difference < 1e-3 (logits are O(10)).
"""

import json
import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.loading.gguf import load_gguf
from jaxinfer.models import llama
from jaxinfer.models import sequence_logits


def _np_weights(path):
    reader = gguf.GGUFReader(path)
    out = {}
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        out[t.name] = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type),
                                 np.float32).reshape(shape)
    return out


def numpy_forward(w, tokens, n_layers=30, n_head=9, n_kv=3, hd=64, theta=100000.0, eps=1e-5):
    """Plain numpy llama forward: tokens [T] -> logits [T, V]. Interleaved RoPE on permuted Q/K."""
    T = len(tokens)

    def norm(x, g):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * g

    def rope_interleaved(x):  # x [T, heads, hd]; rotates pairs (2i, 2i+1)
        inv = theta ** (-np.arange(0, hd, 2) / hd)
        ang = np.arange(T)[:, None] * inv[None, :]          # [T, hd/2]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        xe, xo = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = xe * c - xo * s
        out[..., 1::2] = xe * s + xo * c
        return out

    h = w["token_embd.weight"][tokens].astype(np.float64)
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(n_layers):
        g = lambda n: w[f"blk.{i}.{n}"].astype(np.float64)  # noqa: E731
        x = norm(h, g("attn_norm.weight"))
        q = rope_interleaved((x @ g("attn_q.weight").T).reshape(T, n_head, hd))
        k = rope_interleaved((x @ g("attn_k.weight").T).reshape(T, n_kv, hd))
        v = (x @ g("attn_v.weight").T).reshape(T, n_kv, hd)
        rep = n_head // n_kv
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + mask
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", p, v).reshape(T, n_head * hd)
        h = h + o @ g("attn_output.weight").T
        x = norm(h, g("ffn_norm.weight"))
        a = x @ g("ffn_gate.weight").T
        h = h + ((a / (1 + np.exp(-a))) * (x @ g("ffn_up.weight").T)) @ g("ffn_down.weight").T
    h = norm(h, w["output_norm.weight"].astype(np.float64))
    return h @ w["token_embd.weight"].astype(np.float64).T


@pytest.fixture(scope="module")
def model(smollm2_gguf):
    cfg, weights, _ = load_gguf(smollm2_gguf)
    return cfg, llama.LLAMA.params_from_weights(cfg, weights)


def _logits(cfg, params, tokens):
    return np.asarray(sequence_logits(params, cfg, jnp.asarray([tokens], jnp.int32)))[0]


def test_logits_match_numpy_reference(model, smollm2_gguf):
    cfg, params = model
    tokens = [504, 3575, 282, 4649, 314, 7042, 30, 198, 1, 4093, 198, 19, 415, 639, 30, 216, 33]
    ref = numpy_forward(_np_weights(smollm2_gguf), np.array(tokens))
    got = _logits(cfg, params, tokens)
    assert got.shape == ref.shape
    np.testing.assert_array_less(np.abs(got - ref).max(), 1e-3)


def test_last_logits_match_hf_goldens(model, data_dir):
    """HF transformers (float32) last-position top-10 logits for every golden prompt."""
    cfg, params = model
    cases = json.load(open(os.path.join(data_dir, "smollm2_greedy.json")))["cases"][:6]
    # One forward over the prompts right-padded to the longest: the model is causal, so each
    # prompt's last position sees only its own tokens (padding comes after it).
    width = max(len(c["prompt_ids"]) for c in cases)
    batch = jnp.asarray([c["prompt_ids"] + [0] * (width - len(c["prompt_ids"])) for c in cases],
                        jnp.int32)
    all_logits = np.asarray(sequence_logits(params, cfg, batch))
    for case, logits in zip(cases, all_logits):
        got = logits[len(case["prompt_ids"]) - 1]
        top = case["last_logits_top10"]
        np.testing.assert_allclose(got[top["ids"]], top["values"], atol=2e-3, rtol=0)
        lse = float(jax.nn.logsumexp(got))
        assert abs(lse - case["last_logits_logsumexp"]) < 2e-3
