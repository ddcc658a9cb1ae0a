"""What a team deploys: the compose file, the Kubernetes manifests, the Grafana dashboard and the work pool
template are valid and agree with the code (services, ports, metric names)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
INFRA = ROOT / "infra"
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
    command = ["docker", "compose", "-f", str(INFRA / "compose.yaml"), "config", "-q"]
    environment = {k: v for k, v in os.environ.items() if k != "RECLOOP_ADMIN_TOKEN"}
    refused = subprocess.run(command, capture_output=True, text=True, env=environment)
    assert refused.returncode != 0 and "RECLOOP_ADMIN_TOKEN" in refused.stderr  # no shipped token to fall back on
    subprocess.run(command, check=True, env={**environment, "RECLOOP_ADMIN_TOKEN": "a-secret-of-this-test"})


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


# --- the team setup starts as written (issue #20) ---------------------------------------------------------------

LONG_RUNNING = NEEDED | {"serving-1", "serving-2"}


def _compose() -> dict:
    return yaml.safe_load((INFRA / "compose.yaml").read_text())


def test_every_long_running_service_restarts_and_checks_its_own_health():
    services = _compose()["services"]
    for name in LONG_RUNNING:
        assert services[name].get("restart") == "unless-stopped", f"{name} has no restart policy"
    assert services["buckets"]["restart"] == "no"  # a one-shot job
    for name, service in services.items():  # a health check probes the service itself, not another one
        probe = " ".join(service["healthcheck"]["test"])
        for other in set(services) - {name}:
            assert f"//{other}:" not in probe, f"{name}'s health check probes {other}"
    worker = services["worker"]
    assert "--with-healthcheck" in worker["command"] and "localhost:8080/health" in " ".join(
        worker["healthcheck"]["test"])
    assert worker["build"]["dockerfile"] == "infra/Dockerfile.gpu"  # it trains: the CUDA image


def test_mlflow_artifacts_go_to_the_object_store_through_the_server():
    from recloop.registry import EXPERIMENT, artifact_location
    from recloop.settings import Settings

    compose = _compose()
    services, env = compose["services"], compose["x-recloop-env"]
    mlflow = services["mlflow"]
    assert "--serve-artifacts" in mlflow["command"] and "--artifacts-destination s3://mlflow" in mlflow["command"]
    assert mlflow["environment"]["MLFLOW_S3_ENDPOINT_URL"] == "http://minio:9000"
    assert "buckets" in mlflow["depends_on"]  # the bucket exists before the server writes to it
    for name, service in services.items():  # only the server holds the store's keys
        if name not in ("mlflow", "minio", "buckets"):
            environment = service.get("environment") or {}
            assert not any(key.startswith(("AWS_", "MLFLOW_S3")) for key in environment), name
    settings = Settings(home=Path("/data"), mlflow_tracking_uri=env["RECLOOP_MLFLOW_TRACKING_URI"],
                        mlflow_artifact_uri=env["RECLOOP_MLFLOW_ARTIFACT_URI"])
    for experiment in (EXPERIMENT, "recloop-canary"):
        location = artifact_location(settings, experiment, settings.mlflow_tracking_uri)
        assert location.startswith("mlflow-artifacts:/"), location  # proxied: never a path in one container
    assert artifact_location(Settings(home=Path("/data")), EXPERIMENT, "http://mlflow:5000") is None
    assert artifact_location(Settings(home=Path("/data")), EXPERIMENT, "sqlite:///x.db") == "file:///data/mlartifacts"
    k8s = _one(_documents(), "ConfigMap", "recloop-config")["data"]
    assert k8s["RECLOOP_MLFLOW_ARTIFACT_URI"].startswith("mlflow-artifacts:/")


def _exported_metrics() -> set[str]:
    from recloop.serve.metrics import ServingMetrics

    exported = set()
    for family in ServingMetrics(Path("/nonexistent")).registry.collect():
        exported.update({family.name, f"{family.name}_total"} if family.type == "counter" else {family.name})
        exported.update(sample.name for sample in family.samples)
    return exported


def test_alert_rules_cover_the_loop_and_read_exported_metrics():
    prometheus = yaml.safe_load((INFRA / "prometheus.yml").read_text())
    assert prometheus["rule_files"] == ["/etc/prometheus/alerts.yml"]
    mounts = _compose()["services"]["prometheus"]["volumes"]
    assert "./alerts.yml:/etc/prometheus/alerts.yml:ro" in mounts
    rules = [r for group in yaml.safe_load((INFRA / "alerts.yml").read_text())["groups"] for r in group["rules"]]
    names = {r["alert"] for r in rules}
    assert {"RecloopErrorRateHigh", "RecloopLatencyP99High", "RecloopCanaryRolledBack", "RecloopDriftDetected",
            "RecloopRetrainFailed"} <= names
    exported = _exported_metrics()
    for rule in rules:
        assert rule["labels"]["severity"] in ("page", "ticket") and rule["annotations"]["summary"], rule["alert"]
        used = set(re.findall(r"recloop_[a-z0-9_]+", rule["expr"]))
        assert used and {u.removesuffix("_bucket") for u in used} <= exported, (rule["alert"], used - exported)
        assert rule["expr"].lstrip().startswith(("sum", "max", "histogram_quantile")), rule["alert"]  # replicas


def test_loop_outcomes_reach_the_metrics_the_alerts_read(tmp_path):
    from recloop.flow_support import record_outcome
    from recloop.serve.metrics import ServingMetrics
    from recloop.settings import Settings

    settings = Settings(home=tmp_path)
    for stage, outcome in [("retrain", "failed"), ("retrain", "skipped"), ("retrain", "failed"),
                           ("canary", "rollback")]:
        record_outcome(settings, stage, outcome)
    registry = ServingMetrics(tmp_path).registry
    assert registry.get_sample_value("recloop_loop_outcomes_total", {"stage": "retrain", "outcome": "failed"}) == 2
    assert registry.get_sample_value("recloop_loop_outcomes_total", {"stage": "canary", "outcome": "rollback"}) == 1


def test_dashboard_panels_aggregate_over_the_replicas():
    dashboard = json.loads((INFRA / "grafana" / "dashboards" / "recloop.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expression = target["expr"].lstrip()
            assert expression.startswith(("sum", "max", "avg", "histogram_quantile")), (panel["title"], expression)
    ctr = next(p for p in dashboard["panels"] if p["title"].startswith("Online CTR"))["targets"][0]["expr"]
    assert "recloop_clicks_total" in ctr and "recloop_impressions_total" in ctr  # a ratio of sums, not a mean


def test_the_kubernetes_worker_can_start_and_runs_jobs_from_the_gpu_image():
    documents = _documents()
    worker = _one(documents, "Deployment", "prefect-worker")["spec"]["template"]["spec"]["containers"][0]
    assert "kubernetes" in worker["command"] and worker["livenessProbe"]["httpGet"] == {"path": "/health", "port": 8080}
    pyproject = (INFRA.parent / "pyproject.toml").read_text()
    assert re.search(r'kubernetes = \["prefect-kubernetes[^"]*"\]', pyproject)
    constraints = (INFRA.parent / "constraints.txt").read_text()
    assert re.search(r"^prefect-kubernetes==0\.8\.\d+$", constraints, re.M)  # resolves with prefect 3.8
    assert "'.[kubernetes]'" in (INFRA / "Dockerfile").read_text()
    gpu = (INFRA / "Dockerfile.gpu").read_text()
    assert "gpu" in gpu and "COPY flows flows" in gpu and "torch.version.cuda" in gpu
    template = json.loads((INFRA / "k8s" / "work-pool.json").read_text())
    assert "recloop-gpu" in template["variables"]["properties"]["image"]["default"]


def test_ci_installs_chromium_then_runs_the_readme_test_command_verbatim():
    """The browser tests must run in CI: `.ci/run` installs Debian's chromium (skipped where it is present)
    before the README's test command, which it runs unchanged."""
    readme = (ROOT / "README.md").read_text()
    command = readme.split("Run the tests:", 1)[1].split("```bash\n", 1)[1].split("\n", 1)[0]
    script = (ROOT / ".ci" / "run").read_text().splitlines()
    assert command in script, command
    install = next(i for i, line in enumerate(script) if "apt-get install" in line and "chromium" in line)
    guard = next(i for i, line in enumerate(script) if "/usr/bin/chromium" in line and line.lstrip().startswith("if"))
    assert guard < install < script.index(command)
