"""What a kernel boundary costs a batch-1 decode step, against a grid barrier in one persistent kernel.

Builds bench/gpu_sync.cu with nvcc and runs it: the bytes of an 8B Q4_K_M decode step (36 layers
of QKV, attention at 64 positions, O, gate/up and down, then the output head: 181 dependent
phases, 4.7 GB) streamed as one kernel per phase (a CUDA graph, with and without programmatic
dependent launch), as one cooperative kernel with a grid barrier between phases, and as that
kernel without the barriers (the floor: the same bytes and reads with nothing waiting). Every
phase reads its whole input per CTA before its sums, as the engine's matrix-vector kernels do.

It answers one question for the engine's decode step (issue 5: the 8B Q4_K_M decode's ~13 us of
gaps per layer): would a persistent kernel's barriers cost less than the launches they replace?
The per-boundary cost is (mode - stream) / (phases - 1).

Prints a table and writes OUT/gpu_<machine>_<date>_sync.json (machine, command, every number).

    python bench/bench_sync.py [--reps 50] [--ctas-per-sm 2] [--arch 90a] [--out bench/results]
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

SOURCE = Path(__file__).resolve().parent / "gpu_sync.cu"
MODES = ("kernels", "kernels+pdl", "barrier", "stream")


def build(arch: str, exe: Path) -> None:
    cmd = ["nvcc", "-O3", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-o", str(exe), str(SOURCE)]
    print("building:", shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def table(res: dict, floor_us: float) -> list[str]:
    """The table's lines: each mode's median and best microseconds a step, its share of the
    bandwidth floor, and what each phase boundary costs over the stream mode."""
    modes, gaps = res["modes"], res["phases"] - 1
    base = modes["stream"]["median_us"]
    lines = [f"{'mode':12} {'median us':>10} {'min us':>9} {'% floor':>8} {'us/boundary':>12}"]
    for name in MODES:
        m = modes[name]
        per = (m["median_us"] - base) / gaps
        lines.append(f"{name:12} {m['median_us']:10.1f} {m['min_us']:9.1f} {100 * floor_us / m['median_us']:7.1f}% "
                     f"{per:12.2f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=50, help="timed steps per mode and round (two rounds)")
    ap.add_argument("--ctas-per-sm", type=int, default=2, help="CTAs of 256 threads per multiprocessor (at most)")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--arch", default="90a", help="nvcc's compute / sm target (default 90a: H100 / H200)")
    ap.add_argument("--bandwidth", type=float, default=None,
                    help="B/s for the floor (default: the device-to-device copy measured now)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "gpu_sync"
        build(args.arch, exe)
        print(f"running {args.reps} x 2 steps per mode ...", flush=True)
        out = subprocess.run([str(exe), str(args.reps), str(args.ctas_per_sm), str(args.layers)], check=True,
                             capture_output=True, text=True).stdout
    res = json.loads(out.strip().splitlines()[-1])
    bw = args.bandwidth or machine.copy_bandwidth()
    floor_us = res["bytes"] / bw * 1e6
    print(f"\n{res['device']}: {res['sms']} SMs, {res['ctas']} CTAs ({res['ctas_per_sm']} per SM), {res['phases']} "
          f"phases, {res['bytes'] / 1e9:.2f} GB a step; floor {floor_us:.0f} us at {bw / 1e12:.2f} TB/s")
    for line in table(res, floor_us):
        print(line)
    gpu = machine.gpu_info()
    name = machine.slug(gpu.get("name", "gpu"))
    now = dt.datetime.now(dt.timezone.utc)
    report = {"date": now.isoformat(timespec="seconds"), "command": shlex.join([sys.executable, *sys.argv]),
              "gpu": gpu, "bandwidth_Bps": bw, "floor_us": floor_us, **res}
    path = Path(args.out) / f"gpu_{name}_{now:%Y%m%d}_sync.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
