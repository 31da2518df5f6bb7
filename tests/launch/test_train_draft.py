"""`python -m jaxinfer.launch.train_draft` end to end on the real SmolLM2-135M, kept small:
4 training prompts answered in 16 tokens, 3 optimizer steps, 2 held-out prompts evaluated.

The reported acceptance is checked against an independent bound: under greedy decoding a draft
token is accepted only where it equals the target's next token, so the accepted drafts cannot
outnumber the positions of the target's greedy answers where the draft's own argmax,
teacher-forced on the target's tokens, equals the target's token (plus, per request, the drafts
of a last step that may run past max_tokens before the output is cut)."""

import json
import os
import subprocess
import sys

import pytest

from jaxinfer import configs
from jaxinfer.loading.checkpoint import is_checkpoint_dir, read_checkpoint_config

PROMPTS = configs.path("draft_prompts.txt")


NUM_DRAFT = 4  # the launcher's --num_draft default


def _teacher_forced_agreement(prompts_file: str, draft_dir: str, eval_tokens: int) -> dict:
    """Per draft (the written one, and the untrained one the launcher compares with), the
    positions of the target's greedy answers to the 2 held-out prompts where the draft's
    argmax on the target's own prefix is the target's token (EOS included where it ended)."""
    import jaxinfer as ji
    from jaxinfer import evaluation
    from jaxinfer.draft_train import draft_from_target
    from jaxinfer.loading import load_model

    with open(prompts_file) as f:
        held_out = [line.strip() for line in f if line.strip()][-2:]
    target = load_model("smollm2-135m")
    llm = ji.LLM("smollm2-135m", max_seq_len=512, max_num_seqs=2)
    texts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                               add_generation_prompt=True) for p in held_out]
    outs = llm.generate(texts, ji.SamplingParams(max_tokens=eval_tokens))
    trained = load_model(draft_dir)
    untrained = draft_from_target(target.params, target.config, trained.config.num_layers)
    agree = {}
    for which, (params, cfg) in {"trained": (trained.params, trained.config),
                                 "untrained": untrained}.items():
        agree[which] = 0
        for o in outs:
            answer = o.token_ids + ([llm.tokenizer.eos_token_id]
                                    if o.finish_reason == "stop" else [])
            seq = o.prompt_token_ids + answer
            top = evaluation.score(params, cfg, seq, window=len(seq)).argmax  # top[i]: token i+1
            P = len(o.prompt_token_ids)
            agree[which] += sum(int(top[P + j - 1] == answer[j]) for j in range(1, len(answer)))
    return agree


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
    agree = _teacher_forced_agreement(str(tmp_path / "prompts.txt"), str(out), eval_tokens=8)
    for which in ("untrained", "trained"):
        drafted = summary[which]["draft_tokens"]
        accepted = round(summary[which]["acceptance_rate"] * drafted)
        assert drafted > 0
        assert accepted <= agree[which] + 2 * NUM_DRAFT, (which, accepted, agree)
    assert is_checkpoint_dir(str(out)) and read_checkpoint_config(str(out)).num_layers == 2
    assert os.path.isdir(out / "tokenizer")
