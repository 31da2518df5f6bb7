"""The deployment configs of configs/ and the preset loader's "mesh" section, without loading a
model: each file goes through the functions the launchers use (common.load_preset,
build_settings, build_mesh) with the flags parsed as a command line would give them, and what
comes out is checked against what the library accepts (LLM's signature and value sets,
SamplingParams, MeshConfig, the Llama-3 shapes' divisibility by the tensor degree).
"""

import contextlib
import glob
import inspect
import json
import os
import subprocess
import sys

import pytest
from absl import flags

import jaxinfer as ji
from jaxinfer import backends, configs, sharding
from jaxinfer.launch import common, distributed
from jaxinfer.loading.safetensors import config_from_hf
from jaxinfer.quant import KV_DTYPES, MODES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.json")))
FLAGS = flags.FLAGS


@contextlib.contextmanager
def command_line(*args):
    """The flags parsed from `args`, as app.run parses them; unparsed again afterwards."""
    FLAGS(["launch", *args])
    try:
        yield
    finally:
        FLAGS.unparse_flags()


def write(tmp_path, preset: dict) -> str:
    path = tmp_path / "preset.json"
    path.write_text(json.dumps(preset))
    return str(path)


def test_the_configs_folder_holds_the_deployment_configs():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"smollm2-135m-cpu.json", "smollm2-135m-chat-server.json", "gemma3-270m-cpu.json",
            "llama-3-8b-8xgpu-tp8.json", "llama-3-8b-1xgpu-int8.json",
            "llama-3-70b-8xgpu-tp8.json", "mixtral-8x7b-8xgpu-ep.json",
            "smollm2-135m-ngram-cpu.json"} <= names
    with open(os.path.join(ROOT, "configs", "README.md"), encoding="utf-8") as f:
        readme = f.read()
    for name in names:  # each file has its row, with its command
        assert f"--config configs/{name}" in readme, name


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_builds_what_the_launchers_pass_on(path):
    preset = common.load_preset(path)
    assert preset["description"] and set(preset) == set(common.PRESET_SECTIONS)
    with command_line():
        llm_kwargs, sampling_kwargs = common.build_settings(preset)
        mesh = common.build_mesh(preset)
    inspect.signature(ji.LLM).bind(**llm_kwargs, **({"mesh": mesh} if mesh else {}))
    assert llm_kwargs["dtype"] in (None, "float32", "bfloat16", "float16")
    assert llm_kwargs["quantization"] in (None, *MODES)
    assert llm_kwargs["kv_cache_dtype"] in (None, *KV_DTYPES)
    assert llm_kwargs["attention"] in backends.ATTENTION
    assert llm_kwargs["speculative"] is None or isinstance(llm_kwargs["speculative"],
                                                           ji.SpeculativeConfig)
    ji.SamplingParams(**sampling_kwargs)
    degrees = {axis: preset["mesh"].get(axis, 1) for axis in distributed.MESH_AXES}
    assert (mesh or ji.MeshConfig()) == ji.MeshConfig(**degrees)
    assert llm_kwargs["max_num_seqs"] % degrees["data"] == 0  # LLM's rule: rows per replica
    # What the file says it is: the CPU ones name an alias, the GPU ones a path to edit.
    name = os.path.basename(path)
    if "gpu" in name:
        assert llm_kwargs["model"].startswith("/path/to/") and "Edit: model.model" in \
            preset["description"]
    else:
        assert "/" not in llm_kwargs["model"] and mesh is None


@pytest.mark.parametrize("name", ["llama-3-8b-8xgpu-tp8", "llama-3-70b-8xgpu-tp8"])
def test_llama_meshes_divide_the_model(name):
    """The tensor degree splits Llama-3's heads and FFN (the shapes of configs/models/)."""
    preset = common.load_preset(os.path.join(ROOT, "configs", name + ".json"))
    with open(os.path.join(ROOT, "configs", "models", name.split("-8xgpu")[0] + ".json")) as f:
        cfg = config_from_hf(json.load(f))
    with command_line():
        sharding.check_divisible(cfg, common.build_mesh(preset))


def test_preset_mesh_applies_unless_a_flag_is_passed(tmp_path):
    preset = common.load_preset(write(tmp_path, {"mesh": {"data": 2, "tensor": 4}}))
    with command_line():
        assert common.build_mesh(preset) == ji.MeshConfig(data=2, tensor=4, sequence=1)
    with command_line("--tensor", "2"):  # only tensor is replaced
        assert common.build_mesh(preset) == ji.MeshConfig(data=2, tensor=2, sequence=1)
    with command_line("--tensor", "1", "--data", "1"):  # a flag at its default still wins
        assert common.build_mesh(preset) is None
    with command_line("--sequence", "2"):
        assert common.build_mesh({}) == ji.MeshConfig(sequence=2)
    with command_line():
        assert common.build_mesh({}) is None


@pytest.mark.parametrize("section, message", [
    ({"mesh": {"tensor": -2}}, "mesh.tensor must be a positive integer, got -2"),
    ({"mesh": {"data": 0}}, "mesh.data must be a positive integer, got 0"),
    ({"mesh": {"tensor": 2.0}}, "mesh.tensor must be a positive integer, got 2.0"),
    ({"mesh": {"sequence": "2"}}, "mesh.sequence must be a positive integer, got '2'"),
    ({"mesh": {"tensor": True}}, "mesh.tensor must be a positive integer, got True"),
    ({"mesh": {"expert": 8}}, "unknown mesh keys ['expert']; expected data, tensor, sequence"),
    ({"mesh": [1, 8, 1]}, "'mesh' must be an object"),
    ({"model": {"mesh": {"tensor": 8}}}, "the mesh goes in its own 'mesh' section"),
    ({"description": 3}, "'description' must be a string"),
    ({"model": {"speculative": {"method": "ngram", "k": 4}}}, "model.speculative must be"),
])
def test_bad_preset_names_the_file_and_the_field(tmp_path, section, message):
    path = write(tmp_path, section)
    with pytest.raises(ValueError) as e:
        common.load_preset(path)
    assert str(e.value).startswith(f"preset {path}: ") and message in str(e.value)


def test_the_package_keeps_its_named_presets():
    assert configs.names() == ["smollm2-chat", "smollm2-cpu"]
    for name in configs.names():
        preset = common.load_preset(name)
        assert preset["model"]["model"] == "smollm2-135m"
    assert os.path.isfile(configs.path("draft_prompts.txt"))


def test_llama_hf_configs_are_where_their_users_look():
    """benchmarks/scaling.py (and tests/multidevice_worker.py) read configs/models/."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import scaling

    assert scaling.MODELS_DIR == os.path.join(ROOT, "configs", "models")
    shapes = {}
    for name in ("llama-3-8b", "llama-3-70b"):
        with open(os.path.join(scaling.MODELS_DIR, name + ".json")) as f:
            cfg = config_from_hf(json.load(f))
        shapes[name] = (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.d_model)
    assert shapes == {"llama-3-8b": (32, 32, 8, 4096), "llama-3-70b": (80, 64, 8, 8192)}


def test_run_main_sets_xla_flags_before_jax_distributed(monkeypatch):
    """The launchers' shared main sets the process-wide XLA flags before make_llm starts
    jax.distributed (which starts a backend), not only inside LLM()."""
    calls = []
    monkeypatch.setattr(backends, "set_xla_flags", lambda: calls.append("set_xla_flags"))
    monkeypatch.setattr(common.logging, "set_verbosity", lambda level: None)

    def initialize():
        calls.append("initialize")
        raise ValueError("stop before the model")

    monkeypatch.setattr(distributed, "initialize", initialize)
    with pytest.raises(SystemExit, match="error: stop before the model"):
        common.run_main(["launch"], lambda: common.make_llm({"model": "smollm2-135m"}))
    assert calls == ["set_xla_flags", "initialize"]


@pytest.mark.parametrize("args, message", [
    ((), "needs 8 devices; 1 are available"),           # the preset's mesh reached the LLM
    (("--tensor", "1"), "/path/to/Meta-Llama-3-8B-Instruct"),  # the flag replaced it
])
def test_generate_applies_the_preset_mesh(tmp_path, args, message):
    """End to end through the launcher on one CPU device: the tp8 config's mesh is refused
    for want of devices, before any model loads; with --tensor 1 the run gets as far as the
    placeholder model path."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    r = subprocess.run([sys.executable, "-m", "jaxinfer.launch.generate", "--config",
                        os.path.join(ROOT, "configs", "llama-3-8b-8xgpu-tp8.json"),
                        "--prompt", "hi", *args], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 1, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and message in lines[-1], r.stderr[-2000:]
