"""Speculative decoding (n-gram drafts, exact verification) against independent references.

- ngram_propose == a plain-Python implementation of the documented lookup rule;
- verify: the empirical distribution of the emitted tokens == the exact target distribution
  (chi-square, with drafts that are point proposals and drafts sampled from a distribution q),
  and the sample size is shown to detect a 2% total-variation error;
- decode_loop with drafts, greedy: the same tokens as without, on a ring, a wrapping
  sliding-window ring and a paged pool with NaN in every unused slot, with rows accepting
  different counts and rollback across page boundaries; stop ids end rows as in decode_loop;
  the device-kept n-gram history ends as each row's prompt and output;
- decode_loop with drafts, sampled: the first two tokens follow the model's exact joint distribution
  (n-gram and draft model); n-gram speculation emits exactly decode_loop's sampled tokens;
- the LLM API on the real model: greedy speculative output == the HF goldens, token by token
  (one golden copies its input, so EOS arrives inside a run of accepted drafts).
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from jaxinfer.device import state as device_state
from jaxinfer.device.loop import decode_loop
from jaxinfer.device.step import step_jit
from jaxinfer.config import ModelConfig
from jaxinfer.device.kv_cache import PagedKVCache
from jaxinfer.models import llama
from jaxinfer.models import sequence_logits
from jaxinfer.device.sampling import SamplingArrays
from jaxinfer.device.drafting import ngram_propose, verify
from jaxinfer.device.token_batch import TokenBatch

TINY = ModelConfig("llama", vocab_size=16, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, ffn_dim=64, rope_theta=10000.0, max_position_embeddings=512)


def _sampling(B, temperature=0.0, top_k=0, seed=None):
    return SamplingArrays(temperature=np.full(B, temperature, np.float32),
                          top_k=np.full(B, top_k, np.int32), top_p=np.ones(B, np.float32),
                          min_p=np.zeros(B, np.float32),
                          repetition_penalty=np.ones(B, np.float32),
                          seed=(np.arange(B) if seed is None else np.full(B, seed)).astype(
                              np.uint32))


def _rows(B, max_new, stop=-1, logprobs=False, **sampling):
    return device_state.RowParams(sampling=_sampling(B, **sampling),
                                  max_new=np.full(B, max_new, np.int32),
                                  stop_ids=np.full((B, 2), stop, np.int32),
                                  logprobs=np.full(B, logprobs), prompt_logprobs=np.zeros(B, bool),
                                  sampled_logprobs=np.full(B, logprobs))


# ---- n-gram lookup ------------------------------------------------------------------------------

def _reference_propose(hist, k, n_max, n_min):
    """The documented rule, in plain Python, for one row."""
    L = len(hist)
    for n in range(n_max, n_min - 1, -1):
        if L <= n:
            continue
        suffix = hist[L - n:]
        occ = [j for j in range(L - n) if hist[j:j + n] == suffix]
        if not occ:
            continue
        full = [j for j in occ if j + n + k <= L]
        start = (full or occ)[-1] + n
        cont = hist[start:start + k]
        return cont, len(cont)
    return [], 0


def test_ngram_propose_matches_reference():
    rng = np.random.default_rng(0)
    B, L, k = 64, 40, 4
    hist = rng.integers(0, 4, (B, L)).astype(np.int32)       # 4 symbols: many matches
    hist[:8] = np.tile([1, 2, 3], L)[:L]                        # periodic rows
    lengths = rng.integers(1, L + 1, B).astype(np.int32)
    lengths[:4] = [1, 2, 3, L]
    for n_max, n_min in ((3, 2), (3, 1), (1, 1)):
        drafts, num = jax.jit(ngram_propose, static_argnums=(2, 3, 4))(
            hist, lengths, k, n_max, n_min)
        drafts, num = np.asarray(drafts), np.asarray(num)
        for b in range(B):
            want, n = _reference_propose(hist[b, :lengths[b]].tolist(), k, n_max, n_min)
            assert num[b] == n and drafts[b, :n].tolist() == want, (b, n_max, n_min)
    assert (num > 0).sum() > B // 2


# ---- exactness of verification ------------------------------------------------------------------

def _chi_square_z(counts, probs):
    """Wilson-Hilferty z-score of Pearson's chi-square statistic of counts against probs
    (cells expecting fewer than 5 are pooled). z > 4 rejects at p < 5e-5."""
    counts, probs = np.asarray(counts, float).ravel(), np.asarray(probs, float).ravel()
    n = counts.sum()
    big = probs * n >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(probs[big] * n, probs[~big].sum() * n)
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = keep.sum() - 1
    return ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / np.sqrt(2 / (9 * df))


def _perturbed(probs, tv=0.02):
    """probs with `tv` of mass moved from the likeliest cell to the least likely one."""
    out = np.array(probs, float).ravel()
    hi, lo = np.argmax(out), np.argmin(out)
    out[hi] -= tv
    out[lo] += tv
    return out.reshape(np.shape(probs))


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("drafter", ["point", "sampled"])
def test_verify_emits_the_target_distribution(drafter):
    """Position 0's logits give p0, position 1's p1 (after draft 0). The first emitted token
    must follow p0, and the second (emitted when draft 0 was accepted, so token 0 == draft 0)
    must follow p1. top_k=4 of V=6 shapes p; drafts often fall outside it (p = 0)."""
    rng = np.random.default_rng(1)
    N, V, k = 60_000, 6, 2
    logits = rng.normal(0, 1.2, (k + 1, V)).astype(np.float32)
    q = _softmax(rng.normal(0, 1.0, (k, V)))
    if drafter == "point":
        drafts = np.tile(np.array([[int(np.argsort(logits[0])[-2]), 1]], np.int32), (N, 1))
        draft_probs = None
    else:
        drafts = np.stack([rng.choice(V, N, p=q[i]) for i in range(k)], 1).astype(np.int32)
        draft_probs = np.broadcast_to(q, (N, k, V)).astype(np.float32)
    sp = _sampling(N, temperature=1.0, top_k=4)
    accepted, token = jax.jit(verify)(np.broadcast_to(logits, (N, k + 1, V)), drafts,
                                      np.full(N, k, np.int32), sp, np.zeros((N, V), bool),
                                      np.zeros(N, np.int32), draft_probs=draft_probs)
    accepted, token = np.asarray(accepted), np.asarray(token)
    first = np.where(accepted > 0, drafts[:, 0], token)
    second = np.where(accepted > 1, drafts[:, 1], token)[accepted > 0]
    top4 = lambda x: np.where(x >= np.sort(x)[-4], x, -np.inf)  # noqa: E731
    p0, p1 = _softmax(top4(logits[0])), _softmax(top4(logits[1]))
    c0, c1 = np.bincount(first, minlength=V), np.bincount(second, minlength=V)
    assert _chi_square_z(c0, p0) < 4 and _chi_square_z(c1, p1) < 4
    assert _chi_square_z(c0, _perturbed(p0)) > 4           # a 2% error would be caught
    assert 0 < (accepted == 0).mean() < 1 and (accepted == 2).any()


def test_verify_greedy_is_prefix_matching():
    V, k = 11, 4
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(5, k + 1, V)).astype(np.float32)
    target = logits.argmax(-1)
    drafts = target[:, :k].copy()
    drafts[1, 2] = (drafts[1, 2] + 1) % V        # row 1: two accepted, then the target's token
    drafts[2, 0] = (drafts[2, 0] + 1) % V        # row 2: none
    num = np.array([4, 4, 4, 2, 0], np.int32)    # row 3: two valid drafts, then the bonus
    accepted, token = verify(logits, drafts.astype(np.int32), num, _sampling(5),
                             np.zeros((5, V), bool), np.zeros(5, np.int32))
    assert np.asarray(accepted).tolist() == [4, 2, 0, 2, 0]
    assert np.asarray(token).tolist() == [target[0, 4], target[1, 2], target[2, 0],
                                          target[3, 2], target[4, 0]]


# ---- the loop on caches -------------------------------------------------------------------------

PAGE = 4


HISTORY = 128  # n-gram history positions per row (every prompt plus its output fits)


def _prefill(cfg, params, prompts, cache, rows, draft=None, chunk=None, draft_capacity=128):
    """State after admitting rows (RowParams, with each row's prompt as its n-gram history) and
    prefilling ragged prompts (first tokens sampled); draft: (params, cfg) of a draft model,
    whose ring (draft_capacity slots a row) is prefilled too. chunk: feed the prompts in flat
    steps of at most that many tokens a row (a sliding-window ring holds window + the most
    tokens a row writes in one call), each row sampling in the step that ends its prompt;
    None: one step of the whole prompts."""
    B, T = len(prompts), max(len(p) for p in prompts)
    C = T if chunk is None else chunk
    toks = np.zeros((B, -(-T // C) * C), np.int32)
    hist = np.zeros((B, HISTORY), np.int32)
    for b, p in enumerate(prompts):
        toks[b, :len(p)] = p
        hist[b, :len(p)] = p
    draft_params, draft_cfg = draft or (None, None)
    state = device_state.DecodeState.create(cfg, B, 0, cache=cache, draft_cfg=draft_cfg,
                                            draft_capacity=draft_capacity, history=HISTORY,
                                            num_stop_ids=rows.stop_ids.shape[1])
    state = device_state.admit_rows(state, np.ones(B, bool), np.zeros(B, np.int32),
                                    np.zeros(B, np.int32), rows, hist)
    lens = np.array([len(p) for p in prompts], np.int32)
    first = np.zeros(B, np.int32)
    for s in range(0, toks.shape[1], C):
        num = np.clip(lens - s, 0, C).astype(np.int32)
        ends = (lens > s) & (lens <= s + C)
        sample_rows = np.where(ends, np.arange(B), B).astype(np.int32)
        batch = TokenBatch.dense(jnp.asarray(toks[:, s:s + C]), jnp.asarray(num), None, B)
        out, state = step_jit(params, state, batch, sample_rows, cfg=cfg, query_tile=C,
                              draft_params=draft_params, draft_cfg=draft_cfg)
        first = np.where(ends, np.asarray(out.tokens), first)
    return state, [[int(t)] for t in first]


def _generate(cfg, params, prompts, cache, rows, spec, draft_on=None, steps=4, k=4, draft=None,
              chunk=None, lps=None):
    """Every row to its end through decode_loop, with drafts or without (n-gram drafts from the
    history the device keeps in the state, or draft = (params, cfg) of a draft model). Each
    dispatch lists the rows not yet done (padded with B to a fixed length, as the engine
    does). Checks that the device's history ends as each row's prompt and output. Returns
    (tokens per row, summed SpecCounts, final state). lps: a list that receives per row the
    (raw, sampling-law) log-probabilities of the emitted tokens (rows that want them)."""
    state, out_ids = _prefill(cfg, params, prompts, cache, rows, draft, chunk)
    draft_params, draft_cfg = draft or (None, None)
    B = len(prompts)
    counts = np.zeros((3, B), int)
    listed = np.arange(B, dtype=np.int32)
    for _ in range(100):
        if spec:
            on = np.ones(B, bool) if draft_on is None else draft_on
            state, out, num, done, lp, c = decode_loop(
                params, state, listed, on, cfg=cfg, num_steps=steps, num_draft=k,
                ngram_max=3, ngram_min=1, draft_params=draft_params, draft_cfg=draft_cfg)
            counts += np.stack([np.asarray(c.steps), np.asarray(c.drafted),
                                np.asarray(c.accepted)])
        else:
            state, out, num, done, lp, _ = decode_loop(params, state, listed, cfg=cfg,
                                                       num_steps=steps)
        out, num, done = np.asarray(out), np.asarray(num), np.asarray(done)
        if lps is not None and not lps:
            lps.extend(([], []) for _ in range(B))
        for b in range(B):
            out_ids[b] += out[b, :num[b]].tolist()
            if lps is not None:
                lps[b][0].extend(np.asarray(lp[2])[b, :num[b]].tolist())
                lps[b][1].extend(np.asarray(lp[3])[b, :num[b]].tolist())
        if done.all():
            hist = np.asarray(state.history)
            for b in range(B):
                ids = list(prompts[b]) + out_ids[b]
                assert hist[b, :len(ids)].tolist() == ids, b
            return out_ids, counts, state
        live = np.flatnonzero(~done)
        listed = np.full(B, B, np.int32)
        listed[:len(live)] = live
    raise AssertionError("rows never finished")


def _paged(cfg, B, rng):
    """A pool of 4-token pages, each row's scattered, everything unused NaN."""
    per_row = 32
    num_pages = 1 + B * per_row
    tables = rng.permutation(np.arange(1, num_pages)).reshape(B, per_row).astype(np.int32)
    cache = PagedKVCache.create(cfg.num_layers, num_pages, PAGE, cfg.num_kv_heads, cfg.head_dim,
                                tables)
    return cache.replace(k=jnp.full_like(cache.k, jnp.nan), v=jnp.full_like(cache.v, jnp.nan))


def _loop_prompts(rng, V):
    """Ragged prompts, some periodic (drafts accepted), some random (drafts rejected)."""
    return [np.tile(rng.integers(0, V, 5), 4)[:n].tolist() for n in (17, 9)] + \
           [rng.integers(0, V, n).tolist() for n in (13, 6)]


def _draft_of(cfg, params, seed):
    """A one-layer draft sharing the target's embedding and head, its layer the target's first
    with noise: it agrees with the target often, not always."""
    draft_cfg = cfg.replace(num_layers=1)
    noisy = jax.tree.map(lambda w: w + 0.3 * jnp.std(w) * jax.random.normal(
        jax.random.key(seed), w.shape), params.layers[0])
    return params.replace(layers=(noisy,)), draft_cfg


@pytest.mark.parametrize("cache_kind,drafter", [("ring", "ngram"), ("ring_window", "ngram"),
                                                ("paged", "ngram"), ("ring", "draft"),
                                                ("ring_window", "draft"), ("paged", "draft")])
def test_drafting_greedy_equals_plain_decoding(cache_kind, drafter):
    cfg = TINY.replace(vocab_size=97)
    k = 4
    if cache_kind == "ring_window":
        cfg = cfg.replace(sliding_window=6)
    params = llama.LLAMA.init_params(cfg, jax.random.key(3))
    draft = _draft_of(cfg, params, 9) if drafter == "draft" else None
    rng = np.random.default_rng(3)
    prompts = _loop_prompts(rng, cfg.vocab_size)
    B = len(prompts)
    rows = _rows(B, max_new=40)

    # A sliding-window ring holds window + the most tokens a row writes in one call: the
    # verification's k + 1 (the prompts are fed in chunks of as many), 11 slots in all.
    chunk = k + 1 if cache_kind == "ring_window" else None

    def cache():
        if cache_kind == "paged":
            return _paged(cfg, B, np.random.default_rng(4))
        capacity = 6 + chunk if cache_kind == "ring_window" else 128
        return PagedKVCache.ring(cfg.num_layers, B, capacity, cfg.num_kv_heads, cfg.head_dim)

    if cache_kind == "ring_window":
        assert cache().capacity == 11           # one page of 11 slots: it wraps many times
    plain, _, _ = _generate(cfg, params, prompts, cache(), rows, spec=False, chunk=chunk)
    spec, counts, state = _generate(cfg, params, prompts, cache(), rows, spec=True, k=k,
                                    draft=draft, chunk=chunk)
    assert spec == plain
    steps, drafted, accepted = counts
    # Some rows accepted everything they drafted, others only part of it: rollback ran.
    assert (accepted > 0).any() and (accepted < drafted).any(), counts
    assert np.asarray(state.cache.lengths).tolist() == [
        len(p) + 40 - 1 for p in prompts]
    if draft is not None:
        assert np.asarray(state.draft_cache.lengths).tolist() == [
            len(p) + 40 - 1 for p in prompts]


def test_stop_ids_end_rows_as_in_decode_loop():
    cfg = TINY.replace(vocab_size=97)
    params = llama.LLAMA.init_params(cfg, jax.random.key(3))
    prompts = _loop_prompts(np.random.default_rng(3), cfg.vocab_size)
    B = len(prompts)
    make = lambda: PagedKVCache.ring(cfg.num_layers, B, 128, cfg.num_kv_heads,  # noqa: E731
                                     cfg.head_dim)
    plain, _, _ = _generate(cfg, params, prompts, make(), _rows(B, max_new=40), spec=False)
    stop = plain[3][-1]                 # row 3 ends in a loop of two tokens, drafted and accepted
    want, _, _ = _generate(cfg, params, prompts, make(), _rows(B, max_new=40, stop=stop),
                           spec=False)
    got, _, _ = _generate(cfg, params, prompts, make(), _rows(B, max_new=40, stop=stop),
                               spec=True)
    assert got == want and want[3][-1] == stop and len(want[3]) < 40


@pytest.mark.parametrize("drafter", ["ngram", "draft"])
def test_sampled_speculation_follows_the_models_joint_distribution(drafter):
    """The first two tokens after a fixed context, drawn through decode_loop with drafts
    on, against the exact joint p(x) p(y | x) from full forwards (V=16: 256 outcomes). The
    draft model's proposals are sampled from its own q (top_k=0, temperature 1)."""
    cfg = TINY
    params = llama.LLAMA.init_params(cfg, jax.random.key(5))
    draft = _draft_of(cfg, params, 11) if drafter == "draft" else None
    draft_params, draft_cfg = draft or (None, None)
    # The prompt "a b a b a b a b a": n-gram drafts "b a b". Of all pairs, the one whose draft
    # the model likes best (p(b) about 0.6), so drafts are often accepted and often rejected.
    V = cfg.vocab_size
    pairs = [(a, b) for a in range(V) for b in range(V) if a != b]
    cands = np.array([[a, b] * 4 + [a] for a, b in pairs], np.int32)
    last = np.asarray(sequence_logits(params, cfg, jnp.asarray(cands)))[:, -1]
    p_b = _softmax(last.astype(np.float64))[np.arange(len(pairs)), [b for _, b in pairs]]
    prompt = cands[np.argmax(p_b)].tolist()
    N, chunk = 32_768, 8192
    counts = np.zeros((cfg.vocab_size, cfg.vocab_size), int)
    accepted = 0
    for start in range(0, N, chunk):
        B = chunk
        # Prefill all but the last prompt token; the last is fed by the loop's first step, so
        # output index 0 is drawn by speculation, not by the prefill.
        rows = _rows(B, max_new=2, temperature=1.0)
        rows = rows.replace(sampling=rows.sampling.replace(
            seed=np.arange(start, start + B, dtype=np.uint32)))
        # The prefill's sampled token is replaced by the prompt's last, in the history too.
        state, _ = _prefill(cfg, params, [prompt[:-1]] * B,
                            PagedKVCache.ring(cfg.num_layers, B, 16, cfg.num_kv_heads,
                                              cfg.head_dim), rows, draft, draft_capacity=16)
        hist = np.zeros((B, HISTORY), np.int32)
        hist[:, :len(prompt)] = prompt
        state = state.replace(last_token=jnp.full((B,), prompt[-1], jnp.int32),
                              num_generated=jnp.zeros((B,), jnp.int32),
                              history=jnp.asarray(hist))
        state, out, num, done, _, c = decode_loop(
            params, state, np.arange(B, dtype=np.int32), np.ones(B, bool), cfg=cfg,
            num_steps=2, num_draft=3, ngram_max=3, ngram_min=1, draft_params=draft_params,
            draft_cfg=draft_cfg)
        out, num = np.asarray(out), np.asarray(num)
        assert (num == 2).all()
        np.add.at(counts, (out[:, 0], out[:, 1]), 1)
        accepted += int(np.asarray(c.accepted).sum())
    logits = np.asarray(sequence_logits(params, cfg, jnp.asarray([prompt])))[0, -1]
    p_x = _softmax(logits.astype(np.float64))
    ext = np.array([prompt + [x] for x in range(cfg.vocab_size)], np.int32)
    p_y = _softmax(np.asarray(sequence_logits(params, cfg, jnp.asarray(ext)))[:, -1]
                   .astype(np.float64))
    joint = p_x[:, None] * p_y
    assert _chi_square_z(counts, joint) < 4
    assert _chi_square_z(counts, _perturbed(joint)) > 4
    assert 0.2 * N < accepted < 1.5 * N           # drafts were accepted and rejected


@pytest.mark.parametrize("drafting", [False, True])
def test_ngram_speculation_samples_the_tokens_of_decode_loop(drafting):
    """Sampled (temperature 0.8, top-k 20, seeded): n-gram verification accepts a draft when it
    is the token the sampler draws at that index, so the output equals decode_loop's token for
    token, whether rows draft or not (an exact property of the coupling, float32 logits)."""
    cfg = TINY.replace(vocab_size=97)
    params = llama.LLAMA.init_params(cfg, jax.random.key(6))
    prompts = _loop_prompts(np.random.default_rng(6), cfg.vocab_size)
    B = len(prompts)
    rows = _rows(B, max_new=30, temperature=0.8, top_k=20, logprobs=True)
    make = lambda: PagedKVCache.ring(cfg.num_layers, B, 128, cfg.num_kv_heads,  # noqa: E731
                                     cfg.head_dim)
    lp_plain, lp_spec = [], []
    plain, _, _ = _generate(cfg, params, prompts, make(), rows, spec=False, lps=lp_plain)
    spec, counts, _ = _generate(cfg, params, prompts, make(), rows, spec=True,
                                draft_on=np.full(B, drafting), lps=lp_spec)
    assert spec == plain
    # Verified tokens report the log-probabilities plain decoding does: the raw model's and
    # the sampling law's (top-k 20 at temperature 0.8, so the two differ).
    for (raw_p, law_p), (raw_s, law_s) in zip(lp_plain, lp_spec):
        np.testing.assert_allclose(raw_s, raw_p, atol=1e-4)
        np.testing.assert_allclose(law_s, law_p, atol=1e-4)
        assert np.all(np.asarray(law_p) >= np.asarray(raw_p) - 1e-5)
    assert (counts[2].sum() > 0) if drafting else (counts.sum() == 0)


# ---- the public API on the real model -----------------------------------------------------------

def _generate_goldens(data_dir, spec):
    """SmolLM2 with `spec` on every HF golden prompt: asserts the golden greedy tokens and
    returns (outputs, llm.stats())."""
    with open(os.path.join(data_dir, "smollm2_greedy.json")) as f:
        golden = json.load(f)
    llm = ji.LLM("smollm2-135m", max_seq_len=256, max_num_seqs=4, speculative=spec)
    cases = golden["cases"]
    outs = llm.generate([c["prompt_ids"] for c in cases],
                        ji.SamplingParams(max_tokens=golden["max_new_tokens"]))
    for case, out in zip(cases, outs):
        want = case["greedy_ids"][:-1] if case["hit_eos"] else case["greedy_ids"]
        assert out.token_ids == want, case["name"]
    return outs, llm.stats()


@pytest.mark.slow  # the real model end to end; tiny-model checks cover the default run
def test_llm_ngram_speculation_matches_hf_greedy_goldens(data_dir):
    outs, stats = _generate_goldens(data_dir, ji.SpeculativeConfig("ngram", num_draft_tokens=4))
    assert stats["draft_tokens"] > 0 and 0 < stats["acceptance_rate"] <= 1
    assert sum(o.metrics.accepted_tokens for o in outs) == stats["accepted_tokens"]


@pytest.mark.slow
def test_llm_draft_model_speculation_matches_hf_greedy_goldens(data_dir, tmp_path):
    """A draft of 24 of SmolLM2's 30 layers (the rest dropped, nothing trained): its argmax
    agrees with the target's on about a third of the golden tokens, so drafts are accepted and
    rejected; the output must be the HF goldens all the same."""
    from jaxinfer.draft_train import draft_from_target
    from jaxinfer.loading import load_model
    from jaxinfer.loading.checkpoint import save_checkpoint

    target = load_model("smollm2-135m")
    draft, draft_cfg = draft_from_target(target.params, target.config, 24)
    save_checkpoint(str(tmp_path / "draft"), draft_cfg, draft)
    del target, draft
    _, stats = _generate_goldens(data_dir, ji.SpeculativeConfig(
        "draft", num_draft_tokens=3, draft_model=str(tmp_path / "draft")))
    assert stats["draft_tokens"] > stats["accepted_tokens"] > 0
