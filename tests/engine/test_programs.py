"""The programs cache (jaxinfer.engine.programs): step programs kept on disk across processes and
loaded without tracing, written only when XLA compiled them in the writing process.

Each case runs the tiny Llama in fresh processes that share one cache directory, so what one
process wrote is what the next one loads; every process must give the same greedy and seeded
tokens as the first, which compiled everything itself."""

import json
import os
import shutil
import subprocess
import sys

import pytest

TINY = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "tiny_models", "llama")

_WORKER = r"""
import json, sys
import jax
traced = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, secs, fun_name=None, **kw: traced.append(fun_name)
    if event == "/jax/core/compile/jaxpr_trace_duration" else None)
# JAX's cache keeps every program (the tiny model's compile in well under the 0.2 s that
# jaxinfer sets as the threshold), so that it can answer where ours does not.
jax.config.update("jax_compilation_cache_dir", sys.argv[2])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
import jaxinfer as ji
from jaxinfer.engine import programs
llm = ji.LLM(sys.argv[1], max_seq_len=64, max_num_seqs=2, decode_steps=4)
prefetched = len(programs._PREFETCH)
prompts = [[5, 9, 2, 7], [11, 3, 8, 1, 4, 6]]
greedy = llm.generate(prompts, ji.SamplingParams(max_tokens=10, temperature=0.0,
                                                  ignore_eos=True))
sampled = llm.generate(prompts[:1], ji.SamplingParams(max_tokens=10, temperature=1.0, seed=3,
                                                      ignore_eos=True))
cache = llm._engine.runner.programs
if cache is not None:
    cache.flush()
second = {}
if len(sys.argv) > 3:  # a second LLM of the same arguments, its entries gone from the disk
    import os, shutil
    shutil.rmtree(os.path.join(sys.argv[2], "programs"))
    llm2 = ji.LLM(sys.argv[1], max_seq_len=64, max_num_seqs=2, decode_steps=4)
    again = llm2.generate(prompts, ji.SamplingParams(max_tokens=10, temperature=0.0,
                                                     ignore_eos=True))
    c2 = llm2._engine.runner.programs
    second = {"second_greedy": [o.token_ids for o in again], "second_hits": c2.hits,
              "second_misses": c2.misses}
print("RESULT " + json.dumps({
    "greedy": [o.token_ids for o in greedy], "sampled": sampled[0].token_ids,
    "cache_on": cache is not None,
    **({"hits": cache.hits, "misses": cache.misses, "written": cache.written}
       if cache is not None else {}),
    "prefetched": prefetched, **second,
    "step_traces": sum(name in ("step", "decode_loop", "admit_rows", "fork_rows",
                                "set_block_tables") for name in traced)}))
"""


def _run(cache_dir: str, *extra, **env_extra) -> dict:
    env = dict(os.environ, **env_extra)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env.pop("JAXINFER_COMPILATION_CACHE", None)
    proc = subprocess.run([sys.executable, "-c", _WORKER, TINY, cache_dir, *extra], env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def _entries(cache_dir: str) -> list:
    root = os.path.join(cache_dir, "programs")
    return sorted(n for n in os.listdir(root) if n.endswith(".bin")) if os.path.isdir(root) \
        else []


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """A process on an empty cache: compiles every program, writes an entry for each."""
    cache = str(tmp_path_factory.mktemp("xla"))
    out = _run(cache)
    return cache, out


def test_first_process_writes_what_it_compiled(first):
    cache, out = first
    # A flat step, a decode loop and the admission update at least.
    assert out["hits"] == 0 and out["misses"] >= 3
    assert out["written"] == out["misses"]
    assert len(_entries(cache)) == out["written"]
    assert out["step_traces"] >= out["misses"]


def test_second_process_loads_without_tracing(first, tmp_path):
    """Same tokens, every program loaded (the first ones prefetched while the weights
    loaded), and none of them traced: the steps, decode loops and state updates."""
    cache = str(tmp_path / "xla")
    shutil.copytree(first[0], cache)
    out = _run(cache)
    assert (out["greedy"], out["sampled"]) == (first[1]["greedy"], first[1]["sampled"])
    assert out["misses"] == 0 and out["hits"] == first[1]["misses"]
    assert out["prefetched"] >= 1
    assert out["step_traces"] == 0
    assert out["written"] == 0


def test_nothing_written_from_programs_jax_cache_loaded(first, tmp_path):
    """With JAX's cache holding the programs but no entries of ours, the programs come from
    JAX's cache, and none is written: a loaded executable serializes without some of its code
    (the next process would fail on it). That next process still runs, and gives the same
    tokens. (In a directory of its own: JAX's keys name the cache directory, so a copy of
    `first`'s would miss.)"""
    cache = str(tmp_path / "xla")
    assert _run(cache)["written"] >= 2
    shutil.rmtree(os.path.join(cache, "programs"))
    out = _run(cache)
    assert out["written"] == 0 and out["hits"] == 0 and out["misses"] >= 2
    assert out["step_traces"] >= 2
    assert _entries(cache) == []
    again = _run(cache)
    for o in (out, again):
        assert (o["greedy"], o["sampled"]) == (first[1]["greedy"], first[1]["sampled"])


def test_a_damaged_entry_is_compiled_anew(first, tmp_path):
    """An entry that does not load is removed and its program compiled, and written again
    (JAX's cache misses in a copied directory); the next process loads every program."""
    cache = str(tmp_path / "xla")
    shutil.copytree(first[0], cache)
    names = _entries(cache)
    with open(os.path.join(cache, "programs", names[0]), "wb") as f:
        f.write(b"not a program")
    out = _run(cache)
    assert out["misses"] == 1 and out["hits"] == first[1]["misses"] - 1
    assert out["written"] == 1 and _entries(cache) == names
    again = _run(cache)
    assert again["hits"] == first[1]["misses"] and again["misses"] == 0
    for o in (out, again):
        assert (o["greedy"], o["sampled"]) == (first[1]["greedy"], first[1]["sampled"])


def test_off_with_the_environment_variable(first, tmp_path):
    cache = str(tmp_path / "xla")
    shutil.copytree(first[0], cache)
    out = _run(cache, JAXINFER_PROGRAM_CACHE="0")
    assert not out["cache_on"] and out["prefetched"] == 0 and out["step_traces"] >= 2
    assert (out["greedy"], out["sampled"]) == (first[1]["greedy"], first[1]["sampled"])


def test_a_second_llm_takes_the_first_ones_programs(first, tmp_path):
    """A second LLM of the same arguments in one process gets every program from memory (its
    entries were deleted from the disk in between), as jit's own cache would serve it."""
    cache = str(tmp_path / "xla")
    shutil.copytree(first[0], cache)
    out = _run(cache, "second")
    assert out["second_greedy"] == first[1]["greedy"]
    assert out["second_misses"] == 0 and out["second_hits"] >= 3


def test_loaded_onto_the_devices_it_was_compiled_for(tmp_path):
    """In a process of two (simulated) devices, a one-device engine's programs load onto its
    device: loaded onto all of the process's devices, the next process's first call failed
    ("Expected args ... to have 2 shards")."""
    cache = str(tmp_path / "xla")
    devices = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"
    flags = {"XLA_FLAGS": devices.strip()}
    one = _run(cache, **flags)
    two = _run(cache, **flags)
    assert one["written"] >= 3 and two["hits"] == one["misses"] and two["misses"] == 0
    assert (two["greedy"], two["sampled"]) == (one["greedy"], one["sampled"])
