"""The gateway image's Python requirements, taken from pyproject.toml.

    python docker/gateway_deps.py [pyproject.toml]   # prints one requirement per line

The gateway image installs the specd wheel with --no-deps and then only these packages, so
it carries no numpy, gguf or tokenizers (ARCHITECTURE.md: the gateway needs no native code).
The version specifiers stay single-sourced in pyproject.toml; this file only names which
distributions the gateway process (and `specd models pull`, which the image also runs to
fill the model volume) imports. tests/deploy/test_deploy_images.py walks the imports of
gateway/ and the worker modules it reaches and fails if one is not provided here.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

# distribution -> the top-level modules it provides to the gateway (incl. its own
# dependencies that gateway code imports directly)
GATEWAY_PACKAGES: dict[str, tuple[str, ...]] = {
    "litestar": ("litestar", "anyio"),   # anyio is a dependency of litestar
    "msgspec": ("msgspec",),
    "redis": ("redis",),
    "rq": ("rq",),
    "prometheus_client": ("prometheus_client",),
    "uvicorn": ("uvicorn",),
    "tqdm": ("tqdm",),                   # worker/models.py (specd models pull)
}


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def gateway_requirements(pyproject: Path) -> list[str]:
    """The [project] dependencies of pyproject whose distribution is in GATEWAY_PACKAGES."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    by_name = {_canon(re.match(r"[A-Za-z0-9._-]+", d).group(0)): d for d in deps}
    missing = [p for p in GATEWAY_PACKAGES if _canon(p) not in by_name]
    if missing:
        raise SystemExit(f"gateway_deps: {', '.join(missing)} not in [project] dependencies of {pyproject}; "
                         f"add them there or drop them from GATEWAY_PACKAGES in {__file__}")
    return [by_name[_canon(p)] for p in GATEWAY_PACKAGES]


if __name__ == "__main__":
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml")
    print("\n".join(gateway_requirements(path)))
