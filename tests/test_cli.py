"""The recloop command: --json prints one parseable object on stdout; bad arguments exit 2 with a message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from recloop.cli import app


@pytest.fixture
def runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.setenv("RECLOOP_HOME", str(tmp_path / "home"))
    return CliRunner()


def test_simulate_then_ingest_with_json(runner: CliRunner, tmp_path: Path):
    out = tmp_path / "landing"
    simulated = runner.invoke(app, ["simulate", "--out", str(out), "--days", "1", "--events-per-day", "500",
                                    "--drift", "covariate", "--drift-day", "0", "--json"])
    assert simulated.exit_code == 0, simulated.output
    assert json.loads(simulated.stdout)["events"] == 500

    ingested = runner.invoke(app, ["ingest", str(out), "--json"])
    assert ingested.exit_code == 0, ingested.output
    summary = json.loads(ingested.stdout)
    assert (summary["files"], summary["rows_in"], summary["rows_landed"]) == (24, 500, 500)
    assert (tmp_path / "home" / "lake" / "events" / "date=2026-01-01").is_dir()


def test_demo_runs_simulate_ingest_and_features(runner: CliRunner):
    result = runner.invoke(app, ["demo", "--days", "1", "--events-per-day", "300", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["simulate"]["events"] == 300 and summary["ingest"]["rows_landed"] == 300
    assert summary["features"]["rows"] == 300 and summary["features"]["materialized"] == ["user_stats", "item_stats"]
    assert summary["train"]["samples"] > 0 and "checkpoint" in summary["train"]
    assert summary["train"]["mlflow"]["version"] == "1" and summary["gate"]["version"] == "1"
    assert isinstance(summary["gate"]["passed"], bool) and "reasons" in summary["gate"]
    again = json.loads(runner.invoke(app, ["demo", "--days", "1", "--events-per-day", "300", "--json"]).stdout)
    assert again["train"]["mlflow"]["version"] == "1"  # the same training run is not registered twice


def test_features_on_an_empty_lake_is_a_message_and_exit_0(runner: CliRunner):
    result = runner.invoke(app, ["features", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["rows"] == 0 and "no events" in json.loads(result.stdout)["message"]


def test_drift_reports_a_sudden_shift_as_json(runner: CliRunner, tmp_path: Path):
    out = tmp_path / "landing"
    assert runner.invoke(app, ["simulate", "--out", str(out), "--days", "4", "--events-per-day", "4000",
                               "--drift", "sudden", "--drift-day", "3", "--json"]).exit_code == 0
    assert runner.invoke(app, ["ingest", str(out), "--json"]).exit_code == 0
    result = runner.invoke(app, ["drift", "--hours", "24", "--reference-days", "2", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["decision"] == "drift" and "item_id" in summary["drifted_columns"]
    for key in ("reasons", "drift_share", "kpi", "reference", "current"):
        assert key in summary


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["simulate", "--drift", "meteor"], "not one of"),
        (["simulate", "--start", "soon"], "not an ISO date"),
        (["ingest", "/no/such/folder"], "does not exist"),
        (["ingest", "--spec", "nope"], "unknown spec"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(runner: CliRunner, args: list[str], message: str):
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert message in result.output
