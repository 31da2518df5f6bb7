"""Orbax checkpoints: bitwise round trips, the convert script, and restoring without the source."""

import gzip
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.loading import load_model
from jaxinfer.loading.checkpoint import (CONFIG_FILE, PARAMS_DIR, is_checkpoint_dir,
                                         load_checkpoint, save_checkpoint)
from jaxinfer.loading.safetensors import load_hf_dir
from jaxinfer.loading.tokenizer import Tokenizer
from jaxinfer.models import llama
from jaxinfer.models import sequence_logits

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DATA = os.path.join(REPO, "tests", "data")
TINY = os.path.join(DATA, "tiny_models")


def logits_of(cfg, params, ids):
    """Logits [1, T, V] of one forward of ids (list of T ints) from an empty cache."""
    return np.asarray(sequence_logits(params, cfg, jnp.asarray([ids], jnp.int32)))


def assert_bitwise_equal(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


def tiny(name, dtype=jnp.float32):
    cfg, weights = load_hf_dir(os.path.join(TINY, name))
    return cfg, llama.LLAMA.params_from_weights(cfg, weights, dtype)


@pytest.mark.parametrize("name", ["llama", "llama3_rope", "qwen2"])  # plain, tied+scaled, biases
def test_round_trip_is_bitwise(tmp_path, name):
    cfg, params = tiny(name)
    save_checkpoint(str(tmp_path / "ckpt"), cfg, params)
    assert is_checkpoint_dir(str(tmp_path / "ckpt"))
    cfg2, params2, tok = load_checkpoint(str(tmp_path / "ckpt"))
    assert cfg2 == cfg and tok is None
    assert isinstance(params2, llama.LlamaParams)
    assert_bitwise_equal(params2, params)


def test_bfloat16_checkpoint_restores_in_requested_dtype(tmp_path):
    cfg, params = tiny("llama", jnp.bfloat16)
    save_checkpoint(str(tmp_path), cfg, params)
    meta = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert meta["param_dtype"] == "bfloat16" and meta["format_version"] == 1
    _, restored, _ = load_checkpoint(str(tmp_path), dtype=jnp.bfloat16)
    assert_bitwise_equal(restored, params)
    _, restored, _ = load_checkpoint(str(tmp_path), dtype=jnp.float32)
    assert_bitwise_equal(restored, jax.tree.map(lambda x: x.astype(jnp.float32), params))


@pytest.fixture(scope="module")
def smollm2_hf_tokenizer(tmp_path_factory):
    src = os.path.join(DATA, "smollm2_tokenizer")
    dst = tmp_path_factory.mktemp("smollm2_tokenizer")
    with gzip.open(os.path.join(src, "tokenizer.json.gz"), "rb") as f_in, \
            open(dst / "tokenizer.json", "wb") as f_out:
        shutil.copyfileobj(f_in, f_out)
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), dst / name)
    return Tokenizer.from_hf_dir(str(dst))


TEXTS = ["Hello, world!", "x = 12 + 345 * 6789", "café 日本語 👩‍💻",
         "<|im_start|>user\nHi<|im_end|>\n", "  1  22   333\n\n"]


def assert_same_tokenizer(a, b):
    for attr in ("vocab_size", "bos_token_id", "eos_token_ids", "eos_token_id", "add_bos",
                 "add_eos", "chat_template", "special_ids"):
        assert getattr(a, attr) == getattr(b, attr), attr
    for text in TEXTS:
        ids = a.encode(text)
        assert b.encode(text) == ids
        assert b.decode(ids) == a.decode(ids)
        assert b.decode(ids, skip_special_tokens=False) == a.decode(ids, skip_special_tokens=False)
    if a.chat_template:
        msgs = [{"role": "user", "content": "Hi"}]
        assert b.apply_chat_template(msgs) == a.apply_chat_template(msgs)


def test_tokenizer_round_trip(tmp_path, smollm2_hf_tokenizer):
    cfg, params = tiny("llama")
    save_checkpoint(str(tmp_path), cfg, params, smollm2_hf_tokenizer)
    _, _, tok = load_checkpoint(str(tmp_path))
    assert tok is not None
    assert_same_tokenizer(smollm2_hf_tokenizer, tok)


def test_convert_script_and_restore_without_source(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    shutil.copytree(os.path.join(TINY, "llama"), src)
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "jaxinfer.launch.convert", "--model", str(src),
                           "--output", str(out)], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout and "MiB" in proc.stdout
    assert is_checkpoint_dir(str(out)) and not is_checkpoint_dir(str(src))

    ids = [int(i) for i in np.load(src / "golden.npz")["input_ids"][0]]
    ref = load_model(str(src))
    shutil.move(src, tmp_path / "gone")  # the checkpoint must not need its source
    got = load_model(str(out))
    assert got.source == str(out) and got.config == ref.config
    assert_bitwise_equal(got.params, ref.params)
    np.testing.assert_array_equal(logits_of(got.config, got.params, ids),
                                  logits_of(ref.config, ref.params, ids))

    # A second conversion into the same directory is refused (exit status 1, one-line message).
    proc = subprocess.run([sys.executable, "-m", "jaxinfer.launch.convert", "--model",
                           str(tmp_path / "gone"), "--output", str(out)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "not empty" in proc.stderr


def test_save_refuses_non_empty_dir(tmp_path):
    cfg, params = tiny("llama")
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        save_checkpoint(str(tmp_path), cfg, params)
    with pytest.raises(ValueError, match="not a jaxinfer checkpoint"):
        save_checkpoint(str(tmp_path), cfg, params, overwrite=True)
    assert (tmp_path / "keep.txt").exists()


@pytest.fixture
def saved(tmp_path):
    cfg, params = tiny("llama")
    save_checkpoint(str(tmp_path), cfg, params)
    return tmp_path


def edit_config(path, **changes):
    meta = json.loads((path / CONFIG_FILE).read_text())
    for key, value in changes.items():
        if key in meta["config"]:
            meta["config"][key] = value
        else:
            meta[key] = value
    (path / CONFIG_FILE).write_text(json.dumps(meta))


def test_corrupt_config(saved):
    (saved / CONFIG_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="cannot read checkpoint config"):
        load_checkpoint(str(saved))


@pytest.mark.parametrize("changes, needle", [
    ({"format_version": 99}, "format_version 99"),
    ({"num_kv_heads": 3}, "invalid model config"),
    ({"ffn_dim": 96}, "cannot restore params"),          # shapes no longer match the arrays
    ({"attention_bias": True}, "cannot restore params"),  # leaves the checkpoint lacks
    ({"tie_word_embeddings": True}, "cannot restore params"),  # a leaf the config lacks
])
def test_config_inconsistent_with_checkpoint(saved, changes, needle):
    edit_config(saved, **changes)
    with pytest.raises(ValueError, match=needle):
        load_checkpoint(str(saved))


# Orbax's failed reads can leave an asyncio callback behind that pytest reports as unraisable.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_missing_or_damaged_params(saved):
    data = [os.path.join(r, f) for r, _, fs in os.walk(saved / PARAMS_DIR / "d") for f in fs]
    assert data
    for f in data:
        with open(f, "r+b") as fh:
            fh.truncate(max(0, os.path.getsize(f) // 2))
    with pytest.raises(ValueError, match="cannot restore params"):
        load_checkpoint(str(saved))
    shutil.rmtree(saved / PARAMS_DIR)
    with pytest.raises(ValueError, match="has no params/"):
        load_checkpoint(str(saved))


@pytest.mark.slow
def test_convert_smollm2_gguf(tmp_path, smollm2_gguf):
    from jaxinfer.launch.convert import convert

    summary = convert(smollm2_gguf, str(tmp_path / "smollm2"))
    assert summary["has_tokenizer"] and summary["num_params"] > 100_000_000
    ref = load_model(smollm2_gguf)
    got = load_model(str(tmp_path / "smollm2"))
    assert got.config == ref.config
    assert_same_tokenizer(ref.tokenizer, got.tokenizer)
    ids = ref.tokenizer.encode("The capital of France is")
    np.testing.assert_array_equal(logits_of(got.config, got.params, ids),
                                  logits_of(ref.config, ref.params, ids))
