"""What the images promise beyond hadolint: the backend and GPU targets each one builds (the
same CMake option as the tests, the ARG lines CI's compile check reads), pinned CUDA 12.8+ /
ROCm 6.x bases, multi-stage builds ending as a non-root user with a health check, no model
inside, a .dockerignore that keeps local builds and models out, and a gateway image whose
short dependency list covers everything the gateway imports."""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import pytest
from deploy_helpers import ROOT, vd

DOCKER = ROOT / "docker"
IMAGES = {  # file -> SPECD_BACKEND its build stage uses
    "gateway.Dockerfile": "none",
    "worker-cpu.Dockerfile": "cpu",
    "worker-cuda12.Dockerfile": "cuda",
    "worker-rocm.Dockerfile": "hip",
}


def stages(path: Path) -> list[list[str]]:
    """The instructions of each build stage (continuation lines joined, comments dropped)."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            out.append([])
        if out:
            out[-1].append(line)
    return out


def instr(stage: list[str], name: str) -> list[str]:
    return [ln[len(name) + 1:].strip() for ln in stage if ln.upper().startswith(name + " ")]


def test_the_four_images_exist_and_nothing_else():
    assert sorted(p.name for p in DOCKER.glob("*.Dockerfile")) == sorted(IMAGES)


@pytest.mark.parametrize("name", IMAGES)
def test_build_stage_uses_the_backend_of_the_image(name: str):
    build = stages(DOCKER / name)[0]
    env = " ".join(instr(build, "ENV"))
    assert re.search(rf"\bSPECD_BACKEND={IMAGES[name]}\b", env), f"{name}: build stage ENV {env!r}"
    runs = " ".join(instr(build, "RUN"))
    # the wheel comes from pyproject's scikit-build-core build, like the tests' install
    assert "pip wheel" in runs and "--no-deps" in runs and " ." in runs, runs


def test_arch_arg_lines_match_what_ci_compiles():
    # tools/gpu_compile_check.sh reads exactly these lines: one line, double-quoted default
    cuda = re.findall(r'^ARG SPECD_CUDA_ARCHITECTURES="([^"]*)"$', (DOCKER / "worker-cuda12.Dockerfile").read_text(), re.M)
    assert cuda == ["75-real;80-real;86-real;89-real;90a-real;120"]
    hip = re.findall(r'^ARG SPECD_HIP_ARCHITECTURES="([^"]*)"$', (DOCKER / "worker-rocm.Dockerfile").read_text(), re.M)
    assert len(hip) == 1 and {"gfx90a", "gfx1100", "gfx1151", "gfx1201"} <= set(hip[0].split(";"))


def test_gpu_toolkits_are_cuda_12_8_plus_and_rocm_6():
    froms = [instr(s, "FROM")[0].split()[0] for s in stages(DOCKER / "worker-cuda12.Dockerfile")]
    versions = [re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.(\d+)-(devel|base|runtime)-ubuntu\d+\.\d+", f) for f in froms]
    assert all(versions), froms
    assert versions[0].group(4) == "devel" and {m.group(1, 2, 3) for m in versions} == {versions[0].group(1, 2, 3)}, \
        "build and runtime stages must use the same CUDA release"
    major, minor = int(versions[0].group(1)), int(versions[0].group(2))
    assert major == 12 and minor >= 8, "sm_120 needs CUDA >= 12.8; the image is cuda12"
    rocm = stages(DOCKER / "worker-rocm.Dockerfile")
    base = instr(rocm[0], "FROM")[0].split()[0]
    m = re.fullmatch(r"rocm/dev-ubuntu-\d+\.\d+:(6\.\d+(?:\.\d+)?)", base)
    assert m, base
    # the runtime stage installs the HIP runtime of the same release
    assert f'ARG ROCM_VERSION={m.group(1)}' in rocm[-1], "runtime ROCM_VERSION must match the build image"


@pytest.mark.parametrize("name", IMAGES)
def test_bases_are_pinned_by_tag(name: str):
    for stage in stages(DOCKER / name):
        image = instr(stage, "FROM")[0].split()[0]
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest" and "$" not in image, f"{name}: FROM {image}"


@pytest.mark.parametrize("name", IMAGES)
def test_runtime_stage_is_non_root_with_healthcheck_and_no_model(name: str):
    all_stages = stages(DOCKER / name)
    assert len(all_stages) >= 2, f"{name} must be multi-stage (build tools stay out of the runtime image)"
    final = all_stages[-1]
    user = instr(final, "USER")
    assert user and user[-1].split(":")[0] not in ("0", "root"), f"{name}: USER {user}"
    assert instr(final, "HEALTHCHECK"), f"{name}: no HEALTHCHECK"
    assert any("COPY --from=build /opt/specd /opt/specd" in ln for ln in final)
    text = " ".join(ln for st in all_stages for ln in st)  # instructions, not comments
    assert ".gguf" not in text and "models pull" not in text, f"{name} must not bake a model in"
    cmd = json.loads(instr(final, "CMD")[-1])
    assert cmd[0] == "specd", cmd


def test_dockerignore_keeps_builds_venvs_and_models_out():
    lines = {ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")}
    for needed in (".venv/", "build/", "models/", "**/*.gguf", "**/*.so", "**/.git"):
        assert needed in lines, f".dockerignore lacks {needed}"
    # and lets in what the Dockerfiles copy
    copied = {w for name in IMAGES for st in stages(DOCKER / name) for c in instr(st, "COPY")
              if not c.startswith("--from") for w in c.split()[:-1]}
    assert copied <= {"pyproject.toml", "README.md", "worker/", "gateway/", "docker/gateway_deps.py",
                      "docker/healthcheck.py"}, copied
    for path in copied:
        top = path.rstrip("/").split("/")[0]
        assert f"{top}/" not in lines and top not in lines, f".dockerignore excludes {path}, which an image copies"


# ---- the gateway image's dependencies ------------------------------------------------------

sys.path.insert(0, str(DOCKER))
import gateway_deps  # noqa: E402


def _imports(path: Path, functions: set[str] | None = None) -> set[str]:
    """Dotted modules imported by `path`: everywhere, or (functions given) at module level
    and inside those functions only."""
    tree = ast.parse(path.read_text())
    nodes: list[ast.AST] = []
    if functions is None:
        nodes = list(ast.walk(tree))
    else:
        for top in tree.body:
            if isinstance(top, ast.FunctionDef) and top.name in functions:
                nodes += list(ast.walk(top))
            elif not isinstance(top, (ast.FunctionDef, ast.ClassDef)):
                nodes += list(ast.walk(top))
    out = set()
    for n in nodes:
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
            out.add(n.module)
    return out


def test_gateway_image_dependencies_cover_its_imports():
    """Walks the imports of gateway/, the health check and the CLI paths the gateway image
    runs (`specd gateway`, `specd models pull|list`), following worker.* modules; every
    third-party module must come from a package gateway_deps installs."""
    provided = {m for mods in gateway_deps.GATEWAY_PACKAGES.values() for m in mods}
    stdlib = set(sys.stdlib_module_names)
    todo = [(p, None) for p in (ROOT / "gateway").glob("*.py")]
    todo += [(DOCKER / "healthcheck.py", None),
             (ROOT / "worker" / "cli.py", {"_cmd_gateway", "_cmd_models_pull", "_cmd_models_list", "main",
                                           "build_parser"} | {f"_add_{c}" for c in ("up", "worker", "gateway", "models",
                                                                                      "generate", "perplexity")})]
    seen, missing = set(), {}
    while todo:
        path, funcs = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for mod in _imports(path, funcs):
            top = mod.split(".")[0]
            if top in ("worker", "gateway"):
                target = ROOT.joinpath(*mod.split(".")).with_suffix(".py")
                if target.is_file():
                    todo.append((target, None))
                pkg_init = ROOT / top / "__init__.py"
                todo.append((pkg_init, None))
            elif top not in stdlib and top != "__future__" and top not in provided:
                missing.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    assert ROOT / "worker" / "generate.py" not in seen, "the gateway image must not need the engine"
    assert not missing, (f"imported by the gateway image but not installed there: {missing}; add the "
                         f"distribution to GATEWAY_PACKAGES in docker/gateway_deps.py")


def test_gateway_requirements_come_from_pyproject():
    reqs = gateway_deps.gateway_requirements(ROOT / "pyproject.toml")
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert reqs and set(reqs) <= set(deps)
    assert not any(r.split(">")[0].split("=")[0].strip().lower() in ("numpy", "gguf", "tokenizers") for r in reqs)


def test_gateway_deps_fails_on_a_package_missing_from_pyproject(tmp_path: Path, monkeypatch):
    monkeypatch.setitem(gateway_deps.GATEWAY_PACKAGES, "not-a-dependency", ("nada",))
    with pytest.raises(SystemExit, match="not-a-dependency"):
        gateway_deps.gateway_requirements(ROOT / "pyproject.toml")


def test_validate_deploy_lists_every_dockerfile():
    assert [p.name for p in vd.DOCKERFILES] == sorted(IMAGES)
