"""Decode forwards of one model under Nsight Compute (tools/device: run on the GPU machine).

    ncu --profile-from-start off --clock-control none --cache-control none -c 16 --csv \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,smsp__issue_active.avg.pct_of_peak_sustained_active \
        python3 tools/device/profile_decode.py MODEL.gguf [POS0 [N]] > run.csv
    python3 tools/device/ncu_summary.py run.csv

Opens MODEL on cuda:0, runs one decode forward after POS0 (default 64) positions unprofiled
(filling the cache, capturing the graph), then the profiled range: one more fill of POS0
positions without logits (ncu's -s skips its kernels when asked: 1 + 6 per layer at short
contexts) and two one-position forwards (Engine.bench_forward(1, POS0, 1): a warm-up and the
timed one), the decode step bench_gpu.py times; with N, two N-position forwards instead (N = 512,
POS0 = 0: bench_gpu.py's prefill). The environment picks the kernels
(SPECD_GPU_TC=...). The range is opened with cuProfilerStart, so ncu needs
--profile-from-start off; without ncu the script just runs.
"""
import ctypes
import sys

from worker.engine import Engine
from worker.model_file import open_model


def _profiler(name: str) -> None:
    try:
        getattr(ctypes.CDLL("libcuda.so.1"), name)()
    except (OSError, AttributeError) as exc:  # no driver library: nothing to profile
        print(f"{name}: {exc}", file=sys.stderr)


def main() -> None:
    path = sys.argv[1]
    pos0 = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    with Engine(open_model(path), device="cuda:0", n_ctx=max(256, pos0 + n + 8)) as eng:
        print("n_layers:", eng.model.config.n_layers, flush=True)
        eng.bench_forward(n, pos0, 1)
        _profiler("cuProfilerStart")
        secs = eng.bench_forward(n, pos0, 1)
        _profiler("cuProfilerStop")
        print("forward seconds (profiled):", secs, flush=True)


if __name__ == "__main__":
    main()
