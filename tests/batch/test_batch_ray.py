"""--runner=ray (Ray Data, an actor pool on a local 2-CPU Ray) writes the local runner's files,
also when an actor is killed mid-job and when the driver is killed and the command rerun."""

import json
import os
import signal
import time

import pytest
from batch_util import (LLM_KWARGS, MODEL_FLAGS, assert_same_output, kill_session, launch,
                        line, load_output, mixed_requests, write_lines)

import jaxinfer as ji
from jaxinfer.batch import JobSpec, run_local

import ray  # noqa: E402  (the test extras: a broken install fails, never skips)
pytestmark = pytest.mark.slow

SEED = 4
MAX_LINE_BYTES = 4096  # the fixture's overlong line travels to the actors as its size


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """The local runner's job: (spec, summary)."""
    tmp = tmp_path_factory.mktemp("local")
    lines = mixed_requests(20, max_tokens=6)
    lines[5:5] = ["[]", line("r3", {"prompt": "dup"}), "", line("x", {"prompt": "x", "n": 3}),
                  line("long", {"prompt": "p" * 5000})]
    spec = JobSpec(write_lines(tmp / "in.jsonl", lines), str(tmp / "out"), LLM_KWARGS,
                   seed=SEED, commit_every=3, progress=False, max_line_bytes=MAX_LINE_BYTES)
    return spec, run_local(ji.LLM(**LLM_KWARGS), spec)


def timings_removed(summary):
    return {k: v for k, v in summary.items() if k not in (
        "elapsed_s", "output_tokens_per_s", "requests_per_s", "max_rss_mb", "output",
        "output_sha256")}


def actor_pids():
    """Our Ray Data actors: processes of this session running the _Generator map worker."""
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
            if cmd.startswith(b"ray::MapWorker") and b"MapBatches(_Generator)" in cmd \
                    and os.getsid(int(entry)) == os.getsid(0):
                pids.append(int(entry))
        except OSError:
            continue
    return pids


def test_ray_runner_matches_the_local_runner_even_when_an_actor_dies(local, tmp_path):
    from jaxinfer.batch.ray_runner import run_ray

    spec, want = local
    out = str(tmp_path / "ray")
    ray_spec = JobSpec(spec.input_path, out, LLM_KWARGS, seed=SEED, commit_every=3,
                       progress=False, max_line_bytes=MAX_LINE_BYTES)
    killed = []

    def kill_an_actor(entry):  # after the first commit: its batches in flight are redone
        if not killed:
            killed.extend(actor_pids())
            for pid in killed:
                os.kill(pid, signal.SIGKILL)

    ray.init(num_cpus=2, include_dashboard=False)
    try:
        got = run_ray(ray_spec, num_workers=1, on_commit=kill_an_actor)
    finally:
        ray.shutdown()
    assert len(killed) == 1
    assert_same_output(f"{out}/output.jsonl", f"{spec.output_dir}/output.jsonl")
    assert timings_removed(got) == timings_removed(want)
    manifests = [[json.loads(x) for x in open(f"{d}/shard-00000-of-00001/manifest.jsonl")]
                 for d in (out, spec.output_dir)]
    ids = [[c for e in m for c in e["custom_ids"]] for m in manifests]
    assert ids[0] == ids[1] and len(ids[0]) == len(load_output(f"{out}/output.jsonl"))


def test_a_killed_ray_driver_resumes_to_the_local_output(local, tmp_path):
    spec, _ = local
    out = str(tmp_path / "ray")
    command = ["--input", spec.input_path, "--output", out, *MODEL_FLAGS, "--seed", str(SEED),
               "--commit_every", "3", "--progress=false", "--runner", "ray",
               "--max_line_bytes", str(MAX_LINE_BYTES)]
    manifest = f"{out}/shard-00000-of-00001/manifest.jsonl"
    proc = launch(*command)
    while not (os.path.exists(manifest) and open(manifest).read().count("\n") >= 2):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    kill_session(proc)
    proc = launch(*command)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr
    assert_same_output(f"{out}/output.jsonl", f"{spec.output_dir}/output.jsonl")
    assert json.load(open(f"{out}/summary.json"))["runs"] == 2
    assert stdout.startswith("batch: 24 requests, 21 ok, 3 failed (1 duplicate_custom_id, "
                             "1 invalid_json, 1 line_too_long)")  # n = 3 is answered


def test_the_ray_runner_on_a_finished_job_merges_it_again(local, tmp_path):
    """A one-shard job whose shard is already complete (its driver killed after the last
    commit, before the merge) is merged by the rerun without starting Ray, to the same output
    and summary counts as the local runner's."""
    import shutil

    from jaxinfer.batch.ray_runner import run_ray

    spec, want = local
    out = str(tmp_path / "ray")
    shutil.copytree(spec.output_dir, out)
    os.remove(f"{out}/output.jsonl")
    got = run_ray(JobSpec(spec.input_path, out, LLM_KWARGS, seed=SEED, commit_every=3,
                          progress=False, max_line_bytes=MAX_LINE_BYTES), num_workers=1)
    assert_same_output(f"{out}/output.jsonl", f"{spec.output_dir}/output.jsonl")
    for key in ("requests", "succeeded", "failed", "completion_tokens"):
        assert got[key] == want[key], key
