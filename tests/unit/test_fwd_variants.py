"""tools/device/pos_sweep.py's results keys, shared with fwd_variants.py: a variant given twice
keeps both runs (one call's repeats are how its noise is read), and stored results group back by
model and variant for fwd_variants.py --plot."""
from __future__ import annotations

import json

import pytest

from helpers.tools import ROOT, load_tool


def test_repeated_variants_keep_every_run_in_order() -> None:
    fv = load_tool("device/pos_sweep.py")
    results: dict = {}
    calls = [("a.gguf", "", 1.0), ("a.gguf", "X=1", 2.0), ("a.gguf", "", 3.0), ("a.gguf", "", 4.0),
             ("b.gguf", "", 5.0), ("a.gguf", "X=1", 6.0)]
    for model, variant, t in calls:
        results[fv.run_key(results, model, variant)] = {"1": t}
    assert list(results) == ["a.gguf []", "a.gguf [X=1]", "a.gguf [] #2", "a.gguf [] #3", "b.gguf []",
                             "a.gguf [X=1] #2"]
    results["b.gguf [X=1]"] = {"error": "exit 1"}  # a failed run is left out of the groups
    groups = fv.group_runs(json.loads(json.dumps(results)))
    assert {m: {v: [r["1"] for r in rs] for v, rs in vs.items()} for m, vs in groups.items()} == {
        "a.gguf": {"": [1.0, 3.0, 4.0], "X=1": [2.0, 6.0]}, "b.gguf": {"": [5.0]}}


def test_this_sessions_stored_results_have_both_runs_of_each_variant() -> None:
    fv = load_tool("device/pos_sweep.py")
    data = json.loads((ROOT / "bench/results/gpu_nvidia-h200_20261203c_prep-rounds.json").read_text())
    groups = fv.group_runs(data["results"])
    assert len(groups) == 3
    for variants in groups.values():
        assert len(variants) == 3 and all(len(runs) == 2 for runs in variants.values())
    assert set(data["labels"]) == set(next(iter(groups.values())))


def test_pos_sweep_options() -> None:
    """--n, --n-ctx and --positions before the rest; the defaults; a context too small is refused."""
    ps = load_tool("device/pos_sweep.py")
    assert ps.parse(["o.json", "m.gguf", "--", ""]) == (1, 4200, [64, 128, 192, 300, 1000, 4000],
                                                        ["o.json", "m.gguf", "--", ""])
    assert ps.parse(["--n-ctx", "40960", "--n", "16", "--positions", "64,300", "o.json", "m.gguf", "--"]) == (
        16, 40960, [64, 300], ["o.json", "m.gguf", "--"])
    for argv in (["--n-ctx", "256", "o.json"], ["--n", "16", "--n-ctx", "87", "--positions", "64", "o.json"]):
        with pytest.raises(SystemExit, match="does not fit the context"):
            ps.parse(argv)
    assert ps.parse(["--n", "16", "--n-ctx", "88", "--positions", "64", "o.json"])[:3] == (16, 88, [64])
