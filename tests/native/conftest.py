"""Fixtures shared by the native op tests: fresh random inputs with a printed seed."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture
def rng() -> np.random.Generator:
    """A generator seeded afresh for every test; the seed is printed (shown on failure)
    so a failing draw can be replayed with np.random.default_rng(seed)."""
    seed = int(np.random.SeedSequence().entropy % 2**63)
    print(f"seed={seed}")
    return np.random.default_rng(seed)
