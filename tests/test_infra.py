"""What a team deploys: the compose file, the Kubernetes manifests, the Grafana dashboard and the work pool
template are valid and agree with the code (services, ports, metric names)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

INFRA = Path(__file__).resolve().parents[1] / "infra"
NEEDED = {"postgres", "redis", "minio", "prefect", "worker", "mlflow", "serving", "evidently", "prometheus", "grafana"}


def test_compose_file_is_complete_and_consistent():
    compose = yaml.safe_load((INFRA / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) >= NEEDED
    for name, service in services.items():
        assert "healthcheck" in service, f"{name} has no health check"
        assert "image" in service or "build" in service, name
        for dependency in service.get("depends_on", {}):
            assert dependency in services, f"{name} depends on unknown {dependency}"
        if "build" in service:
            assert (INFRA.parent / service["build"]["dockerfile"]).exists()
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert source in compose["volumes"] or (INFRA / source).exists(), f"{name}: {source}"
    worker_gpu = services["worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert worker_gpu["capabilities"] == ["gpu"]
    env = compose["x-recloop-env"]
    assert env["RECLOOP_FEAST_ONLINE_STORE"] == "redis" and env["RECLOOP_MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    from recloop.settings import Settings

    known = {f"RECLOOP_{name.upper()}" for name in Settings.model_fields}
    assert {k for k in env if k.startswith("RECLOOP_")} <= known  # every setting named exists


def _compose_available() -> bool:
    return shutil.which("docker") is not None and subprocess.run(
        ["docker", "compose", "version"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _compose_available(), reason="docker compose is not installed here")
def test_compose_config_with_docker():
    subprocess.run(["docker", "compose", "-f", str(INFRA / "compose.yaml"), "config", "-q"], check=True)


MANIFESTS = ("recloop.yaml", "serving-autoscaling.yaml")


def _documents() -> list[dict]:
    return [d for name in MANIFESTS for d in yaml.safe_load_all((INFRA / "k8s" / name).read_text()) if d]


def _one(documents: list[dict], kind: str, name: str) -> dict:
    return next(d for d in documents if d["kind"] == kind and d["metadata"]["name"] == name)


def test_kubernetes_manifests_parse_and_request_a_gpu():
    documents = _documents()
    kinds = {(d["kind"], d["metadata"]["name"]) for d in documents}
    assert {("Deployment", "serving"), ("Deployment", "prefect-worker"), ("Service", "serving"),
            ("ConfigMap", "recloop-config"), ("HorizontalPodAutoscaler", "serving"),
            ("PodDisruptionBudget", "serving")} <= kinds
    serving = _one(documents, "Deployment", "serving")
    assert _one(documents, "HorizontalPodAutoscaler", "serving")["spec"]["minReplicas"] > 1
    assert serving["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/healthz"
    template = json.loads((INFRA / "k8s" / "work-pool.json").read_text())
    container = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_grafana_dashboard_uses_metrics_the_services_export():
    from recloop.serve.metrics import ServingMetrics

    exported = set()
    for family in ServingMetrics(Path("/nonexistent")).registry.collect():
        exported.update({family.name, f"{family.name}_total"} if family.type == "counter" else {family.name})
        exported.update(sample.name for sample in family.samples)
    dashboard = json.loads((INFRA / "grafana" / "dashboards" / "recloop.json").read_text())
    used = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            used.update(re.findall(r"recloop_[a-z0-9_]+", target["expr"]))
    assert used, "no panel queries a recloop metric"
    missing = {name for name in used if name not in exported and name.removesuffix("_bucket") not in exported}
    assert not missing, missing
    provisioning = yaml.safe_load((INFRA / "grafana" / "provisioning" / "dashboards" / "recloop.yaml").read_text())
    assert provisioning["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"


def test_kubernetes_manifests_pass_the_schema_validator():
    """Every object against the Kubernetes OpenAPI schemas (kubernetes-validate, strict: unknown fields
    fail too), and a broken object fails, so the check is not a no-op."""
    import kubernetes_validate

    for document in _documents():
        kubernetes_validate.validate(document, "1.37.0", strict=True)
    broken = _one(_documents(), "HorizontalPodAutoscaler", "serving")
    broken["spec"]["minReplicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, "1.37.0", strict=True)
    misspelt = _one(_documents(), "PodDisruptionBudget", "serving")
    misspelt["spec"]["maxUnavialable"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(misspelt, "1.37.0", strict=True)


def test_serving_autoscaling_fits_the_deployment_and_the_metrics_it_exports():
    from recloop.serve.metrics import ServingMetrics

    documents = _documents()
    serving = _one(documents, "Deployment", "serving")
    autoscaler = _one(documents, "HorizontalPodAutoscaler", "serving")
    budget = _one(documents, "PodDisruptionBudget", "serving")
    assert autoscaler["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "serving"}
    assert "replicas" not in serving["spec"]  # the autoscaler owns the count; a re-apply must not reset it
    labels = serving["spec"]["template"]["metadata"]["labels"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert budget["spec"]["maxUnavailable"] < autoscaler["spec"]["minReplicas"]
    metrics = {m["type"]: m for m in autoscaler["spec"]["metrics"]}
    assert metrics["Resource"]["resource"]["name"] == "cpu"
    assert serving["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"]  # needed by it
    rate_metric = metrics["Pods"]["pods"]["metric"]["name"]
    rules = yaml.safe_load(_one(documents, "ConfigMap", "recloop-prometheus-adapter-rules")["data"]["config.yaml"])
    rule = next(r for r in rules["rules"] if r["name"]["as"] == rate_metric)
    series = re.match(r"[a-z_]+", rule["seriesQuery"]).group(0)
    exported = {f"{family.name}_total" for family in ServingMetrics(Path("/nonexistent")).registry.collect()
                if family.type == "counter"}
    assert series in exported  # the adapter reads a counter the serving API really exports
    config = _one(documents, "ConfigMap", "recloop-config")["data"]
    secrets = _one(documents, "Secret", "recloop-secrets")["stringData"]
    assert config["RECLOOP_JOURNAL"] == "postgres" and secrets["RECLOOP_POSTGRES_DSN"].startswith("postgresql://")


def test_compose_runs_two_serving_replicas_behind_the_proxy():
    compose = yaml.safe_load((INFRA / "compose.yaml").read_text())
    services = compose["services"]
    replicas = sorted(name for name in services if re.fullmatch(r"serving-\d+", name))
    assert len(replicas) == 2 and all("recloop serve" in services[r]["command"] for r in replicas)
    proxy = services["serving"]
    assert proxy["image"].startswith("nginx") and proxy["ports"] == ["8000:8000"]
    nginx = (INFRA / "nginx.conf").read_text()
    assert sorted(re.findall(r"server (serving-\d+):8000", nginx)) == replicas
    assert "http_503" in nginx  # a replica without a champion is skipped
    prometheus = yaml.safe_load((INFRA / "prometheus.yml").read_text())
    assert sorted(prometheus["scrape_configs"][0]["static_configs"][0]["targets"]) == [f"{r}:8000" for r in replicas]
    env = compose["x-recloop-env"]
    assert env["RECLOOP_JOURNAL"] == "postgres" and env["RECLOOP_POSTGRES_DSN"].startswith("postgresql://")
