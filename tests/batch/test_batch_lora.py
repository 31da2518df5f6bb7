"""Batch jobs with LoRA adapters: a line's `model` naming an adapter runs under it (its text
equals LLM.generate's with that adapter), other lines run the base model, and the adapter's
content is part of the job's fingerprint (a changed adapter file refuses the resume)."""

import os
import sys

import numpy as np
import pytest
from batch_util import line, load_output, write_lines

import jaxinfer as ji
from jaxinfer.batch import JobSpec, run_local

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "lora"))
from lora_util import peft_tensors, write_peft  # noqa: E402

KWARGS = {"model": "smollm2-135m", "max_seq_len": 128, "max_num_seqs": 4, "max_loras": 1,
          "max_lora_rank": 4}
PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_batch")
    llm = ji.LLM(**KWARGS)
    shapes = {f"model.layers.{i}.self_attn.q_proj.weight": np.zeros(lp.wq.shape[::-1])
              for i, lp in enumerate(llm.params.layers)}
    adapter = write_peft(str(tmp / "ad"), peft_tensors(shapes, {"q_proj"}, r=4, seed=3,
                                                       std=0.05), 4, 8.0, ("q_proj",))
    lines = [line(f"r{i}", {"prompt": p, "max_tokens": 8, "temperature": 0,
                            **({"model": "ad"} if i % 2 == 0 else {})})
             for i, p in enumerate(PROMPTS * 2)]
    return llm, adapter, write_lines(tmp / "in.jsonl", lines), tmp


def test_lines_naming_an_adapter_run_under_it(setup):
    llm, adapter, path, tmp = setup
    spec = JobSpec(path, str(tmp / "out"), KWARGS, lora_modules={"ad": adapter},
                   progress=False)
    run_local(llm, spec)
    records = {r["custom_id"]: r for r in load_output(f"{spec.output_dir}/output.jsonl")}
    for i, p in enumerate(PROMPTS * 2):
        text = records[f"r{i}"]["response"]["body"]["choices"][0]["text"]
        want = llm.generate(p, ji.SamplingParams(max_tokens=8),
                            lora="ad" if i % 2 == 0 else None)[0].text
        assert text == want
    assert records["r0"]["response"]["body"]["choices"][0]["text"] != \
        records["r3"]["response"]["body"]["choices"][0]["text"]


def test_a_changed_adapter_refuses_the_resume(setup):
    llm, adapter, path, tmp = setup
    spec = JobSpec(path, str(tmp / "out2"), KWARGS, lora_modules={"ad": adapter},
                   progress=False, max_lines=2)
    run_local(llm, spec)
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        text = f.read()
    with open(os.path.join(adapter, "adapter_config.json"), "w") as f:
        f.write(text.replace('"lora_alpha": 8.0', '"lora_alpha": 16.0'))
    llm.unload_lora("ad")
    again = JobSpec(path, str(tmp / "out2"), KWARGS, lora_modules={"ad": adapter},
                    progress=False)
    with pytest.raises(ValueError, match="lora_modules"):
        run_local(llm, again)
