"""deploy/k8s: every manifest parses and validates against vendored schemas, and the fields ops rely on hold.

Schemas: tests/data/k8s-schemas.json (Kubernetes 1.33 strict + KEDA 2.20 CRDs, made strict; written by
scripts/vendor_k8s_schemas.py, Apache-2.0). The GPU overlay is rendered with `kubectl kustomize` when
kubectl is installed (no cluster needed); its patch files are checked either way.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import tomllib
import yaml

from tests.unit.test_compose import _is_setting
from worker.settings import Settings

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
BASE, GPU = K8S / "base", K8S / "gpu"
SCHEMAS = json.loads((Path(__file__).parents[1] / "data" / "k8s-schemas.json").read_text(encoding="utf-8"))
# KEDA v2.20 redis-streams trigger metadata (pkg/scalers/redis_streams_scaler.go + redis_scaler.go) ...
KEDA_STREAMS_METADATA = {
    "stream",
    "consumerGroup",
    "pendingEntriesCount",
    "streamLength",
    "lagCount",
    "activationLagCount",
    "databaseIndex",
    "enableTLS",
    "unsafeSsl",
    "address",
    "addresses",
    "host",
    "hosts",
    "port",
    "ports",
    "username",
    "password",
    "addressFromEnv",
    "hostFromEnv",
    "portFromEnv",
    "usernameFromEnv",
    "passwordFromEnv",
}
# ... and what its TriggerAuthentication may supply
KEDA_REDIS_AUTH_PARAMS = {
    "address",
    "addresses",
    "host",
    "hosts",
    "port",
    "ports",
    "username",
    "password",
    "tls",
    "ca",
    "cert",
    "key",
    "keyPassword",
}


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


def _base() -> list[dict]:
    kust = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    return [d for f in kust["resources"] for d in _docs(BASE / f)]


def _one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def _kustomize(path: Path) -> list[dict] | None:
    if not shutil.which("kubectl"):
        return None
    out = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def base() -> list[dict]:
    return _base()


@pytest.fixture(scope="module")
def gpu() -> list[dict]:
    docs = _kustomize(GPU)
    if docs is None:
        pytest.skip("no kubectl to render the GPU overlay (its patch files are checked below)")
    return docs


def _validator(doc: dict) -> jsonschema.Draft202012Validator:
    kind = f"{doc['apiVersion']}/{doc['kind']}"
    name = SCHEMAS["kinds"][kind]
    schema = {"$defs": SCHEMAS["$defs"], "$ref": "#/$defs/" + name.replace("~", "~0").replace("/", "~1")}
    return jsonschema.Draft202012Validator(schema)


def _errors(doc: dict) -> list[str]:
    return [f"{doc['kind']} {'/'.join(map(str, e.path))}: {e.message}" for e in _validator(doc).iter_errors(doc)]


def _container(deployment: dict) -> dict:
    [c] = deployment["spec"]["template"]["spec"]["containers"]
    return c


# ------------------------------------------------------------------ parse + schemas
def test_every_manifest_parses_and_the_kustomizations_list_them():
    files = sorted(K8S.rglob("*.yaml"))
    assert {f.name for f in files} >= {
        "kustomization.yaml",
        "deployment.yaml",
        "configmap.yaml",
        "scaledobject.yaml",
        "secret.example.yaml",
        "deployment-gpu.yaml",
        "configmap-gpu.yaml",
    }
    for f in files:
        assert _docs(f), f
    listed = set(yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"])
    assert listed == {f.name for f in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    gpu = yaml.safe_load((GPU / "kustomization.yaml").read_text())
    assert gpu["resources"] == ["../base"]
    assert {p["path"] for p in gpu["patches"] if "path" in p} == {"deployment-gpu.yaml", "configmap-gpu.yaml"}


def test_base_manifests_match_their_schemas(base):
    docs = base + _docs(K8S / "secret.example.yaml")
    assert {d["kind"] for d in docs} == {"ConfigMap", "Deployment", "ScaledObject", "TriggerAuthentication", "Secret"}
    errors = [e for d in docs for e in _errors(d)]
    assert not errors, "\n".join(errors)


def test_rendered_overlays_match_their_schemas(gpu):
    docs = gpu + _kustomize(BASE)
    errors = [e for d in docs for e in _errors(d)]
    assert not errors, "\n".join(errors)


def test_schemas_catch_misspelt_fields(base):
    """The vendored schemas are strict (so the tests above can fail)."""
    dep = json.loads(json.dumps(_one(base, "Deployment")))
    _container(dep)["livenessProbe"]["periodSecond"] = 30
    assert _errors(dep)
    so = json.loads(json.dumps(_one(base, "ScaledObject")))
    so["spec"]["scaleTargetRef"]["nmae"] = so["spec"]["scaleTargetRef"].pop("name")
    assert _errors(so)
    cm = json.loads(json.dumps(_one(base, "ConfigMap")))
    cm["data"]["TRIAGE_WINDOW_MAX_ITEMS"] = 64  # must be a string
    assert _errors(cm)


# ------------------------------------------------------------------ the worker Deployment
def test_probes_run_the_healthcheck_of_this_pod(base):
    c = _container(_one(base, "Deployment", "triage-worker"))
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    for probe, ready in (("startupProbe", "--ready "), ("livenessProbe", ""), ("readinessProbe", "--ready ")):
        cmd = c[probe]["exec"]["command"]
        assert cmd[:2] == ["sh", "-c"], probe
        # one GET of this pod's heartbeat (--host would SCAN the whole keyspace, result keys included, per probe);
        # startup and readiness wait for the model: a rollout stops an old pod only once the new one can work
        want = rf'exec triage-worker healthcheck --quiet {ready}--consumer "\$\(hostname\)"'
        assert re.fullmatch(want, cmd[2]), cmd
        assert c[probe]["timeoutSeconds"] >= 10  # one healthcheck: ~1.7 s wall, 0.6 CPU-s measured
    assert "triage-worker" in scripts
    assert re.search(r'exec triage-worker run --consumer "\$\(hostname\)"', c["command"][-1])
    start = c["startupProbe"]
    assert start["periodSeconds"] * start["failureThreshold"] >= 180  # model load before liveness counts
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 2 * Settings().heartbeat_ttl_s


def test_pods_get_no_service_link_variables(base, gpu):
    """Kubernetes gives every pod TRIAGE_REDIS_PORT=tcp://... for a Service named triage-redis (TRIAGE_METRICS_PORT
    for triage-metrics, a real setting): settings come from the ConfigMap and the Secret only."""
    for rendered in (base, gpu):
        assert _one(rendered, "Deployment", "triage-worker")["spec"]["template"]["spec"]["enableServiceLinks"] is False


def test_resources_and_threads_fit(base):
    dep = _one(base, "Deployment", "triage-worker")
    c = _container(dep)
    req, lim = c["resources"]["requests"], c["resources"]["limits"]
    assert {"cpu", "memory"} <= set(req) and "memory" in lim
    assert "cpu" not in lim  # throttling would starve the exec probes beside a busy model
    assert "nvidia.com/gpu" not in req and "nvidia.com/gpu" not in lim  # CPU base
    data = _one(base, "ConfigMap", "triage-config")["data"]
    assert int(data["TRIAGE_TORCH_THREADS"]) == int(req["cpu"])
    grace_s = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace_s >= 2 * float(data["TRIAGE_WINDOW_TARGET_S"]) + 30 >= 30  # a warm stop: two windows' work
    assert dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_metrics_port_is_one_number_in_the_configmap_the_pod_and_its_scrape_annotation(base):
    """The manifests served no metrics: nothing set TRIAGE_METRICS_PORT, and no port or annotation named one."""
    port = _one(base, "ConfigMap", "triage-config")["data"]["TRIAGE_METRICS_PORT"]
    assert Settings(metrics_port=port).metrics_port > 0
    pod = _one(base, "Deployment", "triage-worker")["spec"]["template"]
    (named,) = [p for p in _container(_one(base, "Deployment", "triage-worker"))["ports"] if p["name"] == "metrics"]
    notes = pod["metadata"]["annotations"]
    assert str(named["containerPort"]) == port == notes["prometheus.io/port"]
    assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/path"] == "/metrics"


def test_configmap_names_are_settings_and_no_secret_is_inlined(base):
    cm = _one(base, "ConfigMap", "triage-config")
    for name, value in cm["data"].items():
        assert name.startswith("TRIAGE_") and _is_setting(name), name
        assert not re.search(r"://[^/]*@|password", f"{name}={value}", re.I), name
    assert "TRIAGE_REDIS_URL" not in cm["data"]
    assert not [d for d in base if d["kind"] == "Secret"]  # the Secret is created out of band
    c = _container(_one(base, "Deployment", "triage-worker"))
    [url] = [e for e in c["env"] if e["name"] == "TRIAGE_REDIS_URL"]
    assert set(url) == {"name", "valueFrom"} and url["valueFrom"]["secretKeyRef"]["name"] == "triage-redis"
    assert c["envFrom"] == [{"configMapRef": {"name": "triage-config"}}]


def test_secret_example_has_every_key_the_manifests_read_and_only_placeholders(base):
    secret = _one(_docs(K8S / "secret.example.yaml"), "Secret", "triage-redis")
    c = _container(_one(base, "Deployment", "triage-worker"))
    read = {e["valueFrom"]["secretKeyRef"]["key"] for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    auth = _one(base, "TriggerAuthentication", "triage-redis")
    read |= {ref["key"] for ref in auth["spec"]["secretTargetRef"] if ref["name"] == secret["metadata"]["name"]}
    assert read == set(secret["stringData"])
    assert all("CHANGE-ME" in v for v in secret["stringData"].values())


# ------------------------------------------------------------------ KEDA
def test_scaledobject_targets_the_worker_on_the_real_stream_and_group(base):
    so = _one(base, "ScaledObject", "triage-worker")
    dep = _one(base, "Deployment")
    ref = so["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == ("apps/v1", "Deployment", dep["metadata"]["name"])
    assert 1 <= so["spec"]["minReplicaCount"] <= so["spec"]["maxReplicaCount"]
    data = _one(base, "ConfigMap", "triage-config")["data"]
    triggers = {t["name"]: t for t in so["spec"]["triggers"]}
    assert set(triggers) == {"waiting", "in-flight"}
    url = _one(_docs(K8S / "secret.example.yaml"), "Secret", "triage-redis")["stringData"]["TRIAGE_REDIS_URL"]
    db = url.rsplit("/", 1)[1]
    for t in triggers.values():
        meta = t["metadata"]
        assert t["type"] == "redis-streams"
        assert set(meta) <= KEDA_STREAMS_METADATA, set(meta) - KEDA_STREAMS_METADATA
        assert meta["stream"] == data["TRIAGE_INPUT_STREAM"] and meta["consumerGroup"] == data["TRIAGE_GROUP"]
        assert all(isinstance(v, str) for v in meta.values())  # KEDA metadata values are strings
        assert "password" not in meta and "address" not in meta  # from the TriggerAuthentication
        assert t["authenticationRef"]["name"] == "triage-redis"
        assert meta["databaseIndex"] == db  # KEDA would watch another database than the worker reads
    assert int(triggers["waiting"]["metadata"]["lagCount"]) > 0  # lag mode (needs Redis >= 7)
    assert "lagCount" not in triggers["in-flight"]["metadata"]  # pending-entries mode
    window = int(data["TRIAGE_WINDOW_MAX_ITEMS"])
    assert int(triggers["in-flight"]["metadata"]["pendingEntriesCount"]) == 2 * window  # window + prefetched one


def test_trigger_authentication_reads_the_workers_secret(base):
    auth = _one(base, "TriggerAuthentication", "triage-redis")
    c = _container(_one(base, "Deployment", "triage-worker"))
    secret_names = {e["valueFrom"]["secretKeyRef"]["name"] for e in c["env"] if "valueFrom" in e}
    for ref in auth["spec"]["secretTargetRef"]:
        assert ref["parameter"] in KEDA_REDIS_AUTH_PARAMS and ref["name"] in secret_names
    assert {r["parameter"] for r in auth["spec"]["secretTargetRef"]} >= {"address", "password"}


# ------------------------------------------------------------------ GPU
def test_gpu_patch_asks_one_gpu_per_pod_on_gpu_nodes():
    patch = _docs(GPU / "deployment-gpu.yaml")[0]
    spec = patch["spec"]["template"]["spec"]
    [c] = spec["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["resources"]["requests"].get("nvidia.com/gpu", 1) == 1
    assert spec["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    assert patch["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0  # no spare GPU for a surge pod
    cm = _docs(GPU / "configmap-gpu.yaml")[0]["data"]
    assert cm["TRIAGE_DEVICE"] == "cuda" and all(_is_setting(k) for k in cm)


def test_rendered_gpu_overlay(gpu):
    dep = _one(gpu, "Deployment", "triage-worker")
    c = _container(dep)
    assert c["image"].endswith(":gpu")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert _container(_one(gpu, "Deployment"))["startupProbe"]  # probes kept from the base
    data = _one(gpu, "ConfigMap", "triage-config")["data"]
    assert data["TRIAGE_DEVICE"] == "cuda" and data["TRIAGE_INPUT_STREAM"] == "triage:tickets"
    assert int(data["TRIAGE_TORCH_THREADS"]) == int(c["resources"]["requests"]["cpu"])
    so = _one(gpu, "ScaledObject", "triage-worker")
    assert so["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
    assert so["spec"]["triggers"][0]["name"] == "waiting"  # the JSON patch replaced the lag trigger's target
    # the GPU window (not the base's 64, which would cap every pass at 64) and the in-flight trigger that follows it
    window = int(data["TRIAGE_WINDOW_MAX_ITEMS"])
    assert window >= 4096
    in_flight = next(t for t in so["spec"]["triggers"] if t["name"] == "in-flight")
    assert int(in_flight["metadata"]["pendingEntriesCount"]) == 2 * window
