"""Decode step (or verify) time against position, per environment variant (tools/device: the
GPU machine).

    python3 tools/device/pos_sweep.py [--n N] [--n-ctx C] [--positions P,P,...] OUT.json MODEL.gguf
        [MODEL.gguf ...] -- "" "SPECD_GPU_DEC_ATTN=0" ...

For each model and each variant ("VAR=VALUE;VAR=VALUE", "" for the defaults; each in its own
process, since the kernels read the environment once), opens the model on cuda:0 with n_ctx C
(default 4200; the decode attention's grid is a block per 256 positions of the context and KV
head, so C matters even at short positions) and times Engine.bench_forward(n, pos, 40) (one
forward of n positions after `pos`: n = 1, the default, a decode step; n = 16 a speculative
verify) for each pos (default 64, 128, 192, 300, 1000 and 4000): the best of 5 medians, in
microseconds. Prints a line per model and variant and writes them all
to OUT.json (a variant given twice keeps both runs: "MODEL [VARIANT] #2"). A variant may point
SPECD_NATIVE_DIR at another build (tools/device/build_base.sh). fwd_variants.py shares the
runner and the results' keys.
"""
import json
import os
import re
import statistics
import subprocess
import sys

POSITIONS = [64, 128, 192, 300, 1000, 4000]
N_CTX = 4200  # the engine's context: the last position plus a verify's rows


def child(path: str, n: int, n_ctx: int, positions: list[int]) -> None:
    from worker.engine import Engine
    from worker.model_file import open_model

    res = {}
    with Engine(open_model(path), device="cuda:0", n_ctx=n_ctx) as eng:
        for p in positions:
            res[p] = min(statistics.median(eng.bench_forward(n, p, 40)) for _ in range(5)) * 1e6
    print("RESULT", json.dumps(res), flush=True)


def run_variants(script: str, models, variants, args, timeout: float):
    """Yields (model, variant, result) for each model and variant: `script --child MODEL *args`
    run in a process of its own with the variant's "VAR=VALUE;VAR=VALUE" added to the
    environment; result is the JSON of the child's "RESULT " line, or {"error": its stderr}."""
    for m in models:
        for v in variants:
            env = dict(os.environ)
            env.update(kv.split("=", 1) for kv in v.split(";") if kv)
            r = subprocess.run([sys.executable, script, "--child", m, *args], env=env, capture_output=True, text=True,
                               timeout=timeout)
            line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
            yield m, v, json.loads(line[0][7:]) if line else {"error": r.stderr[-800:]}


def run_key(results: dict, model: str, variant: str) -> str:
    """The results key of a new run: "MODEL [VARIANT]", then "... #2", "... #3" for repeats."""
    key = f"{model} [{variant}]"
    runs = sum(k == key or k.startswith(key + " #") for k in results)
    return key if runs == 0 else f"{key} #{runs + 1}"


def group_runs(results: dict) -> dict:
    """{model: {variant: [result of each run]}} in the order of the results (failed runs left out)."""
    runs: dict = {}
    for key, res in results.items():
        m = re.fullmatch(r"(.*) \[(.*)\](?: #\d+)?", key)
        if m and "error" not in res:
            runs.setdefault(m[1], {}).setdefault(m[2], []).append(res)
    return runs


def parse(argv: list[str]) -> tuple[int, int, list[int], list[str]]:
    """[--n N] [--n-ctx C] [--positions P,...] REST -> (n, n_ctx, positions, REST); exits with a
    message when n positions after the last one do not fit the context."""
    n, n_ctx, positions = 1, N_CTX, POSITIONS
    while argv and argv[0] in ("--n", "--n-ctx", "--positions") and len(argv) > 1:
        flag, value, argv = argv[0], argv[1], argv[2:]
        if flag == "--n":
            n = int(value)
        elif flag == "--n-ctx":
            n_ctx = int(value)
        else:
            positions = [int(p) for p in value.split(",") if p]
    if not positions or min(positions) < 0 or not 1 <= n <= n_ctx - 8 - max(positions):
        sys.exit(f"pos_sweep: --n {n} after positions {positions} does not fit the context of {n_ctx} "
                 f"(8 positions spare)")
    return n, n_ctx, positions, argv


def main() -> None:
    if sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), [int(p) for p in sys.argv[5].split(",")])
        return
    n, n_ctx, positions, args = parse(sys.argv[1:])
    out, split = args[0], args.index("--")
    models, variants = args[1:split], args[split + 1 :]
    results = {}
    child_args = [str(n), str(n_ctx), ",".join(map(str, positions))]
    for m, v, res in run_variants(__file__, models, variants, child_args, timeout=200):
        results[run_key(results, os.path.basename(m), v)] = res
        cells = " ".join(f"{p}:{x:.1f}" if isinstance(x, float) else f"{p}:{x}" for p, x in res.items())
        print(os.path.basename(m), v or "default", cells, flush=True)
    with open(out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "unit": f"us per forward of {n} position(s)", "n": n,
                   "n_ctx": n_ctx, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
