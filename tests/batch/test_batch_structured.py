"""Batch jobs with structured outputs: response_format, guided extensions and /v1/responses
lines give outputs that validate (jsonschema, the choices), a bad constraint gets an error
record naming its field, and a job stopped midway resumes to the uninterrupted output."""

import json

import jsonschema
import pytest
from batch_util import assert_same_output, line, load_output, write_lines

import jaxinfer as ji
from jaxinfer.batch import JobSpec, run_local

KWARGS = {"model": "smollm2-135m", "max_seq_len": 384, "max_num_seqs": 4}
SEED = 5
POINT = {"type": "object", "additionalProperties": False, "required": ["x", "y"],
         "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99},
                        "y": {"type": "integer", "minimum": 0, "maximum": 99}}}
CITY = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
        "properties": {"city": {"type": "string", "maxLength": 20},
                       "country": {"type": "string", "maxLength": 20}}}
SCHEMAS = {"point": POINT, "city": CITY}
CHOICES = ["red", "green", "blue"]


def _chat(cid, content, schema_name, **extra):
    return line(cid, {"messages": [{"role": "user", "content": content}], "max_tokens": 60,
                      "response_format": {"type": "json_schema", "json_schema": {
                          "name": schema_name, "schema": SCHEMAS[schema_name]}}, **extra},
                "/v1/chat/completions")


def requests():
    return [
        _chat("p0", "Give a point as JSON.", "point", temperature=0),
        _chat("p1", "Give a point as JSON.", "point", temperature=0.9, seed=3),
        _chat("c0", "A city and its country, as JSON.", "city"),  # the job derives the seed
        _chat("c1", "Paris, as JSON.", "city", temperature=0.7),
        line("k0", {"prompt": "My favourite colour is", "max_tokens": 5,
                    "guided_choice": CHOICES}),
        line("k1", {"prompt": "The sky is", "max_tokens": 5, "temperature": 1.2,
                    "structured_outputs": {"choice": CHOICES}}),
        line("r0", {"input": "Rome, as JSON.", "max_output_tokens": 60,
                    "text": {"format": {"type": "json_schema", "name": "city",
                                        "schema": CITY}}}, "/v1/responses"),
        line("r1", {"input": "Give a point.", "instructions": "Answer in JSON.",
                    "max_output_tokens": 60, "temperature": 0,
                    "text": {"format": {"type": "json_schema", "name": "point",
                                        "schema": POINT}}}, "/v1/responses"),
        line("bad", {"messages": [{"role": "user", "content": "x"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "a", "schema": {
                "type": "array", "uniqueItems": True}}}}, "/v1/chat/completions"),
    ]


@pytest.fixture(scope="module")
def llm():
    return ji.LLM(**KWARGS)


@pytest.fixture(scope="module")
def job(llm, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("structured")
    spec = JobSpec(write_lines(tmp / "in.jsonl", requests()), str(tmp / "out"), KWARGS,
                   seed=SEED, commit_every=3, progress=False)
    return spec, run_local(llm, spec)


def test_outputs_validate_and_a_bad_schema_gets_an_error_record(job):
    spec, _ = job
    records = {r["custom_id"]: r for r in load_output(f"{spec.output_dir}/output.jsonl")}
    bad = records["bad"]["response"]
    assert bad["status_code"] == 400 and bad["body"]["error"]["param"] == "response_format"
    assert "uniqueItems" in bad["body"]["error"]["message"]
    for cid, schema in (("p0", POINT), ("p1", POINT), ("c0", CITY), ("c1", CITY)):
        choice = records[cid]["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    for cid in ("k0", "k1"):
        assert records[cid]["response"]["body"]["choices"][0]["text"] in CHOICES
    for cid, schema in (("r0", CITY), ("r1", POINT)):
        body = records[cid]["response"]["body"]
        assert body["object"] == "response" and body["status"] == "completed", body
        text = body["output"][0]["content"][0]["text"]
        jsonschema.validate(json.loads(text), schema)


def test_a_stopped_job_resumes_to_the_same_output(llm, job, tmp_path):
    spec, _ = job
    resumed = JobSpec(spec.input_path, str(tmp_path / "out"), KWARGS, seed=SEED,
                      commit_every=3, progress=False)
    commits = []

    class Crash(Exception):
        pass

    def stop_after_one(entry):
        commits.append(entry)
        if len(commits) == 1:
            raise Crash

    with pytest.raises(Crash):
        run_local(llm, resumed, on_commit=stop_after_one)
    run_local(llm, resumed)
    assert_same_output(f"{resumed.output_dir}/output.jsonl", f"{spec.output_dir}/output.jsonl")
