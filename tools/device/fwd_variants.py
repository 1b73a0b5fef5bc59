"""Forward times of one, 16 and 8 positions (a decode step, speculative verifies) per model and
environment variant, side by side in one device call (tools/device: the GPU machine).

    python3 tools/device/fwd_variants.py OUT.json MODEL.gguf [MODEL.gguf ...] -- "" "SPECD_GPU_MMA_WARPS=8" ...

Each variant ("VAR=VALUE;VAR=VALUE", "" for the defaults; SPECD_NATIVE_DIR=<build_base.sh's
build> for the code before a change) runs in its own process, since the kernels read the
environment once: the model opened on cuda:0 with n_ctx 256, Engine.bench_forward(n, 64, reps)
for n = 1 (40 reps), 16 and 8 (15 reps), the best of 3 medians, in microseconds. Prints a line
per model and variant (with n = 16 and 8 in decode steps) and writes them all to OUT.json (a
variant given twice, to see the noise, keeps both runs: "MODEL [VARIANT] #2").
"""
import json
import os
import statistics
import sys

from pos_sweep import run_variants  # (this folder: sys.path[0] when run as a script)

RUNS = ((1, 40), (16, 15), (8, 15))  # (positions, reps)


def child(path: str) -> None:
    from worker.engine import Engine
    from worker.model_file import open_model

    res = {}
    with Engine(open_model(path), device="cuda:0", n_ctx=256) as eng:
        for n, reps in RUNS:
            res[n] = min(statistics.median(eng.bench_forward(n, 64, reps)) for _ in range(3)) * 1e6
    print("RESULT", json.dumps(res), flush=True)


def main() -> None:
    if sys.argv[1] == "--child":
        child(sys.argv[2])
        return
    out, args = sys.argv[1], sys.argv[2:]
    split = args.index("--")
    models, variants = args[:split], args[split + 1:]
    results = {}
    for m, v, res in run_variants(__file__, models, variants, [], timeout=300):
        key = f"{os.path.basename(m)} [{v}]"
        runs = sum(k == key or k.startswith(key + " #") for k in results)
        results[key if runs == 0 else f"{key} #{runs + 1}"] = res  # (a variant given twice: both runs)
        if "error" in res:
            print(os.path.basename(m), v or "default", res, flush=True)
            continue
        cells = " ".join(f"fwd{n} {res[str(n)]:8.1f}" + (f" ({res[str(n)] / res['1']:.2f})" if n > 1 else "")
                         for n, _ in RUNS)
        print(f"{os.path.basename(m):32s} {v or 'default':28s} {cells}", flush=True)
    with open(out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "unit": "us per forward after 64 positions", "results": results}, f,
                  indent=1)


if __name__ == "__main__":
    main()
