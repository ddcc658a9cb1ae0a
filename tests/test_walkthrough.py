"""The README's "Your own event log" walkthrough, command by command as a new user types it, on a log spanning
twenty years with MovieLens' key names (``userId``/``movieId``): ingest → features → train → gate → promote →
a second model gated against the first over the users the spec names → retrain with no landing folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ratings_log import spec_for, write_log
from typer.testing import CliRunner

from recloop.cli import app

YEARS = 20
START_1999 = 915_148_800  # 1999-01-01T00:00:00Z

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # the walkthrough runs in the first test's setup


@pytest.fixture(scope="module")
def walked(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("walkthrough")
    spec_file = root / "my_events.yaml"
    spec_file.write_text(spec_for("userId", "movieId"))
    # A few ratings over twenty years, most in the last months (as a long-lived site's log looks).
    log = write_log(root / "my_log", events=60, users=150, items=600, weeks=YEARS * 52 - 20, seed=3, files=1,
                    keys=("userId", "movieId"), start=START_1999, name="early", id_prefix="e")
    write_log(log, events=3000, users=150, items=600, weeks=20, seed=4, keys=("userId", "movieId"),
              start=START_1999 + (YEARS * 52 - 20) * 7 * 86400)
    runner = CliRunner(env={"RECLOOP_HOME": str(root / "home")})
    out: dict = {}

    def run(name: str, *args: str, codes: tuple[int, ...] = (0,)) -> dict:
        result = runner.invoke(app, [*args, "--json"])
        assert result.exit_code in codes, (args, result.output)
        out[f"{name} exit"] = result.exit_code
        out[name] = json.loads(result.stdout)
        return out[name]

    run("ingest", "ingest", str(log), "--spec", str(spec_file))
    run("features", "features", "--no-materialize")
    run("train", "train", "--mode", "full", "--epochs", "1", "--batch-size", "256")
    run("promote", "promote", "1", "--why", "first model, by hand")
    # another seed: with early stopping a second run on the same rows and seed may keep the first run's weights
    # (its second epoch did worse on the held-aside rows), which is the same model and registers no version
    run("train-2", "train", "--mode", "full", "--epochs", "2", "--batch-size", "256", "--seed", "1")
    gate = run("gate", "gate", codes=(0, 4))  # 4: refused (the pairing is what this walkthrough judges)
    assert (gate["verdict"] == "refused") == (out["gate exit"] == 4), gate["verdict"]
    retrain = runner.invoke(app, ["retrain", "--json"])  # $RECLOOP_HOME/landing was never made
    out["retrain"] = (retrain.exit_code, retrain.stdout, retrain.stderr)
    return root, out


def test_the_log_lands_whole_and_features_span_twenty_years(walked):
    _, out = walked
    assert (out["ingest"]["rows_in"], out["ingest"]["rows_landed"], out["ingest"]["rows_quarantined"]) == (3060, 3060, 0)
    assert out["features"]["rows"] == 3060 and out["features"]["start"].startswith("1999")


def test_the_second_model_is_judged_against_the_first_over_the_spec_users(walked):
    _, out = walked
    assert out["promote"]["champion"] == "1"
    gate = out["gate"]
    paired = gate["figures"]["grouped_auc"]
    # With the user key named userId the gate paired "over 1 users" with the interval [-inf, inf].
    assert paired["users"] > 50, paired
    assert -1 < paired["low"] <= paired["high"] < 1, paired


def test_retrain_runs_without_a_landing_folder_and_says_what_happened_in_one_line(walked):
    root, out = walked
    code, stdout, stderr = out["retrain"]
    assert (root / "home" / "landing").is_dir()
    assert "Traceback" not in stdout + stderr and "ERROR" not in stderr, stderr
    assert code == 0, stdout + stderr
    assert json.loads(stdout)["ingest"]["rows_in"] == 0
