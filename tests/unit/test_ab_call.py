"""tools/device/ab_call.sh, the one-call A/B on the GPU machine, run here with every tool it calls
replaced by a stub that records its arguments: which builds it makes (and with which flags),
which models it writes, and the variants it hands fwd_variants.py, in order."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from helpers.tools import ROOT

STUBS = {
    # each stub appends one line: its name and arguments (and the settings that matter)
    # (and the marker a patched tree holds: see test_patched_extra_build)
    "tools/dev_build.sh": ('m=$(cat PATCHED 2>/dev/null); echo "dev_build $1 [$CUDAFLAGS]${m:+ $m}" >> "$LOG"; '
                           'mkdir -p "build/dev-$1"\n'),
    "tools/device/build_base.sh": 'echo "build_base $1 $2" >> "$LOG"\n',
    "tools/gen_gguf.py": 'import os, sys\nopen(os.environ["LOG"], "a").write("gen " + " ".join(sys.argv[1:]) + "\\n")\n',
    "tools/device/fwd_variants.py": ('import os, sys\nopen(os.environ["LOG"], "a").write("fwd " + "|".join(sys.argv[1:]) + "\\n")\n'
                                     'print("fwd1 stub")\n'),
    # (and the SPECD_GPU_* settings it runs with, if any)
    "tools/device/trace_decode.py": ('import os, sys\nopen(os.environ["LOG"], "a").write('
                                     '" ".join(["trace", *sys.argv[1:], os.environ["SPECD_NATIVE_DIR"]] + '
                                     'sorted(k + "=" + v for k, v in os.environ.items() if k.startswith("SPECD_GPU_")))'
                                     ' + "\\n")\n'),
}


def run(tmp_path: Path, args: list[str], files: dict[str, str] | None = None, printed: list[str] | None = None,
        **env: str) -> list[str]:
    tree = tmp_path / "tree"
    (tree / "tools" / "device").mkdir(parents=True)
    (tree / ".whl").mkdir()
    for rel, text in (files or {}).items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(text)
    shutil.copy(ROOT / "tools" / "device" / "ab_call.sh", tree / "tools" / "device" / "ab_call.sh")
    for rel, text in STUBS.items():
        (tree / rel).write_text(text)
    log = tmp_path / "calls.log"
    full = {**os.environ, "OUT": str(tmp_path / "out"), "LOG": str(log), **env}
    done = subprocess.run(["bash", "tools/device/ab_call.sh", *args], cwd=tree, env=full, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    if printed is not None:
        printed.append(done.stdout)
    return sorted(log.read_text().splitlines())


def test_builds_models_variants_and_traces(tmp_path: Path) -> None:
    calls = run(tmp_path, ["SPECD_GPU_X=1;SPECD_Y=2", "build:x"], TRACE="1", TESTS="", REPEAT="1",
                EXTRA="x:-DFOO=1", MODELS="qwen3-0.6b Q8_0 qwen3-8b Q4_K_M")
    tree = tmp_path / "tree"
    m06, m8 = "/dev/shm/m/qwen3-0.6b-Q8_0.random.gguf", "/dev/shm/m/qwen3-8b-Q4_K_M.random.gguf"
    base = "SPECD_NATIVE_DIR=/tmp/base/build/dev-base"
    assert calls == sorted([
        "build_base .device/base.patch /tmp/base",
        "dev_build gpu []",
        "dev_build trace [-DSPECD_GPU_TRACE=1]",
        "dev_build x [-DFOO=1]",
        "gen -q -o /dev/shm/m qwen3-0.6b Q8_0 qwen3-8b Q4_K_M",
        # the base, the tree (twice with REPEAT=1), then the arguments; "build:x" names x's build
        "fwd " + "|".join([str(tmp_path / "out" / "ab.json"), m06, m8, "--", base, "", base, "",
                           "SPECD_GPU_X=1;SPECD_Y=2", f"SPECD_NATIVE_DIR={tree}/build/dev-x"]),
        f"trace {m06} --n 1 --json {tmp_path}/out/trace-n1.json {tree}/build/dev-trace",
        f"trace {m06} --n 16 --json {tmp_path}/out/trace-n16.json {tree}/build/dev-trace",
    ])


def test_defaults_build_base_and_tree_only(tmp_path: Path) -> None:
    calls = run(tmp_path, [], TESTS="")
    assert [c.split()[0] for c in calls] == ["build_base", "dev_build", "fwd", "gen"]
    assert "gen -q -o /dev/shm/m qwen3-8b Q4_K_M qwen3-0.6b Q8_0 qwen3-0.6b Q4_K_M" in calls
    fwd = next(c for c in calls if c.startswith("fwd ")).split("|")
    assert fwd[-3:] == ["--", "SPECD_NATIVE_DIR=/tmp/base/build/dev-base", ""]


def test_positions_sweep_and_traces_of_base_and_tree(tmp_path: Path) -> None:
    # POSITIONS: the same variants' decode steps at those positions (pos_sweep.py, a context of
    # the largest position + 200); TRACE_POS: a trace build of the base too, and one-position
    # traces of base and tree after each position instead of the default n = 1 and 16 ones
    stub = ('import os, sys\nopen(os.environ["LOG"], "a").write("pos " + "|".join(sys.argv[1:]) + "\\n")\n')
    calls = run(tmp_path, ["SPECD_GPU_X=1"], {"tools/device/pos_sweep.py": stub}, TESTS="", TRACE="1",
                POSITIONS="64,4000,300", TRACE_POS="64,1000", MODELS="qwen3-8b Q4_K_M")
    tree, out = tmp_path / "tree", tmp_path / "out"
    m8, base = "/dev/shm/m/qwen3-8b-Q4_K_M.random.gguf", "SPECD_NATIVE_DIR=/tmp/base/build/dev-base"
    assert "build_base .device/base.patch /tmp/tbase" in calls and "dev_build trace [-DSPECD_GPU_TRACE=1]" in calls
    assert "pos " + "|".join(["--n", "1", "--positions", "64,4000,300", "--n-ctx", "4200", str(out / "ab-pos.json"),
                              m8, "--", base, "", "SPECD_GPU_X=1"]) in calls
    traces = [c for c in calls if c.startswith("trace ")]
    assert traces == sorted(f"trace {m8} --pos0 {p} --n-ctx 4200 --json {out}/trace-{b}-p{p}.json {d}"
                            for p in (64, 1000) for b, d in (("base", "/tmp/tbase/build/dev-base"),
                                                             ("tree", f"{tree}/build/dev-trace")))


def test_build_variant_settings_no_forwards_and_traced_settings(tmp_path: Path) -> None:
    # "build:NAME;VAR=VALUE": an EXTRA build run with those settings; FWD=0: no fwd_variants.py;
    # TRACE_ENV: the tree's trace once more per setting, named after it; SWEEP_N: the sweep's
    # forwards are of that many positions (a verify)
    stub = ('import os, sys\nopen(os.environ["LOG"], "a").write("pos " + "|".join(sys.argv[1:]) + "\\n")\n')
    calls = run(tmp_path, ["build:x;SPECD_GPU_A=1;SPECD_GPU_B=2", "build:x"], {"tools/device/pos_sweep.py": stub},
                TESTS="", FWD="0", EXTRA="x:-DX=1", POSITIONS="64", SWEEP_N="16", TRACE="1", TRACE_POS="64",
                TRACE_ENV="SPECD_GPU_AHEAD=0 SPECD_GPU_PDL=0", MODELS="qwen3-8b Q4_K_M")
    tree, out = tmp_path / "tree", tmp_path / "out"
    m8, base = "/dev/shm/m/qwen3-8b-Q4_K_M.random.gguf", "SPECD_NATIVE_DIR=/tmp/base/build/dev-base"
    assert not any(c.startswith("fwd ") for c in calls)
    assert "pos " + "|".join(["--n", "16", "--positions", "64", "--n-ctx", "264", str(out / "ab-pos.json"), m8, "--",
                              base, "", f"SPECD_NATIVE_DIR={tree}/build/dev-x;SPECD_GPU_A=1;SPECD_GPU_B=2",
                              f"SPECD_NATIVE_DIR={tree}/build/dev-x"]) in calls
    trace = f"trace {m8} --pos0 64 --n-ctx 264 --json {out}/trace-"
    assert [c for c in calls if c.startswith("trace ")] == sorted([
        f"{trace}base-p64.json /tmp/tbase/build/dev-base",
        f"{trace}tree-p64.json {tree}/build/dev-trace",
        f"{trace}tree-SPECD_GPU_AHEAD-0-p64.json {tree}/build/dev-trace SPECD_GPU_AHEAD=0",
        f"{trace}tree-SPECD_GPU_PDL-0-p64.json {tree}/build/dev-trace SPECD_GPU_PDL=0",
    ])


def test_two_sweeps_decode_then_verify(tmp_path: Path) -> None:
    # SWEEP_N="1,16": decode steps into ab-pos.json, then 16-position forwards into
    # ab-pos-n16.json, the same positions and variants, in that order
    stub = ('import os, sys\nopen(os.environ["LOG"], "a").write("pos " + "|".join(sys.argv[1:]) + "\\n")\n')
    printed: list[str] = []
    calls = run(tmp_path, ["SPECD_GPU_X=1"], {"tools/device/pos_sweep.py": stub}, printed, TESTS="", FWD="0",
                POSITIONS="64,1000", SWEEP_N="1,16", MODELS="qwen3-0.6b Q8_0")
    out, m06 = tmp_path / "out", "/dev/shm/m/qwen3-0.6b-Q8_0.random.gguf"
    base = "SPECD_NATIVE_DIR=/tmp/base/build/dev-base"
    sweeps = [c for c in calls if c.startswith("pos ")]
    assert sweeps == sorted("pos " + "|".join(["--n", n, "--positions", "64,1000", "--n-ctx", "1200", str(out / name),
                                               m06, "--", base, "", "SPECD_GPU_X=1"])
                            for n, name in (("1", "ab-pos.json"), ("16", "ab-pos-n16.json")))
    said = [line for line in printed[0].splitlines() if "positions swept" in line]
    assert [line.split("] ")[1] for line in said] == ["positions swept, 1 a forward", "positions swept, 16 a forward"]


# a patch that adds the file PATCHED (its text: "patched") at the tree's root
ADD_MARKER = """--- /dev/null
+++ b/PATCHED
@@ -0,0 +1 @@
+patched
"""


def test_patched_extra_build(tmp_path: Path) -> None:
    """An EXTRA build "NAME:@PATCH" is the working tree with PATCH applied, built in a copy under
    AB_TMP (the working tree itself stays unpatched), and "build:NAME" runs that build."""
    assert shutil.which("patch"), "ab_call.sh's patched builds need the patch program (apt-get install patch)"
    ab_tmp = tmp_path / "ab"
    calls = run(tmp_path, ["build:p", "build:f"], files={".device/p.patch": ADD_MARKER}, TESTS="",
                EXTRA="p:@.device/p.patch f:-DF=1", AB_TMP=str(ab_tmp))
    tree = tmp_path / "tree"
    assert "dev_build p [] patched" in calls and "dev_build f [-DF=1]" in calls and "dev_build gpu []" in calls
    assert not (tree / "PATCHED").exists() and (ab_tmp / "p" / "PATCHED").read_text() == "patched\n"
    assert (ab_tmp / "p" / "build" / "dev-p").is_dir() and not (ab_tmp / "p" / ".git").exists()
    fwd = next(c for c in calls if c.startswith("fwd ")).split("|")
    assert fwd[-2:] == [f"SPECD_NATIVE_DIR={ab_tmp}/p/build/dev-p", f"SPECD_NATIVE_DIR={tree}/build/dev-f"]


def test_patch_that_does_not_apply_is_reported(tmp_path: Path) -> None:
    bad = "--- a/MISSING\n+++ b/MISSING\n@@ -1 +1 @@\n-old\n+new\n"  # (a file the tree lacks)
    printed: list[str] = []
    calls = run(tmp_path, [], files={".device/bad.patch": bad}, TESTS="", EXTRA="b:@.device/bad.patch",
                AB_TMP=str(tmp_path / "ab"), printed=printed)
    assert not any(c.startswith("dev_build b") for c in calls)
    assert "ab_call: .device/bad.patch does not apply to the working tree" in printed[0]
