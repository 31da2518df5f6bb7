"""LLM.beam_search against an independent reference: a plain numpy float64 beam search over
full forwards (no cache) of the tiny random Llama in tests/data, following the rule written in
docs/api.md. Same beams (token ids, finish reasons) and the same scores within 1e-4 (the engine
computes float32 logits over a paged cache; the reference float64 over the whole sequence).
Width 1 equals greedy decoding. Memory: the pages of a width-4 search on a 200-token prompt are
one prompt's pages plus the beams' own tails.
"""

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

import jaxinfer as ji
from jaxinfer.engine.beam_search import BeamSearchParams

TINY = os.path.join(os.path.dirname(__file__), "data", "tiny_models", "llama")
# Chosen (from seeded random ones) so that EOS ends hypotheses at every width tested.
PROMPTS = [[132, 194, 243, 11, 39, 211], [130, 69, 8, 192], [186, 77, 139],
           [200, 1, 150, 9, 9, 31, 64, 77, 3, 14, 88]]


def _forward(w, cfg, tokens):
    """Logits [T, V] in float64: a plain HF-layout Llama (half-rotation RoPE)."""
    T = len(tokens)
    N, K = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    H, eps = cfg["head_dim"], cfg["rms_norm_eps"]
    theta = cfg["rope_parameters"]["rope_theta"]
    g = lambda name: w[name].astype(np.float64)  # noqa: E731
    norm = lambda x, s: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * s  # noqa: E731
    ang = np.arange(T)[:, None] * theta ** (-np.arange(0, H, 2) / H)[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

    def rope(x):                                           # [T, heads, H]
        rot = np.concatenate([-x[..., H // 2:], x[..., :H // 2]], -1)
        return x * cos[:, None] + rot * sin[:, None]

    h = g("model.embed_tokens.weight")[tokens]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = norm(h, g(p + "input_layernorm.weight"))
        q = rope((x @ g(p + "self_attn.q_proj.weight").T).reshape(T, N, H))
        k = rope((x @ g(p + "self_attn.k_proj.weight").T).reshape(T, K, H))
        v = (x @ g(p + "self_attn.v_proj.weight").T).reshape(T, K, H)
        k, v = np.repeat(k, N // K, axis=1), np.repeat(v, N // K, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(H) + mask
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        h = h + np.einsum("hts,shd->thd", a, v).reshape(T, N * H) @ g(p + "self_attn.o_proj.weight").T
        x = norm(h, g(p + "post_attention_layernorm.weight"))
        gate = x @ g(p + "mlp.gate_proj.weight").T
        h = h + ((gate / (1 + np.exp(-gate))) * (x @ g(p + "mlp.up_proj.weight").T)) @ \
            g(p + "mlp.down_proj.weight").T
    return norm(h, g("model.norm.weight")) @ g("lm_head.weight").T


def _log_softmax(x):
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def reference_beam_search(w, cfg, prompt, W, max_tokens, length_penalty, eos):
    """The documented rule, from scratch: candidates ranked by cumulative log-probability, the
    best 2W kept; EOS among the first W finishes a hypothesis; W live beams; at max_tokens the
    live beams finish; early stop once W are finished and no live beam's score beats them."""
    score = lambda cum, n: cum / max(n, 1) ** length_penalty  # noqa: E731
    live, finished = [([], 0.0)], []
    for step in range(max_tokens):
        cands = []
        for i, (toks, cum) in enumerate(live):
            lp = _log_softmax(_forward(w, cfg, prompt + toks)[-1])
            order = np.argsort(-lp, kind="stable")[:2 * W]
            cands += [(cum + lp[t], i, r, int(t)) for r, t in enumerate(order)]
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        nxt = []
        for rank, (cum, i, _, t) in enumerate(cands[:2 * W]):
            if len(nxt) == W:
                break
            if t == eos:
                if rank < W:
                    finished.append((score(cum, len(live[i][0]) + 1), cum, live[i][0], "stop"))
                continue
            nxt.append((live[i][0] + [t], cum))
        live = nxt
        top = sorted((f[0] for f in finished), reverse=True)[:W]
        if step + 1 == max_tokens:
            finished += [(score(c, len(t)), c, t, "length") for t, c in live]
            break
        if len(top) == W and max(score(c, len(t)) for t, c in live) <= top[-1]:
            break
    return sorted(finished, key=lambda f: -f[0])[:W]


def _llm():
    return ji.LLM(TINY, max_seq_len=256, max_num_seqs=12, page_size=16)


@pytest.fixture(scope="module")
def tiny():
    llm = _llm()
    with open(os.path.join(TINY, "config.json")) as f:
        cfg = json.load(f)
    return llm, load_file(os.path.join(TINY, "model.safetensors")), cfg


@pytest.mark.parametrize("W,penalty", [(1, 1.0), (2, 1.0), (4, 0.6)])
def test_beams_and_scores_match_a_float64_reference(tiny, W, penalty):
    llm, w, cfg = tiny
    got = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=W, max_tokens=7,
                                                    length_penalty=penalty))
    reasons = set()
    for prompt, out in zip(PROMPTS, got):
        ref = reference_beam_search(w, cfg, prompt, W, 7, penalty, cfg["eos_token_id"])
        assert [s.token_ids for s in out.sequences] == [r[2] for r in ref]
        assert [s.finish_reason for s in out.sequences] == [r[3] for r in ref]
        np.testing.assert_allclose([s.score for s in out.sequences], [r[0] for r in ref],
                                   atol=1e-4)
        np.testing.assert_allclose([s.cumulative_logprob for s in out.sequences],
                                   [r[1] for r in ref], atol=1e-4)
        reasons.update(r[3] for r in ref)
    assert llm.stats()["pages_used"] == 0
    assert reasons == {"stop", "length"}  # EOS ends some hypotheses, max_tokens others


def test_width_one_is_greedy(tiny):
    llm, _, _ = tiny
    beams = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=9,
                                                      ignore_eos=True))
    greedy = llm.generate(PROMPTS, ji.SamplingParams(max_tokens=9, ignore_eos=True))
    assert [b.sequences[0].token_ids for b in beams] == [g.token_ids for g in greedy]


def test_beams_share_the_prompt_pages():
    """Width 4 on a 200-token prompt (pages of 16): the peak is the prompt's 13 pages plus at
    most two of each beam's own (the copy of the partly filled page, and one more as 8 tokens
    cross a page boundary), not four prompts' 52."""
    llm = _llm()  # a fresh engine (its peak page count), the same compiled programs
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 256, 200)]
    out = llm.beam_search([prompt], BeamSearchParams(beam_width=4, max_tokens=8,
                                                     ignore_eos=True))
    assert len(out[0].sequences) == 4
    peak = llm.stats()["peak_pages_used"]
    assert 13 <= peak <= 13 + 2 * 4
    assert llm.stats()["pages_used"] == 0


def test_bad_params_are_refused(tiny):
    llm, _, _ = tiny
    with pytest.raises(ValueError, match="beam_width must be an int in \\[1, 10\\], got 11"):
        BeamSearchParams(beam_width=11)
    with pytest.raises(ValueError, match="max_seq_len is 256"):
        llm.beam_search([[5] * 256], BeamSearchParams(beam_width=2))
    small = ji.LLM(TINY, max_seq_len=256, max_num_seqs=4, page_size=16)
    with pytest.raises(ValueError, match="beam_width 5 exceeds the 4 slots"):
        small.beam_search(PROMPTS, BeamSearchParams(beam_width=5))
