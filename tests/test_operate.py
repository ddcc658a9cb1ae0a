"""Failing fast and clearly where an operator first looks: serving before any champion, `recloop up` on a
port someone else holds (issue #20). The unreachable-service cases are in test_endpoints and test_cli."""

from __future__ import annotations

import http.server
import os
import re
import threading
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from recloop.settings import Settings


def test_serving_on_a_fresh_home_answers_503_until_a_champion_exists(tmp_path: Path):
    from recloop.serve.app import create_app

    with TestClient(create_app(Settings(home=tmp_path / "home"))) as http_client:
        health = http_client.get("/healthz")
        assert health.status_code == 503 and not health.json()["ready"]
        assert any("no champion" in reason for reason in health.json()["reasons"]), health.json()
        answer = http_client.post("/rank", json={"user_id": 1, "item_ids": [1, 2]})
        assert answer.status_code == 503 and "no champion" in answer.json()["detail"]
        assert http_client.get("/metrics").status_code == 200  # alive, and scraped, while not ready


class _Anything(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the stdlib's name
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"someone else's server")

    def log_message(self, *args):
        pass


def test_up_does_not_call_someone_elses_server_on_its_port_up(tmp_path: Path):
    from recloop import services

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Anything)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        port = other.server_address[1]
        settings = Settings(home=tmp_path / "home")
        started = services.up(settings, timeout=10, services=(services.Service("mlflow", port, "/health"),))
    finally:
        other.shutdown()
        other.server_close()
    entry = started["mlflow"]
    assert entry["status"].startswith("failed: port") and "held by another process" in entry["status"], entry
    assert entry["pid"] is None and not (settings.home / "run" / "mlflow.pid").exists()  # nothing started


def test_the_command_loads_no_heavy_library_before_a_command_runs():
    """`recloop --help` and argument errors stay fast (measured: 2.2 s → 0.7 s on the 2-core machine): the
    commands import pandas, torch, MLflow or Prefect only when they run."""
    import subprocess
    import sys

    heavy = ("pandas", "torch", "pyarrow", "mlflow", "prefect", "numpy", "pandera")
    code = f"import sys, recloop.cli; print([m for m in {heavy!r} if m in sys.modules])"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]", loaded


def test_choices_are_enums_that_match_the_code():
    from recloop.cli import CanaryAction, Device, Drift, Mode
    from recloop.simulate import DRIFT_SCENARIOS

    assert tuple(Drift) == DRIFT_SCENARIOS
    assert {m.value for m in Mode} == {"full", "incremental"} and {d.value for d in Device} == {
        "auto",
        "cpu",
        "cuda",
    }
    assert {a.value for a in CanaryAction} == {"status", "step", "promote", "rollback", "start"}


def test_the_demo_table_fits_120_columns():
    import io

    from rich.console import Console

    from recloop.cli import DEMO_WIDTH, demo_table

    day = {
        "day": 12,
        "events": 1_000_000,
        "drift": "broken_column",
        "retrain": "full (kpi_decay)",
        "candidate_version": "123",
        "gate": "passed → challenger",
        "canary": ["step v123", "rollback v123"],
        "champion": "122",
        "online_ctr": {"122": 0.1234, "123": 0.1301},
        "vs_oracle": 0.91234,
        "baseline_vs_oracle": 0.81234,
    }
    out = io.StringIO()
    Console(file=out, width=DEMO_WIDTH, color_system=None).print(
        demo_table({"days": [day, {**day, "day": 13}]})
    )
    lines = out.getvalue().splitlines()
    assert DEMO_WIDTH == 120 and max(len(line) for line in lines) <= 120
    assert "v123 → challenger" in out.getvalue() and "broken_column" in out.getvalue()  # nothing cut


def test_libraries_deprecation_notices_stay_out_of_the_commands_output():
    """In a process of its own, as the command runs: Feast's ``simplefilter("once", ...)`` cannot bring them
    back, and a warning that is not a deprecation still shows."""
    import subprocess
    import sys

    code = """if True:
        import warnings
        from recloop.cli import base
        base.drop_deprecation_notices()
        warnings.simplefilter("once", DeprecationWarning)  # what importing Feast does
        warnings.warn("numpy.core is deprecated", DeprecationWarning, stacklevel=1)
        warnings.warn("old", FutureWarning, stacklevel=1)
        warnings.warn("a real problem", UserWarning, stacklevel=1)
    """
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr
    assert "a real problem" in err and "deprecated" not in err and "FutureWarning" not in err, err


def test_the_exclusive_lock_admits_one_holder_across_processes(tmp_path: Path):
    """``exclusive_lock`` (filelock): while this process holds it, another process cannot take it."""
    import subprocess
    import sys

    from recloop.locks import exclusive_lock

    lock = tmp_path / "lake" / "_ingest.lock"
    probe = (
        "import sys; from filelock import FileLock, Timeout\n"
        "try:\n    FileLock(sys.argv[1]).acquire(timeout=0.2)\nexcept Timeout:\n    sys.exit(7)\n"
    )
    with exclusive_lock(lock):
        held = subprocess.run([sys.executable, "-c", probe, str(lock)], check=False)
    free = subprocess.run([sys.executable, "-c", probe, str(lock)], check=False)
    assert (held.returncode, free.returncode) == (7, 0)


def test_the_demo_report_marks_each_day_once_rollbacks_included(tmp_path: Path):
    from recloop.canary.explain import decision_row
    from recloop.demo import DayRecord, DemoConfig, write_report

    records = [
        DayRecord(day=0, events=10, retrain="full (bootstrap)", gate="passed → champion", champion="1"),
        DayRecord(
            day=1,
            events=10,
            drift="drift",
            retrain="full (drift)",
            gate="passed → challenger",
            canary=["start v2"],
            champion="1",
            online_ctr={"1": 0.1},
        ),
        DayRecord(
            day=2,
            events=10,
            retrain="incremental",
            canary=["step v2 → 50%", "rollback v2: challenger <b>CTR</b> fell"],
            decisions=[{"day": 2, "model": "ranker", "version": "2", "champion": "1", **decision_row(
                1, "rollback", 0.0, {}, ["challenger <b>CTR</b> fell"])}],  # the reason, in the moves' table
            champion="1",
        ),
    ]
    summary = {"freshness_seconds": [1.0], "seconds": 3.0}
    page = write_report(
        Settings(home=tmp_path), records, summary, DemoConfig(days=3, drift_day=1)
    ).read_text()
    labels = re.findall(r'"text":"([^"]*)"', page)
    assert labels.count("drift\\u003cbr\\u003efull retrain (drift)") == 1  # day 1: one label for both events
    assert labels.count("rolled back v2") == 1 and labels.count("full retrain (bootstrap)") == 1
    assert "<b>CTR</b>" not in page and "&lt;b&gt;CTR&lt;/b&gt;" in page  # the template escapes what it shows
    assert "v1: 0.100" in page


def test_the_demo_report_says_why_each_model_moved_in_a_table(tmp_path: Path):
    """Day 2 of the review's demo promoted v2 while its online CTR (0.170) was below v1's (0.209), and the page
    never said why; its canary column was a run-on list of actions. The moves now have their own table (the
    interleaved evidence with its interval, the guardrails, the reasons), one line each in the day's cell, and
    a promotion against the raw CTR is explained in words."""
    import re

    from recloop.canary import CanaryConfig, CanaryState, VariantStats, decide
    from recloop.demo import DayRecord, DemoConfig, write_report
    from recloop.demo.loop import _decision
    from recloop.evidence.sequential import Difference

    config = CanaryConfig(steps=(0.5, 1.0), bake_seconds=0, min_requests=10, min_feedback=10, min_effect=0.3)
    champion = VariantStats(requests=300, p99_ms=5.0, impressions=2000, clicks=418)
    challenger = VariantStats(requests=300, p99_ms=6.0, impressions=2000, clicks=340)
    credit = Difference(estimate=0.12, variance=0.01, low=-0.08, high=0.35, units=240, method="interleaving")
    moves = []
    for share, evidence in ((0.5, credit), (1.0, credit)):
        decision = decide(champion, challenger, CanaryState(share, 0.0), config, now=10.0, evidence=evidence)
        moves.append({"action": decision.action, "share": decision.share, "challenger": "2", "champion": "1",
                      "decision": decision.to_dict()})
    bad = decide(champion, VariantStats(requests=300, errors=90, p99_ms=6.0), CanaryState(0.5, 0.0), config, 10.0)
    day = DayRecord(day=2, canary=["step v2 → 100%", "promote v2", "rollback retriever v3: error rate"],
                    online_ctr={"1": 0.209, "2": 0.170}, champion="2")
    day.decisions = [_decision(2, "", moves[0]), _decision(2, "", moves[1]),
                     _decision(2, "retriever ", {"action": "rollback", "share": 0.0, "challenger": "3",
                                                  "champion": "1", "decision": bad.to_dict()})]
    page = write_report(Settings(home=tmp_path), [DayRecord(day=0, champion="1"), day], {"freshness_seconds": [],
                        "seconds": 1.0}, DemoConfig(days=3, drift_day=1)).read_text()
    table = page[page.index('<table class="decisions">'):]
    table = table[:table.index("</table>")]
    rows = re.findall(r"<tr><td>2</td>.*?</tr>", table, flags=re.S)
    assert len(rows) == 3, table
    assert "promote" in rows[1] and "interleaving: +12.0% [-8.0%, +35.0%], 240 users" in rows[1]
    assert "0.209 / 0.170" in rows[1] and "non-inferior" in rows[1]
    assert "retriever" in rows[2] and "error rate 30.00%" in rows[2] and "rollback" in rows[2]
    assert "step v2 → 100%<br>promote v2<br>rollback retriever v3" in page  # one move a line, no reasons run on
    note = re.search(r'<p class="raw-ctr-note">(.*?)</p>', page, flags=re.S).group(1)
    assert "Day 2: v2 was promoted while its online CTR that day (0.170) was below v1&#39;s (0.209)" in note
    assert "interleaving: +12.0%" in note


def test_a_dead_journal_database_is_one_line_for_its_readers_and_no_outage_for_serving(tmp_path: Path):
    """Readers of the journal (the canary controller, the monitor) fail at once with one line naming the database;
    serving's journal opens without it (issue 41: `recloop serve` exited 3, so a replica restarted during the outage
    served nothing), says why, and refuses feedback until the database answers (tests/test_serve_faults.py serves
    through such an outage on the real PostgreSQL)."""
    import socket

    from recloop.endpoints import ServiceUnavailable
    from recloop.journal import JournalUnavailable, open_journal

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dsn = f"postgresql://recloop:s3cret@127.0.0.1:{probe.getsockname()[1]}/recloop"
    settings = Settings(home=tmp_path / "home", journal="postgres", postgres_dsn=dsn, service_retries=1,
                        connect_timeout_seconds=0.5)
    shown = dsn.replace("s3cret", "***")
    with pytest.raises(ServiceUnavailable, match=f"^PostgreSQL at {re.escape(shown)} is unreachable"):
        open_journal(settings)
    journal = open_journal(settings, connect_later=True)
    try:
        assert journal.degraded.startswith(f"PostgreSQL at {shown} unreachable since start-up"), journal.degraded
        assert "s3cret" not in journal.degraded
        with pytest.raises(JournalUnavailable, match=f"PostgreSQL at {re.escape(shown)} is unreachable"):
            journal.add_feedback("0" * 32, [1], [])
    finally:
        journal.close()


def test_up_does_not_take_a_reused_pid_for_its_service(tmp_path: Path):
    """A pid file left by a service that died names a pid another program has since: `up` reported the
    service "running" (its pid alive); now the pid must run the service's own command."""
    import subprocess
    import sys

    from recloop import services

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Anything)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        port = other.server_address[1]
        settings = Settings(home=tmp_path / "home")
        (settings.home / "run").mkdir(parents=True)
        (settings.home / "run" / "mlflow.pid").write_text(str(stranger.pid))
        started = services.up(settings, timeout=10, services=(services.Service("mlflow", port, "/health"),))
    finally:
        stranger.kill()
        stranger.wait(10)
        other.shutdown()
        other.server_close()
    entry = started["mlflow"]
    assert entry["status"] != "running" and entry["pid"] != stranger.pid, entry
    assert "held by another process" in entry["status"], entry


def test_down_leaves_a_process_that_reused_a_services_pid_alone(tmp_path: Path):
    """`down` with a pid file whose pid another program has since: it would have signalled that program's
    process group (and raised on the SIGKILL, leaving the other services running); now it is "not running"
    and the stranger lives on."""
    import subprocess
    import sys

    from recloop import services

    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        settings = Settings(home=tmp_path / "home")
        (settings.home / "run").mkdir(parents=True)
        (settings.home / "run" / "mlflow.pid").write_text(str(stranger.pid))
        assert services.down(settings) == {"mlflow": "was not running"}
        assert stranger.poll() is None and not (settings.home / "run" / "mlflow.pid").exists()
    finally:
        stranger.kill()
        stranger.wait(10)


def test_a_service_that_exited_unreaped_is_not_running(tmp_path: Path):
    """``down`` called by the process that ran ``up`` (the demo's test) stops children it never reaps: an exited
    one (a zombie) still takes signals, and ``down`` waited five seconds for each as if it were still running."""
    import signal
    import subprocess

    from polling import eventually

    from recloop import services

    child = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        assert services._alive(child.pid)
        os.killpg(child.pid, signal.SIGTERM)
        state = Path(f"/proc/{child.pid}/stat")
        eventually(lambda: state.read_text().rsplit(")", 1)[-1].split()[0] == "Z", 30, "the child never exited")
        assert not services._alive(child.pid)  # exited, not yet reaped: not running
    finally:
        child.kill()
        child.wait(10)
    assert not services._alive(child.pid)


def test_each_home_takes_its_own_ports_and_down_stops_what_up_started_on_them(tmp_path: Path, monkeypatch):
    """Two homes side by side: ports from the settings (``RECLOOP_UP_*_PORT``) or flags, kept in the pid file,
    so ``down`` stops the service on the port it was started on (it looked only at the fixed 5000, 4200...)."""
    import subprocess
    import sys

    from polling import eventually
    from typer.testing import CliRunner

    from recloop import services
    from recloop.cli import app

    monkeypatch.setenv("RECLOOP_UP_MLFLOW_PORT", "5123")
    settings = Settings(home=tmp_path / "home")
    ports = {s.name: s.port for s in services.services_for(settings, {"serving": 8123})}
    assert ports == {"prefect": 4200, "mlflow": 5123, "evidently": 8001, "serving": 8123}
    assert "--mlflow-port" in CliRunner().invoke(app, ["up", "--help"]).output
    program = tmp_path / "bin" / "mlflow"  # what `up` starts, as /proc shows it: the program, then its port
    program.parent.mkdir()
    program.write_text("import time\ntime.sleep(120)\n")
    service = subprocess.Popen([sys.executable, str(program), "ui", "--port", "5999"], start_new_session=True)
    try:
        # until the child has exec'd, /proc shows the test's own command line, not the program's
        eventually(lambda: str(program).encode() in Path(f"/proc/{service.pid}/cmdline").read_bytes(), 30,
                   "the stand-in never started")
        (settings.home / "run").mkdir(parents=True)
        (settings.home / "run" / "mlflow.pid").write_text(f"{service.pid} 5999")  # started with --mlflow-port 5999
        assert services.down(settings) == {"mlflow": "stopped"}
        assert service.wait(10) is not None
    finally:
        service.kill()
        service.wait(10)


def test_up_tells_the_prefect_ui_the_port_its_api_is_on():
    """On any port but 4200 the Prefect UI said "Can't connect to Server API at http://127.0.0.1:4200/api"."""
    from recloop import services

    env = services._service_env(services.Service("prefect", 4321, "/api/health"), "127.0.0.1")
    assert env["PREFECT_UI_API_URL"] == "http://127.0.0.1:4321/api"
    assert env["PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE"] == "200"  # as the temporary server's
    # MLflow's UI without its job runner (seven consumer processes), unless the user's environment asks for it
    mlflow = services.Service("mlflow", 5000, "/health")
    assert services._service_env(mlflow, "127.0.0.1") == {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "true")
        assert services._service_env(mlflow, "127.0.0.1") == {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "true"}
