"""The Python side of the C++ <-> Python boundary: the only importer of the native module.

`Engine` wraps one resident model (weights memmapped, handed to C++ as zero-copy views);
`Sequence` is a handle on one conversation's KV cache and sampler. Every call into C++
releases the GIL. Dev builds can point SPECD_NATIVE_DIR at a folder holding a freshly
built `_specd*.so` (see tools/dev_build.sh); installed builds ship it inside `worker/`.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
from types import ModuleType

from worker.errors import SpecdError


def _load_native() -> ModuleType:
    dev_dir = os.environ.get("SPECD_NATIVE_DIR")
    if dev_dir:
        found = sorted(glob.glob(os.path.join(dev_dir, "_specd*.so")))
        if not found:
            raise SpecdError(f"SPECD_NATIVE_DIR={dev_dir!r} holds no _specd*.so; build it with tools/dev_build.sh")
        spec = importlib.util.spec_from_file_location("worker._specd", found[0])
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["worker._specd"] = module
        spec.loader.exec_module(module)
        return module
    try:
        from worker import _specd  # type: ignore[attr-defined]
    except ImportError as exc:
        raise SpecdError(
            "specd's native engine is not built in this install (built with SPECD_BACKEND=none?); "
            "reinstall with `pip install .` and the default SPECD_BACKEND=cpu"
        ) from exc
    return _specd


native = _load_native()
ops = native.ops
EngineError = native.EngineError
