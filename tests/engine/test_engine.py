"""Engine scheduling on a tiny HF model: warmup covers every shape, slots are refilled, and
batching does not change greedy results."""

import os

import numpy as np
import pytest

import jaxinfer as ji

TINY = os.path.join(os.path.dirname(__file__), "..", "data", "tiny_models", "llama")


@pytest.fixture(scope="module")
def llm():
    # Small buckets: batch {1, 4}, prefill chunk {16, 32}, kv_view {128} (capacity 128).
    return ji.LLM(TINY, max_seq_len=128, max_num_seqs=4, prefill_chunk=32, decode_steps=4)


def _prompts(n, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, int(rng.integers(1, 90))).tolist() for _ in range(n)]


def test_no_compilation_after_warmup(llm, compile_recorder):
    _no_compilation_after_warmup(llm, compile_recorder)


@pytest.mark.parametrize("method", ["ngram", pytest.param("draft", marks=pytest.mark.slow)])
def test_no_compilation_after_warmup_with_speculation(method, tmp_path, compile_recorder):
    from jaxinfer.draft_train import draft_from_target
    from jaxinfer.loading import load_model
    from jaxinfer.loading.checkpoint import save_checkpoint

    spec = ji.SpeculativeConfig("ngram", num_draft_tokens=3)
    if method == "draft":
        target = load_model(TINY)
        draft, draft_cfg = draft_from_target(target.params, target.config, 1)
        save_checkpoint(str(tmp_path / "draft"), draft_cfg, draft)
        spec = ji.SpeculativeConfig("draft", num_draft_tokens=3,
                                    draft_model=str(tmp_path / "draft"))
    llm = ji.LLM(TINY, max_seq_len=128, max_num_seqs=4, prefill_chunk=32, decode_steps=4,
                 speculative=spec)
    _no_compilation_after_warmup(llm, compile_recorder)


def _no_compilation_after_warmup(llm, compile_recorder):
    llm.warmup()
    with compile_recorder() as rec:
        # Mixed lengths (chunked prefill over 1..3 chunks), more requests than slots, each
        # sampling mode, seeds and stop strings: nothing may compile.
        prompts = _prompts(7, 0)
        params = [ji.SamplingParams(max_tokens=int(m), temperature=t, top_k=k, seed=i)
                  for i, (m, t, k) in enumerate(zip([3, 9, 20, 1, 5, 30, 2],
                                                    [0, 0.5, 1.0, 0, 0.9, 0, 1.5],
                                                    [0, 0, 8, 0, 3, 0, 0]))]
        outs = llm.generate(prompts, params)
        outs += llm.generate(_prompts(1, 1), ji.SamplingParams(max_tokens=40, ignore_eos=True))
        # Requests joining a running one grow the slot batch (1 -> 4 slots).
        sp = ji.SamplingParams(max_tokens=12, ignore_eos=True)
        llm.add_request(_prompts(1, 3)[0], sp)
        llm.step()
        for prompt in _prompts(3, 4):
            llm.add_request(prompt, sp)
        while llm.has_unfinished_requests():
            llm.step()
        assert rec.logs == [] and rec.events == [], rec.logs
    assert [len(o.token_ids) for o in outs[:7]] == [3, 9, 20, 1, 5, 30, 2]


def test_batching_and_slot_reuse_keep_greedy_results(llm):
    """Ten requests through four slots (slots refilled as requests finish) give the tokens each
    gets when run alone."""
    prompts = _prompts(10, 2)
    params = [ji.SamplingParams(max_tokens=m, ignore_eos=True)
              for m in [12, 3, 25, 7, 1, 18, 9, 30, 4, 14]]
    together = llm.generate(prompts, params)
    for prompt, sp, out in zip(prompts, params, together):
        alone = llm.generate([prompt], sp)[0]
        assert out.token_ids == alone.token_ids
        assert len(out.token_ids) == sp.max_tokens and out.finish_reason == "length"
    assert llm.stats()["running"] == 0 and llm.stats()["waiting"] == 0


@pytest.mark.parametrize("fail_at", [1, 7])  # in the flat step; in a decode dispatch
def test_a_failing_request_finishes_with_error_and_the_others_go_on(llm, fail_at, caplog):
    """One request's host bookkeeping raises at its fail_at-th token: it finishes "error" with
    the tokens before, the traceback is logged, and the requests beside it give exactly what
    they give alone; the engine serves on."""
    prompts = _prompts(3, 5)
    sp = ji.SamplingParams(max_tokens=16, ignore_eos=True)
    alone = [llm.generate([p], sp)[0].token_ids for p in prompts]
    rids = [llm.add_request(p, sp) for p in prompts]
    victim = llm._requests[rids[1]].stream
    calls, add = [], victim.add

    def broken_add(token_id):
        calls.append(token_id)
        if len(calls) == fail_at:
            raise RuntimeError("bookkeeping broke")
        return add(token_id)

    victim.add = broken_add
    outs = {}
    while llm.has_unfinished_requests():
        outs.update((o.request_id, o) for o in llm.step() if o.finished)
    assert outs[rids[1]].finish_reason == "error"
    assert outs[rids[1]].token_ids == alone[1][:fail_at]  # the token was booked, then it broke
    for i in (0, 2):
        assert outs[rids[i]].finish_reason == "length"
        assert outs[rids[i]].token_ids == alone[i]
    assert "bookkeeping broke" in caplog.text
    assert llm.generate([prompts[1]], sp)[0].token_ids == alone[1]


def test_greedy_matches_hf_generate(llm):
    """HF transformers' greedy continuation of the tiny model (golden.npz), via the engine."""
    golden = np.load(os.path.join(TINY, "golden.npz"))
    n = int(golden["greedy_prompt_len"])
    prompt = golden["input_ids"][0, :n].tolist()
    want = golden["greedy_ids"][0].tolist()
    out = llm.generate([prompt], ji.SamplingParams(max_tokens=len(want), ignore_eos=True))[0]
    assert out.token_ids == want


def test_pallas_kernels_match_reference_through_the_engine(tmp_path):
    """attention="pallas" (flash for prefill chunks, paged for decode; interpret mode on CPU)
    gives the reference implementation's greedy tokens, on a tiny random model with head dim 32
    saved as a checkpoint."""
    import jax

    from jaxinfer.config import ModelConfig
    from jaxinfer.loading.checkpoint import save_checkpoint
    from jaxinfer.models import llama

    cfg = ModelConfig("llama", vocab_size=256, d_model=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=32, ffn_dim=128, max_position_embeddings=512)
    save_checkpoint(str(tmp_path / "tiny"), cfg, llama.LLAMA.init_params(cfg, jax.random.key(7)))
    engines = {impl: ji.LLM(str(tmp_path / "tiny"), max_seq_len=128, max_num_seqs=4,
                            prefill_chunk=32, decode_steps=4, attention=impl)
               for impl in ("reference", "pallas")}
    assert engines["pallas"].engine_config.attention == "pallas"
    prompts = _prompts(3, 3)
    params = [ji.SamplingParams(max_tokens=m, ignore_eos=True) for m in (6, 11, 3)]
    ref, pallas = (engines[i].generate(prompts, params) for i in ("reference", "pallas"))
    assert [o.token_ids for o in pallas] == [o.token_ids for o in ref]
    with pytest.raises(ValueError, match="head dim"):
        ji.LLM(TINY, attention="pallas")  # head dim 16: no kernel for it


@pytest.fixture(scope="module")
def crowded():
    # 4 slots but pages for only 20 * 8 = 160 tokens: decoding rows must preempt each other.
    return ji.LLM(TINY, max_seq_len=128, max_num_seqs=4, prefill_chunk=32, decode_steps=4,
                  page_size=8, num_pages=1 + 20)


def test_preemption_keeps_greedy_and_seeded_results(llm, crowded):
    """Many mixed requests through few slots and few pages (the preemption path) give the
    tokens each gets alone; seeded sampling survives preemption (recompute never re-samples)."""
    prompts = _prompts(9, 5)
    params = [ji.SamplingParams(max_tokens=m, ignore_eos=True, temperature=t, seed=i)
              for i, (m, t) in enumerate(zip([40, 35, 50, 30, 45, 38, 42, 33, 47],
                                             [0, 0.8, 0, 1.0, 0, 0.7, 0, 0, 1.2]))]
    together = crowded.generate(prompts, params)
    assert crowded.stats()["preemptions"] > 0
    assert sum(o.metrics.preemptions for o in together) == crowded.stats()["preemptions"]
    for prompt, sp, out in zip(prompts, params, together):
        alone = llm.generate([prompt], sp)[0]
        assert out.token_ids == alone.token_ids
        assert len(out.token_ids) == sp.max_tokens
    stats = crowded.stats()
    assert stats["pages_used"] == 0 and stats["running"] == 0  # every page is free again


def test_admission_preempted_in_its_own_round_never_reaches_the_device(llm, crowded,
                                                                       monkeypatch):
    """A request admitted (such as a prefix-cache hit after an earlier preemption) and preempted
    by the same round's page reservation is left out of the admissions sent to the device: it
    once reached Runner.admit without a slot, and numpy's mask[None] = True rewrote every row
    (greedy tokens of the other rows changed)."""
    sched = crowded._engine.scheduler
    rounds = []
    real_admit, real_reserve = sched._admit, sched.reserve

    def admit():
        got = real_admit()
        rounds.append(([r for r, _ in got], []))
        return got

    def reserve(decoding, tokens):
        out = real_reserve(decoding, tokens)
        if rounds:
            rounds[-1][1].extend(out)
        return out

    monkeypatch.setattr(sched, "_admit", admit)
    monkeypatch.setattr(sched, "reserve", reserve)
    sent = []
    real_runner_admit = crowded._engine.runner.admit
    monkeypatch.setattr(crowded._engine.runner, "admit", lambda admitted, tables: (
        sent.extend(r.slot for r, _ in admitted), real_runner_admit(admitted, tables))[1])
    prompts = _prompts(9, 5)
    params = [ji.SamplingParams(max_tokens=m, ignore_eos=True, temperature=t, seed=i)
              for i, (m, t) in enumerate(zip([40, 35, 50, 30, 45, 38, 42, 33, 47],
                                             [0, 0.8, 0, 1.0, 0, 0.7, 0, 0, 1.2]))]
    together = crowded.generate(prompts, params)
    same_round = sum(any(r in preempted for r in admitted) for admitted, preempted in rounds)
    assert same_round > 0, "the workload no longer preempts a request in its admission round"
    assert None not in sent
    for prompt, sp, out in zip(prompts, params, together):
        assert out.token_ids == llm.generate([prompt], sp)[0].token_ids


def test_prefix_cache_shares_pages_and_keeps_outputs(crowded):
    rng = np.random.default_rng(6)
    system = rng.integers(0, 256, 40).tolist()  # 5 full pages of 8
    prompts = [system + rng.integers(0, 256, n).tolist() for n in (3, 9, 5)]
    sp = ji.SamplingParams(max_tokens=6, ignore_eos=True)
    first = [crowded.generate([p], sp)[0].token_ids for p in prompts]
    before = crowded.stats()["prefix_cache_hit_tokens"]
    again = crowded.generate(prompts, sp)
    assert [o.token_ids for o in again] == first
    hits = crowded.stats()["prefix_cache_hit_tokens"] - before
    assert hits >= 3 * 40 and crowded.stats()["prefix_cache_hit_rate"] > 0
    assert all(o.metrics.prefix_cache_hit_tokens >= 40 for o in again)


def test_abort_frees_pages(crowded):
    rid = crowded.add_request(_prompts(1, 7)[0], ji.SamplingParams(max_tokens=60,
                                                                   ignore_eos=True))
    crowded.step()
    crowded.step()
    assert crowded.stats()["pages_used"] > 0
    crowded.abort(rid)
    assert crowded.stats()["pages_used"] == 0 and not crowded.has_unfinished_requests()


def _tokens_by_step(llm, until):
    """Runs llm.step() until `until()`; returns per step {request_id: tokens so far}."""
    steps = []
    while not until():
        steps.append({o.request_id: len(o.token_ids) for o in llm.step()})
    return steps


def test_decodes_advance_every_step_while_a_long_prompt_prefills(llm):
    """Decode-maximal batching: while a 100-token prompt prefills in chunks within the token
    budget, the running request gets one token in every step (not a stall until the prompt
    is done), and both give the tokens they get alone."""
    budget = 20
    engine = ji.LLM(TINY, max_seq_len=128, max_num_seqs=4, prefill_chunk=16, decode_steps=4,
                    max_num_batched_tokens=budget)
    short, long = _prompts(1, 8)[0][:5], np.random.default_rng(9).integers(0, 256, 100).tolist()
    sp_a = ji.SamplingParams(max_tokens=40, ignore_eos=True)
    sp_b = ji.SamplingParams(max_tokens=3, ignore_eos=True)
    a = engine.add_request(short, sp_a)
    while not any(o.request_id == a and o.token_ids for o in engine.step()):
        pass
    b = engine.add_request(long, sp_b)
    counter = engine._engine.stats_counters
    prompt_tokens, seen_a, per_step, final = counter["prompt_tokens"], None, [], {}
    while True:
        got = {o.request_id: o for o in engine.step()}
        final.update(got)
        per_step.append(counter["prompt_tokens"] - prompt_tokens)
        prompt_tokens = counter["prompt_tokens"]
        n_a = len(got[a].token_ids)
        assert seen_a is None or n_a == seen_a + 1  # one token per step, never a stall
        seen_a = n_a
        if b in got and got[b].token_ids:
            break
    # 100 prompt tokens, chunks of at most 16 within the 20 - 1 tokens the decode leaves.
    assert sum(per_step) == 100 and max(per_step) <= min(16, budget - 1)
    assert len(per_step) == 7
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step()})
    for rid, prompt, sp in ((a, short, sp_a), (b, long, sp_b)):
        assert final[rid].token_ids == llm.generate([prompt], sp)[0].token_ids


def test_decode_dispatch_ends_early_for_a_waiting_request():
    """With a request waiting for a slot, a decode dispatch ends when a row stops rather than
    running all decode_steps, so the freed slot is refilled at once."""
    engine = ji.LLM(TINY, max_seq_len=128, max_num_seqs=2, prefill_chunk=16, decode_steps=16)
    prompts = [p[:8] for p in _prompts(3, 10)]  # each prefills in one chunk
    ids = [engine.add_request(p, ji.SamplingParams(max_tokens=m, ignore_eos=True))
           for p, m in zip(prompts, (3, 60, 5))]
    steps = _tokens_by_step(engine, lambda: not engine.has_unfinished_requests())
    finished_a = next(i for i, s in enumerate(steps) if s.get(ids[0]) == 3)
    # Row 0 stops after 2 decode tokens: the dispatch ends there, with row 1 equally short.
    assert steps[finished_a][ids[1]] == 3
    assert steps[finished_a + 1].get(ids[2]) == 1  # the waiting request started next step


def test_speculation_rates_pick_the_faster_mode_and_probe_the_other():
    from jaxinfer.engine.draft_policy import SpeculationRates

    rates = SpeculationRates()
    assert rates.draft(16)                      # nothing measured: draft first
    rates.record(16, True, tokens=100, seconds=1.0)
    assert not rates.draft(16)                  # then measure without drafting
    rates.record(16, False, tokens=300, seconds=1.0)
    picks = [rates.draft(16) for _ in range(2 * rates.PROBE_EVERY)]
    assert picks.count(True) == 2 and picks[rates.PROBE_EVERY - 1]   # probes only
    assert rates.draft(1)                       # batch sizes are measured apart
    for _ in range(10):                         # drafting got faster: it wins again
        rates.record(16, True, tokens=500, seconds=1.0)
    picks = [rates.draft(16) for _ in range(2 * rates.PROBE_EVERY)]
    assert picks.count(False) == 2              # and plain decoding is re-measured in turn


def test_stats_sizes(llm):
    """llm.stats()'s sizes: the weights' bytes equal the checkpoint's (read from the
    safetensors header: every tensor float32, as the test run's LLM dtype); the decode state's
    bytes cover at least the KV pool (layers x pages x page size x kv heads x head dim, K and
    V, float32) once a request has allocated it; model_programs counts at least one flat
    step and one decode loop."""
    import json
    import struct

    with open(os.path.join(TINY, "model.safetensors"), "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    header.pop("__metadata__", None)
    assert {v["dtype"] for v in header.values()} == {"F32"}
    want = 4 * sum(int(np.prod(v["shape"])) for v in header.values())
    llm.generate([[1, 2, 3]], ji.SamplingParams(max_tokens=2))
    stats = llm.stats()
    assert stats["parameter_bytes"] == want
    cfg = llm.model_config
    page_size = 16  # the LLM's default
    pool = 2 * 4 * cfg.num_layers * stats["num_pages"] * page_size * cfg.num_kv_heads * cfg.head_dim
    assert pool <= stats["state_bytes"] < pool * 1.5, (pool, stats["state_bytes"])
    assert stats["model_programs"] >= 2


def test_compile_threads_must_be_a_count(monkeypatch):
    """JAXINFER_COMPILE_THREADS (how many programs warmup compiles at once) names a bad value."""
    monkeypatch.setenv("JAXINFER_COMPILE_THREADS", "two")
    llm = ji.LLM(TINY, max_seq_len=128, max_num_seqs=4, prefill_chunk=32, decode_steps=4)
    with pytest.raises(ValueError, match="JAXINFER_COMPILE_THREADS must be a whole number >= 1, "
                                         "got 'two'"):
        llm.warmup()
