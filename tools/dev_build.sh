#!/usr/bin/env bash
# Dev build of the native module without pip: builds into build/dev-$NAME and leaves
# _specd*.so in that folder. Point SPECD_NATIVE_DIR at it to use it:
#   tools/dev_build.sh me && SPECD_NATIVE_DIR=build/dev-me python -m pytest tests/native
set -euo pipefail
cd "$(dirname "$0")/.."
name="${1:-default}"
out="build/dev-$name"
cmake -S worker/kernels -B "$out" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DSPECD_BACKEND="${SPECD_BACKEND:-cpu}" -DSPECD_DEV_OUTPUT_DIR="$PWD/$out" \
  -DSPECD_CUDA_ARCHITECTURES="${SPECD_CUDA_ARCHITECTURES:-}" -DSPECD_HIP_ARCHITECTURES="${SPECD_HIP_ARCHITECTURES:-gfx90a}" \
  -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" -DPython_EXECUTABLE="$(command -v python3)" >/dev/null
cmake --build "$out" -j "${JOBS:-2}"
echo "built: $(ls "$out"/_specd*.so)"
