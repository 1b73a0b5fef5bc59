"""Shared by the tests in tests/deploy: tools/validate_deploy.py imported as `vd`, the value
sets the chart is rendered with, and small lookups over rendered manifests. (pytest puts
this folder on sys.path; the module name is unique in the repository.)"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import validate_deploy as vd  # noqa: E402,F401  (tools/ is not a package; re-exported)

MIXED_VALUES = ROOT / "helm" / "examples" / "mixed-gpu.yaml"
VALUE_SETS = {"default": [], "mixed-gpu": [MIXED_VALUES]}


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    """Manifests of `kind` (and metadata.name, if given)."""
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def pod_specs(docs: list[dict]) -> list[tuple[str, dict]]:
    """(workload name, pod spec) of every Deployment and StatefulSet."""
    return [(d["metadata"]["name"], d["spec"]["template"]["spec"])
            for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
