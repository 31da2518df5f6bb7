"""The sampler (jaxinfer.device.sampling) against independent references and exact properties.

- filtered_logits == a float64 numpy implementation of the documented filter chain, on a batch
  whose rows each carry different (temperature, top_k, top_p, min_p);
- greedy / top_k=1 / repetition-penalty cases with exact answers;
- the empirical distribution of `sample` == the exact filtered softmax (total-variation bound);
- the inverse-CDF draw == a float64 numpy inverse CDF, never drawing a zero weight;
- token i of a request depends on (seed, i) alone, inside the sampler and through the LLM API;
- new sampling values never compile anything.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from jaxinfer import backends
from jaxinfer.device.sampling import (SamplingArrays, apply_repetition_penalty, filtered_logits,
                               mark_seen, sample)

_filtered = jax.jit(filtered_logits)
_sample = jax.jit(sample)


def _arrays(temperature, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, seed=0, B=None):
    """SamplingArrays from scalars or per-row sequences (scalars are broadcast to B rows)."""
    cols = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                repetition_penalty=repetition_penalty, seed=seed)
    if B is None:
        B = max(len(np.atleast_1d(v)) for v in cols.values())
    dtypes = dict(temperature=np.float32, top_k=np.int32, top_p=np.float32, min_p=np.float32,
                  repetition_penalty=np.float32, seed=np.uint32)
    return SamplingArrays(**{k: jnp.asarray(np.broadcast_to(np.asarray(v, dtypes[k]), (B,)))
                             for k, v in cols.items()})


def _distinct_logits(rng, B, V, spread=3.0):
    """[B, V] float32 logits without ties: a shuffled even grid, scaled and shifted per row."""
    grid = np.linspace(-spread, spread, V)
    rows = [rng.permutation(grid) * rng.uniform(0.5, 1.5) + rng.normal() for _ in range(B)]
    return np.asarray(rows, np.float32)


def _no_seen(B, V):
    return jnp.zeros((B, V), bool)


# ---- numpy reference of the filter chain -------------------------------------------------------

def _reference_filter(logits, temperature, top_k, top_p, min_p, tol=1e-5):
    """One row, in float64. Returns (keep [V] bool, unsure [V] bool, probs [V] float64).

    keep: the documented rule; top-k = the k largest; top-p = the smallest prefix (descending)
    of the renormalised top-k survivors whose mass reaches top_p; min-p: p_i >= min_p * p_max,
    i.e. exp(s_i - s_max) >= min_p. unsure: tokens whose top-p or min-p decision lies within tol
    of its threshold, where float32 arithmetic may legitimately decide either way. probs: the
    exact sampling distribution (softmax over the kept tokens).
    """
    s = np.asarray(logits, np.float64) / temperature
    V = s.shape[0]
    k = V if top_k == 0 else min(top_k, V)
    cand = np.argsort(-s, kind="stable")[:k]
    w = np.exp(s[cand] - s[cand[0]])          # relative to the most likely token
    p = w / w.sum()
    cum = np.cumsum(p)
    reached = np.nonzero(cum >= top_p)[0]
    n = reached[0] + 1 if len(reached) else k
    in_prefix = np.arange(k) < n
    keep_c = in_prefix & (w >= min_p)
    unsure_c = np.abs((cum - p) - top_p) < tol
    if min_p > 0:
        unsure_c |= np.abs(w - min_p) < tol * min_p
    unsure_c[0] = False                       # the top token is always kept
    keep = np.zeros(V, bool)
    unsure = np.zeros(V, bool)
    keep[cand[keep_c]] = True
    unsure[cand[unsure_c]] = True
    probs = np.zeros(V)
    probs[keep] = np.exp(s[keep] - s[keep].max())
    probs /= probs.sum()
    return keep, unsure, probs


def test_filtered_logits_matches_reference_per_row():
    temps, top_ks, top_ps, min_ps = (0.3, 0.7, 1.0, 1.8), (0, 1, 3, 20, 50, 64), \
        (1.0, 0.95, 0.6, 0.2), (0.0, 0.02, 0.2)
    grid = [(t, k, p, m) for t in temps for k in top_ks for p in top_ps for m in min_ps]
    V = 50
    logits = _distinct_logits(np.random.default_rng(0), len(grid), V)
    t, k, p, m = (np.array(c) for c in zip(*grid))
    got = np.asarray(_filtered(jnp.asarray(logits), _arrays(t, k, p, m)))

    unsure_total = 0
    sizes = set()
    for b, (tb, kb, pb, mb) in enumerate(grid):
        keep, unsure, _ = _reference_filter(logits[b], tb, kb, pb, mb)
        sure = ~unsure
        if pb < 1.0:
            unsure_total += unsure.sum()
        # (With top_p == 1 the unsure tokens are the tail holding the last 1e-5 of the mass,
        # which a float32 cumsum cannot resolve.)
        sizes.add(int(keep.sum()))
        kept = np.isfinite(got[b])
        np.testing.assert_array_equal(kept[sure], keep[sure],
                                      err_msg=f"row {b}: T={tb} top_k={kb} top_p={pb} min_p={mb}")
        assert np.all(got[b][~kept] == -np.inf)
        # Survivors carry the temperature-scaled logits.
        np.testing.assert_allclose(got[b][kept], logits[b][kept] / np.float32(tb), rtol=1e-6)
        assert kept[np.argmax(logits[b])]
    # The comparison is meaningful: few float32-ambiguous entries, many different survivor sets.
    assert unsure_total < 0.002 * logits.size
    assert len(sizes) > 20


def test_candidate_filter_matches_reference_on_every_tier():
    """Top-k / top-p over the most likely candidates (lax.top_k) rather than the sorted
    vocabulary: with candidate counts (4, 16) on V = 50, each row alone goes to the first tier
    that surely holds its survivors (top_k <= 4, or top-k off and the 4 candidates' mass
    reaching top_p), else 16, else the full sort; a batch goes where its least covered row
    must. The survivors equal the numpy reference wherever it is certain, on every tier, and
    each tier is taken by some row."""
    temps, top_ks, top_ps, min_ps = (0.3, 1.0, 1.8), (0, 1, 3, 4, 5, 16, 20, 64), \
        (1.0, 0.95, 0.6, 0.2), (0.0, 0.2)
    grid = [(t, k, p, m) for t in temps for k in top_ks for p in top_ps for m in min_ps]
    V, caps = 50, (4, 16)
    logits = _distinct_logits(np.random.default_rng(3), len(grid), V)
    f = jax.jit(lambda x, sp: filtered_logits(x, sp, candidates=caps))

    def tier(row, t, k, p):
        if k == 0 and p >= 1.0:
            return "min_p"
        s = np.sort(logits[row].astype(np.float64) / t)[::-1]
        q = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
        for c in caps:
            if (0 < k <= c) or (k == 0 and q[:c].sum() >= p + 1e-4):
                return c
        return "sort"

    tiers = {}
    for b, (tb, kb, pb, mb) in enumerate(grid):
        got = np.asarray(f(jnp.asarray(logits[b:b + 1]), _arrays(tb, kb, pb, mb)))[0]
        keep, unsure, _ = _reference_filter(logits[b], tb, kb, pb, mb)
        kept = np.isfinite(got)
        np.testing.assert_array_equal(kept[~unsure], keep[~unsure],
                                      err_msg=f"row {b}: T={tb} top_k={kb} top_p={pb} min_p={mb}")
        np.testing.assert_allclose(got[kept], logits[b][kept] / np.float32(tb), rtol=1e-6)
        tiers[tier(b, tb, kb, pb)] = tiers.get(tier(b, tb, kb, pb), 0) + 1
    assert all(tiers.get(t, 0) >= 6 for t in (4, 16, "sort", "min_p")), tiers
    # The whole grid as one batch: some row needs the full sort, so every row gets it.
    t, k, p, m = (np.array(c) for c in zip(*grid))
    batch = np.asarray(f(jnp.asarray(logits), _arrays(t, k, p, m)))
    full = np.asarray(_filtered(jnp.asarray(logits), _arrays(t, k, p, m)))
    np.testing.assert_array_equal(batch, full)


@pytest.mark.parametrize("candidates", [(), (64,)], ids=["full_sort", "candidates"])
def test_top_k_among_equal_logits_keeps_the_lowest_indices(candidates):
    """Logits of a few repeated values (0.0 and -0.0 among them, which compare equal), NaN
    and -inf: top-k keeps exactly the first k of numpy's stable descending order (equal values
    by index; NaN never), on the full sort and on the candidate tier, for cuts that fall inside
    a run of equal values. -0.0 and NaN are left out where lax.top_k ranks the candidates (the
    candidate tier without the native sort): it puts NaN above every number (a row with NaN
    then keeps nothing there) and 0.0 above -0.0."""
    rng = np.random.default_rng(11)
    B, V = 24, 300
    special = backends.default().kernels is not None or not candidates
    values = np.array([2.0, 1.0, 0.0, -0.0 if special else 0.0, -1.0, -np.inf,
                       np.nan if special else -2.0], np.float32)
    logits = values[rng.choice(len(values), (B, V), p=[.05, .15, .3, .3, .15, .03, .02])]
    top_k = rng.integers(1, 60, B)
    got = np.asarray(jax.jit(lambda x, sp: filtered_logits(x, sp, candidates=candidates))(
        jnp.asarray(logits), _arrays(1.0, top_k)))
    for b in range(B):
        order = np.argsort(np.where(np.isnan(logits[b]), np.inf, -logits[b]),  # NaN last
                           kind="stable")
        keep = np.zeros(V, bool)
        keep[order[:top_k[b]]] = True
        keep &= np.isfinite(logits[b])    # a kept -inf is -inf all the same
        np.testing.assert_array_equal(np.isfinite(got[b]), keep, err_msg=f"row {b}, k={top_k[b]}")
        np.testing.assert_array_equal(got[b][keep], logits[b][keep])


def test_filtered_logits_top_p_uses_top_k_renormalised_mass():
    # Probabilities (T=1) [0.47, 0.26, 0.13, 0.07, ...]. Over the top 3 renormalised:
    # [0.55, 0.30, 0.15]; mass before the third is 0.85 >= 0.8, so top_p=0.8 keeps 2. Without
    # renormalisation the mass before the third would be 0.73 < 0.8 and it would keep 3.
    logits = np.log(np.array([0.47, 0.26, 0.13, 0.07, 0.04, 0.02, 0.007, 0.003]))
    perm = np.array([3, 0, 6, 1, 7, 4, 2, 5])          # vocabulary order != probability order
    x = np.empty(8, np.float32)
    x[perm] = logits
    got = np.asarray(_filtered(jnp.asarray(x[None]), _arrays(1.0, 3, 0.8)))[0]
    np.testing.assert_array_equal(np.isfinite(got), np.isin(np.arange(8), perm[:2]))
    got = np.asarray(_filtered(jnp.asarray(x[None]), _arrays(1.0, 0, 0.8)))[0]
    np.testing.assert_array_equal(np.isfinite(got), np.isin(np.arange(8), perm[:3]))


# ---- exact cases of `sample` ---------------------------------------------------------------------

def test_temperature_zero_is_argmax():
    rng = np.random.default_rng(1)
    B, V = 32, 1000
    logits = rng.normal(size=(B, V)).astype(np.float32) * 3
    sp = _arrays(0.0, rng.integers(0, 50, B), rng.uniform(0.05, 1.0, B), rng.uniform(0, 0.9, B),
                 1.0, rng.integers(0, 2**32, B, dtype=np.uint64))
    seen = jnp.asarray(rng.random((B, V)) < 0.3)
    got = _sample(jnp.asarray(logits), sp, seen, jnp.asarray(rng.integers(0, 100, B), jnp.int32))
    np.testing.assert_array_equal(np.asarray(got), logits.argmax(-1))

    # Greedy rows stay greedy when other rows of the batch sample.
    temp = np.where(np.arange(B) % 2 == 0, 0.0, 1.5).astype(np.float32)
    got = np.asarray(_sample(jnp.asarray(logits), _arrays(temp, seed=np.arange(B)), seen,
                             jnp.zeros(B, jnp.int32)))
    np.testing.assert_array_equal(got[::2], logits.argmax(-1)[::2])
    assert np.mean(got[1::2] != logits.argmax(-1)[1::2]) > 0.5   # the others really sample


@pytest.mark.parametrize("temperature", [1e-3, 0.5, 1.0, 10.0, 1e3])
def test_single_survivor_is_argmax_at_any_temperature(temperature):
    rng = np.random.default_rng(2)
    B, V = 48, 512
    logits = _distinct_logits(rng, B, V, spread=20.0)      # neighbours >= 0.039 apart
    best = logits.argmax(-1)
    seeds = rng.integers(0, 2**32, B, dtype=np.uint64)
    idx = jnp.asarray(rng.integers(0, 1000, B), jnp.int32)
    for filt in (dict(top_k=1), dict(top_p=1e-6),
                 dict(top_k=0, top_p=1.0, min_p=0.999) if temperature <= 10 else None):
        if filt is None:   # exp(-0.039 / 1e3) > 0.999: min_p cannot isolate the top token there
            continue
        got = _sample(jnp.asarray(logits), _arrays(temperature, seed=seeds, B=B, **filt),
                      _no_seen(B, V), idx)
        np.testing.assert_array_equal(np.asarray(got), best, err_msg=str(filt))


def test_repetition_penalty_hand_built():
    logits = np.array([[2.0, -1.0, 1.5, 0.5, -0.2, 0.0]] * 3, np.float32)
    seen = np.array([[1, 1, 0, 0, 1, 1],
                     [1, 1, 0, 0, 1, 1],
                     [0, 0, 0, 1, 0, 0]], bool)
    penalty = np.array([2.0, 1.0, 0.2], np.float32)
    got = np.asarray(apply_repetition_penalty(jnp.asarray(logits), jnp.asarray(seen),
                                              jnp.asarray(penalty)))
    want = np.array([[1.0, -2.0, 1.5, 0.5, -0.4, 0.0],     # seen: >0 divided, <0 multiplied
                     [2.0, -1.0, 1.5, 0.5, -0.2, 0.0],     # penalty 1: unchanged
                     [2.0, -1.0, 1.5, 2.5, -0.2, 0.0]],    # penalty < 1 boosts token 3
                    np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-7)

    # In `sample`, the penalty acts on raw logits before everything else, per row.
    for temp, top_k in ((0.0, 0), (0.5, 1), (3.0, 1)):
        tok = _sample(jnp.asarray(logits), _arrays(temp, top_k, repetition_penalty=penalty),
                      jnp.asarray(seen), jnp.zeros(3, jnp.int32))
        np.testing.assert_array_equal(np.asarray(tok), [2, 0, 3])
    # Temperature divides the penalised logits: penalty 2 then T=0.5 gives 2 * [1, -2, ...].
    got = np.asarray(_filtered(jnp.asarray(want), _arrays(0.5, B=3)))
    np.testing.assert_allclose(got, want / np.float32(0.5), rtol=1e-7)


def test_mark_seen():
    seen = jnp.zeros((2, 6), bool).at[1, 5].set(True)
    tokens = jnp.asarray([[0, 3, 3, 4], [2, 1, 0, 0]], jnp.int32)
    valid = jnp.asarray([[1, 1, 0, 0], [1, 0, 0, 0]], bool)
    got = np.asarray(mark_seen(seen, tokens, valid))
    np.testing.assert_array_equal(got, [[1, 0, 0, 1, 0, 0], [0, 0, 1, 0, 0, 1]])


# ---- the sampled distribution -------------------------------------------------------------------

def test_sample_distribution_matches_filtered_softmax():
    """Empirical distributions of N draws per setting vs the exact filtered softmax.

    Bound: total variation TV(empirical, exact) <= 0.01 on each setting, with N = 200_000.
    With K <= 8 outcomes, E[TV] <= 0.5 * sqrt((K - 1) / N) = 0.003 (Cauchy-Schwarz on
    E|q_i - p_i| <= sqrt(p_i (1 - p_i) / N)), and one draw moves TV by at most 1/N, so
    P(TV >= 0.003 + t) <= exp(-2 N t^2) (McDiarmid): for t = 0.007 that is 3e-9. So a correct
    sampler passes with that margin, and a sampler whose distribution is off by TV >= 0.02 (2% of
    the mass in the wrong place) shows TV >= 0.02 - 0.01 > bound except with the same 3e-9
    probability. (At N = 20_000 the E[TV] bound alone is 0.009, too close to 0.02 to separate.)
    Tokens outside the exact support must never be drawn.
    """
    base = np.array([2.0, 1.6, 1.1, 0.7, 0.3, -0.2, -0.9, -1.5])
    perm = np.array([3, 0, 6, 1, 7, 4, 2, 5])
    x = np.empty(8, np.float32)
    x[perm] = base
    settings = [  # (top_k, top_p, min_p) at temperature 0.7
        (0, 1.0, 0.0),      # 8 tokens
        (0, 0.9, 0.0),      # 4
        (5, 1.0, 0.0),      # 5
        (0, 1.0, 0.05),     # 5
        (3, 0.8, 0.0),      # 2 (top-p over the renormalised top-3)
        (6, 0.95, 0.05),    # 5
    ]
    N, T = 200_000, 0.7
    S = len(settings)
    k, p, m = (np.repeat(np.array(c), N) for c in zip(*settings))
    seed = np.repeat(np.arange(S) + 100, N)
    idx = jnp.asarray(np.tile(np.arange(N), S), jnp.int32)   # a request's tokens 0 .. N-1
    logits = jnp.broadcast_to(jnp.asarray(x), (S * N, 8))
    draws = np.asarray(_sample(logits, _arrays(T, k, p, m, 1.0, seed), _no_seen(S * N, 8), idx))
    supports = []
    for s, (ks, ps, ms) in enumerate(settings):
        keep, unsure, exact = _reference_filter(x, T, ks, ps, ms)
        assert not unsure.any()
        supports.append(int(keep.sum()))
        counts = np.bincount(draws[s * N:(s + 1) * N], minlength=8)
        assert counts[~keep].sum() == 0, (settings[s], counts, keep)
        tv = 0.5 * np.abs(counts / N - exact).sum()
        assert tv <= 0.01, (settings[s], tv, counts / N, exact)
    assert supports == [8, 4, 5, 5, 2, 5]


# ---- seeds ----------------------------------------------------------------------------------------

def test_seeded_token_depends_on_seed_and_index_only():
    rng = np.random.default_rng(3)
    V = 1000
    row0 = rng.normal(size=V).astype(np.float32) * 2
    seen0 = rng.random(V) < 0.1
    p0 = dict(temperature=1.0, top_k=0, top_p=0.95, min_p=0.0, repetition_penalty=1.2,
              seed=1234)
    idx0 = 5

    def run(others_logits, others_params, others_idx):
        logits = np.concatenate([row0[None], others_logits])
        seen = np.concatenate([seen0[None], rng.random((len(others_logits), V)) < 0.1])
        cols = {key: [p0[key]] + [o[key] for o in others_params] for key in p0}
        idx = np.array([idx0] + list(others_idx), np.int32)
        out = _sample(jnp.asarray(logits), _arrays(**cols), jnp.asarray(seen), jnp.asarray(idx))
        return int(out[0])

    def params(**kw):
        d = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, seed=0)
        d.update(kw)
        return d

    results = {
        run(np.zeros((0, V), np.float32), [], []),                         # alone (B = 1)
        run(rng.normal(size=(3, V)).astype(np.float32), [params()] * 3, [0, 0, 0]),
        run(rng.normal(size=(3, V)).astype(np.float32) * 5,
            [params(temperature=0.3, top_k=7, seed=1), params(temperature=2.0, min_p=0.1, seed=2),
             params(temperature=1.0, top_p=0.5, repetition_penalty=0.7, seed=1234)], [0, 9, 5]),
        run(np.broadcast_to(row0, (3, V)).copy(),
            [params(temperature=1.0, top_p=0.95, repetition_penalty=1.2, seed=1234)] * 3,
            [4, 6, 7]),
    }
    assert len(results) == 1

    # And it is the documented draw: the inverse CDF of the filtered softmax at
    # u = uniform(fold_in(key(seed), index)).
    pen = np.where(seen0, np.where(row0 > 0, row0 / np.float32(1.2), row0 * np.float32(1.2)),
                   row0).astype(np.float32)
    keep, unsure, probs = _reference_filter(pen, 1.0, 0, 0.95, 0.0)
    assert not unsure.any()
    assert results == {_reference_draw(probs, 1234, idx0)}


def _reference_draw(probs, seed, index):
    """The documented draw in float64: the first token whose cumulative probability exceeds
    u = uniform(fold_in(key(seed), index)). Asserts u is not within 1e-5 of a boundary, where
    float32 running sums may decide either way."""
    u = float(jax.random.uniform(jax.random.fold_in(jax.random.key(np.uint32(seed)), index)))
    cum = np.cumsum(probs)
    assert np.min(np.abs(cum - u)) > 1e-5
    return int(np.argmax(cum > u))


@pytest.mark.parametrize("native", [False, True], ids=["two levels", "native where built"])
@pytest.mark.parametrize("V,block", [(1000, 64), (4096, 1024), (1030, 256), (50, 1024)])
def test_blocked_argmax_equals_numpy(V, block, native):
    """The backend's argmax against numpy's argmax (first index of the maximum; NaN counts as the
    maximum, its first occurrence wins) on random rows, ties inside a block and across blocks,
    rows of -inf, rows with NaN, a V that is not a multiple of the block (padded), leading axes,
    and bf16 input; in two levels, and through the native CPU kernel where it is built (float32
    rows longer than a block)."""
    import dataclasses

    from jaxinfer.backends.sort import argmax
    backend = backends.resolve(num_devices=1)
    if not native:
        backend = dataclasses.replace(backend, kernels=None, batch_invariant=False)
    rng = np.random.default_rng(V)
    x = rng.standard_normal((12, V)).astype(np.float32)
    x[1, [3, 7]] = 9.0                              # a tie inside one block
    x[2, [5, V - 1]] = 9.0                          # a tie across blocks, the last entry
    x[3] = -np.inf                                  # nothing beats -inf: index 0
    x[4, [V // 2, V - 2]] = np.nan                  # NaN wins, the first one
    x[5, V - 1] = 50.0                              # the maximum in the (padded) last block
    x[6] = 1.0                                      # all equal
    x[7, :] = -np.inf
    x[7, V - 1] = -1e30                             # the only finite entry is the last
    x[8, [10, V - 3]] = [np.inf, np.nan]            # +inf before a NaN: the NaN wins
    x[9, [V - 4, 2]] = np.inf                       # two +inf: the first
    f = jax.jit(lambda a: argmax(backend, a, block))
    np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x))), np.argmax(x, axis=-1))
    x3 = x.reshape(3, 4, V)
    np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x3))), np.argmax(x3, axis=-1))
    xb = jnp.asarray(x, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(f(xb)),
                                  np.argmax(np.asarray(xb.astype(jnp.float32)), axis=-1))
    assert f(jnp.asarray(x)).dtype == jnp.int32


def test_draw_against_reference_and_zero_weights():
    """sampling.draw on rows whose weights are unnormalised, sparse (zeros must never be
    drawn, even at u near 0 or 1) and span several blocks, against a float64 inverse CDF."""
    from jaxinfer.device.sampling import draw
    rng = np.random.default_rng(7)
    B, V = 64, 1000                         # 4 blocks of 256, the last one partial
    w = rng.random((B, V)) * (rng.random((B, V)) < 0.05) * rng.uniform(0.1, 50, (B, 1))
    w[np.arange(B), rng.integers(0, V, B)] = 1.0     # every row has mass
    u = np.concatenate([[0.0, 1 - 2 ** -24], rng.random(B - 2)]).astype(np.float32)
    got = np.asarray(jax.jit(draw)(jnp.asarray(w, jnp.float32), jnp.asarray(u)))
    assert np.all(w[np.arange(B), got] > 0)
    cum = np.cumsum(w / w.sum(1, keepdims=True), axis=1)
    want = np.argmax(cum > u[:, None].astype(np.float64), axis=1)
    near = np.min(np.abs(cum - u[:, None]), axis=1) < 1e-5
    np.testing.assert_array_equal(got[~near], want[~near])
    assert (~near).sum() >= B - 4
    assert got[1] == np.nonzero(w[1])[0].max()      # u just below 1: the last positive token
    assert got[0] == np.nonzero(w[0])[0].min()      # u = 0: the first positive token


def test_different_seeds_and_indices_give_different_tokens():
    rng = np.random.default_rng(4)
    B, V = 200, 1000
    logits = jnp.broadcast_to(jnp.asarray(rng.normal(size=V).astype(np.float32)), (B, V))
    by_seed = np.asarray(_sample(logits, _arrays(1.0, seed=np.arange(B) * 7919 + 1),
                                 _no_seen(B, V), jnp.zeros(B, jnp.int32)))
    by_index = np.asarray(_sample(logits, _arrays(1.0, seed=77, B=B), _no_seen(B, V),
                                  jnp.arange(B, dtype=jnp.int32)))
    # hundreds of plausible tokens (entropy ~6.4 nats): 200 draws give far more than 100 distinct ones.
    assert len(set(by_seed.tolist())) > 100
    assert len(set(by_index.tolist())) > 100
    big = np.array([2**31 - 1, 2**31, 2**32 - 1], np.uint64)   # the whole uint32 range is usable
    out = np.asarray(_sample(logits[:3], _arrays(1.0, seed=big), _no_seen(3, V),
                             jnp.zeros(3, jnp.int32)))
    x = np.asarray(logits[0], np.float64)
    probs = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
    np.testing.assert_array_equal(out, [_reference_draw(probs, s, 0) for s in big])


# ---- the real model through the LLM API ---------------------------------------------------------

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def llm():
    return ji.LLM("smollm2-135m", max_seq_len=256, max_num_seqs=4)


def test_llm_seeded_request_is_independent_of_the_batch(llm):
    sp = ji.SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=16)
    alone = llm.generate(PROMPT, sp)[0].token_ids
    assert len(alone) == 16
    others = [
        ("Once upon a time", ji.SamplingParams(temperature=1.0, seed=7, max_tokens=10)),
        ("def fib(n):", ji.SamplingParams(max_tokens=20)),
        ("Water boils at", ji.SamplingParams(temperature=0.5, top_k=20, min_p=0.1,
                                             repetition_penalty=1.3, seed=99, max_tokens=12)),
    ]
    prompts = [others[0][0], others[1][0], PROMPT, others[2][0]]   # the seeded one in slot 2
    params = [others[0][1], others[1][1], sp, others[2][1]]
    batch = llm.generate(prompts, params)
    assert batch[2].token_ids == alone
    assert llm.generate(PROMPT, sp)[0].token_ids == alone            # and again, alone
    other_seed = llm.generate(PROMPT, ji.SamplingParams(temperature=0.8, top_p=0.95, seed=1235,
                                                        max_tokens=16))[0].token_ids
    assert other_seed != alone


def test_new_sampling_values_do_not_compile(llm, compile_recorder):
    variants = [
        ji.SamplingParams(max_tokens=12),
        ji.SamplingParams(temperature=0.7, seed=1, max_tokens=12),
        ji.SamplingParams(temperature=1.3, top_p=0.8, seed=2, max_tokens=12),
        ji.SamplingParams(temperature=0.9, top_k=5, seed=3, max_tokens=12),
        ji.SamplingParams(temperature=1.0, min_p=0.2, seed=4, max_tokens=12),
        ji.SamplingParams(temperature=0.6, repetition_penalty=1.5, seed=5, max_tokens=12),
        ji.SamplingParams(temperature=0.0, repetition_penalty=0.8, max_tokens=12),
        ji.SamplingParams(temperature=2.0, top_k=40, top_p=0.9, min_p=0.05,
                          repetition_penalty=1.1, seed=2**32 - 1, max_tokens=12),
    ]
    llm.generate(PROMPT, ji.SamplingParams(temperature=0.5, seed=0, max_tokens=12))  # warm
    with compile_recorder() as rec:
        outs = [llm.generate(PROMPT, sp)[0] for sp in variants]
        assert rec.logs == [] and rec.events == [], (rec.logs, rec.events)
    assert all(len(o.token_ids) > 0 for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) > 4        # the values did take effect


def test_top_p_one_keeps_every_token():
    """top_p == 1 disables the filter: no tail token is cut by float32 cumsum rounding."""
    x = jnp.asarray([[1., 30., 20., 25., -3.]], jnp.float32)
    sp = SamplingArrays(*(jnp.asarray([v], d) for v, d in (
        (1.0, jnp.float32), (0, jnp.int32), (1.0, jnp.float32), (0.0, jnp.float32),
        (1.0, jnp.float32), (0, jnp.uint32))))
    assert np.isfinite(np.asarray(filtered_logits(x, sp))).all()
