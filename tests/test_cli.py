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
    # 24 hourly files and the world's _world.json, counted as ignored (every entry found is counted: issue 41)
    assert (summary["files"], summary["rows_in"], summary["rows_landed"]) == (25, 500, 500)
    assert (tmp_path / "home" / "lake" / "events" / "date=2026-01-01").is_dir()


def test_demo_refuses_bad_options_clearly(runner: CliRunner):
    """The demo itself runs in tests/test_demo.py (under a Prefect test server); here: its argument checks."""
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


def test_every_drift_check_leaves_a_snapshot_the_evidently_workspace_lists(runner: CliRunner, tmp_path: Path):
    """A check that decides "ok" leaves its snapshots in the workspace `recloop up` serves with `evidently
    ui` (it left none, and answered `evidently_snapshot: null`): the one the answer names among them."""
    from recloop.monitor import dashboards
    from recloop.settings import Settings

    out = tmp_path / "landing"
    assert runner.invoke(app, ["simulate", "--out", str(out), "--days", "3", "--events-per-day", "4000",
                               "--json"]).exit_code == 0
    assert runner.invoke(app, ["ingest", str(out), "--json"]).exit_code == 0
    result = runner.invoke(app, ["drift", "--hours", "24", "--reference-days", "1", "--json"])
    assert result.exit_code == 0, result.output
    check = json.loads(result.stdout)
    assert check["decision"] == "ok", check["reasons"]
    workspace, project = dashboards.project(Settings(home=tmp_path / "home"))
    listed = {str(run) for run in workspace.list_runs(project.id)}
    assert check["evidently_snapshot"] in listed and len(listed) == 2  # the drift report and the decision's figures


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["simulate", "--drift", "meteor"], "not one of"),
        (["simulate", "--start", "soon"], "not an ISO date"),
        (["ingest", "/no/such/folder"], "does not exist"),
        (["ingest", "--spec", "nope"], "unknown spec"),
        (["train", "--embedding-l2-choices", "0.1,lots"], "comma-separated numbers"),
        (["train", "--embedding-l2-choices", "-1"], "a penalty is a number of 0 or more"),
        (["train", "--id-dropout", "1.5"], "less than or equal to 1"),
        (["replay", "--data", ".", "--embedding-l2-choices", "nan"], "a penalty is a number of 0 or more"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(runner: CliRunner, args: list[str], message: str):
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert message in result.output


# --- the error boundary: one line, the right exit code, JSON whatever happens --------------------------


@pytest.fixture
def dead_mlflow(monkeypatch: pytest.MonkeyPatch):
    """MLflow's address is a port nothing listens on; MLflow's client variables are restored afterwards."""
    import os
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        uri = f"http://127.0.0.1:{probe.getsockname()[1]}"
    monkeypatch.setenv("RECLOOP_MLFLOW_TRACKING_URI", uri)
    names = [k for k in os.environ if k.startswith("MLFLOW_HTTP_REQUEST")]
    saved = {k: os.environ.pop(k) for k in names}
    yield uri
    for key in [k for k in os.environ if k.startswith("MLFLOW_HTTP_REQUEST")]:
        del os.environ[key]
    os.environ.update(saved)


@pytest.mark.timeout(60)
def test_a_dead_mlflow_is_one_line_naming_it_and_exit_3(runner: CliRunner, dead_mlflow: str):
    result = runner.invoke(app, ["promote", "1", "--json"])
    assert result.exit_code == 3, result.output
    payload = json.loads(result.stdout)
    assert payload["kind"] == "service_unavailable" and dead_mlflow in payload["error"]
    assert "Traceback" not in result.output
    assert [line for line in result.stderr.splitlines() if line.strip()] == [
        line for line in result.stderr.splitlines() if line.startswith("error: MLflow at")]


@pytest.mark.timeout(60)
def test_debug_lets_the_traceback_through(runner: CliRunner, dead_mlflow: str):
    from recloop.endpoints import ServiceUnavailable

    result = runner.invoke(app, ["--debug", "promote", "1"])
    assert result.exit_code == 3, result.output  # the traceback, and the exit code a script checks (it was 1)
    assert "Traceback" in result.stderr and ServiceUnavailable.__name__ in result.stderr


def test_an_unexpected_failure_is_one_line_and_json(runner: CliRunner, tmp_path: Path):
    landing = tmp_path / "landing"
    assert runner.invoke(app, ["simulate", "--out", str(landing), "--days", "1", "--events-per-day", "100",
                               "--json"]).exit_code == 0
    ledger = tmp_path / "home" / "lake" / "_ledger.sqlite"
    ledger.parent.mkdir(parents=True)
    ledger.write_bytes(b"this is not a SQLite database, it was overwritten " * 100)
    result = runner.invoke(app, ["ingest", str(landing), "--json"])
    assert result.exit_code == 1
    assert json.loads(result.stdout) == {"error": "DatabaseError: file is not a database", "kind": "DatabaseError"}
    assert "Traceback" not in result.output and "--debug" in result.stderr


def test_a_usage_error_under_json_is_json_too(runner: CliRunner):
    result = runner.invoke(app, ["ingest", "--spec", "nope", "--json"])
    assert result.exit_code == 2
    assert json.loads(result.stdout)["kind"] == "usage" and "unknown spec" in json.loads(result.stdout)["error"]
    parse_error = runner.invoke(app, ["ingest", "--days", "3", "--json"])
    assert parse_error.exit_code == 2 and "--days" in json.loads(parse_error.stdout)["error"]


def test_json_output_is_strict_json(capsys: pytest.CaptureFixture):
    import numpy as np

    from recloop.cli_boundary import emit_json

    emit_json({"auc": float("nan"), "ratio": np.float32(1.5), "scores": np.array([np.inf, -np.inf, 2.0]),
               "count": np.int64(3), "when": Path("/x")})
    line = capsys.readouterr().out
    assert json.loads(line, parse_constant=lambda name: pytest.fail(f"non-standard JSON constant {name}")) == {
        "auc": None, "ratio": 1.5, "scores": [None, None, 2.0], "count": 3, "when": "/x"}


def test_promoting_a_version_that_does_not_exist_is_one_clear_line(runner: CliRunner):
    result = runner.invoke(app, ["promote", "99"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == ["error: recloop-ranker has no version '99' (no version registered yet)"], lines  # no MLflow INFO


def test_ctrl_c_under_json_is_one_json_object(tmp_path: Path):
    """A command interrupted by Ctrl-C (SIGINT) says so in one line, and under --json in one JSON object,
    exit 130 (it printed click's "Aborted!" and no JSON, against the boundary's promise)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "RECLOOP_HOME": str(tmp_path / "home")}
    command = [sys.executable, "-m", "recloop.cli", "simulate", "--out", str(tmp_path / "landing"), "--days", "400",
               "--events-per-day", "1000000", "--json"]
    # SIGINT at its default, as a terminal's shell starts a command: an xdist worker ignores it, and a child
    # inherits that (Python then never raises KeyboardInterrupt: the command ran on to the timeout)
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # Interrupted inside the command, past its imports: its first hour's file is being written. (A signal
    # during the imports of a loaded machine's slow start lands before the command's boundary exists.)
    deadline = time.monotonic() + 120
    while not (tmp_path / "landing").exists() and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.1)
    try:
        assert (tmp_path / "landing").exists(), process.communicate()
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=60)
    finally:  # never left writing 400 days of a million events a day (a timed-out run filled the disk)
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 130, (stdout, stderr)
    assert json.loads(stdout) == {"error": "interrupted (Ctrl-C)", "kind": "interrupted"}
    assert "Traceback" not in stderr and "Aborted" not in stderr + stdout


def test_promote_and_rollback_take_the_retriever_by_model(runner: CliRunner, tmp_path: Path):
    """`recloop promote/rollback --model recloop-retriever` move the retriever's aliases, not the ranker's (a
    retriever refused on thin evidence could not be brought up by hand: /recommend stayed 503)."""
    from recloop import registry
    from recloop.settings import Settings

    settings = Settings()
    registry.configure(settings)
    source = tmp_path / "artifacts"
    source.mkdir()
    first = registry.register(settings, str(source), model_name=registry.RETRIEVER_NAME)
    second = registry.register(settings, str(source), model_name=registry.RETRIEVER_NAME)
    for version in (first, second):
        result = runner.invoke(app, ["promote", version, "--model", "recloop-retriever", "--json"])
        assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"champion": second, "challenger": None, "previous": first}
    assert registry.version_by_alias(settings, "champion") is None  # the ranker's aliases untouched
    back = runner.invoke(app, ["rollback", "--model", "recloop-retriever", "--json"])
    assert back.exit_code == 0, back.output
    assert registry.version_by_alias(settings, "champion", registry.RETRIEVER_NAME) == first
    wrong = runner.invoke(app, ["promote", "1", "--model", "recloop-nothing"])
    assert wrong.exit_code == 2 and "recloop-retriever" in wrong.output


def _versions(settings, tmp_path: Path, count: int) -> list[str]:
    """``count`` registered ranker versions (of an empty folder: the aliases are under test, not the model)."""
    from recloop import registry

    registry.configure(settings)
    source = tmp_path / "artifacts"
    source.mkdir(exist_ok=True)
    return [registry.register(settings, str(source)) for _ in range(count)]


def test_two_promotes_at_once_end_as_one_after_the_other(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Two promotes at the same moment each read the old champion: one version was lost (champion 2, previous 1,
    v3 nowhere) while both said they had won. Alias moves take a lock. Each alias write is slowed here so that,
    without the lock, the two always overlap."""
    import threading
    import time

    from recloop import registry
    from recloop.settings import Settings

    settings = Settings(home=tmp_path / "home")
    first, second, third = _versions(settings, tmp_path, 3)
    registry.promote(settings, first)
    set_alias = registry.set_alias

    def slow_set_alias(*args, **kwargs):
        time.sleep(0.5)  # between reading the champion and writing the aliases
        return set_alias(*args, **kwargs)

    monkeypatch.setattr(registry, "set_alias", slow_set_alias)
    errors: list[BaseException] = []

    def promote(version: str) -> None:
        try:
            registry.promote(settings, version)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=promote, args=(version,)) for version in (second, third)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    state = registry.aliases(settings)
    assert {state["champion"], state["previous"]} == {second, third}, state  # either order, nothing lost


def test_a_version_is_a_number_in_ascii_digits_and_01_is_1(runner: CliRunner, tmp_path: Path):
    """`promote 01` compared "01" with the champion "1": champion and previous became the same version and the
    real previous was lost; `promote ١` (an Arabic-Indic one) was v1, `promote ²` a Python error message."""
    from recloop import registry
    from recloop.settings import Settings

    settings = Settings()
    first, second = _versions(settings, tmp_path, 2)
    registry.promote(settings, second)
    registry.promote(settings, first)  # champion 1, previous 2
    again = runner.invoke(app, ["promote", "01", "--json"])
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout) == {"champion": first, "challenger": None, "previous": second}
    for odd in ("\u0661", "\u00b2", "v1", ""):
        refused = runner.invoke(app, ["promote", odd])
        assert refused.exit_code == 2 and "has no version" in refused.output, (odd, refused.output)


def test_promoting_the_challenger_by_hand_ends_its_canary_as_promoted(runner: CliRunner, tmp_path: Path):
    """`recloop promote N` of the challenger moved the aliases alone: its canary tag still said "running" at
    its last share. It goes through the canary's own decision now."""
    from recloop import registry
    from recloop.canary import CanaryConfig, controller
    from recloop.canary.tag import CanaryTag
    from recloop.settings import Settings

    settings = Settings()
    first, second = _versions(settings, tmp_path, 2)
    registry.promote(settings, first)
    controller.set_challenger(settings, second, who="test", why="a challenger")
    controller.start(settings, CanaryConfig())
    assert CanaryTag.from_tags(registry.version_info(settings, second).tags).state == "running"
    # the version the operator named, not whichever is challenger by then (a gate may have moved it)
    with pytest.raises(controller.NoCanary, match=f"v{first} is no longer the challenger"):
        controller.manual(settings, "promote", "by hand", expected=first)
    promoted = runner.invoke(app, ["promote", second, "--json"])
    assert promoted.exit_code == 0, promoted.output
    assert json.loads(promoted.stdout) == {"champion": second, "challenger": None, "previous": first}
    tag = CanaryTag.from_tags(registry.version_info(settings, second).tags)
    assert tag.state == "promoted" and "manual promote" in " ".join(tag.reasons), tag


def test_a_bad_setting_is_one_line_naming_its_variable_and_an_empty_home_is_refused(tmp_path: Path):
    """``RECLOOP_SERVE_THREADS=abc`` printed "1 validation error for Settings" (exit 1) on some commands and a
    four-line pydantic report on others; an empty ``RECLOOP_HOME`` was the working directory (a lake appeared
    wherever the command ran)."""
    import os
    import subprocess
    import sys

    def run(*args: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "recloop.cli", *args], capture_output=True, text=True,
                              env={**os.environ, "RECLOOP_HOME": str(tmp_path / "home"), **env}, cwd=tmp_path,
                              timeout=120)

    for command in (["ingest", str(tmp_path)], ["gate"], ["promote", "1"]):
        done = run(*command, RECLOOP_SERVE_THREADS="abc")
        assert done.returncode == 2 and done.stderr.count("\n") == 1, (command, done.stderr)
        assert "RECLOOP_SERVE_THREADS='abc': Input should be a valid integer" in done.stderr, done.stderr
    empty = run("ingest", str(tmp_path), RECLOOP_HOME="")
    assert empty.returncode == 2 and "RECLOOP_HOME='': is empty" in empty.stderr, empty.stderr
    assert not (tmp_path / "lake").exists()


def test_options_out_of_order_or_range_are_refused_by_name(runner: CliRunner, tmp_path: Path):
    """`features --start` after `--end` said "empty window" and exited 0; `simulate --seed -3` failed inside
    numpy ("expected non-negative integer", exit 1); a bad `drift --reference` date was reported as `--start`."""
    reversed_window = runner.invoke(app, ["features", "--start", "2026-01-02", "--end", "2026-01-01"])
    assert reversed_window.exit_code == 2 and "--start 2026-01-02 is not before --end 2026-01-01" in reversed_window.output
    seed = runner.invoke(app, ["simulate", "--seed", "-3", "--out", str(tmp_path / "w")])
    assert seed.exit_code == 2 and "--seed" in seed.output
    (tmp_path / "a-file").write_text("x")
    into_a_file = runner.invoke(app, ["simulate", "--out", str(tmp_path / "a-file"), "--days", "1"])
    assert into_a_file.exit_code == 2 and "is a file, not a folder" in into_a_file.output
    named = runner.invoke(app, ["drift", "--current", "2026-01-02..2026-01-03", "--reference", "x..2026-01-02"])
    assert named.exit_code == 2 and "--reference 'x' is not an ISO date" in named.output, named.output
    # a drift day past the last day wrote (or ran) a world with no drift in it, exit 0
    late = runner.invoke(app, ["simulate", "--days", "2", "--drift", "sudden", "--drift-day", "2",
                               "--out", str(tmp_path / "late")])
    assert late.exit_code == 2 and "--drift-day 2 is past the last simulated day (1" in late.output, late.output
    assert not (tmp_path / "late").exists()
    late_demo = runner.invoke(app, ["demo", "--days", "3", "--drift-day", "3"])
    assert late_demo.exit_code == 2 and "--drift-day 3 is past the last simulated day (2" in late_demo.output
