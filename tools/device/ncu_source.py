"""Where a kernel's instructions and stalls go, per SASS opcode, from Nsight Compute's source page
(tools/device: run anywhere on the CSV the GPU machine wrote).

    ncu ... --section SourceCounters -o prof python3 tools/device/profile_decode.py MODEL 0 16
    ncu -i prof.ncu-rep --page source --print-source sass --csv > src.csv   # (gzip it to carry)
    python3 tools/device/ncu_source.py src.csv[.gz] [--kernel REGEX] [--nth N] [--per IMMA] [--top 20]

The export holds one block per profiled launch: a "Kernel Name" line, a header, then one row per
SASS instruction with its executed count ("Instructions Executed", warp instructions) and its
warp-stall samples. This prints, for the N-th launch (from 0) whose name matches REGEX: the
launch's executed instructions and stall samples, then per opcode (its first dotted part: IMMA,
FFMA, LOP3 ...) the executed count, its share, its count per executed --per instruction (an
IMMA by default: "how many instructions does each MMA cost"), and its share of the stall
samples; then the --top instructions by stall samples (the wait for a load shows as the first
instruction that reads it). --keep FILE writes the launch's rows with the columns this reads
(a smaller CSV for bench/results).
"""
from __future__ import annotations

import argparse
import csv
import gzip
import io
import re
import sys
from collections import Counter
from dataclasses import dataclass

EXECUTED = "Instructions Executed"
STALLS = "Warp Stall Sampling (All Samples)"
KEEP = ["Address", "Source", STALLS, EXECUTED]


@dataclass
class Launch:
    name: str
    rows: list[dict[str, str]]


def read_launches(path: str) -> list[Launch]:
    """The export's launches in order (a gzip file is read as such)."""
    raw = gzip.open(path, "rt", newline="") if path.endswith(".gz") else open(path, newline="")
    with raw as f:
        lines = f.read().splitlines()
    launches: list[Launch] = []
    i = 0
    while i < len(lines):
        if not lines[i].startswith('"Kernel Name"'):
            i += 1
            continue
        name = next(csv.reader([lines[i]]))[1]
        j = i + 1
        while j < len(lines) and not lines[j].startswith('"Kernel Name"'):
            j += 1
        rows = list(csv.DictReader(io.StringIO("\n".join(lines[i + 1:j]))))
        launches.append(Launch(name, rows))
        i = j
    return launches


def opcode(source: str) -> str:
    """The opcode of a SASS line without its modifiers or predicate: "@P0 LOP3.LUT R1, ..." -> LOP3."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def count(value: str) -> int:
    return int(float(value.replace(",", ""))) if value and value != "-" else 0


def summary(launch: Launch, per: str = "IMMA", top: int = 20) -> list[str]:
    executed: Counter[str] = Counter()
    stalls: Counter[str] = Counter()
    for r in launch.rows:
        op = opcode(r["Source"])
        executed[op] += count(r[EXECUTED])
        stalls[op] += count(r[STALLS])
    total, total_st = sum(executed.values()), sum(stalls.values())
    ref = executed.get(per, 0)
    out = [launch.name, f"executed {total} warp instructions, {total_st} stall samples"
           + (f", {total / ref:.1f} per {per}" if ref else f", no {per}")]
    out.append(f"{'opcode':<10} {'executed':>12} {'share':>6} {'per ' + per:>10} {'stalls':>7}")
    for op, n in executed.most_common():
        if n == 0:
            continue
        per_ref = f"{n / ref:10.2f}" if ref else f"{'-':>10}"
        out.append(f"{op:<10} {n:12d} {100 * n / total:5.1f}% {per_ref} {100 * stalls[op] / max(total_st, 1):6.1f}%")
    hot = sorted(launch.rows, key=lambda r: count(r[STALLS]), reverse=True)[:top]
    out.append(f"top {len(hot)} instructions by stall samples (samples, executed, source):")
    out.extend(f"{count(r[STALLS]):7d} {count(r[EXECUTED]):10d}  {r['Source'].strip()}" for r in hot)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--kernel", default=".", help="regex on the launch's name (default: any)")
    ap.add_argument("--nth", type=int, default=0, help="which matching launch, from 0")
    ap.add_argument("--per", default="IMMA", help="the opcode to count the others against")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--list", action="store_true", help="only list the launches")
    ap.add_argument("--keep", help="write the chosen launch's rows (Kernel Name line and the columns read) here")
    a = ap.parse_args(argv)
    launches = read_launches(a.csv)
    if a.list:
        for i, ln in enumerate(launches):
            print(f"{i:3d} {len(ln.rows):6d} rows  {ln.name}")
        return 0
    chosen = [ln for ln in launches if re.search(a.kernel, ln.name)]
    if a.nth >= len(chosen):
        print(f"ncu_source: {len(chosen)} launches match {a.kernel!r}; --nth {a.nth} is past them", file=sys.stderr)
        return 1
    launch = chosen[a.nth]
    missing = [c for c in KEEP if launch.rows and c not in launch.rows[0]]
    if not launch.rows or missing:
        print(f"ncu_source: the launch has no rows or lacks columns {missing} (was SourceCounters collected?)",
              file=sys.stderr)
        return 1
    print("\n".join(summary(launch, a.per, a.top)))
    if a.keep:
        opener = gzip.open if a.keep.endswith(".gz") else open
        with opener(a.keep, "wt", newline="") as f:
            w = csv.writer(f, quoting=csv.QUOTE_ALL)
            w.writerow(["Kernel Name", launch.name])
            w.writerow(KEEP)
            for r in launch.rows:
                w.writerow([r[c] for c in KEEP])
    return 0


if __name__ == "__main__":
    sys.exit(main())
