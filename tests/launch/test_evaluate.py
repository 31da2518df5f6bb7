"""jaxinfer.evaluation and `python -m jaxinfer.launch.evaluate` on the real SmolLM2-135M.

Scores are checked against numpy's float64 log-softmax of the scoring forward's logits; the
launcher end to end (one subprocess) for its printed and JSON figures.
"""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer
from jaxinfer import evaluation
from jaxinfer.loading import load_model
from jaxinfer.models import sequence_logits

# The evaluation text, shipped as package data (a verbatim copy of the GPL's text).
TEXT = os.path.join(os.path.dirname(jaxinfer.__file__), "data", "gpl-3.txt")


@pytest.fixture(scope="module")
def smollm2():
    loaded = load_model("smollm2-135m")
    with open(TEXT) as f:
        ids = loaded.tokenizer.encode(f.read())[:150]
    return loaded, ids


def test_scores_match_a_float64_log_softmax(smollm2):
    """Windows of 64 over 150 tokens (64 + 64 + a padded 22): every predicted token's NLL
    equals float64 numpy on the same logits of each window scored alone, and the argmax too.
    Tolerance 1e-4 + 2e-5 relative: the two float32 programs (the padded-window scorer and the
    plain forward) sum in different orders; measured worst 1.3e-4 at an NLL of 14.85."""
    loaded, ids = smollm2
    s = evaluation.score(loaded.params, loaded.config, ids, window=64)
    nll, top = [], []
    for start in (0, 64, 128):
        chunk = ids[start:start + 64]
        logits = np.asarray(sequence_logits(loaded.params, loaded.config,
                                                  jnp.asarray([chunk])), np.float64)[0, :-1]
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        nll.append(-logp[np.arange(len(chunk) - 1), chunk[1:]])
        top.append(logits.argmax(-1))
    assert s.nll.shape == (63 + 63 + 21,)
    np.testing.assert_allclose(s.nll, np.concatenate(nll), atol=1e-4, rtol=2e-5)
    np.testing.assert_array_equal(s.argmax, np.concatenate(top))
    assert s.perplexity == pytest.approx(float(np.exp(np.concatenate(nll).mean())), rel=1e-5)
    assert evaluation.agreement(s, s) == 1.0
    with pytest.raises(ValueError, match="window must be at least 2 tokens, got 1"):
        evaluation.score(loaded.params, loaded.config, ids, window=1)
    with pytest.raises(ValueError, match="at least 2 tokens, got 1"):
        evaluation.score(loaded.params, loaded.config, ids[:1])


@pytest.mark.slow
def test_launcher_reports_perplexity_and_agreement(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "jaxinfer.launch.evaluate", "--quantization",
                           "int8", "--kv_cache_dtype", "int8", "--max_tokens", "256",
                           "--window", "128", "--text", TEXT, "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["tokens"] == 256 and r["quantization"] == "int8" and r["kv_cache_dtype"] == "int8"
    assert 0.9 <= r["greedy_agreement"] <= 1.0
    # int8 weights (groups of 32) and KV int8 must not cost more than 2% of float32's
    # perplexity. On these 256 tokens they measure x0.956 (44.694 against 46.733; weights
    # alone x0.957, KV alone x0.986); on 4,096 tokens x0.997 (docs/quantization.md): a sample
    # this small moves the ratio by several percent either way, so only the loss is bounded.
    assert r["perplexity"] / r["float32_perplexity"] < 1.02
    assert r["param_bytes"] < 0.3 * r["float32_param_bytes"]
    assert f"perplexity {r['perplexity']:.3f}" in proc.stdout
    assert f"greedy agreement {r['greedy_agreement']:.4f}" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "jaxinfer.launch.evaluate", "--kv_cache_dtype",
                          "int4"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "kv_cache_dtype" in bad.stderr
