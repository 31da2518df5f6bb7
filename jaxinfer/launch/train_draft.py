"""Distils a small draft model from a target model, for speculative decoding.

    python -m jaxinfer.launch.train_draft --out /tmp/smollm2-draft [--model smollm2-135m]
        [--prompts_file jaxinfer/configs/draft_prompts.txt] [--num_layers 2] [--steps 150]
    then: ji.LLM("smollm2-135m", speculative=ji.SpeculativeConfig("draft",
                 draft_model="/tmp/smollm2-draft"))

The recipe: the target answers every prompt itself (seeded), so the draft learns the text it
will be asked to predict; the draft (jaxinfer.draft_train) is trained with AdamW on
KL(p_target || q_draft) over prompt and answer, and saved as a checkpoint with the target's
tokenizer. With --eval, the acceptance of the trained and the untrained draft in greedy
speculative decoding of the last --eval_prompts prompts (held out) is reported. The JSON
summary is printed and written to <out>/train_summary.json.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

from absl import app, flags

from jaxinfer import configs
from jaxinfer.draft_train import acceptance, draft_from_target, read_prompts, train

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Target model (alias or path).")
_OUT = flags.DEFINE_string("out", None, "Directory for the draft checkpoint.", required=True)
_PROMPTS = flags.DEFINE_string("prompts_file", configs.path("draft_prompts.txt"),
                               "Text file, one prompt per line (blank lines skipped).")
_CHAT = flags.DEFINE_bool("chat", True, "Send prompts through the model's chat template.")
_NUM_LAYERS = flags.DEFINE_integer("num_layers", 2, "Decoder layers of the draft.")
_GEN_TOKENS = flags.DEFINE_integer("gen_tokens", 128, "Tokens the target generates per prompt.")
_GEN_TEMP = flags.DEFINE_float("gen_temperature", 0.7, "Temperature of the generated text.")
_SAMPLES = flags.DEFINE_integer("samples_per_prompt", 1, "Answers generated per training prompt "
                                "(each with its own seed).")
_STEPS = flags.DEFINE_integer("steps", 150, "Optimizer steps.")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Sequences per step.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 192, "Longest training sequence (longer ones are cut).")
_LR = flags.DEFINE_float("learning_rate", 1e-3, "Peak AdamW learning rate.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the generation and of the batch order.")
_EVAL_PROMPTS = flags.DEFINE_integer("eval_prompts", 8, "Prompts held out for the evaluation.")
_EVAL = flags.DEFINE_bool("eval", True, "Measure acceptance, trained against untrained.")
_NUM_DRAFT = flags.DEFINE_integer("num_draft", 4, "Draft tokens per step in the evaluation.")
_EVAL_TOKENS = flags.DEFINE_integer("eval_tokens", 96, "Tokens generated per held-out prompt.")
_LOG_EVERY = flags.DEFINE_integer("log_every", 10, "Steps between loss lines.")


def main(argv) -> None:
    del argv
    import jaxinfer as ji
    from jaxinfer.loading.checkpoint import save_checkpoint

    prompts = read_prompts(_PROMPTS.value)
    n_eval = min(_EVAL_PROMPTS.value, len(prompts) - 1) if _EVAL.value else 0
    train_prompts, eval_prompts = prompts[:len(prompts) - n_eval], prompts[len(prompts) - n_eval:]
    llm = ji.LLM(_MODEL.value, max_seq_len=512)
    tok = llm.tokenizer
    render = (lambda p: tok.apply_chat_template([{"role": "user", "content": p}],
                                                add_generation_prompt=True)) if _CHAT.value \
        else (lambda p: p)
    t0 = time.perf_counter()
    texts = [render(p) for p in train_prompts for _ in range(_SAMPLES.value)]
    outs = llm.generate(texts, [ji.SamplingParams(max_tokens=_GEN_TOKENS.value,
                                                  temperature=_GEN_TEMP.value,
                                                  seed=_SEED.value + i)
                                for i in range(len(texts))])
    seqs = [o.prompt_token_ids + o.token_ids for o in outs]
    print(f"generated {sum(len(o.token_ids) for o in outs)} tokens in {len(seqs)} answers "
          f"in {time.perf_counter() - t0:.0f} s", flush=True)
    target_params, target_cfg = llm._engine.params, llm.model_config
    del llm
    draft, draft_cfg, losses = train(
        target_params, target_cfg, seqs, num_layers=_NUM_LAYERS.value, steps=_STEPS.value,
        batch_size=_BATCH.value, seq_len=_SEQ_LEN.value, learning_rate=_LR.value,
        seed=_SEED.value, log_every=_LOG_EVERY.value, log=lambda m: print(m, flush=True))
    save_checkpoint(_OUT.value, draft_cfg, draft, tok)
    summary = {"model": _MODEL.value, "num_layers": _NUM_LAYERS.value, "steps": _STEPS.value,
               "train_sequences": len(seqs), "kl_first": losses[0], "kl_last": losses[-1],
               "out": os.path.abspath(_OUT.value)}
    if eval_prompts:
        eval_texts = [render(p) for p in eval_prompts]
        untrained, _ = draft_from_target(target_params, target_cfg, _NUM_LAYERS.value)
        with tempfile.TemporaryDirectory() as tmp:
            save_checkpoint(tmp, draft_cfg, untrained, tok)
            summary["untrained"] = acceptance(_MODEL.value, tmp, eval_texts,
                                              num_draft=_NUM_DRAFT.value,
                                              max_tokens=_EVAL_TOKENS.value)
        summary["trained"] = acceptance(_MODEL.value, _OUT.value, eval_texts,
                                        num_draft=_NUM_DRAFT.value,
                                        max_tokens=_EVAL_TOKENS.value)
        summary["eval_prompts"] = len(eval_prompts)
    with open(os.path.join(_OUT.value, "train_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    app.run(main)
