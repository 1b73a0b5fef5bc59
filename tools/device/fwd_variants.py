"""Forward times of one, 16 and 8 positions (a decode step, speculative verifies) per model and
environment variant, side by side in one device call (tools/device: the GPU machine).

    python3 tools/device/fwd_variants.py OUT.json MODEL.gguf [MODEL.gguf ...] -- "" "SPECD_GPU_MMA_WARPS=8" ...

Each variant ("VAR=VALUE;VAR=VALUE", "" for the defaults; SPECD_NATIVE_DIR=<build_base.sh's
build> for the code before a change) runs in its own process, since the kernels read the
environment once: the model opened on cuda:0 with n_ctx 256 (FWD_N_CTX=C, in the environment or
as a variant, sets another: the decode attention's grid grows with it), Engine.bench_forward(n, 64, reps)
for n = 1 (40 reps), 16 and 8 (15 reps), the best of 3 medians, in microseconds. Prints a line
per model and variant (with n = 16 and 8 in decode steps) and writes them all to OUT.json (a
variant given twice, to see the noise, keeps both runs: "MODEL [VARIANT] #2").

    python3 tools/device/fwd_variants.py --plot OUT.json OUT.png

draws a stored result (off the device: matplotlib): per model, the 1- and 16-position forwards
of each variant (the mean of its runs) as % of the model's first variant; the JSON's optional
"labels" ({variant: name}) name the bars.
"""
import json
import os
import statistics
import sys

from pos_sweep import group_runs, run_key, run_variants  # (this folder: sys.path[0] when run as a script)

RUNS = ((1, 40), (16, 15), (8, 15))  # (positions, reps)


def child(path: str) -> None:
    from worker.engine import Engine
    from worker.model_file import open_model

    res = {}
    with Engine(open_model(path), device="cuda:0", n_ctx=int(os.environ.get("FWD_N_CTX", "256"))) as eng:
        for n, reps in RUNS:
            res[n] = min(statistics.median(eng.bench_forward(n, 64, reps)) for _ in range(3)) * 1e6
    print("RESULT", json.dumps(res), flush=True)


def plot(path: str, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        data = json.load(f)
    labels = data.get("labels", {})
    runs = group_runs(data["results"])
    models = list(runs)
    variants = list(dict.fromkeys(v for m in models for v in runs[m]))
    width = 0.8 / len(variants)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, n in zip(axes, ("1", "16")):
        ref = {m: statistics.mean(r[n] for r in next(iter(runs[m].values()))) for m in models}  # first variant
        every = []
        for j, v in enumerate(variants):
            xs, ys = [], []
            for i, m in enumerate(models):
                if v in runs[m]:
                    xs.append(i + j * width)
                    ys.append(100 * statistics.mean(r[n] for r in runs[m][v]) / ref[m])
            every += ys
            ax.bar(xs, ys, width=0.95 * width, label=labels.get(v, v or "default"))
            for x, y in zip(xs, ys):
                ax.text(x, y, f"{y:.1f}", ha="center", va="bottom", fontsize=7)
        ax.set_ylim(min(every) - 5, max(every) + 3)
        ax.set_xticks([i + width * (len(variants) - 1) / 2 for i in range(len(models))],
                      [m.replace(".random.gguf", "") for m in models], fontsize=8)
        ax.set_title(("decode step" if n == "1" else f"forward of {n} positions") + ", % of the first variant",
                     fontsize=9)
    axes[1].legend(fontsize=7, loc="lower left")
    fig.suptitle(os.path.basename(path) + " (H200, every variant in one call)", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    if sys.argv[1] == "--child":
        child(sys.argv[2])
        return
    if sys.argv[1] == "--plot":
        plot(sys.argv[2], sys.argv[3])
        return
    out, args = sys.argv[1], sys.argv[2:]
    split = args.index("--")
    models, variants = args[:split], args[split + 1:]
    results = {}
    for m, v, res in run_variants(__file__, models, variants, [], timeout=300):
        results[run_key(results, os.path.basename(m), v)] = res
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
