"""bench/bench_gpu.py's llama.cpp side: llama-bench's JSON is read into the rates the tables
compare with specd's, each the median of its repetitions (specd's are medians too; llama-bench's
own avg_ts is their mean, which its slow first repetition of a prompt size drags down)."""
from __future__ import annotations

import argparse
import json
import stat
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # bench_gpu imports its sibling machine.py

import bench_gpu  # noqa: E402

# Rows as llama-bench -o json writes them (the fields bench_gpu reads, and a few others), with
# the repetitions of the 0.6B F16 run on the H200 (2026-12-01): a slow first repetition each.
ROWS = [
    {"n_prompt": 16, "n_gen": 0, "avg_ts": 4782.854987, "samples_ts": [1752.28, 6223.97, 6372.31],
     "build_commit": "abc123", "build_number": 1, "gpu_info": "NVIDIA H200", "backends": "CUDA"},
    {"n_prompt": 512, "n_gen": 0, "avg_ts": 54344.94104, "samples_ts": [24919.7, 70460.8, 67654.4],
     "build_commit": "abc123", "build_number": 1, "gpu_info": "NVIDIA H200", "backends": "CUDA"},
    {"n_prompt": 0, "n_gen": 64, "avg_ts": 660.871992, "samples_ts": [644.383, 663.091, 675.143],
     "build_commit": "abc123", "build_number": 1, "gpu_info": "NVIDIA H200", "backends": "CUDA"},
]


def fake_llama_bench(tmp_path: Path, rows: list[dict]) -> str:
    exe = tmp_path / "llama-bench"
    exe.write_text(f"#!{sys.executable}\nimport sys\nsys.stdout.write({json.dumps(json.dumps(rows))})\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return str(exe)


def args(**kw) -> argparse.Namespace:
    return argparse.Namespace(prefill=[512], gen=64, llama_reps=3, **kw)


def test_rates_are_medians_of_the_repetitions(tmp_path: Path) -> None:
    res = bench_gpu.run_llama_bench(fake_llama_bench(tmp_path, ROWS), Path("m.gguf"), args(), timeout=60)
    assert res["ok"] is True
    assert res["command"][-8:] == ["-fa", "1", "-ngl", "99", "-r", "3", "-o", "json"]
    assert res["command"][res["command"].index("-p") + 1] == "16,512"
    assert res["decode"]["tok_s"] == 663.091 and res["decode"]["n_gen"] == 64
    assert res["decode"]["mean_tok_s"] == 660.871992
    assert res["prefill"]["512"]["tok_s"] == 67654.4
    assert res["prefill"]["16"]["tok_s"] == 6223.97
    assert res["prefill"]["16"]["samples_tok_s"] == [1752.28, 6223.97, 6372.31]
    # 16 positions cost 16 / 6223.97 s, one step 1 / 663.091 s
    assert res["verify_cost_16"] == pytest.approx(16 * 663.091 / 6223.97)
    assert res["build"] == "abc123 (1)"


# llama-bench -p 0 -n 64 -d 1000,4000 (its context filled with D tokens before each tg test)
DEPTH_ROWS = [
    {"n_prompt": 0, "n_gen": 64, "n_depth": 1000, "avg_ts": 610.0, "samples_ts": [580.0, 612.5, 637.5]},
    {"n_prompt": 0, "n_gen": 64, "n_depth": 4000, "avg_ts": 500.0, "samples_ts": [490.0, 505.0, 505.0]},
]


def fake_llama_bench_by_depth(tmp_path: Path, rows: list[dict], depth_rows: list[dict] | str) -> str:
    """A llama-bench that answers a run with -d with depth_rows (a str: fails with it as stderr)."""
    exe = tmp_path / "llama-bench"
    exe.write_text(f"#!{sys.executable}\nimport sys\n"
                   f"if '-d' not in sys.argv:\n    sys.stdout.write({json.dumps(json.dumps(rows))})\n"
                   f"elif isinstance({depth_rows!r}, str):\n    sys.stderr.write({depth_rows!r}); sys.exit(1)\n"
                   f"else:\n    sys.stdout.write({json.dumps(json.dumps(depth_rows))})\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return str(exe)


def test_decode_at_depth_is_a_second_run(tmp_path: Path) -> None:
    exe = fake_llama_bench_by_depth(tmp_path, ROWS, DEPTH_ROWS)
    res = bench_gpu.run_llama_bench(exe, Path("m.gguf"), args(depth=[1000, 4000], depth_gen=64), timeout=60)
    assert res["ok"] is True and "-d" not in res["command"]
    assert res["depth_command"] == [exe, "-m", "m.gguf", "-p", "0", "-n", "64", "-d", "1000,4000", "-fa", "1",
                                    "-ngl", "99", "-r", "3", "-o", "json"]
    assert res["decode_depth"]["1000"]["tok_s"] == 612.5 and res["decode_depth"]["4000"]["tok_s"] == 505.0
    assert res["decode_depth"]["1000"]["tokens"] == 64 and res["decode_depth"]["4000"]["prompt"] == 4000
    assert res["decode"]["tok_s"] == 663.091  # the first run's numbers are unchanged
    # the headline: specd / llama.cpp at each depth, None where a side has no number
    row = {"floor_tok_s": 3581.0, "llama": res,
           "specd": {"decode_depth": {"1000": {"tok_s": 1225.0}}}}
    bench_gpu.summarize(row, [512], [1000, 4000])
    h = row["headline"]
    assert h["decode_depth_1000_ratio"] == pytest.approx(1225.0 / 612.5)
    assert h["llama_decode_depth_4000_tok_s"] == 505.0 and h["decode_depth_4000_ratio"] is None


def test_a_failing_depth_run_keeps_the_first_runs_numbers(tmp_path: Path) -> None:
    exe = fake_llama_bench_by_depth(tmp_path, ROWS, "failed to create context with n_ctx 4064")
    res = bench_gpu.run_llama_bench(exe, Path("m.gguf"), args(depth=[4000], depth_gen=64), timeout=60)
    assert res["ok"] is True and res["decode"]["tok_s"] == 663.091
    assert res["depth_error"] == "exit 1: failed to create context with n_ctx 4064" and "decode_depth" not in res


def test_depth_arguments() -> None:
    assert bench_gpu.parse_args(["m.gguf"]).depth == [1000, 4000]
    assert bench_gpu.parse_args(["m.gguf", "--depth", ""]).depth == []
    assert bench_gpu.parse_args(["m.gguf", "--depth", "300", "--depth-gen", "8"]).depth == [300]
    for bad in (["--depth", "0"], ["--depth-gen", "1"]):
        with pytest.raises(SystemExit):
            bench_gpu.parse_args(["m.gguf", *bad])


def test_rows_without_samples_keep_the_mean(tmp_path: Path) -> None:
    rows = [{k: v for k, v in r.items() if k != "samples_ts"} for r in ROWS]
    res = bench_gpu.run_llama_bench(fake_llama_bench(tmp_path, rows), Path("m.gguf"), args(), timeout=60)
    assert res["decode"]["tok_s"] == 660.871992 and res["prefill"]["512"]["tok_s"] == 54344.94104


def test_a_failing_llama_bench_is_reported_not_raised(tmp_path: Path) -> None:
    exe = tmp_path / "llama-bench"
    exe.write_text(f"#!{sys.executable}\nimport sys\nsys.stderr.write('no CUDA device')\nsys.exit(3)\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    res = bench_gpu.run_llama_bench(str(exe), Path("m.gguf"), args(), timeout=60)
    assert res["ok"] is False and res["error"] == "exit 3: no CUDA device"


def test_variants_parse_and_refuse_ambiguity(capsys):
    args = bench_gpu.parse_args(["m.gguf", "--variant", "none:SPECD_GPU_STAGE=", "--variant",
                                 "two:SPECD_GPU_PDL=0,SPECD_GPU_FOLD=0"])
    assert args.variants == {"none": {"SPECD_GPU_STAGE": ""}, "two": {"SPECD_GPU_PDL": "0", "SPECD_GPU_FOLD": "0"}}
    # the same name twice would silently replace the first run; a ':' in the name makes the rest
    # a variable name that no program reads
    for bad, message in ((["--variant", "a:X=1", "--variant", "a:X=2"], "already taken"),
                         (["--variant", "pf16:last:SPECD_GPU_L2PF=16"], "environment variable"),
                         (["--variant", "x:=1"], "expected NAME:VAR=VALUE"),
                         (["--variant", "x"], "expected NAME:VAR=VALUE")):
        with pytest.raises(SystemExit):
            bench_gpu.parse_args(["m.gguf", *bad])
        assert message in capsys.readouterr().err


def test_floor_bandwidth_is_the_gpus_own(monkeypatch):
    # The floors divide by the bandwidth of the GPU the benchmark runs on (an H100's copy is ~30 %
    # below the H200's 4.27 TB/s), measured unless --bandwidth names one; a failed measurement
    # falls back to the H200's figure and says so in the report.
    monkeypatch.setattr(bench_gpu, "measured_bandwidth", lambda: 2.9e12)
    assert bench_gpu.resolve_bandwidth(bench_gpu.parse_args(["m.gguf"])) == (
        2.9e12, "device-to-device copy measured at the start")
    assert bench_gpu.resolve_bandwidth(bench_gpu.parse_args(["m.gguf", "--bandwidth", "3.35e12"])) == (
        3.35e12, "--bandwidth")
    assert bench_gpu.resolve_bandwidth(bench_gpu.parse_args(["m.gguf", "--device", "cpu"]))[0] == 4.27e12

    def no_gpu():
        raise RuntimeError("CUDA unavailable")

    monkeypatch.setattr(bench_gpu, "measured_bandwidth", no_gpu)
    bw, source = bench_gpu.resolve_bandwidth(bench_gpu.parse_args(["m.gguf"]))
    assert bw == 4.27e12 and source.endswith("(measuring failed: RuntimeError: CUDA unavailable)")


def test_measuring_the_bandwidth_without_a_gpu_says_why():
    # measured_bandwidth() runs the copy in a child process; on a machine without PyTorch or a GPU
    # the child's last error line comes back as the reason (resolve_bandwidth then falls back).
    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is visible: the measurement would succeed")
    except ImportError:
        pass
    # e.g. "ModuleNotFoundError: No module named 'torch'"
    with pytest.raises(RuntimeError, match=r"^\w+(Error|Exception): \S"):
        bench_gpu.measured_bandwidth(timeout=120)
