"""Operating the deployments: one slot for every run that trains or gates, an hourly retrain with nothing new
skipped, run names and outcomes a reviewer can read, and a pull step that finds the code where the run is.

Under a real Prefect server (``prefect_test_harness``); the retrain uses the session's champion."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from recloop.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
TRAINS_OR_GATES = {
    "flows/retrain_flow.py:retrain_flow",
    "flows/train_flow.py:train_flow",
    "flows/gate_flow.py:gate_flow",
}


def test_deployments_that_train_or_gate_share_one_slot_and_no_per_deployment_limit():
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    trainers = [d for d in spec["deployments"] if d["entrypoint"] in TRAINS_OR_GATES]
    assert {d["name"] for d in trainers} == {"incremental-retrain", "full-retrain", "train", "train-multi-gpu", "gate"}
    for deployment in trainers:  # a per-deployment limit would let the hourly and the full retrain overlap
        assert "concurrency_limit" not in deployment and "recloop-model" in deployment["tags"], deployment[
            "name"
        ]
    text = (ROOT / "prefect.yaml").read_text()
    assert "$PWD" not in text and "RECLOOP_CHECKOUT" not in text and "worker.yaml" not in text
    for path in __import__("re").findall(r"infra/[\w./-]+", text):  # every file a comment names exists
        assert (ROOT / path.rstrip(".")).exists(), path


def test_the_pull_step_finds_the_installed_code_at_run_time(monkeypatch, tmp_path):
    from prefect.deployments.steps.core import run_steps

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(
        "PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    )  # the worker's
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    asyncio.run(run_steps(spec["pull"]))
    for deployment in spec["deployments"]:
        assert (Path.cwd() / deployment["entrypoint"].split(":")[0]).is_file(), deployment["entrypoint"]


def _hold_slot(release: threading.Event, held: threading.Event, home: Path) -> threading.Thread:
    from recloop.flow_support import model_slot

    def hold():
        with model_slot(30, home):
            held.set()
            release.wait(30)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert held.wait(30)
    return thread


def test_one_run_at_a_time_trains_or_gates(prefect_server, tmp_path):
    """While another run holds ``recloop-model``, train, gate and retrain wait, then end Cancelled having
    done nothing; once it is free, the slot is taken at once."""
    from prefect import get_client

    from flows.gate_flow import gate_flow
    from flows.retrain_flow import retrain_flow
    from flows.train_flow import train_flow
    from recloop.flow_support import MODEL_SLOT, model_slot, settings_parameter

    settings = Settings(home=tmp_path / "home")
    parameters = settings_parameter(settings)
    release, held = threading.Event(), threading.Event()
    holder = _hold_slot(release, held, settings.home)
    try:
        states = [
            train_flow(mode="full", slot_timeout_seconds=1, settings=parameters, return_state=True),
            gate_flow(version="1", slot_timeout_seconds=1, settings=parameters, return_state=True),
            retrain_flow(mode="full", slot_timeout_seconds=1, settings=parameters, return_state=True),
        ]
    finally:
        release.set()
        holder.join(30)
    for state in states:
        assert state.is_cancelled(), state
        assert MODEL_SLOT in state.message and "nothing was done" in state.message
    assert not (settings.home / "lake").exists() and not (settings.home / "checkpoints").exists()
    with get_client(sync_client=True) as client:
        assert client.read_global_concurrency_limit_by_name(MODEL_SLOT).limit == 1
    # Released by the holder; nested in a run that holds it (the retrain's subflows), no wait for itself.
    with model_slot(5, settings.home), model_slot(0.5, settings.home):
        pass


def test_an_incremental_retrain_with_no_new_hours_is_skipped(
    prefect_server, champion_home, copy_home, tmp_path
):
    """The champion has trained on every hour but the held-out ones and nothing new landed: the hourly
    retrain ends ``Skipped`` with the reason, trains nothing and registers no version."""
    from prefect import get_client

    from flows.retrain_flow import retrain_flow
    from recloop import registry
    from recloop.flow_support import settings_parameter

    home = copy_home(champion_home, tmp_path / "home", feast=True)
    home.landing_dir.mkdir(parents=True, exist_ok=True)
    # The champion trained on all but the newest 12 of the first three days' hours; the retrain builds the
    # fourth day's features, and with 36 hours held out every hour it could train on is one it has seen.
    checkpoints = sorted(p.name for p in (home.home / "checkpoints").iterdir())
    state = retrain_flow(
        mode="incremental", validation_hours=36, settings=settings_parameter(home), return_state=True
    )
    assert state.is_completed() and state.name == "Skipped", state
    assert "no new hours" in state.message and "no version registered" in state.message
    result = state.result()
    assert result["pending"]["hours"] == 0 and "train" not in result and "gate" not in result
    assert registry.aliases(home)["champion"] == "1" and registry.version_info(home, "1")
    from mlflow import MlflowClient

    assert [
        str(v.version) for v in MlflowClient().search_model_versions(f"name='{registry.MODEL_NAME}'")
    ] == ["1"]
    assert sorted(p.name for p in (home.home / "checkpoints").iterdir()) == checkpoints
    outcomes = json.loads((home.home / "loop" / "outcomes.json").read_text())
    assert outcomes["retrain"] == {"skipped": 1}  # counted for recloop_loop_outcomes_total
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(state.state_details.flow_run_id)
        assert __import__("re").fullmatch(r"retrain-incremental-20\d\d-\d\d-\d\dT\d\d-[0-9a-f]{6}", run.name), run.name
        assert "retrain:skipped" in run.tags
        from prefect.logging.handlers import APILogHandler

        APILogHandler().flush()
        from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
        messages = [log.message for log in logs]
        assert any("Skipped: no new hours" in m for m in messages), messages


# A canary that moves only when told: nothing here serves traffic, and the retrain must leave it as it is.
QUICK_CANARY = {"steps": [0.05, 1.0], "bake_seconds": 0, "min_requests": 0, "min_feedback": 0, "holdout": 0.0,
                "mode": "canary"}


def _home_with_running_canaries(champion_home, copy_home, root: Path, started: float | None = None) -> Settings:
    """The shared champion (v1) with a challenger (v2, the same model) whose canary runs, and a retriever
    champion and challenger with a running canary of their own. The retriever's versions reuse the ranker's
    artifact: only their aliases and tags are read here (a waiting retriever loads nothing)."""
    from recloop import registry
    from recloop.canary import CanaryConfig, controller

    home = copy_home(champion_home, root / "home", feast=True)
    home.landing_dir.mkdir(parents=True, exist_ok=True)
    info = registry.version_info(home, "1")
    config = CanaryConfig(**{**QUICK_CANARY, "steps": tuple(QUICK_CANARY["steps"])})
    for model_name in (registry.MODEL_NAME, registry.RETRIEVER_NAME):
        if model_name == registry.RETRIEVER_NAME:
            registry.set_alias(home, "champion", registry.register(home, info.source, info.run_id,
                                                                   model_name=model_name), model_name=model_name)
        challenger = registry.register(home, info.source, info.run_id, model_name=model_name)
        registry.set_alias(home, "challenger", challenger, who="test", why="a canary in progress",
                           model_name=model_name)
        controller.start(home, config, now=time.time() if started is None else started, model_name=model_name)
        assert controller.running(home, model_name) == challenger
    return home


def _lenient_gate(root: Path) -> Path:
    """A gate thresholds file any trained candidate passes (for tests about what is trained and who waits)."""
    path = root / "gate.yaml"
    path.write_text("min_auc: 0.0\nmax_logloss_ratio: 100.0\nmin_rows: 1\ncalibration_range: [0.01, 100.0]\n"
                    "max_auc_drop_incremental: 1.0\nmax_slice_auc_drop: 1.0\nbaseline_auc_margin: null\n"
                    "baseline_logloss_margin: null\n")
    return path


def _versions(model_name: str) -> list[str]:
    from mlflow import MlflowClient

    return sorted(str(v.version) for v in MlflowClient().search_model_versions(f"name='{model_name}'"))


def test_a_scheduled_incremental_retrain_waits_for_the_running_canaries(
    prefect_server, champion_home, copy_home, tmp_path
):
    """New hours have landed, but each model's canary is still running: the hourly retrain builds the
    features and trains neither model, so neither challenger is replaced and its evidence keeps growing."""
    from prefect import get_client

    from flows.retrain_flow import retrain_flow
    from recloop import registry
    from recloop.canary.tag import CanaryTag
    from recloop.flow_support import settings_parameter

    home = _home_with_running_canaries(champion_home, copy_home, tmp_path)
    before = {name: (registry.aliases(home, name), _versions(name),
                     registry.version_info(home, registry.version_by_alias(home, "challenger", name), name).tags)
              for name in (registry.MODEL_NAME, registry.RETRIEVER_NAME)}
    # a chain long enough for a periodic full retrain (1 hour) waits for the canaries all the same
    state = retrain_flow(mode="incremental", reason="scheduled", full_every_hours=1, settings=settings_parameter(home),
                         return_state=True)
    assert state.is_completed() and state.name == "Skipped", state
    result = state.result()
    assert result["pending"]["hours"] > 0  # not the no-new-hours skip: there was something to train on
    assert result["mode"] == "incremental" and "periodic" not in result
    assert not (home.home / "loop" / "periodic_full.json").exists()  # nothing trained: no attempt recorded
    assert result["features"]["rows"] > 0 and "train" not in result and "gate" not in result
    assert result["waiting_for"]["version"] == "2" and result["waiting_for"]["share"] == 0.05
    assert "v2's canary is still running (share 5%)" in state.message and "waits for its decision" in state.message
    retriever = result["retriever"]  # the retriever's step ran, and waited for its own canary
    assert "gate" not in retriever and retriever["waiting_for"]["version"] == "2"
    assert "retriever: v2's canary is still running" in state.message
    for name, (aliases, versions, tags) in before.items():
        assert registry.aliases(home, name) == aliases and _versions(name) == versions, name
        challenger = registry.version_info(home, aliases["challenger"], name)
        assert CanaryTag.from_tags(challenger.tags) == CanaryTag.from_tags(tags), name  # the same experiment
    outcomes = json.loads((home.home / "loop" / "outcomes.json").read_text())
    assert outcomes["retrain"] == {"skipped": 1}
    with get_client(sync_client=True) as client:
        assert "retrain:skipped" in client.read_flow_run(state.state_details.flow_run_id).tags


def test_a_drift_retrain_supersedes_a_running_canary(prefect_server, champion_home, copy_home, tmp_path):
    """A drift retrain must not wait behind a challenger trained before the drift: it trains, and its
    candidate replaces the challenger whose canary was running."""
    from flows.retrain_flow import retrain_flow
    from recloop import registry
    from recloop.canary import controller
    from recloop.flow_support import settings_parameter

    home = _home_with_running_canaries(champion_home, copy_home, tmp_path)
    lenient = _lenient_gate(tmp_path)  # any trained candidate passes: this test is about who waits, not quality
    canary = tmp_path / "canary.json"
    canary.write_text(json.dumps(QUICK_CANARY))
    state = retrain_flow(mode="incremental", reason="drift", gate_thresholds=str(lenient), canary_config=str(canary),
                         retriever=False, settings=settings_parameter(home), return_state=True)
    assert state.is_completed() and state.name == "Challenger", state
    result = state.result()
    version = result["train"]["mlflow"]["version"]
    assert version == "3" and _versions(registry.MODEL_NAME) == ["1", "2", "3"]
    assert "waiting_for" not in result and result["gate"]["alias"] == "challenger"
    assert registry.aliases(home)["challenger"] == "3" and controller.running(home) == "3"  # a new canary


def test_a_scheduled_retrain_waits_no_longer_than_canary_wait_hours(champion_home, copy_home, tmp_path):
    """A canary no traffic reaches never decides: past ``canary_wait_hours`` the scheduled retrain stops
    waiting for it (and supersedes it)."""
    from flows.canary_flow import running_canary_task
    from recloop import registry
    from recloop.flow_support import settings_parameter

    home = _home_with_running_canaries(champion_home, copy_home, tmp_path, started=time.time() - 25 * 3600)
    settings = settings_parameter(home)
    for name in (registry.MODEL_NAME, registry.RETRIEVER_NAME):
        waiting = running_canary_task.fn(settings, name, max_wait_hours=48)
        assert waiting["version"] == "2" and 24.9 < waiting["hours"] < 25.2
        assert running_canary_task.fn(settings, name, max_wait_hours=24) is None



def test_a_scheduled_retrain_that_supersedes_a_canary_trains_from_the_champion_and_takes_over_the_monitors_hold(
    prefect_server, champion_home, copy_home, tmp_path
):
    """Past ``canary_wait_hours`` the scheduled run's candidate replaces the challenger. It starts from the champion
    over every hour the champion has not seen (on the loop's chain that beat continuing from the challenger, a
    drift's full retrain: benchmarks/RESULTS.md), and when the challenger was the drift monitor's retrain, the
    monitor's hold passes to it: before, the monitor asked for another full retrain once its cool-down ended,
    which replaced the model trained on the drifted days in turn."""
    from flows.retrain_flow import retrain_flow
    from recloop import registry
    from recloop.flow_support import settings_parameter
    from recloop.monitor import MonitorDecision
    from recloop.monitor.runner import record_retrain_outcome, request_retrain, retrain_requests

    home = _home_with_running_canaries(champion_home, copy_home, tmp_path, started=time.time() - 25 * 3600)
    # the challenger is the drift monitor's last retrain
    assert request_retrain(home, MonitorDecision("drift", ("country: drifted",), 0.4, ("country",)), now=0.0).retrain
    record_retrain_outcome(home, deployed=True, now=100.0, version="2")
    lenient = _lenient_gate(tmp_path)  # any trained candidate passes: this test is about what is trained and held
    state = retrain_flow(mode="incremental", reason="scheduled", canary_wait_hours=24, gate_thresholds=str(lenient),
                         retriever=False, settings=settings_parameter(home), return_state=True)
    assert state.is_completed() and state.name == "Challenger", state
    result = state.result()
    assert result["superseding"] == "2" and "waiting_for" not in result
    warm = Path(result["train"]["warm_start"])  # the champion's verified copy
    assert "v1" in warm.parts and "v2" not in warm.parts, warm
    assert result["train"]["mode"] == "incremental" and result["train"]["mlflow"]["version"] == "3"
    assert registry.aliases(home)["challenger"] == "3" and registry.aliases(home)["champion"] == "1"
    carried = retrain_requests(home)[-1]
    assert (carried["version"], carried["made"]) == ("3", "2"), carried


def test_a_scheduled_retrain_starts_over_from_scratch_when_the_champions_chain_is_long(
    prefect_server, champion_home, copy_home, tmp_path
):
    """The champion (a full retrain) plus the new day's hours make a chain longer than ``full_every_hours``:
    the scheduled retrain trains from scratch (reason ``periodic``), its checkpoint begins a new chain, and
    the attempt is remembered, so a second one within ``full_every_hours`` stays incremental."""
    from flows.retrain_flow import retrain_flow
    from recloop import checkpoint, pipeline, registry
    from recloop.flow_support import settings_parameter
    from recloop.hours import hour_after
    from recloop.train import TrainConfig, chain_origin

    home = copy_home(champion_home, tmp_path / "home", feast=True)
    home.landing_dir.mkdir(parents=True, exist_ok=True)
    lenient = _lenient_gate(tmp_path)  # any trained candidate passes: this test is about what is trained
    champion = checkpoint.read(checkpoint.resolve(home, "1"))
    assert chain_origin(champion) == champion["trained_until"]  # a full run begins its own chain
    # the features flow inside the retrain builds day four; its hours are what an incremental run would train on
    pipeline.build_features(home)
    pending = pipeline.pending_hours(home, TrainConfig())
    assert pending.chain_hours is not None and pending.chain_hours > 12
    state = retrain_flow(mode="incremental", reason="scheduled", full_every_hours=12, full_epochs=1, days=4,
                         gate_thresholds=str(lenient), retriever=False, settings=settings_parameter(home),
                         full_embedding_l2_choices=[1000.0], return_state=True)
    assert state.is_completed(), state
    result = state.result()
    assert result["mode"] == "full" and result["reason"] == "periodic"
    from prefect import get_client

    with get_client(sync_client=True) as client:
        tags = client.read_flow_run(state.state_details.flow_run_id).tags
    assert {"retrain:periodic", "mode:full"} <= set(tags), tags
    assert "chain of incremental runs spans" in result["periodic"] and "every 12 hours" in result["periodic"]
    version = result["train"]["mlflow"]["version"]
    state_of_new = checkpoint.read(checkpoint.resolve(home, version))
    assert state_of_new["train"]["mode"] == "full" and state_of_new["train"]["epochs"] == 1
    assert state_of_new["full_trained_until"] == state_of_new["trained_until"]
    assert state_of_new["train"]["days"] == 4
    # the full retrain tried the flow's embedding penalty beside the default and trained with the one it kept
    selection = result["train"]["selection"]
    assert set(selection["embedding_l2"]) == {"0.01", "1000"}, selection
    # (the default kept stays unset: the run no choosing would have made, its chain at the incremental default)
    assert state_of_new["train"]["embedding_l2"] == (None if selection["kept"] == 0.01 else selection["kept"])
    assert any(line.startswith(f"embedding_l2 {selection['kept']:g} ") for line in result["train"]["overrides"])
    # the attempt is remembered: within 12 hours of data, the policy says no more (even for the old champion)
    assert json.loads((home.home / "loop" / "periodic_full.json").read_text())["until"] == \
        hour_after(pending.hours[-1])
    assert pipeline.periodic_full_due(home, pending, 12) is None
    assert registry.aliases(home)["champion"] == "1"  # the new version went through the gate, not around it


def test_the_retriever_step_trains_in_the_runs_mode(tmp_path):
    """A scheduled run that became a periodic full retrain trains the retriever from scratch too: ``_finish``
    hands the retriever's step the run's mode as it ended, not as it was scheduled."""
    from flows.retrain_flow import _finish
    from recloop.flow_support import settings_parameter

    calls = []

    def step(spec: str, mode: str) -> dict:
        calls.append((spec, mode))
        return {"train": {"skipped": "nothing new"}}

    result = {"spec": "synthetic", "mode": "full", "reason": "periodic"}
    state = _finish(settings_parameter(Settings(home=tmp_path / "home")), "Refused", "v3 failed the gate", result,
                    step)
    assert calls == [("synthetic", "full")]
    assert "retriever: nothing new" in state.message


def test_retrain_wait_reports_a_run_that_did_not_complete_as_a_failure():
    """``recloop retrain --wait`` against a server: a flow run that failed, crashed or was cancelled is an
    error (exit 1, its state and message), not a result printed with exit 0; without --wait, any state is
    the answer (the run was started)."""
    from uuid import uuid4

    from prefect.client.schemas.objects import FlowRun
    from prefect.states import Cancelled, Completed, Crashed, Failed

    from recloop.cli import deployment_result
    from recloop.cli_boundary import FAILURE, UserError

    for state in (Failed(message="gate refused v9"), Crashed(), Cancelled()):
        run = FlowRun(id=uuid4(), flow_id=uuid4(), state=state)
        with pytest.raises(UserError, match=f"ended {state.name}") as raised:
            deployment_result("retrain/full-retrain", run, wait=True)
        assert raised.value.code == FAILURE
        assert deployment_result("retrain/full-retrain", run, wait=False)["state"] == state.name
    with pytest.raises(UserError, match="gate refused v9"):
        deployment_result("retrain/full-retrain", FlowRun(id=uuid4(), flow_id=uuid4(),
                                                          state=Failed(message="gate refused v9")), wait=True)
    done = FlowRun(id=uuid4(), flow_id=uuid4(), state=Completed())
    assert deployment_result("retrain/full-retrain", done, wait=True)["state"] == "Completed"


def test_without_a_server_the_slot_is_a_file_lock_a_killed_holder_gives_back(tmp_path):
    """The model slot is a lock file in RECLOOP_HOME (on a server, its limit too): while a process holds it,
    another waits (and gives up at its timeout); when the holder is killed (Ctrl-C, a crash, SIGKILL), the
    next takes it at once. The embedded server's concurrency limit stayed counted after such a stop, and
    every later training and gate waited for it in vain."""
    import signal
    import subprocess

    from recloop.flow_support import MODEL_SLOT_FILE, file_slot

    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), RECLOOP_HOME=str(tmp_path / "home"))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time\nfrom recloop.flow_support import model_slot\n"
         "with model_slot(30):\n    print('held', flush=True)\n    time.sleep(120)\n"],
        env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        lock = tmp_path / "home" / "run" / MODEL_SLOT_FILE
        assert lock.read_text().strip() == str(holder.pid)
        with pytest.raises(TimeoutError), file_slot(lock, 0.5):
            pass
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
        with file_slot(lock, 5):
            assert lock.read_text().strip() == str(os.getpid())
    finally:
        holder.kill()
        holder.wait(30)


def test_a_full_retrain_makes_the_same_passes_by_hand_here_or_on_a_server():
    """``recloop retrain --full`` without a server ran the flow's default of one pass, the ``full-retrain``
    deployment two: a full run now takes ``full_epochs`` unless told otherwise, and the deployment says the
    same."""
    import inspect

    from flows.retrain_flow import retrain_flow, run_epochs

    full_epochs = inspect.signature(retrain_flow.fn).parameters["full_epochs"].default
    assert run_epochs("full", None, full_epochs) == full_epochs == 2
    assert run_epochs("incremental", None, full_epochs) == 1 and run_epochs("full", 5, full_epochs) == 5
    deployments = {d["name"]: d for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]}
    assert deployments["full-retrain"]["parameters"].get("epochs", full_epochs) == full_epochs


@pytest.mark.timeout(900)  # two ranks start torch, recloop and MLflow each: minutes on 2 shared cores
def test_the_multi_gpu_deployment_trains_as_two_processes(prefect_server, champion_home, copy_home, tmp_path,
                                                           monkeypatch):
    """``train-multi-gpu``'s parameters (``nproc: 2``) run ``recloop train --nproc 2`` under torchrun from the
    flow: two ranks train (the checkpoint records two data shards), rank 0 registers the version, and the
    flow's result is the same report a one-process run returns."""
    from flows.train_flow import train_flow
    from recloop import checkpoint, registry
    from recloop.flow_support import settings_parameter

    deployment = next(d for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]
                      if d["name"] == "train-multi-gpu")
    assert deployment["parameters"]["nproc"] == deployment["job_variables"]["gpus"] == 2
    home = copy_home(champion_home, tmp_path / "home", frame_backend="pandas")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # two ranks on a small machine
    state = train_flow(**{**deployment["parameters"], "days": 2, "validation_hours": 8, "batch_size": 512},
                       settings=settings_parameter(home), return_state=True)
    assert state.is_completed(), state
    result = state.result()
    assert checkpoint.read(result["checkpoint"])["train"]["data_shards"] == 2
    assert result["mode"] == "full" and result["steps"] > 0 and 0.5 < result["auc"] <= 1.0
    version = result["mlflow"]["version"]
    assert version == "2" and registry.version_info(home, version)  # the champion is 1
