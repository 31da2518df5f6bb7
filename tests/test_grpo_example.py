"""examples/grpo.py: the reward / advantage / batch bookkeeping, one GRPO step through the real
engine on a tiny model (adapter updated, weight version advanced, later samples carrying it),
and, as a slow test, the documented configuration's reward rising on SmolLM2."""

import os
import sys

import jax
import numpy as np
import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.insert(0, EXAMPLES)

import grpo  # noqa: E402

import jaxinfer as ji  # noqa: E402


def test_reward_partial_credit():
    assert grpo.reward("11", 11, "stop") == 1.0
    assert grpo.reward(" 11.", 11, "stop") == 1.0
    assert grpo.reward("12", 11, "stop") == 0.5  # the format, not the sum
    assert grpo.reward("The answer is 11.", 11, "stop") == pytest.approx(0.5 + 0.25 * (1 - 4 / 8))
    assert grpo.reward("To find 3 + 8, we add them and get 11", 11, "length") == 0.5
    assert grpo.reward("To find 3 + 8, we add", 11, "length") == 0.0
    assert grpo.reward("one two three four five six seven eight nine", 11, "stop") == 0.0


def test_group_advantages():
    r = np.array([[0.0, 1.0, 0.5, 0.5], [0.2, 0.2, 0.2, 0.2]], np.float32)
    a = grpo.group_advantages(r)
    np.testing.assert_allclose(a.sum(axis=1), 0.0, atol=1e-5)
    np.testing.assert_allclose(a[1], 0.0)  # no signal in a group with one reward
    np.testing.assert_allclose(a[0].std(), 1.0, atol=1e-3)


def test_build_batch_alignment():
    b = grpo.build_batch([[5, 6, 7], [5, 6]], [[8, 9], [10]],
                         [np.array([-0.1, -0.2]), np.array([-0.3, -0.05])], [1.0, -1.0],
                         buckets=(4, 8), rows=3, stop_ids=[None, 2])
    assert b.tokens.shape == (3, 8)
    assert b.tokens[0].tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
    assert b.tokens[1].tolist() == [5, 6, 10, 2, 0, 0, 0, 0]  # the EOS appended
    # Logits at t predict token t + 1: the mask starts at the prompt's last token.
    assert b.mask[0].tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    assert b.mask[1].tolist() == [0, 1, 1, 0, 0, 0, 0, 0]
    assert not b.mask[2].any()  # a padding row
    np.testing.assert_allclose(b.old_logp[0, 2:4], [-0.1, -0.2])
    # The sampler's arrays cover the stop id that ended row 1 (appended to its tokens).
    np.testing.assert_allclose(b.old_logp[1, 1:3], [-0.3, -0.05])
    assert b.advantages.tolist() == [1.0, -1.0, 0.0]
    with pytest.raises(ValueError, match="longer than the largest bucket"):
        grpo.build_batch([[1] * 9], [[2]], [np.zeros(1)], [0.0], buckets=(4, 8))


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    """A tiny random Llama (2 layers of width 64) with SmolLM2's vocabulary, tokenizer and chat
    template, bf16: the example's whole path at a size whose gradient compiles in seconds (the
    slow test below runs SmolLM2 itself)."""
    import jax.numpy as jnp

    from jaxinfer.config import ModelConfig
    from jaxinfer.loading import load_model
    from jaxinfer.loading.checkpoint import save_checkpoint
    from jaxinfer.models import llama

    tokenizer = load_model("smollm2-135m").tokenizer
    cfg = ModelConfig(architecture="llama", vocab_size=49152, d_model=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, ffn_dim=128,
                      tie_word_embeddings=True, max_position_embeddings=512, bos_token_id=1,
                      eos_token_id=2)
    path = str(tmp_path_factory.mktemp("tiny") / "smollm2-vocab")
    save_checkpoint(path, cfg, llama.LLAMA.init_params(cfg, jax.random.key(0), jnp.float32),
                    tokenizer)
    return ji.LLM(path, dtype="bfloat16", max_seq_len=128, max_num_seqs=4, max_loras=1,
                  max_lora_rank=4)


def test_grpo_steps_update_the_sampler(llm):
    trainer = grpo.Trainer(llm, rank=4, lr=1e-2, prompts_per_step=2, group_size=2,
                           max_tokens=8, buckets=(64,), seed=0,
                           # distinct rewards within a group, so the gradient is not zero
                           reward_fn=lambda text, answer, reason: len(text) / 100.0)
    v0 = llm.weight_version
    rng = np.random.default_rng(0)
    before = jax.tree.map(np.asarray, trainer.lora)
    records = []
    for _ in range(2):
        problems = grpo.make_problems(rng, 2)
        records.append(trainer.step(problems))
        assert trainer.step_index == len(records)
    for rec in records:
        assert np.isfinite(rec["loss"]) and np.isfinite(rec["mean_reward"])
        assert np.isfinite(rec["logp_gap"]) and np.isfinite(rec["grad_norm"])
        assert 0.0 <= rec["mean_reward"] <= 1.0
        assert np.asarray(rec["rewards"]).shape == (2, 2)
        np.testing.assert_allclose(grpo.group_advantages(rec["rewards"]).sum(axis=1), 0.0,
                                   atol=1e-4)
        # One update per batch: the training forward scores the sampled tokens as the
        # sampler did, up to bf16 noise.
        assert rec["logp_gap"] < 0.1, rec["logp_gap"]
    after = jax.tree.map(np.asarray, trainer.lora)
    changed = [not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(before),
                                                        jax.tree.leaves(after))]
    assert all(changed)  # every A and B moved (B from zeros)
    assert llm.weight_version == v0 + 2  # one update_weights per step
    assert records[0]["sampled_weight_version"] == [v0]  # sampled before the first update
    assert records[1]["sampled_weight_version"] == [v0 + 1]
    # Samples drawn now carry the newest version.
    _, outs = trainer.sample(grpo.make_problems(rng, 1), step=99)
    assert {c.weight_version for c in outs[0].outputs} == {llm.weight_version}


@pytest.mark.slow
def test_grpo_reward_rises():
    """The first 20 steps of the documented run (python examples/grpo.py --steps 30 --seed
    0): the mean reward of steps 15-19 beats steps 0-4 by at least 0.15 (reward in [0, 1];
    the documented run measured 0.425 against 0.064)."""
    llm = ji.LLM("smollm2-135m", dtype="bfloat16", max_seq_len=128, max_num_seqs=16,
                 max_loras=1, max_lora_rank=8)
    records = grpo.run(llm, 20, log=None, rank=8, lr=2e-3, prompts_per_step=2, group_size=8,
                       max_tokens=16, buckets=(64, 96), seed=0)
    rewards = [r["mean_reward"] for r in records]
    first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
    assert last > first + 0.15, (first, last, rewards)
