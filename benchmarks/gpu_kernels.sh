#!/bin/bash
# The kernels' GPU check in one device run: the gpu-marked kernel tests (compiled, not
# interpreted), then benchmarks/kernels.py at full shapes (flash, paged decode, ragged step).
# Logs go to $OUT (or /tmp/gpu_kernels): device.txt, tests.log and kernels.txt.
#     bash benchmarks/gpu_kernels.sh            # from the repository root, on the GPU machine
# TEST_S and BENCH_S bound the two parts in seconds (defaults 200 and 260).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_kernels}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  $PY -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
} 2>&1 | tee "$OUT/device.txt"
echo "== pytest -m gpu tests/kernels"
timeout "${TEST_S:-200}" $PY -m pytest -q -o addopts="" -m gpu -n 8 -rfE -p no:cacheprovider \
    tests/kernels > "$OUT/tests.log" 2>&1
echo "pytest exit $?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -25
echo "== benchmarks/kernels.py"
timeout "${BENCH_S:-260}" $PY benchmarks/kernels.py --runs 10 2>&1 | tee "$OUT/kernels.txt" | grep -v "^$"
echo "kernels.py exit ${PIPESTATUS[0]}"
