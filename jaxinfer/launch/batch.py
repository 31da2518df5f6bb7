"""Batch generation: an OpenAI batch file (or one prompt a line) in, OpenAI batch output out;
sharded, resumable, exactly-once. The contract is docs/batch.md.

    python -m jaxinfer.launch.batch --input requests.jsonl --output DIR
    python -m jaxinfer.launch.batch --input prompts.txt --output DIR --max_tokens 128 \
        --temperature 0.7 --seed 1                  # plain text: sampling from the flags
    python -m jaxinfer.launch.batch --input requests.jsonl --output DIR \
        --num_shards 4 --shard_index I              # one of 4 workers, then:
    python -m jaxinfer.launch.batch --merge DIR
    python -m jaxinfer.launch.batch --input requests.jsonl --output DIR \
        --runner ray --num_workers 8                # Ray Data, one LLM per actor

Rerunning the same command after a kill goes on from the last commit. Model, engine, sampling
and --config flags come from launch.common, mesh flags from launch.distributed.
"""

from __future__ import annotations

import contextlib
import os
import sys

from absl import app, flags

from jaxinfer.launch import common, distributed

_INPUT = flags.DEFINE_string("input", None, "Input file: OpenAI batch JSONL, or plain text "
                             "with one prompt a line.")
_OUTPUT = flags.DEFINE_string("output", None, "Output directory (created; reused on resume).")
_MERGE = flags.DEFINE_string("merge", None, "Check the shards in this directory and join them "
                             "into DIR/output.jsonl and DIR/summary.json; loads no model.")
_FORMAT = flags.DEFINE_enum("input_format", "auto", ["auto", "jsonl", "text"],
                            "auto: .jsonl/.json are JSONL, .txt is text, else by the first line.")
_CHAT = flags.DEFINE_bool("chat", False, "Plain text: send each line as one user message "
                          "through the chat template (default: a completion of the line).")
_NUM_SHARDS = flags.DEFINE_integer("num_shards", 1, "Split the input into this many shards.")
_SHARD_INDEX = flags.DEFINE_integer("shard_index", 0, "The shard this run answers, 0-based.")
_MAX_LINES = flags.DEFINE_integer("max_lines", None, "Read only the first N input lines "
                                  "(a rerun with a larger N goes on from there).")
_COMMIT_EVERY = flags.DEFINE_integer("commit_every", 256, "Output lines per committed part.")
_COMMIT_INTERVAL = flags.DEFINE_float("commit_interval", 30.0, "Also commit what is ready "
                                      "after this many seconds (bounds the work a kill loses).")
_MAX_IN_FLIGHT = flags.DEFINE_integer("max_in_flight", None, "Requests in the engine at once "
                                      "(default: 2 x --max_num_seqs).")
_FAIL_ON_ERROR = flags.DEFINE_bool("fail_on_error", False, "Exit with status 1 at the end if "
                                   "any line got an error record.")
# The default is jaxinfer.batch.inputs.MAX_LINE_BYTES (not imported here: flags load first).
_MAX_LINE_BYTES = flags.DEFINE_integer("max_line_bytes", 2 << 20, "Longest input line, in "
                                       "bytes; a longer one gets a line_too_long record.")
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar on stderr.")
_WARMUP = flags.DEFINE_bool("warmup", False, "Compile every shape before the first request.")
_RUNNER = flags.DEFINE_enum("runner", "local", ["local", "ray"], "local: one LLM in this "
                            "process; ray: Ray Data, an actor pool with one LLM per actor.")
_NUM_WORKERS = flags.DEFINE_integer("num_workers", 1, "--runner=ray: actors (LLMs).")
_RAY_ADDRESS = flags.DEFINE_string("ray_address", None, "--runner=ray: the cluster to join "
                                   "(default: RAY_ADDRESS, else a local one).")
_WORKER_CPUS = flags.DEFINE_float("ray_cpus_per_worker", 1.0, "--runner=ray: CPUs per actor.")
_WORKER_GPUS = flags.DEFINE_float("ray_gpus_per_worker", 0.0, "--runner=ray: GPUs per actor.")

FLAGS = flags.FLAGS


def build_spec():
    """The JobSpec of the command line (the preset, overridden by flags passed explicitly)."""
    from jaxinfer.batch import JobSpec
    from jaxinfer.engine.request import SamplingParams

    if not _INPUT.value or not _OUTPUT.value:
        raise ValueError("pass --input FILE and --output DIR (or --merge DIR)")
    preset = common.preset_from_flag()
    llm_kwargs, sampling = common.build_settings(preset)
    chat = _CHAT.value if _CHAT.present or "chat" not in preset else preset["chat"]
    job_seed = sampling.pop("seed")  # per request: derived from it and the custom_id
    SamplingParams(**sampling)  # plain-text sampling checked before the model loads
    mesh = common.build_mesh(preset)
    return JobSpec(
        input_path=_INPUT.value, output_dir=_OUTPUT.value, llm_kwargs=llm_kwargs,
        input_format=_FORMAT.value, sampling=sampling, chat=chat, seed=job_seed,
        mesh=None if mesh is None else (mesh.data, mesh.tensor, mesh.sequence),
        num_shards=_NUM_SHARDS.value, shard_index=_SHARD_INDEX.value,
        max_lines=_MAX_LINES.value, commit_every=_COMMIT_EVERY.value,
        commit_interval_s=_COMMIT_INTERVAL.value, max_in_flight=_MAX_IN_FLIGHT.value,
        progress=_PROGRESS.value, max_line_bytes=_MAX_LINE_BYTES.value,
        lora_modules=common.lora_modules())


def run() -> dict:
    """Everything main does, minus error handling; returns the summary."""
    from jaxinfer.batch import merge, run_local
    from jaxinfer.config import MeshConfig

    if _MERGE.value:
        return merge(_MERGE.value)
    spec = build_spec()
    with open(spec.input_path, "rb"):  # a missing input fails before the model loads
        pass
    mesh = None if spec.mesh is None else MeshConfig(*spec.mesh)  # as job.json records it
    with _early_lock(spec):  # a directory another run works in is refused before the load
        if _RUNNER.value == "ray":
            from jaxinfer.batch import ray_runner

            return ray_runner.run_ray(spec, num_workers=_NUM_WORKERS.value,
                                      address=_RAY_ADDRESS.value, mesh=mesh,
                                      cpus_per_worker=_WORKER_CPUS.value,
                                      gpus_per_worker=_WORKER_GPUS.value)
        llm = common.make_llm(spec.llm_kwargs, mesh, warmup=_WARMUP.value)
        import jax

        return run_local(llm, spec, writer=jax.process_index() == 0)


def _early_lock(spec):
    """The shard's lock, taken before the model loads when this is plainly the run's only
    process (a multi-process worker learns whether it writes only inside make_llm)."""
    from jaxinfer.batch.job import shard_lock

    multi = FLAGS["coordinator_address"].value is not None or any(
        v in os.environ for v in distributed._CLUSTER_ENV)
    if multi and _RUNNER.value != "ray":
        return contextlib.nullcontext()
    return shard_lock(spec)


def main(argv):
    from jaxinfer.batch import summary_line

    summary = common.run_main(argv, run, errors=(ValueError, NotImplementedError, OSError))
    if "output" in summary:
        print(summary_line(summary))
    else:
        print(summary_line(summary) + f" (shard {summary['shard_index']} of "
              f"{summary['num_shards']}; when every shard is done: python -m "
              f"jaxinfer.launch.batch --merge {_OUTPUT.value})")
    if _FAIL_ON_ERROR.value and summary["failed"]:
        print(f"error: {summary['failed']} line(s) got an error record (--fail_on_error)",
              file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
