"""The Prefect flows, the deployments file, the retrain trigger and the whole loop (`recloop demo`) under a
real Prefect server (``prefect_test_harness``), MLflow on SQLite, Feast on SQLite and an Evidently workspace."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from recloop import trigger
from recloop.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def prefect_server():
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


# --- the deployments file -----------------------------------------------------------------------------------


def test_prefect_yaml_entrypoints_import_and_schedules_parse():
    from prefect.client.schemas.objects import ConcurrencyLimitConfig
    from prefect.client.schemas.schedules import CronSchedule
    from prefect.events import DeploymentEventTrigger
    from prefect.flows import load_flow_from_entrypoint

    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    names = {d["name"] for d in spec["deployments"]}
    assert {"incremental-retrain", "full-retrain", "drift-monitor", "canary-check"} <= names
    cwd = os.getcwd()
    os.chdir(ROOT)  # entrypoints are relative to the project root, as for `prefect deploy`
    try:
        for deployment in spec["deployments"]:
            flow = load_flow_from_entrypoint(deployment["entrypoint"])
            flow.validate_parameters(deployment.get("parameters") or {})
            for schedule in deployment.get("schedules", []):
                CronSchedule(cron=schedule["cron"], timezone=schedule.get("timezone"))
            for raw in deployment.get("triggers", []):
                parsed = DeploymentEventTrigger(**{k: v for k, v in raw.items() if k != "type"})
                assert parsed.expect == {"recloop.retrain.requested"}
            if "concurrency_limit" in deployment:
                limit = ConcurrencyLimitConfig(**deployment["concurrency_limit"])
                assert limit.limit == 1 and limit.collision_strategy.value == "CANCEL_NEW"
            assert deployment["work_pool"]["name"] == "recloop-gpu"
    finally:
        os.chdir(cwd)
    by_name = {d["name"]: d for d in spec["deployments"]}
    assert by_name["incremental-retrain"]["schedules"][0]["cron"] == "5 * * * *"
    assert by_name["drift-monitor"]["schedules"][0]["cron"] == "*/30 * * * *"
    assert by_name["canary-check"]["schedules"][0]["cron"] == "*/10 * * * *"
    assert "triggers" in by_name["full-retrain"]


# --- the trigger: debounced, with a cool-down, never on broken data --------------------------------------------


@pytest.mark.parametrize(("decision", "last", "now", "retrain", "fragment"), [
    ("ok", None, 0, False, "nothing to do"),
    ("data_quality", None, 0, False, "no retrain on broken data"),
    ("drift", None, 0, True, "full retrain"),
    ("kpi_decay", None, 0, True, "full retrain"),
    ("drift", 0.0, 3600.0, False, "cool-down"),
    ("drift", 0.0, 7 * 3600.0, True, "full retrain"),
])
def test_should_retrain(decision, last, now, retrain, fragment):
    verdict = trigger.should_retrain(decision, last, now, trigger.TriggerConfig(cooldown_seconds=6 * 3600))
    assert verdict.retrain is retrain and fragment in verdict.reason
    assert verdict.alert is (decision in ("data_quality", "kpi_decay"))


def test_a_persistent_drift_requests_one_retrain_per_cool_down(tmp_path: Path):
    settings = Settings(home=tmp_path)
    config = trigger.TriggerConfig(cooldown_seconds=3600)
    asked = [trigger.decide_and_record(settings, "drift", ["x"], now=t * 600.0, config=config).retrain
             for t in range(13)]  # every 10 minutes for two hours
    assert asked == [True] + [False] * 5 + [True] + [False] * 5 + [True]
    assert len(trigger.history(settings)) == 3


# --- the flows under a real Prefect server --------------------------------------------------------------------


@pytest.fixture(scope="module")
def loop_home(tmp_path_factory, lake_factory):
    """Two simulated days with a sudden drift on the second, ingested later by the flows."""
    from recloop.simulate import WorldConfig, simulate

    root = tmp_path_factory.mktemp("flows")
    settings = Settings(home=root / "home", frame_backend="pandas")
    simulate(WorldConfig(seed=8, days=2, events_per_day=3000, drift="sudden", drift_day=1), settings.landing_dir)
    return settings


def test_flows_chain_and_the_drift_monitor_requests_exactly_one_retrain(prefect_server, loop_home, monkeypatch):
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    from recloop.demo import load_flows

    monkeypatch.setenv("RECLOOP_HOME", str(loop_home.home))
    monkeypatch.setenv("RECLOOP_FRAME_BACKEND", "pandas")
    flows = load_flows()
    gate_file = loop_home.home / "gate.yaml"
    gate_file.parent.mkdir(parents=True, exist_ok=True)
    gate_file.write_text("calibration_range: [0.5, 2.0]\nmin_auc: 0.5\n")
    first = flows["retrain_flow"](mode="full", reason="test", days=2, epochs=2, batch_size=256,
                                  validation_hours=6, gate_thresholds=str(gate_file))
    assert first["ingest"]["rows_landed"] == 6000 and first["features"]["rows"] == 6000
    assert first["gate"]["alias"] == "champion"
    version = first["train"]["mlflow"]["version"]
    outcomes = [flows["drift_flow"](hours=12, now=1_000.0 + 600 * i, cooldown_seconds=3600) for i in range(4)]
    decisions = {o["decision"] for o in outcomes}
    assert decisions <= {"drift", "ok"}
    assert [o["trigger"]["retrain"] for o in outcomes].count(True) <= 1
    assert sum(o["trigger"]["retrain"] for o in outcomes) == (1 if "drift" in decisions else 0)
    assert all("mlflow_run_id" in o for o in outcomes)
    assert all("prediction_drift_score" in o["figures"] for o in outcomes)  # the champion scored both windows
    assert all(o["served_features"]["drift_share"] >= 0 for o in outcomes)
    with get_client(sync_client=True) as client:
        tagged = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[
            f"model-version:{version}"])))
        assert {run.name for run in tagged} and len(tagged) >= 2  # train and gate runs name the version
        artifacts = client.read_artifacts()
        assert {"gate-report", "drift-summary"} <= {a.key for a in artifacts}


def test_the_demo_runs_every_stage_each_day(prefect_server, tmp_path: Path, monkeypatch):
    """Three cycles after the bootstrap day, a sudden drift on day 2: the whole loop, as `recloop demo` runs it."""
    from recloop.demo import DemoConfig, run_demo

    settings = Settings(home=tmp_path / "home", frame_backend="pandas")
    monkeypatch.setenv("RECLOOP_FRAME_BACKEND", "pandas")
    monkeypatch.setenv("RECLOOP_HOME", str(settings.home))
    summary = run_demo(settings, DemoConfig(days=4, events_per_day=4000, requests_per_day=120, rounds=3, seed=1,
                                            drift="sudden", drift_day=2))
    days = summary["days"]
    assert [d["day"] for d in days] == [0, 1, 2, 3]
    assert days[0]["gate"] == "passed → champion"
    for day in days[1:]:
        assert day["requests"] == 120 and day["events"] == 4000
        assert day["drift"] in ("ok", "drift", "kpi_decay", "data_quality")
        assert day["retrain"] in ("incremental", "full (drift)", "full (kpi_decay)")
        assert day["gate"] in ("refused", "passed → challenger", "passed → champion")
        assert day["vs_oracle"] is not None and day["online_ctr"]
    assert days[2]["drift"] == "drift" and days[2]["retrain"] == "full (drift)"
    assert summary["full_retrains"] == 1  # the drift persists on day 3: the cool-down holds
    decisions = [c for d in days for c in d["canary"]]
    assert any(c.split()[0] in ("step", "promote", "rollback") for c in decisions), decisions
    report = Path(summary["report"]).read_text()
    assert "plotly" in report and "served / oracle" in report
    from recloop.dashboards import project

    workspace, found = project(settings)
    assert len(workspace.list_runs(found.id)) >= 3  # a drift snapshot per monitoring run (and KPIs)
