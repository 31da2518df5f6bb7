"""Batch jobs on the real SmolLM2-135M (one module-wide LLM, small settings): outputs equal
LLM.generate's on the same prompts and parameters, bad lines get their error records, a job
stopped by an exception resumes to the uninterrupted output, shards merge to it."""

import json
import time

import pytest
from batch_util import (LLM_KWARGS, PROMPTS, assert_same_output, line, load_output,
                        mixed_requests, write_lines)

import jaxinfer as ji
from jaxinfer.batch import JobSpec, records, run_local
from jaxinfer.openai_api import CHAT

MAX_TOKENS = 6
SEED = 11
N_GOOD = 10


class Crash(Exception):
    pass


@pytest.fixture(scope="module")
def llm():
    return ji.LLM(**LLM_KWARGS)


def bad_lines():
    """(line, expected kind) of every way a line can fail."""
    return [("{not json", "invalid_json"),
            (json.dumps({"url": "/v1/completions", "body": {"prompt": "x"}}), "missing_custom_id"),
            (line("r1", {"prompt": "dup"}), "duplicate_custom_id"),
            (line("e1", {"input": "x"}, "/v1/embeddings"), "unknown_url"),
            (line("e2", {"prompt": "x", "top_p": 0}), "invalid_request"),
            (line("e3", {"prompt": "word " * 300}), "prompt_too_long"),
            (line("e4", {"prompt": [1, 2, 10**9]}), "invalid_prompt"),
            (line("e5", {"prompt": "x", "n": 99}), "invalid_request")]


@pytest.fixture(scope="module")
def job(llm, tmp_path_factory):
    """The uninterrupted job: (spec, its summary)."""
    tmp = tmp_path_factory.mktemp("job")
    lines = mixed_requests(N_GOOD, MAX_TOKENS)
    for bad, _ in bad_lines():
        lines.insert(len(lines) // 2, bad)
    lines.insert(3, "")
    spec = JobSpec(write_lines(tmp / "in.jsonl", lines), str(tmp / "out"), LLM_KWARGS,
                   seed=SEED, commit_every=4, progress=False)
    return spec, run_local(llm, spec)


def reference_params(record_line):
    """The prompt and SamplingParams of a good request line, written out by hand."""
    req = json.loads(record_line)
    body, cid = req["body"], req["custom_id"]
    temperature = body.get("temperature", 1.0)
    seed = body.get("seed", records.derive_seed(SEED, cid))
    top = body.get("top_logprobs") if body.get("logprobs") else None
    params = ji.SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=seed,
                               top_k=body.get("top_k", 0), logprobs=top)
    return req["url"] == CHAT, body.get("prompt") or body["messages"], params


def test_outputs_equal_generate_and_bad_lines_get_error_records(llm, job):
    spec, summary = job
    out = load_output(f"{spec.output_dir}/output.jsonl")
    lines = [x for x in open(spec.input_path).read().splitlines() if x]
    assert len(out) == len(lines)  # one output line per input line, in input order
    requests = set(mixed_requests(N_GOOD, MAX_TOKENS))
    good = [(i, x) for i, x in enumerate(lines) if x in requests]
    assert len(good) == N_GOOD
    prompts, params, chats = [], [], []
    for _, x in good:
        chat, prompt, sp = reference_params(x)
        prompts.append(llm.tokenizer.apply_chat_template(prompt) if chat else prompt)
        params.append(sp)
        chats.append(chat)
    want = llm.generate(prompts, params)
    for (i, x), w, chat in zip(good, want, chats):
        rec = out[i]
        assert rec["custom_id"] == json.loads(x)["custom_id"] and rec["error"] is None
        body = rec["response"]["body"]
        assert rec["response"]["status_code"] == 200 and body["model"] == "smollm2-135m"
        choice = body["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        assert (text, choice["finish_reason"]) == (w.text, w.finish_reason)
        assert body["usage"] == {"prompt_tokens": len(w.prompt_token_ids),
                                 "completion_tokens": len(w.token_ids),
                                 "total_tokens": len(w.prompt_token_ids) + len(w.token_ids)}
        if w.logprobs is not None:  # float32 sums in other batches: equal to ~1e-5
            got = [t["logprob"] for t in choice["logprobs"]["content"]]
            assert got == pytest.approx([lp[t] for lp, t in zip(w.logprobs, w.token_ids)],
                                        abs=1e-4)
    for bad, kind in bad_lines():
        i = lines.index(bad)
        rec = out[i]
        if rec["response"] is None:
            assert rec["error"]["code"] == kind and f"line {i + 2}" in rec["error"]["message"]
        else:
            assert rec["response"]["status_code"] == (404 if kind == "unknown_url" else 400)
            assert rec["response"]["body"]["error"]["message"]
    too_long = out[lines.index(bad_lines()[5][0])]["response"]["body"]["error"]
    assert "prompt has 301 tokens; max_seq_len is 256" in too_long["message"]
    kinds = [kind for _, kind in bad_lines()]
    assert summary["errors_by_kind"] == {kind: kinds.count(kind) for kind in kinds}
    too_many = out[lines.index(bad_lines()[7][0])]["response"]["body"]["error"]
    assert too_many["param"] == "n" and "n=99 exceeds the limit of 4" in too_many["message"]
    assert (summary["requests"], summary["succeeded"], summary["blank_lines"]) == (
        len(lines), N_GOOD, 1)
    assert summary["completion_tokens"] == sum(len(w.token_ids) for w in want)
    assert summary["runs"] == 1 and summary["output_tokens_per_s"] > 0


def test_a_job_stopped_midway_resumes_to_the_same_output(llm, job, tmp_path):
    spec, _ = job
    resumed = JobSpec(spec.input_path, str(tmp_path / "out"), LLM_KWARGS, seed=SEED,
                      commit_every=4, progress=False)
    commits = []

    def stop_after_two(entry):
        commits.append(entry)
        if len(commits) == 2:
            raise Crash  # the requests in the engine are lost, as under a kill

    with pytest.raises(Crash):
        run_local(llm, resumed, on_commit=stop_after_two)
    assert not llm.has_unfinished_requests()
    summary = run_local(llm, resumed)
    assert_same_output(f"{resumed.output_dir}/output.jsonl", f"{spec.output_dir}/output.jsonl")
    assert summary["runs"] == 2
    again = run_local(llm, resumed)  # finished: rerunning changes nothing
    assert again["requests"] == summary["requests"]
    assert_same_output(f"{resumed.output_dir}/output.jsonl", f"{spec.output_dir}/output.jsonl")


def test_shards_merge_to_the_unsharded_output(llm, job, tmp_path):
    from jaxinfer.batch import merge

    spec, summary = job
    out = str(tmp_path / "out")
    for i in range(2):
        shard = JobSpec(spec.input_path, out, LLM_KWARGS, seed=SEED, num_shards=2,
                        shard_index=i, commit_every=3, progress=False)
        assert run_local(llm, shard)["num_shards"] == 2
    merged = merge(out)
    assert_same_output(f"{out}/output.jsonl", f"{spec.output_dir}/output.jsonl")
    assert {k: merged[k] for k in ("requests", "succeeded", "errors_by_kind")} == {
        k: summary[k] for k in ("requests", "succeeded", "errors_by_kind")}


def test_plain_text_lines_take_sampling_from_the_flags(llm, tmp_path):
    path = write_lines(tmp_path / "prompts.txt", [PROMPTS[0], "", PROMPTS[1]])
    spec = JobSpec(path, str(tmp_path / "out"), LLM_KWARGS, seed=3, progress=False,
                   sampling={"max_tokens": 4, "temperature": 0.8})
    summary = run_local(llm, spec)
    out = load_output(f"{spec.output_dir}/output.jsonl")
    assert [r["custom_id"] for r in out] == ["1", "3"] and summary["blank_lines"] == 1
    want = llm.generate([PROMPTS[0], PROMPTS[1]], [
        ji.SamplingParams(max_tokens=4, temperature=0.8, seed=records.derive_seed(3, c))
        for c in ("1", "3")])
    assert [r["response"]["body"]["choices"][0]["text"] for r in out] == [w.text for w in want]


def test_a_model_without_tokenizer_is_refused_before_any_work(data_dir, tmp_path):
    tiny = ji.LLM(f"{data_dir}/tiny_models/llama", max_seq_len=64, max_num_seqs=2)
    path = write_lines(tmp_path / "in.jsonl", [line("a", {"prompt": [1, 2, 3]})])
    spec = JobSpec(path, str(tmp_path / "out"), {"model": "tiny"}, progress=False)
    with pytest.raises(ValueError, match="'tiny' has no tokenizer"):
        run_local(tiny, spec)
    assert not (tmp_path / "out").exists()


class FailingTokenizer:
    """The model's tokenizer, but encode raises (a bug) for one prompt text."""

    def __init__(self, inner, text):
        self.inner, self.text = inner, text

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, text, *args, **kwargs):
        if text == self.text:
            raise RuntimeError("a tokenizer bug")
        return self.inner.encode(text, *args, **kwargs)


class EngineErrors:
    """The LLM, but a request of one prompt finishes "error", as when its bookkeeping raised."""

    def __init__(self, inner, prompt):
        self.inner, self.prompt = inner, prompt

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step(self):
        import dataclasses

        return [dataclasses.replace(o, finish_reason="error")
                if o.finished and o.prompt == self.prompt else o for o in self.inner.step()]


def test_an_internal_failure_of_one_request_gets_a_500_record(llm, tmp_path, monkeypatch,
                                                              caplog):
    from jaxinfer.batch import engine_loop

    greedy = {"max_tokens": 3, "temperature": 0}
    prompts = [PROMPTS[0], "boom on submit", PROMPTS[1], "boom in the body", "boom in engine"]
    lines = [line(f"q{i}", {"prompt": p, **greedy}) for i, p in enumerate(prompts)]
    spec = JobSpec(write_lines(tmp_path / "in.jsonl", lines), str(tmp_path / "out"),
                   LLM_KWARGS, progress=False)
    body = engine_loop.response_body

    def failing_body(req, *args, **kwargs):
        if req.prompt == "boom in the body":
            raise KeyError("a response bug")
        return body(req, *args, **kwargs)

    monkeypatch.setattr(engine_loop, "response_body", failing_body)
    monkeypatch.setattr(llm, "tokenizer", FailingTokenizer(llm.tokenizer, "boom on submit"))
    summary = run_local(EngineErrors(llm, "boom in engine"), spec)
    monkeypatch.undo()
    out = load_output(f"{spec.output_dir}/output.jsonl")
    assert [r["custom_id"] for r in out] == [f"q{i}" for i in range(5)]
    for i in (1, 3, 4):
        response = out[i]["response"]
        assert response["status_code"] == 500 and out[i]["error"] is None
        assert response["body"]["error"]["type"] == "server_error"
        message = response["body"]["error"]["message"]
        assert message.startswith(f"line {i + 1}: internal error") and "bug" not in message
    want = llm.generate([PROMPTS[0], PROMPTS[1]], ji.SamplingParams(max_tokens=3))
    assert [out[i]["response"]["body"]["choices"][0]["text"] for i in (0, 2)] == [
        w.text for w in want]
    assert summary["errors_by_kind"] == {"internal_error": 3} and summary["succeeded"] == 2
    assert "line 2: submitting the request failed" in caplog.text
    assert "line 4: building the response failed" in caplog.text
    assert "RuntimeError: a tokenizer bug" in caplog.text  # the traceback goes to the log
    assert not llm.has_unfinished_requests()


def test_the_model_is_fingerprinted_by_its_content(tmp_path, monkeypatch):
    import shutil

    from jaxinfer.batch import job
    from jaxinfer.batch.store import ShardStore
    from jaxinfer.loading.hub import ALIASES, resolve_alias

    source = resolve_alias("smollm2-135m")
    copy = tmp_path / "elsewhere.gguf"
    shutil.copyfile(source, copy)
    inp = write_lines(tmp_path / "in.jsonl", [line("a", {"prompt": "x"})])

    def fingerprint(model):
        return JobSpec(inp, "unused", {**LLM_KWARGS, "model": model}).fingerprint("jsonl")

    fp = fingerprint("smollm2-135m")
    assert fp["model"] == {"name": "smollm2-135m", "sha256": ALIASES["smollm2-135m"].sha256}
    out = str(tmp_path / "out")
    ShardStore(out, 0, 1, fp, inp)
    ShardStore(out, 0, 1, fingerprint(str(copy)), inp)  # the same file elsewhere: resumes
    ShardStore(out, 0, 1, fingerprint(source), inp)
    with open(copy, "r+b") as f:  # one bit changed, same size
        f.seek(5_000_000)
        b = f.read(1)
        f.seek(5_000_000)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(ValueError, match="other settings \\(model was {'name': "
                                         "'smollm2-135m', 'sha256': "):
        ShardStore(out, 0, 1, fingerprint(str(copy)), inp)
    ShardStore(str(tmp_path / "old"), 0, 1, {**fp, "model": "smollm2-135m"}, inp)  # before
    with pytest.raises(ValueError, match="model was 'smollm2-135m', now {'name'"):
        ShardStore(str(tmp_path / "old"), 0, 1, fp, inp)

    # The digest of each file is remembered, keyed by its path, size, times and inode.
    monkeypatch.setenv("JAXINFER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(job, "FRESH_S", 0.0)
    changed = job.file_sha256(str(copy))
    (stamp,) = (tmp_path / "cache" / "digests").iterdir()
    recorded = json.loads(stamp.read_text())
    stamp.write_text(json.dumps({**recorded, "sha256": "0" * 64}))
    assert job.file_sha256(str(copy)) == "0" * 64  # read from the stamp, not hashed
    time.sleep(0.05)  # past the timestamps' tick
    copy.write_bytes(copy.read_bytes())  # rewritten: new times
    assert job.file_sha256(str(copy)) == changed
