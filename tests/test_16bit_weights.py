"""16-bit weights with float32 activations (LLM(dtype="bfloat16") on CPU).

Backend.dot is checked against the float32 product of the same rounded operands (tolerance:
float32 summation order, rtol 1e-5), and its compiled program for the absence of a float32 copy
of the weight matrix. The real model in bfloat16 is checked against the float32 model's
perplexity on GPL-3 text.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import backends
from jaxinfer.config import ModelConfig
from jaxinfer.layers import linear
from jaxinfer.models import llama
from jaxinfer.models import sequence_logits


@pytest.mark.parametrize("rows", [(1,), (1, 1), (3,), (2, 5)])
@pytest.mark.parametrize("spec", ["...i,io->...o", "...D,VD->...V"])
def test_dot_rounds_x_to_the_weights_dtype(rows, spec):
    rng = np.random.default_rng(0)
    I, O = 96, 200
    x = jnp.asarray(rng.normal(size=rows + (I,)), jnp.float32)
    shape = (I, O) if spec.endswith("o") else (O, I)
    w = jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
    backend = backends.default()
    fn = jax.jit(lambda x, w: backend.dot(x, w, spec))
    got = fn(x, w)
    want = np.einsum(spec, np.asarray(x.astype(jnp.bfloat16), np.float32),
                     np.asarray(w, np.float32))
    assert got.dtype == jnp.float32 and got.shape == rows + (O,)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    # No float32 copy of the weights: XLA:CPU makes one for a single-row bf16 dot unless
    # the backend pads the row (or a native kernel takes it).
    hlo = fn.lower(x, w).compile().as_text()
    assert f"f32[{shape[0]},{shape[1]}]" not in hlo


def test_linear_keeps_the_activation_dtype():
    x = jnp.ones((2, 8), jnp.float32)
    w = jnp.full((8, 4), 0.5, jnp.bfloat16)
    y = linear(x, w, jnp.ones((4,), jnp.float32), backend=backends.default())
    assert y.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(y), np.full((2, 4), 5.0))


def numpy_forward(params, cfg: ModelConfig, tokens: np.ndarray, round_inputs) -> np.ndarray:
    """A Llama forward in float64 numpy, written from the architecture (RMSNorm, half-rotation
    RoPE, causal GQA attention, SwiGLU, untied head): tokens [T] -> logits [T, V]. Every
    linear's input goes through round_inputs first, as a 16-bit weight's matmul rounds it."""
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    T, N, K, H = len(tokens), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.rms_norm_eps) * f64(w)

    def lin(x, w):
        return round_inputs(x) @ f64(w)

    inv = cfg.rope_theta ** (-np.arange(0, H, 2) / H)
    ang = np.arange(T)[:, None] * inv[None]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]

    def rope(x):  # [T, heads, H]: pairs (i, i + H/2)
        x1, x2 = x[..., :H // 2], x[..., H // 2:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    h = f64(params.embed)[tokens]
    causal = np.triu(np.full((T, T), -np.inf), 1)
    for lp in params.layers:
        x = norm(h, lp.attn_norm)
        q = rope(lin(x, lp.wq).reshape(T, N, H))
        k = np.repeat(rope(lin(x, lp.wk).reshape(T, K, H)), N // K, axis=1)
        v = np.repeat(lin(x, lp.wv).reshape(T, K, H), N // K, axis=1)
        s = np.einsum("tnh,snh->nts", q, k) / np.sqrt(H) + causal
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        h = h + lin(np.einsum("nts,snh->tnh", p, v).reshape(T, N * H), lp.wo)
        x = norm(h, lp.mlp_norm)
        g = lin(x, lp.w_gate)
        h = h + lin(g / (1 + np.exp(-g)) * lin(x, lp.w_up), lp.w_down)
    return lin(norm(h, params.final_norm), params.lm_head)


def test_with_float32_activations_embed_and_forward():
    """Vectors become float32, matrices stay bf16; the embedding gathers the table's rows
    exactly; the forward equals a float64 numpy forward of the same bf16 weights that rounds
    each linear's input to bf16 (and nothing else).

    Tolerance 1e-4 of the logits' scale: what is left is float32 arithmetic against float64
    (dots of at most 96 products, 2^-24 relative error each; measured 7e-8 of the scale), and
    a float32 activation so close to a bf16 rounding boundary that it rounds the other way
    (one element moved by a bf16 ulp, 2^-8 of itself: up to about 1e-4 of the scale; none
    here). Skipping the rounding moves the logits by 4e-3 of their scale, 40 times the
    tolerance."""
    import ml_dtypes

    cfg = ModelConfig(architecture="llama", vocab_size=128, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, ffn_dim=96, max_position_embeddings=64)
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16),
                        llama.LLAMA.init_params(cfg, jax.random.key(0), jnp.float32))
    mixed = llama.LLAMA.with_float32_activations(bf16)
    assert mixed.final_norm.dtype == jnp.float32 and mixed.layers[0].mlp_norm.dtype == jnp.float32
    assert mixed.layers[0].wq.dtype == jnp.bfloat16 and mixed.embed.dtype == jnp.bfloat16
    assert llama.LLAMA.activation_dtype(mixed) == jnp.float32
    tokens = np.asarray([3, 127, 0, 64, 5, 9, 64, 100])
    np.testing.assert_array_equal(np.asarray(llama.LLAMA.embed(mixed, None, jnp.asarray([tokens]))[0]),
                                  np.asarray(bf16.embed, np.float32)[tokens])
    got = sequence_logits(mixed, cfg, jnp.asarray([tokens], jnp.int32))[0]
    assert got.dtype == jnp.float32
    to_bf16 = lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float64)  # noqa: E731
    want = numpy_forward(bf16, cfg, tokens, to_bf16)
    scale = float(np.max(np.abs(want)))
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=1e-4 * scale)


@pytest.mark.slow
def test_smollm2_bfloat16_on_cpu(smollm2_gguf):
    """LLM(dtype="bfloat16") on CPU: bf16 matrices, float32 vectors, a bf16 KV cache kept as
    uint16 bits (kv_cache.Bits16KV, tuning.kv_16bit_as_bits); perplexity on
    the first 1024 tokens of GPL-3 within 1% of float32 (at 4,096 tokens: 24.979 against
    24.973, +0.02%, greedy agreement 0.993); the same greedy text on a short prompt."""
    import jaxinfer as ji
    from jaxinfer.evaluation import perplexity

    path = os.path.join(os.path.dirname(ji.__file__), "data", "gpl-3.txt")
    if jax.default_backend() != "cpu":
        pytest.skip("CPU only")
    f32 = ji.LLM("smollm2-135m", max_seq_len=512, max_num_seqs=1)
    bf16 = ji.LLM("smollm2-135m", dtype="bfloat16", max_seq_len=512, max_num_seqs=1)
    params = bf16._engine.params
    assert params.layers[0].w_up.dtype == jnp.bfloat16 and params.embed.dtype == jnp.bfloat16
    assert params.final_norm.dtype == jnp.float32
    with open(path) as f:
        tokens = f32.tokenizer.encode(f.read())[:1024]
    want = perplexity(f32._engine.params, f32.model_config, tokens)
    got = perplexity(params, bf16.model_config, tokens)
    assert abs(got / want - 1) < 0.01, (got, want)
    prompt = "The capital of France is"
    greedy = ji.SamplingParams(max_tokens=8, temperature=0.0)
    assert bf16.generate([prompt], greedy)[0].text == f32.generate([prompt], greedy)[0].text
    from jaxinfer.device.kv_cache import Bits16KV
    kvs = jax.tree.leaves(bf16._engine.state.cache, is_leaf=lambda x: isinstance(x, Bits16KV))
    bits = [x for x in kvs if isinstance(x, Bits16KV)]
    assert bits and all(x.dtype == jnp.bfloat16 and x.bits.dtype == jnp.uint16 for x in bits)
    assert not any(jnp.issubdtype(x.dtype, jnp.floating) and x.ndim >= 3 for x in kvs
                   if not isinstance(x, Bits16KV)), "a float KV buffer beside the bits"
