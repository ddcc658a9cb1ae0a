"""The Prefect flows, the deployments file and the retrain trigger under a
real Prefect server (``prefect_test_harness``), MLflow on SQLite, Feast on SQLite and an Evidently workspace
(the whole loop, ``recloop demo``, is tests/test_demo.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from recloop.monitor import MonitorDecision, TriggerConfig, should_retrain
from recloop.monitor.runner import request_retrain, retrain_requests
from recloop.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


# --- the deployments file -----------------------------------------------------------------------------------


def test_prefect_yaml_entrypoints_import_and_schedules_parse():
    from prefect.client.schemas.objects import ConcurrencyLimitConfig
    from prefect.client.schemas.schedules import CronSchedule
    from prefect.events import DeploymentEventTrigger
    from prefect.flows import load_flow_from_entrypoint

    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    names = {d["name"] for d in spec["deployments"]}
    assert {"incremental-retrain", "full-retrain", "drift-monitor", "canary-check"} <= names
    for deployment in spec["deployments"]:
        # Entrypoints are relative to the project root, as for `prefect deploy`.
        path, name = deployment["entrypoint"].split(":")
        flow = load_flow_from_entrypoint(f"{ROOT / path}:{name}")
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
    by_name = {d["name"]: d for d in spec["deployments"]}
    assert by_name["incremental-retrain"]["schedules"][0]["cron"] == "5 * * * *"
    assert by_name["drift-monitor"]["schedules"][0]["cron"] == "*/30 * * * *"
    assert by_name["canary-check"]["schedules"][0]["cron"] == "*/10 * * * *"
    assert by_name["retriever-canary-check"]["parameters"] == {"model_name": "recloop-retriever"}
    assert "triggers" in by_name["full-retrain"]
    # the retrain the monitor asks for reports its gate verdict back (the cool-down starts only after a pass)
    full = by_name["full-retrain"]["triggers"][0]["parameters"]
    assert full["monitor_request"] is True and full["mode"] == "full"
    load_flow_from_entrypoint(f"{ROOT / 'flows/retrain_flow.py'}:retrain_flow").validate_parameters(
        {k: v for k, v in full.items() if "{{" not in str(v)})


def test_every_flow_names_its_runs():
    """A flow without ``flow_run_name`` gets Prefect's random name (``retriever`` had one: "gentle-otter")."""
    import importlib

    from prefect import Flow

    for path in sorted((ROOT / "flows").glob("*_flow.py")):
        module = importlib.import_module(f"flows.{path.stem}")
        flows = [value for value in vars(module).values() if isinstance(value, Flow)]
        assert flows, path
        for found in flows:
            assert found.flow_run_name is not None, f"{path.name}: flow {found.name!r} has no run name"


# --- the trigger: debounced, with a cool-down, never on broken data --------------------------------------------


@pytest.mark.parametrize(("decision", "last", "now", "retrain", "fragment"), [
    ("ok", None, 0, False, "nothing to do"),
    ("data_quality", None, 0, False, "no retrain on broken data"),
    ("drift", None, 0, True, "full retrain"),
    ("kpi_decay", None, 0, True, "full retrain"),
    ("drift", 0.0, 3600.0, False, "cool-down"),
    ("drift", 0.0, 7 * 3600.0, True, "full retrain"),
    ("drift", 0.0, 4.5 * 3600.0, True, "has no outcome"),  # lost: its event or its run
])
def test_should_retrain(decision, last, now, retrain, fragment):
    found = MonitorDecision(decision, ("x",), 0.0, ())
    verdict = should_retrain(found, last, now, TriggerConfig(cooldown_seconds=6 * 3600))
    assert verdict.retrain is retrain and fragment in verdict.reason
    assert verdict.alert is (decision in ("data_quality", "kpi_decay"))


def test_a_persistent_drift_requests_one_retrain_per_cool_down(tmp_path: Path):
    settings = Settings(home=tmp_path)
    config = TriggerConfig(cooldown_seconds=3600)
    drift = MonitorDecision("drift", ("x",), 0.5, ("device",))
    asked = [request_retrain(settings, drift, now=t * 600.0, config=config).retrain
             for t in range(13)]  # every 10 minutes for two hours
    assert asked == [True] + [False] * 5 + [True] + [False] * 5 + [True]
    assert len(retrain_requests(settings)) == 3


def test_flow_runs_in_this_process_skip_heartbeats_unless_a_server_is_configured(monkeypatch):
    """``in_process_runs``: no heartbeat thread for runs against the embedded server (each run's end waited
    for its one-second sleep); with ``PREFECT_API_URL`` (a real server) Prefect's setting stays."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, get_current_settings, temporary_settings

    from recloop.flow_support import in_process_runs

    def heartbeat():
        return get_current_settings().flows.heartbeat_frequency

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: 60}):
        with in_process_runs():
            assert heartbeat() is None
        assert heartbeat() == 60  # only within the block
        monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")
        with in_process_runs():
            assert heartbeat() == 60


# --- the flows under a real Prefect server --------------------------------------------------------------------


@pytest.fixture(scope="module")
def loop_home(tmp_path_factory):
    """Two simulated days of a world with a sudden drift on the second; the flows land them day by day."""
    from recloop.simulate import WorldConfig, simulate

    root = tmp_path_factory.mktemp("flows")
    simulate(WorldConfig(seed=8, days=2, events_per_day=3000, drift="sudden", drift_day=1), root / "world")
    return Settings(home=root / "home", frame_backend="pandas")


def land(world: Path, settings: Settings, date: str) -> None:
    """One simulated day's files into the landing zone (as an upstream system would drop them)."""
    shutil.copytree(world / date, settings.landing_dir / date)


def test_flows_chain_and_the_drift_monitor_requests_exactly_one_retrain(prefect_server, loop_home, tmp_path,
                                                                         monkeypatch):
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    from flows.drift_flow import drift_flow
    from flows.retrain_flow import retrain_flow
    from recloop.flow_support import settings_parameter

    workdir = tmp_path / "cwd"
    workdir.mkdir()
    monkeypatch.chdir(workdir)  # nothing may be written where the process runs
    settings = settings_parameter(loop_home)
    gate_file = loop_home.home / "gate.yaml"
    gate_file.parent.mkdir(parents=True, exist_ok=True)
    # a two-epoch model on 3,000 rows: the loop's wiring is under test, not whether it beats the baselines
    gate_file.write_text("calibration_range: [0.5, 2.0]\nmin_auc: 0.5\nbaseline_auc_margin: null\n"
                         "baseline_logloss_margin: null\n")
    world = loop_home.home.parent / "world"
    land(world, loop_home, "2026-01-01")
    first = retrain_flow(mode="full", reason="test", days=1, epochs=2, batch_size=256, validation_hours=6,
                         gate_thresholds=str(gate_file), settings=settings)
    assert first["ingest"]["rows_landed"] == 3000 and first["features"]["rows"] == 3000
    assert first["gate"]["alias"] == "champion"
    retriever = first["retriever"]  # the same flow trained, registered and gated the retriever
    assert retriever["train"]["mode"] == "full" and retriever["train"]["mlflow"]["version"] == "1"
    assert retriever["gate"]["alias"] == "champion", retriever["gate"]["reasons"]
    from recloop import registry

    assert registry.aliases(loop_home, registry.RETRIEVER_NAME)["champion"] == "1"
    version = first["train"]["mlflow"]["version"]
    land(world, loop_home, "2026-01-02")  # the drift day arrives, and is ingested and built by the hourly runs
    from flows.features_flow import features_flow
    from flows.ingest_flow import ingest_flow

    ingest_flow(settings=settings)
    features_flow(settings=settings)
    # two checks of the same drift: one request, then the cool-down (its length over many checks is
    # test_a_persistent_drift_requests_one_retrain_per_cool_down's)
    outcomes = [drift_flow(hours=12, now=1_000.0 + 600 * i, cooldown_seconds=3600, settings=settings)
                for i in range(2)]
    assert [o["decision"] for o in outcomes] == ["drift"] * 2, [o["reasons"] for o in outcomes]
    assert [o["trigger"]["retrain"] for o in outcomes] == [True, False]  # one, then cool-down
    assert "cool-down" in outcomes[1]["trigger"]["reason"]
    assert all(o["champion"] == version and o["mlflow_run_id"] for o in outcomes)
    assert all("prediction_drift_score" in o["figures"] for o in outcomes)  # the champion scored both windows
    assert all(o["served_features"]["drift_share"] >= 0 for o in outcomes)
    assert outcomes[0]["reference"][1] <= outcomes[0]["current"][0]  # the champion's days vs the new one
    with get_client(sync_client=True) as client:
        tagged = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[
            f"model-version:{version}"])))
        assert {run.name for run in tagged} and len(tagged) >= 2  # train and gate runs name the version
        artifacts = client.read_artifacts()
        assert {"gate-report", "drift-summary"} <= {a.key for a in artifacts}
    # The full-retrain deployment answers the request (its trigger sets monitor_request): a candidate the
    # gate refuses (this gate file asks for an impossible AUC) is recorded as refused, and the very next
    # check asks again instead of waiting out the cool-down.
    impossible = loop_home.home / "gate-impossible.yaml"
    impossible.write_text("min_auc: 0.999\n")
    refused = retrain_flow(mode="full", reason=outcomes[0]["trigger"]["reason"], days=1, epochs=1, batch_size=256,
                           validation_hours=6, gate_thresholds=str(impossible), retriever=False,
                           monitor_request=True, requested_at=3_000.0, settings=settings)
    assert not refused["gate"]["passed"]
    from recloop.monitor.runner import retrain_requests

    assert [(r["outcome"], r["outcome_at"]) for r in retrain_requests(loop_home)] == [("refused", 3_000.0)]
    again = drift_flow(hours=12, now=3_100.0, cooldown_seconds=3600, settings=settings)
    assert again["trigger"]["retrain"] and "refused by the gate" in again["trigger"]["reason"]
    assert list(workdir.iterdir()) == []


def test_run_names_say_the_simulated_day_and_are_unique_and_no_op_checks_are_marked(prefect_server, tmp_path):
    """A 3-day demo's 44 runs fell in one wall-clock hour and shared ten names; checks that moved nothing
    cluttered the list. Runs tagged ``day:N`` (as the demo tags each day's) are named for that day, two runs of
    one flow never share a name, and a canary check with nothing to judge ends ``NoCanary``, tagged ``no-op``."""
    import re

    from prefect import get_client, tags

    from flows.canary_flow import canary_flow
    from recloop.flow_support import SIMULATED_DAY_TAG, settings_parameter

    settings = settings_parameter(Settings(home=tmp_path / "home"))
    with tags(f"{SIMULATED_DAY_TAG}2"):
        states = [canary_flow(settings=settings, return_state=True) for _ in range(2)]
    plain = canary_flow(settings=settings, model_name="recloop-retriever", return_state=True)
    with get_client(sync_client=True) as client:
        runs = [client.read_flow_run(s.state_details.flow_run_id) for s in (*states, plain)]
    assert all(re.fullmatch(r"canary-check-day2-[0-9a-f]{6}", r.name) for r in runs[:2]), [r.name for r in runs]
    assert runs[0].name != runs[1].name
    assert re.fullmatch(r"retriever-canary-check-20\d\d-\d\d-\d\dT\d\d-[0-9a-f]{6}", runs[2].name), runs[2].name
    for state, run in zip((*states, plain), runs, strict=True):
        assert state.is_completed() and state.name == "NoCanary" and "no-op" in run.tags, (state, run.tags)
    assert states[0].result()["action"] == "none"  # calling the flow still returns its result


def test_a_runs_model_version_goes_into_its_name_before_when():
    from recloop.flow_support import with_version

    assert with_version("retrain-incremental-day2-3f9a1c", "7") == "retrain-incremental-v7-day2-3f9a1c"
    assert with_version("canary-check-2026-11-23T10-abc123", "3") == "canary-check-v3-2026-11-23T10-abc123"
    assert with_version("gate-v7-day2-3f9a1c", "7") == "gate-v7-day2-3f9a1c"  # already there: unchanged


def test_up_says_how_to_deploy_while_the_server_has_no_deployments(prefect_server):
    """After `recloop up` the Deployments page was empty and nothing said why: while the server has none, up
    prints how to deploy them (the checkout's prefect.yaml); once it has one, it says nothing."""
    from prefect import get_client
    from prefect.settings import get_current_settings

    from recloop import services

    api_url = get_current_settings().api.url
    with get_client(sync_client=True) as client:
        existing = services.deployment_count(api_url)
        assert existing == len(client.read_deployments())
        if existing == 0:  # this session's server: nothing deployed yet
            hint = services.deployments_hint(existing, api_url, services.checkout())
            assert f"export PREFECT_API_URL={api_url}" in hint and f"cd {ROOT} && prefect deploy --all" in hint
            flow_id = client.create_flow_from_name("recloop-hint-check")
            client.create_deployment(flow_id, name="hint-check")
    assert services.deployment_count(api_url) >= 1
    assert services.deployments_hint(services.deployment_count(api_url), api_url, ROOT) is None
    assert services.deployments_hint(None, api_url, ROOT) is None  # a server that does not answer: no claim
