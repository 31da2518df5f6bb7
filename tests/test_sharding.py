"""Sharding over meshes of simulated CPU devices.

The rules and kv-head replication are checked here in process (one CPU device); everything on
a mesh runs in a subprocess with 8 simulated devices (tests/multidevice_worker.py), since the
device count is fixed when jax starts. References: HF transformers' greedy goldens
(tests/data/smollm2_greedy.json) for the real model, the same model on one device for a random
one (float32: logprobs within 1e-5, tokens equal), exact byte counts for placement.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from jaxinfer import sharding
from jaxinfer.config import MeshConfig, ModelConfig
from jaxinfer.models import llama
from jaxinfer.models import sequence_logits

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = ModelConfig("llama", vocab_size=97, d_model=32, num_layers=2, num_heads=8, num_kv_heads=2,
                   head_dim=8, ffn_dim=48, max_position_embeddings=64)


@pytest.mark.slow
def test_hybrid_cache_on_meshes():
    """A hybrid KV cache (tiny Gemma 3, the ring wrapping) on (data 2, tensor 2) and (data 2,
    sequence 2) meshes: one device's greedy tokens and logprobs (1e-5), the ring's slots split
    over data and sequence like the pool's pages."""
    got = run_worker("hybrid")
    one = got["single"]
    assert one["ring_slots"] == 23
    for name in ("data2_tensor2", "data2_seq2"):
        assert got[name]["tokens"] == one["tokens"], name
        np.testing.assert_allclose(got[name]["logprobs"], one["logprobs"], atol=1e-5, rtol=0)
    assert _spec(got["data2_seq2"]["ring_spec"]) == (None, ("data", "sequence"))


@pytest.mark.slow
def test_lora_adapters_on_meshes():
    """Rows of two LoRA adapters and the base in one batch on (tensor 2) and (data 2) meshes:
    one device's tokens and logprobs (1e-5); the slots' A and B split over tensor along their
    base weight's input and output axes."""
    got = run_worker("lora")
    one = got["single"]
    for name in ("tensor2", "data2"):
        assert got[name]["tokens"] == one["tokens"], name
        np.testing.assert_allclose(got[name]["logprobs"], one["logprobs"], atol=1e-5, rtol=0)
    assert _spec(got["tensor2"]["a_spec"]) == ()  # wq's input (embed) is not split
    assert _spec(got["tensor2"]["b_spec"]) == (None, "tensor")  # its output: q heads


@pytest.mark.slow
def test_weight_updates_on_a_callers_meshes():
    """LLM(mesh=<the caller's jax Mesh>, mesh_axes=) on (tensor 2), (data 2) and (tensor 4:
    kv heads repeated) views of 8 simulated devices; update_weights from a float32 tree the
    caller sharded on other devices, and on the engine's own in another layout: greedy tokens
    equal a fresh LLM of the new weights on the same mesh, nothing compiles after the first
    update of a layout; a LoRA update's log-probs equal sequence_logits(lora=) (1e-4)."""
    got = run_worker("rl")
    for name, r in got.items():
        assert r["before"] != r["want"], name
        assert r["after"] == r["again"] == r["shared"] == r["want"], name
        assert r["compiles"] == [], (name, r["compiles"])
        assert r["version"] == 4, name
    assert got["tensor2"]["wk_devices"] == [0, 1] and _spec(got["tensor2"]["wk_spec"]) == (
        None, "tensor")
    assert _spec(got["data2"]["wk_spec"]) == ()
    assert got["tensor4"]["kv_heads"] == 4 and got["tensor4"]["wk_devices"] == [0, 1, 2, 3]
    assert got["tensor2"]["lora_logprob_error"] < 1e-4


def test_a_callers_mesh_is_viewed_under_jaxinfers_axes():
    from jax.sharding import Mesh

    from jaxinfer import sharding
    dev = np.array(jax.devices()[:1])
    view = sharding.view_mesh(Mesh(dev.reshape(1, 1), ("fsdp", "model")),
                              {"data": "fsdp", "tensor": "model"})
    assert view.axis_names == sharding.MESH_AXES and dict(view.shape) == {
        "data": 1, "sequence": 1, "tensor": 1}
    for axes, msg in (({"pipeline": "fsdp"}, "not one of jaxinfer's axes"),
                      ({"data": "batch"}, "names axis 'batch'"),
                      ({"data": "fsdp", "tensor": "fsdp"}, "mapped twice"),
                      ([("data", "fsdp")], "must be a dict")):
        with pytest.raises(ValueError, match=msg):
            sharding.view_mesh(Mesh(dev.reshape(1, 1), ("fsdp", "model")), axes)
    with pytest.raises(ValueError, match="mesh_axes maps the axes of a jax.sharding.Mesh"):
        ji.LLM("smollm2-135m", mesh_axes={"data": "fsdp"})


def _spec(text: str) -> tuple:
    """A printed PartitionSpec as a tuple without trailing Nones: jit outputs print their
    specs trimmed (P(None, 'data')), placed arrays in full (P(None, 'data', None))."""
    items = list(eval(text, {"P": jax.sharding.PartitionSpec}))  # noqa: S307 (our own strings)
    while items and items[-1] is None:
        items.pop()
    return tuple(items)


def run_worker(mode: str, devices: int = 8, timeout: int = 900) -> dict:
    # The suite's own XLA flags (tests/conftest.py) and the simulated devices.
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    env = dict(os.environ, XLA_FLAGS=flags.strip())
    proc = subprocess.run([sys.executable, os.path.join(HERE, "multidevice_worker.py"), mode],
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_spec_for_maps_logical_axes_and_replicates_what_does_not_divide():
    mesh = {"data": 2, "sequence": 2, "tensor": 3}
    P = jax.sharding.PartitionSpec
    assert sharding.spec_for((576, 576), ("embed", "q_heads"), mesh) == P(None, "tensor")
    assert sharding.spec_for((49152, 576), ("vocab", "embed"), mesh) == P("tensor", None)
    assert sharding.spec_for((49153, 576), ("vocab", "embed"), mesh) == P(None, None)
    assert sharding.spec_for((4, 7), ("batch", "vocab"), mesh) == P("data", None)
    assert sharding.spec_for((1, 7), ("batch", "vocab"), mesh) == P(None, None)
    # The pool's slots split over data and sequence together.
    assert sharding.spec_for((30, 64, 3, 64), ("layers", "pages", "kv_heads", "head_dim"),
                             mesh) == P(None, ("data", "sequence"), "tensor", None)
    assert sharding.spec_for((30, 64), ("layers", "pages"), {"data": 1, "sequence": 2,
                                                             "tensor": 1}) == P(None, "sequence")
    # A mesh axis is used once per array.
    assert sharding.spec_for((6, 6), ("q_heads", "ffn"), mesh) == P("tensor", None)
    with pytest.raises(ValueError, match="unknown logical axis 'heads'"):
        sharding.spec_for((4,), ("heads",), mesh)
    with pytest.raises(ValueError, match="differ in rank"):
        sharding.spec_for((4, 4), ("embed",), mesh)


def test_tensor_degree_must_split_the_model():
    smol = TINY.replace(num_heads=9, num_kv_heads=3, ffn_dim=1152)
    sharding.check_divisible(smol, MeshConfig(tensor=3))
    sharding.check_divisible(smol, MeshConfig(tensor=9))   # kv heads replicated 3x
    with pytest.raises(ValueError, match="tensor degree 2 does not divide the 9 query heads"):
        sharding.check_divisible(smol, MeshConfig(tensor=2))
    with pytest.raises(ValueError, match="tensor degree 3 does not divide the FFN width 1000"):
        sharding.check_divisible(smol.replace(ffn_dim=1000), MeshConfig(tensor=3))
    with pytest.raises(ValueError, match="tensor degree 6 neither divides the 4 kv heads"):
        sharding.check_divisible(TINY.replace(num_heads=12, num_kv_heads=4), MeshConfig(tensor=6))


def test_bad_meshes_raise_before_loading():
    with pytest.raises(ValueError, match=r"needs 6 devices; 1 are available"):
        sharding.make_mesh(MeshConfig(data=2, tensor=3))
    with pytest.raises(ValueError, match="needs 2 devices; 1 are available"):
        ji.LLM("smollm2-135m", mesh=ji.MeshConfig(tensor=2))
    with pytest.raises(ValueError, match="max_num_seqs 5 is not a multiple of the data degree 2"):
        ji.LLM("smollm2-135m", max_num_seqs=5, mesh=ji.MeshConfig(data=2))
    with pytest.raises(ValueError, match="mesh must be a ji.MeshConfig"):
        ji.LLM("smollm2-135m", mesh=(1, 2, 1))
    with pytest.raises(ValueError, match="MeshConfig.tensor must be a positive int, got 0"):
        ji.MeshConfig(tensor=0)


def test_replicated_kv_heads_compute_the_same_model():
    """Repeating each kv head tensor // K times (host weights, numpy) leaves the logits equal:
    query head n reads a copy of the kv head it read before."""
    params = llama.LLAMA.init_params(TINY, jax.random.key(1))
    weights = {}
    for i, lp in enumerate(params.layers):
        for field, value in vars(lp).items():
            if value is not None:
                weights[f"layers.{i}.{field}"] = np.asarray(value)
    weights.update(embed=np.asarray(params.embed), final_norm=np.asarray(params.final_norm),
                   lm_head=np.asarray(params.lm_head))
    cfg4, weights4 = sharding.replicate_kv_heads(TINY, weights, tensor=8)
    assert cfg4.num_kv_heads == 8 and weights4["layers.0.wk"].shape == (32, 64)
    tokens = jnp.asarray([np.random.default_rng(0).integers(0, 97, 20)], jnp.int32)
    want = sequence_logits(params, TINY, tokens)
    got = sequence_logits(llama.LLAMA.params_from_weights(cfg4, weights4), cfg4, tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
    assert sharding.replicate_kv_heads(TINY, weights, tensor=2) == (TINY, weights)


def test_llama3_8b_and_70b_fit_80gb_per_device_on_8_way_tensor_parallelism():
    """Per-device bytes from the shardings of abstract params and a paged cache of 64 x 8,192
    tokens (bfloat16): weights split 8 ways but the norms; the cache 8 ways by kv head."""
    got = run_worker("big")
    for name, r in got.items():
        assert r["params_device"] == pytest.approx(r["params_total"] / 8, rel=1e-3), name
        assert r["state_device"] == pytest.approx(r["state_total"] / 8, rel=1e-3), name
        assert r["params_device"] + r["state_device"] < 80e9, (name, r)
    assert got["llama-3-70b"]["params_device"] > 17e9  # 141 GB of bf16 weights / 8


def test_kv_heads_fewer_than_the_tensor_degree_are_replicated():
    """A random model with 2 kv heads on a 4-way tensor mesh, restored from orbax straight into
    its shardings: each device holds a whole copy of one kv head; greedy tokens and their
    logprobs equal the single-device run."""
    got = run_worker("kvrep")
    one, four = got["single"], got["tensor4"]
    assert (one["kv_heads"], four["kv_heads"]) == (2, 4)
    assert four["wk_spec"] == "P(None, 'tensor')"
    assert four["tokens"] == one["tokens"]
    np.testing.assert_allclose(four["logprobs"], one["logprobs"], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_meshes_give_the_golden_greedy_tokens(data_dir):
    """SmolLM2 (9 query heads, 3 kv heads) on (data, tensor, sequence) = (2,3,1) and (2,1,2):
    the 15 HF greedy goldens, parameters split 3 ways under tensor=3, the pool split over data
    and sequence, and nothing compiled after warmup on a (2,3,1) mesh, a row under a JSON
    schema included."""
    import jsonschema

    with open(os.path.join(data_dir, "smollm2_greedy.json")) as f:
        cases = json.load(f)["cases"]
    got = run_worker("meshes")
    assert set(got["runs"]) == {"2,3,1", "2,1,2"}
    for mesh, run in got["runs"].items():
        for case, tokens, finish in zip(cases, run["tokens"], run["finish"], strict=True):
            want = case["greedy_ids"][:-1] if case["hit_eos"] else case["greedy_ids"]
            assert tokens == want, (mesh, case["name"])
            assert finish == ("stop" if case["hit_eos"] else "length")
        d, t, s = map(int, mesh.split(","))
        share = run["param_bytes_device0"] / run["param_bytes_total"]
        if t == 3:  # all but the norms (0.03% of the bytes) split over tensor
            assert share == pytest.approx(1 / 3, rel=2e-3), mesh
            assert (run["wq_spec"], run["wo_spec"], run["embed_spec"]) == (
                "P(None, 'tensor')", "P('tensor', None)",
                "P('tensor', None)")
        else:
            assert share == 1.0
        pool = {(1, 1): "None", (2, 1): "'data'", (1, 2): "'sequence'",
                (2, 2): "('data', 'sequence')"}[d, s]
        heads = "'tensor'" if t == 3 else "None"
        assert _spec(run["pool_spec"]) == _spec(f"P(None, {pool}, {heads}, None)"), mesh
        assert _spec(run["rows_spec"]) == _spec("P('data',)" if d == 2 else "P(None,)")
    assert got["bad_tensor"] == "tensor degree 2 does not divide the 9 query heads"
    assert got["compiles_after_warmup"] == []
    # A row under a JSON schema beside the others on the (2,3,1) mesh.
    from multidevice_worker import STRUCTURED_SCHEMA

    assert got["structured"]["finish"] == "stop", got["structured"]
    jsonschema.validate(json.loads(got["structured"]["text"]), STRUCTURED_SCHEMA)


def test_pallas_kernels_run_under_shard_map_on_a_mesh():
    """attention="pallas" (flash prefill, paged decode; interpret mode) on a (data 2, tensor 2)
    mesh, each kernel under jax.shard_map over batch rows and heads: the greedy tokens and
    logprobs of the reference attention on one device (float32, 1e-5)."""
    got = run_worker("kernels")
    one, mesh = got["single"], got["pallas_mesh"]
    assert mesh["attention"] == "pallas" and mesh["wk_spec"] == "P(None, 'tensor')"
    assert got["kernel_shard_map"]
    assert mesh["tokens"] == one["tokens"]
    np.testing.assert_allclose(mesh["logprobs"], one["logprobs"], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_sequence_parallelism_splits_prefill_and_matches_one_device():
    """Sequence meshes: ring and all-gather context-parallel attention equal the reference
    (float32, 1e-5); a random model served with its prefill tokens split over `sequence`
    (and rows over `data`) gives one device's greedy tokens and logprobs (1e-5); on a (data 2,
    sequence 2) mesh every request's KV pages are held by its own replica's devices; draft-model
    speculation on a (data 2, tensor 2) mesh gives the same greedy tokens; and a prefill
    chunk's per-device FLOPs halve on 2 sequence devices (the matmuls split; measured 0.50,
    bounded by 0.55 for the replicated norms and head)."""
    got = run_worker("context")
    for name, err in got["attention"].items():
        assert err < 1e-5, name
    one = got["runs"]["single"]
    for name in ("seq2", "data2_seq2"):
        run = got["runs"][name]
        assert run["tokens"] == one["tokens"], name
        np.testing.assert_allclose(run["logprobs"], one["logprobs"], atol=1e-5, rtol=0)
    # Draft-model speculation on a (data 2, tensor 2) mesh, the draft sharded like the target.
    draft = got["runs"]["draft_data2_tensor2"]
    assert draft["tokens"] == one["tokens"]
    assert draft["draft_wq_spec"] == "P(None, 'tensor')"
    # Data parallelism over a paged pool: every request's pages sit on its slot's replica.
    pages = got["replica_pages"]
    assert pages["tokens"] == [12] * 6 and len(pages["requests"]) == 6
    assert {r["replica"] for r in pages["requests"]} == {0, 1}
    for r in pages["requests"]:
        assert r["page_holders"] == [r["replica"]], r
    flops = got["prefill_flops"]
    assert float(flops["2"]) / float(flops["1"]) < 0.55, flops
