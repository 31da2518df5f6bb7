"""Converts a model (alias, .gguf file, HF directory or checkpoint) to a jaxinfer orbax
checkpoint, optionally quantized.

    python -m jaxinfer.launch.convert --model smollm2-135m --output /tmp/smollm2 \
        [--dtype float32|bfloat16] [--quantization int8|int4|int4-awq|fp8] [--overwrite]

The checkpoint loads without the source model: `LLM("/tmp/smollm2")`. Quantized weights are
stored as they are, so loading them skips quantization work such as AWQ's calibration
(docs/quantization.md); loading with another mode requantizes.
"""

from __future__ import annotations

import os
import time
from typing import Optional

from absl import app, flags, logging


def define_flags() -> None:
    """Registers this script's flags when it runs as a script, not on import: launch.common
    defines --model, --dtype and --quantization with other meanings."""
    flags.DEFINE_string("model", None, "Model alias, .gguf path or HF model directory.")
    flags.DEFINE_string("output", None, "Checkpoint directory to write.")
    flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                      "Dtype the params are stored in.")
    flags.DEFINE_enum("quantization", None, ["int8", "int4", "int4-awq", "fp8"],
                      "Quantize the weights before saving them (default: as loaded).")
    flags.DEFINE_bool("overwrite", False, "Replace an existing jaxinfer checkpoint at --output.")
    flags.mark_flags_as_required(["model", "output"])


def _dir_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f))
               for root, _, files in os.walk(path) for f in files)


def convert(model: str, output: str, dtype: str = "float32", overwrite: bool = False,
            quantization: Optional[str] = None) -> dict:
    """Loads `model` (float params in `dtype`, quantized by `quantization`) and saves it as a
    checkpoint at `output`; returns a summary (output, num_params, bytes on disk, seconds,
    has_tokenizer, quantization)."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.loading import load_model
    from jaxinfer.loading.checkpoint import save_checkpoint

    start = time.perf_counter()
    loaded = load_model(model, dtype=jnp.dtype(dtype), quantization=quantization)
    save_checkpoint(output, loaded.config, loaded.params, loaded.tokenizer, overwrite=overwrite,
                    quantization=quantization)
    return {
        "output": os.path.abspath(output),
        "num_params": sum(int(x.size) for x in jax.tree.leaves(loaded.params)),
        "bytes": _dir_size(output),
        "seconds": time.perf_counter() - start,
        "has_tokenizer": loaded.tokenizer is not None,
        "quantization": quantization,
    }


def main(argv):
    from jaxinfer import backends

    backends.set_xla_flags()  # as common.run_main, before load_model starts a backend
    FLAGS = flags.FLAGS
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # app.run's INFO default floods with orbax logs
    try:
        s = convert(FLAGS.model, FLAGS.output, FLAGS.dtype, FLAGS.overwrite, FLAGS.quantization)
    except ValueError as e:  # unusable model or output directory: a message, not a traceback
        raise SystemExit(f"error: {e}") from None
    kind = f"{FLAGS.dtype}, {s['quantization']}" if s["quantization"] else FLAGS.dtype
    print(f"wrote {s['output']}: {s['num_params']:,} params ({kind}), "
          f"{s['bytes'] / 2**20:.1f} MiB, tokenizer: {'yes' if s['has_tokenizer'] else 'no'}, "
          f"in {s['seconds']:.1f} s")


if __name__ == "__main__":
    define_flags()
    app.run(main)
