"""Flags and set-up shared by the launchers that serve a model (generate, batch, serve): the
model, engine, speculative and sampling flags and --config, turned into LLM and SamplingParams
keyword arguments. Mesh and multi-process flags live in launch/distributed.py.

--config takes a preset name (jaxinfer/configs/NAME.json) or a path to a JSON file (such as the
deployment presets in the repository's configs/ folder) with the optional sections
{"description", "model", "sampling", "chat", "mesh"}; flags passed explicitly override it one
setting at a time. Defaults come from the library, so the command line and Python API agree.
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

from jaxinfer import backends, configs
from jaxinfer.config import MeshConfig, SpeculativeConfig
from jaxinfer.engine.request import SamplingParams
from jaxinfer.launch import distributed

SP_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
_SPEC_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SpeculativeConfig)}


def _llm_defaults() -> dict:
    from jaxinfer.llm import LLM
    return {name: p.default for name, p in inspect.signature(LLM.__init__).parameters.items()
            if name != "self" and p.default is not inspect.Parameter.empty}


LLM_DEFAULTS = _llm_defaults()

PRESET_SECTIONS = ("description", "model", "sampling", "chat", "mesh")

CONFIG = flags.DEFINE_string("config", None, "Preset name in jaxinfer/configs/ (e.g. "
                             "smollm2-cpu) or path to a preset JSON file (e.g. "
                             "configs/smollm2-135m-cpu.json); explicit flags override it.")
# Model / engine (LLM kwargs).
MODEL_FLAGS = ("model", "dtype", "max_seq_len", "max_num_seqs", "quantization",
               "kv_cache_dtype", "attention", "page_size", "num_pages", "prefill_chunk",
               "decode_steps", "max_num_batched_tokens", "max_loras", "max_lora_rank")
flags.DEFINE_string("model", LLM_DEFAULTS["model"], "Model alias, .gguf path, HF model "
                    "directory or jaxinfer checkpoint.")
flags.DEFINE_string("dtype", LLM_DEFAULTS["dtype"], "float32 | bfloat16 | float16 (default: "
                    "bfloat16 weights with float32 activations on CPU, bfloat16 on accelerators; "
                    "$JAXINFER_DEFAULT_DTYPE overrides).")
flags.DEFINE_integer("max_seq_len", LLM_DEFAULTS["max_seq_len"], "Longest sequence (prompt + "
                     "generated tokens); default: min(model context, 2048).")
flags.DEFINE_integer("max_num_seqs", LLM_DEFAULTS["max_num_seqs"],
                     "Most sequences decoded together.")
flags.DEFINE_string("quantization", LLM_DEFAULTS["quantization"],
                    "Weight quantization: int8 | int4 | int4-awq | fp8 (default: none).")
flags.DEFINE_string("kv_cache_dtype", LLM_DEFAULTS["kv_cache_dtype"],
                    "KV cache storage: int8 | fp8 (default: the model's dtype).")
flags.DEFINE_string("attention", LLM_DEFAULTS["attention"], "auto | reference | pallas.")
flags.DEFINE_integer("page_size", LLM_DEFAULTS["page_size"], "Tokens per KV page.")
flags.DEFINE_integer("num_pages", LLM_DEFAULTS["num_pages"], "KV pages in the pool "
                     "(default: from device memory, or room for every slot at max_seq_len).")
flags.DEFINE_integer("prefill_chunk", LLM_DEFAULTS["prefill_chunk"],
                     "Longest chunk of one prompt per step.")
flags.DEFINE_integer("decode_steps", LLM_DEFAULTS["decode_steps"],
                     "Decode steps per dispatch when nothing waits to be scheduled.")
flags.DEFINE_integer("max_num_batched_tokens", LLM_DEFAULTS["max_num_batched_tokens"],
                     "Tokens one step may carry.")
flags.DEFINE_integer("max_loras", LLM_DEFAULTS["max_loras"], "LoRA adapter slots on the "
                     "device (0: LoRA off); more adapters may be loaded and take turns.")
flags.DEFINE_integer("max_lora_rank", LLM_DEFAULTS["max_lora_rank"],
                     "The highest LoRA rank an adapter may have.")
LORA_MODULES = flags.DEFINE_list("lora_modules", [], "LoRA adapters to load, name=path "
                                 "(a PEFT directory), comma-separated; needs --max_loras.")


def lora_modules() -> dict:
    """--lora_modules as {name: path}; ValueError for an entry without '='."""
    out = {}
    for item in LORA_MODULES.value:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora_modules: {item!r} is not name=path")
        if name in out:
            raise ValueError(f"--lora_modules: {name!r} is given twice")
        out[name] = path
    return out
# Speculative decoding (SpeculativeConfig).
SPECULATIVE = flags.DEFINE_enum("speculative", None, ["ngram", "draft"],
                                "Speculative decoding: ngram (prompt lookup) or draft (a draft "
                                "model, --draft_model).")
NUM_DRAFT_TOKENS = flags.DEFINE_integer("num_draft_tokens", _SPEC_DEFAULTS["num_draft_tokens"],
                                        "Tokens drafted per speculative step.")
DRAFT_MODEL = flags.DEFINE_string("draft_model", None, "Draft model for --speculative=draft.")
NGRAM_MAX = flags.DEFINE_integer("ngram_max", _SPEC_DEFAULTS["ngram_max"],
                                 "Longest suffix n-gram matched for --speculative=ngram.")
# Sampling (SamplingParams kwargs).
SAMPLING_FLAGS = ("n", "max_tokens", "temperature", "top_k", "top_p", "min_p",
                  "repetition_penalty", "seed", "stop", "ignore_eos", "token_logprobs")
flags.DEFINE_integer("n", SP_DEFAULTS["n"], "Sequences per prompt (sequence i: seed + i).")
flags.DEFINE_integer("max_tokens", SP_DEFAULTS["max_tokens"], "Most tokens to generate.")
flags.DEFINE_float("temperature", SP_DEFAULTS["temperature"], "Sampling temperature; 0 = greedy.")
flags.DEFINE_integer("top_k", SP_DEFAULTS["top_k"], "Keep the k most likely tokens; 0 = off.")
flags.DEFINE_float("top_p", SP_DEFAULTS["top_p"], "Nucleus sampling mass in (0, 1].")
flags.DEFINE_float("min_p", SP_DEFAULTS["min_p"], "Drop tokens below min_p * max prob.")
flags.DEFINE_float("repetition_penalty", SP_DEFAULTS["repetition_penalty"],
                   "Penalty for tokens already seen; 1 = off.")
flags.DEFINE_integer("seed", SP_DEFAULTS["seed"], "Seed for reproducible sampling.")
flags.DEFINE_multi_string("stop", SP_DEFAULTS["stop"],
                          "A string that ends generation (repeat the flag for several).")
flags.DEFINE_bool("ignore_eos", SP_DEFAULTS["ignore_eos"], "Keep generating past EOS.")
flags.DEFINE_bool("token_logprobs", SP_DEFAULTS["token_logprobs"],
                  "Print each answer's summed token log-probabilities.")

FLAGS = flags.FLAGS


def resolve_preset_path(name_or_path: str) -> str:
    """A bare name -> the package's preset (jaxinfer.configs.path); otherwise a path to a file."""
    if os.path.isfile(name_or_path):
        return name_or_path
    if os.sep not in name_or_path and not name_or_path.endswith(".json"):
        if name_or_path in configs.names():
            return configs.path(name_or_path)
        raise ValueError(f"unknown preset {name_or_path!r}; available: "
                         f"{', '.join(configs.names())} (or pass a path to a JSON file)")
    raise ValueError(f"preset file {name_or_path!r} does not exist")


def load_preset(name_or_path: str) -> dict:
    """Reads and checks a preset: {"description": str, "model": {...}, "sampling": {...},
    "chat": bool, "mesh": {...}}, each section optional."""
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
    for section, allowed in (("model", LLM_DEFAULTS), ("sampling", SP_DEFAULTS)):
        value = preset.get(section, {})
        if not isinstance(value, dict):
            raise ValueError(f"preset {path}: {section!r} must be an object")
        bad = sorted(set(value) - set(allowed))
        if bad:
            raise ValueError(f"preset {path}: unknown {section} keys {bad}")
    if "mesh" in preset.get("model", {}):
        raise ValueError(f"preset {path}: the mesh goes in its own 'mesh' section, not in "
                         "'model'")
    spec = preset.get("model", {}).get("speculative")
    if spec is not None and (not isinstance(spec, dict) or set(spec) - set(_SPEC_DEFAULTS)):
        raise ValueError(f"preset {path}: model.speculative must be an object with keys among "
                         f"{', '.join(_SPEC_DEFAULTS)}, got {spec!r}")
    if not isinstance(preset.get("chat", False), bool):
        raise ValueError(f"preset {path}: 'chat' must be true or false")
    if not isinstance(preset.get("description", ""), str):
        raise ValueError(f"preset {path}: 'description' must be a string")
    _check_mesh(preset.get("mesh", {}), path)
    return preset


def _check_mesh(mesh, path: str) -> None:
    if not isinstance(mesh, dict):
        raise ValueError(f"preset {path}: 'mesh' must be an object like "
                         '{"data": 1, "tensor": 8, "sequence": 1}')
    unknown = sorted(set(mesh) - set(distributed.MESH_AXES))
    if unknown:
        raise ValueError(f"preset {path}: unknown mesh keys {unknown}; expected "
                         f"{', '.join(distributed.MESH_AXES)}")
    for axis, degree in mesh.items():
        if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
            raise ValueError(f"preset {path}: mesh.{axis} must be a positive integer, got "
                             f"{degree!r}")


def preset_from_flag() -> dict:
    return load_preset(CONFIG.value) if CONFIG.value else {}


def build_settings(preset: dict) -> tuple[dict, dict]:
    """(LLM kwargs, SamplingParams kwargs): the preset, overridden by flags passed explicitly,
    else the library's defaults. "speculative" is a SpeculativeConfig or None; the mesh is
    build_mesh's, kept apart because a batch job records it beside the LLM kwargs."""
    llm_kwargs = dict(preset.get("model", {}))
    sampling_kwargs = dict(preset.get("sampling", {}))
    for names, kwargs in ((MODEL_FLAGS, llm_kwargs), (SAMPLING_FLAGS, sampling_kwargs)):
        for name in names:
            if FLAGS[name].present or name not in kwargs:
                kwargs[name] = FLAGS[name].value
    spec = llm_kwargs.get("speculative")
    if SPECULATIVE.value is not None:
        spec = SpeculativeConfig(method=SPECULATIVE.value,
                                 num_draft_tokens=NUM_DRAFT_TOKENS.value,
                                 draft_model=DRAFT_MODEL.value, ngram_max=NGRAM_MAX.value)
    elif isinstance(spec, dict):
        spec = SpeculativeConfig(**spec)
    llm_kwargs["speculative"] = spec
    return llm_kwargs, sampling_kwargs


def build_mesh(preset: dict) -> Optional[MeshConfig]:
    """The preset's "mesh" section overridden by the mesh flags; None for one device."""
    return distributed.mesh_config(preset.get("mesh"))


def make_llm(llm_kwargs: dict, mesh: Optional[MeshConfig] = None, warmup: bool = False):
    """Starts jax.distributed (a no-op for one process), builds the LLM on `mesh` (None: one
    device) and warms it up when asked; load and compile times go to stderr."""
    from jaxinfer.llm import LLM

    kwargs = dict(llm_kwargs)
    model = kwargs.pop("model")
    distributed.initialize()
    if mesh is not None:
        kwargs["mesh"] = mesh
    t0 = time.perf_counter()
    llm = LLM(model, **kwargs)
    print(f"loaded {model} ({llm.dtype}, max_seq_len {llm.max_seq_len}) in "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if warmup:
        print(f"compiled in {llm.warmup():.1f} s", file=sys.stderr)
    return llm


def run_main(argv, run, errors=(ValueError, NotImplementedError)):
    """The launchers' main: XLA flags set before any jax backend starts (XLA reads them once),
    no positional arguments, absl logging at WARNING unless --verbosity is given, and
    `errors` as a one-line message instead of a traceback. Returns run()'s result."""
    backends.set_xla_flags()
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    try:
        return run()
    except errors as e:
        raise SystemExit(f"error: {e}") from None
