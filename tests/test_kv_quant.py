"""The quantized KV cache (kv_cache_dtype "int8" / "fp8"): quantization error bounds, attention
over quantized keys (segments, the page pool's ragged attention and the kernels), and the model
over quantized ring and paged caches against one-shot forwards and the float cache.

Error bounds: int8 rounds each element to the nearest multiple of its (token, kv head) scale
amax / 127, so |x - x_hat| <= scale / 2; e4m3 keeps 3 mantissa bits, so |x - x_hat| <= 2^-4 |x|
for values in e4m3's normal range (>= 2^-6 * scale) and <= 2^-10 * scale below it.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
# ragged_paged_attention is what attention="pallas" runs (backends.attention): imported here so
# that a broken kernel package fails this module's collection.
from pallas_kernels import flash_attention, paged_attention, ragged_paged_attention  # noqa: F401

from jaxinfer import backends
from jaxinfer.backends.attention import ragged_attention, reference_attention
from jaxinfer.device.ragged_meta import ragged_meta
from jaxinfer.config import ModelConfig
from jaxinfer.engine import memory
from jaxinfer.device.kv_cache import KV_DTYPES, PagedKVCache, QuantizedKV, kv_buffer, quantize_kv
from jaxinfer.models import llama
from jaxinfer.models import sequence_logits
from jaxinfer.device.token_batch import host_batch

forward = jax.jit(llama.LLAMA.forward, static_argnums=(1,), static_argnames=("backend",))
forward_tokens = jax.jit(llama.LLAMA.forward_tokens, static_argnums=(1,),
                         static_argnames=("backend", "query_tile", "num_tiles"))
CFG = ModelConfig("llama", vocab_size=97, d_model=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=32, ffn_dim=64, max_position_embeddings=512)


def _kv(shape, seed=0):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    x[..., 0, :] *= 30          # heads of very different magnitude
    x[0, 0, 1] = 0.0            # an all-zero head: scale 1, codes 0
    return x


def test_int8_error_within_half_a_step():
    x = _kv((3, 5, 2, 64))
    q = quantize_kv(jnp.asarray(x), jnp.int8)
    assert q.codes.dtype == jnp.int8 and q.scale.dtype == jnp.float32
    assert q.scale.shape == (3, 5, 2)
    scale = np.abs(x).max(-1) / 127
    np.testing.assert_allclose(np.asarray(q.scale)[scale > 0], scale[scale > 0], rtol=1e-6)
    err = np.abs(np.asarray(q.dequantize()) - x)
    assert (err <= np.asarray(q.scale)[..., None] * (0.5 + 1e-5)).all()
    assert np.abs(np.asarray(q.codes)).max() == 127
    assert (np.asarray(q.codes)[0, 0, 1] == 0).all()
    assert (np.asarray(q.dequantize())[0, 0, 1] == 0).all()


def test_fp8_relative_error():
    x = _kv((3, 5, 2, 64), seed=1)
    q = quantize_kv(jnp.asarray(x), jnp.float8_e4m3fn)
    scale = np.asarray(q.scale)[..., None]
    err = np.abs(np.asarray(q.dequantize()) - x)
    normal = np.abs(x) >= 2.0 ** -6 * scale
    assert (err[normal] <= 2.0 ** -4 * np.abs(x[normal]) * (1 + 1e-6)).all()
    tiny = 2.0 ** -10 * np.broadcast_to(scale, x.shape)[~normal]
    assert (err[~normal] <= tiny * (1 + 1e-6)).all()
    assert np.isfinite(np.asarray(q.dequantize())).all()


def test_page_bytes_count_codes_and_scales():
    # 2 (k, v) * 2 layers * 4 tokens * (2 heads * 32 dims * itemsize + 2 heads * 4 scale bytes)
    assert memory.kv_page_bytes(CFG, 4, jnp.float32) == 2 * 2 * 4 * 64 * 4
    assert memory.kv_page_bytes(CFG, 4, jnp.int8) == 2 * 2 * 4 * (64 + 8)
    assert memory.kv_page_bytes(CFG, 4, jnp.float8_e4m3fn) == 2 * 2 * 4 * (64 + 8)


def _quantized_segment(B, S, K, H, dtype, seed):
    rng = np.random.default_rng(seed)
    k = quantize_kv(jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.float32), dtype)
    v = quantize_kv(jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.float32), dtype)
    return k, v


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_attention_over_quantized_keys_reads_what_was_stored(kv):
    """Attention over QuantizedKV: the dense reference over the dequantized arrays, and the
    Pallas flash and paged kernels (interpret mode), which take codes and scales, equal it
    within float32 rounding (1e-5). The model's path, ragged_attention over the same keys as a
    quantized page pool (the jnp work list, and the ragged Pallas kernel), equals it within
    float32 rounding too."""
    B, T, S, N, K, H = 2, 3, 16, 4, 2, 32
    k, v = _quantized_segment(B, S, K, H, KV_DTYPES[kv], seed=2)
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
    lengths = jnp.asarray([11, 16], jnp.int32)
    qpos = lengths[:, None] - T + jnp.arange(T)[None]
    kpos = jnp.where(jnp.arange(S)[None] < lengths[:, None], jnp.arange(S)[None], -1)
    want = reference_attention(q, qpos, [(k.dequantize(), v.dequantize(), kpos)])
    scales = dict(k_scale=k.scale, v_scale=v.scale)
    flash = flash_attention(q, k.typed_codes, v.typed_codes, q_offset=lengths - T,
                            kv_lengths=lengths, interpret=True, **scales)
    np.testing.assert_allclose(np.asarray(flash), np.asarray(want), atol=1e-5, rtol=0)
    # Single-token decode through the paged kernel: the rows' keys as pages of 4.
    pages = jax.tree.map(lambda a: a.reshape((B * S // 4, 4) + a.shape[2:]),
                         (k.typed_codes, v.typed_codes, k.scale, v.scale))
    tables = jnp.arange(B * S // 4, dtype=jnp.int32).reshape(B, S // 4)
    one = paged_attention(q[:, -1], pages[0], pages[1], lengths, tables, k_scale=pages[2],
                          v_scale=pages[3], interpret=True)
    np.testing.assert_allclose(np.asarray(one), np.asarray(want[:, -1]), atol=1e-5, rtol=0)
    # The flat step: the rows' T queries side by side over a one-layer pool of 4-slot pages.
    pool = jax.tree.map(lambda a: a.reshape((1, B * S) + a.shape[2:]), (k, v))
    assert isinstance(pool[0], QuantizedKV)
    meta = ragged_meta(jnp.asarray([0, T], jnp.int32), jnp.full((B,), T, jnp.int32), lengths,
                       num_tokens=B * T, query_tile=T, num_tiles=B, page_size=4)
    flat_want = np.asarray(want).reshape(B * T, N, H)
    for impl in ("reference", "pallas"):
        backend = dataclasses.replace(backends.default(), attention=impl)
        flat = ragged_attention(backend, q.reshape(B * T, N, H), *pool, 0, tables, meta,
                                page_size=4)
        np.testing.assert_allclose(np.asarray(flat), flat_want, atol=1e-5, rtol=0,
                                   err_msg=impl)


def _paged(cfg, B, pages_per_row, dtype, rng):
    num_pages = 1 + B * pages_per_row + 3
    order = rng.permutation(np.arange(1, num_pages))[:B * pages_per_row]
    return PagedKVCache.create(cfg.num_layers, num_pages, 4, cfg.num_kv_heads, cfg.head_dim,
                               order.reshape(B, pages_per_row).astype(np.int32), dtype)


def _chunked_run(params, prompts, steps, cache, flat=False, **kw):
    """Chunked prefill (chunks of 8) then greedy decode; logits of every position per row.
    flat: each step as one flat TokenBatch (llama.LLAMA.forward_tokens): the rows' tokens packed side
    by side with the padding at the end, prefill chunks cut into query tiles of 4."""
    B = len(prompts)
    lens = np.array([len(p) for p in prompts])
    logits = [[] for _ in range(B)]

    def run(toks, num):
        """Row b's first num[b] tokens of toks [B, T] through the model: (logits of each row's
        tokens, cache)."""
        if not flat:
            h, c = forward(params, CFG, jnp.asarray(toks), cache, jnp.asarray(num), **kw)
            lg = np.asarray(llama.LLAMA.head(params, h))
            return [lg[b, :num[b]] for b in range(B)], c
        T = toks.shape[1]
        batch = host_batch(B * T + 1, B, [(b, toks[b, :num[b]]) for b in range(B) if num[b]])
        h, c = forward_tokens(params, CFG, batch, cache, query_tile=min(T, 4), **kw)
        lg = np.asarray(llama.LLAMA.head(params, h))
        start = np.asarray(batch.query_start)
        return [lg[start[b]:start[b] + num[b]] for b in range(B)], c

    for s in range(0, lens.max(), 8):
        toks = np.zeros((B, 8), np.int32)
        num = np.clip(lens - s, 0, 8).astype(np.int32)
        for b, p in enumerate(prompts):
            toks[b, :num[b]] = p[s:s + num[b]]
        lg, cache = run(toks, num)
        for b in range(B):
            logits[b].extend(lg[b])
    seqs = [list(p) for p in prompts]
    for _ in range(steps):
        nxt = np.array([np.argmax(logits[b][-1]) for b in range(B)], np.int32)
        for b in range(B):
            seqs[b].append(int(nxt[b]))
        lg, cache = run(nxt[:, None], np.ones(B, np.int32))
        for b in range(B):
            logits[b].append(lg[b][0])
    return [np.stack(x) for x in logits], seqs, cache


@pytest.mark.parametrize("kv", ["int8", "fp8"])
@pytest.mark.parametrize("layout", ["ring", "paged", "paged-flat", "paged-flat-bits",
                                    "paged-pallas"])
def test_quantized_cache_under_the_model(kv, layout):
    """Chunked prefill and decode over a quantized ring or paged cache (reference attention,
    flat ragged token batches, or the Pallas ragged kernel) against the one-shot forward with
    the same KV dtype (sequence_logits(kv_cache_dtype=)): every key is quantized the same
    way in both, so they agree to 1e-3 (float32; a key computed in another order may round to
    the neighbouring code, so not to float32's 1e-5), and against the float cache within the
    quantization's error (measured max |logit diff| over all rows and layouts: int8 0.021, fp8
    0.098, on logits up to ~3 in magnitude; bounds about 3x: 0.06 and 0.3). paged-flat-bits:
    the pool as the CPU engine makes it (kv_buffer(fp8_bits=True): float8 codes kept as their
    uint8 bits), whose logits equal paged-flat's exactly."""
    dtype = KV_DTYPES[kv]
    params = llama.LLAMA.init_params(CFG, jax.random.key(0))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (13, 1, 22)]
    if layout == "ring":
        cache, kw = PagedKVCache.ring(CFG.num_layers, 3, 64, CFG.num_kv_heads, CFG.head_dim,
                                      dtype), {}
        assert cache.wraps
    else:
        cache = _paged(CFG, 3, 16, dtype, rng)
        kw = {"paged": {}, "paged-flat": dict(flat=True), "paged-flat-bits": dict(flat=True),
              "paged-pallas": dict(backend=dataclasses.replace(backends.default(),
                                                               attention="pallas"))}[layout]
    if layout == "paged-flat-bits":
        typed = cache
        cache = cache.replace(**{n: kv_buffer(getattr(cache, n).shape, dtype, fp8_bits=True)
                                 for n in ("k", "v")})
        stored = {"int8": jnp.int8, "fp8": jnp.uint8}[kv]
        assert cache.k.codes.dtype == stored and cache.k.dtype == dtype
    assert isinstance(cache.k, QuantizedKV) and cache.k.dtype == dtype
    got, seqs, cache = _chunked_run(params, prompts, 5, cache, **kw)
    if layout == "paged-flat-bits":
        want, _, _ = _chunked_run(params, prompts, 5, typed, flat=True)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
    assert isinstance(cache.k, QuantizedKV)
    assert np.asarray(cache.lengths).tolist() == [len(s) for s in seqs]
    bound = {"int8": 0.06, "fp8": 0.3}[kv]
    for b, seq in enumerate(seqs):
        tokens = jnp.asarray([seq])
        same = np.asarray(sequence_logits(params, CFG, tokens, kv_cache_dtype=kv))[0]
        exact = np.asarray(sequence_logits(params, CFG, tokens))[0]
        assert np.isfinite(got[b]).all()
        np.testing.assert_allclose(got[b], same, atol=1e-3, rtol=0)
        assert np.abs(got[b] - exact).max() < bound, np.abs(got[b] - exact).max()
