"""Quantized weights and a quantized KV cache on meshes of simulated CPU devices.

A random model (6 query heads, 3 kv heads, so tensor 3 splits it) saved as an orbax checkpoint
and quantized at load, served on one device and on (data, tensor, sequence) = (1, 3, 1) and
(2, 1, 2) meshes; also float weights with an int8 KV cache, on the (2, 1, 2) mesh. Reference:
the same model and settings on one device; greedy tokens equal and their logprobs within 1e-5
(float32 summed in another order across shards, as in tests/test_sharding.py). The quantized
weights' codes and scales split like the float weight: column-parallel wq on its output axis,
row-parallel wo on its input axis, a device holding a third of the quantized bytes (norms
aside); the KV pool's codes and scales split over its slots (data, sequence) and kv heads
(tensor).

The runs happen in a subprocess (`python tests/test_quant_mesh.py`): the device count is fixed
when jax starts.
"""

import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # compiles an LLM per mesh and variant (about 50 s)

HERE = os.path.dirname(os.path.abspath(__file__))
MESHES = {"1,3,1": (1, 3, 1), "2,1,2": (2, 1, 2)}   # (data, tensor, sequence)
VARIANTS = {"int8": {"quantization": "int8"},
            "int4_kv8": {"quantization": "int4", "kv_cache_dtype": "int8"}}
# Float weights (the default dtype) with an int8 KV cache: the cache's path without quantized
# weights, on one mesh only (each run compiles an LLM of its own).
KV_ONLY, KV_ONLY_MESH = {"kv_cache_dtype": "int8"}, "2,1,2"
KV_FP8 = {"kv_cache_dtype": "fp8"}  # the same with float8 codes (kept as uint8 bits on CPU)


def _spec(array) -> str:
    """The array's PartitionSpec without trailing Nones (jit outputs print theirs trimmed,
    placed arrays in full)."""
    spec = list(getattr(array.sharding, "spec", None) or ())
    while spec and spec[-1] is None:
        spec.pop()
    return str(tuple(spec))


def _specs(w) -> dict:
    """The specs of a quantized weight's codes and scales, or of a float weight ("w")."""
    if hasattr(w, "q"):
        return {k: _spec(getattr(w, k)) for k in ("q", "scale")}
    return {"w": _spec(w)}


def _device0_share(layers):
    """Bytes of the layers' quantized weights (codes, scales, offsets) on device 0 over
    their whole size (None without quantized weights)."""
    import jax

    from jaxinfer.quant import QuantizedWeight

    dev = jax.devices()[0]
    local = total = 0
    for lp in layers:
        for w in vars(lp).values():
            if isinstance(w, QuantizedWeight):
                for leaf in jax.tree.leaves(w):
                    total += leaf.nbytes
                    local += sum(s.data.nbytes for s in leaf.addressable_shards
                                 if s.device == dev)
    return local / total if total else None


def worker() -> dict:
    import jax

    import jaxinfer as ji
    from jaxinfer.config import ModelConfig
    from jaxinfer.loading.checkpoint import save_checkpoint
    from jaxinfer.models import llama

    cfg = ModelConfig("llama", vocab_size=256, d_model=96, num_layers=2, num_heads=6,
                      num_kv_heads=3, head_dim=16, ffn_dim=192, max_position_embeddings=128)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 17, 33, 2)]
    params = ji.SamplingParams(max_tokens=12, logprobs=1)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(tmp, cfg, llama.LLAMA.init_params(cfg, jax.random.key(0)))
        runs = [(variant, kw, name) for variant, kw in VARIANTS.items()
                for name in ("single", *MESHES)]
        runs += [("float_kv8", KV_ONLY, name) for name in ("single", KV_ONLY_MESH)]
        runs += [("float_kv_fp8", KV_FP8, name) for name in ("single", KV_ONLY_MESH)]
        for variant, kw, mesh_name in runs:
            mesh_kw = {}
            if mesh_name in MESHES:
                data, tensor, sequence = MESHES[mesh_name]
                mesh_kw = {"mesh": ji.MeshConfig(data=data, tensor=tensor, sequence=sequence)}
            llm = ji.LLM(tmp, max_seq_len=64, max_num_seqs=4, **kw, **mesh_kw)
            outs = llm.generate(prompts, params)
            eng = llm._engine
            layer = eng.params.layers[0]
            out[f"{variant} {mesh_name}"] = {
                "tokens": [o.token_ids for o in outs],
                "logprobs": [[lp[t] for lp, t in zip(o.logprobs, o.token_ids)]
                             for o in outs],
                "wq": _specs(layer.wq),
                "wo": _specs(layer.wo),
                "kinds": [getattr(layer.wq, "kind", None),
                          getattr(eng.params.embed, "kind", None)],
                "layer_share": _device0_share(eng.params.layers),
                "cache": {k: (_spec(getattr(eng.state.cache.k, k)),
                              str(getattr(eng.state.cache.k, k).dtype))
                          for k in ("codes", "scale")}
                if kw.get("kv_cache_dtype") else None,
            }
            del llm, eng, layer
            jax.clear_caches()
    return out


@pytest.fixture(scope="module")
def runs() -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("mesh", list(MESHES))
def test_quantized_model_on_a_mesh_gives_one_devices_tokens(runs, variant, mesh):
    one, got = runs[f"{variant} single"], runs[f"{variant} {mesh}"]
    assert got["kinds"] == one["kinds"] == [variant[:4]] * 2  # linears and embedding
    assert got["tokens"] == one["tokens"]
    for a, b in zip(got["logprobs"], one["logprobs"]):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    tensor = mesh == "1,3,1"
    col, row = ("(None, 'tensor')", "('tensor',)") if tensor else ("()", "()")
    assert got["wq"] == {"q": col, "scale": col}
    assert got["wo"] == {"q": row, "scale": row}   # wo's 3 groups of 32 inputs: one a device
    # Every quantized array splits 3 ways on tensor (group boundaries fall on shard ones).
    assert got["layer_share"] == (1 / 3 if tensor else 1.0)
    if variant == "int4_kv8":
        pool = "(None, None, 'tensor')" if tensor else "(None, ('data', 'sequence'))"
        assert got["cache"] == {"codes": [pool, "int8"], "scale": [pool, "float32"]}


@pytest.mark.parametrize("kv,stored", [("kv8", "int8"), ("kv_fp8", "uint8")])
def test_quantized_kv_cache_with_float_weights_on_a_mesh_gives_one_devices_tokens(runs, kv,
                                                                                   stored):
    """int8 codes, and float8 codes kept as their uint8 bits (the CPU backend's storage)."""
    one, got = runs[f"float_{kv} single"], runs[f"float_{kv} {KV_ONLY_MESH}"]
    assert got["kinds"] == one["kinds"] == [None, None]  # float weights
    assert got["wq"] == {"w": "()"}                       # replicated: no tensor axis
    assert got["tokens"] == one["tokens"]
    for a, b in zip(got["logprobs"], one["logprobs"]):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    pool = "(None, ('data', 'sequence'))"
    assert got["cache"] == {"codes": [pool, stored], "scale": [pool, "float32"]}
    assert one["cache"]["codes"][1] == stored


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(HERE))
    print(json.dumps(worker()))
