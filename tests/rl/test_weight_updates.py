"""update_weights, sleep / wake_up and weight versions (docs/rl.md), on the tiny random Llama
in bfloat16 (the CPU default), one device. References are independent engines: a fresh LLM
loaded from a checkpoint of the new weights. Meshes: tests/test_sharding.py ("rl" worker)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from jaxinfer.loading import load_model
from jaxinfer.loading.checkpoint import save_checkpoint

TINY = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "tiny_models", "llama")
PROMPTS = [[132, 194, 243, 11, 39, 211], [130, 69, 8, 192], [186, 77, 139, 4, 4, 4, 4, 4, 4, 4,
                                                               9, 9, 9, 9, 9, 9, 9, 9, 1, 2]]
KW = dict(dtype="bfloat16", max_seq_len=128, max_num_seqs=4, page_size=8, decode_steps=2)
GREEDY = ji.SamplingParams(max_tokens=12, ignore_eos=True)


def perturbed(params, seed: int, size: float = 0.5):
    """params with every matrix moved by size * its std of noise (float32, the caller's)."""
    key = jax.random.key(seed)
    leaves, tree = jax.tree.flatten(params)
    out = [x + size * jnp.std(x) * jax.random.normal(jax.random.fold_in(key, i), x.shape)
           if x.ndim == 2 else x for i, x in enumerate(leaves)]
    return jax.tree.unflatten(tree, out)


@pytest.fixture(scope="module")
def source():
    return load_model(TINY, dtype=jnp.float32)


@pytest.fixture(scope="module")
def new_weights(source, tmp_path_factory):
    """(float32 perturbed tree, a fresh LLM loaded from its checkpoint)."""
    tree = perturbed(source.params, 1)
    path = str(tmp_path_factory.mktemp("ck") / "new")
    save_checkpoint(path, source.config, tree)
    return tree, ji.LLM(path, **KW)


def tokens(outs):
    return [o.token_ids for o in outs]


def test_update_equals_a_fresh_engine_and_compiles_nothing(source, new_weights,
                                                           compile_recorder):
    tree, fresh = new_weights
    llm = ji.LLM(TINY, **KW)
    before = llm.generate(PROMPTS, GREEDY)
    want = fresh.generate(PROMPTS, GREEDY)
    assert tokens(before) != tokens(want)  # the perturbation matters
    old_wq = llm.params.layers[0].wq
    assert llm.update_weights(tree) == []
    assert old_wq.is_deleted()  # the replaced buffers are freed
    assert not any(x.is_deleted() for x in jax.tree.leaves(tree))  # the caller's are not
    with compile_recorder() as rec:
        after = llm.generate(PROMPTS, GREEDY)
        llm.update_weights(tree)  # the second conversion of this layout: cached
        again = llm.generate(PROMPTS, GREEDY)
    assert rec.logs == [] and rec.events == []
    assert tokens(after) == tokens(want) == tokens(again)
    assert [o.weight_version for o in before] == [0] * 3
    assert [o.outputs[0].weight_versions for o in after] == [[(0, 1)]] * 3
    assert llm.weight_version == 2
    # A named subset (one layer's weights, float32 here, bf16 in the engine) swaps just those.
    back = {f"layers.1.{f}": getattr(source.params.layers[1], f)
            for f in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")}
    llm.update_weights(back)
    mixed = tree.replace(layers=(tree.layers[0], source.params.layers[1]))
    np.testing.assert_array_equal(np.asarray(llm.params.layers[1].wq, np.float32),
                                  np.asarray(source.params.layers[1].wq.astype(jnp.bfloat16),
                                             np.float32))
    np.testing.assert_array_equal(np.asarray(llm.params.layers[0].wq, np.float32),
                                  np.asarray(mixed.layers[0].wq.astype(jnp.bfloat16), np.float32))


@pytest.mark.parametrize("bad,msg", [
    ({"layers.9.wq": np.zeros((64, 64), np.float32)}, "not one of this model's"),
    ({"layers.0.wq": np.zeros((64, 32), np.float32)}, "has shape (64, 32); the model's is"),
    ({"layers.0.wq": np.zeros((64, 64), np.int32)}, "a float dtype is needed"),
    ({}, "nothing to update"),
    ([1, 2], "mapping of weight names"),
])
def test_bad_weights_are_refused_before_anything_changes(new_weights, bad, msg):
    _, llm = new_weights
    version, wq = llm.weight_version, llm.params.layers[0].wq
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        llm.update_weights(bad)
    assert llm.weight_version == version and llm.params.layers[0].wq is wq
    with pytest.raises(ValueError, match="mode must be one of"):
        llm.update_weights({"embed": np.zeros((256, 64), np.float32)}, mode="later")


def _running(llm, params=GREEDY):
    """Requests added and stepped until every one has generated a token or two."""
    ids = [llm.add_request(p, params) for p in PROMPTS]
    outs = {}
    for _ in range(6):
        for o in llm.step():
            outs[o.request_id] = o
        if len(outs) == 3 and all(o.token_ids for o in outs.values()):
            break
    assert all(o.token_ids and not o.finished for o in outs.values()) and len(outs) == 3
    return ids


def _drain(llm) -> dict:
    outs = {}
    while llm.has_unfinished_requests():
        outs.update((o.request_id, o) for o in llm.step())
    return outs


def test_modes_for_requests_in_flight(source, new_weights):
    tree, fresh = new_weights
    llm = ji.LLM(TINY, **KW)
    old = tokens(llm.generate(PROMPTS, GREEDY))
    new = tokens(fresh.generate(PROMPTS, GREEDY))

    # wait: they finish on the old weights, returned by the call.
    ids = _running(llm)
    done = {o.request_id: o for o in llm.update_weights(tree, mode="wait") if o.finished}
    assert [done[i].token_ids for i in ids] == old
    assert all(done[i].outputs[0].weight_versions == [(0, 0)] for i in ids)

    # abort: they end at once, with the tokens they had.
    llm.update_weights(source.params)
    ids = _running(llm)
    ended = {o.request_id: o for o in llm.update_weights(tree, mode="abort")}
    assert all(ended[i].finish_reason == "abort" for i in ids)
    assert all(old[k][:len(ended[i].token_ids)] == ended[i].token_ids for k, i in enumerate(ids))
    assert not llm.has_unfinished_requests()

    # restart: the same ids start over on the new weights.
    llm.update_weights(source.params)
    ids = _running(llm)
    assert llm.update_weights(tree, mode="restart") == []
    outs = _drain(llm)
    v = llm.weight_version
    assert [outs[i].token_ids for i in ids] == new
    assert all(outs[i].outputs[0].weight_versions == [(0, v)] for i in ids)

    # keep: the tokens so far stay; the KV is recomputed and the rest follows the new weights
    # (the same engine continuing from prompt + kept tokens).
    llm.update_weights(source.params)
    ids = _running(llm)
    kept = {i: list(llm._requests[i].token_ids) for i in ids}
    llm.update_weights(tree, mode="keep")
    v = llm.weight_version
    outs = _drain(llm)
    for k, i in enumerate(ids):
        got, n = outs[i].token_ids, len(kept[i])
        assert got[:n] == kept[i] == old[k][:n]
        assert outs[i].outputs[0].weight_versions == [(0, v - 1), (n, v)]
        cont = llm.generate([PROMPTS[k] + kept[i]],
                            ji.SamplingParams(max_tokens=12 - n, ignore_eos=True))[0]
        assert got[n:] == cont.token_ids
    assert llm.stats()["pages_used"] == 0


def test_prefix_cache_forgets_the_old_weights(new_weights, source):
    tree, _ = new_weights
    llm = ji.LLM(TINY, **KW)
    long = PROMPTS[2] * 2
    llm.generate([long], GREEDY)
    assert llm.generate([long], GREEDY)[0].metrics.prefix_cache_hit_tokens > 0
    llm.update_weights(tree)
    assert llm.generate([long], GREEDY)[0].metrics.prefix_cache_hit_tokens == 0
    assert llm.generate([long], GREEDY)[0].metrics.prefix_cache_hit_tokens > 0


def live_bytes() -> int:
    """Device bytes held by live arrays (CPU devices report no memory_stats)."""
    stats = jax.devices()[0].memory_stats()
    if stats and "bytes_in_use" in stats:
        return int(stats["bytes_in_use"])
    return sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted())


def test_sleep_frees_memory_and_wake_up_restores_it(new_weights, compile_recorder):
    tree, fresh = new_weights
    llm = ji.LLM(TINY, **KW)
    before = tokens(llm.generate(PROMPTS, GREEDY))
    pool = llm.stats()["state_bytes"]
    weights = llm.stats()["parameter_bytes"]
    awake = live_bytes()
    llm.sleep(level=1)
    assert awake - live_bytes() >= pool
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(PROMPTS, GREEDY)
    with pytest.raises(RuntimeError, match="asleep"):
        llm.add_request(PROMPTS[0], GREEDY)
    with compile_recorder() as rec:
        llm.wake_up()
        assert tokens(llm.generate(PROMPTS, GREEDY)) == before
        llm.sleep(level=2)  # weights to the host and back
        assert awake - live_bytes() >= pool + weights
        llm.wake_up()
        assert tokens(llm.generate(PROMPTS, GREEDY)) == before
    assert rec.logs == [] and rec.events == []
    # Level 2 without a host copy: only a whole tree brings weights back.
    llm.sleep(level=2, keep_weights=False)
    llm.wake_up()
    with pytest.raises(RuntimeError, match="update_weights"):
        llm.generate(PROMPTS, GREEDY)
    with pytest.raises(ValueError, match="needs all of them"):
        llm.update_weights({"embed": tree.embed})
    llm.update_weights(tree)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == tokens(fresh.generate(PROMPTS, GREEDY))
    with pytest.raises(ValueError, match="level must be 1 or 2"):
        llm.sleep(level=3)
    llm.add_request(PROMPTS[0], GREEDY)
    with pytest.raises(RuntimeError, match="no unfinished requests"):
        llm.sleep()
    _drain(llm)


def test_a_quantized_engine_quantizes_the_update(new_weights, tmp_path):
    """int8 weights: the update is quantized as loading quantizes (on the host), so the engine
    equals a fresh int8 engine of the new weights."""
    tree, _ = new_weights
    kw = dict(KW, quantization="int8")
    llm = ji.LLM(TINY, **kw)
    llm.update_weights(tree)
    path = str(tmp_path / "new")
    save_checkpoint(path, load_model(TINY).config, tree)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == tokens(ji.LLM(path, **kw).generate(
        PROMPTS, GREEDY))
