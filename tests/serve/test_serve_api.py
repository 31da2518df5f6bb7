"""The OpenAI-compatible server against the official openai client on a live loopback server:
answers equal llm.generate token for token, streamed and not; stop strings; logprobs and echo;
/health and /v1/models; /metrics counts. Bad input, overload, disconnects and shutdown are in
test_serve_errors.py."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxinfer.engine.request import SamplingParams

MODEL = "smollm2-135m"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def reference(server, prompt, **params):
    """llm.generate on the server's own engine, between requests."""
    fut = server.state.engine.call(lambda llm: llm.generate([prompt], SamplingParams(**params)))
    return fut.result(timeout=120)[0]


def token_texts(llm, ids):
    return [llm.tokenizer.decode([t], skip_special_tokens=False) for t in ids]


def collect_completion(stream):
    text, tokens, lps, finish, chunks = "", [], [], None, []
    for chunk in stream:
        chunks.append(chunk)
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        text += choice.text
        if choice.logprobs is not None:
            tokens += choice.logprobs.tokens
            lps += choice.logprobs.token_logprobs
        finish = choice.finish_reason or finish
    return text, tokens, lps, finish, chunks


def collect_chat(stream):
    text, tokens, finish, roles, usage = "", [], None, [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            roles += [choice.delta.role] if choice.delta.role else []
            text += choice.delta.content or ""
            if choice.logprobs is not None:
                tokens += [t.token for t in choice.logprobs.content]
            finish = choice.finish_reason or finish
    return text, tokens, finish, roles, usage


def test_health_and_models(server, client, raw):
    assert raw.request("GET", "/health")[:1] == (200,)
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_health_before_ready(helpers):
    from jaxinfer.serve import ServeConfig, ServerThread

    with ServerThread(None, ServeConfig(MODEL)) as srv:  # no model attached: still loading
        r = helpers.Raw(srv.url)
        assert r.request("GET", "/health")[0] == 503
        status, headers, body = r.request("POST", "/v1/completions", {"prompt": "a"})
        assert status == 503 and headers["retry-after"] == "1"
        assert body["error"]["type"] == "service_unavailable"


@pytest.mark.parametrize("sampling", [dict(temperature=0.0),
                                      dict(temperature=0.9, top_p=0.95, seed=1234)],
                         ids=["greedy", "seeded"])
def test_completions_match_generate(server, client, llm, sampling):
    ref = reference(server, PROMPT, max_tokens=8, logprobs=0, **sampling)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, logprobs=0,
                                  **sampling)
    c = r.choices[0]
    assert c.text == ref.text and c.finish_reason == ref.finish_reason
    assert c.logprobs.tokens == token_texts(llm, ref.token_ids)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (
        len(ref.prompt_token_ids), len(ref.token_ids))
    text, tokens, lps, finish, _ = collect_completion(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, logprobs=0, stream=True, **sampling))
    assert (text, tokens, finish) == (ref.text, c.logprobs.tokens, ref.finish_reason)
    assert lps == pytest.approx([lp[t] for lp, t in zip(ref.logprobs, ref.token_ids)],
                                abs=1e-5)
    # A prompt given as token ids is the same request.
    r2 = client.completions.create(model=MODEL, prompt=ref.prompt_token_ids, max_tokens=8,
                                   **sampling)
    assert r2.choices[0].text == ref.text


@pytest.mark.parametrize("sampling", [dict(temperature=0.0),
                                      dict(temperature=0.8, top_p=0.9, seed=7)],
                         ids=["greedy", "seeded"])
def test_chat_matches_generate(server, client, llm, sampling):
    prompt = llm.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    ref = reference(server, prompt, max_tokens=8, logprobs=0, **sampling)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, logprobs=True,
                                       **sampling)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == ref.text
    assert [t.token for t in c.logprobs.content] == token_texts(llm, ref.token_ids)
    assert c.finish_reason == ref.finish_reason
    assert r.usage.completion_tokens == len(ref.token_ids)
    text, tokens, finish, roles, usage = collect_chat(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=8, logprobs=True, stream=True,
        stream_options={"include_usage": True}, **sampling))
    assert (text, tokens, finish, roles) == (ref.text, token_texts(llm, ref.token_ids),
                                             ref.finish_reason, ["assistant"])
    assert usage.completion_tokens == len(ref.token_ids)
    assert usage.prompt_tokens == len(ref.prompt_token_ids)


def test_n_choices_match_generate(server, client):
    """n = 3 seeded: three choices, each the request's sequence of that index (llm.generate
    with n = 3), streamed and not; usage counts every sequence's tokens."""
    ref = reference(server, PROMPT, max_tokens=8, temperature=0.9, seed=21, n=3)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0.9,
                                  seed=21, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [o.text for o in ref.outputs]
    assert r.usage.completion_tokens == sum(len(o.token_ids) for o in ref.outputs)
    texts, finish = ["", "", ""], [None] * 3
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                           temperature=0.9, seed=21, n=3, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            finish[c.index] = c.finish_reason or finish[c.index]
    assert texts == [o.text for o in ref.outputs]
    assert finish == [o.finish_reason for o in ref.outputs]


@pytest.mark.parametrize("stop", ["\n\n", "s."], ids=["whole-token", "across-tokens"])
def test_stop_strings(server, client, stop):
    full = reference(server, PROMPT, max_tokens=8).text
    assert stop in full
    ref = reference(server, PROMPT, max_tokens=8, stop=[stop])
    assert ref.text == full[:full.index(stop)] and ref.finish_reason == "stop"
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                  stop=stop)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (ref.text, "stop")
    text, _, _, finish, chunks = collect_completion(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop], stream=True))
    assert (text, finish) == (ref.text, "stop")   # no held-back prefix of the stop leaked
    assert all(stop not in c.choices[0].text for c in chunks)


def test_logprobs(server, client, llm):
    ref = reference(server, PROMPT, max_tokens=4, logprobs=3)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    for i, (tok, want) in enumerate(zip(ref.token_ids, ref.logprobs)):
        assert lp.token_logprobs[i] == pytest.approx(want[tok], abs=1e-5)
        top = sorted(want.items(), key=lambda kv: -kv[1])[:3]
        assert lp.top_logprobs[i] == pytest.approx(
            {llm.tokenizer.decode([t], skip_special_tokens=False): v for t, v in top}, abs=1e-5)
    offsets = [0]
    for t in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp.text_offset == offsets
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2)
    for entry in chat.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob <= entry.top_logprobs[0].logprob + 1e-6
        assert bytes(entry.bytes).decode() == entry.token


def test_echo_scores_the_prompt(server, client, llm):
    ref = reference(server, PROMPT, max_tokens=2, logprobs=1, prompt_logprobs=1)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                                  logprobs=1, echo=True)
    c = r.choices[0]
    assert c.text == PROMPT + ref.text
    ids = ref.prompt_token_ids + ref.token_ids
    assert c.logprobs.tokens == token_texts(llm, ids)
    assert c.logprobs.token_logprobs[0] is None
    want = [lp[t] for lp, t in zip(ref.prompt_logprobs[1:] + ref.logprobs, ids[1:])]
    assert c.logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-5)
    text, tokens, lps, _, _ = collect_completion(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=1, echo=True,
        stream=True))
    assert (text, tokens) == (c.text, c.logprobs.tokens)
    assert lps[1:] == pytest.approx(c.logprobs.token_logprobs[1:], abs=1e-6)


def scrape(raw) -> dict:
    status, _, text = raw.request("GET", "/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_count_what_was_sent(server, client, raw, helpers, llm):
    before = scrape(raw)
    usages = [client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=n,
                                        temperature=0).usage for n in (3, 5)]
    *_, usage = collect_chat(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    usages.append(usage)
    assert raw.request("POST", "/v1/completions", {"prompt": "a", "temperature": 5})[0] == 400
    after = scrape(raw)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("jaxinfer_requests_total", endpoint="/v1/completions", status="200") == 2
    assert delta("jaxinfer_requests_total", endpoint="/v1/chat/completions", status="200") == 1
    assert delta("jaxinfer_requests_total", endpoint="/v1/completions", status="400") == 1
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert delta(f"jaxinfer_{hist}_count") == 3
    finished = sum(delta("jaxinfer_requests_finished_total", finish_reason=r)
                   for r in ("stop", "length"))
    assert finished == 3
    assert delta("jaxinfer_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    generated = [u.completion_tokens for u in usages]
    assert delta("jaxinfer_generation_tokens_total") == sum(generated)
    assert delta("jaxinfer_inter_token_latency_seconds_count") == sum(n - 1 for n in generated)
    # Every admitted request looks its whole prompt up in the prefix cache once (no request
    # here is preempted: the CPU pool holds every slot at max_seq_len); the rejected one never
    # reaches the engine. Hits come in whole pages, never the page of the last token.
    assert delta("jaxinfer_prefix_cache_query_tokens_total") == sum(u.prompt_tokens
                                                                    for u in usages)
    page = llm._engine.paged.page_size
    hits = delta("jaxinfer_prefix_cache_hit_tokens_total")
    assert hits % page == 0 and 0 <= hits <= sum((u.prompt_tokens - 1) // page * page
                                                 for u in usages)
    idle = helpers.wait_for(lambda: (m := scrape(raw))[("jaxinfer_requests_running", ())] == 0
                            and m[("jaxinfer_kv_pages_used", ())] == 0 and m, 5)
    assert idle and idle[("jaxinfer_requests_waiting", ())] == 0
    assert idle[("jaxinfer_kv_pages_total", ())] == server.state.engine.stats["num_pages"]
    for name in ("kv_page_utilization", "prefix_cache_hit_rate", "preemptions_total"):
        assert ("jaxinfer_" + name, ()) in idle
    assert server.state.engine.stats["pages_used"] == 0
