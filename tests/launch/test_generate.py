"""`python -m jaxinfer.launch.generate` end to end, on the real SmolLM2-135M model.

Each launch loads the model (~10 s on CPU), so the checks are grouped into few launches. Runs use a
working directory outside the repository to show that presets resolve from anywhere.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

import jaxinfer as ji

PROMPTS = ["The capital of France is", "1, 2, 3,"]
CHAT_PROMPT = "What is 2+2?"
ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\w+)$", re.M)
AGGREGATE = re.compile(r"^aggregate: (\d+) requests?, (\d+) tokens in [\d.]+ s \([\d.]+ tok/s\), "
                       r"mean TTFT [\d.]+ ms, mean ITL [\d.]+ ms$", re.M)


def launch(cwd, *args, timeout=300):
    return subprocess.run([sys.executable, "-m", "jaxinfer.launch.generate", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def rows(stdout):
    return [(int(m[1]), int(m[2]), int(m[3]), m[7]) for m in ROW.finditer(stdout)]


@pytest.fixture(scope="module")
def reference():
    """The library's greedy outputs for PROMPTS, batched together like the script batches them."""
    llm = ji.LLM("smollm2-135m")
    outs = llm.generate(PROMPTS, ji.SamplingParams(max_tokens=8))
    return outs, llm.tokenizer


def test_generate_greedy_matches_library(tmp_path, reference):
    outs, _ = reference
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text(f"\n{PROMPTS[1]}\n\n")  # blank lines are skipped
    r = launch(tmp_path, "--prompt", PROMPTS[0], "--prompts_file", str(prompts_file),
               "--max_tokens", "8")
    assert r.returncode == 0, r.stderr
    assert outs[0].text.startswith(" Paris")
    for i, (prompt, out) in enumerate(zip(PROMPTS, outs)):  # default flags = greedy SamplingParams
        assert f"=== [{i}] {prompt}\n{out.text}\n\n" in r.stdout
    assert rows(r.stdout) == [(i, o.metrics.prompt_tokens, 8, "length") for i, o in enumerate(outs)]
    assert AGGREGATE.search(r.stdout).groups() == ("2", "16")
    assert "loaded smollm2-135m" in r.stderr and "Traceback" not in r.stderr


def test_preset_and_flag_override(tmp_path, data_dir, reference):
    """smollm2-chat: chat mode, max_tokens 128, temperature 0.7; the flags override the last
    two. The golden chat case for this question (HF transformers' chat template and greedy
    ids, tests/data/smollm2_greedy.json) gives the prompt's tokens and the answer."""
    with open(os.path.join(data_dir, "smollm2_greedy.json")) as f:
        case = next(c for c in json.load(f)["cases"]
                    if c.get("messages") == [{"role": "user", "content": CHAT_PROMPT}])
    r = launch(tmp_path, "--config", "smollm2-chat", "--prompt", CHAT_PROMPT,
               "--max_tokens", "5", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    ((_, prompt_tokens, generated, finish),) = rows(r.stdout)
    assert prompt_tokens == len(case["prompt_ids"])  # the template was applied, exactly
    assert (generated, finish) == (5, "length")
    _, tokenizer = reference
    assert _answers(r.stdout) == [tokenizer.decode(case["greedy_ids"][:5])]
    assert "max_seq_len 2048" in r.stderr


def test_flag_defaults_are_sampling_params_defaults(tmp_path):
    r = launch(tmp_path, "--helpfull", timeout=120)  # absl prints the help and exits 1
    helptext = r.stdout + r.stderr
    for f in dataclasses.fields(ji.SamplingParams):
        if f.default is None:  # seed, stop, logprobs: no default shown (and no logprobs flag)
            continue
        m = re.search(rf"--(?:\[no\])?{f.name}: [^\n]*\n\s+\(default: '([^']*)'\)", helptext)
        assert m, (f.name, helptext)
        assert m[1] == (str(f.default).lower() if isinstance(f.default, bool) else str(f.default))


@pytest.mark.parametrize("args, message", [
    ((), "no prompt given"),
    (("--prompt", "hi", "--config", "no-such-preset"), "unknown preset 'no-such-preset'"),
    (("--prompt", "hi", "--temperature", "-1"), "temperature must be >= 0"),
    (("--prompt", "hi", "--config", "{bad_preset}"), "unknown sampling keys ['temprature']"),
])
def test_errors_exit_1_with_one_line(tmp_path, args, message):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"sampling": {"temprature": 0.5}}))
    r = launch(tmp_path, *[a.format(bad_preset=bad) for a in args], timeout=120)
    assert r.returncode == 1
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr


def test_configs_are_well_formed():
    """The presets ship inside the package (jaxinfer/configs, package data), so they resolve
    from an installed wheel."""
    from jaxinfer import configs

    assert {"smollm2-cpu", "smollm2-chat"} <= set(configs.names())
    with pytest.raises(ValueError, match="unknown preset 'nope'; available: smollm2-chat"):
        configs.path("nope")
    for name in ("smollm2-cpu", "smollm2-chat"):
        with open(configs.path(name)) as f:
            preset = json.load(f)
        assert set(preset) <= {"description", "model", "sampling", "chat", "mesh"}
        ji.SamplingParams(**preset.get("sampling", {}))
        assert preset["model"]["model"] == "smollm2-135m"


def _answers(stdout: str) -> list[str]:
    """The answer text after each '=== [i] prompt' header."""
    parts = re.split(r"^=== \[\d+\] .*$", stdout.split("\n  0 ")[0], flags=re.M)[1:]
    return [p.strip("\n").rsplit("\n\nreq", 1)[0].strip("\n") for p in parts]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_of_four_devices_give_the_one_process_tokens(tmp_path, reference):
    """Two local CPU processes x 4 simulated devices, joined by jax.distributed from the flags
    into one (data 2, sequence 4) mesh: each prints the greedy answers of one process on one
    device."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    args = [sys.executable, "-m", "jaxinfer.launch.generate", "--max_tokens", "8",
            "--max_num_seqs", "4", "--data", "2", "--sequence", "4",
            "--coordinator_address", f"127.0.0.1:{port}", "--num_processes", "2"]
    for p in PROMPTS:
        args += ["--prompt", p]
    procs = [subprocess.Popen(args + ["--process_id", str(i)], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    results = [p.communicate(timeout=600) for p in procs]
    outs, _ = reference
    for proc, (stdout, stderr) in zip(procs, results):
        assert proc.returncode == 0, stderr[-3000:]
        assert _answers(stdout) == [o.text for o in outs], stdout
        assert [r[2] for r in rows(stdout)] == [len(o.token_ids) for o in outs]


def test_distributed_flags_go_together(tmp_path):
    r = launch(tmp_path, "--prompt", "x", "--coordinator_address", "127.0.0.1:1",
               "--num_processes", "2")
    assert r.returncode != 0
    assert "error: --coordinator_address, --num_processes and --process_id go together (got " \
           "only --coordinator_address, --num_processes)" in r.stderr


@pytest.mark.slow
def test_report_lists_every_sequence_of_n():
    """--n 2: the report prints both sequences of a prompt, in index order, as [prompt.index];
    sequence 1 is what seed + 1 samples alone."""
    from jaxinfer.launch.generate import report

    llm = ji.LLM("smollm2-135m", max_seq_len=64, max_num_seqs=2)
    params = ji.SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=5)
    (out,) = llm.generate([PROMPTS[0]], params)
    alone = llm.generate([PROMPTS[0]], dataclasses.replace(params, n=1, seed=6))[0]
    text = report([PROMPTS[0]], [out], 1.0)
    assert [s.index for s in out.outputs] == [0, 1]
    assert out.outputs[1].token_ids == alone.token_ids
    for seq in out.outputs:
        assert f"=== [0.{seq.index}] {PROMPTS[0]}\n{seq.text}\n\n" in text
    assert rows(text) == [(0, out.metrics.prompt_tokens, 8, "length")]
    # --token_logprobs: each sequence's summed log-probabilities follow its text.
    (lp,) = llm.generate([PROMPTS[0]], dataclasses.replace(params, n=1, token_logprobs=True))
    seq = lp.outputs[0]
    assert (f"=== [0] {PROMPTS[0]}\n{seq.text}\n--- logprob: sampled "
            f"{float(seq.sampling_logprobs.sum()):.4f}, model "
            f"{float(seq.model_logprobs.sum()):.4f} over 4 tokens\n") in report([PROMPTS[0]],
                                                                              [lp], 1.0)


@pytest.mark.slow
def test_beam_width_flag_runs_beam_search(tmp_path):
    """--beam_width 2: the launcher prints the beams of LLM.beam_search, best first."""
    from jaxinfer.engine.beam_search import BeamSearchParams

    r = launch(tmp_path, "--prompt", PROMPTS[0], "--beam_width", "2", "--max_tokens", "4",
               "--max_seq_len", "64", "--max_num_seqs", "2")
    assert r.returncode == 0, r.stderr
    llm = ji.LLM("smollm2-135m", max_seq_len=64, max_num_seqs=2)
    (want,) = llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=4))
    for j, seq in enumerate(want.sequences):
        assert f"=== [0] beam {j}: score {seq.score:.4f}" in r.stdout
        assert f"{PROMPTS[0]}\n{seq.text}\n\n" in r.stdout
    bad = launch(tmp_path, "--prompt", "x", "--beam_width", "11")
    assert bad.returncode != 0 and "beam_width must be an int in [1, 10], got 11" in bad.stderr
