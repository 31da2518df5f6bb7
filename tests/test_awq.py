"""jaxinfer.awq: activation-aware int4 quantization.

Checked against independent things: the calibration forward against `llama.sequence_logits`;
folding against the exact property that the folded float model is the same model; the search
against errors recomputed from explicit activations (not the Gram matrices the search uses) and
against round to nearest of the same weights; perplexity against a uniform model (perplexity V).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import awq, quant
from jaxinfer.config import ModelConfig
from jaxinfer.models import llama

CFG = ModelConfig("llama", vocab_size=256, d_model=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, ffn_dim=128, rope_theta=10000.0,
                  tie_word_embeddings=True)
CFG_BIAS = CFG.replace(architecture="qwen2", attention_bias=True, tie_word_embeddings=False)


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """init_params weights as a host dict, with log-normal norm weights: a few input channels
    carry much larger activations than the rest, as in trained models (what AWQ exploits)."""
    params = llama.init_params(cfg, jax.random.key(seed))
    rng = np.random.default_rng(seed)
    weights = {"embed": np.asarray(params.embed), "final_norm": np.asarray(params.final_norm)}
    if params.lm_head is not None:
        weights["lm_head"] = np.asarray(params.lm_head)
    for i, lp in enumerate(params.layers):
        for field in lp.__dataclass_fields__:
            value = getattr(lp, field)
            if value is not None:
                weights[f"layers.{i}.{field}"] = np.asarray(value)
        for norm in ("attn_norm", "mlp_norm"):
            weights[f"layers.{i}.{norm}"] = np.exp(
                rng.standard_normal(cfg.d_model)).astype(np.float32)
    return weights


def tokens(cfg: ModelConfig, shape, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, shape).astype(np.int32)


def logits(cfg, weights, toks) -> np.ndarray:
    params = llama.params_from_weights(cfg, awq.dequantized(weights))
    return np.asarray(llama.sequence_logits(params, cfg, jnp.asarray(toks)))


def scales_of(report, groups=awq.GROUPS) -> dict[str, np.ndarray]:
    return {k: r["scale"] for k, r in report.items() if k.rsplit(".", 1)[1] in groups}


@pytest.mark.parametrize("cfg", [CFG, CFG_BIAS], ids=["tied", "bias"])
def test_calibration_forward_matches_model(cfg):
    weights = random_weights(cfg)
    toks = tokens(cfg, (2, 24))
    params = llama.params_from_weights(cfg, weights)
    got = np.asarray(awq.calibration_logits(params, cfg, jnp.asarray(toks)))
    np.testing.assert_allclose(got, logits(cfg, weights, toks), atol=1e-4, rtol=0)


@pytest.mark.parametrize("cfg", [CFG, CFG_BIAS], ids=["tied", "bias"])
def test_folding_any_scales_keeps_the_model(cfg):
    """Exact property: scales folded into the float weights leave the logits unchanged, for
    arbitrary positive scales (not only searched ones), GQA tying and bv included."""
    weights = random_weights(cfg)
    rng = np.random.default_rng(3)
    sizes = {"o": cfg.kv_dim, "qkv": cfg.d_model, "down": cfg.ffn_dim, "gate_up": cfg.d_model}
    scales = {f"layers.{i}.{g}": np.exp(rng.standard_normal(n)).astype(np.float32)
              for i in range(cfg.num_layers) for g, n in sizes.items()}
    folded = awq.fold_scales(cfg, weights, scales)
    assert not np.allclose(folded["layers.0.wv"], weights["layers.0.wv"])
    toks = tokens(cfg, (2, 24))
    np.testing.assert_allclose(logits(cfg, folded, toks), logits(cfg, weights, toks),
                               atol=1e-4, rtol=0)


def _flat(x) -> np.ndarray:
    return np.asarray(x, np.float64).reshape(-1, x.shape[-1])


def linear_inputs(cfg, weights, calibration) -> list[dict[str, np.ndarray]]:
    """Per layer, each linear group's input [R, C] (float64) over every calibration token, one
    sequence at a time."""
    params = llama.params_from_weights(cfg, weights)
    runs = [list(awq.run_layers(params, cfg, jnp.asarray([seq]))) for seq in calibration]
    return [{name: np.concatenate([_flat(getattr(run[i][1], name)) for run in runs])
             for name in awq.GROUP_INPUTS.values()} for i in range(cfg.num_layers)]


def _error(x, w, w_hat) -> float:
    """||x w - x w_hat||^2 from explicit activations x [R, C], in float64."""
    return float(np.sum((x @ np.asarray(w, np.float64) - x @ np.asarray(w_hat, np.float64)) ** 2))


@pytest.mark.parametrize("cfg", [CFG, CFG_BIAS], ids=["tied", "bias"])
def test_awq_int4_is_never_worse_than_rtn_on_calibration(cfg):
    weights = random_weights(cfg)
    calibration = [list(t) for t in tokens(cfg, (3, 32))] + [list(tokens(cfg, (20,), seed=2))]
    new, report = awq.awq_int4(cfg, weights, calibration, group_size=32, grid=10)

    assert set(new) == set(weights)
    for i in range(cfg.num_layers):
        for name in awq.LINEARS:
            w = new[f"layers.{i}.{name}"]
            assert (w.kind, w.axis, w.group_size) == ("int4", 0, 32)
            assert w.scale.dtype == np.float16 and w.offset.dtype == np.float16
    assert new["embed"].axis == 1
    assert isinstance(new["layers.0.attn_norm"], np.ndarray)
    if not cfg.tie_word_embeddings:
        assert new["lm_head"].axis == 0
    # The embedding (and lm_head) are round to nearest of the unchanged float weights.
    np.testing.assert_array_equal(new["embed"].q,
                                  quant.quantize_int4(weights["embed"], axis=1).q)

    # Recompute every group's errors from explicit activations. AWQ: the final weights on the
    # inputs of the folded float model. RTN: the original weights on the original inputs, with
    # the "o" and "down" scales folded into the output columns of wv and w_up (searched later).
    folded = awq.fold_scales(cfg, weights, scales_of(report))
    columns = awq.fold_scales(cfg, weights, scales_of(report, ("o", "down")))
    x_orig, x_folded = (linear_inputs(cfg, w, calibration) for w in (weights, folded))
    improved = 0
    for i in range(cfg.num_layers):
        for group, linears in awq.GROUP_LINEARS.items():
            x, xf = (xs[i][awq.GROUP_INPUTS[group]] for xs in (x_orig, x_folded))
            base = weights if group in ("o", "down") else columns
            awq_err = rtn_err = 0.0
            for name in linears:
                key = f"layers.{i}.{name}"
                awq_err += _error(xf, folded[key], quant.dequantize(new[key]))
                rtn = quant.dequantize(quant.quantize_int4(base[key], axis=0, group_size=32))
                rtn_err += _error(x, base[key], rtn)
            r = report[f"layers.{i}.{group}"]
            np.testing.assert_allclose([r["awq_error"], r["rtn_error"]], [awq_err, rtn_err],
                                       rtol=2e-3)
            assert r["awq_error"] <= r["rtn_error"]
            assert awq_err <= rtn_err * (1 + 1e-3)
            improved += r["awq_error"] < 0.9 * r["rtn_error"]
    assert improved >= 4, report  # outlier channels: AWQ helps most groups


def test_search_scale_prefers_outlier_channels():
    """One linear whose input has a few large channels: AWQ's error against explicit X is
    well below round to nearest's, and alpha 0 is exactly round to nearest."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 128)).astype(np.float32)
    x[:, :4] *= 30
    w = (rng.standard_normal((128, 96)) * 0.1).astype(np.float32)
    x64 = x.astype(np.float64)
    s, alpha, err, rtn_err = awq.search_scale(np.abs(x).mean(0), x.T @ x, w, 32, 20)
    w_rtn = quant.dequantize(quant.quantize_int4(w, axis=0, group_size=32))
    w_awq = quant.dequantize(quant.quantize_int4(w * s[:, None], axis=0, group_size=32))
    w_awq = np.asarray(w_awq) / s[:, None]
    np.testing.assert_allclose(rtn_err, _error(x64, w, w_rtn), rtol=1e-3)
    np.testing.assert_allclose(err, _error(x64, w, w_awq), rtol=1e-3)
    assert alpha > 0 and err < 0.7 * rtn_err


def test_group_size_must_divide_the_model():
    with pytest.raises(ValueError, match="group_size 48"):
        awq.awq_int4(CFG, random_weights(CFG), [[1, 2, 3]], group_size=48)


def test_perplexity_of_a_uniform_model_is_the_vocab_size():
    weights = random_weights(CFG)
    weights["final_norm"] = np.zeros_like(weights["final_norm"])  # logits all 0
    params = llama.params_from_weights(CFG, weights)
    ppl = awq.perplexity(params, CFG, list(tokens(CFG, (50,))), window=16)
    np.testing.assert_allclose(ppl, CFG.vocab_size, rtol=1e-5)


def test_perplexity_windows():
    """Non-overlapping windows, each scored from scratch; the short last one included."""
    weights = random_weights(CFG)
    params = llama.params_from_weights(CFG, weights)
    toks = tokens(CFG, (40,))
    nll = []
    for start in (0, 16, 32):
        chunk = toks[start:start + 16]
        lg = np.asarray(llama.sequence_logits(params, CFG, jnp.asarray(chunk[None])),
                        np.float64)[0]
        lse = np.log(np.sum(np.exp(lg - lg.max(-1, keepdims=True)), -1)) + lg.max(-1)
        nll += list(lse[:-1] - lg[np.arange(len(chunk) - 1), chunk[1:]])
    np.testing.assert_allclose(awq.perplexity(params, CFG, list(toks), window=16),
                               np.exp(np.mean(nll)), rtol=1e-5)


# -- the real model -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    from jaxinfer.loading.gguf import load_gguf
    from jaxinfer.loading.tokenizer import Tokenizer

    cfg, weights, meta = load_gguf(smollm2_gguf)
    return cfg, weights, Tokenizer.from_gguf_metadata(meta)


def _license_tokens(tokenizer, name: str) -> list[int]:
    path = os.path.join("/usr/share/common-licenses", name)
    if not os.path.exists(path):
        pytest.skip(f"{path} is missing")
    with open(path) as f:
        return tokenizer.encode(f.read())


@pytest.mark.slow
def test_smollm2_calibration_forward_matches_model(smollm2):
    cfg, weights, tokenizer = smollm2
    toks = jnp.asarray([_license_tokens(tokenizer, "Apache-2.0")[:128]])
    params = llama.params_from_weights(cfg, weights)
    np.testing.assert_allclose(np.asarray(awq.calibration_logits(params, cfg, toks)),
                               np.asarray(llama.sequence_logits(params, cfg, toks)),
                               atol=1e-4, rtol=0)


@pytest.mark.slow
def test_smollm2_awq_perplexity(smollm2):
    """SmolLM2-135M (the GGUF's Q4_1 / Q8_0 weights, dequantized, as float32), calibrated on
    8 x 256 tokens of Apache-2.0, evaluated on the first 1024 tokens of GPL-3 in windows of
    512, int4 group 64. Measured: float 21.06, RTN 33.35, AWQ 27.18. Not within 5% of float:
    the embedding's int4 alone costs ~11% at group 64. (Group 32 is no test of AWQ on this
    file: its Q4_1 linears are int4 groups of 32 already, which RTN reproduces exactly.)"""
    cfg, weights, tokenizer = smollm2
    calib = _license_tokens(tokenizer, "Apache-2.0")
    calibration = [calib[i * 256:(i + 1) * 256] for i in range(8)]
    evaluation = _license_tokens(tokenizer, "GPL-3")[:1024]

    def ppl(w):
        return awq.perplexity(llama.params_from_weights(cfg, awq.dequantized(w)), cfg,
                              evaluation)
    float_ppl = ppl(weights)
    rtn_ppl = ppl(awq.rtn_int4(cfg, weights, group_size=64))
    awq_ppl = ppl(awq.awq_int4(cfg, weights, calibration, group_size=64)[0])
    assert awq_ppl < 0.9 * rtn_ppl and awq_ppl < 1.4 * float_ppl, (float_ppl, rtn_ppl, awq_ppl)
