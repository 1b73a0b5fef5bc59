"""GPU tests: every test here is marked `gpu` and skipped unless the native module was
built with a GPU backend (SPECD_BACKEND=cuda|hip) and a device answers. They run on a GPU
machine with the repo's own test command; CI (no GPU) compiles the backends instead."""

from __future__ import annotations

import numpy as np
import pytest


def _gpu_reason() -> str | None:
    try:
        from worker.engine import native
    except Exception as exc:  # noqa: BLE001 - any import failure means "no GPU build here"
        return f"native module unavailable: {exc}"
    if not hasattr(native, "gpu_ops"):
        return f"native module built with SPECD_BACKEND={native.backend}, not cuda/hip"
    if native.gpu_ops.device_count() == 0:
        return "no GPU device visible"
    return None


_REASON = _gpu_reason()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "/tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if _REASON is not None:
                item.add_marker(pytest.mark.skip(reason=_REASON))


@pytest.fixture
def rng() -> np.random.Generator:
    """Seeded afresh per test; the seed is printed (shown on failure) for replay."""
    seed = int(np.random.SeedSequence().entropy % 2**63)
    print(f"seed={seed}")
    return np.random.default_rng(seed)
