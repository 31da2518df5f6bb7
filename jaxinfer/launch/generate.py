"""Generates text for prompts from the command line and reports per-request latency.

    python -m jaxinfer.launch.generate --prompt "The capital of France is" [--prompt ...]
    python -m jaxinfer.launch.generate --config smollm2-chat --chat --prompt "Tell me a joke."
    python -m jaxinfer.launch.generate --prompts_file prompts.txt --max_tokens 32 --temperature 0.7
    python -m jaxinfer.launch.generate --tensor 2 --data 2 --prompt ...        # on a mesh
    # one of N processes (each host runs this with its own --process_id):
    python -m jaxinfer.launch.generate --coordinator_address host0:1234 --num_processes N \
        --process_id i --data 2 --sequence 4 --prompt ...

--config takes a preset name (configs/NAME.json at the repository root) or a path to a JSON file
shaped {"model": {LLM kwargs}, "sampling": {SamplingParams kwargs}, "chat": bool}; flags passed
on the command line override the preset. Sampling flag defaults are SamplingParams' defaults
(greedy decoding).

Prints each answer, then a table of per-request metrics (TTFT, mean inter-token latency, decode
tokens/s, finish reason) and an aggregate line. The first request of a run pays for XLA
compilation in its TTFT unless --warmup compiles every shape beforehand.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import sys
import time
from typing import Optional

from absl import app, flags, logging

from jaxinfer.engine.request import SamplingParams
from jaxinfer.launch import distributed
from jaxinfer.llm import LLM

# Defaults come from the library so the command line and the Python API agree.
_SP_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
_LLM_DEFAULTS = {name: p.default for name, p in inspect.signature(LLM.__init__).parameters.items()
                 if name != "self" and p.default is not inspect.Parameter.empty}

CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "configs")
PRESET_SECTIONS = ("model", "sampling", "chat")

# Prompts and mode.
_PROMPT = flags.DEFINE_multi_string("prompt", None, "A prompt (repeat the flag for several).")
_PROMPTS_FILE = flags.DEFINE_string("prompts_file", None,
                                    "Text file with one prompt per line (blank lines skipped).")
_CHAT = flags.DEFINE_bool("chat", False, "Send each prompt as one user message through the "
                          "model's chat template (LLM.chat).")
_CONFIG = flags.DEFINE_string("config", None, "Preset name in configs/ (e.g. smollm2-cpu) or "
                              "path to a preset JSON file; explicit flags override it.")
_WARMUP = flags.DEFINE_bool("warmup", False, "Compile every shape before generating, so that "
                            "TTFT excludes compilation.")
# Model / engine (LLM kwargs).
_MODEL_FLAGS = ("model", "dtype", "max_seq_len", "max_num_seqs")
flags.DEFINE_string("model", _LLM_DEFAULTS["model"], "Model alias, .gguf path, HF model "
                    "directory or jaxinfer checkpoint.")
flags.DEFINE_string("dtype", _LLM_DEFAULTS["dtype"], "float32 | bfloat16 | float16 (default: "
                    "float32 on CPU, bfloat16 on accelerators).")
flags.DEFINE_integer("max_seq_len", _LLM_DEFAULTS["max_seq_len"], "Longest sequence (prompt + "
                     "generated tokens); default: min(model context, 2048).")
flags.DEFINE_integer("max_num_seqs", _LLM_DEFAULTS["max_num_seqs"],
                     "Most sequences decoded together.")
# Sampling (SamplingParams kwargs).
_SAMPLING_FLAGS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                   "seed", "stop", "ignore_eos")
flags.DEFINE_integer("max_tokens", _SP_DEFAULTS["max_tokens"], "Most tokens to generate.")
flags.DEFINE_float("temperature", _SP_DEFAULTS["temperature"], "Sampling temperature; 0 = greedy.")
flags.DEFINE_integer("top_k", _SP_DEFAULTS["top_k"], "Keep the k most likely tokens; 0 = off.")
flags.DEFINE_float("top_p", _SP_DEFAULTS["top_p"], "Nucleus sampling mass in (0, 1].")
flags.DEFINE_float("min_p", _SP_DEFAULTS["min_p"], "Drop tokens below min_p * max prob.")
flags.DEFINE_float("repetition_penalty", _SP_DEFAULTS["repetition_penalty"],
                   "Penalty for tokens already seen; 1 = off.")
flags.DEFINE_integer("seed", _SP_DEFAULTS["seed"], "Seed for reproducible sampling.")
flags.DEFINE_multi_string("stop", _SP_DEFAULTS["stop"],
                          "A string that ends generation (repeat the flag for several).")
flags.DEFINE_bool("ignore_eos", _SP_DEFAULTS["ignore_eos"], "Keep generating past EOS.")

FLAGS = flags.FLAGS


def resolve_preset_path(name_or_path: str) -> str:
    """A bare name -> configs/NAME.json at the repository root; otherwise a path to a file."""
    if os.path.isfile(name_or_path):
        return name_or_path
    bare = os.sep not in name_or_path and not name_or_path.endswith(".json")
    if bare:
        path = os.path.join(CONFIGS_DIR, name_or_path + ".json")
        if os.path.isfile(path):
            return path
        available = sorted(f[:-5] for f in os.listdir(CONFIGS_DIR)
                           if f.endswith(".json")) if os.path.isdir(CONFIGS_DIR) else []
        raise ValueError(f"unknown preset {name_or_path!r}; available: "
                         f"{', '.join(available) or 'none'} (or pass a path to a JSON file)")
    raise ValueError(f"preset file {name_or_path!r} does not exist")


def load_preset(name_or_path: str) -> dict:
    """Reads and checks a preset: {"model": {...}, "sampling": {...}, "chat": bool}, each
    section optional."""
    path = resolve_preset_path(name_or_path)
    try:
        with open(path, encoding="utf-8") as f:
            preset = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"preset {path} is not valid JSON: {e}") from None
    if not isinstance(preset, dict):
        raise ValueError(f"preset {path} must hold a JSON object")
    unknown = sorted(set(preset) - set(PRESET_SECTIONS))
    if unknown:
        raise ValueError(f"preset {path}: unknown sections {unknown}; expected {PRESET_SECTIONS}")
    for section, allowed in (("model", _LLM_DEFAULTS), ("sampling", _SP_DEFAULTS)):
        value = preset.get(section, {})
        if not isinstance(value, dict):
            raise ValueError(f"preset {path}: {section!r} must be an object")
        bad = sorted(set(value) - set(allowed))
        if bad:
            raise ValueError(f"preset {path}: unknown {section} keys {bad}")
    if not isinstance(preset.get("chat", False), bool):
        raise ValueError(f"preset {path}: 'chat' must be true or false")
    return preset


def build_settings(preset: dict) -> tuple[dict, dict, bool]:
    """(LLM kwargs, SamplingParams kwargs, chat): the preset, overridden by flags passed explicitly.
    A flag that is neither passed nor in the preset contributes its default (the library's)."""
    llm_kwargs = dict(preset.get("model", {}))
    sampling_kwargs = dict(preset.get("sampling", {}))
    for names, kwargs in ((_MODEL_FLAGS, llm_kwargs), (_SAMPLING_FLAGS, sampling_kwargs)):
        for name in names:
            if FLAGS[name].present or name not in kwargs:
                kwargs[name] = FLAGS[name].value
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
        lines += [f"=== [{i}] {prompt}", out.text, ""]
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


def run() -> str:
    """Everything main does, minus error handling; returns the report."""
    prompts = read_prompts(_PROMPT.value, _PROMPTS_FILE.value)
    preset = load_preset(_CONFIG.value) if _CONFIG.value else {}
    llm_kwargs, sampling_kwargs, chat = build_settings(preset)
    params = SamplingParams(**sampling_kwargs)  # checked before the model loads
    model = llm_kwargs.pop("model")

    distributed.initialize()
    mesh = distributed.mesh_config()
    if mesh is not None:
        llm_kwargs["mesh"] = mesh
    t0 = time.perf_counter()
    llm = LLM(model, **llm_kwargs)
    print(f"loaded {model} ({llm.dtype}, max_seq_len {llm.max_seq_len}) in "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if _WARMUP.value:
        print(f"compiled in {llm.warmup():.1f} s", file=sys.stderr)

    t0 = time.perf_counter()
    if chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    return report(prompts, outputs, time.perf_counter() - t0)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    try:
        text = run()
    except (ValueError, NotImplementedError) as e:  # bad input: a message, not a traceback
        raise SystemExit(f"error: {e}") from None
    print(text)


if __name__ == "__main__":
    app.run(main)
