#!/usr/bin/env bash
# Builds llama.cpp's llama-bench with the CUDA backend (sm_90, the H200) on the GPU machine, from
# the stripped source archive tools/device/pack_llamacpp.sh wrote to .device/ (carried there).
#
#   tools/device/build_llamacpp.sh [DIR]     -> DIR/build/bin/llama-bench  (DIR: /tmp/llamacpp)
#
# Options: GGML_CUDA on, Hopper only (CMAKE_CUDA_ARCHITECTURES=90), no host-CPU tuning
# (GGML_NATIVE off), nothing that fetches (OpenSSL/HTTPS off; LLAMA_CURL no longer exists in this
# version), static libraries so the binary runs from the build tree, only the llama-bench target.
# JOBS (default: all cores) sets the parallelism; ~4 min on 16 cores. LLAMA_CMAKE_ARGS: more
# cmake options, last wins (e.g. -DGGML_CUDA=OFF for a CPU build where there is no cuBLAS).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DIR=${1:-/tmp/llamacpp}
archives=("$ROOT"/.device/llama.cpp-*.tar.gz)
ARCHIVE=${archives[-1]}
[[ -f $ARCHIVE ]] || { echo "no .device/llama.cpp-*.tar.gz: run tools/device/pack_llamacpp.sh here and carry .device"; exit 1; }
JOBS=${JOBS:-$(nproc)}
mkdir -p "$DIR"
# a warm machine keeps /tmp: same archive -> keep the tree, so the build below is incremental
stamp=$(sha256sum "$ARCHIVE" | cut -c1-16)
if [[ $(cat "$DIR/.archive" 2>/dev/null) != "$stamp" ]]; then
  rm -rf "$DIR/llama.cpp" "$DIR/build"
  tar xzf "$ARCHIVE" -C "$DIR"
  echo "$stamp" >"$DIR/.archive"
fi
if command -v nvcc >/dev/null; then NVCC=$(command -v nvcc); else NVCC=/usr/local/cuda/bin/nvcc; fi
GEN=(); command -v ninja >/dev/null && GEN=(-G Ninja)
t0=$(date +%s)
# shellcheck disable=SC2086  # LLAMA_CMAKE_ARGS: several words on purpose
cmake -S "$DIR/llama.cpp" -B "$DIR/build" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_COMPILER="$NVCC" -DGGML_NATIVE=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
  -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TOOLS=ON -DBUILD_SHARED_LIBS=OFF ${LLAMA_CMAKE_ARGS:-}
cmake --build "$DIR/build" -j "$JOBS" --target llama-bench
echo "built $DIR/build/bin/llama-bench in $(( $(date +%s) - t0 )) s"
