"""The repository's scripts under tools/ loaded as modules by path (they are scripts, not a
package), for tests of their pure functions."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_tool(rel: str) -> ModuleType:
    """tools/<rel> (e.g. "device/trace_decode.py") as a fresh module named after the file."""
    path = ROOT / "tools" / rel
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
