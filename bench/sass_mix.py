"""What the GPU kernels' inner loops are made of: SASS instructions per tensor-core or dot
instruction, by kind, read off the compiled code (no GPU needed).

The verify's int8 tensor-core readers (worker/kernels/cuda/matvec_kq_mma.cu) are bound by the
instructions they issue, not by their weight stream (Nsight Compute on the H100: 26 warp
instructions per IMMA in the 8B's gate/up loop, issuing in 54 % of cycles,
bench/results/gpu_nvidia-h100_20261207k_mma-ksplit.md). So a change that keeps the bits but
issues fewer instructions per IMMA is a speed change, and this counts them on any machine with
nvcc: it compiles a kernel file for one architecture with the build's flags, disassembles it
(cuobjdump), finds each kernel's inner loop (the innermost backward branch whose body holds the
most tensor-core / dot instructions), and reports that loop's instructions per such
instruction, by kind, with the kernel's registers and stack frame (where ptxas puts its spills).

The counts are static: the loop body as compiled, its rarely taken branches (a new tile of
weights) included, so they overstate what runs (the H100's measured 26 per IMMA against ~29
here for the same loop). They compare two builds of the same loop well, which is their use:

    python3 bench/sass_mix.py [--file matvec_kq_mma.cu] [--arch sm_90a] [--match REGEX] \\
        [-D NAME=VALUE ...] [--label NAME] [--out PATH]
    python3 bench/sass_mix.py --compare BEFORE.json AFTER.json

Needs nvcc (PATH or /usr/local/cuda) and cuobjdump: PATH, the CUDA toolkit, $CUOBJDUMP, or the
PyPI package nvidia-cuda-cuobjdump (`pip install nvidia-cuda-cuobjdump`). Writes
bench/results/sass_mix_<label>_<date>.json.
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import gguf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import machine  # noqa: E402

# The build's nvcc flags for kernel files (worker/kernels/CMakeLists.txt), with the include
# folders and define that CMake passes.
NVCC_FLAGS = ["-std=c++17", "-O3", "--use_fast_math", "--expt-relaxed-constexpr", "-DSPECD_WITH_GPU=1"]

# Kinds of SASS opcodes (the part before the first '.'); the rest count as "other".
KINDS: dict[str, tuple[str, ...]] = {
    "tensor": ("IMMA", "HMMA", "IGMMA", "HGMMA", "QGMMA", "BMMA"),
    "dot": ("IDP", "IDP4A"),
    "int": ("IMAD", "IADD3", "IADD", "LEA", "SHF", "LOP3", "PRMT", "IMNMX", "ISETP", "SEL", "IABS", "BMSK",
            "SGXT", "VIADD", "VIMNMX", "VIADDMNMX", "IMUL", "FLO", "POPC", "BREV", "PLOP3", "P2R", "R2P"),
    "convert": ("I2F", "I2FP", "F2I", "F2F", "F2FP", "FRND", "I2I", "I2IP"),
    "float": ("FFMA", "FMUL", "FADD", "FMNMX", "FSETP", "FSEL", "HADD2", "HMUL2", "HFMA2", "MUFU", "FCHK",
              "FSWZADD", "DADD", "DMUL", "DFMA"),
    "load": ("LDG", "LDS", "LD", "LDL", "LDSM", "LDGSTS", "LDGDEPBAR"),
    "const": ("LDC", "ULDC"),
    "store": ("STG", "STS", "ST", "STL", "RED", "ATOM", "ATOMG", "ATOMS"),
    "move": ("MOV", "S2R", "S2UR", "CS2R", "R2UR", "SHFL", "UMOV"),
    "control": ("BRA", "BSSY", "BSYNC", "BAR", "EXIT", "WARPSYNC", "NOP", "DEPBAR", "CALL", "RET", "YIELD",
                "BPT", "ACQBULK", "PREEXIT", "ERRBAR", "MEMBAR", "CCTL", "VOTE", "VOTEU"),
}
KIND_OF = {op: kind for kind, ops in KINDS.items() for op in ops}
WORK = ("tensor", "dot")  # the instructions a loop is there to issue

_INSN = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRA = re.compile(r"\bBRA(?:\.[A-Z.]+)?\s+(?:`?\(?)(0x[0-9a-f]+)")
_RES = re.compile(r"^\s*Function\s+(\S+?):\s*$")
_REG = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def mnemonic(text: str) -> str:
    """An instruction's opcode with its modifiers, without its guard predicate: '@!P0 IMAD.WIDE
    R4, ...' -> 'IMAD.WIDE'."""
    t = re.sub(r"^@!?U?P[T0-9]+\s+", "", text.strip())
    return t.split(None, 1)[0] if t else ""


def opcode(text: str) -> str:
    """The mnemonic without its modifiers: '@!P0 IMAD.WIDE R4, ...' -> 'IMAD'."""
    return mnemonic(text).split(".", 1)[0]


def kind(op: str) -> str:
    if op in KIND_OF:
        return KIND_OF[op]
    if op.startswith("U"):  # uniform-datapath arithmetic (UIADD3, ULEA, ...)
        return "uniform"
    return "other"


@dataclass
class Function:
    name: str
    insns: list[str] = field(default_factory=list)  # instruction texts, in address order
    index: dict[int, int] = field(default_factory=dict)  # address -> position in insns

    def loops(self) -> list[tuple[int, int]]:
        """The (first, last) positions of every backward branch's body, branch included."""
        out = []
        for i, text in enumerate(self.insns):
            m = _BRA.search(text)
            if m:
                target = self.index.get(int(m.group(1), 16))
                if target is not None and target <= i:
                    out.append((target, i))
        return out

    def mix(self, first: int = 0, last: int | None = None) -> collections.Counter:
        """Opcode counts of positions first..last (all by default)."""
        last = len(self.insns) - 1 if last is None else last
        return collections.Counter(opcode(t) for t in self.insns[first:last + 1])

    def work_loop(self) -> tuple[int, int] | None:
        """The inner loop: of the loops holding work instructions and no inner loop that holds
        any, the one with the most of them (None where no loop holds any)."""
        loops = [(a, b, work_count(self.mix(a, b))) for a, b in self.loops()]
        loops = [lp for lp in loops if lp[2] > 0]
        inner = [(a, b, w) for a, b, w in loops
                 if not any(a <= a2 and b2 <= b and (a2, b2) != (a, b) for a2, b2, _ in loops)]
        if not inner:
            return None
        a, b, _ = max(inner, key=lambda lp: (lp[2], lp[0] - lp[1]))
        return a, b


def work_count(mix: collections.Counter) -> int:
    return sum(n for op, n in mix.items() if kind(op) in WORK)


def macs(text: str) -> int:
    """Multiply-adds a warp instruction performs: an MMA's m x n x k from its shape
    (IMMA.16832: 16 x 8 x 32), a dot product's 4 or 2 per lane (IDP.4A: 128); 0 otherwise."""
    parts = mnemonic(text).split(".")
    if parts[0] in ("IMMA", "HMMA") and len(parts) > 1 and re.fullmatch(r"\d{4,5}", parts[1]):
        shape = parts[1]
        return int(shape[:2]) * int(shape[2]) * int(shape[3:])
    if parts[0] == "IDP" and len(parts) > 1 and parts[1] in ("4A", "2A"):
        return 32 * int(parts[1][0])
    return 0


def parse_sass(text: str) -> list[Function]:
    """cuobjdump -sass output -> its functions (mangled names) with their instructions."""
    funcs: list[Function] = []
    for line in text.splitlines():
        if "Function : " in line:
            funcs.append(Function(line.split("Function : ", 1)[1].strip()))
            continue
        m = _INSN.match(line)
        if m and funcs:
            f = funcs[-1]
            f.index[int(m.group(1), 16)] = len(f.insns)
            f.insns.append(m.group(2))
    return funcs


def parse_res_usage(text: str) -> dict[str, dict[str, int]]:
    """cuobjdump -res-usage output -> {mangled name: {regs, stack, shared, local}}."""
    out: dict[str, dict[str, int]] = {}
    name = None
    for line in text.splitlines():
        m = _RES.match(line)
        if m:
            name = m.group(1)
            continue
        m = _REG.search(line)
        if m and name:
            out[name] = dict(zip(("regs", "stack", "shared", "local"), map(int, m.groups())))
            name = None
    return out


def demangle(names: list[str]) -> dict[str, str]:
    """Mangled -> readable names (c++filt where there is one), shortened: namespaces and the
    anonymous namespace dropped, the GgmlType casts as the types' GGUF names."""
    readable = dict(zip(names, names))
    if shutil.which("c++filt") and names:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
        if len(out) == len(names):
            readable = dict(zip(names, out))
    short = {}
    for k, v in readable.items():
        v = re.sub(r"\(specd::GgmlType\)(\d+)", lambda m: gguf.GGMLQuantizationType(int(m.group(1))).name, v)
        v = re.sub(r"\(anonymous namespace\)::", "", v).replace("specd::gpu::", "").replace("specd::", "")
        short[k] = re.sub(r"\(.*\)$", "", v).replace("void ", "")
    return short


def find_cuobjdump(given: str | None = None) -> str:
    """cuobjdump: the given path, $CUOBJDUMP, PATH, the CUDA toolkit, or the nvidia-cuda-cuobjdump
    package's copy."""
    cands = [given, os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump"), "/usr/local/cuda/bin/cuobjdump"]
    try:
        import nvidia  # the namespace package of NVIDIA's PyPI wheels

        for base in getattr(nvidia, "__path__", []):
            cands += sorted(str(p) for p in Path(base).glob("cu*/bin/cuobjdump"))
            cands += sorted(str(p) for p in Path(base).glob("cuda_cuobjdump/bin/cuobjdump"))
    except ImportError:
        pass
    for c in cands:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return c
    raise SystemExit("sass_mix: no cuobjdump found: put the CUDA toolkit's on PATH, set CUOBJDUMP, or "
                     "`pip install nvidia-cuda-cuobjdump`")


def find_nvcc() -> str:
    for c in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if c and Path(c).is_file():
            return c
    raise SystemExit("sass_mix: no nvcc found (PATH or /usr/local/cuda/bin)")


def compile_cubin(src: Path, arch: str, defines: list[str], out: Path) -> None:
    """The kernel file as a cubin, with the build's flags."""
    cmd = [find_nvcc(), *NVCC_FLAGS, f"-arch={arch}", f"-I{ROOT / 'worker' / 'kernels'}", f"-I{ROOT / 'worker'}",
           *(f"-D{d}" for d in defines), "--cubin", str(src), "-o", str(out)]
    t0 = time.time()
    print(f"compiling {src.name} for {arch} {' '.join('-D' + d for d in defines)} ...", flush=True)
    with tempfile.TemporaryFile(mode="w+") as log:  # (a file, not a pipe: nvcc's warnings can fill one)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
        while proc.poll() is None:  # (matvec.cu takes minutes on 2 cores: say it is still going)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                print(f"  ... {time.time() - t0:.0f} s", flush=True)
        if proc.returncode != 0:
            log.seek(0)
            raise SystemExit(f"sass_mix: nvcc failed:\n{log.read()[-4000:]}")
    print(f"  compiled in {time.time() - t0:.0f} s", flush=True)


def kernel_rows(sass: str, res: str, match: str) -> list[dict]:
    """One row per kernel whose readable name matches: its inner loop's mix and its resources."""
    funcs = parse_sass(sass)
    usage = parse_res_usage(res)
    names = demangle([f.name for f in funcs])
    rows = []
    for f in funcs:
        if not re.search(match, names[f.name]):
            continue
        loop = f.work_loop()
        row = {"kernel": names[f.name], "mangled": f.name, "instructions": len(f.insns), **usage.get(f.name, {})}
        if loop is not None:
            mix = f.mix(*loop)
            work = work_count(mix)
            kinds = collections.Counter()
            for op, n in mix.items():
                kinds[kind(op)] += n
            n = loop[1] - loop[0] + 1
            row.update(loop_instructions=n, loop_work=work, per_work=round(n / work, 2),
                       macs_per_insn=round(sum(macs(t) for t in f.insns[loop[0]:loop[1] + 1]) / n, 1),
                       kinds=dict(kinds.most_common()), opcodes=dict(mix.most_common()))
        rows.append(row)
    return rows


def print_rows(rows: list[dict]) -> None:
    kinds = ["tensor", "dot", "int", "convert", "float", "load", "const", "move", "control"]
    print(f"\n{'kernel':<58} {'regs':>4} {'stack':>5} {'loop':>5} {'work':>4} {'/work':>6} {'MAC/i':>6}  " +
          " ".join(f"{k[:7]:>7}" for k in kinds))
    for r in rows:
        if "loop_work" not in r:
            continue
        w = r["loop_work"]
        print(f"{r['kernel'][:58]:<58} {r.get('regs', 0):>4} {r.get('stack', 0):>5} {r['loop_instructions']:>5} "
              f"{w:>4} {r['per_work']:>6.2f} {r['macs_per_insn']:>6.1f}  " + " ".join(f"{r['kinds'].get(k, 0) / w:>7.2f}" for k in kinds))
    print("(per work instruction: the loop's instructions of each kind over its tensor-core / dot ones; MAC/i: "
          "the loop's 8-bit multiply-adds per instruction, each digit plane counted)")


def compare(before: dict, after: dict) -> list[dict]:
    """Kernels in both result files: their loops' instructions per work instruction, before and
    after, with the change."""
    b = {r["kernel"]: r for r in before["kernels"] if "per_work" in r}
    out = []
    for r in after["kernels"]:
        if "per_work" in r and r["kernel"] in b:
            p0, p1 = b[r["kernel"]]["per_work"], r["per_work"]
            out.append({"kernel": r["kernel"], "before": p0, "after": p1, "change": round(p1 / p0 - 1, 4),
                        "regs": (b[r["kernel"]].get("regs"), r.get("regs")),
                        "stack": (b[r["kernel"]].get("stack"), r.get("stack"))})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", default="matvec_kq_mma.cu", help="a file of worker/kernels/cuda, or a path")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--match", default="kernel", help="regex on the readable kernel name")
    ap.add_argument("-D", dest="defines", action="append", default=[], help="NAME=VALUE for nvcc (repeatable)")
    ap.add_argument("--label", default="", help="a name for this build in the result file's name")
    ap.add_argument("--cuobjdump", help="path to cuobjdump")
    ap.add_argument("--out", help="JSON path (default bench/results/sass_mix_<label>_<date>.json)")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="two result files: print the change")
    args = ap.parse_args()

    if args.compare:
        rows = compare(*(json.loads(Path(p).read_text()) for p in args.compare))
        print(f"{'kernel':<58} {'before':>7} {'after':>7} {'change':>8}  regs        stack")
        for r in rows:
            print(f"{r['kernel'][:58]:<58} {r['before']:>7.2f} {r['after']:>7.2f} {100 * r['change']:>+7.1f}%  "
                  f"{r['regs'][0]}->{r['regs'][1]:<6} {r['stack'][0]}->{r['stack'][1]}")
        return 0

    src = next((c for c in (Path(args.file), ROOT / args.file) if c.is_file()), ROOT / "worker" / "kernels" / "cuda" / args.file)
    cuobjdump = find_cuobjdump(args.cuobjdump)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        compile_cubin(src, args.arch, args.defines, cubin)
        sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([cuobjdump, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    rows = kernel_rows(sass, res, args.match)
    if not rows:
        raise SystemExit(f"sass_mix: no kernel of {args.file} matches {args.match!r}")
    print_rows(rows)

    date = dt.date.today().isoformat()
    label = f"_{args.label}" if args.label else ""
    out = Path(args.out or ROOT / "bench" / "results" / f"sass_mix{label}_{date.replace('-', '')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True).stdout.strip()
    except OSError:
        rev = ""
    nvcc_version = subprocess.run([find_nvcc(), "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    out.write_text(json.dumps({
        "date": date, "command": "python3 " + shlex.join(sys.argv), "machine": machine.cpu_name(), "head": rev,
        "file": args.file,
        "arch": args.arch, "defines": args.defines, "nvcc": nvcc_version[-1] if nvcc_version else "",
        "flags": NVCC_FLAGS, "kernels": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
