"""Runs the scaled-weights design probe (bench/mma_scaled_a.cu) on the 8B's Q4_K verify shapes.

The probe is a Q4_K reader for 16 rows of x whose sub-block scales are applied on the weight
side as integers, so that a 256-element super-block ends in one float epilogue per output
(bench/results/sass_mix_scaled-a_20261208.md). The engine does not use it. This builds it with
nvcc as a standalone program and, per shape, reports:

* host (no GPU): the probe's arithmetic replayed on the CPU, against a float64 reference of the
  same weights and x on the same grids (max error / max output, over the first 512 rows), and
  whether any of its 32-bit integers would overflow, on random data and on the extreme case
  the bounds allow;
* the same replayed the decode way (sum_j sc_j S_(t,j) from dp4a-sized sums, sum_j mn_j T_j
  whole): its outputs must equal the verify's bit for bit, or speculation would not be exact;
* with --gpu: the verify kernel's outputs against the replay (bit for bit) and the reference,
  the decode kernel's (`sa_decode_kernel`, one row of x at a time) against the verify
  kernel's (bit for bit, every output), and both kernels' times (median of --reps launches)
  and weight bandwidth.

To compare with the engine, time the engine's verify on the same device in the same call,
e.g. `tools/device/trace_decode.py MODEL --n 16` (its gate/up, wo and QKV launches).

    python3 bench/bench_scaled_a.py [--gpu] [--reps 50] [--arch 90a] [--out bench/results]

Shapes (K, rows): Qwen3-8B's gate/up (4096, 2 x 12288), wo (4096, 4096), Q and K (4096, 5120).
The down projection (K = 12288) is left out: the probe keeps all of x's image in shared memory.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402
from sass_mix import NVCC_FLAGS, find_nvcc  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SOURCE = Path(__file__).resolve().parent / "mma_scaled_a.cu"
SHAPES = {"gate/up": (4096, 24576), "wo": (4096, 4096), "q+k": (4096, 5120)}


def build(arch: str, exe: Path, warps: int = 16) -> list[str]:
    """The probe as a program (the engine's flags); returns the command."""
    cmd = [find_nvcc(), *NVCC_FLAGS, f"-DSA_WARPS={warps}", f"-gencode=arch=compute_{arch},code=sm_{arch}", f"-I{ROOT / 'worker' / 'kernels'}",
           f"-I{ROOT / 'worker'}", "-o", str(exe), str(SOURCE)]
    print("building:", shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return cmd


def run(exe: Path, mode: str, k: int, n_out: int, reps: int) -> dict:
    """One run of the program: its JSON line."""
    out = subprocess.run([str(exe), mode, str(k), str(n_out), str(reps)], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", action="store_true", help="also run and time the kernel (needs a CUDA device)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--arch", default="90a", help="nvcc's compute / sm target (default 90a: H100 / H200)")
    ap.add_argument("--warps", type=int, default=16, help="warps per CTA: 16 (128 registers) or 8")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "mma_scaled_a"
        cmd = build(args.arch, exe, args.warps)
        for name, (k, n_out) in SHAPES.items():
            print(f"{name}: K {k}, {n_out} rows ...", flush=True)
            r = run(exe, "gpu" if args.gpu else "host", k, n_out, args.reps)
            rows.append({"shape": name, **r})

    print(f"\n{'shape':8} {'K':>6} {'rows':>6} {'replay err':>11} {'extreme err':>12} {'overflow':>9} {'dec-replay!=':>8}"
          + (f" {'kernel err':>11} {'!=replay':>8} {'us':>8} {'GB/s':>7} {'dec us':>8} {'dec GB/s':>9} {'dec!=ver':>6}"
             if args.gpu else ""))
    for r in rows:
        line = (f"{r['shape']:8} {r['K']:>6} {r['n_out']:>6} {r['replay_rel_err']:>11.2e} {r['extreme_rel_err']:>12.2e} "
                f"{str(r['int32_overflow'] or r['extreme_int32_overflow']):>9} {r['decode_replay_unlike']:>8}")
        if args.gpu:
            line += (f" {r['kernel_rel_err']:>11.2e} {r['outputs_unlike_replay']:>8} {r['median_us']:>8.2f} "
                     f"{r['weight_gb_s']:>7.1f} {r['decode_median_us']:>8.2f} {r['decode_weight_gb_s']:>9.1f} "
                     f"{r['decode_unlike_verify']:>6}")
        print(line)
    print("(err: max |output - float64 reference| / max |reference|; extreme: every q, scale and minimum at its "
          "largest, every digit of x +-2^22; dec-replay!=: outputs of the decode-way replay whose bits differ from the "
          "verify's; !=replay / dec!=ver: the verify kernel's against the replay, the decode kernel's against the verify "
          "kernel's)")

    date = dt.date.today().isoformat()
    dev = machine.slug(rows[0].get("device", "cpu")) if rows else "cpu"
    out = Path(args.out) / f"scaled_a_{dev}_{date.replace('-', '')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": date, "command": "python3 " + shlex.join(sys.argv), "build": shlex.join(cmd),
                               "machine": machine.cpu_name(), "gpu": machine.gpu_info() if args.gpu else {},
                               "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    bad = [r["shape"] for r in rows if r["int32_overflow"] or r["extreme_int32_overflow"] or r["decode_replay_unlike"]
           or (args.gpu and (r["outputs_unlike_replay"] or r["decode_unlike_verify"]))]
    if bad:
        print(f"bench_scaled_a: FAILED on {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
