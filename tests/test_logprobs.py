"""logprobs and prompt_logprobs on the real model.

Independent checks: the first generated token's top log-probabilities against HF transformers'
last-position logits (tests/data/smollm2_greedy.json: top-10 values minus logsumexp), and prompt
log-probabilities, computed chunk by chunk by the engine, against one full scoring forward.
Tolerance 2e-3 (float32 logits of O(10), compared after log_softmax).
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from jaxinfer.models import sequence_logits


@pytest.fixture(scope="module")
def llm():
    return ji.LLM("smollm2-135m", max_seq_len=256, max_num_seqs=4, prefill_chunk=64)


@pytest.fixture(scope="module")
def cases(data_dir):
    with open(os.path.join(data_dir, "smollm2_greedy.json")) as f:
        return json.load(f)["cases"]


def test_first_token_logprobs_match_hf(llm, cases):
    picked = [c for c in cases if not c["hit_eos"]][:3]
    outs = llm.generate([c["prompt_ids"] for c in picked],
                        ji.SamplingParams(max_tokens=6, logprobs=5))
    for case, out in zip(picked, outs):
        assert len(out.logprobs) == len(out.token_ids) == 6
        first = out.logprobs[0]
        top = case["last_logits_top10"]
        want = {i: v - case["last_logits_logsumexp"] for i, v in zip(top["ids"][:5],
                                                                     top["values"][:5])}
        assert set(first) == set(want)  # greedy: the sampled token is the top one
        for token_id, logprob in want.items():
            assert abs(first[token_id] - logprob) < 2e-3
        for tok, d in zip(out.token_ids, out.logprobs):
            assert tok in d and d[tok] == pytest.approx(max(d.values()))  # greedy = argmax
            assert len(d) == 5


def test_prompt_logprobs_across_chunks_match_full_forward(llm, cases):
    case = max(cases, key=lambda c: len(c["prompt_ids"]))  # 145 tokens: 3 chunks of 64
    ids = case["prompt_ids"]
    out = llm.generate([ids], ji.SamplingParams(max_tokens=1, prompt_logprobs=3))[0]
    assert out.logprobs is None
    plp = out.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    logits = sequence_logits(llm._engine.params, llm.model_config, jnp.asarray([ids]))
    lp = np.asarray(jax.nn.log_softmax(logits[0], axis=-1))
    for i in range(1, len(ids)):
        d = plp[i]
        assert ids[i] in d and abs(d[ids[i]] - lp[i - 1, ids[i]]) < 2e-3
        top3 = np.argsort(-lp[i - 1])[:3]
        for j in top3:
            assert abs(d[int(j)] - lp[i - 1, j]) < 2e-3


def test_logprobs_limits_and_mixed_batch(llm):
    with pytest.raises(ValueError, match="logprobs=21 exceeds the limit of 20"):
        llm.generate("Hi", ji.SamplingParams(logprobs=21))
    outs = llm.generate(["Hello", "Hello"], [ji.SamplingParams(max_tokens=4, logprobs=0),
                                             ji.SamplingParams(max_tokens=4)])
    assert [len(d) for d in outs[0].logprobs] == [1] * 4  # only the sampled token
    assert outs[1].logprobs is None and outs[1].prompt_logprobs is None
    assert outs[0].token_ids == outs[1].token_ids
