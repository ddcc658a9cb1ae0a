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


def test_demo_refuses_bad_options_clearly(runner: CliRunner):
    """The demo itself runs in tests/test_flows.py (under a Prefect test server); here: its argument checks."""
    too_short = runner.invoke(app, ["demo", "--days", "1"])
    assert too_short.exit_code == 2 and "--days" in too_short.output
    unknown = runner.invoke(app, ["demo", "--drift", "sideways"])
    assert unknown.exit_code == 2 and "sideways" in unknown.output


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
