"""Quantized orbax checkpoints: written once, restored as written, and quantizing a checkpoint.

References: the quantized params before saving (a restore must give them back bit for bit,
QuantizedWeight layout included), and the same mode applied to the source model's weights
(quantizing a float checkpoint must equal quantizing the model it was converted from, since
both start from the same float weights).
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxinfer import quant
from jaxinfer.loading import load_model
from jaxinfer.loading.checkpoint import (CONFIG_FILE, load_checkpoint, named_weights,
                                         save_checkpoint)
from jaxinfer.loading.safetensors import load_hf_dir
from jaxinfer.models import llama
from jaxinfer.quant import awq

TINY = os.path.join(os.path.dirname(__file__), "..", "data", "tiny_models", "llama")


def assert_same_params(a, b):
    """Same tree (QuantizedWeight kinds, axes and group sizes are part of its structure) and
    the same bytes in every array."""
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


@pytest.mark.parametrize("mode", ["int8", "int4", "fp8"])
def test_quantized_checkpoint_restores_as_written(tmp_path, mode):
    loaded = load_model(TINY, quantization=mode)
    save_checkpoint(str(tmp_path), loaded.config, loaded.params, quantization=mode)
    meta = json.loads((tmp_path / CONFIG_FILE).read_text())["quantization"]
    assert meta["mode"] == mode
    assert meta["weights"]["layers.0.wq"] == {"kind": mode, "axis": 0,
                                              "group_size": quant.GROUP_SIZE.get(mode, 0)}
    assert meta["weights"]["embed"]["axis"] == 1
    cfg, params, _ = load_checkpoint(str(tmp_path))
    assert cfg == loaded.config
    assert_same_params(params, loaded.params)
    # Loading it with its own mode keeps it; with none too (a checkpoint loads as written).
    for q in (None, mode):
        assert_same_params(load_model(str(tmp_path), quantization=q).params, loaded.params)


def test_quantizing_a_float_checkpoint_equals_quantizing_its_source(tmp_path):
    float_ckpt = str(tmp_path / "float")
    src = load_model(TINY)
    save_checkpoint(float_ckpt, src.config, src.params)
    for mode in ("int8", "int4"):
        assert_same_params(load_model(float_ckpt, quantization=mode).params,
                           load_model(TINY, quantization=mode).params)
    # An int8 checkpoint loaded as int4: int8 matrices are kept under int4 (as a GGUF's Q8_0
    # embedding is: 4 bits would lose what they hold), so it loads as written.
    int8 = str(tmp_path / "int8")
    written = load_model(TINY, quantization="int8").params
    save_checkpoint(int8, src.config, written, quantization="int8")
    assert_same_params(load_model(int8, quantization="int4").params, written)
    # A float checkpoint's weights through fp8: each matrix the fp8 quantizer's output for the
    # source's float weights.
    got = named_weights(load_model(float_ckpt, quantization="fp8").params)
    for name, w in named_weights(src.params).items():
        axis = quant.contraction_axis(name)
        want = w if axis is None else quant.quantize_fp8(w, axis=axis)
        assert_same_params(got[name], want)


def test_int4_awq_checkpoint_loads_without_calibration(tmp_path, monkeypatch):
    """AWQ's searched weights, saved with mode int4-awq, restore bit for bit, and loading with
    quantization="int4-awq" does not calibrate again (the search is made to fail if called)."""
    cfg, weights = load_hf_dir(TINY)
    rng = np.random.default_rng(0)
    calibration = [rng.integers(0, cfg.vocab_size, 32).tolist() for _ in range(2)]
    searched, _ = awq.awq_int4(cfg, weights, calibration, grid=3)
    params = llama.LLAMA.params_from_weights(cfg, searched)
    save_checkpoint(str(tmp_path), cfg, params, quantization="int4-awq")

    def no_search(*args, **kwargs):
        raise AssertionError("calibrated again")
    monkeypatch.setattr(awq, "awq_int4", no_search)
    loaded = load_model(str(tmp_path), quantization="int4-awq")
    assert_same_params(loaded.params, params)
    assert loaded.params.layers[0].w_down.kind == "int4"


@pytest.mark.slow
def test_convert_int4_awq_smollm2_then_generate_the_golden_text(tmp_path, data_dir):
    """`launch.convert --quantization int4-awq` on SmolLM2: the calibration runs once, in the
    script (through load_model, the path LLM(quantization="int4-awq") takes at load: 138 s on
    two CPU cores, `python benchmarks/loading.py --configs int4-awq --runs 1`); the checkpoint
    loads with int4 linears in groups of 32 and an int8 embedding, and an LLM over it
    generates the greedy text of 4 golden prompts (HF transformers, float32). Measured: 100%
    of tokens; bound 90% (teacher-forced agreement on GPL-3 is 0.971, docs/quantization.md)."""
    import jaxinfer as ji

    out = tmp_path / "awq"
    proc = subprocess.run([sys.executable, "-m", "jaxinfer.launch.convert", "--model",
                           "smollm2-135m", "--output", str(out), "--quantization", "int4-awq"],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "int4-awq" in proc.stdout
    loaded = load_model(str(out), quantization="int4-awq")
    assert loaded.params.layers[0].wq.kind == "int4" and loaded.params.embed.kind == "int8"
    assert loaded.tokenizer is not None

    with open(os.path.join(data_dir, "smollm2_greedy.json")) as f:
        cases = json.load(f)["cases"][:4]
    llm = ji.LLM(str(out), max_seq_len=128, max_num_seqs=4, quantization="int4-awq")
    p = llm.params
    assert (p.layers[0].wq.kind, p.layers[0].wq.group_size, p.embed.kind) == ("int4", 32, "int8")
    n = min(len(c["greedy_ids"]) for c in cases)
    outs = llm.generate([c["prompt_ids"] for c in cases],
                        ji.SamplingParams(max_tokens=n, ignore_eos=True))
    agree = np.mean([np.array(o.token_ids[:n]) == np.array(c["greedy_ids"][:n])
                     for o, c in zip(outs, cases)])
    assert agree >= 0.9, agree
