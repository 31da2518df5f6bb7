"""Draft distillation (jaxinfer.draft_train, behind launch.train_draft) on the tiny HF llama
(2 layers, vocab 256).

- draft_from_target picks evenly spaced layers and shares embedding, head and final norm;
- training lowers the KL(target || draft) it minimises, measured on the training batches by
  an independent float64 numpy computation before and after;
- the saved checkpoint works as draft_model through the public API, and greedy speculative
  output equals plain greedy output token by token.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from jaxinfer import draft_train as train_draft
from jaxinfer.loading import load_model
from jaxinfer.loading.checkpoint import save_checkpoint
from jaxinfer.models import llama
from jaxinfer.models import sequence_logits

TINY = os.path.join(os.path.dirname(__file__), "data", "tiny_models", "llama")


@pytest.fixture(scope="module")
def target():
    loaded = load_model(TINY)
    return loaded.params, loaded.config


def _kl_numpy(target_params, draft_params, cfg, draft_cfg, seqs):
    """Mean KL(p || q) over next-token positions, float64 from each model's logits."""
    total, count = 0.0, 0
    for s in seqs:
        x = jnp.asarray([s])
        lp = np.asarray(sequence_logits(target_params, cfg, x), np.float64)[0, :-1]
        lq = np.asarray(sequence_logits(draft_params, draft_cfg, x), np.float64)[0, :-1]
        lp = lp - np.log(np.exp(lp - lp.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - lp.max(-1, keepdims=True)
        lq = lq - np.log(np.exp(lq - lq.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - lq.max(-1, keepdims=True)
        total += (np.exp(lp) * (lp - lq)).sum()
        count += len(lp)
    return total / count


def test_draft_from_target_layers(target):
    params, cfg = target
    draft, draft_cfg = train_draft.draft_from_target(params, cfg, 1)
    assert draft_cfg.num_layers == 1 and draft.layers[0] is params.layers[0]
    assert draft.embed is params.embed and draft.final_norm is params.final_norm
    both, _ = train_draft.draft_from_target(params, cfg, 2)
    assert [id(x) for x in both.layers] == [id(x) for x in params.layers]
    with pytest.raises(ValueError, match=r"num_layers must be in \[1, 2\], got 3"):
        train_draft.draft_from_target(params, cfg, 3)


@pytest.mark.slow
def test_training_lowers_kl_and_the_draft_serves_speculation(target, tmp_path):
    params, cfg = target
    rng = np.random.default_rng(0)
    # The target's own greedy continuations of random prompts: the text a draft must predict.
    llm = ji.LLM(TINY, max_seq_len=128, max_num_seqs=4)
    prompts = [rng.integers(3, cfg.vocab_size, int(n)).tolist() for n in rng.integers(4, 12, 12)]
    outs = llm.generate(prompts, ji.SamplingParams(max_tokens=24, ignore_eos=True))
    seqs = [o.prompt_token_ids + o.token_ids for o in outs]
    untrained, draft_cfg = train_draft.draft_from_target(params, cfg, 1)
    draft, draft_cfg2, losses = train_draft.train(
        params, cfg, seqs, num_layers=1, steps=40, batch_size=4, seq_len=64,
        learning_rate=3e-3, seed=0, log_every=0)
    assert draft_cfg2 == draft_cfg and len(losses) == 40
    before = _kl_numpy(params, untrained, cfg, draft_cfg, seqs)
    after = _kl_numpy(params, draft, cfg, draft_cfg, seqs)
    assert after < 0.7 * before, (before, after)
    assert draft.embed is params.embed  # frozen and shared

    save_checkpoint(str(tmp_path / "draft"), draft_cfg, draft)
    spec = ji.LLM(TINY, max_seq_len=128, max_num_seqs=4,
                  speculative=ji.SpeculativeConfig("draft", num_draft_tokens=3,
                                                   draft_model=str(tmp_path / "draft")))
    params_out = ji.SamplingParams(max_tokens=20, ignore_eos=True)
    test_prompts = prompts[:4] + [rng.integers(3, cfg.vocab_size, 9).tolist()]
    want = [o.token_ids for o in llm.generate(test_prompts, params_out)]
    got = spec.generate(test_prompts, params_out)
    assert [o.token_ids for o in got] == want
    stats = spec.stats()
    assert 0 < stats["accepted_tokens"] < stats["draft_tokens"]
    assert stats["prefix_cache_query_tokens"] == 0  # a draft model turns prefix caching off
    # The target as its own draft: under greedy sampling every draft is the token the target
    # picks, so every one is accepted; a verification that rejected a right draft, or
    # accepted a wrong one (the tokens above would differ), breaks the equality.
    same = ji.LLM(TINY, max_seq_len=128, max_num_seqs=4,
                  speculative=ji.SpeculativeConfig("draft", num_draft_tokens=3, draft_model=TINY))
    assert [o.token_ids for o in same.generate(test_prompts, params_out)] == want
    stats = same.stats()
    assert stats["draft_tokens"] > 0 and stats["accepted_tokens"] == stats["draft_tokens"]


def test_draft_with_another_vocabulary_is_refused(tmp_path):
    small = load_model(TINY).config.replace(vocab_size=64, num_layers=1)
    save_checkpoint(str(tmp_path / "d"), small, llama.LLAMA.init_params(small, jax.random.key(0)))
    with pytest.raises(ValueError, match="vocabulary of 64 tokens; the target's has 256"):
        ji.LLM(TINY, speculative=ji.SpeculativeConfig("draft", draft_model=str(tmp_path / "d")))
