"""`jaxinfer.step` as a user embeds it: inside their own jax.jit, a prefill step and a
lax.scan of decode steps, on a tiny random model (float32). Checked against greedy decoding by
full forwards (argmax of the last position's logits, re-run from scratch for every token): an
independent path through the model with no cache. Tolerance: exact token ids.
"""

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer as ji
from jaxinfer.config import ModelConfig
from jaxinfer.models import llama
from jaxinfer.models import sequence_logits
from jaxinfer.device.token_batch import host_batch

TINY = ModelConfig("llama", vocab_size=97, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, ffn_dim=64, rope_theta=10000.0, max_position_embeddings=512)


def _greedy_by_full_forwards(params, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        logits = sequence_logits(params, TINY, jnp.asarray([seq], jnp.int32))
        seq.append(int(np.argmax(np.asarray(logits)[0, -1])))
    return seq[len(prompt):]


def test_step_inside_a_users_jit_generates_greedy_tokens():
    params = llama.LLAMA.init_params(TINY, jax.random.key(3))
    prompts = [[5, 17, 33, 2, 61, 8, 40], [12, 90, 4]]
    B, steps = 2, 6

    state = ji.DecodeState.create(TINY, B, capacity=64)
    rows = ji.RowParams.empty(B, 1)             # temperature 0 (greedy), no stop ids
    rows = rows.replace(max_new=np.full(B, steps + 1, np.int32))
    state = ji.admit_rows(state, np.ones(B, bool), np.zeros(B, np.int32),
                          np.zeros(B, np.int32), rows)
    prefill = host_batch(16, B, [(b, p) for b, p in enumerate(prompts)])

    @jax.jit
    def generate(params, state, prefill):
        out, state = ji.step(params, state, prefill, jnp.arange(B, dtype=jnp.int32), cfg=TINY)

        def decode(state, _):
            batch = ji.TokenBatch(tokens=state.last_token, rows=jnp.arange(B, dtype=jnp.int32),
                                  query_start=jnp.arange(B, dtype=jnp.int32),
                                  num_queries=jnp.ones(B, jnp.int32))
            out, state = ji.step(params, state, batch, jnp.arange(B, dtype=jnp.int32), cfg=TINY)
            return state, out.tokens

        state, tokens = jax.lax.scan(decode, state, None, length=steps)
        return jnp.concatenate([out.tokens[None], tokens]).T, state

    tokens, state = generate(params, state, prefill)
    for b, prompt in enumerate(prompts):
        assert np.asarray(tokens[b]).tolist() == _greedy_by_full_forwards(params, prompt,
                                                                         steps + 1)
    assert np.asarray(state.cache.lengths).tolist() == [len(p) + steps for p in prompts]
