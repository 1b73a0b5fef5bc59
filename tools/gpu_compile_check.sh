#!/usr/bin/env bash
# Compile-only check of the GPU backends (CI has no GPU): builds the native module with
#   - SPECD_BACKEND=cuda for sm_75, sm_90a and sm_120 + PTX (every architecture-dependent
#     branch; ALL_ARCHS=1: the list of docker/worker-cuda12.Dockerfile), with the nvcc on PATH
#     or in /usr/local/cuda;
#   - SPECD_BACKEND=hip with hipcc (Debian's ROCm 5 packages, HIP_PLATFORM=amd) for gfx
#     targets that compiler knows: gfx90a (CDNA, 64-lane waves) and gfx1030 (RDNA2, 32-lane
#     waves: the consumer cards' wave size; the rocm image builds its full list with ROCm 6).
# Usage: tools/gpu_compile_check.sh [cuda|hip|all]   (default all). Needs the Python env with
# pybind11 (the .venv of .ci/run). Fails on any compiler error.
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"
jobs="${JOBS:-$(nproc)}"

build() {  # name backend extra-cmake-args...
  local name="$1" backend="$2"; shift 2
  local out="build/check-$name"
  rm -rf "$out"
  cmake -S worker/kernels -B "$out" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPECD_BACKEND="$backend" \
    -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" -DPython_EXECUTABLE="$(command -v python3)" "$@" \
    >"$out.configure.log" 2>&1 || { cat "$out.configure.log"; return 1; }
  grep -E "specd: (CUDA|HIP)" "$out.configure.log" || true
  local t0=$SECONDS
  cmake --build "$out" -j "$jobs" 2>&1 | grep -Ev "^\[[0-9]+/[0-9]+\] (Building|Linking)" || true
  test -n "$(ls "$out"/_specd*.so 2>/dev/null)" || { echo "gpu_compile_check: $name build failed"; return 1; }
  echo "gpu_compile_check: $name OK ($((SECONDS - t0)) s)"
}

if [[ "$what" == cuda || "$what" == all ]]; then
  if ! command -v nvcc >/dev/null; then
    for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do [[ -x "$d/nvcc" ]] && export PATH="$d:$PATH" && break; done
  fi
  command -v nvcc >/dev/null || { echo "gpu_compile_check: no nvcc (CUDA toolkit) found"; exit 1; }
  # Every architecture-dependent branch of the sources (__CUDA_ARCH__ >= 610, 700, 800, 900,
  # sm_90a's wgmma) is compiled by sm_75 (dp4a, wmma, no mma.sync) and sm_90a (mma.sync,
  # cp.async, PDL, wgmma), and sm_120 + PTX adds the newest toolkit target: a third of the
  # compile time of the image's full list (matvec.cu alone takes ~2 min per architecture on 2
  # cores). ALL_ARCHS=1 builds the list of docker/worker-cuda12.Dockerfile instead.
  archs="75-real;90a-real;120"
  if [[ "${ALL_ARCHS:-0}" == 1 && -f docker/worker-cuda12.Dockerfile ]]; then
    archs="$(sed -nE 's/^ARG SPECD_CUDA_ARCHITECTURES="([^"]*)".*/\1/p' docker/worker-cuda12.Dockerfile | head -1)"
  fi
  echo "gpu_compile_check: nvcc $(nvcc --version | sed -nE 's/.*release ([0-9.]+).*/\1/p'), architectures '${archs:-default}'"
  build cuda cuda -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" ${archs:+-DSPECD_CUDA_ARCHITECTURES="$archs"}
  # The phase marks of tools/device/trace_decode.py (cuda/trace.cuh) exist only in
  # SPECD_GPU_TRACE=1 builds: the files that hold them, compiled for sm_90a with it.
  t0=$SECONDS
  pids=()
  mkdir -p build/check-cuda
  for f in device.cu matvec_kq.cu matvec_kq_mma.cu matvec_f16.cu attention.cu; do
    nvcc -std=c++17 --expt-relaxed-constexpr -O3 -arch=sm_90a -Iworker/kernels -Iworker -DSPECD_WITH_GPU=1 \
      -DSPECD_GPU_TRACE=1 -c "worker/kernels/cuda/$f" -o "build/check-cuda/trace-${f%.cu}.o" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || { echo "gpu_compile_check: the SPECD_GPU_TRACE=1 build failed"; exit 1; }; done
  echo "gpu_compile_check: cuda with SPECD_GPU_TRACE=1 OK ($((SECONDS - t0)) s)"
  # The digit readers with fewer planes of x (cuda/digits.cuh, -DSPECD_X_PLANES: an experiment
  # switch), sm_90a: 2 planes for the direct and tensor-core readers, 1 for the staged one.
  t0=$SECONDS
  pids=()
  for fp in matvec_kq.cu:2 matvec_kq_mma.cu:2 matvec.cu:1; do
    f=${fp%:*}
    nvcc -std=c++17 --expt-relaxed-constexpr -O3 -arch=sm_90a -Iworker/kernels -Iworker -DSPECD_WITH_GPU=1 \
      -DSPECD_X_PLANES=${fp#*:} -c "worker/kernels/cuda/$f" -o "build/check-cuda/planes-${f%.cu}.o" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || { echo "gpu_compile_check: the SPECD_X_PLANES build failed"; exit 1; }; done
  echo "gpu_compile_check: cuda with SPECD_X_PLANES=2 / 1 OK ($((SECONDS - t0)) s)"
  # bench/bench_sync.py's program (built on the device machine): as that script builds it
  nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -c bench/gpu_sync.cu -o build/check-cuda/gpu_sync.o ||
    { echo "gpu_compile_check: bench/gpu_sync.cu failed"; exit 1; }
  echo "gpu_compile_check: bench/gpu_sync.cu OK"
  # bench/mma_scaled_a.cu (a design probe that bench/sass_mix.py counts), both register budgets
  for w in 16 8; do
    nvcc -std=c++17 --expt-relaxed-constexpr -O3 --use_fast_math -arch=sm_90a -Iworker/kernels -Iworker \
      -DSPECD_WITH_GPU=1 -DSA_WARPS=$w --cubin bench/mma_scaled_a.cu -o build/check-cuda/mma_scaled_a_$w.cubin ||
      { echo "gpu_compile_check: bench/mma_scaled_a.cu failed"; exit 1; }
  done
  echo "gpu_compile_check: bench/mma_scaled_a.cu OK"
fi

if [[ "$what" == hip || "$what" == all ]]; then
  command -v hipcc >/dev/null || { echo "gpu_compile_check: no hipcc (apt-get install hipcc libamdhip64-dev)"; exit 1; }
  export HIP_PLATFORM=amd HCC_AMDGPU_TARGET=gfx90a  # no GPU here: name the target (no probing)
  build hip hip "-DSPECD_HIP_ARCHITECTURES=gfx90a;gfx1030"
fi
