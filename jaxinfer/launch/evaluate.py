"""Evaluates a (quantized) model on a text file: perplexity, and greedy agreement with float32.

    python -m jaxinfer.launch.evaluate --model smollm2-135m --quantization int8 [--group_size 64]
    python -m jaxinfer.launch.evaluate --quantization int4-awq --kv_cache_dtype int8 \
        --max_tokens 4096 --window 512 --json out.json      # GPL-3's text by default
    python -m jaxinfer.launch.evaluate --model /tmp/smollm2-awq --reference_model smollm2-135m

The float32 reference (or --reference_model, for a quantized checkpoint) is scored on the same
windows; greedy agreement is the fraction of positions where both models' top token agree.
"""

from __future__ import annotations

import json
import os
import time

import jax
from absl import app, flags

from jaxinfer import backends, evaluation
from jaxinfer.quant import KV_DTYPES, MODES

# The GNU GPL v3's text, shipped with the package (verbatim copies are permitted).
DEFAULT_TEXT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            "data", "gpl-3.txt")

def define_flags() -> None:
    """Registers this script's flags when it runs as a script, not on import: launch.common
    defines --model, --quantization and --max_tokens with other meanings."""
    flags.DEFINE_string("model", "smollm2-135m", "Model alias, .gguf path or HF model "
                        "directory.")
    flags.DEFINE_enum("quantization", None, list(MODES), "Weight quantization.")
    flags.DEFINE_integer("group_size", None, "Elements per scale of int8 / int4 "
                         "(0: per output channel; default: jaxinfer.quant.GROUP_SIZE).",
                         lower_bound=0)
    flags.DEFINE_string("reference_model", None, "Float model to compare with "
                        "(default: --model).")
    flags.DEFINE_enum("kv_cache_dtype", None, list(KV_DTYPES), "KV-cache quantization.")
    flags.DEFINE_string("text", DEFAULT_TEXT, "Text file to score (default: the GPL-3 "
                        "text shipped on every Debian system).")
    flags.DEFINE_integer("max_tokens", 4096, "Score the text's first tokens only.",
                         lower_bound=2)
    flags.DEFINE_integer("window", 512, "Tokens per scoring window.", lower_bound=2)
    flags.DEFINE_bool("reference", True, "Also score float32 weights with a float "
                      "cache, and report greedy agreement with it.")
    flags.DEFINE_string("json", None, "Write the results to this JSON file.")


def evaluate(model: str, quantization=None, kv_cache_dtype=None, text: str = DEFAULT_TEXT,
             max_tokens: int = 4096, window: int = 512, reference: bool = True,
             group_size=None, reference_model=None) -> dict:
    from jaxinfer.loading import load_model

    if not os.path.isfile(text):
        raise ValueError(f"text file {text!r} does not exist")
    with open(text, encoding="utf-8") as f:
        content = f.read()
    t0 = time.perf_counter()
    loaded = load_model(model, quantization=quantization, group_size=group_size)
    load_s = time.perf_counter() - t0
    ids = loaded.tokenizer.encode(content)[:max_tokens]
    if len(ids) < 2:
        raise ValueError(f"text file {text!r} has {len(ids)} tokens; scoring needs at least 2")
    scores = evaluation.score(loaded.params, loaded.config, ids, window, kv_cache_dtype)
    result = {"model": model, "quantization": quantization, "group_size": group_size,
              "kv_cache_dtype": kv_cache_dtype,
              "text": text, "tokens": len(ids), "window": window, "load_s": load_s,
              "perplexity": scores.perplexity, "param_bytes": _nbytes(loaded.params)}
    if reference:
        if quantization is None and kv_cache_dtype is None and reference_model is None:
            base = scores
            result["float32_param_bytes"] = result["param_bytes"]
        else:
            ref = load_model(reference_model or model)
            base = evaluation.score(ref.params, ref.config, ids, window)
            result["float32_param_bytes"] = _nbytes(ref.params)
        result["float32_perplexity"] = base.perplexity
        result["greedy_agreement"] = evaluation.agreement(scores, base)
    return result


def _nbytes(params) -> int:
    return sum(int(x.nbytes) for x in jax.tree.leaves(params))


def main(argv):
    del argv
    backends.set_xla_flags()  # as common.run_main, before load_model starts a backend
    F = flags.FLAGS
    r = evaluate(F.model, F.quantization, F.kv_cache_dtype, F.text, F.max_tokens, F.window,
                 F.reference, F.group_size, F.reference_model)
    group = "" if r["group_size"] is None else f" (group {r['group_size']})"
    name = (f"weights {r['quantization'] or 'as loaded'}{group}, "
            f"KV {r['kv_cache_dtype'] or 'float32'}")
    print(f"{r['tokens']} tokens of {r['text']} in windows of {r['window']}")
    print(f"{name}: perplexity {r['perplexity']:.3f}, params {r['param_bytes'] / 2**20:.1f} MiB "
          f"(loaded in {r['load_s']:.1f} s)")
    if "float32_perplexity" in r:
        ratio = r["perplexity"] / r["float32_perplexity"]
        print(f"float32: perplexity {r['float32_perplexity']:.3f}, params "
              f"{r['float32_param_bytes'] / 2**20:.1f} MiB; greedy agreement "
              f"{r['greedy_agreement']:.4f}; perplexity x{ratio:.4f}")
    if F.json:
        with open(F.json, "w") as f:
            json.dump(r, f, indent=2)


if __name__ == "__main__":
    define_flags()
    app.run(main)
