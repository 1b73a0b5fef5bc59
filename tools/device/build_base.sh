#!/usr/bin/env bash
# The code before a change, built beside the working tree's on the GPU machine, so that one
# device call can time both (the machines drift between calls, a side by side does not).
#
#   off the device:  git diff BASE -- worker > .device/base.patch      (carry .device)
#   on the device:   bash tools/device/build_base.sh .device/base.patch [DIR]
#                    python3 bench/bench_gpu.py ... --variant base:SPECD_NATIVE_DIR=DIR/build/dev-base
#
# Copies this tree (without build/ and .git) to DIR (default /tmp/specd-base), reverses the
# patch there and runs tools/dev_build.sh base with the same settings a plain GPU build takes
# (SPECD_BACKEND, default cuda; SPECD_CUDA_ARCHITECTURES, default 90a-real; CUDAFLAGS; JOBS,
# default the core count). The build's log goes to DIR/build-base.log; the last line printed
# is the SPECD_NATIVE_DIR of the base build.
set -euo pipefail
cd "$(dirname "$0")/../.."
patch_file=$(realpath "${1:?usage: build_base.sh PATCH [DIR]}")
dir="${2:-/tmp/specd-base}"
mkdir -p "$dir"
tar --exclude=./build --exclude=./.git -cf - . | tar -xf - -C "$dir"
cd "$dir"
patch -s -R -p1 < "$patch_file"
t0=$(date +%s)
SPECD_BACKEND="${SPECD_BACKEND:-cuda}" SPECD_CUDA_ARCHITECTURES="${SPECD_CUDA_ARCHITECTURES:-90a-real}" \
  JOBS="${JOBS:-$(nproc)}" bash tools/dev_build.sh base > build-base.log 2>&1 ||
  { tail -40 build-base.log; echo "build_base: the base build failed (log: $dir/build-base.log)" >&2; exit 1; }
echo "build_base: built in $(( $(date +%s) - t0 )) s" >&2
echo "$dir/build/dev-base"
