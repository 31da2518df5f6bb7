"""SamplingParams(n > 1): n sequences of one prompt, prefilled once, sharing its pages.

On the tiny random Llama of tests/data (token-id prompts). Checked against separate requests:
sequence i of a request seeded s equals a request of n = 1 seeded s + i (the documented seed
rule), alone and in a crowd and after preemption; exact token ids.
"""

import os

import pytest

import jaxinfer as ji

TINY = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "tiny_models", "llama")
PROMPT = [5, 17, 33, 3, 61, 8, 40, 77, 12, 9, 100, 3, 45, 66, 20, 31, 7, 88]  # 18 tokens


@pytest.fixture(scope="module")
def llm():
    return ji.LLM(TINY, max_seq_len=64, max_num_seqs=8, page_size=4,
                  max_num_batched_tokens=32, prefill_chunk=8)


def _sampled(**kw):
    return ji.SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, ignore_eos=True, **kw)


def test_n_seeded_samples_equal_separate_requests_and_prefill_once(llm):
    before = llm.stats()["prompt_tokens"]
    out = llm.generate([PROMPT], _sampled(n=4, seed=11))[0]
    # The prompt's first 17 tokens once, then each sequence feeds the last prompt token.
    assert llm.stats()["prompt_tokens"] - before == len(PROMPT) - 1 + 4
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert out.token_ids == out.outputs[0].token_ids and out.finish_reason == "length"
    separate = llm.generate([PROMPT] * 4, [_sampled(seed=11 + i) for i in range(4)])
    assert [o.outputs[0].token_ids for o in separate] == [o.token_ids for o in out.outputs]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # they are different samples
    assert llm.stats()["pages_used"] == 0


def test_samples_in_a_crowd_and_greedy_copies(llm):
    """A request of n = 3 among others gives what it gives alone; greedy sequences are all
    the greedy continuation."""
    alone = llm.generate([PROMPT], _sampled(n=3, seed=5))[0]
    crowd = llm.generate([PROMPT[:7], PROMPT, PROMPT[3:]],
                         [_sampled(seed=1), _sampled(n=3, seed=5), _sampled(n=2, seed=9)])
    assert [o.token_ids for o in crowd[1].outputs] == [o.token_ids for o in alone.outputs]
    greedy = llm.generate([PROMPT], ji.SamplingParams(max_tokens=8, n=3, ignore_eos=True))[0]
    single = llm.generate([PROMPT], ji.SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert all(o.token_ids == single.token_ids for o in greedy.outputs)


def test_preemption_with_shared_pages_keeps_the_samples(llm):
    """A pool too small for every sequence at once: sequences are preempted and recomputed;
    the samples are those of a roomy pool, and no page leaks."""
    small = ji.LLM(TINY, max_seq_len=64, max_num_seqs=8, page_size=4, num_pages=24,
                   max_num_batched_tokens=32, prefill_chunk=8)
    params = [_sampled(n=4, seed=3), _sampled(n=3, seed=4)]
    outs = small.generate([PROMPT, PROMPT[2:]], params)
    stats = small.stats()
    assert stats["preemptions"] > 0 and stats["pages_used"] == 0
    ref = llm.generate([PROMPT, PROMPT[2:]], params)  # room for all
    for a, b in zip(outs, ref):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]


def test_abort_and_limits(llm):
    rid = llm.add_request(PROMPT, _sampled(n=4, seed=0))
    llm.step()
    llm.abort(rid)
    assert not llm.has_unfinished_requests() and llm.stats()["pages_used"] == 0
    with pytest.raises(ValueError, match="n=9 exceeds the 8 sequences"):
        llm.generate([PROMPT], _sampled(n=9))
    with pytest.raises(ValueError, match="n must be at least 1, got 0"):
        ji.SamplingParams(n=0)
    with pytest.raises(ValueError, match="use add_request"):
        next(llm.stream(PROMPT, _sampled(n=2)))
