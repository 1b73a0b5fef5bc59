#!/usr/bin/env bash
# A change measured side by side with the code before it, in one device call (tools/device: the
# GPU machine, from the repo root; carry .whl, from tools/device/stack_wheels.sh, and .device).
#
#   off the device:  git diff BASE -- worker > .device/base.patch
#   on the device:   OUT=$OUT bash tools/device/ab_call.sh [VARIANT ...]
#
# Steps, each under its own timeout, logged with the seconds since the start:
#   1. the carried wheels into /tmp/site (PYTHONPATH);
#   2. at once: the models ($MODELS: tools/gen_gguf.py's "shape TYPE" pairs, default the 8B Q4_K_M
#      and the 0.6B Q8_0 / Q4_K_M) into /dev/shm/m; the base (tools/device/build_base.sh with
#      .device/base.patch, in /tmp/base); the working tree (build/dev-gpu); with TRACE=1 a trace
#      build of it (build/dev-trace); and the EXTRA builds, each "NAME:CUDAFLAGS" (the working
#      tree with those flags, build/dev-NAME) or "NAME:@PATCH" (the working tree with PATCH, a
#      path from the repo root such as .device/x.patch, applied in a copy: $AB_TMP/NAME, its
#      build in $AB_TMP/NAME/build/dev-NAME; AB_TMP defaults to /tmp); the cores are shared
#      between the builds;
#   3. unless TESTS is empty: pytest -q -x $TESTS (default tests/gpu) on the working tree's build;
#   4. tools/device/fwd_variants.py $OUT/ab.json over the models: the base, the working tree, then
#      each VARIANT ("VAR=VALUE;VAR=VALUE" for the working tree's build with those settings,
#      "build:NAME" for the EXTRA build NAME, "build:NAME;VAR=VALUE;..." that build with those
#      settings); REPEAT=1 runs the base and the working tree twice, to show the noise; FWD=0
#      skips this step (a call that only sweeps positions or traces);
#   4b. with POSITIONS ("64,1000,4000"): tools/device/pos_sweep.py $OUT/ab-pos.json, the same
#      variants' decode steps after each of those positions (n_ctx: the last one + 200); with
#      SWEEP_N (e.g. 16) forwards of that many positions instead (a speculative verify);
#      SWEEP_N="1,16" sweeps both, the first into ab-pos.json, the next into ab-pos-n16.json;
#   5. with TRACE=1: tools/device/trace_decode.py on the first model, one position and 16
#      ($OUT/trace-n1.json, $OUT/trace-n16.json); with TRACE_POS ("64,1000,4000") instead one
#      position after each of those, on the tree's trace build and on a trace build of the base
#      (/tmp/tbase; $OUT/trace-base-pP.json, $OUT/trace-tree-pP.json; n_ctx as POSITIONS'), and
#      with TRACE_ENV ("VAR=VALUE ...") the tree's trace once more per setting
#      ($OUT/trace-tree-VAR-VALUE-pP.json).
# Builds keep their logs in /tmp/build-NAME.log (the last lines of a failed one are printed).
# The whole run stays within the device's 600 s a call only with few models and variants: about
# 75 s to build, 60 s of tests, ~10 s per 0.6B variant and ~25 s per 8B one, ~15 s per trace.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
: "${OUT:?set OUT to the folder the results go to}"
AB_TMP="${AB_TMP:-/tmp}"
T0=$(date +%s)
say() { echo "[ab_call t=$(($(date +%s) - T0))s] $*"; }

python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SPECD_NATIVE_DIR=$PWD/build/dev-gpu
read -r -a models <<< "${MODELS:-qwen3-8b Q4_K_M qwen3-0.6b Q8_0 qwen3-0.6b Q4_K_M}"
paths=()
for ((i = 0; i + 1 < ${#models[@]}; i += 2)); do paths+=("/dev/shm/m/${models[i]}-${models[i + 1]}.random.gguf"); done
read -r -a extra <<< "${EXTRA:-}"
trace_base=0
[ "${TRACE:-0}" = 1 ] && [ -n "${TRACE_POS:-}" ] && trace_base=1
builds=$((2 + ${TRACE:-0} + trace_base + ${#extra[@]}))
# the context for POSITIONS / TRACE_POS: their largest + 200
last_pos=$(tr ',' '\n' <<< "${POSITIONS:-},${TRACE_POS:-},0" | grep -v '^$' | sort -n | tail -1)
n_ctx=$((last_pos + 200))
jobs=$(( $(nproc) / builds > 1 ? $(nproc) / builds : 1 ))

build() {  # NAME CUDAFLAGS: the tree in the current folder into build/dev-NAME
  CUDAFLAGS="$2" SPECD_BACKEND=cuda SPECD_CUDA_ARCHITECTURES=90a-real JOBS=$jobs \
    timeout 300 bash tools/dev_build.sh "$1" > "/tmp/build-$1.log" 2>&1 ||
    { tail -20 "/tmp/build-$1.log"; echo "ab_call: build $1 failed"; }
}
copy_patched() {  # NAME PATCH: a copy of the working tree with PATCH applied, in $AB_TMP/NAME
  local dir="$AB_TMP/$1"
  command -v patch > /dev/null || { echo "ab_call: build $1 needs the patch program (apt-get install patch)"; return 1; }
  rm -rf "$dir" && mkdir -p "$dir" && tar --exclude=./build --exclude=./.git -cf - . | tar -xf - -C "$dir" &&
    patch -s -p1 -d "$dir" < "$2" || { echo "ab_call: $2 does not apply to the working tree"; return 1; }
}
say "models ${models[*]}; $builds builds of $jobs jobs"
# The copies of the tree (the patched EXTRA builds here, build_base.sh's) must not see "." change
# while tar reads it (tar then exits 1: "file changed as we read it"): build/ exists before the
# builds start, and the patched copies are made before them.
mkdir -p build
declare -A where=() flags=()  # EXTRA build NAME -> the folder holding its build/dev-NAME; CUDAFLAGS of those to build
for e in "${extra[@]}"; do
  name="${e%%:*}" spec="${e#*:}"
  if [[ "$spec" == @* ]]; then
    where[$name]="$AB_TMP/$name"
    copy_patched "$name" "${spec#@}" && flags[$name]=""
  else
    where[$name]="$PWD" flags[$name]="$spec"
  fi
done
build_base() {  # DIR CUDAFLAGS: the base (build_base.sh with .device/base.patch) in DIR/build/dev-base
  local log="/tmp/build-$(basename "$1").log"
  (CUDAFLAGS="$2" JOBS=$jobs timeout 300 bash tools/device/build_base.sh .device/base.patch "$1" > "$log" 2>&1 ||
    { tail -20 "$log"; echo "ab_call: the base build in $1 failed"; }) &
}
timeout 240 python3 tools/gen_gguf.py -q -o /dev/shm/m "${models[@]}" > /tmp/gen.log 2>&1 &
build_base /tmp/base "${CUDAFLAGS:-}"
[ $trace_base = 1 ] && build_base /tmp/tbase "-DSPECD_GPU_TRACE=1"
build gpu "" &
[ "${TRACE:-0}" = 1 ] && build trace "-DSPECD_GPU_TRACE=1" &
for name in "${!flags[@]}"; do
  (cd "${where[$name]}" && build "$name" "${flags[$name]}") &
done
wait
say "built"

if [ -n "${TESTS-tests/gpu}" ]; then
  read -r -a tests <<< "${TESTS-tests/gpu}"
  timeout 200 python3 -m pytest -q -x "${tests[@]}" 2>&1 | tail -3
  say "tested"
fi

variants=("SPECD_NATIVE_DIR=/tmp/base/build/dev-base" "")
[ "${REPEAT:-0}" = 1 ] && variants+=("SPECD_NATIVE_DIR=/tmp/base/build/dev-base" "")
for v in "$@"; do
  if [[ "$v" == build:* ]]; then
    name="${v#build:}" settings=""
    [[ "$name" == *";"* ]] && settings=";${name#*;}" name="${name%%;*}"
    variants+=("SPECD_NATIVE_DIR=${where[$name]:-$PWD}/build/dev-$name$settings")
  else
    variants+=("$v")
  fi
done
if [ "${FWD:-1}" != 0 ]; then
  timeout 300 python3 tools/device/fwd_variants.py "$OUT/ab.json" "${paths[@]}" -- "${variants[@]}" 2>&1 |
    grep -E "fwd1|Error|error"
  say "forwards timed"
fi

if [ -n "${POSITIONS:-}" ]; then
  sweeps=${SWEEP_N:-1}  # (default: decode steps)
  first=1
  for sweep_n in ${sweeps//,/ }; do
    pos_json=$OUT/ab-pos.json  # the first sweep's; the others' are named after their n
    [ $first = 1 ] || pos_json=$OUT/ab-pos-n$sweep_n.json
    first=0
    timeout 300 python3 tools/device/pos_sweep.py --n "$sweep_n" --positions "$POSITIONS" --n-ctx "$n_ctx" "$pos_json" \
      "${paths[@]}" -- "${variants[@]}" 2>&1 | grep -v "^RESULT"
    say "positions swept, $sweep_n a forward"
  done
fi

if [ $trace_base = 1 ]; then
  read -r -a trace_env <<< "${TRACE_ENV:-}"
  for p in ${TRACE_POS//,/ }; do
    for b in base tree "${trace_env[@]}"; do
      dir=$PWD/build/dev-trace name=$b set=()
      [ $b = base ] && dir=/tmp/tbase/build/dev-base
      [[ $b == *=* ]] && name="tree-${b//=/-}" set=("$b")
      env "${set[@]}" SPECD_NATIVE_DIR=$dir timeout 90 python3 tools/device/trace_decode.py "${paths[0]}" --pos0 "$p" \
        --n-ctx "$n_ctx" --json "$OUT/trace-$name-p$p.json" 2>&1 | grep -E "attn|forward"
    done
  done
  say "traced"
elif [ "${TRACE:-0}" = 1 ]; then
  for n in 1 16; do
    SPECD_NATIVE_DIR=$PWD/build/dev-trace timeout 90 python3 tools/device/trace_decode.py "${paths[0]}" --n $n \
      --json "$OUT/trace-n$n.json" 2>&1 | tail -14
  done
  say "traced"
fi
