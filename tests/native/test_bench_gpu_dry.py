"""bench/bench_gpu.py end to end on the CPU engine (--device cpu, its dry run) with a tiny model
and a stand-in llama-bench: every phase runs, decode at depth included, and the report holds
what the tables print."""
from __future__ import annotations

import importlib.util
import json
import stat
import subprocess
import sys
from pathlib import Path

from helpers.tiny_gguf import write_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def fake_llama_bench(path: Path) -> Path:
    """Answers the plain run with pp/tg rows and the run with -d D,... with one tg row per depth
    (tok/s 100 + D / 10, so each depth's number is told apart); logs its arguments."""
    path.write_text(f"""#!{sys.executable}
import json, sys
open({str(path) + '.log'!r}, "a").write(" ".join(sys.argv[1:]) + "\\n")
a = sys.argv
if "-d" in a:
    n = int(a[a.index("-n") + 1])
    rows = [{{"n_prompt": 0, "n_gen": n, "n_depth": int(d), "avg_ts": 100 + int(d) / 10,
              "samples_ts": [100 + int(d) / 10]}} for d in a[a.index("-d") + 1].split(",")]
else:
    rows = [{{"n_prompt": int(p), "n_gen": 0, "avg_ts": 5000.0}} for p in a[a.index("-p") + 1].split(",")]
    rows.append({{"n_prompt": 0, "n_gen": int(a[a.index("-n") + 1]), "avg_ts": 200.0}})
print(json.dumps(rows))
""")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_dry_run_with_depths(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny.gguf", "qwen3", "Q8_0", ctx=1024, seed=3)
    exe = fake_llama_bench(tmp_path / "llama-bench")
    out = tmp_path / "out"
    cmd = [sys.executable, "bench/bench_gpu.py", model, "--device", "cpu", "--llama-bench", str(exe), "--out", str(out),
           "--gen", "6", "--prefill", "32", "--verify", "2,16", "--depth", "300,600", "--depth-gen", "5",
           "--reps-decode", "2", "--reps-verify", "2", "--reps-prefill", "1", "--gen-repeats", "1", "--llama-reps", "1"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(next(out.glob("gpu_*.json")).read_text())
    (row,) = report["results"]
    specd, llama, h = row["specd"], row["llama"], row["headline"]
    assert specd["ok"] is True, specd.get("error")
    assert specd["n_ctx"] >= 600 + 5 + 1
    for d in (300, 600):
        dd = specd["decode_depth"][str(d)]
        assert dd["prompt"] == d and dd["tokens"] == 5 and len(dd["runs"]) == 1 and dd["tok_s"] > 0
        assert llama["decode_depth"][str(d)]["tok_s"] == 100 + d / 10
        assert h[f"decode_depth_{d}_ratio"] == dd["tok_s"] / (100 + d / 10)
    assert llama["depth_command"][-12:] == ["-n", "5", "-d", "300,600", "-fa", "1", "-ngl", "99", "-r", "1", "-o", "json"]
    calls = Path(str(exe) + ".log").read_text().splitlines()
    assert len(calls) == 2 and "-d" not in calls[0].split()
    assert "decode vs context" in done.stdout
    if importlib.util.find_spec("matplotlib") is None:  # the picture needs the bench extra's matplotlib
        return
    assert "plot failed" not in done.stdout and next(out.glob("gpu_*.png")).stat().st_size > 0
