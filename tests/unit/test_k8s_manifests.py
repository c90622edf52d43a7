"""deploy/k8s offline: every core object validates against the Kubernetes API schema
(kubernetes-validate, strict: an unknown field fails); the KEDA ScaledObject and the
ServiceMonitor against the fields their docs define; and the manifests agree with the code and
with docker-compose on streams, consumer group, ports, roles and health checks."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from llmmesh import queue

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "deploy" / "k8s" / "base"
K8S_VERSION = "1.32.0"
CORE_KINDS = {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget",
              "NetworkPolicy", "StatefulSet"}


def _base_docs() -> list[dict]:
    listed = yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"]
    return [d for name in listed for d in yaml.safe_load_all((BASE / name).read_text()) if d]


def _by(docs, kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def test_every_core_object_validates_strictly():
    docs = _base_docs()
    assert {d["kind"] for d in docs} >= CORE_KINDS
    for doc in docs:
        if doc["kind"] in CORE_KINDS:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_a_wrong_field_is_refused():
    deployment = _by(_base_docs(), "Deployment")["llmmesh-gateway"]
    _container(deployment)["livenessProbe"]["periodSecond"] = 5    # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_keda_scales_workers_on_both_streams_lag_for_the_routers_group():
    docs = _base_docs()
    scaled = _by(docs, "ScaledObject")["llmmesh-worker"]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"]["name"] in _by(docs, "Deployment")
    assert set(scaled["spec"]) <= {"scaleTargetRef", "minReplicaCount", "maxReplicaCount",
                                   "pollingInterval", "cooldownPeriod", "triggers", "advanced",
                                   "idleReplicaCount", "fallback"}
    auth = _by(docs, "TriggerAuthentication")
    streams = set()
    for trigger in scaled["spec"]["triggers"]:
        assert trigger["type"] == "redis-streams"
        m = trigger["metadata"]
        # The redis-streams scaler's documented metadata keys; lag needs a consumer group.
        assert set(m) <= {"address", "host", "port", "stream", "consumerGroup", "lagCount",
                          "activationLagCount", "pendingEntriesCount", "streamLength",
                          "enableTLS", "databaseIndex", "usernameFromEnv", "passwordFromEnv"}
        assert m["consumerGroup"] == queue.ROUTER_GROUP and int(m["lagCount"]) > 0
        assert all(isinstance(v, str) for v in m.values())    # KEDA metadata is strings
        assert trigger["authenticationRef"]["name"] in auth
        streams.add(m["stream"])
    assert streams == {queue.queue_stream(c) for c in queue.CLASSES}
    params = {p["parameter"] for p in next(iter(auth.values()))["spec"]["secretTargetRef"]}
    assert params <= {"address", "host", "port", "username", "password", "tls", "ca", "cert", "key"}


def test_servicemonitor_scrapes_a_port_every_service_names():
    docs = _base_docs()
    monitor = _by(docs, "ServiceMonitor")["llmmesh"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    apps = set(monitor["spec"]["selector"]["matchExpressions"][0]["values"])
    services = {s["metadata"]["labels"]["app"]: s for s in _by(docs, "Service").values()
                if s["metadata"].get("labels", {}).get("app") in apps}
    assert set(services) == apps
    for endpoint in monitor["spec"]["endpoints"]:
        assert set(endpoint) <= {"port", "interval", "path", "scheme", "tlsConfig", "scrapeTimeout"}
        for svc in services.values():
            assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}


def test_each_service_runs_with_its_own_role_and_probes_it():
    deployments = _by(_base_docs(), "Deployment")
    ports = {"gateway": "50051", "router": "50052", "worker": "50061", "costd": "50055"}
    for role, port in ports.items():
        d = deployments[f"llmmesh-{role}"]
        c = _container(d)
        module = {"worker": "workers"}.get(role, role)
        assert c["args"][:3] == ["python", "-m", module]
        assert f"0.0.0.0:{port}" in c["args"]
        env = {e["name"]: e for e in c["env"]}
        assert env["LLMMESH_TLS_DIR"]["value"] == "/tls"
        volumes = {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == f"llmmesh-tls-{role}"
        probes = [c.get(k) for k in ("readinessProbe", "livenessProbe", "startupProbe") if c.get(k)]
        assert any(p.get("exec", {}).get("command") == [
            "python", "-m", "llmmesh.healthcheck", f"127.0.0.1:{port}", role] for p in probes), role
        assert d["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
        assert "9464" in c["args"] and {"name": "metrics", "containerPort": 9464} in c["ports"]


def test_compose_and_the_manifests_agree_on_public_ports_and_health_checks():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    deployments = _by(_base_docs(), "Deployment")
    gw = _container(deployments["llmmesh-gateway"])
    assert {p["containerPort"] for p in gw["ports"]} >= {50051, 8000}
    assert {"50051:50051", "8000:8000"} <= set(compose["gateway"]["ports"])
    for role in ("gateway", "router", "costd"):
        assert compose[role]["healthcheck"]["test"][-1] == role


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl missing: overlays not built")
@pytest.mark.parametrize("overlay,gpu", [("cpu", False), ("gpu", True)])
def test_overlays_build_and_validate(overlay, gpu):
    out = subprocess.run(["kubectl", "kustomize", str(ROOT / "deploy" / "k8s" / "overlays" / overlay)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    for doc in docs:
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "llmmesh"
        if doc["kind"] in CORE_KINDS:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    worker = _container(_by(docs, "Deployment")["llmmesh-worker"])
    assert worker["image"] == f"llmmesh:{overlay}"
    assert ("nvidia.com/gpu" in worker["resources"]["limits"]) is gpu
    assert {e["name"]: e.get("value") for e in worker["env"]}["LLMMESH_DEVICE"] == ("cuda" if gpu else "cpu")
    # The default-deny policy selects every pod by the kustomize label.
    for d in _by(docs, "Deployment").values():
        assert d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/part-of"] == "llmmesh"


def test_compose_prometheus_scrapes_every_service_where_it_serves_metrics():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]}
    mesh = {name for name, svc in services.items()
            if svc.get("command", [])[:2] == ["python", "-m"]
            and svc["command"][2] in ("gateway", "router", "workers", "costd")}
    port = services["gateway"]["environment"]["LLMMESH_METRICS_PORT"]
    assert targets == {f"{name}:{port}" for name in mesh}
    assert services["gateway"]["environment"]["LLMMESH_METRICS_HOST"] == "0.0.0.0"
    # Kubernetes scrapes the same port.
    gw = _container(_by(_base_docs(), "Deployment")["llmmesh-gateway"])
    assert gw["args"][gw["args"].index("--metrics-port") + 1] == port
    mounts = services["grafana"]["volumes"]
    assert any(m.startswith("./deploy/grafana/llmmesh.json:") for m in mounts)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool missing")
def test_compose_prometheus_config_is_valid():
    out = subprocess.run(["promtool", "check", "config", "prometheus.yml"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT / "deploy" / "prometheus")
    assert out.returncode == 0, out.stdout + out.stderr


def test_compose_fans_traces_out_through_a_collector_but_bills_go_straight_to_costd():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    endpoints = compose["router"]["environment"]["LLMMESH_OTLP_ENDPOINT"].split(",")
    # The router ships bills to the first endpoint (router/__main__.py): costd itself.
    assert endpoints[0] == "costd:50055" and "otel-collector:4317" in endpoints
    collector = yaml.safe_load((ROOT / "deploy" / "otel" / "collector.yaml").read_text())
    tls = collector["receivers"]["otlp"]["protocols"]["grpc"]["tls"]
    # Mutual TLS: services present their certificates and expect a costd-role one.
    assert tls["client_ca_file"] == "/tls/ca.pem" and tls["cert_file"] == "/tls/costd.pem"
    assert collector["service"]["pipelines"]["traces"]["exporters"] == ["otlp/jaeger"]
    assert "jaeger" in compose and "tls:/tls:ro" in compose["otel-collector"]["volumes"]
