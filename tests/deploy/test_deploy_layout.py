"""The shape of the compose stack and the Helm release, as their own tools resolve them:
Redis persistence, ports, start-up order, health checks, the model volume, what each
profile starts; and for the chart the objects the issue lists, probes on /health and /ready,
security contexts, scrape config, and the external-Redis variant."""

from __future__ import annotations

import pytest
from deploy_helpers import find, pod_specs, vd

# ---- compose ------------------------------------------------------------------------------


def test_compose_redis_persists_queued_jobs(compose_all):
    redis = compose_all["services"]["redis"]
    cmd = redis["command"]
    assert cmd[cmd.index("--appendonly") + 1] == "yes", "append-only file: queued jobs survive a restart"
    [vol] = redis["volumes"]
    assert vol["type"] == "volume" and vol["target"] == "/data" and vol["source"] in compose_all["volumes"]
    assert "ports" not in redis, "Redis stays on the compose network"
    assert redis["healthcheck"]["test"][1:] == ["redis-cli", "ping"]


def test_compose_gateway_on_8000_after_redis(compose_all):
    gw = compose_all["services"]["gateway"]
    [port] = gw["ports"]
    assert port["target"] == 8000 and port["published"] == "8000"
    assert gw["depends_on"]["redis"]["condition"] == "service_healthy"
    assert gw["environment"]["SPECD_REDIS_URL"] == "redis://redis:6379/0"


def test_compose_workers_share_the_model_volume_and_wait_for_it(compose_all):
    services = compose_all["services"]
    workers = {n: s for n, s in services.items() if n.startswith("worker-")}
    for name, svc in {**workers, "models": services["models"]}.items():
        mounts = {v["target"]: v for v in svc["volumes"]}
        assert mounts["/data"]["source"] == "models", f"{name}: model volume at SPECD_HOME=/data"
    for name, svc in workers.items():
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy", name
        assert svc["depends_on"]["models"]["condition"] == "service_completed_successfully", name
        assert svc["healthcheck"]["test"] == ["CMD", "specd-healthcheck", "worker"], name
        assert svc["environment"]["SPECD_REDIS_URL"] == "redis://redis:6379/0", name
        assert svc["stop_grace_period"], f"{name}: give the running generation time to finish"
    assert services["models"]["restart"] == "no"


@pytest.mark.parametrize("profiles,expected", [
    ([], {"redis", "gateway"}),
    (["cpu"], {"redis", "gateway", "models", "worker-cpu"}),
    (["cuda"], {"redis", "gateway", "models", "worker-cuda-0"}),
    (["cuda-x2"], {"redis", "gateway", "models", "worker-cuda-0", "worker-cuda-1"}),
    (["rocm"], {"redis", "gateway", "models", "worker-rocm-0"}),
    (["cuda", "rocm"], {"redis", "gateway", "models", "worker-cuda-0", "worker-rocm-0"}),
])
def test_compose_profiles_start_the_right_services(tools, profiles, expected):
    assert set(vd.compose_model(vd.COMPOSE_FILE, profiles)["services"]) == expected


def test_compose_variables_reach_the_services(tools):
    import json
    import subprocess

    env = {**vd._clean_env(), "SPECD_MODEL": "/data/models/m.gguf", "SPECD_CUDA_GPU_1": "3",
           "SPECD_ROCM_GPU_0": "2", "SPECD_PORT": "9000", "SPECD_RENDER_GID": "109"}
    res = subprocess.run([str(vd.compose_path()), "-f", str(vd.COMPOSE_FILE), "--profile", "*", "config",
                          "--format", "json"], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    s = json.loads(res.stdout)["services"]
    assert s["worker-cuda-1"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["3"]
    assert s["worker-rocm-0"]["environment"]["ROCR_VISIBLE_DEVICES"] == "2"
    assert "109" in s["worker-rocm-0"]["group_add"]
    assert s["gateway"]["ports"][0]["published"] == "9000"
    assert s["worker-cpu"]["command"][s["worker-cpu"]["command"].index("--model") + 1] == "/data/models/m.gguf"
    assert s["models"]["environment"]["SPECD_MODEL"] == "/data/models/m.gguf"


# ---- Helm ---------------------------------------------------------------------------------


def test_helm_default_is_a_cpu_deployment(rendered):
    docs = rendered["default"]
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {("Deployment", "specd-gateway"), ("Service", "specd-gateway"), ("StatefulSet", "specd-redis"),
            ("Service", "specd-redis"), ("Secret", "specd-redis"), ("Deployment", "specd-worker-cpu"),
            ("PodDisruptionBudget", "specd-gateway"), ("PodDisruptionBudget", "specd-worker-cpu")} <= names
    assert not find(docs, "ScaledObject") and not find(docs, "Ingress") and not find(docs, "ServiceMonitor")
    worker = find(docs, "Deployment", "specd-worker-cpu")[0]["spec"]["template"]["spec"]
    [init] = worker["initContainers"]
    assert init["args"] == ["specd", "models", "pull", "--quiet", "demo"], "the demo model is pulled first"
    assert "/gpu" not in str(worker["containers"][0]["resources"])


def test_helm_redis_is_persistent_and_password_protected(rendered):
    docs = rendered["default"]
    sts = find(docs, "StatefulSet", "specd-redis")[0]
    [claim] = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"
    redis = sts["spec"]["template"]["spec"]["containers"][0]
    args = redis["args"]
    assert args[args.index("--appendonly") + 1] == "yes" and "--requirepass" in args
    secret = find(docs, "Secret", "specd-redis")[0]
    assert len(secret["data"]["redis-password"]) >= 32
    for _, spec in pod_specs(docs):
        for c in spec["containers"]:
            env = {e["name"]: e for e in c.get("env", [])}
            if c["name"] in ("gateway", "worker"):
                assert env["SPECD_REDIS_URL"]["value"] == "redis://:$(REDIS_PASSWORD)@specd-redis:6379/0"
                # Kubernetes expands $(VAR) only from variables defined earlier in the list
                names = [e["name"] for e in c["env"]]
                assert names.index("REDIS_PASSWORD") < names.index("SPECD_REDIS_URL")


def test_helm_probes_and_scrape_config(rendered):
    for values, docs in rendered.items():
        gw = find(docs, "Deployment", "specd-gateway")[0]["spec"]["template"]
        c = gw["spec"]["containers"][0]
        assert c["livenessProbe"]["httpGet"]["path"] == "/health"
        assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
        ann = gw["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics"
        assert ann["prometheus.io/port"] == str(c["ports"][0]["containerPort"]) == "8000"
    [sm] = find(rendered["mixed-gpu"], "ServiceMonitor")
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    svc = find(rendered["mixed-gpu"], "Service", "specd-gateway")[0]
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()


def test_helm_pods_run_locked_down(rendered):
    for values, docs in rendered.items():
        for workload, spec in pod_specs(docs):
            psc = spec["securityContext"]
            assert psc["runAsNonRoot"] is True and psc["seccompProfile"]["type"] == "RuntimeDefault", workload
            assert spec["automountServiceAccountToken"] is False, workload
            for c in spec["containers"] + spec.get("initContainers", []):
                sc = c["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True, workload
                assert sc["capabilities"]["drop"] == ["ALL"], workload
                assert c["resources"].get("requests"), f"{workload}/{c['name']}: no resource requests"


def test_helm_selectors_match_their_pods(rendered):
    for values, docs in rendered.items():
        for d in docs:
            if d["kind"] in ("Deployment", "StatefulSet"):
                sel = d["spec"]["selector"]["matchLabels"]
                assert sel.items() <= d["spec"]["template"]["metadata"]["labels"].items(), d["metadata"]["name"]
            if d["kind"] == "PodDisruptionBudget":
                sel = d["spec"]["selector"]["matchLabels"]
                targets = [w for w in docs if w["kind"] in ("Deployment", "StatefulSet")
                           and sel.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
                assert len(targets) == 1, f"PDB {d['metadata']['name']} selects {len(targets)} workloads"


def test_helm_mixed_example_has_both_pools_behind_one_gateway(rendered):
    docs = rendered["mixed-gpu"]
    assert len(find(docs, "Deployment", "specd-gateway")) == 1
    workers = {d["metadata"]["name"]: d for d in find(docs, "Deployment") if "-worker-" in d["metadata"]["name"]}
    assert set(workers) == {"specd-worker-nvidia", "specd-worker-amd"}
    amd = workers["specd-worker-amd"]["spec"]["template"]["spec"]
    assert amd["securityContext"]["supplementalGroups"], "non-root access to /dev/kfd and /dev/dri"
    assert amd["securityContext"]["runAsNonRoot"] is True, "pool podSecurityContext merges over the chart's"
    for d in workers.values():
        assert d["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0, "no surge pod waiting for a GPU"
    assert find(docs, "Ingress") and find(docs, "PersistentVolumeClaim", "specd-models")


def test_helm_external_redis(tools):
    res, docs = vd.helm_template(vd.CHART, [], sets=[
        "redis.enabled=false", "externalRedis.host=redis.infra.svc", "externalRedis.port=6380",
        "externalRedis.db=2", "externalRedis.tls=true", "externalRedis.existingSecret=redis-cred",
        "pools[0].name=cpu", "pools[0].keda.enabled=true"])
    assert res.ok, res.line()
    assert not find(docs, "StatefulSet") and not find(docs, "Secret")
    c = find(docs, "Deployment", "specd-gateway")[0]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    assert env["SPECD_REDIS_URL"]["value"] == "rediss://:$(REDIS_PASSWORD)@redis.infra.svc:6380/2"
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "redis-cred"
    [so] = find(docs, "ScaledObject")
    md = so["spec"]["triggers"][0]["metadata"]
    assert md["address"] == "redis.infra.svc:6380" and md["databaseIndex"] == "2" and md["enableTLS"] == "true"
    assert find(docs, "TriggerAuthentication")[0]["spec"]["secretTargetRef"][0]["name"] == "redis-cred"
    assert vd.validate_manifests(docs, "external redis").ok
