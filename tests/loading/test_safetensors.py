"""HF directory loader against tiny random HF models and their transformers logits.

tests/data/tiny_models/<name>/golden.npz holds input_ids [1, T] and the float32 logits
[1, T, V] that HF transformers (PyTorch, CPU, float32) computed for them. The loaded model must
reproduce them to max |diff| < 1e-4.
"""

import json
import os
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from jaxinfer.config import RopeScaling
from jaxinfer.loading.safetensors import (_SafetensorsFile, config_from_hf, eos_token_ids,
                                          load_hf_dir)
from jaxinfer.models import llama
from jaxinfer.models import sequence_logits

TINY = os.path.join(os.path.dirname(__file__), "..", "data", "tiny_models")
MODELS = ["llama", "llama3_rope", "qwen2", "mistral_sw", "llama_sharded"]
ATOL = 1e-4


def hf_logits(cfg, params, input_ids):
    """Logits [1, T, V] of one forward over all T tokens from an empty cache."""
    return np.asarray(sequence_logits(params, cfg, jnp.asarray(input_ids)))


@pytest.fixture(scope="module")
def loaded():
    return {name: load_hf_dir(os.path.join(TINY, name)) for name in MODELS}


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_transformers(loaded, name):
    cfg, weights = loaded[name]
    golden = np.load(os.path.join(TINY, name, "golden.npz"))
    params = llama.LLAMA.params_from_weights(cfg, weights, jnp.float32)
    logits = hf_logits(cfg, params, golden["input_ids"])
    assert logits.shape == golden["logits"].shape
    np.testing.assert_allclose(logits, golden["logits"], rtol=0, atol=ATOL)


def test_config_mapping(loaded):
    cfg = loaded["llama"][0]
    assert (cfg.architecture, cfg.vocab_size, cfg.d_model, cfg.num_layers) == ("llama", 256, 64, 2)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_dim) == (4, 2, 16, 128)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.max_position_embeddings) == (1, 2, 512)
    assert cfg.rope_scaling is None and cfg.sliding_window is None and not cfg.attention_bias
    assert not cfg.tie_word_embeddings and loaded["llama"][1]["lm_head"].shape == (64, 256)

    cfg, weights = loaded["llama3_rope"]
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 64)
    assert cfg.tie_word_embeddings and "lm_head" not in weights

    assert loaded["mistral_sw"][0].sliding_window == 8
    cfg, weights = loaded["qwen2"]
    assert cfg.attention_bias and cfg.sliding_window is None and cfg.rope_theta == 1e6
    assert weights["layers.1.bq"].shape == (64,) and weights["layers.1.bk"].shape == (32,)
    # Linear weights come transposed to [in, out].
    assert weights["layers.0.wk"].shape == (64, 32) and weights["layers.0.wo"].shape == (64, 64)
    assert all(w.dtype == np.float32 for w in weights.values())


BASE = {"model_type": "llama", "vocab_size": 32, "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 96}


def test_config_from_hf_legacy_keys_and_defaults():
    cfg = config_from_hf({**BASE, "rope_theta": 5e5, "eos_token_id": [7, 3, 9],
                          "rope_scaling": {"type": "llama3", "factor": 32.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 8192}})
    assert cfg.num_kv_heads == 4 and cfg.head_dim == 16 and cfg.rope_theta == 5e5
    assert cfg.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)
    assert cfg.eos_token_id == 7 and eos_token_ids({"eos_token_id": [7, 3, 9]}) == [7, 3, 9]
    assert config_from_hf({**BASE, "rope_scaling": None, "head_dim": None}).head_dim == 16
    assert config_from_hf({**BASE, "attention_bias": True}).attention_bias


def test_config_from_hf_sliding_window_rules():
    mistral = {**BASE, "model_type": "mistral"}
    assert config_from_hf({**mistral, "sliding_window": 4096}).sliding_window == 4096
    assert config_from_hf({**mistral, "sliding_window": None}).sliding_window is None
    qwen = {**BASE, "model_type": "qwen2", "sliding_window": 16, "max_window_layers": 0}
    assert config_from_hf({**qwen, "use_sliding_window": False}).sliding_window is None
    assert config_from_hf({**qwen, "use_sliding_window": True}).sliding_window == 16
    assert config_from_hf({**qwen, "use_sliding_window": True,
                           "max_window_layers": 2}).sliding_window is None
    with pytest.raises(ValueError, match="mixed sliding"):
        config_from_hf({**qwen, "use_sliding_window": True, "max_window_layers": 1})


@pytest.mark.parametrize("change, needle", [
    ({"model_type": "gpt2"}, "'gpt2'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"hidden_act": "gelu"}, "'gelu'"),
    ({"num_key_value_heads": 3}, "num_kv_heads 3"),
    ({"hidden_size": None}, "hidden_size"),
])
def test_config_from_hf_rejects(change, needle):
    with pytest.raises(ValueError, match=needle):
        config_from_hf({**BASE, **change}, "some/config.json")


@pytest.fixture
def llama_copy(tmp_path):
    dst = tmp_path / "llama"
    shutil.copytree(os.path.join(TINY, "llama"), dst)
    return dst


def test_bf16_and_f16_tensors_load(llama_copy, loaded):
    st = llama_copy / "model.safetensors"
    tensors = safetensors.numpy.load_file(str(st))
    dtypes = [ml_dtypes.bfloat16, np.float16]
    mixed = {k: v.astype(dtypes[i % 2]) for i, (k, v) in enumerate(sorted(tensors.items()))}
    safetensors.numpy.save_file(mixed, str(st))
    cfg, weights = load_hf_dir(str(llama_copy))
    ref = loaded["llama"][1]
    assert weights.keys() == ref.keys()
    seen = set()
    for k, w in weights.items():
        assert w.dtype == np.float32
        # Exactly the float32 weights rounded to the stored dtype: nothing lost on conversion.
        match = [dt for dt in dtypes if np.array_equal(w, ref[k].astype(dt).astype(np.float32))]
        assert match, k
        seen.update(match)
    assert len(seen) == 2


def test_missing_dir_and_config(tmp_path, llama_copy):
    with pytest.raises(ValueError, match="does not exist"):
        load_hf_dir(str(tmp_path / "nope"))
    os.remove(llama_copy / "config.json")
    with pytest.raises(ValueError, match="no config.json"):
        load_hf_dir(str(llama_copy))


def test_no_safetensors(llama_copy):
    os.remove(llama_copy / "model.safetensors")
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        load_hf_dir(str(llama_copy))


@pytest.mark.parametrize("keep, needle", [(4, "truncated"), (200, "truncated or corrupt"),
                                          (-1000, "is truncated: tensor")])
def test_truncated_safetensors(llama_copy, keep, needle):
    st = llama_copy / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[:keep])
    with pytest.raises(ValueError, match=needle) as e:
        load_hf_dir(str(llama_copy))
    assert "model.safetensors" in str(e.value)


def test_corrupt_header(llama_copy):
    st = llama_copy / "model.safetensors"
    data = bytearray(st.read_bytes())
    data[8:12] = b"\xff\xfe!!"
    st.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="corrupt header"):
        load_hf_dir(str(llama_copy))


def test_missing_tensor_and_shape_mismatch(llama_copy):
    st = str(llama_copy / "model.safetensors")
    tensors = safetensors.numpy.load_file(st)
    safetensors.numpy.save_file(
        {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}, st)
    with pytest.raises(ValueError, match="lacks tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_hf_dir(str(llama_copy))
    tensors["model.norm.weight"] = np.ones(65, np.float32)
    safetensors.numpy.save_file(tensors, st)
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(65,\)"):
        load_hf_dir(str(llama_copy))


def test_unsupported_model_type(llama_copy):
    path = llama_copy / "config.json"
    hf = json.loads(path.read_text())
    path.write_text(json.dumps({**hf, "model_type": "gemma"}))
    with pytest.raises(ValueError, match="unsupported model_type 'gemma'"):
        load_hf_dir(str(llama_copy))


def test_sharded_index_errors(tmp_path):
    dst = tmp_path / "sharded"
    shutil.copytree(os.path.join(TINY, "llama_sharded"), dst)
    os.remove(dst / "model-00003-of-00003.safetensors")
    with pytest.raises(ValueError, match="model-00003-of-00003.safetensors' does not exist"):
        load_hf_dir(str(dst))


# -- crafted files --------------------------------------------------------------------------------

def write_raw(path, header: dict, data: bytes = b"", length: int | None = None):
    """A .safetensors file of `header` (JSON) and `data`; `length` overrides the header's
    8-byte length field."""
    raw = json.dumps(header).encode()
    path.write_bytes((len(raw) if length is None else length).to_bytes(8, "little") + raw + data)


@pytest.mark.parametrize("header, length, needle", [
    ({}, 2**40, f"header length {2**40} bytes exceeds the format's limit of 100000000"),
    ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}, None,
     r"tensor 'w' has data_offsets \[-4, 0\].*0 <= begin <= end"),
    ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}}, None,
     r"tensor 'w' has data_offsets \[8, 4\]"),
    ({"w": {"dtype": "F32", "shape": [-1, -2], "data_offsets": [0, 8]}}, None,
     r"shape \(-1, -2\).*dimensions be >= 0"),
    ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, None,
     r"tensor 'w' has 8 bytes for shape \(3,\) F32, which takes 12"),
    ({"w": {"dtype": "I64", "shape": [2], "data_offsets": [0, 8]}}, None,
     r"tensor 'w' has 8 bytes for shape \(2,\) I64, which takes 16"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, None,
     r"tensor 'b' at data_offsets \[4, 12\] overlaps tensor 'a', which ends at 8"),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, None,
     "is truncated: tensor 'w' ends at byte"),
])
def test_crafted_headers_are_refused(tmp_path, header, length, needle):
    path = tmp_path / "model.safetensors"
    write_raw(path, header, bytes(12), length)
    with pytest.raises(ValueError, match=needle) as e:
        _SafetensorsFile(str(path))
    assert str(path) in str(e.value)


def test_empty_tensors_may_share_an_offset(tmp_path):
    path = tmp_path / "model.safetensors"
    write_raw(path, {"e": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]},
                     "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8))
    assert set(_SafetensorsFile(str(path)).entries) == {"e", "w"}


@pytest.fixture
def sharded(tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(os.path.join(TINY, "llama_sharded"), dst)
    return dst


def point_first_tensor_at(model_dir, fname):
    """The index's first tensor placed in `fname` instead."""
    index = model_dir / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    name = next(iter(data["weight_map"]))
    data["weight_map"][name] = fname
    index.write_text(json.dumps(data))


@pytest.mark.parametrize("fname, needle", [
    ("../evil.safetensors", "resolves to .*evil.safetensors', outside the model directory"),
    ("sub/../../evil.safetensors", "outside the model directory"),
    ("/etc/passwd", "'/etc/passwd'; it must be a relative path inside the model directory"),
    (["a"], r"\['a'\]; it must be a relative path"),
])
def test_weight_map_names_outside_the_directory_are_refused(sharded, fname, needle):
    # A valid file there, so that only where it lies is wrong.
    shutil.copy(sharded / "model-00003-of-00003.safetensors", sharded.parent / "evil.safetensors")
    point_first_tensor_at(sharded, fname)
    with pytest.raises(ValueError, match=needle) as e:
        load_hf_dir(str(sharded))
    assert "model.safetensors.index.json' weight_map names tensor file" in str(e.value)


def test_symlinks_out_of_the_directory_are_refused(sharded, tmp_path):
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(sharded / "model-00003-of-00003.safetensors", outside)
    os.symlink(outside, sharded / "model-00003-of-00003.safetensors")
    with pytest.raises(ValueError, match="elsewhere.safetensors', outside the model directory"):
        load_hf_dir(str(sharded))
    os.remove(sharded / "model.safetensors.index.json")  # the files found by listing: alike
    with pytest.raises(ValueError, match="elsewhere.safetensors', outside the model directory"):
        load_hf_dir(str(sharded))


def test_hub_cache_snapshot_links_into_its_blobs(tmp_path):
    """Hugging Face's hub cache: snapshots/<revision>/<file> links to ../../blobs/<hash>."""
    repo = tmp_path / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    shutil.copytree(os.path.join(TINY, "llama_sharded"), snapshot)
    blobs.mkdir()
    for f in os.listdir(snapshot):
        shutil.move(snapshot / f, blobs / f"hash-{f}")
        os.symlink(os.path.join("..", "..", "blobs", f"hash-{f}"), snapshot / f)
    cfg, weights = load_hf_dir(str(snapshot))
    assert cfg.num_layers == 2 and weights["embed"].shape == (256, 64)
