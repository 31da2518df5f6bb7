"""Multi-LoRA against an independent reference: for each family (tiny random checkpoints, float32)
an adapter's outputs equal the base model with the adapter merged into its weights
(W + scale * B A, computed in numpy in float64 and written as a new checkpoint), greedy
token-exact and log-probabilities within 1e-4. A batch mixing three adapters and the base gives
each row what it gets alone; adapters evicted and written back while requests run change
nothing and compile nothing; the prefix cache never shares pages across adapters; bad adapters
are refused before any device work, naming the file, field or tensor.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from lora_util import (HF_MODULES, merged, peft_tensors, read_weights, write_model,
                       write_peft)

import jaxinfer as ji
from jaxinfer.lora.adapters import AdapterError, from_peft_arrays, read_peft

TINY = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "tiny_models")
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
PROMPTS = [[1, 5, 9, 30, 41], [2, 7, 100], [3, 3, 3, 8, 120, 64, 9]]
LP_TOL = 1e-4  # float32 logprobs: the low-rank term against the merged weight's product


def _sp(**kw):
    return ji.SamplingParams(max_tokens=10, logprobs=3, ignore_eos=True, **kw)


def _same(got, want, tol=LP_TOL):
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        lp = [abs(g.logprobs[i][t] - w.logprobs[i][t]) for i, t in enumerate(g.token_ids)]
        assert max(lp) <= tol, max(lp)


@pytest.mark.parametrize("family, modules, r, alpha, rslora", [
    ("llama", tuple(HF_MODULES), 4, 8.0, False),
    ("qwen3", ("q_proj", "v_proj", "down_proj"), 8, 16.0, True),
    ("gemma3", tuple(HF_MODULES), 2, 4.0, False),
    ("qwen3_moe", ATTN, 4, 4.0, False),  # attention only: a MoE layer's experts are not adapted
])
def test_adapter_equals_merged_weights(tmp_path, family, modules, r, alpha, rslora):
    src = os.path.join(TINY, family)
    weights = read_weights(src)
    tensors = peft_tensors(weights, set(modules), r=r, seed=1)
    scale = alpha / (np.sqrt(r) if rslora else r)
    ref = ji.LLM(write_model(src, str(tmp_path / "merged"), merged(weights, tensors, scale)),
                 dtype="float32", max_seq_len=64, max_num_seqs=4)
    llm = ji.LLM(src, dtype="float32", max_seq_len=64, max_num_seqs=4, max_loras=1,
                 max_lora_rank=8)
    llm.load_lora("ad", write_peft(str(tmp_path / "ad"), tensors, r, alpha, modules, rslora))
    want = ref.generate(PROMPTS, [_sp(), _sp(temperature=0.8, seed=3), _sp()])
    got = llm.generate(PROMPTS, [_sp(), _sp(temperature=0.8, seed=3), _sp()], lora="ad")
    _same(got, want)
    base = llm.generate(PROMPTS, _sp())
    assert any(b.token_ids != g.token_ids for b, g in zip(base, got))


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    """The tiny Llama with three adapters (ranks 2, 4, 8; different targets), an engine that
    serves them from 2 slots, and each adapter's merged reference engine."""
    tmp = tmp_path_factory.mktemp("three")
    src = os.path.join(TINY, "llama")
    weights = read_weights(src)
    specs = {"a": (ATTN, 2, 4.0), "b": (("gate_proj", "up_proj", "down_proj"), 4, 4.0),
             "c": (tuple(HF_MODULES), 8, 32.0)}
    llm = ji.LLM(src, dtype="float32", max_seq_len=96, max_num_seqs=6, max_loras=2,
                 max_lora_rank=8, page_size=8)
    refs = {}
    for seed, (name, (modules, r, alpha)) in enumerate(specs.items()):
        tensors = peft_tensors(weights, set(modules), r=r, seed=10 + seed)
        llm.load_lora(name, write_peft(str(tmp / name), tensors, r, alpha, modules))
        refs[name] = ji.LLM(write_model(src, str(tmp / f"m_{name}"),
                                        merged(weights, tensors, alpha / r)),
                            dtype="float32", max_seq_len=96, max_num_seqs=6, page_size=8)
    return llm, refs


def test_a_mixed_batch_gives_each_row_its_own_answer(three):
    """Rows of three adapters and the base in one batch (more adapters than the 2 slots: the
    third waits for a slot) against each adapter's merged model alone."""
    llm, refs = three
    loras = ["a", None, "b", "c", "a", None]
    prompts = [PROMPTS[i % 3] for i in range(6)]
    params = [_sp(temperature=0.7, seed=i) if i % 2 else _sp() for i in range(6)]
    got = llm.generate(prompts, params, lora=loras)
    for i, name in enumerate(loras):
        if name is None:
            want = llm.generate(prompts[i], params[i])
        else:
            want = refs[name].generate(prompts[i], params[i])
        _same([got[i]], want)
    assert llm.stats()["lora_slot_writes"] >= 3


def test_swapping_adapters_while_requests_run_compiles_nothing(three, compile_recorder):
    """Requests of three adapters through two slots, added while others run: adapters are
    written over and back (slot writes), outputs equal each adapter alone, nothing compiles,
    no page stays in use."""
    llm, refs = three
    llm.generate(PROMPTS[0], _sp(), lora="a")  # every program ran once
    writes = llm.stats()["lora_slot_writes"]
    order = ["c", "a", "b", None, "c", "b", "a"]
    outs = {}

    def step():
        outs.update((o.request_id, o) for o in llm.step() if o.finished)

    with compile_recorder() as rec:
        ids = []
        for i, name in enumerate(order):
            ids.append(llm.add_request(PROMPTS[i % 3], _sp(), lora=name))
            step()
        while llm.has_unfinished_requests():
            step()
    assert rec.logs == [] and rec.events == []
    assert llm.stats()["lora_slot_writes"] > writes + 1
    assert llm.stats()["pages_used"] == 0
    for i, (rid, name) in enumerate(zip(ids, order)):
        engine = llm if name is None else refs[name]
        _same([outs[rid]], engine.generate(PROMPTS[i % 3], _sp()))


def test_the_prefix_cache_is_per_adapter(three):
    llm, refs = three
    prompt = list(range(1, 40))
    llm.generate(prompt, _sp())                         # the base model's pages, cached
    first = llm.generate(prompt, _sp(), lora="b")[0]
    assert first.metrics.prefix_cache_hit_tokens == 0   # not the base model's keys
    again = llm.generate(prompt, _sp(), lora="b")[0]
    assert again.metrics.prefix_cache_hit_tokens > 0    # its own
    _same([first], refs["b"].generate(prompt, _sp()))
    _same([again], [first])


def test_unload_and_list(three):
    llm, _ = three
    names = {a["name"] for a in llm.list_loras()}
    assert names == {"a", "b", "c"}
    with pytest.raises(ValueError, match="no LoRA adapter named 'zz'"):
        llm.generate(PROMPTS[0], _sp(), lora="zz")
    with pytest.raises(ValueError, match="already loaded"):
        llm.add_lora(llm._engine.loras.adapters["a"])
    rid = llm.add_request(PROMPTS[0], _sp(), lora="b")  # waiting: not yet admitted
    with pytest.raises(ValueError, match="in use by 1 unfinished"):
        llm.unload_lora("b")
    llm.abort(rid)


def test_save_and_load_in_jaxinfers_form(three, tmp_path):
    """save_lora writes an adapter with orbax; loaded back under another name it gives the
    same tokens and log-probabilities."""
    llm, refs = three
    llm.save_lora("c", str(tmp_path / "c_orbax"))
    llm.load_lora("c2", str(tmp_path / "c_orbax"))
    try:
        _same(llm.generate(PROMPTS, _sp(), lora="c2"), refs["c"].generate(PROMPTS, _sp()))
    finally:
        llm.unload_lora("c2")


def test_peft_arrays_are_read_as_written(tmp_path):
    from jaxinfer.models import get_model

    src = os.path.join(TINY, "llama")
    weights = read_weights(src)
    tensors = peft_tensors(weights, {"q_proj", "down_proj"}, r=3, seed=5)
    path = write_peft(str(tmp_path / "ad"), tensors, 3, 6.0, ("q_proj", "down_proj"), True)
    llm = ji.LLM(src, dtype="float32", max_seq_len=32, max_num_seqs=2, max_loras=1,
                 max_lora_rank=4)
    ad = read_peft("x", path, family=get_model("llama"), cfg=llm.model_config, max_rank=4)
    assert ad.rank == 3 and ad.scale == pytest.approx(6.0 / np.sqrt(3))
    assert set(ad.a) == {"wq", "w_down"}
    key = "base_model.model.model.layers.1.self_attn.q_proj"
    np.testing.assert_array_equal(ad.a["wq"][1], tensors[key + ".lora_A.weight"].T)
    np.testing.assert_array_equal(ad.b["wq"][1], tensors[key + ".lora_B.weight"].T)


def _bad(tensors, key, value=None):
    out = dict(tensors)
    if value is None:
        del out[key]
    else:
        out[key] = value
    return out


def test_bad_adapters_are_refused_naming_the_fault(tmp_path):
    from jaxinfer.models import get_model

    src = os.path.join(TINY, "llama")
    weights = read_weights(src)
    llm = ji.LLM(src, dtype="float32", max_seq_len=32, max_num_seqs=2, max_loras=1,
                 max_lora_rank=4)
    kw = dict(family=get_model("llama"), cfg=llm.model_config, max_rank=4)
    good = peft_tensors(weights, {"q_proj"}, r=2, seed=0)
    a_key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    cases = [
        (dict(tensors=_bad(good, a_key, np.zeros((2, 7), np.float32)), r=2), "shape"),
        (dict(tensors=_bad(good, a_key), r=2), "lora_A is missing"),
        (dict(tensors=_bad(good, a_key, np.full((2, 64), np.nan, np.float32)), r=2), "NaN"),
        (dict(tensors=good, r=8), "max_lora_rank"),
        (dict(tensors=_bad(good, "base_model.model.model.embed_tokens.lora_A.weight",
                           np.zeros((2, 256), np.float32)), r=2), "embed_tokens"),
        (dict(tensors=_bad(good, "base_model.model.model.layers.9.self_attn.q_proj."
                           "lora_A.weight", np.zeros((2, 64), np.float32)), r=2), "layer 9"),
        (dict(tensors=good, r=2, target_modules=["qkv"]), "target module 'qkv'"),
    ]
    for args, words in cases:
        args.setdefault("lora_alpha", 4.0)
        with pytest.raises(AdapterError, match=words):
            from_peft_arrays("x", **args, **kw)
    path = write_peft(str(tmp_path / "ok"), good, 2, 4.0, ("q_proj",))
    os.remove(os.path.join(path, "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="adapter_model.safetensors is missing"):
        llm.load_lora("x", path)
    path = write_peft(str(tmp_path / "dora"), good, 2, 4.0, ("q_proj",))
    with open(os.path.join(path, "adapter_config.json")) as f:
        text = f.read().replace('"use_dora": false', '"use_dora": true')
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        f.write(text)
    with pytest.raises(AdapterError, match="use_dora"):
        llm.load_lora("x", path)
    assert llm.list_loras() == [] and llm.stats()["lora_slot_writes"] == 0


def test_a_quantized_base_keeps_float_adapters(tmp_path):
    """int8 weights with a float adapter: an adapter whose B is zero gives the quantized base's
    tokens exactly; a real one changes them."""
    src = os.path.join(TINY, "llama")
    weights = read_weights(src)
    tensors = peft_tensors(weights, set(HF_MODULES), r=4, seed=2)
    zero_b = {k: (np.zeros_like(v) if "lora_B" in k else v) for k, v in tensors.items()}
    llm = ji.LLM(src, dtype="float32", quantization="int8", max_seq_len=48, max_num_seqs=2,
                 max_loras=2, max_lora_rank=4)
    llm.load_lora("zero", write_peft(str(tmp_path / "z"), zero_b, 4, 8.0, HF_MODULES))
    llm.load_lora("real", write_peft(str(tmp_path / "r"), tensors, 4, 8.0, HF_MODULES))
    base = llm.generate(PROMPTS, _sp())
    _same(llm.generate(PROMPTS, _sp(), lora="zero"), base, tol=0.0)
    real = llm.generate(PROMPTS, _sp(), lora="real")
    assert any(b.token_ids != r.token_ids for b, r in zip(base, real))


def test_lora_off_refuses_adapters():
    llm = ji.LLM(os.path.join(TINY, "llama"), max_seq_len=32, max_num_seqs=2)
    with pytest.raises(ValueError, match="max_loras"):
        llm.generate(PROMPTS[0], _sp(), lora="a")
    with pytest.raises(ValueError, match="max_lora_rank must be an int >= 1"):
        ji.LLM(os.path.join(TINY, "llama"), max_loras=1, max_lora_rank=0)


def test_default_dtype_matches_merged_weights(tmp_path):
    """At the defaults users get (bf16 weights, the native kernels on CPU; bf16 slots): the
    prompt's log-probabilities under an adapter against the merged checkpoint at the same
    defaults, teacher-forced so no sampled token can diverge. Tolerance 0.05 nats (both round
    weights to bf16, at different points); the adapter itself moves them far more."""
    src = os.path.join(TINY, "llama")
    weights = read_weights(src)
    tensors = peft_tensors(weights, set(HF_MODULES), r=4, seed=7)
    from jaxinfer import backends

    dtype = backends.default_dtype()  # what LLM() picks outside the test suite (bfloat16)
    ref = ji.LLM(write_model(src, str(tmp_path / "merged"), merged(weights, tensors, 2.0)),
                 dtype=dtype, max_seq_len=64, max_num_seqs=2)
    llm = ji.LLM(src, dtype=dtype, max_seq_len=64, max_num_seqs=2, max_loras=1,
                 max_lora_rank=4)
    llm.load_lora("ad", write_peft(str(tmp_path / "ad"), tensors, 4, 8.0, HF_MODULES))
    prompt = [1, 17, 40, 99, 3, 250, 61, 8, 8, 130, 77, 5, 201, 33, 12, 90]
    sp = ji.SamplingParams(max_tokens=1, prompt_logprobs=0)

    def scores(out):
        return np.array([lp[t] for lp, t in zip(out.prompt_logprobs[1:], prompt[1:])])

    got = scores(llm.generate(prompt, sp, lora="ad")[0])
    want = scores(ref.generate(prompt, sp)[0])
    base = scores(llm.generate(prompt, sp)[0])
    assert llm.dtype == "bfloat16"
    np.testing.assert_allclose(got, want, atol=0.05, rtol=0)
    assert np.abs(base - want).max() > 0.5
