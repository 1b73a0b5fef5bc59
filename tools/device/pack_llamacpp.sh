#!/usr/bin/env bash
# Packs a stripped llama.cpp source tree for a CUDA build of llama-bench on the GPU machine.
#
# Runs HERE (a machine with the package registry): takes the llama.cpp sources vendored in the
# PyPI sdist of llama-cpp-python (the registry is the one source we may fetch from), keeps only
# what `cmake --build --target llama-bench` with GGML_CUDA=ON needs (ggml core + ggml-cpu +
# ggml-cuda, src, common, vendor/{nlohmann,sheredom,cpp-httplib}, tools/llama-bench, cmake
# files), replaces tools/ and vendor/ CMakeLists with ones that add only those, and writes
# .device/llama.cpp-<ver>.tar.gz (~ 6 MB; /.device/ is git-excluded and carried by the lead).
# With --check it also configures and builds llama-bench for the CPU backend here, proving
# nothing needed was stripped (CUDA cannot be built here: no GPU toolkit libraries to link).
#
#   tools/device/pack_llamacpp.sh [--check]          (LLAMACPP_PY_VERSION=0.3.36 by default)
set -euo pipefail

VER=${LLAMACPP_PY_VERSION:-0.3.36}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUTDIR=$ROOT/.device
WORK=${TMPDIR:-/tmp}/specd-llamacpp-pack
ARCHIVE=$OUTDIR/llama.cpp-$VER.tar.gz
mkdir -p "$WORK" "$OUTDIR"

sdist=$WORK/llama_cpp_python-$VER.tar.gz
if [[ ! -f $sdist ]]; then
  python3 -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VER" -d "$WORK"
fi
rm -rf "$WORK/src" && mkdir -p "$WORK/src"
tar xzf "$sdist" -C "$WORK/src" "llama_cpp_python-$VER/vendor/llama.cpp"
FULL=$WORK/src/llama_cpp_python-$VER/vendor/llama.cpp

DST=$WORK/llama.cpp
rm -rf "$DST" && mkdir -p "$DST"
keep() { for p in "$@"; do mkdir -p "$DST/$(dirname "$p")"; cp -a "$FULL/$p" "$DST/$p"; done; }

keep CMakeLists.txt LICENSE cmake include licenses src common tools/llama-bench \
     vendor/nlohmann vendor/sheredom vendor/cpp-httplib \
     ggml/CMakeLists.txt ggml/cmake ggml/include ggml/src/ggml-cpu ggml/src/ggml-cuda
# ggml/src: the core files (every plain file) and the two backends above
find "$FULL/ggml/src" -maxdepth 1 -type f -exec cp -a {} "$DST/ggml/src/" \;
# the CUDA backend's HIP/MUSA siblings and the CPU backend's other-ISA trees are not needed on x86-64
rm -rf "$DST/ggml/src/ggml-cpu/spacemit" "$DST/ggml/src/ggml-cpu/kleidiai"
for a in arm loongarch powerpc riscv s390 wasm; do rm -rf "$DST/ggml/src/ggml-cpu/arch/$a"; done

# Only the subdirectories llama-bench needs (the originals add every tool and vendored library).
cat > "$DST/tools/CMakeLists.txt" <<'CM'
# specd's stripped tree: llama-bench only (see tools/device/pack_llamacpp.sh)
find_package(Threads REQUIRED)
llama_add_compile_flags()
add_subdirectory(llama-bench)
CM
cat > "$DST/vendor/CMakeLists.txt" <<'CM'
# specd's stripped tree: what llama-common links (see tools/device/pack_llamacpp.sh)
add_subdirectory(nlohmann)
add_subdirectory(sheredom)
if (LLAMA_BUILD_COMMON)
    add_subdirectory(cpp-httplib)
endif()
CM
echo "llama-cpp-python $VER sdist, vendor/llama.cpp, stripped by specd tools/device/pack_llamacpp.sh" > "$DST/SPECD_STRIPPED"

tar czf "$ARCHIVE" -C "$WORK" llama.cpp
echo "wrote $ARCHIVE ($(du -h "$ARCHIVE" | cut -f1))"

if [[ ${1:-} == --check ]]; then
  # Same options as build_llamacpp.sh, CPU backend instead of CUDA.
  CHK=$WORK/check && rm -rf "$CHK" && mkdir -p "$CHK" && tar xzf "$ARCHIVE" -C "$CHK"
  cmake -S "$CHK/llama.cpp" -B "$CHK/build" -DGGML_CUDA=OFF -DGGML_NATIVE=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
        -DLLAMA_BUILD_TOOLS=ON -DBUILD_SHARED_LIBS=OFF -DCMAKE_BUILD_TYPE=Release
  cmake --build "$CHK/build" -j"$(nproc)" --target llama-bench
  "$CHK/build/bin/llama-bench" --help >/dev/null && echo "llama-bench runs: $CHK/build/bin/llama-bench"
fi
