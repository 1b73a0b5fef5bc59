#!/usr/bin/env bash
# The GPU benchmark in one command, on the GPU machine (no network), from the repo root. Carry
# .whl (the gguf wheel) and .device (the llama.cpp archive). specd's native module with the CUDA
# backend must import (`python3 -c "import worker.engine"`, PYTHONPATH / SPECD_NATIVE_DIR set), or
# SPECD_BUILD builds it here, alongside llama.cpp (SPECD_NATIVE_DIR unset: the newest
# build/dev-*/ holding the module, where tools/dev_build.sh puts it).
#
#   OUT=... bash tools/device/run_bench.sh
#
# Phases, each timed in $OUT/bench.log:
#   1. install the carried wheels into /tmp/site;
#   2. build llama-bench (CUDA) in the background, niced (tools/device/build_llamacpp.sh);
#      meanwhile run $SPECD_BUILD, if set (a command that builds specd's native module), then
#      with PYTEST set the GPU tests (`pytest tests/gpu $PYTEST_ARGS`, log in $OUT/pytest.log);
#   3. meanwhile write the random-weight models (tools/gen_gguf.py) into /dev/shm when it has room,
#      else /tmp: $MODELS, small first; a model that would not fit the disk or the time is skipped;
#   4. wait for the llama.cpp build (stopped if it would leave the benchmark < 150 s);
#   5. bench/bench_gpu.py on every model, specd then llama-bench, results in $OUT;
#   6. (NCU_MODELS) per-kernel time, DRAM bytes and issue-slot use of two decode layers
#      (tools/device/profile_decode.py under ncu, tools/device/ncu_summary.py), CSVs in $OUT;
#   7. (STACK_MODEL) the whole serving stack on cuda:0 (bench/bench_stack.py --device cuda:0):
#      what a streamed OpenAI request costs per token next to the in-process engine.
# The llama.cpp build alone takes ~4 min of the 16 cores; beside SPECD_BUILD it had done 163 of
# its 279 steps after 240 s (2026-12-06, H100 machine): with llama.cpp, keep BUDGET_S >= 500.
# Environment: BUDGET_S (the whole run, default 540 s, counted from BENCH_T0: an epoch second,
# default now; export BENCH_T0=$(date +%s) at the start of a longer command to count its earlier
# work), MODELS, LLAMA (0: no llama.cpp), LLAMA_BENCH_BIN (a built llama-bench: no build), REPS
# ("quick", the default, or "full": bench_gpu.py's own), BENCH_ARGS (more bench_gpu.py arguments,
# last wins), NCU_MODELS ("shape:TYPE ...", among MODELS: phase 6 profiles two decode layers of
# each with Nsight Compute, once per NCU_ENVS setting, default "SPECD_GPU_TC=0"; NCU_S seconds,
# default 150, are kept for it; NCU_ARGS, default "64", are profile_decode.py's POS0 [N], and
# NCU_SKIP / NCU_COUNT the kernels ncu skips / profiles, default those of two decode layers:
# e.g. NCU_ARGS="0 512" NCU_SKIP=0 NCU_COUNT=40 for the first layers of a 512-token prefill),
# PYTEST (1: phase 2's GPU tests; PYTEST_ARGS, default "-q", e.g. "-q -x -k wgmma"),
# STACK_MODEL ("shape:TYPE", among MODELS: phase 7 on it; carry the wheels of
# tools/device/stack_wheels.sh in .whl; STACK_S seconds, default 120, are kept for it;
# STACK_ARGS: bench_stack.py's arguments, default "--levels 1,2,4 --pairs 8 --max-tokens 256").
# A warm machine keeps /tmp and /dev/shm: a rerun reuses the models and the build.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT" || exit 1
: "${OUT:?set OUT to the folder the results go to}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/bench.log") 2>&1
BUDGET_S=${BUDGET_S:-540}
MODELS=${MODELS:-"qwen3-0.6b:F16 qwen3-0.6b:Q8_0 qwen3-0.6b:Q4_K_M llama-3.2-1b:BF16 llama-3.2-1b:Q8_0 llama-3.2-1b:Q4_K_M qwen3-8b:Q4_K_M qwen3-8b:F16"}
LLAMA=${LLAMA:-1}
T0=${BENCH_T0:-$(date +%s)}
elapsed() { echo $(( $(date +%s) - T0 )); }
phase() { echo "=== [$(elapsed) s] $*"; }
BUILD_PID=
# shellcheck disable=SC2329  # called by the EXIT trap
cleanup() {
  [[ -n $BUILD_PID ]] && kill -0 "$BUILD_PID" 2>/dev/null && kill -- -"$BUILD_PID" 2>/dev/null
  exec 1>&- 2>&-; sleep 0.5  # let tee write the log's last lines
}
trap cleanup EXIT

phase "start: $(nproc) cores, budget ${BUDGET_S} s, models: $MODELS"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm --format=csv,noheader || true

phase "1. wheels -> /tmp/site"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
fi
LLAMA_DIR=/tmp/llamacpp
if [[ $LLAMA == 1 && -x ${LLAMA_BENCH_BIN:-} ]]; then
  phase "2. llama.cpp: using $LLAMA_BENCH_BIN (no build)"
elif [[ $LLAMA == 1 ]]; then
  phase "2. llama.cpp build started in the background (log: $OUT/llama_build.log)"
  # its own session so that it can be stopped as a group; nice: model writing keeps a core
  setsid nice -n 10 bash tools/device/build_llamacpp.sh "$LLAMA_DIR" >"$OUT/llama_build.log" 2>&1 &
  BUILD_PID=$!
else
  phase "2. llama.cpp skipped (LLAMA=0)"
fi

if [[ -n ${SPECD_BUILD:-} ]]; then
  phase "2b. building specd: $SPECD_BUILD"
  bash -c "$SPECD_BUILD" || echo "SPECD BUILD FAILED: specd's numbers will be missing; llama.cpp's still run"
fi
python3 -c "import gguf; print('gguf', gguf.__version__ if hasattr(gguf, '__version__') else '', gguf.__file__)" \
  || { echo "cannot import gguf: carry .whl (the gguf wheel)"; exit 1; }
# a build by tools/dev_build.sh NAME lands in build/dev-NAME, which nothing points at unless the
# caller set SPECD_NATIVE_DIR: then the newest such folder holding the module is taken
if [[ -z ${SPECD_NATIVE_DIR:-} ]]; then
  so=$(ls -t build/dev-*/_specd*.so 2>/dev/null | head -1)
  if [[ -n $so ]]; then
    export SPECD_NATIVE_DIR=$ROOT/$(dirname "$so")
    echo "SPECD_NATIVE_DIR unset: using $SPECD_NATIVE_DIR (the newest build/dev-* module)"
  fi
fi
python3 -c "import worker.engine as e; print('specd native types:', e.native.supported_types())" \
  || echo "SPECD DOES NOT IMPORT: specd's numbers will be missing; llama.cpp's still run"
if [[ ${PYTEST:-0} == 1 ]]; then
  phase "2c. GPU tests: pytest tests/gpu ${PYTEST_ARGS:--q} (log: $OUT/pytest.log)"
  # shellcheck disable=SC2086  # PYTEST_ARGS: several words on purpose
  python3 -m pytest tests/gpu ${PYTEST_ARGS:--q} >"$OUT/pytest.log" 2>&1
  echo "pytest exit $?: $(tail -1 "$OUT/pytest.log")"
fi

phase "3. writing models"
DIR=/tmp/specd-models
# shellcheck disable=SC2046  # shape/type words on purpose
need=$(python3 tools/gen_gguf.py --dry-run $(echo "$MODELS" | tr ':' ' ') | awk '{s+=$1} END {print s}')
shm=$(df -B1 --output=avail /dev/shm 2>/dev/null | tail -1 || echo 0)
if [[ ${shm:-0} -gt $(( need + (8 << 30) )) ]]; then DIR=/dev/shm/specd-models; fi
mkdir -p "$DIR"
echo "models need $(( need >> 30 )) GiB; writing to $DIR ($(df -h --output=avail "$DIR" | tail -1) free)"
# "SIZE PATH" of the model file that MODELS' entry $1 ("shape:TYPE") names in $DIR
model_file() { python3 tools/gen_gguf.py --dry-run -o "$DIR" "${1%%:*}" "${1#*:}"; }
FILES=()
for m in $MODELS; do
  shape=${m%%:*}; ftype=${m#*:}
  read -r size path < <(model_file "$m")
  avail=$(df -B1 --output=avail "$DIR" | tail -1)
  if (( size + (2 << 30) > avail )); then echo "SKIPPED $m: needs $(( size >> 20 )) MiB, $(( avail >> 20 )) MiB free"; continue; fi
  if (( $(elapsed) > BUDGET_S - 200 )); then echo "SKIPPED $m: out of time"; continue; fi
  t=$(date +%s)
  if python3 tools/gen_gguf.py -q -o "$DIR" "$shape" "$ftype"; then
    FILES+=("$path"); echo "    $m: $(( $(date +%s) - t )) s"
  else
    echo "FAILED to write $m"
  fi
done
phase "3. models written: ${#FILES[@]}"
(( ${#FILES[@]} )) || { echo "no models"; exit 1; }

LLAMA_ARGS=()
if [[ $LLAMA == 1 && -x ${LLAMA_BENCH_BIN:-} ]]; then
  LLAMA_ARGS=(--llama-bench "$LLAMA_BENCH_BIN")
elif [[ -n $BUILD_PID ]]; then
  phase "4. waiting for the llama.cpp build"
  while kill -0 "$BUILD_PID" 2>/dev/null; do
    if (( $(elapsed) > BUDGET_S - 150 )); then
      echo "llama.cpp build stopped: it would leave the benchmark < 150 s (llama.cpp numbers SKIPPED)"
      kill -- -"$BUILD_PID" 2>/dev/null; break
    fi
    sleep 3
  done
  wait "$BUILD_PID" 2>/dev/null; BUILD_PID=
  tail -3 "$OUT/llama_build.log"
  if [[ -x $LLAMA_DIR/build/bin/llama-bench ]]; then
    LLAMA_ARGS=(--llama-bench "$LLAMA_DIR/build/bin/llama-bench")
  else
    echo "no llama-bench binary: llama.cpp numbers SKIPPED (see llama_build.log)"
  fi
fi

phase "5. benchmark"
QUICK=(--reps-decode 30 --reps-verify 10 --reps-prefill 3 --gen-repeats 2 --llama-reps 3)
[[ ${REPS:-quick} == full ]] && QUICK=()
NCU_S=${NCU_S:-150}
[[ -n ${NCU_MODELS:-} ]] || NCU_S=0
STACK_S=${STACK_S:-120}
[[ -n ${STACK_MODEL:-} ]] || STACK_S=0
left=$(( BUDGET_S - NCU_S - STACK_S - $(elapsed) - 10 ))
# shellcheck disable=SC2086  # BENCH_ARGS: several words on purpose
PYTHONUNBUFFERED=1 python3 bench/bench_gpu.py "${FILES[@]}" --out "$OUT" "${LLAMA_ARGS[@]}" "${QUICK[@]}" \
  --deadline "$left" ${BENCH_ARGS:-}
rc=$?
phase "5. done (bench_gpu.py exit $rc)"

if [[ -n ${NCU_MODELS:-} ]]; then
  phase "6. Nsight Compute, two decode layers: $NCU_MODELS x ${NCU_ENVS:-SPECD_GPU_TC=0}"
  NCU_BIN=$(command -v ncu || find /opt/nvidia /usr/local/cuda* -name ncu -type f 2>/dev/null | head -1)
  for m in $NCU_MODELS; do
    shape=${m%%:*}; ftype=${m#*:}
    read -r _ path < <(model_file "$m")
    [[ -f $path ]] || { echo "ncu: $m was not written (add it to MODELS)"; continue; }
    layers=$(python3 -c "from worker.model_file import open_model as o; print(o('$path').config.n_layers)")
    for e in ${NCU_ENVS:-SPECD_GPU_TC=0}; do
      t=$(( BUDGET_S - $(elapsed) ))
      (( t > 20 )) || { echo "ncu: SKIPPED $m $e: out of time"; continue; }
      csv="$OUT/ncu_${shape}_${ftype}_${e//[^A-Za-z0-9]/_}.csv"
      # the default profiled range: a 64-position fill (1 + 6 kernels per layer), then the
      # decode forward's embedding; -c 12 = its first two layers
      # shellcheck disable=SC2086  # NCU_ARGS: several words on purpose
      env "$e" timeout "$t" "$NCU_BIN" --profile-from-start off --clock-control none --cache-control none \
        -s "${NCU_SKIP:-$(( 2 + 6 * layers ))}" -c "${NCU_COUNT:-12}" --csv --metrics gpu__time_duration.sum,dram__bytes_read.sum,\
smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active \
        python3 tools/device/profile_decode.py "$path" ${NCU_ARGS:-64} >"$csv" 2>&1
      echo "== $m, $e"
      python3 tools/device/ncu_summary.py "$csv" || tail -5 "$csv"
    done
  done
  phase "6. done"
fi

if [[ -n ${STACK_MODEL:-} ]]; then
  phase "7. the stack on cuda:0: $STACK_MODEL"
  read -r _ path < <(model_file "$STACK_MODEL")
  t=$(( BUDGET_S - $(elapsed) ))
  if [[ ! -f $path ]]; then
    echo "stack: $STACK_MODEL was not written (add it to MODELS)"
  elif (( t < 30 )); then
    echo "stack: SKIPPED, out of time"
  else
    # shellcheck disable=SC2086  # STACK_ARGS: several words on purpose
    (cd bench && PYTHONUNBUFFERED=1 timeout "$t" python3 bench_stack.py --device cuda:0 --model "$path" \
      --out "$OUT" ${STACK_ARGS:---levels 1,2,4 --pairs 8 --max-tokens 256}) || echo "stack: bench_stack.py failed"
    phase "7. done"
  fi
fi
exit $rc
