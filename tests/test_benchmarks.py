"""The GPU end-to-end benchmark runs its whole path (random-weight checkpoint written, loaded through
the public API, batch-1 decode and concurrent requests) on a tiny model, so it works when a GPU
machine runs it. Its figures are checked against what they are defined from: the weight bytes
against the model's parameter count from its config, the K/V bytes per step against the cache
layout, the decode rate against the wall time of the generate call it was measured in, and the
roofline fraction against the rate, bytes and bandwidth it is the quotient of. The quantization
benchmark runs its whole path on the same tiny model, its memory figures checked against the
bytes its weights take in each mode."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def _weights(c: dict) -> int:
    """Parameters of a tied Llama from its HF config, counted by hand."""
    D, F, V, L = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    q = c["num_attention_heads"] * c["head_dim"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    per_layer = D * q + 2 * D * kv + q * D + 3 * D * F + 2 * D  # wq wk wv wo, MLP, 2 norms
    return V * D + L * per_layer + D                            # embedding, layers, final norm


def test_e2e_benchmark_smoke(tmp_path):
    import e2e

    out = tmp_path / "e2e.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "e2e.py"), "--smoke",
                    "--json", str(out)], check=True, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    b1, c = result["batch1"], e2e.TINY
    assert result["dtype"] == "float32"  # on CPU: 4 bytes per weight and per cached value
    assert b1["weight_bytes"] == 4 * _weights(c)
    prompt, decoded = 128, 16   # the smoke run's prompt and decode lengths
    kv_dim = c["num_key_value_heads"] * c["head_dim"]
    assert b1["kv_bytes_per_step"] == 2 * c["num_hidden_layers"] * kv_dim * 4 * (
        prompt + decoded / 2)
    (rate,), (wall,) = b1["decode_runs"], b1["generate_wall_s"]
    assert b1["decode_tokens_per_s"] == rate
    # decoded - 1 steps after the first token, inside the generate call that was timed.
    assert 0 < (decoded - 1) / rate < wall
    (fraction,), (bandwidth,) = b1["fraction_runs"], b1["read_bandwidth"]
    assert fraction == pytest.approx(
        rate * (b1["weight_bytes"] + b1["kv_bytes_per_step"]) / bandwidth, rel=1e-12)
    (run,) = result["throughput"]
    assert run["requests"] == 4 and run["output_tokens"] == 4 * 8
    assert run["output_tokens_per_s"] == pytest.approx(32 / run["wall_s"], rel=1e-12)



def test_quantization_benchmark_memory_figures(tmp_path):
    """benchmarks/quantization.py end to end on the tiny model (one round, one token each),
    its memory figures against the model's weights counted from its config: float32 4 bytes a
    weight; int8 in groups of 32 one byte a matrix element plus a float16 scale per 32, the
    norms in float32; the decode state (the same float32 page pool) alike for both."""
    import e2e
    import quantization

    path = str(tmp_path / "tiny")
    num_weights = e2e.write_random_model(path, e2e.TINY)
    c = e2e.TINY
    norms = c["num_hidden_layers"] * 2 * c["hidden_size"] + c["hidden_size"]
    result = quantization.main(["--model", path, "--configs", "none,int8", "--runs", "1",
                                "--tokens", "1"])
    none, int8 = result["none"], result["int8"]
    assert none["param_bytes"] == 4 * num_weights
    assert int8["param_bytes"] == (num_weights - norms) * (1 + 2 / 32) + 4 * norms
    state = none["llm_bytes"] - none["param_bytes"]
    pool = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * 4 * 256
    assert state > pool  # room for 4 rows of max_seq_len 256, plus the per-row arrays
    assert int8["llm_bytes"] - int8["param_bytes"] == state
    assert none["llm_bytes_ratio"] == 1.0
    assert int8["llm_bytes_ratio"] == int8["llm_bytes"] / none["llm_bytes"]


def test_kernels_benchmark_ragged_smoke():
    """benchmarks/kernels.py's ragged section on CPU (interpret mode, tiny mixes): every
    implementation is timed and the kernel and the split pair agree with the reference at bf16
    rounding; its byte and FLOP counts follow from the mix it reports."""
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "kernels.py"),
                          "--only", "ragged", "--json", "--ragged_variants", "bq8"],
                         check=True, capture_output=True, text=True, timeout=300)
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    ragged = [r for r in rows if r["bench"] == "ragged_paged_attention"]
    assert {(r["mix"], r["impl"]) for r in ragged} == {
        (m, i) for m in ("mixed", "decode") for i in ("ragged", "ragged:bq8", "split",
                                                      "reference")}
    for r in ragged:
        assert r["ms"] > 0 and "note" not in r, r
        if r["impl"] != "reference":
            assert r["max_abs_diff_vs_ref"] < 2e-2, r     # bf16 outputs of O(1) values
    mixed = next(r for r in ragged if r["mix"] == "mixed")
    # Smoke mix: chunks (16 queries, context 48) and (16, 24), 4 decode rows at context 40.
    K, N, H = mixed["K"], mixed["N"], mixed["H"]
    assert mixed["T"] == 36 and mixed["rows"] == 6
    assert mixed["bytes"] == 2 * (48 + 24 + 4 * 40) * K * H * 2 + 2 * 36 * N * H * 2
    seen = sum(range(33, 49)) + sum(range(9, 25)) + 4 * 40
    assert mixed["flops"] == 4 * N * H * seen


@pytest.mark.slow
def test_structured_and_lora_benchmarks_run_end_to_end():
    """benchmarks/structured.py and benchmarks/lora.py at the smallest sizes: every workload
    generates its exact token count (asserted inside), and each ratio is the quotient of the
    figures it is reported from."""
    import lora
    import structured

    s = structured.main(["--rows", "3", "--output-len", "4", "--rounds", "1"])
    assert s["json_vs_free"] == s["tok_per_s"]["json"] / s["tok_per_s"]["free"]
    first = s["first_rows_tok_per_s"]
    assert s["mixed_vs_free_1"] == first["mixed"] / first["free-1"]
    assert s["schema_check"]["first_s"] > 0 and s["per_row_mask_ms"] > 0
    r = lora.main(["--rows", "2", "--output-len", "4", "--rounds", "1", "--rank", "4",
                   "--adapters", "2"])
    assert r["adapters_vs_off"] == r["tok_per_s"]["adapters"] / r["tok_per_s"]["off"]
    assert r["base_vs_off"] == r["tok_per_s"]["base"] / r["tok_per_s"]["off"]
    assert r["load_lora_s"] > 0 and r["slot_write_s"] > 0


def test_weight_sync_benchmark_runs_end_to_end():
    """benchmarks/weight_sync.py on the tiny Llama: every row timed, sleep frees at least the
    weights at level 2 beyond level 1's pool."""
    import weight_sync

    tiny = os.path.join(ROOT, "tests", "data", "tiny_models", "llama")
    r = weight_sync.main(["--model", tiny, "--rounds", "1", "--rank", "4", "--tokens", "4"])
    assert set(r["seconds"]) == {"full", "subset", "lora", "sleep1", "sleep2"}
    assert all(v["median"] > 0 for v in r["seconds"].values())
    assert r["freed_bytes"]["level2"] >= r["freed_bytes"]["level1"] + r["parameter_bytes"]
    assert r["tokens_per_s_after_update_over_before"] > 0
