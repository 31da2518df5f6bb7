"""Structured outputs on the real SmolLM2 (bf16 weights, the default kernels), checked against
independent judges: every JSON output validates with the `jsonschema` library, regex outputs
fullmatch Python's `re`, grammar outputs parse with the `lark` parser, and each step's token
is replayed through a fresh llguidance matcher (the grammar engine's own reference): it must be
allowed, and under greedy decoding it must be the most likely allowed token. Also: rows under a
constraint leave the other rows' tokens unchanged, preemption and the prefix cache keep the
output, n > 1 and speculation work, bad constraints are refused before any device work.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from schemas import PROMPTS, SCHEMAS

MODEL = "smollm2-135m"
MAX_TOKENS = 160
NAMES = list(SCHEMAS)


@pytest.fixture(scope="module")
def llm():
    import jaxinfer as ji

    # Pages of 8 tokens: outputs cross many page boundaries. A pool of 96 pages (768 tokens)
    # cannot hold 8 rows of these prompts and outputs at once, so the schema batch preempts
    # (asserted).
    from jaxinfer import backends

    # The dtype users get (bfloat16; the suite's own default is float32, tests/conftest.py).
    llm = ji.LLM(MODEL, dtype=backends.default_dtype(), max_num_seqs=8, max_seq_len=512,
                 page_size=8, num_pages=96)
    llm.warmup()
    return llm


def _chat(llm, text: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def _params(ji, spec, temperature=0.0, seed=0, **kw):
    return ji.SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=seed,
                             structured_outputs=spec, **kw)


def _replay(llm, spec, out, greedy: bool) -> None:
    """Replays out's tokens through a fresh matcher of spec's grammar: each is allowed by the
    reference mask, and a greedy one is the most likely allowed token among the top-20 raw
    log-probabilities (when any allowed one is there). Ends accepting unless cut by length."""
    from jaxinfer.structured import fill_masks, mask_words

    guide = llm.grammars.guide(llm.grammars.compile(spec))
    mask = np.zeros((1, mask_words(llm.model_config.vocab_size)), np.int32)
    for i, tok in enumerate(out.token_ids):
        fill_masks([(guide, 0)], mask)
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
        assert bits[tok], f"token {i} ({tok}) is outside the grammar's mask"
        if greedy and out.logprobs is not None:
            top = out.logprobs[i]
            allowed = sorted(((lp, t) for t, lp in top.items() if bits[t]), reverse=True)
            if len(allowed) > 1 and allowed[0][0] == allowed[1][0]:
                pass  # a tie: either is the argmax
            elif allowed:
                assert allowed[0][1] == tok, f"token {i}: {tok} chosen, {allowed[0][1]} is " \
                                             "the most likely allowed token"
        guide.consume(tok)
    if out.finish_reason == "stop":
        assert guide.accepting


def _validate(name: str, text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMAS[name],
                        format_checker=jsonschema.FormatChecker())


@pytest.fixture(scope="module")
def schema_outputs(llm):
    """The 31 schemas, greedy and seeded (temperature 0.7), as one batch of 62 requests."""
    import jaxinfer as ji

    before = llm.stats()["preemptions"]
    specs = [ji.StructuredOutputs(json=SCHEMAS[n]) for n in NAMES]
    prompts = [_chat(llm, PROMPTS[n]) for n in NAMES]
    params = [_params(ji, s, logprobs=20) for s in specs] + \
             [_params(ji, s, 0.7, seed=100 + i) for i, s in enumerate(specs)]
    outs = llm.generate(prompts + prompts, params)
    return specs, outs, llm.stats()["preemptions"] - before


def test_every_schema_output_validates(llm, schema_outputs):
    specs, outs, preemptions = schema_outputs
    assert len(SCHEMAS) >= 30
    for i, out in enumerate(outs):
        name = NAMES[i % len(NAMES)]
        assert out.finish_reason == "stop", (name, out.finish_reason, out.text)
        _validate(name, out.text)
    assert preemptions > 0  # the masks survive re-prefilling


def test_each_token_is_the_references_choice(llm, schema_outputs):
    specs, outs, _ = schema_outputs
    n = len(NAMES)
    for i, out in enumerate(outs):
        _replay(llm, specs[i % n], out, greedy=i < n)


def test_outputs_survive_preemption_and_prefix_cache(llm, schema_outputs):
    """A request alone (no preemption; its prompt's pages cached by the batch) gives the
    tokens it got in the preempting batch."""
    import jaxinfer as ji

    specs, outs, _ = schema_outputs
    for i in (0, 16, 23):
        alone = llm.generate(_chat(llm, PROMPTS[NAMES[i]]),
                             _params(ji, specs[i], logprobs=20))[0]
        assert alone.metrics.prefix_cache_hit_tokens > 0
        assert alone.token_ids == outs[i].token_ids


def test_unconstrained_rows_are_unchanged(llm):
    """Free rows beside constrained ones get the tokens they get alone (greedy and seeded)."""
    import jaxinfer as ji

    free = [ji.SamplingParams(max_tokens=40, ignore_eos=True),
            ji.SamplingParams(max_tokens=40, temperature=0.9, seed=5, ignore_eos=True)]
    prompts = [_chat(llm, "Tell me about the sea."), _chat(llm, "Name three fruits.")]
    alone = llm.generate(prompts, free)
    spec = ji.StructuredOutputs(json=SCHEMAS["person"])
    mixed = llm.generate(prompts + [_chat(llm, PROMPTS["person"])] * 3,
                         free + [_params(ji, spec, 0.8, seed=s) for s in range(3)])
    for a, m in zip(alone, mixed):
        assert a.token_ids == m.token_ids
    for m in mixed[2:]:
        _validate("person", m.text)


@pytest.mark.parametrize("pattern", [r"\(\d{3}\) \d{3}-\d{4}", r"[a-z]{1,12}@[a-z]{1,12}\.(com|org)",
                                     r"(yes|no), because [a-z ]{5,40}\."])
def test_regex_outputs_fullmatch(llm, pattern):
    import jaxinfer as ji

    spec = ji.StructuredOutputs(regex=pattern)
    prompt = _chat(llm, f"Answer in the form {pattern}: is water wet?")
    outs = llm.generate([prompt] * 2, [_params(ji, spec, logprobs=20),
                                       _params(ji, spec, 0.9, seed=3)])
    for i, out in enumerate(outs):
        assert out.finish_reason == "stop" and re.fullmatch(pattern, out.text), out.text
        _replay(llm, spec, out, greedy=i == 0)


def test_choice_outputs_are_one_of_the_choices(llm):
    import jaxinfer as ji

    choices = ["positive", "negative", "neutral", "positive but cautious"]
    spec = ji.StructuredOutputs(choice=choices)
    prompt = _chat(llm, "Classify the sentiment: 'I loved this film.'")
    outs = llm.generate([prompt] * 4, [_params(ji, spec, logprobs=20)] +
                        [_params(ji, spec, 1.5, seed=s) for s in range(3)])
    for out in outs:
        assert out.finish_reason == "stop" and out.text in choices, out.text


ARITHMETIC = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: INT | "(" expr ")"
INT: /[0-9]{1,4}/
"""


def test_lark_grammar_outputs_parse_with_lark(llm):
    import lark

    import jaxinfer as ji

    spec = ji.StructuredOutputs(grammar=ARITHMETIC)
    parser = lark.Lark(ARITHMETIC, start="start")
    prompt = _chat(llm, "Write an arithmetic expression equal to 10, like (2+3)*2.")
    outs = llm.generate([prompt] * 3, [_params(ji, spec, logprobs=20)] +
                        [_params(ji, spec, 0.8, seed=s) for s in range(2)])
    for i, out in enumerate(outs):
        assert out.finish_reason in ("stop", "length")
        if out.finish_reason == "stop":
            parser.parse(out.text)
        _replay(llm, spec, out, greedy=i == 0)
    assert sum(o.finish_reason == "stop" for o in outs) >= 2


def test_json_object_and_n_sequences(llm):
    """json_object gives a JSON object; n = 2 gives two valid outputs, sequence i equal to a
    request of seed + i alone."""
    import jaxinfer as ji

    spec = ji.StructuredOutputs(json_object=True)
    prompt = _chat(llm, 'Reply with a JSON object like {"make": "Ford", "year": 1990}.')
    out = llm.generate(prompt, _params(ji, spec, n=2, seed=11, temperature=0.6))[0]
    for i, seq in enumerate(out.outputs):
        assert seq.finish_reason == "stop", seq.text
        assert isinstance(json.loads(seq.text), dict)
        alone = llm.generate(prompt, _params(ji, spec, seed=11 + i, temperature=0.6))[0]
        assert alone.token_ids == seq.token_ids


def test_a_budget_too_small_finishes_length(llm):
    """A constraint the output cannot finish within max_tokens ends "length", never "stop"."""
    import jaxinfer as ji

    spec = ji.StructuredOutputs(json=SCHEMAS["array_of_objects"])
    out = llm.generate(_chat(llm, PROMPTS["array_of_objects"]),
                       ji.SamplingParams(max_tokens=5, structured_outputs=spec))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


@pytest.mark.parametrize("kw, message", [
    (dict(json={"type": "strin"}), "Invalid type"),
    (dict(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
    (dict(json={"type": "string", "format": "phone"}), "format"),
    (dict(regex="a(b"), "unclosed group"),
    (dict(grammar="start: foo"), "foo"),
])
def test_bad_constraints_are_refused_before_device_work(llm, kw, message):
    import jaxinfer as ji

    before = llm.stats()["generated_tokens"]
    with pytest.raises(ValueError, match=message):
        llm.generate("x", ji.SamplingParams(structured_outputs=ji.StructuredOutputs(**kw)))
    assert llm.stats()["generated_tokens"] == before
    assert not llm.has_unfinished_requests()


@pytest.mark.parametrize("kw", [dict(), dict(json={}, regex="a"), dict(choice=[]),
                                dict(choice="ab"), dict(regex=""), dict(json_object=1),
                                dict(json="{not json"), dict(json=[1]),
                                dict(grammar="x" * (1 << 20 | 1)),
                                dict(choice=["a"] * 2000), dict(regex="\ud800")])
def test_malformed_constraints_are_refused(kw):
    import jaxinfer as ji

    with pytest.raises(ValueError, match="structured_outputs"):
        ji.StructuredOutputs(**kw)


def test_speculation_leaves_constrained_rows_undrafted(llm):
    """With n-gram speculation on, a constrained row never drafts (verification applies no
    mask) and gets the tokens it gets without speculation; free rows still draft."""
    import jaxinfer as ji

    spec = ji.StructuredOutputs(json=SCHEMAS["object_with_array"])
    # The module's engine but for speculation, so that it is the reference.
    spec_llm = ji.LLM(MODEL, dtype=llm.dtype, max_num_seqs=8, max_seq_len=512, page_size=8,
                      num_pages=96,
                      speculative=ji.SpeculativeConfig(method="ngram", num_draft_tokens=3))
    prompt = _chat(llm, PROMPTS["object_with_array"])
    free = ji.SamplingParams(max_tokens=120, ignore_eos=True)
    outs = spec_llm.generate([prompt, prompt], [ji.SamplingParams(max_tokens=MAX_TOKENS,
                                                             structured_outputs=spec), free])
    assert outs[0].metrics.draft_tokens == 0
    assert outs[1].metrics.draft_tokens > 0
    _validate("object_with_array", outs[0].text)
    ref = llm.generate(prompt, ji.SamplingParams(max_tokens=MAX_TOKENS,
                                                 structured_outputs=spec))[0]
    assert ref.token_ids == outs[0].token_ids


def test_token_mask_matches_llguidance_reference():
    """apply_token_mask (jitted, packed words) against llguidance's numpy reference: the same
    tokens at -inf, the rest unchanged, for vocabularies that do and do not fill a word."""
    import jax
    from llguidance.numpy import apply_token_bitmask_inplace

    from jaxinfer.device.sampling import ALL_TOKENS, apply_token_mask

    rng = np.random.default_rng(0)
    for V in (49152, 1000, 33):
        words = -(-V // 32)
        mask = rng.integers(-2**31, 2**31, (4, words), dtype=np.int64).astype(np.int32)
        mask[1] = ALL_TOKENS                      # an unconstrained row
        mask[2] = 0
        mask[2, 0] = 1 << 5                       # one token allowed
        logits = rng.standard_normal((4, V)).astype(np.float32)
        ref = logits.copy()
        apply_token_bitmask_inplace(ref, mask)
        got = np.asarray(jax.jit(apply_token_mask)(logits, mask))
        np.testing.assert_array_equal(got, ref)
        # All rows unconstrained: the logits come back unchanged.
        free = np.full_like(mask, ALL_TOKENS)
        np.testing.assert_array_equal(np.asarray(jax.jit(apply_token_mask)(logits, free)),
                                      logits)


def test_constrained_requests_compile_nothing(llm, compile_recorder):
    """After warmup, constrained and free rows together (flat steps and decode dispatches,
    greedy and sampled, every kind of constraint) run the warmed programs only."""
    import jaxinfer as ji

    kinds = [ji.StructuredOutputs(json=SCHEMAS["person"]), ji.StructuredOutputs(regex="[0-9]{4}"),
             ji.StructuredOutputs(choice=["a", "b"]), ji.StructuredOutputs(grammar=ARITHMETIC),
             ji.StructuredOutputs(json_object=True), None]
    prompts = [_chat(llm, PROMPTS["person"])] * len(kinds)
    with compile_recorder() as rec:
        llm.generate(prompts, [ji.SamplingParams(max_tokens=24, temperature=t, seed=i,
                                                 structured_outputs=k)
                               for i, (k, t) in enumerate(zip(kinds, [0, 0.7] * 3))])
    assert rec.logs == [] and rec.events == []
