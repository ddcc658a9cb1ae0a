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


def test_kubernetes_manifests_parse_and_request_a_gpu():
    documents = [d for d in yaml.safe_load_all((INFRA / "k8s" / "recloop.yaml").read_text()) if d]
    kinds = {(d["kind"], d["metadata"]["name"]) for d in documents}
    assert {("Deployment", "serving"), ("Deployment", "prefect-worker"), ("Service", "serving"),
            ("ConfigMap", "recloop-config")} <= kinds
    serving = next(d for d in documents if d["kind"] == "Deployment" and d["metadata"]["name"] == "serving")
    assert serving["spec"]["replicas"] > 1
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
