"""Serves a model over an OpenAI-compatible HTTP API (FastAPI + uvicorn).

    python -m jaxinfer.launch.serve --model smollm2-135m
    python -m jaxinfer.launch.serve --config smollm2-cpu --port 8080 --api_key secret \\
        --max_waiting 64
    python -m jaxinfer.launch.serve --tensor 2 --host 0.0.0.0   # on a mesh, reachable from others
    python -m jaxinfer.launch.serve --config configs/smollm2-135m-chat-server.json

Model, engine, mesh and --config flags are those of launch.generate; sampling is per request,
so the sampling flags are refused. SIGTERM drains, then exits 0. The contract is docs/serving.md.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

from jaxinfer.launch import common

_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to bind (0.0.0.0: every interface).")
_PORT = flags.DEFINE_integer("port", 8000, "Port to listen on.")
_API_KEY = flags.DEFINE_string("api_key", None, "When set, /v1/* requests need "
                               "`Authorization: Bearer <key>` (else 401). Default: the "
                               "JAXINFER_API_KEY environment variable, if set.")
_MAX_WAITING = flags.DEFINE_integer("max_waiting", 256, "Requests that may wait for a batch "
                                    "slot (beyond --max_num_seqs running); more get 429.")
_MAX_BODY = flags.DEFINE_integer("max_body_bytes", 1 << 20, "Largest request body; larger "
                                 "ones get 413.")
_DRAIN = flags.DEFINE_float("drain_timeout", 30.0, "Seconds running requests get to finish "
                            "after SIGTERM before they are aborted.")
_KEEP_ALIVE = flags.DEFINE_float("keep_alive_timeout", 75.0, "Seconds an idle keep-alive "
                                 "connection stays open; keep it above the clients' pool "
                                 "expiry (httpx 5 s, aiohttp 15 s, nginx upstream 60 s).")
_READ_TIMEOUT = flags.DEFINE_float("read_timeout", 30.0, "Seconds a client gets to send a "
                                   "request's headers (else the connection closes) and again "
                                   "its body (else 408).")
_MAX_CONNECTIONS = flags.DEFINE_integer("max_connections", None, "Open connections the server "
                                        "takes, idle keep-alive ones included; a request past "
                                        "them gets 503. Default: 2 * (--max_num_seqs + "
                                        "--max_waiting) + 64.")
_NAME = flags.DEFINE_string("served_model_name", None, "The model name clients send and "
                            "/v1/models lists (default: --model).")
_WARMUP = flags.DEFINE_bool("warmup", True, "Compile every shape before reporting healthy.")
_TOOL_PARSER = flags.DEFINE_enum("tool_call_parser", None, ["hermes", "llama3_json"],
                                 "How the model writes tool calls (default: llama3_json for "
                                 "Llama 3 chat templates, else hermes).")
_RUNTIME_LORA = flags.DEFINE_bool("allow_runtime_lora", False, "Allow POST "
                                  "/v1/load_lora_adapter and /v1/unload_lora_adapter (they "
                                  "read paths on this machine).")
_REASONING = flags.DEFINE_enum("reasoning_parser", None, ["deepseek_r1", "qwen3", "none"],
                               "Split <think>...</think> into reasoning_content (default: "
                               "when the chat template mentions <think>).")

FLAGS = flags.FLAGS


def check_flags() -> None:
    given = [name for name in common.SAMPLING_FLAGS if FLAGS[name].present]
    if given:
        raise ValueError(f"--{given[0]}: sampling settings are per request in the server "
                         "(send them in the request body)")
    for flag, lo in ((_PORT, 0), (_MAX_WAITING, 0), (_MAX_BODY, 1), (_DRAIN, 0),
                     (_MAX_CONNECTIONS, 1)):
        if flag.value is not None and not flag.value >= lo:
            raise ValueError(f"--{flag.name} must be >= {lo}, got {flag.value}")
    for flag in (_KEEP_ALIVE, _READ_TIMEOUT):
        if not flag.value > 0:
            raise ValueError(f"--{flag.name} must be > 0, got {flag.value}")


def run() -> int:
    from jaxinfer.serve import ServeConfig, serve_forever

    check_flags()
    preset = common.preset_from_flag()
    llm_kwargs, _ = common.build_settings(preset)
    mesh = common.build_mesh(preset)
    cfg = ServeConfig(model_name=_NAME.value or llm_kwargs["model"],
                      api_key=_API_KEY.value or os.environ.get("JAXINFER_API_KEY") or None,
                      max_waiting=_MAX_WAITING.value, max_body_bytes=_MAX_BODY.value,
                      keep_alive_s=_KEEP_ALIVE.value, read_timeout_s=_READ_TIMEOUT.value,
                      max_connections=_MAX_CONNECTIONS.value,
                      tool_call_parser=_TOOL_PARSER.value, reasoning_parser=_REASONING.value,
                      lora_modules=common.lora_modules(),
                      allow_runtime_lora=_RUNTIME_LORA.value)

    def load():
        import jax

        llm = common.make_llm(llm_kwargs, mesh, warmup=_WARMUP.value)
        if jax.process_count() > 1:
            raise NotImplementedError("serving from several processes is not supported yet: "
                                      "run one process (a mesh of its local devices)")
        return llm

    return serve_forever(load, cfg, _HOST.value, _PORT.value, _DRAIN.value,
                         max_num_seqs=llm_kwargs["max_num_seqs"])


def main(argv):
    code = common.run_main(argv, run)
    sys.stdout.flush()
    sys.stderr.flush()
    # The loader thread may still be inside JAX if a signal came during loading.
    os._exit(code)


if __name__ == "__main__":
    app.run(main)
