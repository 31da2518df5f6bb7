"""`python -m jaxinfer.launch.train_draft` end to end on the real SmolLM2-135M, kept small:
4 training prompts answered in 16 tokens, 3 optimizer steps, 2 held-out prompts evaluated."""

import json
import os
import subprocess
import sys

import pytest

from jaxinfer.loading.checkpoint import is_checkpoint_dir, read_checkpoint_config

PROMPTS = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "draft_prompts.txt")


@pytest.mark.slow
def test_train_draft_writes_a_draft_and_reports_acceptance(tmp_path):
    with open(PROMPTS) as f:
        (tmp_path / "prompts.txt").write_text("".join(f.readlines()[:6]))
    out = tmp_path / "draft"
    proc = subprocess.run(
        [sys.executable, "-m", "jaxinfer.launch.train_draft", "--out", str(out),
         "--prompts_file", str(tmp_path / "prompts.txt"), "--eval_prompts", "2", "--steps", "3",
         "--gen_tokens", "16", "--eval_tokens", "8", "--batch_size", "2", "--log_every", "1"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["train_sequences"] == 4 and summary["eval_prompts"] == 2
    assert summary["kl_last"] < summary["kl_first"]
    for which in ("untrained", "trained"):
        assert summary[which]["draft_tokens"] > 0
        assert 0 <= summary[which]["acceptance_rate"] <= 1
    assert is_checkpoint_dir(str(out)) and read_checkpoint_config(str(out)).num_layers == 2
    assert os.path.isdir(out / "tokenizer")
