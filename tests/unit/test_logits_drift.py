"""tools/device/logits_drift.py's measures of how far a build's logits and greedy tokens drift
from a reference build's (e.g. fewer digit planes of x against the default three)."""
from __future__ import annotations

import numpy as np
import pytest

from helpers.tools import load_tool


def test_drift_measures_the_rows_relative_errors_argmax_and_first_token() -> None:
    ld = load_tool("device/logits_drift.py")
    rng = np.random.default_rng(3)
    a = rng.standard_normal((4, 50)).astype(np.float32)
    a[:, 7] = 10.0  # every row's argmax and largest |logit|: 10
    b = a.copy()
    b[1, 3] += 0.5   # row 1: |difference| 0.5 of a largest |logit| of 10
    b[2, 9] = 20.0   # row 2: argmax moves, |difference| up to 20 - a[2, 9]
    ta = np.arange(64)
    tb = ta.copy()
    tb[37:] = 0
    r = ld.drift({"logits": a, "tokens": ta}, {"logits": b, "tokens": tb})
    d = b.astype(np.float64) - a
    assert r["max_rel"] == pytest.approx(abs(d[2, 9]) / 10.0)
    assert r["rms_rel"] == pytest.approx(np.sqrt((d**2).mean() / (a.astype(np.float64) ** 2).mean()))
    assert (r["argmax_diff"], r["rows"], r["first_token_diff"]) == (1, 4, 37)
    same = ld.drift({"logits": a, "tokens": ta}, {"logits": a, "tokens": ta})
    assert (same["max_rel"], same["rms_rel"], same["argmax_diff"], same["first_token_diff"]) == (0.0, 0.0, 0, None)


def test_drift_refuses_runs_of_other_shapes() -> None:
    ld = load_tool("device/logits_drift.py")
    with pytest.raises(ValueError, match="not runs of one model"):
        ld.drift({"logits": np.zeros((4, 5)), "tokens": []}, {"logits": np.zeros((4, 6)), "tokens": []})
