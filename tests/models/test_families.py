"""Qwen3, Mixtral, Qwen3-MoE and Gemma 3 against HF transformers, and the model protocol.

tests/data/tiny_models/{qwen3,mixtral,qwen3_moe,gemma3} are tiny random HF checkpoints with
golden.npz from transformers (tests/data/make_family_goldens.py): the logits of one forward
over 48 tokens, 20 greedy tokens after an 8-token prompt, and for the MoE models the output of
layer 0's sparse MoE block for a random input. Tolerance: float32, max |diff| 1e-4 (measured
1e-5 and below); greedy tokens exact.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
import dataclasses

from jaxinfer import backends
from jaxinfer.config import ModelConfig
from jaxinfer.loading.safetensors import load_hf_dir
from jaxinfer.models import REGISTRY, get_model, moe, sequence_logits

TINY = os.path.join(os.path.dirname(__file__), "..", "data", "tiny_models")
FAMILIES = ["qwen3", "mixtral", "qwen3_moe", "gemma3"]
ATOL = 1e-4


@pytest.fixture(scope="module")
def loaded():
    out = {}
    for name in FAMILIES:
        cfg, weights = load_hf_dir(os.path.join(TINY, name))
        out[name] = (cfg, get_model(cfg.architecture).params_from_weights(cfg, weights))
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_transformers(loaded, name):
    cfg, params = loaded[name]
    golden = np.load(os.path.join(TINY, name, "golden.npz"))
    logits = np.asarray(sequence_logits(params, cfg, jnp.asarray(golden["input_ids"])))
    np.testing.assert_allclose(logits, golden["logits"], rtol=0, atol=ATOL)


def test_configs_carry_each_familys_fields(loaded):
    qwen3, mixtral, qmoe, gemma = (loaded[n][0] for n in FAMILIES)
    assert qwen3.qk_norm and not qwen3.attention_bias and qwen3.num_experts == 0
    assert (mixtral.num_experts, mixtral.experts_per_token, mixtral.router) == \
        (8, 2, "topk_softmax") and not mixtral.qk_norm and mixtral.ffn_dim == 128
    assert (qmoe.num_experts, qmoe.experts_per_token, qmoe.router, qmoe.ffn_dim) == \
        (16, 4, "softmax_topk", 32) and qmoe.qk_norm and qmoe.norm_topk_prob
    assert gemma.layer_windows == (8, 8, None) and gemma.sliding_window is None
    assert gemma.layer_rope_thetas == (1e4, 1e4, 1e6) and gemma.windows == (8, None)
    assert gemma.query_scale == pytest.approx(24 ** -0.5) and gemma.tie_word_embeddings


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("grouped", ["tiles", "ragged_dot"])
def test_moe_block_matches_transformers(loaded, name, grouped, monkeypatch):
    """Layer 0's routed experts alone, both grouped matmuls: HF's sparse MoE block output."""
    cfg, params = loaded[name]
    golden = np.load(os.path.join(TINY, name, "golden.npz"))
    backend = backends.default()
    backend = dataclasses.replace(backend, tuning=dataclasses.replace(backend.tuning,
                                                                      grouped_matmul=grouped))
    out = jax.jit(moe.expert_ffn, static_argnums=(2, 3))(jnp.asarray(golden["moe_input"]),
                                                         params.layers[0], cfg, backend)
    np.testing.assert_allclose(np.asarray(out), golden["moe_output"], rtol=0, atol=ATOL)


def test_routers():
    """Exact properties: Mixtral's softmax over the top-k logits equals Qwen3-MoE's renormalised
    top-k of the full softmax; without renormalisation the weights are the full softmax's."""
    logits = jax.random.normal(jax.random.key(0), (32, 8)) * 3
    cfg = ModelConfig("mixtral", 8, 8, 1, 1, 1, 8, 8, num_experts=8, experts_per_token=2,
                      router="topk_softmax")
    w1, e1 = moe.route(logits, cfg)
    w2, e2 = moe.route(logits, cfg.replace(router="softmax_topk"))
    w3, _ = moe.route(logits, cfg.replace(router="softmax_topk", norm_topk_prob=False))
    np.testing.assert_array_equal(np.asarray(e1), np.asarray(e2))
    np.testing.assert_allclose(np.asarray(w1), np.asarray(w2), rtol=0, atol=1e-6)
    full = np.asarray(jax.nn.softmax(logits, -1))
    np.testing.assert_allclose(np.asarray(w3), np.take_along_axis(full, np.asarray(e1), 1),
                               rtol=0, atol=1e-6)
    assert np.all(np.asarray(e1)[:, 0] == np.argmax(np.asarray(logits), -1))


@pytest.mark.parametrize("rows", [None, 4])
@pytest.mark.parametrize("fn", [moe._tiled_ffn, moe._rounds_ffn])
def test_cpu_grouped_matmuls_skip_empty_experts(fn, rows):
    """The CPU grouped matmuls equal per-group products, with empty groups, a group larger
    than a round and a ragged tail (rows past the groups come back 0), with tiles sized for
    all 23 rows (None) or for a device's share of 4 (several rounds or tiles per group)."""
    rng = np.random.default_rng(0)
    E, D, F, M = 5, 8, 6, 23
    sizes = np.array([2, 0, 19, 0, 1], np.int32)          # 22 of 23 rows; 19 > a round
    xs, wg, wu = (rng.normal(size=s).astype(np.float32) for s in ((M, D), (E, D, F), (E, D, F)))
    wd = rng.normal(size=(E, F, D)).astype(np.float32)
    got = np.asarray(fn(*map(jnp.asarray, (xs, sizes, wg, wu, wd)), rows=rows,
                        dot=backends.default().dot))
    want = np.zeros((M, D), np.float32)
    start = 0
    for e, n in enumerate(sizes):
        x = xs[start:start + n]
        g = x @ wg[e]
        want[start:start + n] = (g / (1 + np.exp(-g)) * (x @ wu[e])) @ wd[e]
        start += n
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", ["gemma3", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_engine_greedy_matches_transformers(name):
    """Through the engine (paged cache, flat steps, decode loop): the 20 HF greedy tokens. For
    Gemma 3 every layer runs on the paged cache with its own window as a mask."""
    golden = np.load(os.path.join(TINY, name, "golden.npz"))
    n = int(golden["greedy_prompt_len"])
    llm = ji.LLM(os.path.join(TINY, name), max_seq_len=64, max_num_seqs=2, prefill_chunk=16,
                 decode_steps=4)
    out = llm.generate([golden["input_ids"][0, :n].tolist()],
                       ji.SamplingParams(max_tokens=20, ignore_eos=True))
    assert out[0].token_ids == golden["greedy_ids"][0].tolist()


def test_registry_and_protocol():
    for arch, family in REGISTRY.items():
        assert get_model(arch) is family
        for method in ("param_specs", "embed", "layer", "head", "forward_tokens",
                       "hf_config", "gguf_config", "hf_layer"):
            assert callable(getattr(family, method)), (arch, method)
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        get_model("gpt2")


@pytest.mark.parametrize("name", ["qwen3_moe", "gemma3"])
def test_checkpoint_round_trip(loaded, name, tmp_path):
    """An orbax checkpoint restores the family's params and per-layer config as saved."""
    from jaxinfer.loading.checkpoint import load_checkpoint, save_checkpoint

    cfg, params = loaded[name]
    save_checkpoint(str(tmp_path / name), cfg, params)
    cfg2, params2, _ = load_checkpoint(str(tmp_path / name))
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
