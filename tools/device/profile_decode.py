"""One model's decode forwards under a profiler (tools/device: run on the GPU machine).

    ncu --clock-control none -c 16 -s 8 --csv --metrics gpu__time_duration.sum,dram__bytes_read.sum \
        python3 tools/device/profile_decode.py MODEL.gguf [REPS]

Opens MODEL on cuda:0 and runs REPS (default 3) one-position forwards after 64 positions
(Engine.bench_forward(1, 64)), the decode step bench_gpu.py times; the environment picks the
kernels (SPECD_GPU_TC=...). Prints the seconds of each forward (under a profiler they measure
the profiler).
"""
import sys

from worker.engine import Engine
from worker.model_file import open_model


def main() -> None:
    path = sys.argv[1]
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    with Engine(open_model(path), device="cuda:0", n_ctx=256) as eng:
        print("forward seconds:", eng.bench_forward(1, 64, reps), flush=True)


if __name__ == "__main__":
    main()
