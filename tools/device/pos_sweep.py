"""Decode step time against position, per environment variant (tools/device: the GPU machine).

    python3 tools/device/pos_sweep.py OUT.json MODEL.gguf [MODEL.gguf ...] -- "" "SPECD_GPU_DEC_ATTN=0" ...

For each model and each variant ("VAR=VALUE;VAR=VALUE", "" for the defaults; each in its own
process, since the kernels read the environment once), opens the model on cuda:0 with n_ctx
4200 and times Engine.bench_forward(1, pos, 40) (one decode forward after `pos` positions) for
pos in 64, 128, 192, 300, 1000 and 4000: the best of 5 medians, in microseconds. Prints a line per model
and variant and writes them all to OUT.json.
"""
import json
import os
import statistics
import subprocess
import sys

POSITIONS = [64, 128, 192, 300, 1000, 4000]


def child(path: str) -> None:
    from worker.engine import Engine
    from worker.model_file import open_model

    res = {}
    with Engine(open_model(path), device="cuda:0", n_ctx=4200) as eng:
        for p in POSITIONS:
            res[p] = min(statistics.median(eng.bench_forward(1, p, 40)) for _ in range(5)) * 1e6
    print("RESULT", json.dumps(res), flush=True)


def main() -> None:
    if sys.argv[1] == "--child":
        child(sys.argv[2])
        return
    out, split = sys.argv[1], sys.argv.index("--")
    models, variants = sys.argv[2:split], sys.argv[split + 1 :]
    results = {}
    for m in models:
        for v in variants:
            env = dict(os.environ)
            env.update(kv.split("=", 1) for kv in v.split(";") if kv)
            r = subprocess.run([sys.executable, __file__, "--child", m], env=env, capture_output=True, text=True,
                               timeout=200)
            line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
            res = json.loads(line[0][7:]) if line else {"error": r.stderr[-800:]}
            results[f"{os.path.basename(m)} [{v}]"] = res
            cells = " ".join(f"{p}:{x:.1f}" if isinstance(x, float) else f"{p}:{x}" for p, x in res.items())
            print(os.path.basename(m), v or "default", cells, flush=True)
    with open(out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "unit": "us per decode step", "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
