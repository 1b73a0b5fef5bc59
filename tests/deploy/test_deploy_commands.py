"""Every `specd ...` command line in the compose file, the rendered Helm chart and the image
CMDs parses with the CLI's real parser (worker.cli.build_parser), option names spelt exactly
(argparse would accept an abbreviation, hiding a renamed flag), so a renamed or removed flag
breaks CI instead of a deployment. Also: each GPU worker gets exactly one GPU and runs on
device 0 of its vendor, every health probe is a form specd-healthcheck accepts, and the KEDA
queue names are the ones the workers serve (worker.protocol.Keys + rq's queue prefix)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shlex
import sys

import pytest
from deploy_helpers import ROOT, VALUE_SETS, find, pod_specs

from worker.cli import build_parser

sys.path.insert(0, str(ROOT / "docker"))
import healthcheck  # noqa: E402

SHELL_SEPARATORS = {";", ";;", "&&", "||", "|", "(", ")", "&"}


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert actions and name in actions[0].choices, f"no subcommand {name!r} in `{parser.prog}`"
    return actions[0].choices[name]


def parse_specd(argv: list[str]) -> argparse.Namespace:
    """Parses argv (starting with 'specd') like `specd` would; fails the test, quoting the
    parser's error, when it would not start."""
    assert argv[0] == "specd", argv
    parser = build_parser()
    sub = _subparser(parser, argv[1])
    rest = argv[2:]
    if argv[1] == "models":
        sub, rest = _subparser(sub, argv[2]), argv[3:]
    options = {s for a in sub._actions for s in a.option_strings}
    for tok in rest:
        if tok.startswith("--") or re.fullmatch(r"-[A-Za-z]", tok):
            assert tok.split("=")[0] in options, \
                f"{shlex.join(argv)}: `specd {argv[1]}` has no option {tok!r} (it has {sorted(options)})"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"`{shlex.join(argv)}` does not parse: {err.getvalue().strip()}")


def specd_in_shell(script: str) -> list[list[str]]:
    """The `specd ...` command lines inside a shell script (`exec specd ...` included)."""
    lex = shlex.shlex(script, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    tokens, out, cur = list(lex), [], None
    for tok in tokens:
        if cur is not None and tok in SHELL_SEPARATORS:
            out.append(cur)
            cur = None
        elif cur is not None:
            cur.append(tok)
        elif tok == "specd":
            cur = ["specd"]
    if cur:
        out.append(cur)
    return out


# ---- compose --------------------------------------------------------------------------


def compose_commands(model: dict) -> dict[str, list[list[str]]]:
    """service -> its specd command lines ($$ of the compose file unescaped)."""
    out = {}
    for name, svc in model["services"].items():
        cmd = [c.replace("$$", "$") for c in (svc.get("command") or [])]
        if cmd[:1] == ["specd"]:
            out[name] = [cmd]
        elif cmd[:2] in (["/bin/sh", "-c"], ["sh", "-c"]):
            out[name] = specd_in_shell(cmd[2])
    return out


def test_compose_commands_parse_with_the_cli(compose_all):
    commands = compose_commands(compose_all)
    assert {"gateway", "models", "worker-cpu", "worker-cuda-0", "worker-rocm-0"} <= set(commands)
    for name, argvs in commands.items():
        assert argvs, f"service {name}: no specd command found"
        for argv in argvs:
            parse_specd(argv)


@pytest.mark.parametrize("with_example", [False, True], ids=["compose.yaml", "+more-gpus.example.yaml"])
def test_compose_gpu_workers_get_one_gpu_each(compose_all, with_example: bool):
    from deploy_helpers import vd

    model = vd.compose_model([vd.COMPOSE_FILE, vd.COMPOSE_EXAMPLE], ["*"]) if with_example else compose_all
    services = model["services"]
    cuda = {n: s for n, s in services.items() if n.startswith("worker-cuda")}
    rocm = {n: s for n, s in services.items() if n.startswith("worker-rocm")}
    assert len(cuda) >= 2 + with_example and len(rocm) >= 2 + with_example
    ids = []
    for name, svc in cuda.items():
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1 and devices[0]["driver"] == "nvidia" and len(devices[0]["device_ids"]) == 1, name
        assert "count" not in devices[0], f"{name}: reserve by device_ids, not count"
        ids.append(devices[0]["device_ids"][0])
        assert parse_specd(svc["command"]).device == "cuda:0", f"{name}: sees only its GPU, as cuda:0"
        assert "CUDA_VISIBLE_DEVICES" not in (svc.get("environment") or {}), \
            f"{name}: the reservation already isolates the GPU; a host index here would hide it"
    assert len(set(ids)) == len(ids), f"two NVIDIA workers on one GPU: {ids}"
    ids = []
    for name, svc in rocm.items():
        env = svc["environment"]
        assert re.fullmatch(r"\d+|GPU-[0-9a-fA-F]+", env["ROCR_VISIBLE_DEVICES"]), name  # exactly one GPU
        assert env.get("HIP_VISIBLE_DEVICES", "0") == "0", name
        ids.append(env["ROCR_VISIBLE_DEVICES"])
        assert {d["source"] for d in svc["devices"]} == {"/dev/kfd", "/dev/dri"}, name
        assert svc.get("group_add"), f"{name}: the non-root worker needs the video/render groups"
        assert parse_specd(svc["command"]).device == "hip:0", name
    assert len(set(ids)) == len(ids), f"two AMD workers on one GPU: {ids}"
    cpu = services["worker-cpu"]
    assert parse_specd(cpu["command"]).device == "cpu" and "deploy" not in cpu and "devices" not in cpu


def test_compose_healthchecks_are_accepted_forms(compose_all):
    for name, svc in compose_all["services"].items():
        test = (svc.get("healthcheck") or {}).get("test") or []
        if "specd-healthcheck" in test:
            assert test[0] == "CMD" and test[1] == "specd-healthcheck", name
            assert tuple(test[2:]) in healthcheck.FORMS, f"{name}: {test}"


# ---- Helm -------------------------------------------------------------------------------


def _containers(spec: dict):
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


@pytest.mark.parametrize("values", VALUE_SETS)
def test_helm_commands_parse_with_the_cli(rendered, values: str):
    found = 0
    for workload, spec in pod_specs(rendered[values]):
        for c in _containers(spec):
            if "redis" in workload:
                continue
            assert "command" not in c, f"{workload}/{c['name']}: keep the image ENTRYPOINT (tini)"
            assert c["args"][0] == "specd", f"{workload}/{c['name']}: {c['args']}"
            parse_specd(c["args"])
            found += 1
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                cmd = (c.get(probe) or {}).get("exec", {}).get("command")
                if cmd:
                    assert cmd[0] == "specd-healthcheck" and tuple(cmd[1:]) in healthcheck.FORMS, cmd
    assert found >= 2


@pytest.mark.parametrize("values", VALUE_SETS)
def test_helm_gpu_pools_get_one_gpu_per_pod(rendered, values: str):
    workers = [d for d in find(rendered[values], "Deployment") if "-worker-" in d["metadata"]["name"]]
    assert workers
    vendors = set()
    for dep in workers:
        c = dep["spec"]["template"]["spec"]["containers"][0]
        device = parse_specd(c["args"]).device
        limits = c.get("resources", {}).get("limits", {})
        gpus = {k: v for k, v in limits.items() if k.endswith("/gpu")}
        if device == "cpu":
            assert not gpus, dep["metadata"]["name"]
            continue
        assert len(gpus) == 1 and list(gpus.values()) == [1], f"{dep['metadata']['name']}: {limits}"
        resource = next(iter(gpus))
        assert device == {"nvidia.com/gpu": "cuda:0", "amd.com/gpu": "hip:0"}[resource], (resource, device)
        vendors.add(resource)
    if values == "mixed-gpu":
        assert vendors == {"nvidia.com/gpu", "amd.com/gpu"}


def test_keda_watches_the_queue_the_workers_serve(rendered):
    from rq import Queue

    from worker.protocol import Keys
    from worker.service import served_name

    docs = rendered["mixed-gpu"]
    scaled = find(docs, "ScaledObject")
    assert len(scaled) == 2
    for so in scaled:
        dep = find(docs, "Deployment", so["spec"]["scaleTargetRef"]["name"])[0]
        ns = parse_specd(dep["spec"]["template"]["spec"]["containers"][0]["args"])
        env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
        queue = Keys(env["SPECD_REDIS_PREFIX"]).queue(served_name(ns.model, ns.name))
        [trigger] = so["spec"]["triggers"]
        assert trigger["type"] == "redis"
        assert trigger["metadata"]["listName"] == Queue.redis_queue_namespace_prefix + queue
        assert "replicas" not in dep["spec"], "KEDA owns the replica count of a scaled pool"


def test_served_name_of_a_path_model_matches_the_worker(tools):
    """The chart derives a pool's model name (for KEDA) as worker.service.served_name does."""
    from deploy_helpers import vd

    from worker.service import served_name

    for model in ("/data/models/Qwen3-8B-Q4_K_M.gguf", "/data/m/a.b.GGUF", "demo"):
        res, docs = vd.helm_template(vd.CHART, [], sets=["pools[0].name=p", f"pools[0].model={model}",
                                                         "pools[0].keda.enabled=true", "pools[0].pullModel=false"])
        assert res.ok, res.line()
        [so] = find(docs, "ScaledObject")
        assert so["spec"]["triggers"][0]["metadata"]["listName"].endswith(":model:" + served_name(model)), model


# ---- Dockerfiles ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gateway", "worker-cpu", "worker-cuda12", "worker-rocm"])
def test_image_cmd_parses_with_the_cli(name: str):
    text = (ROOT / "docker" / f"{name}.Dockerfile").read_text()
    cmd = json.loads(re.findall(r"^CMD (\[.*\])$", text, re.M)[-1])
    ns = parse_specd(cmd)
    expected = {"gateway": None, "worker-cpu": "cpu", "worker-cuda12": "cuda:0", "worker-rocm": "hip:0"}[name]
    assert getattr(ns, "device", None) == expected
    hc = json.loads(re.findall(r"^HEALTHCHECK .* CMD (\[.*\])$", text, re.M)[-1])
    assert hc[0] == "specd-healthcheck" and tuple(hc[1:]) in healthcheck.FORMS


def test_flag_check_catches_a_renamed_flag():
    """The checks above are only worth something if a wrong flag fails them."""
    with pytest.raises(AssertionError, match="has no option '--devices'"):
        parse_specd(["specd", "worker", "--model", "demo", "--devices", "cuda:0"])
    with pytest.raises(pytest.fail.Exception, match="argument --device"):
        parse_specd(["specd", "worker", "--device", "gpu0"])
    with pytest.raises(AssertionError, match="has no option '--dev'"):
        parse_specd(["specd", "worker", "--dev", "cpu"])  # argparse alone would take the abbreviation
    assert specd_in_shell('case "$M" in *.gguf) test -f "$M" ;; *) exec specd models pull --quiet "$M" ;; esac') \
        == [["specd", "models", "pull", "--quiet", "$M"]]
