"""Generates text for prompts from the command line and reports per-request latency.

    python -m jaxinfer.launch.generate --prompt "The capital of France is" [--prompt ...]
    python -m jaxinfer.launch.generate --config smollm2-chat --chat --prompt "Tell me a joke."
    python -m jaxinfer.launch.generate --prompts_file prompts.txt --max_tokens 32 --temperature 0.7
    python -m jaxinfer.launch.generate --tensor 2 --data 2 --prompt ...        # on a mesh
    # one of N processes (each host runs this with its own --process_id):
    python -m jaxinfer.launch.generate --coordinator_address host0:1234 --num_processes N \
        --process_id i --data 2 --sequence 4 --prompt ...
    python -m jaxinfer.launch.generate --config configs/smollm2-135m-ngram-cpu.json --prompt ...

--config and the shared flags are launch.common's. Prints each answer, then per-request metrics
(TTFT, inter-token latency, decode tokens/s, finish reason); without --warmup the first request's
TTFT includes compilation. Sampling defaults are SamplingParams' (greedy).
"""

from __future__ import annotations

import time
from typing import Optional

from absl import app, flags

from jaxinfer.engine.request import SamplingParams
from jaxinfer.launch import common

_PROMPT = flags.DEFINE_multi_string("prompt", None, "A prompt (repeat the flag for several).")
_PROMPTS_FILE = flags.DEFINE_string("prompts_file", None,
                                    "Text file with one prompt per line (blank lines skipped).")
_CHAT = flags.DEFINE_bool("chat", False, "Send each prompt as one user message through the "
                          "model's chat template (LLM.chat).")
_WARMUP = flags.DEFINE_bool("warmup", False, "Compile every shape before generating, so that "
                            "TTFT excludes compilation.")
_BEAM_WIDTH = flags.DEFINE_integer("beam_width", 0, "Beam search of this width instead of "
                                   "sampling (LLM.beam_search; --max_tokens, --ignore_eos, "
                                   "--stop apply); 0 = off.")
_LENGTH_PENALTY = flags.DEFINE_float("length_penalty", 1.0, "--beam_width: a beam's score is "
                                     "its log-probability / generated tokens ** this.")

FLAGS = flags.FLAGS


def build_settings(preset: dict) -> tuple[dict, dict, bool]:
    """(LLM kwargs, SamplingParams kwargs, chat): the preset, overridden by flags passed
    explicitly (common.build_settings), and --chat."""
    llm_kwargs, sampling_kwargs = common.build_settings(preset)
    chat = _CHAT.value if _CHAT.present or "chat" not in preset else preset["chat"]
    return llm_kwargs, sampling_kwargs, chat


def read_prompts(prompts: Optional[list[str]], prompts_file: Optional[str]) -> list[str]:
    out = list(prompts or [])
    if prompts_file:
        try:
            with open(prompts_file, encoding="utf-8") as f:
                out += [line.rstrip("\r\n") for line in f if line.strip()]
        except OSError as e:
            raise ValueError(f"cannot read --prompts_file: {e.strerror}: {prompts_file}") from None
    if not out:
        raise ValueError("no prompt given: pass --prompt TEXT (repeatable) or --prompts_file FILE")
    return out


def _ms(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _num(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1f}"


def report(prompts: list[str], outputs, wall_s: float) -> str:
    """The answers, a per-request metrics table and an aggregate line."""
    lines = []
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        for seq in out.outputs:  # SamplingParams(n > 1): every sequence, in index order
            name = f"{i}.{seq.index}" if len(out.outputs) > 1 else f"{i}"
            lines += [f"=== [{name}] {prompt}", seq.text]
            if seq.sampling_logprobs is not None:  # --token_logprobs
                lines.append(f"--- logprob: sampled {float(seq.sampling_logprobs.sum()):.4f}, "
                             f"model {float(seq.model_logprobs.sum()):.4f} over "
                             f"{len(seq.sampling_logprobs)} tokens")
            lines.append("")
    lines.append(f"{'req':>3}  {'prompt_tok':>10}  {'gen_tok':>7}  {'ttft_ms':>8}  {'itl_ms':>7}  "
                 f"{'tok/s':>7}  finish")
    for i, out in enumerate(outputs):
        m = out.metrics
        lines.append(f"{i:>3}  {m.prompt_tokens:>10}  {m.generated_tokens:>7}  {_ms(m.ttft_s):>8}  "
                     f"{_ms(m.itl_s):>7}  {_num(m.decode_tokens_per_s):>7}  {out.finish_reason}")
    total = sum(o.metrics.generated_tokens for o in outputs)
    ttfts = [o.metrics.ttft_s for o in outputs if o.metrics.ttft_s is not None]
    itls = [o.metrics.itl_s for o in outputs if o.metrics.itl_s is not None]
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    lines.append(f"aggregate: {len(outputs)} request{'s' * (len(outputs) != 1)}, {total} tokens in "
                 f"{wall_s:.2f} s "
                 f"({total / wall_s if wall_s > 0 else 0.0:.1f} tok/s), "
                 f"mean TTFT {_ms(mean(ttfts))} ms, mean ITL {_ms(mean(itls))} ms")
    return "\n".join(lines)


def beam_report(prompts: list[str], results, wall_s: float) -> str:
    """Each prompt's beams, best first, with their scores and cumulative log-probabilities."""
    lines = []
    for i, (prompt, res) in enumerate(zip(prompts, results)):
        for j, seq in enumerate(res.sequences):
            lines += [f"=== [{i}] beam {j}: score {seq.score:.4f}, logprob "
                      f"{seq.cumulative_logprob:.4f}, {len(seq.token_ids)} tokens, "
                      f"{seq.finish_reason}  {prompt}", seq.text, ""]
    lines.append(f"beam search: {len(prompts)} prompt{'s' * (len(prompts) != 1)} in "
                 f"{wall_s:.2f} s")
    return "\n".join(lines)


def run() -> str:
    """Everything main does, minus error handling; returns the report."""
    prompts = read_prompts(_PROMPT.value, _PROMPTS_FILE.value)
    preset = common.preset_from_flag()
    llm_kwargs, sampling_kwargs, chat = build_settings(preset)
    mesh = common.build_mesh(preset)
    params = SamplingParams(**sampling_kwargs)  # checked before the model loads
    beam = None
    if _BEAM_WIDTH.value:
        from jaxinfer.engine.beam_search import BeamSearchParams

        beam = BeamSearchParams(beam_width=_BEAM_WIDTH.value, max_tokens=params.max_tokens,
                                length_penalty=_LENGTH_PENALTY.value,
                                ignore_eos=params.ignore_eos, stop=params.stop)
    llm = common.make_llm(llm_kwargs, mesh, warmup=_WARMUP.value)

    t0 = time.perf_counter()
    if beam is not None:
        texts = prompts
        if chat:
            texts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                       add_generation_prompt=True)
                     for p in prompts]
        results = llm.beam_search(texts, beam)
        return beam_report(prompts, results, time.perf_counter() - t0)
    if chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    return report(prompts, outputs, time.perf_counter() - t0)


def main(argv):
    print(common.run_main(argv, run))


if __name__ == "__main__":
    app.run(main)
