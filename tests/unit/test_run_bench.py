"""tools/device/run_bench.sh, the GPU benchmark's one command, run here with the model writer and
the benchmark replaced by stubs: which native module folder the benchmark gets when the call
builds one (SPECD_BUILD) without saying where it went. (Its import check of worker.engine is
not asserted on: an editable install's import hook finds the real package before PYTHONPATH.)"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from helpers.tools import ROOT

STUBS = {
    # --dry-run: "SIZE PATH" of the file it would write; otherwise it writes nothing
    "tools/gen_gguf.py": ('import sys\nif "--dry-run" in sys.argv:\n'
                          '    d = sys.argv[sys.argv.index("-o") + 1] if "-o" in sys.argv else "/tmp"\n'
                          '    print(1024, d + "/m.gguf")\n'),
    # the benchmark records the module folder it runs with
    "bench/bench_gpu.py": ('import os\nopen(os.environ["LOG"], "a").write('
                           '"bench " + os.environ.get("SPECD_NATIVE_DIR", "-") + "\\n")\n'),
}


def run(tmp_path: Path, **env: str) -> tuple[list[str], str]:
    tree = tmp_path / "tree"
    (tree / "tools" / "device").mkdir(parents=True)
    shutil.copy(ROOT / "tools" / "device" / "run_bench.sh", tree / "tools" / "device" / "run_bench.sh")
    for rel, text in STUBS.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(text)
    log = tmp_path / "calls.log"
    log.touch()
    full = {**os.environ, "OUT": str(tmp_path / "out"), "LOG": str(log), "LLAMA": "0", "MODELS": "qwen3-0.6b:Q8_0",
            "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", **env}
    if "SPECD_NATIVE_DIR" not in env:
        full.pop("SPECD_NATIVE_DIR", None)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvidia-smi").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "bin" / "nvidia-smi").chmod(0o755)
    done = subprocess.run(["bash", "tools/device/run_bench.sh"], cwd=tree, env=full, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return log.read_text().splitlines(), done.stdout


BUILD = "mkdir -p build/dev-old build/dev-gpu && touch build/dev-old/_specd.so && sleep 1.1 && touch build/dev-gpu/_specd.so"


def test_a_build_without_a_module_folder_runs_the_newest_build(tmp_path: Path) -> None:
    calls, out = run(tmp_path, SPECD_BUILD=BUILD)
    assert calls == [f"bench {tmp_path}/tree/build/dev-gpu"]
    assert f"SPECD_NATIVE_DIR unset: using {tmp_path}/tree/build/dev-gpu" in out


def test_a_named_module_folder_is_kept(tmp_path: Path) -> None:
    calls, _ = run(tmp_path, SPECD_BUILD=BUILD, SPECD_NATIVE_DIR="/elsewhere")
    assert calls == ["bench /elsewhere"]


def test_no_build_leaves_the_folder_unset(tmp_path: Path) -> None:
    calls, out = run(tmp_path)
    assert calls == ["bench -"]
    assert "SPECD_NATIVE_DIR unset" not in out
