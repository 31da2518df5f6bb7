"""Expert parallelism: greedy tokens on simulated 8-device meshes equal one device's.

tests/moe_worker.py serves the tiny Mixtral (8 experts) and Qwen3-MoE (16 experts) on one
device and on meshes whose data x tensor devices split the experts (1 or 2 experts a device),
the MoE layers under shard_map with one psum each. Reference: the same model on one device
(float32: tokens equal, logprobs within 1e-5); exact byte counts for the experts' shards.
"""

import os
import json
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


# XLA:CPU aborts a process whose simulated devices do not all reach a collective within 40 s.
# On the 2-core machine, with another test worker compiling beside it, one of the 8 device
# threads once came too late (alone the worker takes about 23 s, under two busy loops 36 s).
# That abort, and only it, gets one more try; a hang would time out again, a wrong result fails.
RENDEZVOUS_TIMEOUT = "Expected 8 threads to join the rendezvous"


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    for attempt in range(2):
        proc = subprocess.run([sys.executable, os.path.join(HERE, "moe_worker.py")], env=env,
                              capture_output=True, text=True, timeout=1200)
        if proc.returncode == 0 or RENDEZVOUS_TIMEOUT not in proc.stderr:
            break
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("name,experts", [("mixtral", 8), ("qwen3_moe", 16)])
def test_meshes_give_one_devices_greedy_tokens(results, name, experts):
    runs = results[name]
    one = runs["single"]
    for label, run in runs.items():
        assert run["tokens"] == one["tokens"], (name, label)
        np.testing.assert_allclose(run["logprobs"], one["logprobs"], atol=1e-5, rtol=0)
        if label == "single":
            continue
        # Experts split over data x tensor: 8 devices hold experts / 8 each, 4 devices / 4.
        if label == "data3_tensor2":  # 6 devices do not divide the experts: ffn split 2 ways
            assert run["expert_spec"] == "P(None, None, 'tensor')", label
            assert run["expert_bytes_device0"] * 2 == run["expert_bytes_total"], label
            continue
        split = {"tensor4": 4, "data2_tensor4": 8, "data8": 8, "data2_tensor2_seq2": 4}[label]
        assert run["expert_bytes_device0"] * split == run["expert_bytes_total"], label
        assert "data" in run["expert_spec"] or "tensor" in run["expert_spec"], label
